"""Building blocks of the decoder, one concept per module; importing it registers the built-in parts."""

from eqmoe.nn import attention_backends, dispatch, gated_deltanet, gqa, mla, mlp, moe, routing_stats  # noqa: F401 (registrations)
from eqmoe.nn.block import Block
from eqmoe.nn.context import AttentionMask, Context, attention_mask, causal_mask
from eqmoe.nn.experts import RoutedExperts
from eqmoe.nn.gqa import GroupedQueryAttention
from eqmoe.nn.kinds import AttentionKind, Cost, FFNKind, PlanShape
from eqmoe.nn.linear import ExpertLinear, Linear, LowRank
from eqmoe.nn.mlp import SwiGLU
from eqmoe.nn.moe import MoE
from eqmoe.nn.norm import RMSNorm
from eqmoe.nn.rope import apply_rope, rope_tables
from eqmoe.nn.router import Router, Routing, softmax_top_k
from eqmoe.nn.routing_stats import RouterStats, layer_stats, router_stats
from eqmoe.nn.stack import RepeatedUnit
from eqmoe.params import Layer, ParamInfo, Role, param, param_info, param_infos

Attention = GroupedQueryAttention  # the name the first attention kind had
Experts = RoutedExperts

__all__ = [
    "Attention",
    "AttentionKind",
    "AttentionMask",
    "Block",
    "Context",
    "Cost",
    "ExpertLinear",
    "Experts",
    "FFNKind",
    "GroupedQueryAttention",
    "Layer",
    "Linear",
    "LowRank",
    "MoE",
    "ParamInfo",
    "PlanShape",
    "RMSNorm",
    "RepeatedUnit",
    "Role",
    "RoutedExperts",
    "Router",
    "RouterStats",
    "Routing",
    "SwiGLU",
    "apply_rope",
    "attention_mask",
    "causal_mask",
    "layer_stats",
    "param",
    "param_info",
    "param_infos",
    "rope_tables",
    "router_stats",
    "softmax_top_k",
]
