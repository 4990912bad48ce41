"""eqmoe model checkpoints: a :class:`Transformer` in an orbax checkpoint with its config in the metadata.

Two kinds of orbax checkpoint hold a model and both load with :func:`load_model`: the ones
:func:`save_model` writes (the tree is the model itself; ``experiments.convert`` makes them from a
Hugging Face folder) and the training checkpoints of ``experiments.sft`` (the tree is a train state whose
``model`` field is read alone, without the optimizer state). Either way the metadata's ``config`` entry is
the :func:`eqmoe.config_io.config_to_dict` of the model's config.
"""

import os
import shutil
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from eqmoe.checkpoints._staging import staged_folder
from eqmoe.checkpoints.orbax import Checkpointer
from eqmoe.config_io import config_from_dict, config_to_dict
from eqmoe.model import Transformer

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
    directory: str | os.PathLike, *, step: int | None = None, dtype: str | None = None
) -> tuple[Transformer, dict[str, Any]]:
    """The model saved in ``directory`` at ``step`` (None: the latest) and that step's metadata.

    ``directory`` is either written by :func:`save_model` or a training run's ``checkpoints`` folder. A model
    trained with LoRA (``metadata["lora"]``) comes back with its adapters (``eqmoe.lora.merge_lora`` folds them).
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
        in_train_state = any(path.startswith(".model.") for path in checkpointer.leaf_paths(step))
        abstract = eqx.filter_eval_shape(_model_fn(metadata, directory), config)
        model, _ = checkpointer.restore(step, abstract, field="model" if in_train_state else None)
    if dtype is not None:
        name = jnp.dtype(dtype).name
        model = model.cast(name).with_config(config.replace(param_dtype=name, dtype=name), allow=("param_dtype",))
    return model, metadata


def _model_fn(metadata: dict[str, Any], directory: Path):
    """What builds the checkpoint's model: the config's, with the adapters its metadata records."""
    lora = metadata.get("lora")
    if lora is None:
        return lambda config: Transformer(config, key=jax.random.key(0))
    from eqmoe.lora import LoRAConfig, add_lora

    try:
        lora_config = LoRAConfig(**{**lora, "targets": tuple(lora["targets"])})
    except (TypeError, KeyError, ValueError) as error:
        raise ValueError(f"{directory}: the checkpoint's LoRA settings are invalid ({error})") from None
    return lambda config: add_lora(Transformer(config, key=jax.random.key(0)), lora_config, key=jax.random.key(0))
