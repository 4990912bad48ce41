"""eqmoe.data.records: every format's records and locations, every error, laziness, the size and the digest."""

import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eqmoe.data.records import Record, columns, content_digest, count_bytes, data_files, iter_records

CHATS = [
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], "id": 0},
    {"messages": [{"role": "system", "content": "be terse", "name": "sys"}, {"role": "user", "content": "2+2"}]},
]
# What a table gives back: one schema for all rows, so a key another row had is None.
CHATS_AS_TABLE = [
    {"messages": [{**m, "name": m.get("name")} for m in chat["messages"]], "id": chat.get("id")} for chat in CHATS
]


def read(path, **kwargs) -> list[Record]:
    return list(iter_records(path, **kwargs))


def error(path, **kwargs) -> str:
    with pytest.raises(ValueError) as caught:
        read(path, **kwargs)
    return str(caught.value)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def write_parquet(path: Path, rows: list[dict], **kwargs) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path, **kwargs)
    return path


def test_jsonl_bom_blank_lines_and_locations(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(CHATS[0]).encode() + b"\n\n  \n" + json.dumps(CHATS[1]).encode())
    got = read(path, field="messages")
    assert [r.record for r in got] == CHATS
    assert [r.where for r in got] == [f"{path}:1", f"{path}:4"]


def test_jsonl_errors_name_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(json.dumps(CHATS[0]).encode() + b"\n\n" + b'{"messages": [}\n')
    records = iter_records(path)
    assert next(records).where == f"{path}:1"  # lazy: the bad line 3 is not read yet
    with pytest.raises(ValueError, match=rf"^{path}:3: malformed JSON \(.* at column 15\)$"):
        next(records)
    path.write_bytes(b'{"a": 1}\n{"a": "\xff"}\n')
    assert error(path) == f"{path}:2: not valid UTF-8 (invalid start byte at byte 7)"
    write_jsonl(path, [{"a": 1}, [1, 2]])
    assert error(path) == f"{path}:2: expected a JSON object, got list"
    write_jsonl(path, [{"messages": []}, {"conversations": [], "id": 3}])
    assert error(path, field="messages") == f"{path}:2: no key 'messages' (keys: conversations, id)"


def test_jsonl_gz(tmp_path):
    path = tmp_path / "chats.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.writelines(json.dumps(chat) + "\n" for chat in CHATS)
    assert read(path) == [Record(CHATS[0], f"{path}:1"), Record(CHATS[1], f"{path}:2")]
    path.write_bytes(path.read_bytes()[:-12])  # truncated
    assert error(path).startswith(f"{path}:")
    assert "cannot read" in error(path)


def test_json_list_and_object(tmp_path):
    path = tmp_path / "list.json"
    path.write_text(json.dumps(CHATS, indent=2), encoding="utf-8-sig")
    assert read(path) == [Record(CHATS[0], f"{path}:row 0"), Record(CHATS[1], f"{path}:row 1")]
    assert error(path, field="id") == f"{path}:row 1: no key 'id' (keys: messages)"

    path = tmp_path / "object.json"
    path.write_text(json.dumps({"train": CHATS, "test": CHATS[:1], "version": 2}))
    assert [r.record for r in read(path, field="test")] == CHATS[:1]
    assert error(path) == (
        f"{path}: several lists (train, test) in the top-level object (keys: train, test, version); "
        "pass field to choose one"
    )
    assert error(path, field="data") == f"{path}: no key 'data' in the top-level object (keys: train, test, version)"
    assert error(path, field="version") == f"{path}: 'version' is a int, not a list of records"

    path.write_text(json.dumps({"data": CHATS, "version": 2}))  # the only list: no field needed
    assert [r.record for r in read(path)] == CHATS
    path.write_text(json.dumps({"data": [CHATS[0], "oops"]}))
    assert error(path) == f"{path}:row 1: expected a JSON object, got str"
    path.write_text('{"data": [1,')
    assert error(path).startswith(f"{path}:1: malformed JSON")

    lines = write_jsonl(tmp_path / "lines.json", CHATS)  # JSON Lines named .json, as on the Hub
    assert read(lines) == [Record(CHATS[0], f"{lines}:1"), Record(CHATS[1], f"{lines}:2")]


def test_parquet_file(tmp_path):
    path = write_parquet(tmp_path / "chats.parquet", CHATS)
    got = read(path, field="messages")
    assert got == [Record(CHATS_AS_TABLE[0], f"{path}:row 0"), Record(CHATS_AS_TABLE[1], f"{path}:row 1")]
    assert error(path, field="conversations") == f"{path}: no column 'conversations' (columns: messages, id)"
    assert columns(path) == ["messages", "id"]

    indexed = tmp_path / "indexed.parquet"  # pandas writes a non-range index as a column
    pq.write_table(pa.table({"text": ["a", "b"], "__index_level_0__": [7, 9]}), indexed)
    assert [r.record for r in read(indexed)] == [{"text": "a"}, {"text": "b"}]


def test_parquet_shards_and_splits(tmp_path):
    folder = tmp_path / "hub"
    rows = [{"text": f"row {i}"} for i in range(5)]
    first = write_parquet(folder / "data" / "train-00000-of-00002.parquet", rows[:3])
    second = write_parquet(folder / "data" / "train-00001-of-00002.parquet", rows[3:])
    test = write_parquet(folder / "data" / "test-00000-of-00001.parquet", [{"text": "t"}])
    (folder / "README.md").write_text("# card")
    (folder / ".cache").mkdir()
    write_parquet(folder / ".cache" / "train-junk.parquet", [{"text": "junk"}])

    got = read(folder, split="train")
    assert [r.record for r in got] == rows
    assert [r.where for r in got][2:4] == [f"{first}:row 2", f"{second}:row 0"]
    assert read(folder) == got  # train by default
    assert read(folder, split="test") == [Record({"text": "t"}, f"{test}:row 0")]
    assert error(folder, split="validation") == f"{folder}: no split 'validation' (splits: test, train)"

    test.unlink()  # a folder with one split needs no split
    assert read(folder) == got
    layout = tmp_path / "by_folder"  # train/*.parquet and validation/*.parquet
    write_parquet(layout / "validation" / "0000.parquet", rows[:1])
    write_parquet(layout / "test" / "0000.parquet", rows[1:2])
    assert [r.record for r in read(layout, split="validation")] == rows[:1]
    assert error(layout) == f"{layout}: several splits (test, validation); pass split to choose one"


def test_saved_dataset_and_dataset_dict(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{**chat, "id": i} for i, chat in enumerate(CHATS * 3)]
    dataset = datasets.Dataset.from_list(rows)
    folder = tmp_path / "saved"
    dataset.save_to_disk(folder, num_shards=2)
    got = read(folder, field="messages")
    assert [r.record["id"] for r in got] == list(range(6))
    assert [r.record["messages"] for r in got[:2]] == [c["messages"] for c in CHATS_AS_TABLE]
    assert [r.where for r in got][2:4] == [
        f"{folder}/data-00000-of-00002.arrow:row 2",
        f"{folder}/data-00001-of-00002.arrow:row 0",
    ]
    assert (
        error(folder, split="train")
        == f"{folder}: a saved Dataset, not a DatasetDict, has no splits (got split 'train')"
    )
    assert (
        error(folder, field="text") == f"{folder}/data-00000-of-00002.arrow: no column 'text' (columns: messages, id)"
    )

    both = tmp_path / "dict"
    datasets.DatasetDict({"train": dataset, "test": dataset.select([4]), "empty": dataset.select([])}).save_to_disk(
        both
    )
    train = read(both)  # train by default
    assert [r.record for r in train] == [r.record for r in got]
    assert [r.where for r in train] == [f"{both}/train/data-00000-of-00001.arrow:row {i}" for i in range(6)]
    assert [r.record["id"] for r in read(both, split="test")] == [4]
    assert read(both, split="test")[0].where == f"{both}/test/data-00000-of-00001.arrow:row 0"
    assert error(both, split="dev") == f"{both}: no split 'dev' (splits: empty, test, train)"
    assert error(both, split="empty") == f"{both}: split 'empty' has no rows"
    assert columns(both, split="test") == ["messages", "id"]
    with pytest.raises(ValueError, match=f"^{both}: split 'empty' has no rows$"):
        columns(both, split="empty")  # datasets saves an empty split without any data file

    no_train = tmp_path / "no_train"
    datasets.DatasetDict({"a": dataset, "b": dataset}).save_to_disk(no_train)
    assert error(no_train) == f"{no_train}: several splits (a, b); pass split to choose one"


def test_arrow_file_and_stream(tmp_path):
    table = pa.Table.from_pylist(CHATS)
    stream, file = tmp_path / "stream.arrow", tmp_path / "file.arrow"
    with pa.ipc.new_stream(stream, table.schema) as writer:
        writer.write_table(table, max_chunksize=1)
    with pa.ipc.new_file(file, table.schema) as writer:
        writer.write_table(table, max_chunksize=1)
    for path in (stream, file):
        assert read(path) == [Record(CHATS_AS_TABLE[0], f"{path}:row 0"), Record(CHATS_AS_TABLE[1], f"{path}:row 1")]
        assert columns(path) == ["messages", "id"]
        assert error(path, field="text") == f"{path}: no column 'text' (columns: messages, id)"


def test_errors(tmp_path):
    missing = tmp_path / "nope.jsonl"
    assert error(missing) == f"{missing}: not found (only local files and folders are read, nothing is downloaded)"
    csv = tmp_path / "data.csv"
    csv.write_text("a,b\n1,2\n")
    assert error(csv) == f"{csv}: unsupported file type '.csv' (supported: .jsonl, .jsonl.gz, .json, .parquet, .arrow)"
    script = tmp_path / "squad" / "squad.py"
    script.parent.mkdir()
    script.write_text("import datasets\n")
    write_jsonl(tmp_path / "squad" / "train.jsonl", CHATS)
    assert error(script) == f"{script}: a dataset loading script; no dataset loading scripts are run"
    assert error(script.parent) == (
        f"{script.parent}: holds a loading script (squad.py); no dataset loading scripts are run"
    )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert error(empty) == f"{empty}: no rows"
    empty_list = tmp_path / "empty.json"
    empty_list.write_text("[]")
    assert error(empty_list) == f"{empty_list}: no rows"
    assert error(empty, split="train") == f"{empty}: a single file has no splits (got split 'train')"
    nothing = tmp_path / "nothing"
    nothing.mkdir()
    (nothing / "README.md").write_text("hi")
    assert error(nothing) == f"{nothing}: no data files (.jsonl, .jsonl.gz, .json, .parquet, .arrow)"
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"not parquet at all")
    assert error(corrupt).startswith(f"{corrupt}: not a readable Parquet file (")
    assert "magic bytes" in error(corrupt)
    truncated = write_parquet(tmp_path / "truncated.parquet", CHATS)
    truncated.write_bytes(truncated.read_bytes()[:-30])
    assert error(truncated).startswith(f"{truncated}: not a readable Parquet file (")
    bad_arrow = tmp_path / "bad.arrow"
    bad_arrow.write_bytes(b"\x00" * 64)
    assert error(bad_arrow).startswith(f"{bad_arrow}: not a readable Arrow file (")
    with pytest.raises(ValueError, match="batch_rows must be at least 1"):
        read(empty, batch_rows=0)


def test_parquet_is_read_lazily(tmp_path, monkeypatch):
    path = write_parquet(tmp_path / "big.parquet", [{"id": i, "text": "x" * 20} for i in range(50_000)])
    pulled = []

    class Spy(pq.ParquetFile):
        def iter_batches(self, *args, **kwargs):
            for batch in super().iter_batches(*args, **kwargs):
                pulled.append(batch.num_rows)
                yield batch

    monkeypatch.setattr(pq, "ParquetFile", Spy)
    rows = iter_records(path, batch_rows=100)
    assert next(rows) == Record({"id": 0, "text": "x" * 20}, f"{path}:row 0")
    assert pulled == [100]
    rows.close()
    assert sum(1 for _ in iter_records(path, batch_rows=4096)) == 50_000
    assert max(pulled[1:]) <= 4096


def test_size_and_digest(tmp_path):
    folder = tmp_path / "a"
    first = write_parquet(folder / "train-00000-of-00002.parquet", CHATS)
    second = write_parquet(folder / "train-00001-of-00002.parquet", CHATS[:1])
    assert data_files(folder) == ([first, second], folder)
    assert count_bytes(folder) == first.stat().st_size + second.stat().st_size
    digest = content_digest(folder)
    assert len(digest) == 64
    copy = tmp_path / "elsewhere" / "b"
    shutil.copytree(folder, copy)
    assert content_digest(copy) == digest
    write_parquet(copy / "train-00001-of-00002.parquet", CHATS[1:])
    assert content_digest(copy) != digest
    (copy / "train-00001-of-00002.parquet").rename(copy / "train-00001-of-00003.parquet")
    assert content_digest(copy) != content_digest(folder)

    single = write_jsonl(tmp_path / "x.jsonl", CHATS)
    moved = tmp_path / "elsewhere" / "x.jsonl"
    shutil.copy(single, moved)
    assert content_digest(single) == content_digest(moved)
    moved.write_bytes(moved.read_bytes() + b"\n")
    assert content_digest(single) != content_digest(moved)


def test_datasets_is_not_imported():
    code = "import sys, eqmoe.data.records; assert 'datasets' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
