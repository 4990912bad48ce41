"""Tokenising a conversation file once: a streaming pass, cached by content hash, read back memory-mapped.

:func:`tokenize_file` reads the file's records in order (:mod:`eqmoe.data.formats`), renders and tokenizes
them in batches with the tokenizer's chat template (:func:`eqmoe.data.chat.encode_chats`) and appends the ids
and loss masks to flat files, so memory stays bounded by one batch whatever the file's size. The result is
kept in ``cache_dir/<key>/`` where the key hashes the data files' bytes, the tokenizer's ``tokenizer.json`` (or its
``tiktoken.model`` and the ``tokenizer_config.json`` beside it, which names its special tokens), the template and its
variables, the layout options and :data:`CACHE_VERSION`; a second run with the same inputs maps those files and
starts at once. Files are written under a temporary name and renamed.
"""

import hashlib
import json
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
from jaxtyping import Bool, Int32, Int64

from eqmoe.cache import cache_root
from eqmoe.data.chat import encode_chats
from eqmoe.data.formats import Item, read_conversations
from eqmoe.data.records import content_digest, count_bytes
from eqmoe.data.tokenizer import TIKTOKEN_FILE, Tokenizer

CACHE_VERSION = 2  # 2: assistant turns found by rendering the history as it continues (eqmoe.data.turns)
_BATCH = 256


def default_cache_dir() -> Path:
    """``$EQMOE_CACHE``, else ``$XDG_CACHE_HOME/eqmoe``, else ``~/.cache/eqmoe``; tokenised data in ``tokenized/``."""
    return cache_root() / "tokenized"


class TokenizedFile(NamedTuple):
    """Every conversation of a file with an assistant turn: ``ids[starts[i]:starts[i + 1]]`` and its mask."""

    ids: Int32[np.ndarray, "tokens"]
    loss_mask: Bool[np.ndarray, "tokens"]
    starts: Int64[np.ndarray, "conversations_plus_one"]
    layout: str
    skipped: int  # records without an assistant turn
    cached: bool  # read from the cache

    def __len__(self) -> int:
        return len(self.starts) - 1

    def conversation(self, i: int) -> tuple[Int32[np.ndarray, "n"], Bool[np.ndarray, "n"]]:
        start, stop = self.starts[i], self.starts[i + 1]
        return self.ids[start:stop], self.loss_mask[start:stop]

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return (self.conversation(i) for i in range(len(self)))


def _file_digest(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _tokenizer_identity(tokenizer: Tokenizer) -> str:
    """The digest of the tokenizer's file; a ``tiktoken.model``'s special tokens come from the
    ``tokenizer_config.json`` beside it, so that file's digest joins it (``-`` when there is none)."""
    path = getattr(tokenizer, "path", None)
    if path is None or not Path(path).is_file():
        return repr(tokenizer)
    path = Path(path)
    if path.name != TIKTOKEN_FILE:
        return _file_digest(path)
    config = path.parent / "tokenizer_config.json"
    return f"{_file_digest(path)}+{_file_digest(config) if config.is_file() else '-'}"


def cache_key(path: Path, tokenizer: Tokenizer, field: str | None, split: str | None) -> str:
    template = tokenizer.chat_template
    parts = {
        "version": CACHE_VERSION,
        "data": content_digest(path, split),
        "field": field,
        "tokenizer": _tokenizer_identity(tokenizer),
        "template": template.sources,
        "variables": template.variables,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _progress(path: Path):
    from tqdm import tqdm

    return tqdm(desc=f"tokenising {path.name}", unit=" conv", disable=None, file=sys.stderr, mininterval=1.0)


def _batches(items: Iterator[Item]) -> Iterator[list[Item]]:
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == _BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def _write(folder: Path, path: Path, tokenizer: Tokenizer, field: str | None, split: str | None) -> dict:
    data = read_conversations(path, field=field, split=split)
    skipped, count, tokens = 0, 0, 0
    with (
        open(folder / "ids.bin", "wb") as ids_file,
        open(folder / "mask.bin", "wb") as mask_file,
        open(folder / "starts.bin", "wb") as starts_file,
        _progress(path) as bar,
    ):
        starts_file.write(np.zeros(1, np.int64).tobytes())
        for batch in _batches(data.items):
            kept = [item for item in batch if item.conversation.has_reply]
            skipped += len(batch) - len(kept)
            encoded = encode_chats([i.conversation for i in kept], tokenizer, where=[i.where for i in kept])
            lengths = np.asarray([len(e.ids) for e in encoded], np.int64)
            if len(encoded):
                ids_file.write(np.concatenate([e.ids for e in encoded]).astype(np.int32).tobytes())
                mask_file.write(np.concatenate([e.loss_mask for e in encoded]).astype(np.bool_).tobytes())
                starts_file.write((tokens + np.cumsum(lengths)).tobytes())
            tokens += int(lengths.sum())
            count += len(encoded)
            bar.update(len(batch))
    if count == 0:
        why = f" ({skipped} without an assistant turn)" if skipped else ""
        raise ValueError(f"{path}: no conversation with an assistant turn{why}")
    return {"layout": data.layout, "skipped": skipped, "conversations": count, "tokens": tokens}


def _read(folder: Path, info: dict, cached: bool) -> TokenizedFile:
    def array(name, dtype):
        size = (folder / name).stat().st_size
        return np.memmap(folder / name, dtype, "r") if size else np.zeros(0, dtype)

    return TokenizedFile(
        array("ids.bin", np.int32),
        array("mask.bin", np.bool_),
        np.asarray(array("starts.bin", np.int64)),
        info["layout"],
        info["skipped"],
        cached,
    )


def tokenize_file(
    path: str | Path,
    tokenizer: Tokenizer,
    *,
    field: str | None = None,
    split: str | None = None,
    cache_dir: str | Path | None = None,
) -> TokenizedFile:
    """The tokenised conversations of a data file, from the cache when the same inputs were tokenised before.

    ``ValueError`` starting with the record's location (``file:line`` or ``file:row N``) for a record that
    cannot be read, checked or rendered; nothing is left in the cache then."""
    path = Path(path)
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = cache_dir / cache_key(path, tokenizer, field, split)
    info_file = folder / "info.json"
    if info_file.is_file():
        return _read(folder, json.loads(info_file.read_text()), cached=True)
    cache_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".tokenizing-", dir=cache_dir))
    try:
        info = _write(scratch, path, tokenizer, field, split)
        info["source"] = str(path.absolute())
        info["bytes"] = count_bytes(path, split)
        (scratch / "info.json").write_text(json.dumps(info))
        try:
            scratch.rename(folder)
        except OSError:  # another process finished the same key first
            shutil.rmtree(scratch, ignore_errors=True)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return _read(folder, info, cached=False)
