"""Routed experts stored fused, as transformers 5 holds them in memory, read as the per-expert tensors of the Hub.

transformers' ``save_pretrained`` writes each expert's ``mlp.experts.{j}.gate_proj.weight`` / ``up_proj`` /
``down_proj`` (its conversion mapping splits what it holds fused), but some published folders (Qwen3.5's, and any
saved without that mapping) store the stacked tensors themselves:

    mlp.experts.gate_up_proj  [E, 2 I, H]   expert j's gate_proj is rows 0..I of slice j, its up_proj rows I..2I
    mlp.experts.down_proj     [E, H, I]     expert j's down_proj is slice j

The loader asks for the per-expert names; :func:`splitting` lists those as views of the fused tensors (memory-mapped:
reading expert ``j`` copies only its slice), so no family's name map changes and exports write the per-expert names
transformers saves and reads.
"""

import re

import numpy as np

from eqmoe.checkpoints.safetensors_io import SafetensorsFile

_FUSED = re.compile(r"^(?P<prefix>.*\.experts\.)gate_up_proj$")


class ExpertSlice:
    """One expert's matrix ``[rows, cols]`` inside a fused ``[E, ...]`` tensor: ``rows`` of slice ``expert``."""

    def __init__(self, file, key: str, expert: int, rows: slice):
        self.file, self.key, self.expert, self.rows = file, key, expert, rows
        self.path = file.path

    def shape(self, key: str) -> tuple[int, ...]:
        _, rows, cols = self.file.shape(self.key)
        return (len(range(*self.rows.indices(rows))), cols)

    def dtype(self, key: str) -> str:
        return self.file.dtype(self.key)

    def read(self, key: str) -> np.ndarray:
        return self.file.read(self.key)[self.expert, self.rows]


def splitting(files: dict[str, SafetensorsFile], expected: set[str]) -> dict:
    """``files`` with every fused ``*.experts.gate_up_proj`` / ``*.experts.down_proj`` pair whose per-expert names
    ``expected`` holds (and the files do not) listed as those per-expert tensors. A fused tensor the name map reads
    as it is (gpt-oss's, in its own layout) is left alone; a malformed pair is one ``ValueError`` naming the file."""
    tensors = dict(files)
    for key in list(files):
        match = _FUSED.match(key)
        if match is None or key in expected:
            continue
        prefix = match["prefix"]
        first = f"{prefix}0.gate_proj.weight"
        if first not in expected or first in files:
            continue
        down = prefix + "down_proj"
        if down not in files:
            raise ValueError(f"{files[key].path}: {key} has no {down} (fused experts need both)")
        up_shape, down_shape = files[key].shape(key), files[down].shape(down)
        if len(up_shape) != 3 or len(down_shape) != 3 or up_shape[1] % 2 or down_shape[0] != up_shape[0]:
            raise ValueError(
                f"{files[key].path}: {key} {list(up_shape)} and {down} {list(down_shape)} are not fused experts "
                "[E, 2 I, H] and [E, H, I]"
            )
        width = up_shape[1] // 2
        for j in range(up_shape[0]):
            expert = f"{prefix}{j}."
            tensors[expert + "gate_proj.weight"] = ExpertSlice(files[key], key, j, slice(0, width))
            tensors[expert + "up_proj.weight"] = ExpertSlice(files[key], key, j, slice(width, 2 * width))
            tensors[expert + "down_proj.weight"] = ExpertSlice(files[down], down, j, slice(None))
        del tensors[key], tensors[down]
    return tensors
