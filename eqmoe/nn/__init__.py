"""Building blocks of the decoder, one concept per module."""

from eqmoe.nn._params import Layer, ParamInfo, Role, param, param_info, param_infos
from eqmoe.nn.attention import Attention, AttentionMask, attention_mask, causal_mask
from eqmoe.nn.block import Block
from eqmoe.nn.dispatch import Experts
from eqmoe.nn.mlp import SwiGLU
from eqmoe.nn.moe import MoE
from eqmoe.nn.norm import RMSNorm
from eqmoe.nn.rope import apply_rope, rope_tables
from eqmoe.nn.router import Router, RouterStats, Routing, router_stats, softmax_top_k
from eqmoe.nn.stack import RepeatedUnit

__all__ = [
    "Attention",
    "AttentionMask",
    "Block",
    "Experts",
    "Layer",
    "MoE",
    "ParamInfo",
    "RMSNorm",
    "RepeatedUnit",
    "Role",
    "Router",
    "RouterStats",
    "Routing",
    "SwiGLU",
    "apply_rope",
    "attention_mask",
    "param",
    "param_info",
    "param_infos",
    "causal_mask",
    "rope_tables",
    "router_stats",
    "softmax_top_k",
]
