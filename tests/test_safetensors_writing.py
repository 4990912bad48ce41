"""Hugging Face folders are written one tensor at a time: host memory holds one tensor, not a shard, and the files
are the ones safetensors' own reader (and torch's) expects, scalars, empty tensors and bfloat16 included."""

import json
import tracemalloc

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file

from eqmoe.checkpoints.hf_write import write_folder

MIB = 2**20


def _tensors(count: int, size: int):
    for i in range(count):
        yield f"layers.{i}.weight", np.full(size // 4, i, np.float32)


def test_a_shard_is_written_holding_one_tensor_at_a_time(tmp_path):
    tracemalloc.start()
    try:
        write_folder(tmp_path / "out", {"model_type": "test"}, _tensors(16, 4 * MIB), 16, max_shard_size="1GB")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2.5 * 4 * MIB, f"peak {peak / MIB:.1f} MiB while writing a 64 MiB shard of 4 MiB tensors"
    loaded = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(loaded) == sorted(f"layers.{i}.weight" for i in range(16))
    for i in range(16):
        np.testing.assert_array_equal(loaded[f"layers.{i}.weight"], np.full(MIB, i, np.float32))


def test_shards_and_their_index_as_transformers_reads_them(tmp_path):
    tensors = {
        "scalar": np.array(7, np.int64),
        "empty": np.zeros((0, 3), np.float16),
        "transposed": np.arange(12, dtype=np.float32).reshape(3, 4).T,  # not contiguous as given
        "half": (np.arange(6) / 4).astype(ml_dtypes.bfloat16).reshape(2, 3),
        "big": np.ones((64, 64), np.float32),
    }
    write_folder(tmp_path / "out", {"model_type": "test"}, iter(tensors.items()), len(tensors), max_shard_size=10_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == 2 and index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    import torch
    from safetensors.torch import load_file as load_torch

    for name, file in index["weight_map"].items():
        got = load_torch(str(tmp_path / "out" / file))[name]
        want = tensors[name]
        assert tuple(got.shape) == want.shape, name
        np.testing.assert_array_equal(got.to(torch.float64).numpy(), want.astype(np.float64))
    expected = ["config.json", "model.safetensors.index.json", *files]  # nothing else: no scratch file left
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(expected)
