"""Envy (Apple's Switch-style MoE, AXLearn ``experiments/text/gpt/envy.py``) and MaxText's port of it.

Every stack is ``repeats x (dense block, MoE block)`` with QK-norm and tied embeddings. The two readings
share shapes and parameter counts and differ in exactly these config fields:

| field                               | AXLearn (``envy-*``)            | MaxText (``envy-*-maxtext``)     |
|-------------------------------------|---------------------------------|----------------------------------|
| ``moe.router.strategy`` / ``top_k`` | ``top2_gating`` / 2             | ``top_k_softmax`` / 1            |
| ``moe.router.capacity_factor``      | 2.0 in 2 groups                 | ``None`` (dropless)              |
| ``attention.qk_norm``               | ``after_rope``                  | ``before_rope``                  |
| ``attention.rope_layout``           | ``interleaved``                 | ``half_split``                   |
| ``tied_logit_scale``                | ``none``                        | ``rsqrt_embed`` (1/sqrt(d))      |
| ``loss``                            | CE + 1e-6 output z; aux logged  | CE + 0.01 per-sequence balance   |
"""

import dataclasses
import re

from eqmoe.config import (
    AttentionConfig,
    LossConfig,
    ModelConfig,
    MoEConfig,
    NormConfig,
    RouterConfig,
)
from eqmoe.models.family import Family, register

NAME = "envy"

# (repeats, model dim, q heads, kv heads, head dim, FFN width = expert width, experts, vocab, FFN norm)
_SIZES = {
    "test": (2, 8, 4, 2, 2, 32, 8, 32, "pre"),
    "switch-base": (6, 1536, 12, 12, 128, 6144, 128, 32768, "hybrid"),
    "switch-large": (12, 2048, 16, 16, 128, 8192, 128, 32768, "hybrid"),
    "switch-xxl": (12, 8192, 64, 8, 128, 20480, 64, 32768, "hybrid"),
}


def axlearn_envy(size: str) -> ModelConfig:
    """The AXLearn reading: Top2Gating with capacity 2.0 in 2 groups, QK-norm after interleaved RoPE,
    unscaled tied logits, objective CE + 1e-6 * output z-loss (the MoE aux loss computed, weight 0).
    Parameters float32; the Switch sizes compute in bfloat16 as AXLearn trains them, ``test`` in float32."""
    repeats, dim, heads, kv_heads, head_dim, ffn, experts, vocab, placement = _SIZES[size]
    return ModelConfig(
        vocab_size=vocab,
        embed_dim=dim,
        attention=AttentionConfig(
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rope_theta=5e5,
            rope_layout="interleaved",
            qk_norm="after_rope",
        ),
        layers=("dense", "moe") * repeats,
        mlp_dim=ffn,
        moe=MoEConfig(
            router=RouterConfig(
                num_experts=experts, top_k=2, strategy="top2_gating", capacity_factor=2.0, num_groups=2
            ),
            expert_dim=ffn,
        ),
        norm=NormConfig(eps=1e-5, ffn_placement=placement, stats_dtype="input"),
        loss=LossConfig(load_balance="axlearn_top1", load_balance_weight=0.0, output_z_loss_weight=1e-6),
        tie_embeddings=True,
        tied_logit_scale="none",
        init="fan_in",
        dtype="float32" if size == "test" else "bfloat16",
        family=NAME,
    )


def maxtext_envy(size: str) -> ModelConfig:
    """MaxText's port: top-1 dropless with the weight a softmax over the selected logit (exactly 1.0),
    QK-norm before half-split RoPE, tied logits times 1/sqrt(d), objective CE + 0.01 * per-sequence
    load balance."""
    axlearn = axlearn_envy(size)
    return dataclasses.replace(
        axlearn,
        attention=dataclasses.replace(axlearn.attention, rope_layout="half_split", qk_norm="before_rope"),
        moe=dataclasses.replace(
            axlearn.moe,
            router=RouterConfig(num_experts=axlearn.moe.router.num_experts, top_k=1, strategy="top_k_softmax"),
        ),
        loss=LossConfig(load_balance="maxtext_sequence", load_balance_weight=0.01),
        tied_logit_scale="rsqrt_embed",
    )


PRESETS: dict[str, ModelConfig] = {
    **{f"envy-{size}": axlearn_envy(size) for size in _SIZES},
    **{f"envy-{size}-maxtext": maxtext_envy(size) for size in _SIZES},
}


# --- names of the same parameters in AXLearn and MaxText checkpoints ----------------------------------

_BLOCK = re.compile(r"segments\.0\.blocks\.(\d)\.(.+)")

# eqmoe leaf (within a block) -> (AXLearn name, MaxText name); AXLearn's layer0 is dense, layer1 MoE.
_BLOCK_NAMES = {
    "attn_norm.weight": ("self_attention/norm/scale", "pre_self_attention_layer_norm/scale"),
    "attention.q.weight": ("self_attention/attention/i_proj/i_proj/qkv_proj/weight[q]", "self_attention/query/kernel"),
    "attention.k.weight": ("self_attention/attention/i_proj/i_proj/qkv_proj/weight[k]", "self_attention/key/kernel"),
    "attention.v.weight": ("self_attention/attention/i_proj/i_proj/qkv_proj/weight[v]", "self_attention/value/kernel"),
    "attention.o.weight": ("self_attention/attention/o_proj/weight", "self_attention/out/kernel"),
    "attention.q_norm.weight": ("self_attention/attention/scale_query/norm/scale", "self_attention/query_norm/scale"),
    "attention.k_norm.weight": ("self_attention/attention/scale_key/norm/scale", "self_attention/key_norm/scale"),
    "pre_norm.weight": ("feed_forward/prenorm/scale", "post_self_attention_layer_norm/scale"),
    "post_norm.weight": ("feed_forward/postnorm/scale", "post_ffw_norm/scale"),
    "ffn.gate.weight": ("feed_forward/linear1_0/weight", "mlp/wi_0/kernel"),
    "ffn.up.weight": ("feed_forward/linear1_1/weight", "mlp/wi_1/kernel"),
    "ffn.down.weight": ("feed_forward/linear2/weight", "mlp/wo/kernel"),
    "ffn.router.gate.weight": ("feed_forward/gate_weight", "MoeBlock_0/gate/kernel"),
    "ffn.experts.gate.weight": ("feed_forward/wi_0_weight", "MoeBlock_0/wi_0"),
    "ffn.experts.up.weight": ("feed_forward/wi_1_weight", "MoeBlock_0/wi_1"),
    "ffn.experts.down.weight": ("feed_forward/wo_weight", "MoeBlock_0/wo"),
}


@dataclasses.dataclass(frozen=True)
class ReferenceName:
    axlearn: str
    axlearn_shape: tuple[int, ...]
    maxtext: str
    maxtext_shape: tuple[int, ...]


def reference_name(path: str, shape: tuple[int, ...]) -> ReferenceName:
    """Where the eqmoe parameter ``path`` (of ``shape``) lives in AXLearn's and MaxText's Envy.

    AXLearn keeps the ``repeats`` axis first and fuses q, k and v into ``qkv_proj (d, nq + 2 nkv, hd)``
    (the ``[q]``/``[k]``/``[v]`` suffix names the slice) and stores ``o_proj`` as ``(d, nq, hd)``;
    MaxText's scanned layout puts the layer axis at position 1.
    """
    if path == "embed":
        return ReferenceName("decoder/emb/token_emb/weight", shape, "token_embedder/embedding", shape)
    if path == "final_norm.weight":
        return ReferenceName("decoder/output_norm/scale", shape, "decoder/decoder_norm/scale", shape)
    match = _BLOCK.fullmatch(path)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        raise ValueError(f"{path!r} is not an Envy parameter")
    layer, leaf = match.groups()
    axlearn, maxtext = _BLOCK_NAMES[leaf]
    repeats, *rest = shape
    axlearn_shape = shape
    if leaf == "attention.o.weight":  # (repeats, heads, head_dim, d) -> (repeats, d, heads, head_dim)
        axlearn_shape = (repeats, rest[2], rest[0], rest[1])
    maxtext_shape = (rest[0], repeats, *rest[1:]) if rest else (repeats,)
    if len(rest) == 1:  # scales: (d,) per layer -> (d, layers)
        maxtext_shape = (rest[0], repeats)
    prefix = f"decoder/transformer/repeat/layer/layer{layer}/"
    return ReferenceName(prefix + axlearn, axlearn_shape, f"decoder/layers/layer_{layer}/" + maxtext, maxtext_shape)


def reference_columns(path: str, shape: tuple[int, ...]) -> dict[str, str]:
    """The parameter report's columns: the parameter's name and shape in AXLearn and in MaxText."""
    name = reference_name(path, shape)

    def text(shape: tuple[int, ...]) -> str:
        return "x".join(map(str, shape)) or "scalar"

    return {
        "axlearn": name.axlearn,
        "axlearn shape": text(name.axlearn_shape),
        "maxtext": name.maxtext,
        "maxtext shape": text(name.maxtext_shape),
    }


# No Hugging Face format: the parameter report names each parameter in AXLearn and MaxText instead.
FAMILY = register(Family(name=NAME, presets=PRESETS, reference_columns=reference_columns))
