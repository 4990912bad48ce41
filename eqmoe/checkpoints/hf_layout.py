"""How a Hugging Face folder holds a model: its weight files' names, the files that travel beside them, and each
parameter's checkpoint name and torch layout (both ways), from the model's family (:mod:`eqmoe.models`)."""

import math
from pathlib import Path

import numpy as np

from eqmoe.config import ModelConfig
from eqmoe.models import family as families
from eqmoe.models.family import TensorName

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SIDE_FILES = (  # travel with the weights through conversions: tokenizer and generation settings
    "tokenizer.json",
    "tiktoken.model",  # Kimi K2's and Moonlight's tokenizer, in place of tokenizer.json
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
)


def side_files(folder: str | Path) -> list[Path]:
    """The :data:`SIDE_FILES` present in ``folder``, and the tokenizer code a tiktoken tokenizer's transformers
    loading needs (``tokenization_kimi.py``)."""
    folder = Path(folder)
    return [folder / name for name in SIDE_FILES if (folder / name).is_file()] + sorted(
        folder.glob("tokenization_*.py")
    )


def checkpoint_names(config: ModelConfig) -> list[TensorName]:
    """Every checkpoint tensor name of ``config``'s model, with where it lives in the model and its layout."""
    return families.get(config.family).checkpoint_names(config)


def leaf_at(tree, path: tuple[str | int, ...]):
    """The part of ``tree`` at ``path`` (attribute names and indices)."""
    for step in path:
        tree = tree[step] if isinstance(step, int) else getattr(tree, step)
    return tree


def to_model_layout(name: TensorName, tensor: np.ndarray, piece: tuple[int, ...]) -> np.ndarray:
    """A checkpoint tensor as the model holds it (``piece``: the shape of its part of the leaf)."""
    if name.columns is not None:
        start, step = name.columns
        return tensor[..., start::step]
    if name.flat or name.stored is not None:
        return tensor.reshape(piece)
    return tensor.T.reshape(piece) if name.linear_in_dims else tensor


def to_checkpoint_layout(name: TensorName, piece: np.ndarray) -> np.ndarray:
    """A model leaf's part as the checkpoint stores it: the inverse of :func:`to_model_layout`."""
    if name.flat:
        return piece.reshape(-1)
    if name.stored is not None:
        return piece.reshape(name.stored)
    if not name.linear_in_dims:
        return piece
    return piece.reshape(math.prod(piece.shape[: name.linear_in_dims]), -1).T
