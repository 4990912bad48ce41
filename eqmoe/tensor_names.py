"""Where a checkpoint's tensors live in the model: the name maps of families and parts are lists of these."""

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class TensorName:
    """Where one checkpoint tensor lives in the eqmoe model.

    ``path`` names a leaf of the model (attribute names and tuple indices); ``index`` selects the slice
    of that leaf (repeat index, then expert index for stacked experts). ``linear_in_dims`` > 0 marks a
    torch ``[out, in]`` matrix: our slice has ``in`` dims first, so the tensor is transposed and reshaped.
    ``flat`` marks a vector the model holds with more axes (a ``[heads, head_dim]`` bias of a flat
    ``[heads * head_dim]`` projection). ``duplicate`` marks a second copy of a tensor another name already loads
    (DeepSeek-V3's multi-token-prediction layer repeats the embedding and the output head): exports write it, and
    loading checks it equals the first instead of reading it. ``columns`` ``(start, step)`` marks one of several
    leaves that share a tensor along its last axis: the leaf's slice is ``tensor[..., start::step]`` (gpt-oss's fused
    ``gate_up_proj``: the gate at columns ``0::2``, up at ``1::2``), and the tensor is written whole once every part
    of it is at hand. ``stored``: the slice's shape in the checkpoint when it differs from the leaf's only by a reshape
    (a ``[channels, kernel]`` convolution stored as torch's ``[channels, 1, kernel]``).
    """

    key: str
    path: tuple[str | int, ...]
    index: tuple[int, ...]
    linear_in_dims: int = 0
    flat: bool = False
    duplicate: bool = False
    columns: tuple[int, int] | None = None
    stored: tuple[int, ...] | None = None

    def checkpoint_shape(self, leaf_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The tensor's shape in the checkpoint (torch ``[out, in]`` for linear weights)."""
        piece = leaf_shape[len(self.index) :]
        if self.stored is not None:
            return self.stored
        if self.columns is not None:
            return (*piece[:-1], piece[-1] * self.columns[1])
        if self.flat:
            return (math.prod(piece),)
        if self.linear_in_dims:
            return (math.prod(piece[self.linear_in_dims :]), math.prod(piece[: self.linear_in_dims]))
        return piece


def linear_names(
    key: str, path: tuple, index: tuple[int, ...], in_dims: int = 1, bias: bool = False
) -> list[TensorName]:
    """A :class:`eqmoe.nn.linear.Linear` at ``path`` as a torch ``nn.Linear`` called ``key`` (``q_proj``):
    ``key.weight`` ``[out, in]`` and, with ``bias``, ``key.bias`` (flat)."""
    names = [TensorName(f"{key}.weight", (*path, "weight"), index, in_dims)]
    if bias:
        names.append(TensorName(f"{key}.bias", (*path, "bias"), index, flat=True))
    return names
