"""Raw records (dicts) from the local files users hold for fine-tuning, streamed, each with its location.

:func:`iter_records` yields ``Record(record, where)``. Formats, chosen by suffix or by what a folder holds:

* ``.jsonl`` / ``.jsonl.gz``: one JSON object per line, UTF-8 (a byte-order mark on line 1 is allowed),
  blank lines skipped, read line by line. ``where`` is ``path:LINE`` (1-based, as editors count).
* ``.json``: a list of objects, or an object holding such a list under ``field`` (without ``field``, the
  object's only list-valued key). The stdlib cannot stream JSON, so the file is loaded whole. A ``.json``
  file that is really JSON Lines (as on the Hugging Face Hub) is read as JSONL.
* ``.parquet``: read ``batch_rows`` rows at a time. ``.arrow``: an Arrow IPC file or stream (memory-mapped).
* A folder saved by ``datasets``: ``Dataset.save_to_disk`` (``state.json``; its ``_data_files`` are Arrow
  IPC *streams*, read in that order) or ``DatasetDict.save_to_disk`` (``dataset_dict.json``; one sub-folder
  per split). Nothing of ``datasets`` is imported, and a folder with a loading script (``*.py``) is refused.
* Any other folder: its ``.parquet``/``.arrow``/``.jsonl``/``.jsonl.gz``/``.json`` files, searched
  recursively (hidden entries and ``datasets`` metadata skipped). A file's split is the folder it sits in
  (unless that is ``data``), else its name without shard numbering: ``data/train-00000-of-00002.parquet``,
  ``train/0000.parquet`` and ``train.jsonl`` are all split ``train``.

For tables (Parquet, Arrow, a JSON list) ``where`` is ``path:row N`` with N the 0-based row of that file.
Every row is a record, a dict of its columns; nested lists of structs come back as lists of dicts. Arrow
struct columns have one schema for all rows, so a key that some rows lack comes back as ``None`` in
those rows: callers should treat ``None`` like a missing key. Pandas index columns are dropped.

``field`` (``--data-field``) names the list inside a JSON object, and otherwise the key every record
must have (a column of a table, checked on the schema before any row is read).

``split`` picks a split of a folder; without it, ``train`` when a folder has several splits, the only
split when it has one, and an error listing them otherwise. A single file or a saved ``Dataset`` has no
splits. Every error is a one-line ``ValueError`` naming the file and what is wrong.
"""

import gzip
import hashlib
import json
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".parquet", ".arrow")
_METADATA = {"state.json", "dataset_info.json", "dataset_infos.json", "dataset_dict.json"}
_SHARD = re.compile(r"[-_.]?\d*(-of-\d+)?$")  # "train-00000-of-00002" -> "train", "0000" -> ""
_PANDAS_INDEX = re.compile(r"__index_level_\d+__")


class Record(NamedTuple):
    """One record and where it came from: ``path:LINE`` (JSONL) or ``path:row N`` (tables, 0-based)."""

    record: dict[str, Any]
    where: str


def _suffix(path: Path) -> str:
    name = path.name.lower()
    return next((s for s in sorted(SUFFIXES, key=len, reverse=True) if name.endswith(s)), path.suffix.lower())


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes().decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None


def _split_of(file: Path, root: Path) -> str:
    parent = file.parent.relative_to(root)
    if parent.parts and parent.name != "data":
        return parent.name
    return _SHARD.sub("", file.name[: -len(_suffix(file))])


def _choose(root: Path, splits: list[str], split: str | None) -> str:
    if split is not None:
        if split not in splits:
            raise ValueError(f"{root}: no split {split!r} (splits: {', '.join(sorted(splits))})")
        return split
    if len(splits) == 1:
        return splits[0]
    if "train" in splits:
        return "train"
    raise ValueError(f"{root}: several splits ({', '.join(sorted(splits))}); pass split to choose one")


def _saved_dataset(folder: Path) -> list[Path]:
    state = _read_json(folder / "state.json")
    try:
        names = [entry["filename"] for entry in state["_data_files"]]
    except (KeyError, TypeError):
        raise ValueError(f"{folder / 'state.json'}: no '_data_files' list of {{'filename': ...}}") from None
    for name in names:
        if not (folder / name).is_file():
            raise ValueError(f"{folder}: state.json lists {name}, which is missing")
    return [folder / name for name in names]


def data_files(path: str | Path, split: str | None = None) -> tuple[list[Path], Path]:
    """The data files to read, in order, and the root their names are relative to (the folder, or the
    file's own folder). Raises the errors described in the module docstring."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: not found (only local files and folders are read, nothing is downloaded)")
    if path.is_file():
        if path.suffix == ".py":
            raise ValueError(f"{path}: a dataset loading script; no dataset loading scripts are run")
        if _suffix(path) not in SUFFIXES:
            raise ValueError(f"{path}: unsupported file type {_suffix(path)!r} (supported: {', '.join(SUFFIXES)})")
        if split is not None:
            raise ValueError(f"{path}: a single file has no splits (got split {split!r})")
        return [path], path.parent
    scripts = sorted(p.name for p in path.glob("*.py"))
    if scripts:
        raise ValueError(f"{path}: holds a loading script ({scripts[0]}); no dataset loading scripts are run")
    if (path / "dataset_dict.json").is_file():
        listed = _read_json(path / "dataset_dict.json")
        splits = listed.get("splits") if isinstance(listed, dict) else None
        if not isinstance(splits, list) or not splits:
            raise ValueError(f"{path / 'dataset_dict.json'}: no 'splits' list")
        chosen = _choose(path, [str(s) for s in splits], split)
        if not (path / chosen / "state.json").is_file():
            raise ValueError(f"{path}: split {chosen!r} has no saved dataset ({path / chosen / 'state.json'})")
        return _saved_dataset(path / chosen), path
    if (path / "state.json").is_file():
        if split is not None:
            raise ValueError(f"{path}: a saved Dataset, not a DatasetDict, has no splits (got split {split!r})")
        return _saved_dataset(path), path
    found = sorted(
        p
        for p in path.rglob("*")
        if p.is_file()
        and _suffix(p) in SUFFIXES
        and p.name not in _METADATA
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    if not found:
        raise ValueError(f"{path}: no data files ({', '.join(SUFFIXES)})")
    by_split: dict[str, list[Path]] = {}
    for file in found:
        by_split.setdefault(_split_of(file, path), []).append(file)
    return by_split[_choose(path, list(by_split), split)], path


def _jsonl(path: Path, field: str | None) -> Iterator[Record]:
    opener = gzip.open if _suffix(path) == ".jsonl.gz" else open
    number = 0
    try:
        with opener(path, "rb") as handle:
            for number, raw in enumerate(handle, start=1):
                where = f"{path}:{number}"
                if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                    raw = raw[3:]
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as error:
                    raise ValueError(f"{where}: not valid UTF-8 ({error.reason} at byte {error.start})") from None
                if not text.strip():
                    continue
                try:
                    record = json.loads(text)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{where}: malformed JSON ({error.msg} at column {error.colno})") from None
                yield Record(_check(record, field, where), where)
    except (OSError, EOFError, zlib.error) as error:  # a truncated or corrupt .gz
        raise ValueError(f"{path}:{number + 1}: cannot read ({error})") from None


def _check(record: object, field: str | None, where: str) -> dict[str, Any]:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if field is not None and field not in record:
        raise ValueError(f"{where}: no key {field!r} (keys: {', '.join(map(str, record))})")
    return record


def _json(path: Path, field: str | None) -> Iterator[Record]:
    try:
        data = json.loads(path.read_bytes().decode("utf-8-sig"))
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not valid UTF-8 ({error.reason} at byte {error.start})") from None
    except json.JSONDecodeError as error:
        if error.msg == "Extra data":  # JSON Lines in a .json file
            yield from _jsonl(path, field)
            return
        raise ValueError(f"{path}:{error.lineno}: malformed JSON ({error.msg} at column {error.colno})") from None
    if isinstance(data, dict):
        keys = ", ".join(data)
        lists = [key for key, value in data.items() if isinstance(value, list)]
        if field is None and len(lists) != 1:
            what = "no list of records" if not lists else f"several lists ({', '.join(lists)})"
            raise ValueError(f"{path}: {what} in the top-level object (keys: {keys}); pass field to choose one")
        key = field if field is not None else lists[0]
        if key not in data:
            raise ValueError(f"{path}: no key {key!r} in the top-level object (keys: {keys})")
        data, field = data[key], None
        if not isinstance(data, list):
            raise ValueError(f"{path}: {key!r} is a {type(data).__name__}, not a list of records")
    elif not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of objects or an object holding one, got {type(data).__name__}")
    for i, record in enumerate(data):
        where = f"{path}:row {i}"
        yield Record(_check(record, field, where), where)


def _columns_check(path: Path, schema: pa.Schema, field: str | None) -> list[str]:
    names = [name for name in schema.names if not _PANDAS_INDEX.fullmatch(name)]
    if field is not None and field not in names:
        raise ValueError(f"{path}: no column {field!r} (columns: {', '.join(names)})")
    return names


def _rows(path: Path, batches: Iterator[pa.RecordBatch], columns: list[str], batch_rows: int) -> Iterator[Record]:
    row = 0
    for batch in batches:
        batch = batch.select(columns)
        for start in range(0, batch.num_rows, batch_rows):
            for record in batch.slice(start, batch_rows).to_pylist():
                yield Record(record, f"{path}:row {row}")
                row += 1


def _parquet(path: Path, field: str | None, batch_rows: int) -> Iterator[Record]:
    try:
        with pq.ParquetFile(path) as parquet:
            columns = _columns_check(path, parquet.schema_arrow, field)
            yield from _rows(path, parquet.iter_batches(batch_size=batch_rows, columns=columns), columns, batch_rows)
    except (pa.ArrowException, OSError) as error:
        raise ValueError(f"{path}: not a readable Parquet file ({error})") from None


def _open_arrow(source: pa.MemoryMappedFile) -> pa.ipc.RecordBatchFileReader | pa.ipc.RecordBatchStreamReader:
    if source.read(6) == b"ARROW1":  # the IPC file format; datasets writes the stream format
        source.seek(0)
        return pa.ipc.open_file(source)
    source.seek(0)
    return pa.ipc.open_stream(source)


def _arrow(path: Path, field: str | None, batch_rows: int) -> Iterator[Record]:
    try:
        with pa.memory_map(str(path)) as source:
            reader = _open_arrow(source)
            columns = _columns_check(path, reader.schema, field)
            if isinstance(reader, pa.ipc.RecordBatchFileReader):
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            else:
                batches = iter(reader)
            yield from _rows(path, batches, columns, batch_rows)
    except (pa.ArrowException, OSError) as error:
        raise ValueError(f"{path}: not a readable Arrow file ({error})") from None


def iter_records(
    path: str | Path, *, field: str | None = None, split: str | None = None, batch_rows: int = 1024
) -> Iterator[Record]:
    """Every record of the file or folder at ``path``, lazily, with its location (see the module docstring).
    At most ``batch_rows`` table rows are converted to dicts at a time. No rows at all is an error."""
    if batch_rows < 1:
        raise ValueError(f"batch_rows must be at least 1, got {batch_rows}")
    files, _ = data_files(path, split)
    count = 0
    for file in files:
        suffix = _suffix(file)
        if suffix in (".jsonl", ".jsonl.gz"):
            records = _jsonl(file, field)
        elif suffix == ".json":
            records = _json(file, field)
        elif suffix == ".parquet":
            records = _parquet(file, field, batch_rows)
        else:
            records = _arrow(file, field, batch_rows)
        for record in records:
            count += 1
            yield record
    if not count:
        raise ValueError(f"{path}: split {split!r} has no rows" if split is not None else f"{path}: no rows")


def columns(path: str | Path, split: str | None = None) -> list[str]:
    """The columns of a table (of its first file), or the keys of the first record of JSON/JSONL."""
    files = data_files(path, split)[0]
    if not files:  # datasets saves an empty Dataset without data files
        raise ValueError(f"{path}: split {split!r} has no rows" if split is not None else f"{path}: no rows")
    file = files[0]
    suffix = _suffix(file)
    if suffix == ".parquet":
        try:
            return _columns_check(file, pq.read_schema(file), None)
        except (pa.ArrowException, OSError) as error:
            raise ValueError(f"{file}: not a readable Parquet file ({error})") from None
    if suffix == ".arrow":
        try:
            with pa.memory_map(str(file)) as source:
                return _columns_check(file, _open_arrow(source).schema, None)
        except (pa.ArrowException, OSError) as error:
            raise ValueError(f"{file}: not a readable Arrow file ({error})") from None
    return list(next(iter_records(path, split=split)).record)


def count_bytes(path: str | Path, split: str | None = None) -> int:
    """The total size in bytes of the data files read for ``path`` and ``split`` (for a progress bar)."""
    return sum(file.stat().st_size for file in data_files(path, split)[0])


def content_digest(path: str | Path, split: str | None = None) -> str:
    """A SHA-256 hex digest of the data files' names (relative to the folder, or the file's name) and
    bytes, read in 1 MiB chunks: the same for a copy elsewhere, different when any byte changes."""
    files, root = data_files(path, split)
    digest = hashlib.sha256(b"eqmoe.data.records 1\0")
    buffer = bytearray(1 << 20)
    view = memoryview(buffer)
    for file in files:
        digest.update(file.relative_to(root).as_posix().encode() + b"\0")
        digest.update(file.stat().st_size.to_bytes(8, "little"))
        with open(file, "rb", buffering=0) as handle:
            while size := handle.readinto(buffer):
                digest.update(view[:size])
    return digest.hexdigest()
