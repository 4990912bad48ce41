"""Writing a :class:`~eqmoe.model.Transformer` as a Hugging Face folder of its family: ``config.json`` and the
safetensors files, streamed tensor by tensor (:func:`save`), and the parameters under their checkpoint names
(:func:`state_dict`)."""

import json
import shutil
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from eqmoe.checkpoints._staging import staged_folder
from eqmoe.checkpoints.hf_layout import INDEX_FILE, SINGLE_FILE, checkpoint_names, leaf_at, to_checkpoint_layout
from eqmoe.checkpoints.safetensors_io import StreamedFile
from eqmoe.model import Transformer
from eqmoe.models import family as families
from eqmoe.nn.fp8 import is_block_fp8
from eqmoe.progress import phase_bar


def iter_tensors(model: Transformer) -> Iterator[tuple[str, np.ndarray]]:
    """``(checkpoint name, tensor)`` for every parameter, one tensor at a time: only that tensor's slice
    of a stacked leaf is copied to the host (a tensor several leaves share, once all its parts are read)."""
    parts: dict[str, dict[int, np.ndarray]] = {}
    for name in checkpoint_names(model.config):
        held = leaf_at(model, name.path)[name.index]
        held = held.dequantize() if is_block_fp8(held) else held  # a block-FP8 weight's float32 dequantization
        tensor = to_checkpoint_layout(name, np.asarray(held))
        if name.columns is None:
            yield name.key, tensor
            continue
        start, step = name.columns
        parts.setdefault(name.key, {})[start] = tensor
        if len(parts[name.key]) == step:
            whole = np.empty((*tensor.shape[:-1], tensor.shape[-1] * step), tensor.dtype)
            for first, part in parts.pop(name.key).items():
                whole[..., first::step] = part
            yield name.key, whole


def state_dict(model: Transformer) -> dict[str, np.ndarray]:
    """Every parameter of ``model`` (or a same-shaped pytree such as its gradients) under its Hugging
    Face checkpoint name, in torch ``[out, in]`` layout."""
    return dict(iter_tensors(model))


_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def _shard_bytes(max_shard_size: int | str) -> int:
    if isinstance(max_shard_size, int):
        size = max_shard_size
    else:
        text = max_shard_size.strip().upper()
        unit = next((u for u in sorted(_UNITS, key=len, reverse=True) if text.endswith(u)), None)
        try:
            size = int(float(text[: -len(unit)] if unit else text) * (_UNITS[unit] if unit else 1))
        except ValueError:
            size = 0
    if size <= 0:
        raise ValueError(f"max_shard_size={max_shard_size!r} is invalid; allowed: a positive size such as '5GB'")
    return size


def save(
    model: Transformer,
    folder: str | Path,
    *,
    dtype: str | jnp.dtype | None = None,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    extra_files: list[Path] = (),
) -> Path:
    """Write ``model`` as a Hugging Face folder of its family: ``config.json`` and ``model.safetensors``, or
    ``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json`` when the tensors
    exceed ``max_shard_size``. Tensors are cast to ``dtype`` (default: the parameters' dtype).

    Tensors are streamed: host memory holds one tensor at a time. The folder is assembled under a temporary
    name beside ``folder`` and renamed into place, so a failure never leaves a half-written checkpoint.
    An existing ``folder`` is refused unless ``overwrite``. ``extra_files`` (e.g. :func:`side_files` of the
    source folder) are copied in beside the weights.
    """
    target = None if dtype is None else jnp.dtype(dtype)
    hf_config = families.get(model.config.family).config_to_hf(model.config)
    hf_config["dtype"] = (target or jnp.dtype(model.config.param_dtype)).name
    count = len({name.key for name in checkpoint_names(model.config)})
    tensors = iter_tensors(model)
    if target is not None:
        tensors = ((key, tensor.astype(target)) for key, tensor in tensors)
    return write_folder(
        folder, hf_config, tensors, count, max_shard_size=max_shard_size, overwrite=overwrite, extra_files=extra_files
    )


def write_folder(
    folder: str | Path,
    hf_config: dict,
    tensors: Iterable[tuple[str, np.ndarray]],
    count: int,
    *,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    extra_files: Sequence[Path] = (),
) -> Path:
    """Write ``hf_config`` as ``config.json`` and the ``count`` named ``tensors`` as safetensors beside it, in shards
    of at most ``max_shard_size`` (:func:`save`'s layout), pulling the tensors one at a time: host memory holds one
    tensor (:class:`~eqmoe.checkpoints.safetensors_io.StreamedFile`). Staged under a temporary name and renamed into
    place; an existing ``folder`` is refused unless ``overwrite``."""
    folder = Path(folder)
    limit = _shard_bytes(max_shard_size)
    with staged_folder(folder, overwrite=overwrite) as staging:
        for extra in extra_files:
            shutil.copyfile(extra, staging / Path(extra).name)
        (staging / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        shards: list[list[str]] = []
        shard, total = None, 0
        for key, tensor in phase_bar(tensors, f"writing {folder.name}", total=count, unit="tensor"):
            if shard is not None and shard.keys and shard.size + tensor.nbytes > limit:
                shards.append(shard.close())
                shard = None
            if shard is None:
                shard = StreamedFile(staging / f"shard-{len(shards)}.tmp", metadata={"format": "pt"})
            shard.add(key, tensor)
            total += tensor.nbytes
        if shard is None:
            shard = StreamedFile(staging / "shard-0.tmp", metadata={"format": "pt"})
        shards.append(shard.close())
        if len(shards) == 1:
            (staging / "shard-0.tmp").rename(staging / SINGLE_FILE)
        else:
            weight_map = {}
            for i, keys in enumerate(shards):
                name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                (staging / f"shard-{i}.tmp").rename(staging / name)
                weight_map.update(dict.fromkeys(keys, name))
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (staging / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return folder
