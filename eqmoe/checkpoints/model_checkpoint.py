"""eqmoe model checkpoints: a :class:`Transformer` in an orbax checkpoint with its config in the metadata.

Two kinds of orbax checkpoint hold a model and both load with :func:`load_model`: the ones
:func:`save_model` writes (the tree is the model itself; ``experiments.convert`` makes them from a
Hugging Face folder) and the training checkpoints of ``experiments.sft`` (the tree is a train state whose
``model`` field is read alone, without the optimizer state). Either way the metadata's ``config`` entry is
the :func:`eqmoe.config_io.config_to_dict` of the model's config.

A checkpoint whose metadata records a ``base`` (:class:`eqmoe.checkpoints.base.BaseModel`) holds only what
training changed (LoRA adapters, unfrozen weights, router biases): every leaf it does not hold is read from
the base folder, after checking that the folder's content digest is the recorded one.
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
from eqmoe.config import ModelConfig
from eqmoe.config_io import config_from_dict, config_to_dict
from eqmoe.model import Transformer
from eqmoe.nn import Role, param_info
from eqmoe.nn._params import ParamInfo

MODEL_KIND = "eqmoe-model"


def save_model(
    model: Transformer,
    directory: str | os.PathLike,
    *,
    metadata: dict[str, Any] | None = None,
    overwrite: bool = False,
    extra_files: list[Path] = (),
) -> Path:
    """Write ``model`` as step 0 of an orbax checkpoint in ``directory``, with ``metadata`` (JSON) beside its
    config. The directory is assembled under a temporary name and renamed into place; an existing
    ``directory`` is refused unless ``overwrite``. ``extra_files`` (e.g. a tokenizer.json) are copied in beside
    the step folder."""
    directory = Path(directory)
    with staged_folder(directory, overwrite=overwrite) as staging:
        with Checkpointer(staging, keep_last=None) as checkpointer:
            info = {**(metadata or {}), "kind": MODEL_KIND, "config": config_to_dict(model.config)}
            checkpointer.save(0, model, info)
        for extra in extra_files:
            shutil.copyfile(extra, staging / Path(extra).name)
    return directory


def load_model(
    directory: str | os.PathLike,
    *,
    step: int | None = None,
    dtype: str | None = None,
    base: str | os.PathLike | None = None,
) -> tuple[Transformer, dict[str, Any]]:
    """The model saved in ``directory`` at ``step`` (None: the latest) and that step's metadata.

    ``directory`` is either written by :func:`save_model` or a training run's ``checkpoints`` folder. A model
    trained with LoRA (``metadata["lora"]``) comes back with its adapters (``eqmoe.lora.merge_lora`` folds them).
    A checkpoint that holds only what training changed reads the rest from its recorded base folder, or from
    ``base`` when given (a moved copy); ``ValueError`` when that folder is missing or its content differs.
    ``dtype`` casts every floating parameter and sets the compute dtype (default: as saved).
    """
    directory = Path(directory)
    with Checkpointer(directory, keep_last=None) as checkpointer:
        metadata = checkpointer.metadata(step)
        if not isinstance(metadata.get("config"), dict):
            raise ValueError(f"{directory}: the checkpoint's metadata has no model config (not an eqmoe model)")
        try:
            config = config_from_dict(metadata["config"])
        except (TypeError, ValueError) as error:
            raise ValueError(f"{directory}: the checkpoint's model config is invalid ({error})") from None
        layout = checkpointer.layout(step)
        saved_paths = list(layout)
        in_train_state = any(path.startswith(".model.") for path in saved_paths)
        prefix = ".model" if in_train_state else ""
        lora = _lora_config(metadata, directory)
        abstract = eqx.filter_eval_shape(lambda: _with_lora(Transformer(config, key=jax.random.key(0)), lora))
        abstract = in_saved_dtypes(abstract, layout, prefix)
        if metadata.get("base") is None:
            model, _ = checkpointer.restore(step, abstract, field="model" if in_train_state else None)
        else:
            recorded = BaseModel.from_json(metadata["base"], str(directory))
            found = locate(recorded, str(directory), base)
            frozen = _with_lora(load_base(found, config), lora)
            mask = saved_mask(abstract, set(saved_paths), prefix)
            changed, _ = eqx.partition(abstract, mask)
            restored, _ = checkpointer.restore(step, changed, field="model" if in_train_state else None)
            _, frozen = eqx.partition(frozen, mask)
            model = eqx.combine(restored, frozen)
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
        from eqmoe.lora import merge_lora

        model = merge_lora(load_model(base.path, step=base.step, dtype=config.param_dtype)[0])
    try:
        return model.with_config(config, allow=("param_dtype",))
    except ValueError as error:
        raise ValueError(f"{base.path}: not the checkpoint's base model ({error})") from None


def changed_part(model: Transformer, trained) -> Transformer:
    """``model`` with ``None`` for every parameter training leaves as it was (frozen or, under LoRA, the base
    weights): what a checkpoint of a run with a base folder stores. ``trained(role)`` says what the optimizer
    updates; router biases move outside the optimizer and are kept."""
    spec = jax.tree.map(
        lambda info: isinstance(info, ParamInfo) and (info.role is Role.ROUTER_BIAS or trained(info.role)),
        param_info(model),
        is_leaf=lambda x: isinstance(x, ParamInfo),
    )
    return eqx.filter(model, spec)


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


def _lora_config(metadata: dict[str, Any], directory: Path):
    """The checkpoint's recorded :class:`eqmoe.lora.LoRAConfig`, or None."""
    lora = metadata.get("lora")
    if lora is None:
        return None
    from eqmoe.lora import LoRAConfig

    try:
        return LoRAConfig(**{**lora, "targets": tuple(lora["targets"])})
    except (TypeError, KeyError, ValueError) as error:
        raise ValueError(f"{directory}: the checkpoint's LoRA settings are invalid ({error})") from None


def _with_lora(model: Transformer, lora) -> Transformer:
    """``model`` with (fresh) adapters for ``lora``: the tree shape the checkpoint's values are read into."""
    if lora is None:
        return model
    from eqmoe.lora import add_lora

    return add_lora(model, lora, key=jax.random.key(0))
