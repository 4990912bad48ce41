"""Hugging Face checkpoints (``config.json`` + safetensors) to and from a Transformer.

The format of each architecture (its ``config.json`` fields and tensor names) belongs to its model family
(:mod:`eqmoe.models`): a folder is read by the family its ``model_type`` names, and a model is written by
the family its ``config.family`` names.

Reading is here; writing is :mod:`eqmoe.checkpoints.hf_write` and the folder's layout
:mod:`eqmoe.checkpoints.hf_layout`, their names importable from here too."""

import functools
import json
import math
import re
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from eqmoe import parallel
from eqmoe.checkpoints import fused_experts, quantized
from eqmoe.checkpoints.hf_layout import (  # noqa: F401 (the folder's names, importable from here as before)
    INDEX_FILE,
    SIDE_FILES,
    SINGLE_FILE,
    checkpoint_names,
    leaf_at,
    side_files,
    to_model_layout,
)
from eqmoe.checkpoints.hf_write import iter_tensors, save, state_dict  # noqa: F401 (writing, importable from here)
from eqmoe.checkpoints.safetensors_io import SafetensorsFile
from eqmoe.config import ModelConfig
from eqmoe.data.hub import resolve_folder
from eqmoe.model import Transformer
from eqmoe.models import family as families
from eqmoe.models.family import TensorName
from eqmoe.models.field_map import report_ignored
from eqmoe.progress import phase_bar

FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def read_config(folder: str | Path) -> ModelConfig:
    """The :class:`ModelConfig` described by ``folder/config.json`` (``folder`` may be a Hub id ORG/NAME[@REV])."""
    path = resolve_folder(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found (a Hugging Face model folder needs config.json)")
    try:
        hf = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{path}: expected a JSON object")
    family = families.from_hf_model_type(hf.get("model_type"), str(path))
    config = family.config_from_hf(hf, str(path))
    report_ignored(family.ignored_keys(hf), str(path), family.hf_model_type)
    return config


def host_buffer(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised array aligned to 64 bytes, which XLA:CPU adopts as a device buffer without copying."""
    dtype = np.dtype(dtype)
    size = math.prod(shape) * dtype.itemsize
    raw = np.empty(size + 64, np.uint8)
    offset = -raw.ctypes.data % 64
    return raw[offset : offset + size].view(dtype).reshape(shape)


def stored_dtype(folder: str | Path) -> str:
    """The parameter dtype ``config.json`` declares (``dtype``, or the older ``torch_dtype``); float32 if none."""
    try:
        hf = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"
    value = (hf.get("dtype") or hf.get("torch_dtype")) if isinstance(hf, dict) else None
    return value if value in ("float32", "bfloat16", "float16") else "float32"


def weight_files(folder: str | Path) -> dict[str, SafetensorsFile]:
    """Every tensor name of a Hugging Face folder and the file that holds it (single file or sharded index), as
    stored (no dequantization)."""
    return _weight_files(Path(folder))


def _weight_files(folder: Path) -> dict[str, SafetensorsFile]:
    """Map every tensor name to the file that holds it (single file or sharded index)."""
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"{index_path}: not a safetensors index ({error!r})") from None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise ValueError(f"{index_path}: weight_map must map tensor names to file names")
        files: dict[str, SafetensorsFile] = {}
        for name in sorted(set(weight_map.values())):
            shard = (folder / name).resolve()
            if shard.parent != folder.resolve():
                raise ValueError(
                    f"{index_path}: shard {name!r} lies outside the checkpoint folder (shards must sit directly in it)"
                )
            files[name] = SafetensorsFile(shard)
        located = {}
        for key, name in weight_map.items():
            if key not in files[name].keys():  # noqa: SIM118 (not a dict)
                raise ValueError(f"{index_path}: {key!r} is listed in {name} but that file does not hold it")
            located[key] = files[name]
        return located
    single = folder / SINGLE_FILE
    if not single.is_file():
        raise FileNotFoundError(f"{folder}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    file = SafetensorsFile(single)
    return {key: file for key in file.keys()}  # noqa: SIM118


def _leaf_path(key_path) -> tuple[str | int, ...]:
    return tuple(getattr(k, "name", getattr(k, "idx", None)) for k in key_path)


def _stored(file, key: str, held: str | None) -> np.ndarray:
    """The tensor ``key`` as the model reads it: as stored or dequantized (``held`` None), or the ``"values"`` or the
    ``"scales"`` of a weight held block-FP8."""
    if held == "values":
        return file.read_values(key)
    return file.read_scales() if held == "scales" else file.read(key)


def _read_slice(
    leaf: jax.ShapeDtypeStruct, names: list[TensorName], files, index: tuple[slice, ...], held: str | None = None
) -> np.ndarray:
    """The part ``index`` of a model leaf, in the leaf's dtype, assembled from the checkpoint tensors that overlap
    it: a device's slice of stacked experts reads only the experts it holds. ``held`` ``"values"`` or ``"scales"``:
    that part of a weight held block-FP8 (its stored bytes, its scale grid)."""
    ranges = [range(*part.indices(size)) for part, size in zip(index, leaf.shape, strict=True)]
    buffer = host_buffer(tuple(len(r) for r in ranges), leaf.dtype)
    filled = 0
    for name in names:
        stacked = len(name.index)
        if not all(i in r for i, r in zip(name.index, ranges, strict=False)):
            continue
        tensor = to_model_layout(name, _stored(files[name.key], name.key, held), leaf.shape[stacked:])
        part = tensor[index[stacked:]]  # a view of the memory-mapped file: only this slice is copied
        buffer[tuple(i - r.start for i, r in zip(name.index, ranges, strict=False))] = part
        filled += part.size
    assert filled == buffer.size, f"checkpoint name map leaves part of {names[0].path if names else index} unset"
    return buffer


def _place(leaf: jax.ShapeDtypeStruct, sharding: jax.sharding.Sharding | None, read) -> jax.Array:
    if sharding is None:  # on CPU an aligned buffer becomes the array without a copy
        return jax.device_put(read(tuple(slice(None) for _ in leaf.shape)))
    return parallel.array_from_slices(leaf.shape, sharding, read)


def load(
    folder: str | Path,
    *,
    dtype: str | jnp.dtype | None = None,
    compute_dtype: str | jnp.dtype | None = None,
    parallelism: parallel.Parallelism | None = None,
    keep_fp8: bool = False,
) -> Transformer:
    """Load a Hugging Face folder (any registered family) as a :class:`Transformer` whose parameters are ``dtype``
    (default: the dtype ``config.json`` declares the files hold, float32 when it declares none) and whose forward
    pass computes in ``compute_dtype`` (default: the parameter dtype).

    Reads ``config.json`` and ``model.safetensors`` or the shards of ``model.safetensors.index.json``;
    needs no torch. Missing, unexpected and mis-shaped tensors are all reported in one ``ValueError``.
    Block-FP8 files (DeepSeek-V3's layout) and MXFP4 experts (gpt-oss's) are dequantized tensor by tensor
    (:mod:`eqmoe.checkpoints.quantized`, :mod:`eqmoe.checkpoints.mxfp4`); any other ``quantization_config`` is
    refused. With ``keep_fp8`` block-FP8 linear weights stay as stored instead, one byte per parameter plus a float32
    scale per block (:class:`eqmoe.nn.fp8.BlockFP8Weight`, dequantized inside
    each product: the frozen base of a LoRA run; :func:`eqmoe.checkpoints.quantized.hold_fp8` says which weights).
    Without ``parallelism`` each parameter is assembled on the host and put on the default device, one at a
    time. With it, each parameter goes straight to the sharding its logical axes give it
    (:func:`eqmoe.parallel.tree_shardings`): every device's slice is read from the files on its own (only the
    checkpoint tensors it overlaps), so the host holds one slice at a time and no device holds more than its share.
    ``folder`` may be a Hub id ORG/NAME[@REVISION], read through the Hugging Face cache.
    """
    folder = resolve_folder(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: checkpoint folder not found")
    scheme = quantized.read_scheme(folder)  # first: a quantization it cannot read is the one thing to say
    config = read_config(folder)
    param_dtype = jnp.dtype(stored_dtype(folder) if dtype is None else dtype).name
    config = config.replace(param_dtype=param_dtype, dtype=jnp.dtype(compute_dtype or param_dtype).name)
    files = quantized.dequantizing(_weight_files(folder), scheme)  # block-FP8 weights read dequantized
    config = _without_absent_mtp(config, files, folder)
    abstract = eqx.filter_eval_shape(Transformer, config, key=jax.random.key(0))
    leaves = {_leaf_path(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(abstract)}
    shardings = {}
    if parallelism is not None:
        placement = parallel.tree_shardings(abstract, parallelism)
        shardings = {_leaf_path(p): s for p, s in jax.tree_util.tree_leaves_with_path(placement)}
    names = checkpoint_names(config)
    files = fused_experts.splitting(files, {name.key for name in names})  # experts stored [E, ...] as one tensor

    check_tensors(config, names, leaves, files, folder)

    by_leaf: dict[tuple, list[TensorName]] = {}
    for name in names:
        if not name.duplicate:
            by_leaf.setdefault(name.path, []).append(name)
    held = set()
    if keep_fp8:
        abstract, held = quantized.hold_fp8(abstract, by_leaf, files, leaf_at, parallelism)
        leaves = {_leaf_path(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(abstract)}
        if parallelism is not None:
            placement = parallel.tree_shardings(abstract, parallelism)
            shardings = {_leaf_path(p): s for p, s in jax.tree_util.tree_leaves_with_path(placement)}
    arrays = {}
    for path, leaf in phase_bar(leaves.items(), f"reading {folder.name}", total=len(leaves), unit="tensor"):
        weight, part = (path[:-1], path[-1]) if path[:-1] in held else (path, None)
        read = functools.partial(_read_slice, leaf, by_leaf.get(weight, []), files, held=part)
        arrays[path] = _place(leaf, shardings.get(path), read)
    model = jax.tree_util.tree_map_with_path(lambda p, _: arrays[_leaf_path(p)], abstract)
    _check_duplicates(model, [name for name in names if name.duplicate], files, folder)
    return model


def check_tensors(
    config: ModelConfig, names: list[TensorName], leaves: dict[tuple, jax.ShapeDtypeStruct], files, folder: Path
) -> None:
    """Every tensor of ``names`` is in ``files`` with the shape of its part of the model's leaf (``leaves``, by path)
    and a float dtype, and ``files`` hold nothing else (a tied head and the family's skipped keys aside, the latter
    listed): else one ``ValueError`` naming every offending tensor."""
    problems = []
    expected = {name.key for name in names}
    for name in names:
        want = name.checkpoint_shape(leaves[name.path].shape)
        if name.key not in files:
            problems.append(f"missing tensor {name.key} (expected shape {want})")
        elif (found := files[name.key].shape(name.key)) != want:
            problems.append(f"wrong shape for {name.key}: expected {want}, found {found}")
        elif (kind := files[name.key].dtype(name.key)) not in FLOAT_DTYPES:
            problems.append(f"wrong dtype for {name.key}: expected a float type, found {kind}")
    ignorable = {"lm_head.weight"} if config.tie_embeddings else set()
    skipped = _skipped(families.get(config.family).skipped_keys, set(files) - expected, folder)
    ignorable |= skipped
    problems += [f"unexpected tensor {key}" for key in sorted(set(files) - expected - ignorable)]
    if problems:
        raise ValueError(f"{folder}: checkpoint does not match its config.json:\n  " + "\n  ".join(problems))


def abstract_leaves(config: ModelConfig) -> dict[tuple, jax.ShapeDtypeStruct]:
    """The shape and dtype of every leaf of ``config``'s model, by path, without building it."""
    abstract = eqx.filter_eval_shape(Transformer, config, key=jax.random.key(0))
    return {_leaf_path(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(abstract)}


def _skipped(patterns: tuple[str, ...], unexpected: set[str], folder: Path) -> set[str]:
    """The tensors of ``unexpected`` that match the family's ``skipped_keys`` (parts of the published files
    transformers does not load either), listed on one line of stderr by pattern with their counts."""
    found = {pattern: sorted(key for key in unexpected if re.match(pattern, key)) for pattern in patterns}
    shown = {pattern: pattern.removeprefix("^").replace("\\", "") for pattern in patterns}
    shown = {pattern: text if text.endswith("*") else text + "*" for pattern, text in shown.items()}
    groups = [f"{shown[pattern]} ({len(keys)})" for pattern, keys in found.items() if keys]
    if groups:
        print(f"{folder}: skipped (transformers does not load them either): {', '.join(groups)}", file=sys.stderr)
    return {key for keys in found.values() for key in keys}


def _check_duplicates(model: Transformer, duplicates: list[TensorName], files, folder: Path) -> None:
    """Each ``duplicate`` tensor equals the one loaded for its leaf (the copy read the same way), or a one-line
    ``ValueError`` names it: a model holds one embedding and one head, whatever the files repeat."""
    for name in duplicates:
        loaded = np.asarray(leaf_at(model, name.path)[name.index])
        copy = to_model_layout(name, np.asarray(files[name.key].read(name.key)), loaded.shape).astype(loaded.dtype)
        if not np.array_equal(copy, loaded):
            raise ValueError(f"{folder}: {name.key} differs from the tensor it repeats (the model holds one of them)")


def _without_absent_mtp(config: ModelConfig, files, folder: Path) -> ModelConfig:
    """``config`` without its multi-token-prediction layers when the folder holds none of their tensors: DeepSeek-V3's
    config says ``num_nextn_predict_layers: 1`` in every folder transformers saves, which never holds them (nor does
    Qwen3.5's ``mtp_num_hidden_layers``). The declared count is kept for the export."""
    if not config.mtp_layers:
        return config
    names = [name.key for name in checkpoint_names(config) if name.path[0] == "mtp" and not name.duplicate]
    if any(key in files for key in names):
        return config
    print(
        f"{folder}: config.json declares {config.mtp_layers} multi-token-prediction layer(s) but the files hold none "
        f"of their tensors ({names[0]}, ...): loading without them",
        file=sys.stderr,
    )
    return config.replace(mtp_layers=0, mtp_layers_declared=config.mtp_layers)
