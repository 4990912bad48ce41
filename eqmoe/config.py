"""Model configuration: frozen dataclasses, validated on construction.

Every field that changes the architecture lives here, so an ablation is one field and a preset is one
value. Validation happens in ``__post_init__`` and raises ``ValueError`` naming the field, the value
given and what is allowed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from eqmoe._checks import EXECUTION, OBJECTIVE, _check, _one_of, _positive, execution, objective  # noqa: F401
from eqmoe._checks import is_number as _is_number
from eqmoe.latent_attention import LatentAttentionConfig  # noqa: F401 (part of the config API)
from eqmoe.linear_attention import LinearAttentionConfig  # noqa: F401 (part of the config API)
from eqmoe.rope_scaling import ROPE_TYPES, RopeScaling  # noqa: F401 (part of the config API)

DType = Literal["float32", "bfloat16", "float16"]
_DTYPES = ("float32", "bfloat16", "float16")


def field_kind(owner: object, name: str) -> str:
    """``"architecture"``, ``"execution"`` or ``"objective"``: the declared kind of field ``name`` of
    the config dataclass (or instance) ``owner``."""
    for item in dataclasses.fields(owner):
        if item.name == name:
            return item.metadata.get("kind", "architecture")
    raise ValueError(f"{getattr(owner, '__name__', type(owner).__name__)} has no field {name!r}")


@dataclass(frozen=True)
class AttentionConfig:
    """Grouped-query attention with rotary positions and optional per-head QK-norm.

    ``rope_layout``: ``"half_split"`` rotates dimension ``i`` with ``i + head_dim/2`` (HF, MaxText);
    ``"interleaved"`` rotates pairs ``(2i, 2i+1)`` (AXLearn, GPT-J).
    ``qk_norm``: RMSNorm over ``head_dim`` on queries and keys ``"before_rope"`` (HF Qwen3, MaxText Envy)
    or ``"after_rope"`` (AXLearn Envy, where the query scale ``head_dim^-0.5`` follows the norm).
    ``qk_norm_scope``: ``"head"`` norms each head over ``head_dim`` with one scale shared by all heads;
    ``"projection"`` norms the whole query (``heads * head_dim``) and key (``kv_heads * head_dim``) projection
    before it is split into heads (OLMoE; ``before_rope`` only).
    ``rope_scaling``: ``None`` for plain RoPE, else how its frequencies are stretched for long contexts
    (:class:`RopeScaling`: Hugging Face's ``linear``, ``yarn`` and ``llama3``).
    ``rotary_dim``: ``None`` rotates the whole head; else only its first ``rotary_dim`` dimensions rotate (with
    frequencies of a ``rotary_dim``-wide head) and the rest pass through (GLM-4.5's partial RoPE).
    ``bias``: biases on the query/key/value projections (``"qkv"``: Qwen2-MoE, GLM-4.5) or on those and the
    output projection (``"qkvo"``: OLMoE's ``attention_bias``).
    ``clip_qkv``: queries, keys and values clamped to ``[-clip_qkv, clip_qkv]`` after biases and QK-norm, before
    RoPE (OLMoE's ``clip_qkv``).
    ``sinks``: one learned logit per query head that joins every query's softmax and is dropped after it, taking
    a share of the probability without a value (gpt-oss's attention sinks; every backend but ``cudnn``).
    ``sliding_cache``: how a sliding layer (``LayerKind.window``) keeps keys while decoding: ``"ring"`` keeps only
    its window, a ring of ``window`` slots; ``"full"`` keeps every slot as a full layer does (same tokens).
    ``output_gate``: the query projection gives each head a second ``head_dim`` block (query first, gate second, as
    the checkpoint holds ``q_proj``), and the attention output is multiplied by ``sigmoid(gate)`` before the output
    projection (Qwen3-Next's gated attention).
    ``linear``: the widths of gated DeltaNet linear attention (:class:`LinearAttentionConfig`), read by the
    ``gated_deltanet`` attention kind of a hybrid model's linear layers; ``None`` for models without one.
    ``latent``: the widths of multi-head latent attention (:class:`LatentAttentionConfig`), read by the ``mla``
    attention kind (DeepSeek-V2/V3), whose ``head_dim`` is the query/key width and ``num_kv_heads`` equals
    ``num_heads``; ``None`` for the other kinds.
    ``backend`` computes the scores (every backend gives the same numbers), a name registered in
    :data:`eqmoe.registries.ATTENTION_BACKENDS` or ``"auto"``: ``"blockwise"`` is flash-style
    attention in ``block_size`` tiles, memory linear in length, masked tiles skipped; ``"dense"`` is the
    reference that materialises every score; ``"cudnn"`` is cuDNN's fused kernel (GPU, half precision,
    plain causal masks); ``"auto"`` is chosen by timing the eligible backends on a training run's shapes
    (:mod:`eqmoe.autotune`: ``dense`` only where a whole row fits in one tile), else it picks ``cudnn`` where it
    applies and ``blockwise`` elsewhere.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1e6
    rope_layout: Literal["half_split", "interleaved"] = "half_split"
    qk_norm: Literal["none", "before_rope", "after_rope"] = "before_rope"
    qk_norm_scope: Literal["head", "projection"] = "head"
    rope_scaling: RopeScaling | None = None
    rotary_dim: int | None = None
    bias: Literal["none", "qkv", "qkvo"] = "none"
    clip_qkv: float | None = None
    sinks: bool = False
    output_gate: bool = False
    latent: LatentAttentionConfig | None = None
    linear: LinearAttentionConfig | None = None
    backend: str = execution("auto")
    block_size: int = execution(256)
    sliding_cache: Literal["ring", "full"] = execution("ring")

    def __post_init__(self):
        _positive(
            "AttentionConfig",
            block_size=self.block_size,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rope_theta=self.rope_theta,
        )
        _check(
            self.num_heads % self.num_kv_heads == 0,
            "AttentionConfig",
            "num_kv_heads",
            self.num_kv_heads,
            f"a divisor of num_heads={self.num_heads}",
        )
        _check(
            self.head_dim % 2 == 0,
            "AttentionConfig",
            "head_dim",
            self.head_dim,
            "an even number (RoPE rotates pairs of dimensions)",
        )
        _one_of("AttentionConfig", "rope_layout", self.rope_layout, ("half_split", "interleaved"))
        _one_of("AttentionConfig", "qk_norm", self.qk_norm, ("none", "before_rope", "after_rope"))
        _one_of("AttentionConfig", "qk_norm_scope", self.qk_norm_scope, ("head", "projection"))
        _check(
            self.qk_norm_scope == "head" or self.qk_norm == "before_rope",
            "AttentionConfig",
            "qk_norm_scope",
            self.qk_norm_scope,
            f"'head' (qk_norm={self.qk_norm!r}; a whole-projection norm runs before RoPE only)",
        )
        _one_of("AttentionConfig", "bias", self.bias, ("none", "qkv", "qkvo"))
        _one_of("AttentionConfig", "sliding_cache", self.sliding_cache, ("ring", "full"))
        rotary = self.rotary_dim
        _check(
            rotary is None or (isinstance(rotary, int) and 0 < rotary <= self.head_dim and rotary % 2 == 0),
            "AttentionConfig",
            "rotary_dim",
            rotary,
            f"None | an even number in 2..head_dim={self.head_dim}",
        )
        _check(
            rotary is None or self.rope_layout == "half_split",
            "AttentionConfig",
            "rotary_dim",
            rotary,
            "None with rope_layout='interleaved'",
        )
        _check(
            self.clip_qkv is None or (_is_number(self.clip_qkv) and self.clip_qkv > 0),
            "AttentionConfig",
            "clip_qkv",
            self.clip_qkv,
            "None | a positive number",
        )
        latent = self.latent
        _check(
            latent is None or isinstance(latent, LatentAttentionConfig),
            "AttentionConfig",
            "latent",
            latent,
            "None | a LatentAttentionConfig",
        )
        _check(
            latent is None or latent.rope_dim < self.head_dim,
            "AttentionConfig",
            "head_dim",
            self.head_dim,
            f"more than latent.rope_dim={getattr(latent, 'rope_dim', None)} (head_dim is nope + rope widths)",
        )
        _check(
            self.linear is None or isinstance(self.linear, LinearAttentionConfig),
            "AttentionConfig",
            "linear",
            self.linear,
            "None | a LinearAttentionConfig",
        )
        scaling = self.rope_scaling
        _check(
            scaling is None or isinstance(scaling, RopeScaling),
            "AttentionConfig",
            "rope_scaling",
            scaling,
            "None | a RopeScaling",
        )


@dataclass(frozen=True)
class NormConfig:
    """RMSNorm settings and where the FFN's norm sits.

    ``ffn_placement``, a name registered in :data:`eqmoe.registries.NORM_PLACEMENTS`: ``"pre"`` is
    ``x + ffn(norm(x))``; ``"post"`` is ``norm(x + ffn(x))``;
    ``"hybrid"`` is ``x + postnorm(ffn(prenorm(x)))`` (AXLearn's names).
    ``stats_dtype``: the mean square is taken in ``"float32"`` (HF) or in the ``"input"`` dtype (AXLearn).
    ``zero_centered``: every norm's scale is held as its offset from 1, initialised at 0 and applied as ``1 + w``
    in float32 before the cast back (Qwen3-Next's and Qwen3.5's RMSNorm; weight decay pulls the scale to 1).
    """

    eps: float = 1e-6
    ffn_placement: str = "pre"
    stats_dtype: Literal["float32", "input"] = "float32"
    zero_centered: bool = False

    def __post_init__(self):
        _positive("NormConfig", eps=self.eps)
        _one_of("NormConfig", "stats_dtype", self.stats_dtype, ("float32", "input"))


@dataclass(frozen=True)
class RouterConfig:
    """Which experts a token goes to and with what weight.

    ``strategy``, a name registered in :data:`eqmoe.registries.ROUTER_STRATEGIES` (built in, in
    :mod:`eqmoe.nn.router`; a new one is a function and a registration):

    - ``"softmax_top_k"``: softmax over all experts, the ``top_k`` largest; divided by their sum when
      ``renormalize`` (HF Qwen3 ``norm_topk_prob``). ``top_k=1, renormalize=False`` is Switch routing.
    - ``"top_k_softmax"``: the ``top_k`` largest logits, softmax over those only (MaxText).
    - ``"top2_gating"``: AXLearn Top2Gating: softmax, top-2, ``g_i / (g1 + g2 + 1e-9)``.
    - ``"sigmoid_top_k"``: independent ``sigmoid(logit)`` scores, the ``top_k`` largest, divided by their
      sum when ``renormalize`` (DeepSeek-V3).

    ``bias_update_rate > 0`` gives the router a per-expert selection bias (aux-loss-free balancing,
    DeepSeek-V3): experts are chosen by ``score + bias`` but weighted by the score alone, and after
    every optimizer step the train step moves the bias by ``rate * sign(mean load - load)`` (the bias
    is not trained by the gradient and not decayed). ``routed_scaling_factor`` multiplies the final
    combine weights (DeepSeek-V3 uses 2.5 with renormalised sigmoid scores).

    ``capacity_factor`` (``None`` = dropless) caps each expert at ``max(1, int(S * factor / E))``
    assignments per group of ``S`` tokens (the batch's tokens split into ``num_groups`` groups); every
    rank-1 assignment is placed before any rank-2 one, earlier tokens first within a rank; a dropped
    assignment contributes nothing and the kept weights are not renormalised.

    ``expert_groups > 1`` is DeepSeek-V3's group-limited routing: the experts split into ``expert_groups``
    contiguous groups, each scored by the sum of its two best choice scores (the strategy's scores plus the
    selection bias), and the top-k is taken among the experts of the ``expert_groups_kept`` best groups only
    (``None``: every group). ``expert_group_score`` says how a group is scored: ``"top2_sum"`` (DeepSeek-V3, the sum
    of its two best) or ``"max"`` (DeepSeek-V2's ``group_limited_greedy``, its best).

    ``gate_bias`` gives the router's linear gate a trained bias, ``logits = x @ W + b`` (gpt-oss).
    """

    num_experts: int
    top_k: int
    strategy: str = "softmax_top_k"
    renormalize: bool = True
    capacity_factor: float | None = None
    num_groups: int = 1
    bias_update_rate: float = 0.0
    routed_scaling_factor: float = 1.0
    expert_groups: int = 1
    expert_groups_kept: int | None = None
    expert_group_score: Literal["top2_sum", "max"] = "top2_sum"
    gate_bias: bool = False

    def __post_init__(self):
        _positive("RouterConfig", num_experts=self.num_experts, top_k=self.top_k, num_groups=self.num_groups)
        _check(self.bias_update_rate >= 0, "RouterConfig", "bias_update_rate", self.bias_update_rate, "a number >= 0")
        _check(
            self.top_k <= self.num_experts, "RouterConfig", "top_k", self.top_k, f"1..num_experts={self.num_experts}"
        )
        _positive("RouterConfig", expert_groups=self.expert_groups)
        groups, kept = self.expert_groups, self.expert_groups_kept
        _check(
            self.num_experts % groups == 0,
            "RouterConfig",
            "expert_groups",
            groups,
            f"a divisor of num_experts={self.num_experts}",
        )
        _one_of("RouterConfig", "expert_group_score", self.expert_group_score, ("top2_sum", "max"))
        _check(
            groups == 1 or self.num_experts // groups >= 2 or self.expert_group_score == "max",
            "RouterConfig",
            "expert_groups",
            groups,
            "1, or groups of at least 2 experts (a group scores by its two best)",
        )
        _check(kept is None or 1 <= kept <= groups, "RouterConfig", "expert_groups_kept", kept, f"None | 1..{groups}")
        eligible = (groups if kept is None else kept) * (self.num_experts // groups)
        _check(
            self.top_k <= eligible,
            "RouterConfig",
            "top_k",
            self.top_k,
            f"1..{eligible} (the experts of the expert_groups_kept={kept} groups)",
        )
        _positive("RouterConfig", routed_scaling_factor=self.routed_scaling_factor)
        if self.capacity_factor is not None:
            _positive("RouterConfig", capacity_factor=self.capacity_factor)


@dataclass(frozen=True)
class LossConfig:
    """Which losses enter the training objective, and with what weights (all are reported regardless).

    ``load_balance`` picks the load-balancing form that is trained, a name registered in
    :data:`eqmoe.registries.LOAD_BALANCE` (every registered form is reported):

    - ``"hf_pooled"``: HF ``E * sum_e f_e P_e`` with top-k fractions pooled over all MoE layers and tokens;
    - ``"axlearn_top1"``: ``E^2 * mean_{groups, e}(f_e P_e)`` with ``f_e`` the top-1 fraction, per layer;
    - ``"maxtext_sequence"``: ``E^2 * mean_{d, e}(density P)`` per packed document ``d`` (a row holds several),
      averaged over layers;
    - ``"micro_batch"``: ``hf_pooled`` taken on each slice of ``balance_micro_batch_rows`` consecutive rows alone and
      averaged over the slices (Qiu et al. 2025's micro-batch balance; ``hf_pooled`` is their global batch). The
      rows are those of one forward pass: with gradient accumulation, of each accumulated micro-batch. When
      ``balance_micro_batch_rows`` does not divide them, the last slice holds the rows left over (and counts as
      much as a whole one). With ``balance_micro_batch_rows`` the rows each device holds, each device's rows are
      balanced alone.

    ``router_z_loss_weight`` multiplies ``mean(logsumexp(router_logits)^2)``; ``output_z_loss_weight``
    multiplies ``mean(logsumexp(output_logits)^2)`` over the target tokens. ``mtp_weight`` multiplies the mean over
    the multi-token-prediction depths of their cross-entropy (DeepSeek-V3's lambda: 0.3, then 0.1; needs
    ``ModelConfig.mtp_layers``).
    """

    load_balance: str = "hf_pooled"
    load_balance_weight: float = 0.001
    router_z_loss_weight: float = 0.0
    output_z_loss_weight: float = 0.0
    mtp_weight: float = 0.0
    balance_micro_batch_rows: int = 1

    def __post_init__(self):
        for name in ("load_balance_weight", "router_z_loss_weight", "output_z_loss_weight", "mtp_weight"):
            _check(getattr(self, name) >= 0, "LossConfig", name, getattr(self, name), "a number >= 0")
        rows = self.balance_micro_batch_rows
        _check(
            isinstance(rows, int) and not isinstance(rows, bool) and rows >= 1,
            "LossConfig",
            "balance_micro_batch_rows",
            rows,
            "an integer >= 1",
        )


@dataclass(frozen=True)
class MoEConfig:
    """A routed-expert FFN: the router, each expert's SwiGLU width and the dispatch backend.

    ``dispatch``, a backend registered in :data:`eqmoe.registries.DISPATCH_BACKENDS` (with its planner estimate)
    or ``"auto"``: ``"dense"`` runs every expert on every token (the reference); ``"sorted"`` sorts
    token slots by expert into blocks of ``block_size`` rows and runs grouped matmuls (dropless);
    ``"ragged_dot"`` sorts them without padding and calls ``jax.lax.ragged_dot`` (dropless, the GPU/TPU
    path); ``"capacity"`` is the GShard einsum over ``[groups, S, E, C]`` buffers (needs a capacity
    factor); ``"auto"`` is chosen by timing every eligible backend on a training run's shapes
    (:mod:`eqmoe.autotune`), else (``EQMOE_AUTO=rule``, meshes, inference) it picks ``capacity`` for capacity
    routing, ``sorted`` on CPU and ``ragged_dot`` on accelerators.
    Every backend gives the same numbers for the same routing.

    ``shared_experts`` SwiGLU experts of width ``shared_expert_dim`` (``None``: ``expert_dim``) see every token
    and are added to the routed output; being all active they are one SwiGLU of width
    ``shared_experts * shared_expert_dim`` (GLM-4.5, DeepSeek). ``shared_expert_gate`` multiplies their output
    by ``sigmoid(x @ w)``, one learned scalar gate per token (Qwen2-MoE).

    ``activation``, a name registered in :data:`eqmoe.registries.FFN_ACTIVATIONS`, is the routed experts' gated unit
    between their input and output sides (:mod:`eqmoe.nn.activations`): ``"swiglu"`` is ``silu(gate) * up``;
    ``"clamped_swiglu"`` is gpt-oss's ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)`` with the gate clamped above
    at ``swiglu_limit`` and up clamped to ``+-swiglu_limit`` (the two constants are read by it alone).
    ``expert_bias`` gives every routed expert's gate, up and down matrices a bias (gpt-oss).
    """

    router: RouterConfig
    expert_dim: int
    shared_experts: int = 0
    shared_expert_dim: int | None = None
    shared_expert_gate: bool = False
    activation: str = "swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    expert_bias: bool = False
    dispatch: str = execution("auto")
    block_size: int = execution(64)

    def __post_init__(self):
        _positive("MoEConfig", expert_dim=self.expert_dim, block_size=self.block_size)
        _positive("MoEConfig", swiglu_alpha=self.swiglu_alpha, swiglu_limit=self.swiglu_limit)
        _check(self.shared_experts >= 0, "MoEConfig", "shared_experts", self.shared_experts, "an integer >= 0")
        if self.shared_expert_dim is not None:
            _positive("MoEConfig", shared_expert_dim=self.shared_expert_dim)
        _check(
            self.shared_experts > 0 or not self.shared_expert_gate,
            "MoEConfig",
            "shared_expert_gate",
            self.shared_expert_gate,
            "False (shared_experts=0: nothing to gate)",
        )

    @property
    def shared_width(self) -> int:
        """The width of the one SwiGLU the shared experts make up (0 without any)."""
        return self.shared_experts * (self.shared_expert_dim or self.expert_dim)


@dataclass(frozen=True)
class LayerKind:
    """What one decoder layer is: its attention kind, its FFN kind and the keys its attention may see.

    ``attention`` and ``ffn`` are names registered in :data:`eqmoe.registries.ATTENTION_KINDS` (built in:
    ``"gqa"``, grouped-query attention configured by ``ModelConfig.attention``) and
    :data:`eqmoe.registries.FFN_KINDS` (``"dense"``: a SwiGLU of width ``ModelConfig.mlp_dim``; ``"moe"``: routed
    experts configured by ``ModelConfig.moe``). ``window`` makes the layer's attention sliding: query ``q`` sees
    keys ``k`` with ``q - window < k <= q`` (Hugging Face's ``sliding_attention`` layers); ``None`` sees every
    earlier key. A per-layer list of these is Hugging Face's ``layer_types`` and ``mlp_only_layers`` in one.
    """

    attention: str = "gqa"
    ffn: str = "moe"
    window: int | None = None

    def __post_init__(self):
        for name in ("attention", "ffn"):
            value = getattr(self, name)
            _check(isinstance(value, str) and bool(value), "LayerKind", name, value, "a registered name")
        window = self.window
        _check(
            window is None or (isinstance(window, int) and not isinstance(window, bool) and window > 0),
            "LayerKind",
            "window",
            window,
            "None | a positive number of keys",
        )

    def __str__(self) -> str:
        window = "" if self.window is None else f", window {self.window}"
        return f"{self.attention}/{self.ffn}{window}"


def layer_kind(value: LayerKind | str | dict) -> LayerKind:
    """A :class:`LayerKind` from itself, from an FFN kind's name (``"moe"``: grouped-query attention and routed
    experts) or from a dictionary of its fields."""
    if isinstance(value, LayerKind):
        return value
    if isinstance(value, str):
        return LayerKind(ffn=value)
    if isinstance(value, dict):
        try:
            return LayerKind(**value)
        except TypeError as error:
            raise ValueError(f"LayerKind: {error}") from None
    raise ValueError(f"ModelConfig.layers entry {value!r} is invalid; allowed: a LayerKind, an FFN kind name or a dict")


@dataclass(frozen=True)
class Segment:
    """``repeats`` copies of a repeat unit of layers, run as one ``lax.scan`` (derived from
    ``ModelConfig.layers`` by :func:`segments`, never configured)."""

    unit: tuple[LayerKind, ...]
    repeats: int

    @property
    def num_layers(self) -> int:
        return len(self.unit) * self.repeats


def segments(layers: tuple[LayerKind, ...]) -> tuple[Segment, ...]:
    """Cover a per-layer list with as few scanned segments as possible.

    Greedy from the left: at each position take the unit, repeated at least twice, whose repetitions cover the
    most layers (the shortest such unit on a tie), or else a single layer. Envy's ``("dense", "moe") * 6``
    becomes one segment of 6 repeats of a two-layer unit; ``["dense"] + ["moe"] * 5`` becomes a one-layer
    segment and a 5-repeat one; 24 alternating sliding and full layers are 12 repeats of one unit.
    """
    kinds = tuple(layers)
    if not kinds:
        raise ValueError("segments: at least one layer is needed")
    found = []
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
        found.append(Segment(unit=kinds[start : start + best_period], repeats=best_repeats))
        start += best_period * best_repeats
    return tuple(found)


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer LM, one :class:`LayerKind` per layer (its attention and FFN kinds).

    ``layers`` lists the layers in checkpoint order; runs of a repeating unit are stacked and scanned
    (:func:`segments`), so depth costs no compile time. An entry may be written as an FFN kind's name
    (``("moe",) * 48``), which is grouped-query attention with that FFN.
    ``mlp_dim`` is the width of the dense FFN blocks (unused when every block is MoE).
    ``dtype`` is the compute dtype, ``param_dtype`` the storage dtype of the parameters.
    ``scan_layers=False`` unrolls each segment into a Python loop (same numbers, larger program).
    ``remat="block"`` recomputes each repeat unit's activations in the backward pass.
    ``init``: ``"normal"`` draws every weight from N(0, init_std^2) (HF ``initializer_range``);
    ``"fan_in"`` uses variance 1/fan_in for weights and 1/embed_dim for the embedding (AXLearn).
    ``tied_logit_scale``: with tied embeddings, logits are ``x @ E^T`` (``"none"``) or that times
    ``embed_dim^-0.5`` (``"rsqrt_embed"``, MaxText).
    ``mtp_layers``: multi-token-prediction layers kept after the decoder (DeepSeek-V3's ``num_nextn_predict_layers``,
    :class:`eqmoe.nn.mtp.MTPLayer`); the causal LM's output and loss do not read them. ``mtp_layers_declared``: what a
    ``config.json`` declares when its folder holds fewer (transformers saves ``num_nextn_predict_layers: 1`` and no
    such layer), written back by exports; ``None``: ``mtp_layers``.
    ``family``: the :mod:`eqmoe.models` family whose checkpoint formats read and write this config
    (``"qwen3_moe"``, whose Hugging Face format also holds the generic decoder's defaults, or ``"envy"``).

    Every field here and in the nested configs is one of three kinds, declared where it is defined
    (:func:`field_kind`):

    - **architecture** (no declaration): the parameters and the function they compute, so what a
      checkpoint holds: widths, layers, routing, norms, initialisation, ``param_dtype``, ``family``.
      A ``--resume`` or :meth:`Transformer.with_config` needs these equal
      (:func:`eqmoe.config_io.architecture_differences`).
    - **execution** (:func:`execution`): how that function is computed, the same numbers up to float
      rounding: ``dtype``, ``scan_layers``, ``remat``, ``moe.dispatch``, ``moe.block_size``,
      ``attention.backend``, ``attention.block_size``.
    - **objective** (:func:`objective`): what training minimises: ``loss`` (every field of it).

    A resumed run may change the execution and objective fields; it continues with the new ones.
    """

    vocab_size: int
    embed_dim: int
    attention: AttentionConfig
    layers: tuple[LayerKind | str, ...]  # read as LayerKind: a name is an FFN kind with grouped-query attention
    mlp_dim: int | None = None
    moe: MoEConfig | None = None
    norm: NormConfig = field(default_factory=NormConfig)
    loss: LossConfig = objective(default_factory=LossConfig)
    tie_embeddings: bool = False
    tied_logit_scale: Literal["none", "rsqrt_embed"] = "none"
    init: Literal["normal", "fan_in"] = "normal"
    init_std: float = 0.02
    dtype: DType = execution("float32")
    # param_dtype is architecture: it is the dtype of the arrays a checkpoint stores (parameters and the
    # optimizer's moments) and of a Hugging Face export. Changing it is a cast of the checkpoint, not
    # another way to run it: restoring float32 master weights as bfloat16 loses the small updates the
    # rest of the run would add. The compute dtype (``dtype``) is execution; sft and pretrain keep
    # param_dtype float32 whatever --dtype says, so their resumes may change --dtype.
    param_dtype: DType = "float32"
    scan_layers: bool = execution(True)
    remat: Literal["none", "block"] = execution("none")
    mtp_layers: int = 0
    mtp_layers_declared: int | None = execution(None)
    family: str = "qwen3_moe"

    def __post_init__(self):
        _positive("ModelConfig", vocab_size=self.vocab_size, embed_dim=self.embed_dim, init_std=self.init_std)
        _check(bool(self.family), "ModelConfig", "family", self.family, "a registered model family name")
        layers = self.layers if isinstance(self.layers, tuple | list) else ()
        _check(len(layers) > 0, "ModelConfig", "layers", self.layers, "a non-empty tuple of LayerKind")
        object.__setattr__(self, "layers", tuple(layer_kind(layer) for layer in layers))
        _one_of("ModelConfig", "dtype", self.dtype, _DTYPES)
        _one_of("ModelConfig", "param_dtype", self.param_dtype, _DTYPES)
        _one_of("ModelConfig", "remat", self.remat, ("none", "block"))
        _one_of("ModelConfig", "init", self.init, ("normal", "fan_in"))
        _one_of("ModelConfig", "tied_logit_scale", self.tied_logit_scale, ("none", "rsqrt_embed"))
        mtp = self.mtp_layers
        _check(
            isinstance(mtp, int) and not isinstance(mtp, bool) and mtp >= 0,
            "ModelConfig",
            "mtp_layers",
            mtp,
            "an integer >= 0",
        )
        _check(
            self.loss.mtp_weight == 0 or mtp > 0,
            "ModelConfig",
            "loss.mtp_weight",
            self.loss.mtp_weight,
            "0 (mtp_layers=0: no multi-token-prediction layer to train)",
        )

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def ffn_kinds(self) -> tuple[str, ...]:
        """The FFN kind of every layer in order, as a checkpoint numbers them."""
        return tuple(layer.ffn for layer in self.layers)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)
