"""Writing MXFP4 checkpoints for tests: gpt-oss's published layout, made from unquantized tensors.

    blocks, scales = quantize_mxfp4(weight)          # [E, rows, cols] float -> uint8 codes, uint8 exponents
    published = to_mxfp4(tensors)                    # transformers' gpt-oss tensors -> the published tensors
    expected = write_mxfp4_folder(folder, tensors, config)   # ... written as a folder transformers and eqmoe read
    expected = mxfp4_folder_from(plain, folder)      # the same from a folder transformers saved unquantized

A quantized parameter ``X`` of transformers' layout ``[E, cols, rows]`` (``mlp.experts.gate_up_proj``
``[E, hidden, 2 * intermediate]``, ``mlp.experts.down_proj`` ``[E, intermediate, hidden]``) is stored transposed,
``[E, rows, cols]``, as ``X_blocks`` ``[E, rows, cols / 32, 16]`` (two E2M1 codes a byte, low nibble first) and
``X_scales`` ``[E, rows, cols / 32]`` (exponent bytes, ``2 ** (byte - 127)``); ``cols`` must be a multiple of 32.
Each 32 values share the smallest power of two that maps their largest magnitude to at most 6, the largest E2M1
value, as the published quantizer (triton_kernels' ``downcast_to_mxfp``, ``DequantScaleRoundingMode.ROUND_UP``)
chooses it; each value is then rounded to the nearest E2M1 value, ties to even.
"""

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from eqmoe.checkpoints.safetensors_io import SafetensorsFile

EXPERT_PARAMETERS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")  # the tensors gpt-oss publishes MXFP4
QUANTIZATION_CONFIG = {  # gpt-oss-20b's config.json
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}
E2M1_MAX = 6.0


def quantize_mxfp4(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``weight`` ``[E, rows, cols]`` as uint8 ``blocks`` ``[E, rows, cols / 32, 16]`` and uint8 ``scales``
    ``[E, rows, cols / 32]`` (see the module docstring for the choice of scale and rounding)."""
    experts, rows, cols = weight.shape
    if cols % 32:
        raise ValueError(f"MXFP4 groups 32 values of the last axis; {cols} columns are not a multiple of 32")
    groups = np.asarray(weight, np.float32).reshape(experts, rows, cols // 32, 32)
    largest = np.abs(groups).max(axis=-1) / np.float32(E2M1_MAX)
    # 2 ** ceil(log2(largest)) as its float32 exponent field: adding 0x7FFFFF carries into the exponent unless the
    # mantissa is zero, as triton_kernels does it
    exponents = ((largest.view(np.uint32) + np.uint32(0x7FFFFF)) & np.uint32(0x7F800000)) >> np.uint32(23)
    scales = exponents.astype(np.uint8)
    scale = np.ldexp(np.float32(1.0), exponents.astype(np.int32) - 127).astype(np.float32)
    codes = (groups / scale[..., None]).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & np.uint8(0x0F)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << np.uint8(4))  # low nibble: the even element
    return blocks.astype(np.uint8), scales


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 ``[E, rows, cols]`` from ``blocks`` and ``scales`` (through ml_dtypes' E2M1, not eqmoe's table)."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    values = codes * np.ldexp(np.float32(1.0), scales.astype(np.int32) - 127).astype(np.float32)[..., None, None]
    return values.reshape(*blocks.shape[:-2], -1)


def is_quantized(name: str) -> bool:
    """Whether gpt-oss publishes the tensor ``name`` in MXFP4."""
    return name.endswith(EXPERT_PARAMETERS)


def to_mxfp4(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``tensors`` (names and layout as transformers' ``GptOssForCausalLM`` holds them) as gpt-oss publishes them:
    each expert parameter ``X`` ``[E, cols, rows]`` replaced by ``X_blocks`` and ``X_scales`` of its transpose, every
    other tensor kept as it is."""
    published = {}
    for name, array in tensors.items():
        if is_quantized(name):
            published[name + "_blocks"], published[name + "_scales"] = quantize_mxfp4(np.swapaxes(array, -1, -2))
        else:
            published[name] = array
    return published


def write_mxfp4_folder(folder: str | Path, tensors: dict[str, np.ndarray], config: dict) -> dict[str, np.ndarray]:
    """Write ``folder/model.safetensors`` (:func:`to_mxfp4` of ``tensors``) and ``folder/config.json`` (``config``
    with gpt-oss-20b's ``quantization_config``); return what a reader should load: every tensor as given, the expert
    parameters as the float32 dequantization of the written bytes in transformers' layout."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    published = to_mxfp4(tensors)
    save_file({name: np.ascontiguousarray(a) for name, a in published.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": QUANTIZATION_CONFIG}, indent=2))
    expected = dict(tensors)
    for name in filter(is_quantized, tensors):
        stored = dequantize_mxfp4(published[name + "_blocks"], published[name + "_scales"])
        expected[name] = np.swapaxes(stored, -1, -2)
    return expected


def mxfp4_folder_from(plain: str | Path, folder: str | Path) -> dict[str, np.ndarray]:
    """:func:`write_mxfp4_folder` of the tiny gpt-oss folder ``plain`` (``save_pretrained`` of an unquantized
    ``GptOssForCausalLM``, one ``model.safetensors``), its other files (generation config, tokenizer) copied."""
    plain, folder = Path(plain), Path(folder)
    file = SafetensorsFile(plain / "model.safetensors")
    tensors = {key: file.read(key) for key in list(file.keys())}  # a SafetensorsFile is not a mapping
    config = json.loads((plain / "config.json").read_text())
    expected = write_mxfp4_folder(folder, tensors, config)
    for path in plain.iterdir():
        if path.is_file() and path.name not in ("config.json", "model.safetensors"):
            shutil.copyfile(path, folder / path.name)
    return expected
