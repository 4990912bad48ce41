"""MXFP4 checkpoints (gpt-oss's published expert weights), dequantized as read.

``config.json`` declares them with ``"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert":
[...]}``. A quantized parameter ``X`` (gpt-oss: each layer's ``mlp.experts.gate_up_proj`` and ``down_proj``) is
stored as two uint8 tensors: ``X_blocks`` ``B`` of shape ``[E, rows, cols / 32, 16]``, two E2M1 (FP4) codes per
byte, the low nibble first, and ``X_scales`` ``S`` of shape ``[E, rows, cols / 32]``, one shared exponent per 32
values (OCP Microscaling Formats (MX) v1.0, E8M0 scales with bias 127):

    W[e, r, 32 g + 2 k]     = FP4[B[e, r, g, k] & 0xF] * 2 ** (S[e, r, g] - 127)
    W[e, r, 32 g + 2 k + 1] = FP4[B[e, r, g, k] >> 4]  * 2 ** (S[e, r, g] - 127)

with ``FP4`` the 16 E2M1 values (sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6). transformers holds the parameter as
``W`` transposed on its last two axes, ``X`` ``[E, cols, rows]`` (``gate_up_proj`` ``[E, hidden, 2 * intermediate]``,
``down_proj`` ``[E, intermediate, hidden]``: ``convert_moe_packed_tensors`` in transformers'
``integrations/mxfp4.py``), and so does the loader: each ``X_blocks`` / ``X_scales`` pair is listed as the one
float32 tensor ``X``, dequantized an expert at a time. Every other tensor is stored unquantized and read as it is.

The values are formed as transformers forms them, ``ldexp`` of the E2M1 value by the exponent, exact in float32 (and
in bfloat16: an E2M1 value has two significant bits), so the weights equal transformers' bit for bit. A scale byte
of 255 (NaN in the MX spec; no finite weight quantizes to it) reads as transformers reads it, as ``2 ** 128``: zeros
stay zero, every other value overflows to infinity.
"""

import dataclasses

import numpy as np

from eqmoe.checkpoints.safetensors_io import SafetensorsFile

BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"  # X -> X_blocks, X_scales
GROUP = 32  # values sharing one scale: 16 bytes of two codes each
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)


@dataclasses.dataclass(frozen=True)
class MXFP4:
    """A folder's MXFP4 quantization (gpt-oss): E2M1 expert weights, one power-of-two scale per 32 values."""

    def describe(self) -> str:
        return "MXFP4 expert"


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 ``[..., groups * 32]`` from the codes ``blocks`` ``[..., groups, 16]`` and the exponent bytes
    ``scales`` ``[..., groups]`` (the equation of the module docstring; no transpose)."""
    values = np.empty((*blocks.shape, 2), np.float32)
    values[..., 0] = FP4_VALUES[blocks & 0x0F]  # low nibble: the even element
    values[..., 1] = FP4_VALUES[blocks >> 4]
    with np.errstate(over="ignore"):  # 6 * 2 ** 127 and beyond: inf, as torch.ldexp gives it
        np.ldexp(values, (scales.astype(np.int32) - 127)[..., None, None], out=values)
    return values.reshape(*blocks.shape[:-2], -1)


class DequantizedMXFP4:
    """One MXFP4 parameter as the loader reads it: transformers' unquantized shape ``[E, cols, rows]``, a float
    dtype, and its float32 values (the scales may sit in another shard than the blocks)."""

    def __init__(self, blocks: SafetensorsFile, blocks_key: str, scales: SafetensorsFile, scales_key: str):
        self.blocks, self.blocks_key, self.scales, self.scales_key = blocks, blocks_key, scales, scales_key

    def shape(self, key: str) -> tuple[int, ...]:
        experts, rows, groups, _ = self.blocks.shape(self.blocks_key)
        return (experts, groups * GROUP, rows)

    def dtype(self, key: str) -> str:
        return "F32"

    def read(self, key: str) -> np.ndarray:
        """The dequantized ``[E, cols, rows]``; the files are memory-mapped and one expert is widened at a time, so
        the only temporaries are one expert's."""
        blocks, scales = self.blocks.read(self.blocks_key), self.scales.read(self.scales_key)
        out = np.empty(self.shape(key), np.float32)
        for expert in range(blocks.shape[0]):
            out[expert] = dequantize(blocks[expert], scales[expert]).T
        return out


def _pair_problem(files: dict[str, SafetensorsFile], name: str) -> str | None:
    """What is wrong with the parts of the MXFP4 tensor ``name``, as one phrase naming the file (None: fine)."""
    blocks_key, scales_key = name + BLOCKS_SUFFIX, name + SCALES_SUFFIX
    if blocks_key not in files:
        return f"{files[scales_key].path}: {scales_key} has no {blocks_key} (an MXFP4 tensor needs both)"
    if scales_key not in files:
        return f"{files[blocks_key].path}: {blocks_key} has no {scales_key} (an MXFP4 tensor needs both)"
    if name in files:
        return f"{files[name].path}: {name} is stored unquantized besides its {blocks_key} and {scales_key}"
    blocks, scales = files[blocks_key], files[scales_key]
    for file, key in ((blocks, blocks_key), (scales, scales_key)):
        if (stored := file.dtype(key)) != "U8":
            return f"{file.path}: {key} is stored {stored}, not U8"
    shape = blocks.shape(blocks_key)
    if len(shape) != 4 or shape[-1] != GROUP // 2:
        return f"{blocks.path}: {blocks_key} has shape {list(shape)}, expected [experts, rows, cols / 32, 16]"
    if (found := scales.shape(scales_key)) != shape[:-1]:
        return (
            f"{scales.path}: {scales_key} has shape {list(found)}, expected {list(shape[:-1])} "
            f"(one scale per 32 values of {blocks_key} {list(shape)})"
        )
    return None


def dequantizing(files: dict[str, SafetensorsFile]) -> dict[str, SafetensorsFile | DequantizedMXFP4]:
    """``files`` (tensor name -> the file holding it) with every ``X_blocks`` / ``X_scales`` pair replaced by the
    dequantized ``X`` in transformers' layout; a part without its partner, parts that are not uint8 or whose shapes
    disagree, are one ``ValueError`` naming each file and tensor."""
    tensors: dict[str, SafetensorsFile | DequantizedMXFP4] = dict(files)
    names = [
        key.removesuffix(suffix) for key in files for suffix in (BLOCKS_SUFFIX, SCALES_SUFFIX) if key.endswith(suffix)
    ]
    problems = []
    for name in dict.fromkeys(names):  # each name once, in the files' order
        if (problem := _pair_problem(files, name)) is not None:
            problems.append(problem)
            continue
        blocks_key, scales_key = name + BLOCKS_SUFFIX, name + SCALES_SUFFIX
        tensors[name] = DequantizedMXFP4(files[blocks_key], blocks_key, files[scales_key], scales_key)
        del tensors[blocks_key], tensors[scales_key]
    if problems:
        raise ValueError("; ".join(problems))
    return tensors
