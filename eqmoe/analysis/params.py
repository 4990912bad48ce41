"""Parameter counts and a per-parameter table, computed from shapes alone (nothing is allocated)."""

import math
from dataclasses import dataclass

import equinox as eqx
import jax

from eqmoe.config import ModelConfig
from eqmoe.model import Transformer
from eqmoe.params import param_infos


@dataclass(frozen=True)
class ParamRow:
    path: str
    shape: tuple[int, ...]
    count: int
    routed: bool  # part of the routed experts (only top_k of num_experts are active per token)


def abstract_model(config: ModelConfig) -> Transformer:
    """The model with ``jax.ShapeDtypeStruct`` leaves, built by ``eqx.filter_eval_shape``."""
    return eqx.filter_eval_shape(Transformer, config, key=jax.random.key(0))


def parameter_table(config: ModelConfig) -> list[ParamRow]:
    """One row per parameter array (stacked layers appear once, with their leading ``repeats`` axis)."""
    model = abstract_model(config)
    rows = []
    for (key_path, leaf), info in zip(jax.tree_util.tree_leaves_with_path(model), param_infos(model), strict=True):
        path = jax.tree_util.keystr(key_path, simple=True, separator=".")
        rows.append(ParamRow(path, tuple(leaf.shape), math.prod(leaf.shape), info.role.routed))
    return rows


def count_parameters(config: ModelConfig, rows: list[ParamRow] | None = None) -> tuple[int, int]:
    """``(total, active)``: active counts only ``top_k / num_experts`` of the routed-expert weights.

    ``rows`` is the :func:`parameter_table` of ``config`` when the caller already has it.
    """
    rows = parameter_table(config) if rows is None else rows
    total = sum(row.count for row in rows)
    routed = sum(row.count for row in rows if row.routed)
    if config.moe is None:
        return total, total
    router = config.moe.router
    return total, total - routed // router.num_experts * (router.num_experts - router.top_k)
