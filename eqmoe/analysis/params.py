"""Parameter counts and a per-parameter table, computed from shapes alone (nothing is allocated)."""

import math
from dataclasses import dataclass

import equinox as eqx
import jax

from eqmoe.config import ModelConfig
from eqmoe.model import Transformer
from eqmoe.params import Role, param_infos


@dataclass(frozen=True)
class ParamRow:
    path: str
    shape: tuple[int, ...]
    count: int
    routed: bool  # part of the routed experts (only top_k of num_experts are active per token)
    mtp: bool = False  # part of the multi-token-prediction layers (counted apart: the causal LM does not run them)


def abstract_model(config: ModelConfig) -> Transformer:
    """The model with ``jax.ShapeDtypeStruct`` leaves, built by ``eqx.filter_eval_shape``."""
    return eqx.filter_eval_shape(Transformer, config, key=jax.random.key(0))


def parameter_table(config: ModelConfig) -> list[ParamRow]:
    """One row per parameter array (stacked layers appear once, with their leading ``repeats`` axis)."""
    model = abstract_model(config)
    rows = []
    for (key_path, leaf), info in zip(jax.tree_util.tree_leaves_with_path(model), param_infos(model), strict=True):
        path = jax.tree_util.keystr(key_path, simple=True, separator=".")
        rows.append(ParamRow(path, tuple(leaf.shape), math.prod(leaf.shape), info.routed, info.role is Role.MTP))
    return rows


def count_parameters(config: ModelConfig, rows: list[ParamRow] | None = None) -> tuple[int, int]:
    """``(total, active)`` of the language model: active counts only ``top_k / num_experts`` of the routed-expert
    weights. The multi-token-prediction layers are not in either (:func:`count_mtp`), as transformers' causal LM
    does not build them.

    ``rows`` is the :func:`parameter_table` of ``config`` when the caller already has it.
    """
    rows = parameter_table(config) if rows is None else rows
    total = sum(row.count for row in rows if not row.mtp)
    routed = sum(row.count for row in rows if row.routed)
    if config.moe is None:
        return total, total
    router = config.moe.router
    return total, total - routed // router.num_experts * (router.num_experts - router.top_k)


def count_mtp(rows: list[ParamRow]) -> int:
    """The parameters of the multi-token-prediction layers (their copies of the embedding and head included)."""
    return sum(row.count for row in rows if row.mtp)
