"""eqmoe model checkpoints: a :class:`Transformer` in an orbax checkpoint with its :class:`RunMetadata`.

Two kinds of orbax checkpoint hold a model and both load with :func:`load_model`: the ones
:func:`save_model` writes (the tree is the model itself; ``experiments.convert`` makes them from a
Hugging Face folder) and the training checkpoints of ``experiments.sft`` and ``pretrain`` (the tree is a train
state whose ``model`` field is read alone, without the optimizer state).

A checkpoint whose metadata records a ``base`` (:class:`eqmoe.checkpoints.base.BaseModel`) holds only what
training changed (LoRA adapters, unfrozen weights, router biases): every leaf it does not hold is read from
the base folder, after checking that the folder's content digest is the recorded one. :func:`restore` is that
one path, for loading a model and for resuming a run alike.
"""

import os
import shutil
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from eqmoe.checkpoints._staging import staged_folder
from eqmoe.checkpoints.base import BaseModel, locate
from eqmoe.checkpoints.orbax import Checkpointer
from eqmoe.checkpoints.run_metadata import MODEL_KIND, RunMetadata
from eqmoe.config import ModelConfig
from eqmoe.lora import LoRAConfig, add_lora, merge_lora
from eqmoe.model import Transformer
from eqmoe.params import Role, role_mask

__all__ = ["MODEL_KIND", "RunMetadata", "changed_part", "load_base", "load_model", "restore", "save_model"]


def save_model(
    model: Transformer,
    directory: str | os.PathLike,
    *,
    metadata: RunMetadata | None = None,
    overwrite: bool = False,
    extra_files: list[Path] = (),
) -> Path:
    """Write ``model`` as step 0 of an orbax checkpoint in ``directory``, with ``metadata`` (its config set to the
    model's). The directory is assembled under a temporary name and renamed into place; an existing
    ``directory`` is refused unless ``overwrite``. ``extra_files`` (e.g. a tokenizer.json) are copied in beside
    the step folder."""
    directory = Path(directory)
    record = (metadata or RunMetadata(model.config)).replace(kind=MODEL_KIND, config=model.config)
    with staged_folder(directory, overwrite=overwrite) as staging:
        with Checkpointer(staging, keep_last=None) as checkpointer:
            checkpointer.save(0, model, record.to_json())
        for extra in extra_files:
            shutil.copyfile(extra, staging / Path(extra).name)
    return directory


def restore(
    checkpointer: Checkpointer, step: int | None, target: Any, *, fill: Any = None, field: str | None = None
) -> Any:
    """The arrays of ``target`` (an abstract tree: ``jax.ShapeDtypeStruct`` leaves carrying their shardings) that
    the checkpoint holds at ``step``, in the dtypes it holds them in, and ``fill``'s arrays (a tree shaped like
    ``target``: the base model's weights) for those it leaves out. ``field`` reads one field of the saved tree
    (``"model"`` of a train state). A leaf neither holds is a ``ValueError`` naming it."""
    layout = checkpointer.layout(step)
    prefix = "" if field is None else f".{field}"
    target = in_saved_dtypes(target, layout, prefix)
    saved = saved_mask(target, set(layout), prefix)
    restored, _ = checkpointer.restore(step, eqx.filter(target, saved), field=field)
    if fill is None:
        missing = [jax.tree_util.keystr(path) for path, kept in jax.tree_util.tree_leaves_with_path(saved) if not kept]
        if missing:
            raise ValueError(f"{checkpointer.directory}: step {step} does not hold {missing[0]} and there is no base")
        return restored
    _, rest = eqx.partition(fill, saved)
    return eqx.combine(restored, rest)


def load_model(
    directory: str | os.PathLike,
    *,
    step: int | None = None,
    dtype: str | None = None,
    base: str | os.PathLike | None = None,
) -> tuple[Transformer, RunMetadata]:
    """The model saved in ``directory`` at ``step`` (None: the latest) and that step's :class:`RunMetadata`.

    ``directory`` is either written by :func:`save_model` or a training run's ``checkpoints`` folder. A model
    trained with LoRA (``metadata.lora``) comes back with its adapters (``eqmoe.lora.merge_lora`` folds them).
    A checkpoint that holds only what training changed reads the rest from its recorded base folder, or from
    ``base`` when given (a moved copy); ``ValueError`` when that folder is missing or its content differs.
    ``dtype`` casts every floating parameter and sets the compute dtype (default: as saved).
    """
    directory = Path(directory)
    with Checkpointer(directory, keep_last=None) as checkpointer:
        metadata = RunMetadata.from_json(checkpointer.metadata(step), str(directory))
        config, lora = metadata.config, metadata.lora_config(str(directory))
        in_train_state = any(path.startswith(".model.") for path in checkpointer.leaf_paths(step))
        abstract = eqx.filter_eval_shape(lambda: _with_lora(Transformer(config, key=jax.random.key(0)), lora))
        fill = None
        if metadata.base is not None:
            found = locate(metadata.base, str(directory), base)
            fill = _with_lora(load_base(found, config), lora)
        model = restore(checkpointer, step, abstract, fill=fill, field="model" if in_train_state else None)
    if dtype is not None:
        name = jnp.dtype(dtype).name
        model = model.cast(name).with_config(config.replace(param_dtype=name, dtype=name), allow=("param_dtype",))
    return model, metadata


def load_base(base: BaseModel, config: ModelConfig) -> Transformer:
    """The base model's weights in ``config``'s parameter dtype (adapters of an eqmoe base merged), carrying
    ``config`` (the run's execution settings); ``ValueError`` when its architecture is not ``config``'s."""
    if base.format == "hf":
        from eqmoe.checkpoints import hf

        model = hf.load(base.path, dtype=config.param_dtype)
    else:
        model = merge_lora(load_model(base.path, step=base.step, dtype=config.param_dtype)[0])
    try:
        return model.with_config(config, allow=("param_dtype",))
    except ValueError as error:
        raise ValueError(f"{base.path}: not the checkpoint's base model ({error})") from None


def changed_part(model: Transformer, trained) -> Transformer:
    """``model`` with ``None`` for every parameter training leaves as it was (frozen or, under LoRA, the base
    weights): what a checkpoint of a run with a base folder stores. ``trained(role)`` says what the optimizer
    updates; router biases move outside the optimizer and are kept."""
    return eqx.filter(model, role_mask(model, lambda role: role is Role.ROUTER_BIAS or trained(role)))


def saved_mask(tree: Any, saved_paths: set[str], prefix: str = "") -> Any:
    """``True`` for every leaf of ``tree`` whose path (``prefix`` + ``jax.tree_util.keystr``) a checkpoint
    holds."""
    return jax.tree_util.tree_map_with_path(lambda path, _: prefix + jax.tree_util.keystr(path) in saved_paths, tree)


def in_saved_dtypes(tree: Any, layout: dict[str, tuple[list[int], str]], prefix: str = "") -> Any:
    """``tree`` (abstract) with each floating leaf in the dtype the checkpoint holds it in: frozen parameters
    are held in the compute dtype (:func:`eqmoe.train.state.hold_frozen`), which may have changed since."""

    def saved(path, leaf):
        entry = layout.get(prefix + jax.tree_util.keystr(path))
        if entry is None or not isinstance(leaf, jax.ShapeDtypeStruct) or not jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf
        return jax.ShapeDtypeStruct(leaf.shape, jnp.dtype(entry[1]), sharding=leaf.sharding)

    return jax.tree_util.tree_map_with_path(saved, tree)


def _with_lora(model: Transformer, lora: LoRAConfig | None) -> Transformer:
    """``model`` with (fresh) adapters for ``lora``: the tree shape the checkpoint's values are read into."""
    return model if lora is None else add_lora(model, lora, key=jax.random.key(0))
