"""Block-FP8 checkpoints (DeepSeek-V3's published layout, transformers' "fine-grained FP8"), dequantized as read.

``config.json`` declares them with ``"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [b0, b1]}`` (and optionally ``"scale_fmt": "ue8m0"``). A
quantized linear weight ``X.weight`` (``[out, in]``) is stored as float8_e4m3fn values ``Q`` beside a companion
``X.weight_scale_inv`` ``S`` of shape ``[ceil(out / b0), ceil(in / b1)]``, one scale per ``b0 x b1`` block, the
blocks at the bottom and right edges partial where ``b0`` or ``b1`` does not divide the matrix:

    W[i, j] = float32(Q[i, j]) * S[i // b0, j // b1]

(``S`` is the inverse of the scale that quantized ``W``, hence its name; leading dimensions, as in stacked experts,
carry through). With ``scale_fmt`` "ue8m0" every scale is a power of two, stored as float32 or as one exponent
byte ``e`` (``F8_E8M0``, or ``U8`` as MXFP8 checkpoints write it) meaning ``2 ** (e - 127)``. Tensors without a
companion (norms, embeddings, router gates, biases) are stored unquantized and read as they are.

The product is formed in float32 one tensor at a time, as transformers dequantizes; the loader then casts it to
the parameter dtype, so a model is never held in float32 beyond one tensor. ``hf.load(..., keep_fp8=True)`` instead
keeps the values and scales as they are (:class:`eqmoe.nn.fp8.BlockFP8Weight`: the frozen base of a LoRA run held
at one byte per parameter), reading them through :meth:`DequantizedWeight.read_values` and ``read_scales``
(:func:`hold_fp8`).

``"quant_method": "mxfp4"`` (gpt-oss's published expert weights) is read by :mod:`eqmoe.checkpoints.mxfp4`, always
dequantized (:func:`hold_fp8` holds block-FP8 weights only). Any other ``quant_method`` (INT4 "compressed-tensors",
"bitsandbytes", ...) is refused: its bytes would load as garbage.
"""

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from eqmoe.checkpoints import mxfp4
from eqmoe.checkpoints.safetensors_io import SafetensorsFile
from eqmoe.nn.fp8 import FP8, BlockFP8Weight, grid
from eqmoe.nn.linear import Linear

SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv
SCALE_DTYPES = ("F32", "F64", "F16", "BF16", "F8_E8M0")  # plus U8 exponent bytes with scale_fmt "ue8m0"


@dataclasses.dataclass(frozen=True)
class BlockFP8:
    """A folder's block-FP8 quantization: the block of rows x columns one scale covers, and how scales are stored."""

    block: tuple[int, int]
    scale_fmt: str = "float"  # "float" or "ue8m0" (powers of two)

    def describe(self) -> str:
        return f"block-FP8 (e4m3, {self.block[0]}x{self.block[1]} blocks, {self.scale_fmt} scales)"


def _refuse(path: Path, field: str, value, allowed: str) -> ValueError:
    return ValueError(f"{path}: quantization_config.{field}={value!r} is not supported; allowed: {allowed}")


def read_scheme(folder: str | Path) -> BlockFP8 | mxfp4.MXFP4 | None:
    """The :class:`BlockFP8` or :class:`~eqmoe.checkpoints.mxfp4.MXFP4` that ``folder/config.json``'s
    ``quantization_config`` declares, ``None`` without one; a one-line ``ValueError`` naming the file for any other
    quantization (the weights could not be read)."""
    path = Path(folder) / "config.json"
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # read_config reports a missing or malformed config.json
    spec = hf.get("quantization_config") if isinstance(hf, dict) else None
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise ValueError(f"{path}: quantization_config must be a JSON object, found {spec!r}")
    if (method := spec.get("quant_method")) == "mxfp4":
        return mxfp4.MXFP4()
    if method != "fp8":
        allowed = "'fp8' (block-FP8 weights), 'mxfp4' (MXFP4 expert weights), both dequantized on load"
        raise _refuse(path, "quant_method", method, allowed)
    if (fmt := spec.get("fmt", "e4m3")) != "e4m3":
        raise _refuse(path, "fmt", fmt, "'e4m3'")
    if (activations := spec.get("activation_scheme", "dynamic")) != "dynamic":
        raise _refuse(path, "activation_scheme", activations, "'dynamic'")
    block = spec.get("weight_block_size", [128, 128])
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(_positive_int(b) for b in block)):
        raise _refuse(path, "weight_block_size", block, "two positive integers such as [128, 128]")
    if (scale_fmt := spec.get("scale_fmt") or "float") not in ("float", "ue8m0"):
        raise _refuse(path, "scale_fmt", scale_fmt, "'float', 'ue8m0'")
    return BlockFP8((int(block[0]), int(block[1])), scale_fmt)


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def scales_as_float32(scales: np.ndarray, stored: str) -> np.ndarray:
    """Block scales as float32: exponent bytes (``F8_E8M0``, or ``U8`` under ue8m0) become ``2 ** (e - 127)``."""
    if stored == "U8":
        scales = scales.view(ml_dtypes.float8_e8m0fnu)
    return scales.astype(np.float32)


def dequantize(values: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """float32 ``values * scale_inv``, each scale spread over its ``block`` of the last two dimensions (partial
    blocks at the edges included). One band of ``block[0]`` rows is widened at a time, so the only temporaries are
    a band, never a full-size scale matrix."""
    rows, cols = values.shape[-2:]
    out = np.empty(values.shape, np.float32)
    for band, start in enumerate(range(0, rows, block[0])):
        row_scales = np.repeat(scale_inv[..., band, :], block[1], axis=-1)[..., None, :cols]
        out[..., start : start + block[0], :] = values[..., start : start + block[0], :].astype(np.float32) * row_scales
    return out


class DequantizedWeight:
    """One block-FP8 weight as the loader reads it: the weight's shape, a float dtype, and its dequantized values
    (the scale may sit in another shard than the weight)."""

    def __init__(self, file: SafetensorsFile, scales: SafetensorsFile, scale_key: str, block: tuple[int, int]):
        self.file, self.scales, self.scale_key, self.block = file, scales, scale_key, block

    def shape(self, key: str) -> tuple[int, ...]:
        return self.file.shape(key)

    def dtype(self, key: str) -> str:
        return "F32"

    def read(self, key: str) -> np.ndarray:
        return dequantize(self.file.read(key), self.read_scales(), self.block)

    def read_values(self, key: str) -> np.ndarray:
        """The stored float8_e4m3fn values, ``[out, in]`` (a weight kept block-FP8 in memory)."""
        return self.file.read(key)

    def read_scales(self) -> np.ndarray:
        """The block scales as float32, ``[ceil(out / b0), ceil(in / b1)]``."""
        return scales_as_float32(self.scales.read(self.scale_key), self.scales.dtype(self.scale_key))


def _pair_problem(files: dict[str, SafetensorsFile], key: str, scheme: BlockFP8) -> str | None:
    """What is wrong with the weight ``key`` and its scale companion, as one phrase naming the file (None: fine)."""
    scale_key = key + SCALE_SUFFIX
    weight, scales = files[key], files[scale_key]
    if (stored := weight.dtype(key)) != "F8_E4M3":
        return f"{weight.path}: {key} has a {scale_key} but is stored {stored}, not F8_E4M3"
    allowed = SCALE_DTYPES + (("U8",) if scheme.scale_fmt == "ue8m0" else ())
    if (stored := scales.dtype(scale_key)) not in allowed:
        return f"{scales.path}: {scale_key} is stored {stored}; allowed: {', '.join(allowed)}"
    shape = weight.shape(key)
    if len(shape) < 2:
        return f"{weight.path}: {key} has shape {list(shape)}, a block-FP8 weight needs at least two dimensions"
    blocks = (*shape[:-2], *(math.ceil(size / b) for size, b in zip(shape[-2:], scheme.block, strict=True)))
    if scales.shape(scale_key) != blocks:
        return (
            f"{scales.path}: {scale_key} has shape {list(scales.shape(scale_key))}, expected {list(blocks)} "
            f"({key} {list(shape)} in {scheme.block[0]}x{scheme.block[1]} blocks)"
        )
    return None


def dequantizing(
    files: dict[str, SafetensorsFile], scheme: BlockFP8 | mxfp4.MXFP4 | None
) -> dict[str, SafetensorsFile | DequantizedWeight | mxfp4.DequantizedMXFP4]:
    """``files`` (tensor name -> the file holding it) with every weight that has a ``weight_scale_inv`` companion
    read dequantized and the companions consumed (no longer listed). A scale whose weight is absent stays listed,
    for the loader to report as unexpected; bad pairs are one ``ValueError`` naming each file and tensor. Under
    MXFP4 the ``X_blocks`` / ``X_scales`` pairs become ``X`` instead (:func:`eqmoe.checkpoints.mxfp4.dequantizing`)."""
    if scheme is None:
        return dict(files)
    if isinstance(scheme, mxfp4.MXFP4):
        return mxfp4.dequantizing(files)
    tensors: dict[str, SafetensorsFile | DequantizedWeight] = dict(files)
    problems = []
    for scale_key in [key for key in files if key.endswith(SCALE_SUFFIX)]:
        key = scale_key.removesuffix(SCALE_SUFFIX)
        if key not in files:
            continue
        if (problem := _pair_problem(files, key, scheme)) is not None:
            problems.append(problem)
            continue
        tensors[key] = DequantizedWeight(files[key], files[scale_key], scale_key, scheme.block)
        del tensors[scale_key]
    if problems:
        raise ValueError("; ".join(problems))
    return tensors


def hold_fp8(abstract, by_leaf: dict[tuple, list], files: dict, get, parallelism=None) -> tuple[Any, set[tuple]]:
    """``abstract`` (a model's ``jax.ShapeDtypeStruct`` tree) with every :class:`~eqmoe.nn.linear.Linear` weight whose
    checkpoint tensors (``by_leaf[path]``, found with ``get(tree, path)``) are all block-FP8 held as a
    :class:`~eqmoe.nn.fp8.BlockFP8Weight`, and the paths of those weights.

    A checkpoint tensor is torch ``[out, in]`` in ``[b_out, b_in]`` blocks; the model's weight is ``[*lead, *in, *out]``
    with ``in`` and ``out`` the checkpoint's flattened dimensions, so the values are the tensor transposed and reshaped
    (several tensors stack alike on the leading axes: repeats, experts) and the scales are the ``weight_scale_inv``
    grid transposed, blocks ``(b_in, b_out)`` of the flattened ``[fan_in, fan_out]`` matrix. Every linear weight
    is representable so; what stays dequantized: a weight some of whose tensors are not block-FP8, a tensor loaded into
    anything but a ``Linear`` weight (an embedding, the output head), and, on a mesh (``parallelism``), a weight whose
    shards along an input or output axis would cut through its blocks (the experts' products inside ``shard_map`` see
    one shard and its own scales only)."""
    paths, weights = [], []
    for path, names in by_leaf.items():
        linear = get(abstract, path[:-1]) if path[-1] == "weight" else None
        if not isinstance(linear, Linear) or not names:
            continue
        tensors = [files[name.key] for name in names]
        in_dims, out_dims = len(linear.in_axes), len(linear.out_axes)
        if not all(isinstance(t, DequantizedWeight) for t in tensors) or len({t.block for t in tensors}) != 1:
            continue
        if any(name.flat or name.linear_in_dims != in_dims for name in names):
            continue
        block = (tensors[0].block[1], tensors[0].block[0])  # (b_in, b_out) of the [fan_in, fan_out] matrix
        shape = linear.weight.shape
        weight = eqx.filter_eval_shape(
            lambda shape=shape, block=block, in_dims=in_dims, out_dims=out_dims: BlockFP8Weight(
                jnp.zeros(shape, FP8),
                jnp.zeros(grid(shape, block, in_dims, out_dims), jnp.float32),
                block,
                in_dims,
                out_dims,
            )
        )
        if parallelism is not None and not _whole_blocks(weight, linear, parallelism):
            continue
        paths.append(path)
        weights.append(weight)
    if not paths:
        return abstract, set()
    held = eqx.tree_at(lambda tree: [get(tree, path) for path in paths], abstract, weights)
    return held, set(paths)


def _whole_blocks(weight, linear, parallelism) -> bool:
    """Whether every shard of ``weight`` along a single input or output axis holds whole blocks, and its scales are
    split alike."""
    _, dims = linear.declared()["weight"]
    axes = ("layers",) * (weight.ndim - len(dims)) + tuple(dims)
    scale_axes = weight.parameter_axes(axes)["scales"]
    values = parallelism.spec(axes, weight.shape)
    scales = parallelism.spec(scale_axes, tuple(weight.scales.shape))
    lead = weight.ndim - weight.in_dims - weight.out_dims
    sides = [(lead, -2, weight.in_dims, weight.block[0]), (weight.ndim - 1, -1, weight.out_dims, weight.block[1])]
    for dim, grid_dim, count, block in sides:
        if count != 1:
            continue  # a grid over several axes is replicated; only GSPMD's global products read such weights
        mesh = values[dim]
        if mesh != scales[grid_dim]:
            return False
        if mesh is not None:
            split = math.prod(parallelism.size(a) for a in ((mesh,) if isinstance(mesh, str) else mesh))
            if (weight.shape[dim] // split) % block:
                return False
    return True
