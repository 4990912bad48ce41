"""The routing analyses MoE papers publish, on any model and data.

    python -m experiments.analyze_routing --checkpoint runs/pretrain/checkpoints          # the built-in corpus
    python -m experiments.analyze_routing --hf path/to/Qwen3-30B-A3B --data notes.jsonl --tokens 65536 \\
        --dtype bfloat16 --trace parquet
    python -m experiments.analyze_routing --checkpoint runs/pretrain/checkpoints --json > routing.json

The model comes from ``--checkpoint`` (an eqmoe checkpoint, or a training run's ``checkpoints`` folder) or
``--hf`` (a Hugging Face folder). The data is ``--data`` (text files, one document each, or JSONL files of
``{"text", "domain"}``; every document is used) or, by default, the held-out split of the built-in
multi-domain corpus ``experiments.pretrain`` trains on (``eqmoe.data.corpus``). Documents are packed as
pretraining packs them and ``--tokens`` worth of rows, drawn in a seeded random order so every domain is
represented, are run through the model while :class:`eqmoe.analysis.routing_records.RoutingRecorder` records
every token's top-k experts and weights in every MoE layer.

The tokenizer is ``--tokenizer``, else the model folder's ``tokenizer.json`` or ``tiktoken.model``, else the one a
training run recorded, else eqmoe's byte tokenizer (what ``experiments.pretrain`` trains on by default).

Writes to ``--out-dir``: ``routing.json`` (every number below, NaN as null), ``load.png``, ``coactivation.png``,
``agreement.png``, ``vocabulary.png``, ``domains.png`` and with ``--trace`` ``trace.jsonl`` or
``trace.parquet`` (one row per token and MoE layer). Prints a short summary (``--json``: routing.json itself).
Any problem with the inputs is one line on stderr and exit code 2.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

import numpy as np
import tyro

from eqmoe.analysis import routing_maps as maps
from eqmoe.analysis.evaluate import plot_domain_routing
from eqmoe.analysis.routing import max_violation
from eqmoe.checkpoints.source import load_source, source_tokenizer
from eqmoe.data.corpus import EVAL_CHARS_PER_DOMAIN, load_documents, pack_documents, synthetic_documents
from eqmoe.data.packing import PackedRows
from eqmoe.data.tokenizer import check_tokenizer_fits
from eqmoe.model import Transformer
from eqmoe.train.logging import save_figure, write_json_atomic
from eqmoe.train.loop import OutputOptions
from experiments._cli import UsageError, guarded
from experiments.options import DtypeOption, JsonOptions, ModelSourceOptions, ShapeOptions, TokenizerOption


@dataclass(frozen=True)
class Args(ModelSourceOptions, TokenizerOption, ShapeOptions, DtypeOption, JsonOptions, OutputOptions):
    batch_size: int = 8

    data: tuple[Path, ...] = ()
    """Text files (one document each) or JSONL files of {"text", "domain"} (default: the built-in corpus)."""

    chars_per_domain: int = EVAL_CHARS_PER_DOMAIN
    """Built-in corpus: characters of each domain's held-out split to draw rows from."""

    tokens: int = 8192
    """Token budget: rows are taken until they hold at least this many real tokens (or the data runs out)."""

    out_dir: Path = Path("runs/routing")
    trace: Literal["jsonl", "parquet"] | None = None
    """Also write the router trace, one row per (token, MoE layer), as trace.jsonl or trace.parquet."""

    top_n: int = 10
    """Token ids listed per expert (and most frequent token ids listed)."""

    dead_threshold: float = 1e-3
    """An expert is dead in a layer when its share of assignments is below this fraction of the uniform 1/E."""

    show_experts: int = 4
    """Experts whose top token ids the summary prints (the most token-specialised of the last MoE layer)."""

    seed: int = 0
    """Seed of the row order (and of the built-in corpus)."""


# --- inputs ------------------------------------------------------------------------------------------------------


def _check(args: Args) -> None:
    for name in ("tokens", "batch_size", "top_n"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    if args.seq_len < 2:
        raise UsageError(f"--seq-len {args.seq_len}: must be at least 2")
    if args.chars_per_domain < 1:
        raise UsageError(f"--chars-per-domain {args.chars_per_domain}: must be at least 1")
    if not 0 <= args.dead_threshold <= 1:
        raise UsageError(f"--dead-threshold {args.dead_threshold}: must be in [0, 1]")


def packed_rows(args: Args, tokenizer) -> tuple[PackedRows, np.ndarray, tuple[str, ...], str]:
    """Rows holding about ``--tokens`` real tokens, in a seeded random order, with their domain labels."""
    if args.data:
        documents = load_documents(args.data)
        note = f"{len(documents)} documents from {len(args.data)} file(s)"
    else:
        documents = synthetic_documents("eval", args.chars_per_domain, args.seed)
        note = "the built-in corpus (held-out split)"
    packed = pack_documents(documents, tokenizer, args.seq_len)
    rows, labels = packed.packed.rows, packed.packed.labels
    order = np.random.default_rng(args.seed).permutation(len(rows.tokens))
    real = (rows.segment_ids[order] > 0).sum(1)
    count = int(np.searchsorted(np.cumsum(real), args.tokens) + 1)
    chosen = np.sort(order[:count])  # document order within the sample, for a readable trace
    return PackedRows(*(np.asarray(array)[chosen] for array in rows)), labels[chosen], packed.domains, note


def record(model: Transformer, rows: PackedRows, labels: np.ndarray, batch_size: int) -> maps.RoutingRecords:
    """Every real token's routing, ``batch_size`` rows at a time; the last batch is filled with padding rows
    (no real token) so every batch has one shape and compiles once."""
    recorder = maps.RoutingRecorder(model)
    parts = []
    for start in range(0, len(rows.tokens), batch_size):
        index = np.arange(start, start + batch_size)
        real = index < len(rows.tokens)
        index = np.minimum(index, len(rows.tokens) - 1)
        segment_ids = np.where(real[:, None], rows.segment_ids[index], 0)
        parts.append(
            recorder(
                rows.tokens[index],
                segment_ids=segment_ids,
                positions=rows.positions[index],
                token_mask=segment_ids > 0,
                domains=labels[index],
            )
        )
    return maps.concat_records(parts)


# --- the summary -------------------------------------------------------------------------------------------------


def _plain(value):
    """``value`` as JSON: arrays as lists, floats to 6 significant digits, NaN and infinities as null."""
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if isinstance(value, np.ndarray):
        return _plain(value.tolist())
    if isinstance(value, float | np.floating):
        return float(f"{value:.6g}") if math.isfinite(value) else None
    if isinstance(value, np.integer | np.bool_):
        return value.item()
    return value


def _text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([int(token_id)])


class Analyses(NamedTuple):
    load: maps.LoadReport
    coactivation: maps.CoActivation
    agreement: maps.LayerAgreement
    vocabulary: maps.VocabularySpecialisation
    domains: maps.DomainRouting


def analyze(records: maps.RoutingRecords, num_domains: int, args: Args) -> Analyses:
    return Analyses(
        maps.load_report(records, dead_threshold=args.dead_threshold),
        maps.coactivation(records),
        maps.cross_layer_agreement(records),
        maps.vocabulary_specialisation(records, args.top_n),
        maps.domain_routing(records, num_domains),
    )


def summarize(records: maps.RoutingRecords, results: Analyses, domains: tuple[str, ...], tokenizer, top_n: int) -> dict:
    """Every figure of ``results`` as one JSON-ready dict (the content of routing.json)."""
    load, pairs, agreement, vocabulary, by_domain = results
    layers = records.layers.tolist()
    frequent = np.argsort(-vocabulary.token_counts, kind="stable")[:top_n]
    summary = {
        "layers": layers,
        "num_experts": records.num_experts,
        "top_k": records.top_k,
        "tokens": records.num_tokens,
        "rows": int(len(np.unique(records.sequences))),
        "load": {
            "share": load.share,
            "percentiles": {f"p{level:g}": load.percentiles[:, i] for i, level in enumerate(load.levels)},
            "dead_threshold": load.dead_threshold,
            "dead_experts": [list(dead) for dead in load.dead],
            "max_vio": max_violation(load.share),
        },
        "coactivation": {
            "matrix": pairs.matrix,
            "conditional": pairs.conditional,
            "top_pairs": [[{"experts": [i, j], "fraction": f} for i, j, f in top] for top in pairs.top_pairs],
        },
        "agreement": [
            {
                "layers": [layers[pair], layers[pair + 1]],
                "nmi": agreement.nmi[pair],
                "top1_accuracy": agreement.accuracy[pair],
                "baseline": agreement.baseline[pair],
                "conditional": agreement.conditional[pair],
            }
            for pair in range(len(agreement.nmi))
        ],
        "vocabulary": {
            "top_n": vocabulary.top_tokens.shape[-1],
            "specialisation": vocabulary.specialisation,
            "experts": [
                [
                    {
                        "expert": expert,
                        "top_share": vocabulary.top_share[layer, expert],
                        "token_ids": [int(t) for t in vocabulary.top_tokens[layer, expert] if t >= 0],
                        "texts": [_text(tokenizer, t) for t in vocabulary.top_tokens[layer, expert] if t >= 0],
                        "counts": [int(c) for c in vocabulary.top_counts[layer, expert] if c > 0],
                    }
                    for expert in range(records.num_experts)
                ]
                for layer in range(len(layers))
            ],
            "frequent_tokens": [
                {
                    "token_id": vocabulary.token_ids[i],
                    "text": _text(tokenizer, vocabulary.token_ids[i]),
                    "count": vocabulary.token_counts[i],
                    "expert": vocabulary.token_expert[:, i],
                    "fraction": vocabulary.token_fraction[:, i],
                }
                for i in frequent
            ],
        },
        "domains": {
            "names": list(domains),
            "tokens": by_domain.tokens,
            "loss": by_domain.loss,
            "nmi": by_domain.nmi,
            "counts": by_domain.counts,
        },
    }
    return _plain(summary)


def write_outputs(
    records: maps.RoutingRecords, results: Analyses, domains: tuple[str, ...], summary: dict, args: Args
) -> dict:
    """The figures, the trace and routing.json in ``--out-dir``; ``summary`` with the names written."""
    out, layers = args.out_dir, records.layers.tolist()
    figures = {
        "load.png": maps.plot_load(results.load, layers),
        "coactivation.png": maps.plot_coactivation(results.coactivation, layers),
        "agreement.png": maps.plot_agreement(results.agreement, layers),
        "vocabulary.png": maps.plot_vocabulary(results.vocabulary, layers),
    }
    for name, figure in figures.items():
        save_figure(figure, out / name)
    names = list(figures)
    if domains:
        nmi = results.domains.nmi.tolist()
        plot_domain_routing(results.domains.counts.astype(np.float64), domains, out / "domains.png", nmi)
        names.append("domains.png")
    summary["figures"] = names
    if args.trace is not None:
        summary["trace"] = maps.write_trace(records, out / f"trace.{args.trace}", args.trace).name
    write_json_atomic(out / "routing.json", summary)
    return summary


def _share(value: float | None) -> str:
    return "  -  " if value is None else f"{value:.3f}"


def print_summary(summary: dict, args: Args) -> None:
    layers, load, agreement = summary["layers"], summary["load"], summary["agreement"]
    print(
        f"{len(layers)} MoE layers x {summary['num_experts']} experts (top-{summary['top_k']}); "
        f"{summary['tokens']:,} tokens in {summary['rows']} rows of {summary['source']}"
    )
    uniform = 1 / summary["num_experts"]
    print(f"layer  load p1 / p50 / p99 (1/E={uniform:.3f})  MaxVio  dead  top pair          next: NMI  top-1")
    for i, layer in enumerate(layers):
        levels = " / ".join(_share(load["percentiles"][name][i]) for name in ("p1", "p50", "p99"))
        dead = ",".join(map(str, load["dead_experts"][i])) or "-"
        top = summary["coactivation"]["top_pairs"][i]
        pair = f"{top[0]['experts'][0]}+{top[0]['experts'][1]} {top[0]['fraction']:.3f}" if top else "-"
        after = f"{_share(agreement[i]['nmi'])}  {_share(agreement[i]['top1_accuracy'])}" if i < len(agreement) else ""
        max_vio = _share(load["max_vio"][i])
        print(f"{layer:>5}  {levels:<31}  {max_vio:<6}  {dead:<4}  {pair:<16}  {after}")
    vocabulary = summary["vocabulary"]
    last = vocabulary["experts"][-1]
    shown = sorted(last, key=lambda e: -(e["top_share"] or 0))[: args.show_experts]
    chance = summary["top_k"] / summary["num_experts"]
    print(
        f"top token ids of the most specialised experts of layer {layers[-1]} "
        f"(token specialisation {_share(vocabulary['specialisation'][-1])}; without any: {chance:.3f}):"
    )
    for expert in shown:
        pairs = zip(expert["texts"][:6], expert["counts"][:6], strict=True)
        tokens = ", ".join(f"{text!r} {count}" for text, count in pairs)
        share = _share(expert["top_share"])
        print(f"  expert {expert['expert']:>3} ({share} in its top {vocabulary['top_n']}): {tokens}")
    domains = summary["domains"]
    if domains["names"]:
        losses = ", ".join(f"{n} {_share(loss)}" for n, loss in zip(domains["names"], domains["loss"], strict=True))
        nmi = " ".join(_share(value) for value in domains["nmi"])
        print(f"per-domain loss: {losses}; domain-expert NMI per layer: {nmi}")
    written = ["routing.json", *summary["figures"], *([summary["trace"]] if "trace" in summary else [])]
    print(f"wrote {args.out_dir}: {', '.join(written)}")


# --- the command ---------------------------------------------------------------------------------------------------


def run(args: Args) -> dict:
    _check(args)
    source = load_source(
        hf_folder=args.hf, checkpoint=args.checkpoint, step=args.step, base=args.base, dtype=args.dtype
    )
    model, folder = source.model, source.folder
    tokenizer = source_tokenizer(source, args.tokenizer, chat=False, bytes_if_none=True)
    check_tokenizer_fits(tokenizer.vocab_size, model.config.vocab_size)
    rows, labels, domains, note = packed_rows(args, tokenizer)
    records = record(model, rows, labels, args.batch_size)
    results = analyze(records, len(domains), args)
    summary = {"source": note, "model": str(folder), **summarize(records, results, domains, tokenizer, args.top_n)}
    return write_outputs(records, results, domains, summary, args)


def main(args: Args) -> int:
    summary = guarded("analyze_routing", run, args)
    if summary is None:
        return 2
    if args.json:
        print(json.dumps(summary, ensure_ascii=False))
    else:
        print_summary(summary, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(tyro.cli(Args)))
