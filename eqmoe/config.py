"""Model configuration: frozen dataclasses, validated on construction.

Every field that changes the architecture lives here, so an ablation is one field and a preset is one
value. Validation happens in ``__post_init__`` and raises ``ValueError`` naming the field, the value
given and what is allowed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

DType = Literal["float32", "bfloat16", "float16"]
BlockKind = Literal["dense", "moe"]
_DTYPES = ("float32", "bfloat16", "float16")


def _check(condition: bool, owner: str, name: str, value: object, allowed: str) -> None:
    if not condition:
        raise ValueError(f"{owner}.{name}={value!r} is invalid; allowed: {allowed}")


def _positive(owner: str, **values: int | float) -> None:
    for name, value in values.items():
        _check(value > 0, owner, name, value, "a positive number")


def _one_of(owner: str, name: str, value: object, allowed: tuple) -> None:
    _check(value in allowed, owner, name, value, " | ".join(map(str, allowed)))


@dataclass(frozen=True)
class AttentionConfig:
    """Grouped-query attention with rotary positions and optional per-head QK-norm."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1e6
    rope_layout: Literal["half_split"] = "half_split"
    qk_norm: Literal["none", "before_rope"] = "before_rope"

    def __post_init__(self):
        _positive("AttentionConfig", num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                  head_dim=self.head_dim, rope_theta=self.rope_theta)
        _check(self.num_heads % self.num_kv_heads == 0, "AttentionConfig", "num_kv_heads", self.num_kv_heads,
               f"a divisor of num_heads={self.num_heads}")
        _check(self.head_dim % 2 == 0, "AttentionConfig", "head_dim", self.head_dim,
               "an even number (RoPE rotates pairs of dimensions)")
        _one_of("AttentionConfig", "rope_layout", self.rope_layout, ("half_split",))
        _one_of("AttentionConfig", "qk_norm", self.qk_norm, ("none", "before_rope"))


@dataclass(frozen=True)
class NormConfig:
    """RMSNorm settings and where the FFN's norm sits.

    ``ffn_placement``: ``"pre"`` is ``x + ffn(norm(x))``; ``"post"`` is ``norm(x + ffn(x))``;
    ``"hybrid"`` is ``x + postnorm(ffn(prenorm(x)))`` (AXLearn's names).
    """

    eps: float = 1e-6
    ffn_placement: Literal["pre", "post", "hybrid"] = "pre"

    def __post_init__(self):
        _positive("NormConfig", eps=self.eps)
        _one_of("NormConfig", "ffn_placement", self.ffn_placement, ("pre", "post", "hybrid"))


@dataclass(frozen=True)
class RouterConfig:
    """Which experts a token goes to and with what weight.

    ``renormalize`` divides the k selected weights by their sum (HF ``norm_topk_prob``).
    ``load_balance_weight`` and ``z_loss_weight`` are the coefficients of the router losses in the
    training objective (HF ``router_aux_loss_coef``; z-loss is ``mean(logsumexp(logits)^2)``).
    """

    num_experts: int
    top_k: int
    score: Literal["softmax"] = "softmax"
    renormalize: bool = True
    load_balance_weight: float = 0.001
    z_loss_weight: float = 0.0

    def __post_init__(self):
        _positive("RouterConfig", num_experts=self.num_experts, top_k=self.top_k)
        _check(self.top_k <= self.num_experts, "RouterConfig", "top_k", self.top_k,
               f"1..num_experts={self.num_experts}")
        _one_of("RouterConfig", "score", self.score, ("softmax",))
        for name in ("load_balance_weight", "z_loss_weight"):
            _check(getattr(self, name) >= 0, "RouterConfig", name, getattr(self, name), "a number >= 0")


@dataclass(frozen=True)
class MoEConfig:
    """A routed-expert FFN: the router, each expert's SwiGLU width and the dispatch backend.

    ``dispatch``: ``"dense"`` runs every expert on every token (the reference); ``"sorted"`` sorts
    token slots by expert into blocks of ``block_size`` rows and runs grouped matmuls (dropless);
    ``"auto"`` picks the fast backend for the platform.
    """

    router: RouterConfig
    expert_dim: int
    dispatch: Literal["dense", "sorted", "auto"] = "auto"
    block_size: int = 64

    def __post_init__(self):
        _positive("MoEConfig", expert_dim=self.expert_dim, block_size=self.block_size)
        _one_of("MoEConfig", "dispatch", self.dispatch, ("dense", "sorted", "auto"))


@dataclass(frozen=True)
class Segment:
    """``repeats`` copies of a repeat unit of blocks, run as one ``lax.scan``.

    Envy's stack is ``Segment(unit=("dense", "moe"), repeats=6)``; Qwen3-30B-A3B is
    ``Segment(unit=("moe",), repeats=48)``.
    """

    unit: tuple[BlockKind, ...]
    repeats: int

    def __post_init__(self):
        _check(len(self.unit) > 0, "Segment", "unit", self.unit, "a non-empty tuple of 'dense' | 'moe'")
        for kind in self.unit:
            _one_of("Segment", "unit", kind, ("dense", "moe"))
        _positive("Segment", repeats=self.repeats)

    @property
    def num_layers(self) -> int:
        return len(self.unit) * self.repeats


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer LM whose FFNs are dense SwiGLUs or routed experts.

    ``mlp_dim`` is the width of the dense FFN blocks (unused when every block is MoE).
    ``dtype`` is the compute dtype, ``param_dtype`` the storage dtype of the parameters.
    ``scan_layers=False`` unrolls each segment into a Python loop (same numbers, larger program).
    ``remat="block"`` recomputes each repeat unit's activations in the backward pass.
    """

    vocab_size: int
    embed_dim: int
    attention: AttentionConfig
    layers: tuple[Segment, ...]
    mlp_dim: int | None = None
    moe: MoEConfig | None = None
    norm: NormConfig = field(default_factory=NormConfig)
    tie_embeddings: bool = False
    init_std: float = 0.02
    dtype: DType = "float32"
    param_dtype: DType = "float32"
    scan_layers: bool = True
    remat: Literal["none", "block"] = "none"

    def __post_init__(self):
        _positive("ModelConfig", vocab_size=self.vocab_size, embed_dim=self.embed_dim, init_std=self.init_std)
        _check(len(self.layers) > 0, "ModelConfig", "layers", self.layers, "at least one Segment")
        kinds = {kind for segment in self.layers for kind in segment.unit}
        if "moe" in kinds:
            _check(self.moe is not None, "ModelConfig", "moe", self.moe, "a MoEConfig when a segment has 'moe'")
        if "dense" in kinds:
            _check(self.mlp_dim is not None and self.mlp_dim > 0, "ModelConfig", "mlp_dim", self.mlp_dim,
                   "a positive width when a segment has 'dense'")
        _one_of("ModelConfig", "dtype", self.dtype, _DTYPES)
        _one_of("ModelConfig", "param_dtype", self.param_dtype, _DTYPES)
        _one_of("ModelConfig", "remat", self.remat, ("none", "block"))

    @property
    def num_layers(self) -> int:
        return sum(segment.num_layers for segment in self.layers)

    def layer_kinds(self) -> tuple[BlockKind, ...]:
        """The kind of every layer in order, as a checkpoint numbers them."""
        return tuple(kind for segment in self.layers for _ in range(segment.repeats) for kind in segment.unit)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def segments_from_kinds(kinds: tuple[BlockKind, ...] | list[BlockKind]) -> tuple[Segment, ...]:
    """Cover a per-layer list of block kinds with as few scanned segments as possible.

    Greedy from the left: at each position take the unit, repeated at least twice, whose repetitions
    cover the most layers (the shortest such unit on a tie), or else a single layer.
    ``["dense", "moe"] * 3`` becomes ``(Segment(("dense", "moe"), 3),)``; ``["dense"] + ["moe"] * 5``
    becomes ``(Segment(("dense",), 1), Segment(("moe",), 5))``.
    """
    kinds = tuple(kinds)
    if not kinds:
        raise ValueError("segments_from_kinds: at least one layer is needed")
    segments = []
    start = 0
    while start < len(kinds):
        best_period, best_repeats = 1, 1
        for period in range(1, (len(kinds) - start) // 2 + 1):
            unit = kinds[start : start + period]
            repeats = 1
            while kinds[start + repeats * period : start + (repeats + 1) * period] == unit:
                repeats += 1
            if repeats >= 2 and period * repeats > best_period * best_repeats:
                best_period, best_repeats = period, repeats
        segments.append(Segment(unit=kinds[start : start + best_period], repeats=best_repeats))
        start += best_period * best_repeats
    return tuple(segments)
