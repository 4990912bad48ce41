"""What the trainer will see of a data file: each conversation as rendered, the trained spans marked.

    python -m experiments.inspect_data --tokenizer DIR --data chats.parquet
    python -m experiments.inspect_data --tokenizer DIR --data chats.jsonl --chat-template my.jinja --limit 3
    python -m experiments.inspect_data --data sharegpt.json --json > tokens.jsonl
    python -m experiments.inspect_data --tokenizer openai/gpt-oss-20b --data chats.jsonl \\
        --template-var reasoning_effort=high

The human view prints the first ``--limit`` conversations with the trained text between ``[[`` and ``]]``
(highlighted in a terminal): every token of each reply after its generation prompt, up to its closing token, e.g.
gpt-oss's analysis, tool call and final answer with the channel headers between them. Then each conversation's
token counts, and over the whole file: the layout, the template and the ``--template-var`` values it rendered
with, how many conversations there are and how many have no assistant turn, token and trained-token totals, and
for ``--seq-len`` how many conversations are longer (truncated by sft) and how the rest pack into rows.

``--json`` prints one object per record, in input order: ``where`` (``file:line`` or ``file:row N``),
``ids``, ``loss_mask`` (0/1, as long as ``ids``) and ``trained`` (false for a record without an assistant
turn: its ids are shown, all untrained, and training skips it). Nothing is cached or written.
"""

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tyro

from eqmoe.data import encode_chats, pack, read_conversations
from experiments._cli import UsageError, guarded
from experiments.options import JsonOptions, SeqLenOption, TokenizerOptions

_BATCH = 256


@dataclass(frozen=True)
class Args(TokenizerOptions, SeqLenOption, JsonOptions):
    data: Path = Path()
    """The data file or folder (.jsonl, .json, .parquet, .arrow, a datasets folder)."""
    data_field: str | None = None
    """The field holding each record's messages (or, in a .json object, the list of records)."""
    split: str | None = None
    """The split of a datasets or Parquet folder."""
    limit: int = 5
    """Conversations to print in the human view (0: none, only the statistics)."""


def _marked(tokenizer, ids: np.ndarray, mask: np.ndarray, color: bool) -> str:
    open_, close = ("\x1b[1;32m", "\x1b[0m") if color else ("[[", "]]")
    pieces, start = [], 0
    for stop in [*np.flatnonzero(np.diff(mask.astype(np.int8))) + 1, len(ids)]:
        text = tokenizer.decode(ids[start:stop])
        pieces.append(open_ + text + close if mask[start] else text)
        start = stop
    return "".join(pieces)


def _records(args: Args, tokenizer):
    """``(where, ids, mask, trained)`` of every record, in order, tokenised in batches."""
    data = read_conversations(args.data, field=args.data_field, split=args.split)
    yield data.layout
    batch = []

    def flush():
        encoded = encode_chats([i.conversation for i in batch], tokenizer, where=[i.where for i in batch])
        for item, e in zip(batch, encoded, strict=True):
            yield item.where, e.ids, e.loss_mask, item.conversation.has_reply

    for item in data.items:
        batch.append(item)
        if len(batch) == _BATCH:
            yield from flush()
            batch = []
    yield from flush()


def run(args: Args) -> dict:
    if args.data == Path():
        raise UsageError("give --data FILE")
    if args.seq_len < 1 or args.limit < 0:
        raise UsageError("--seq-len must be at least 1 and --limit at least 0")
    tokenizer = args.load()
    records = _records(args, tokenizer)
    layout = next(records)
    color = sys.stdout.isatty()
    stats = {"layout": layout, "template": tokenizer.chat_template.origin, "template_vars": args.variables()}
    stats.update(conversations=0, no_assistant=0)
    stats.update(tokens=0, trained_tokens=0, longer_than_seq_len=0)
    lengths = []
    for where, ids, mask, trained in records:
        if args.json:
            record = {"where": where, "ids": ids.tolist(), "loss_mask": mask.astype(int).tolist(), "trained": trained}
            print(json.dumps(record))
        if not trained:
            stats["no_assistant"] += 1
            continue
        stats["conversations"] += 1
        stats["tokens"] += len(ids)
        stats["trained_tokens"] += int(mask.sum())
        stats["longer_than_seq_len"] += len(ids) > args.seq_len
        lengths.append(len(ids))
        if not args.json and stats["conversations"] <= args.limit:
            print(f"--- {where}: {len(ids)} tokens, {int(mask.sum())} trained")
            print(_marked(tokenizer, ids, mask, color))
    if lengths:
        dummy = [(np.zeros(n, np.int32), np.zeros(n, bool)) for n in lengths]
        packed = pack(dummy, args.seq_len, 0, overflow="truncate")
        stats.update(rows=len(packed.rows.tokens), fill=round(packed.fill, 4), seq_len=args.seq_len)
    return stats


def _variables(variables: dict) -> str:
    """`` with KEY=VALUE ...``: the --template-var values the template rendered with (values as JSON)."""
    return " with " + " ".join(f"{key}={json.dumps(value)}" for key, value in variables.items()) if variables else ""


def main(args: Args) -> int:
    stats = guarded("inspect_data", run, args)
    if stats is None:
        return 2
    if args.json:
        print(f"inspect_data: {json.dumps(stats)}", file=sys.stderr)
        return 0
    print(
        f"{args.data}: {stats['layout']} layout, template {stats['template']}{_variables(stats['template_vars'])}\n"
        f"  {stats['conversations']} conversations ({stats['no_assistant']} without an assistant turn, skipped)\n"
        f"  {stats['tokens']:,} tokens, {stats['trained_tokens']:,} trained "
        f"({stats['trained_tokens'] / max(stats['tokens'], 1):.1%})"
    )
    if "rows" in stats:
        print(
            f"  --seq-len {stats['seq_len']}: {stats['longer_than_seq_len']} longer (truncated), "
            f"{stats['rows']} packed rows, {stats['fill']:.1%} filled"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(tyro.cli(Args)))
