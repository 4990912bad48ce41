"""The attention part of a model's configuration (``ModelConfig.attention``): every attention kind reads its widths,
positions and backend from one :class:`AttentionConfig`, with the latent and linear kinds' own widths beside it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from eqmoe._checks import _check, _one_of, _positive, execution
from eqmoe._checks import is_number as _is_number
from eqmoe.latent_attention import LatentAttentionConfig
from eqmoe.linear_attention import LinearAttentionConfig
from eqmoe.rope_scaling import RopeScaling


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
    plain causal masks); ``"splash"`` is the TPU's Pallas flash kernel (self-attention over a multiple of 128
    tokens; its blocks are the largest multiple of 128 up to ``block_size`` that divides the length; off the TPU it
    runs in Pallas interpret mode, for checking); ``"auto"`` is chosen by timing the eligible backends on a
    training run's shapes (:mod:`eqmoe.autotune`: ``dense`` only where a whole row fits in one tile, ``splash`` on
    the TPU at each of its block sizes), else it picks ``splash`` on a TPU where it applies, ``cudnn`` where it
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
