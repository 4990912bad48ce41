"""The rows ``bench_model`` times: each a model shape and batch (:data:`SHAPES`), named with or without its pass
(:func:`row_and_pass`), checked after the command line's overrides (:func:`check_latent_and_groups`), built as a random
transformers model and the same weights loaded into eqmoe (:func:`build_models`)."""

import dataclasses
import tempfile
from dataclasses import dataclass
from typing import Literal

import numpy as np

from experiments._cli import UsageError


@dataclass(frozen=True)
class Shape:
    """One benchmark row: the model and the batch."""

    layers: int
    embed: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    expert_dim: int
    vocab: int
    batch: int
    seq: int
    family: Literal["qwen3_moe", "gpt_oss", "qwen3_next", "deepseek_v3"] = "qwen3_moe"
    """The transformers model: Qwen3-MoE, gpt-oss (sinks, biases, clamped SwiGLU, sliding and full layers),
    Qwen3-Next (gated DeltaNet linear layers and gated full attention, a shared expert) or DeepSeek-V3 (multi-head
    latent attention, sigmoid routing limited to groups, shared experts, dense first layers)."""
    window: int | None = None
    """gpt-oss: the window of its sliding layers (every even layer, as transformers alternates them)."""
    linear_heads: tuple[int, int] | None = None
    """Qwen3-Next: the linear layers' key heads and value heads, each of ``head_dim`` (every 4th layer is full)."""
    latent: tuple[int, int] | None = None
    """DeepSeek-V3: the query and key/value latent ranks of its attention; each head's unrotated part and its values
    are ``head_dim`` wide, its rotated part half that (its 128 and 64)."""
    groups: tuple[int, int] | None = None
    """DeepSeek-V3: ``(n_group, topk_group)``: a token's experts are chosen among the ``topk_group`` of ``n_group``
    equal groups whose two best scores sum highest."""
    shared_experts: int = 0
    """DeepSeek-V3: experts every token passes through beside its routed ones, each ``expert_dim`` wide."""
    dense_layers: int = 0
    """DeepSeek-V3: the first layers, whose FFN is one SwiGLU as wide as a token's experts together, routed and
    shared (its 18432 = 9 x 2048)."""

    def model_key(self) -> tuple:
        return dataclasses.astuple(dataclasses.replace(self, batch=0, seq=0))


_SMALL = dict(layers=4, embed=256, heads=4, kv_heads=2, head_dim=64, experts=16, top_k=2, expert_dim=512, vocab=2048)
_WIDE = dict(layers=2, embed=512, heads=8, kv_heads=4, head_dim=64, experts=32, top_k=4, expert_dim=1024, vocab=2048)
# gpt-oss-20b's proportions on two cores: one sliding layer (window 128) and one full, heads of 64 with 8 query heads
# per key/value head (its 64:8), 32 experts top-4 (its own), experts as wide as the model (its 2880 and 2880). It runs
# 1 x 8,192 tokens, where a window pays off; transformers' eager attention scores [8, 8192, 8192] float32 (2 GiB) in
# every layer, sliding or not: on a 2-core, 23 GiB machine its train step took 38 s (59 s the first), the process
# peaked at 13.8 GiB and ``--shape gpt-oss --breakdown --repeats 3`` took 12 minutes.
_GPT_OSS = dict(layers=2, embed=512, heads=8, kv_heads=1, head_dim=64, experts=32, top_k=4, expert_dim=512, vocab=2048)
# Qwen3-Next-80B-A3B's proportions: three gated DeltaNet layers and one full-attention layer (its 48 as 12 x 4), query
# heads 4 per key/value head (its 16:2 is 8), the linear layers' value heads twice their key heads (its 32:16), many
# experts a quarter as wide as the model (its 512 of 512 at 2048), top-4 and a shared expert as wide.
_QWEN3_NEXT = dict(
    layers=4, embed=256, heads=4, kv_heads=1, head_dim=64, experts=32, top_k=4, expert_dim=64, vocab=2048
)
# Qwen3-30B-A3B's proportions: 128 experts top-8 (its own), each a quarter of the model's width (its 768 at 2048), 8
# query heads per key/value head and the heads together twice the model's width (its 32 x 128 at 2048).
_FINE = dict(layers=4, embed=512, heads=16, kv_heads=2, head_dim=64, experts=128, top_k=8, expert_dim=128, vocab=2048)
# DeepSeek-V3's proportions where they fit: 256 experts top-8 in 8 groups of which a token searches its best 4, one
# shared expert (its own), experts about a quarter of the model's width (its 2048 at 7168), the heads together twice
# it (its 128 x 128), the first layer dense (its 3 of 61), a query latent three times the key/value one (its 1536 and
# 512). transformers' attention has as many key/value heads as query heads: the latent is expanded per head.
_DEEPSEEK = dict(
    layers=4, embed=512, heads=16, kv_heads=16, head_dim=64, experts=256, top_k=8, expert_dim=128, vocab=2048
)
_DEEPSEEK_PARTS = dict(family="deepseek_v3", latent=(384, 128), groups=(8, 4), shared_experts=1, dense_layers=1)
SHAPES = {
    "small": Shape(**_SMALL, batch=8, seq=256),
    "wide": Shape(**_WIDE, batch=4, seq=1024),
    "long": Shape(**_WIDE, batch=1, seq=4096),  # the "wide" model
    "fine": Shape(**_FINE, batch=4, seq=512),
    "deepseek": Shape(**_DEEPSEEK, batch=4, seq=512, **_DEEPSEEK_PARTS),
    "gpt-oss": Shape(**_GPT_OSS, batch=1, seq=8192, family="gpt_oss", window=128),
    "qwen3-next": Shape(**_QWEN3_NEXT, batch=1, seq=2048, family="qwen3_next", linear_heads=(2, 4)),
}
DEFAULT_ROWS = ("small", "wide", "long", "fine", "deepseek")  # gpt-oss's 12 minutes and qwen3-next run when asked for
PASSES = ("forward", "train")


def row_and_pass(entry: str) -> tuple[str, str]:
    """``NAME`` -> ``(NAME, "")``, ``NAME-PASS`` -> ``(NAME, PASS)``; a row's name may hold a dash (gpt-oss)."""
    name, _, pass_name = entry.rpartition("-")
    if entry in SHAPES or pass_name not in PASSES:
        return entry, ""
    return name, pass_name


def check_latent_and_groups(name: str, shape: Shape) -> None:
    """What a DeepSeek-V3 row's overrides must keep: a key/value head per query head (its attention expands the
    latent per head) and experts that split into the row's groups, enough of them kept to choose ``top_k``."""
    if shape.latent is not None and shape.kv_heads != shape.heads:
        raise UsageError(
            f"--kv-heads={shape.kv_heads} is invalid for --shape {name}: its latent attention has one key/value head "
            f"per query head; allowed: {shape.heads} (--heads)"
        )
    if shape.groups is not None:
        groups, kept = shape.groups
        if shape.experts % groups or shape.top_k > kept * (shape.experts // groups):
            raise UsageError(
                f"--experts={shape.experts} --top-k={shape.top_k} is invalid for --shape {name}: its experts split "
                f"into {groups} equal groups and a token chooses among {kept} of them; allowed: a multiple of {groups} "
                f"experts, top-k at most {kept} groups' experts"
            )


def expert_matmul_shape(shape: Shape) -> tuple[int, int, int]:
    """``(rows, inner, cols)`` of a routed expert's first product on the row's batch: the mean rows an expert is
    routed, the model's width, its gate and up projections together (both frameworks multiply them as one)."""
    rows = max(1, shape.batch * shape.seq * shape.top_k // shape.experts)
    return rows, shape.embed, 2 * shape.expert_dim


def build_models(shape: Shape, seed: int):
    """A random transformers model of the shape's family (eager attention and experts, eval mode) and the same
    weights as an eqmoe ``Transformer``, read back with ``eqmoe.checkpoints.hf.load`` from a ``save_pretrained``
    folder; both in float32."""
    import torch
    import transformers

    from eqmoe.checkpoints import hf

    config, model_class = {
        "qwen3_moe": (_qwen3_moe_config, transformers.Qwen3MoeForCausalLM),
        "gpt_oss": (_gpt_oss_config, transformers.GptOssForCausalLM),
        "qwen3_next": (_qwen3_next_config, transformers.Qwen3NextForCausalLM),
        "deepseek_v3": (_deepseek_v3_config, transformers.DeepseekV3ForCausalLM),
    }[shape.family]
    config = config(shape)
    torch.manual_seed(seed)
    reference = model_class(config).eval()
    _perturb_off_init(reference)
    with tempfile.TemporaryDirectory(prefix="bench_model_") as folder:
        reference.save_pretrained(folder)
        model = hf.load(folder)
    return reference, model


def _shared_fields(shape: Shape) -> dict:
    """The config fields the families name alike: the shape's widths, untied, eager attention and experts."""
    return dict(
        vocab_size=shape.vocab,
        hidden_size=shape.embed,
        intermediate_size=shape.expert_dim,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        num_experts_per_tok=shape.top_k,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="eager",
        experts_implementation="eager",
    )


def _qwen3_moe_config(shape: Shape):
    import transformers

    return transformers.Qwen3MoeConfig(
        **_shared_fields(shape),
        moe_intermediate_size=shape.expert_dim,  # intermediate_size is unused: every layer is MoE
        num_experts=shape.experts,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=max(shape.seq, 4096),
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )


def _gpt_oss_config(shape: Shape):
    """GptOssConfig's own defaults (YaRN RoPE x32 over 4096 positions, theta 150000, swiglu_limit 7) at the shape's
    sizes, its layers alternating sliding and full, sliding first, as gpt-oss's ``layer_types``."""
    import transformers

    return transformers.GptOssConfig(
        **_shared_fields(shape),
        num_local_experts=shape.experts,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(shape.layers)],
        sliding_window=shape.window,
    )


def _qwen3_next_config(shape: Shape):
    """Qwen3NextConfig at the shape's sizes: every 4th layer full attention (its ``full_attention_interval``), the
    linear layers' heads ``linear_heads`` of ``head_dim``, a shared expert as wide as the routed ones; its own
    defaults otherwise (a quarter of each head rotated, theta 10000)."""
    import transformers

    key_heads, value_heads = shape.linear_heads or (shape.kv_heads, shape.heads)
    return transformers.Qwen3NextConfig(
        **_shared_fields(shape),
        moe_intermediate_size=shape.expert_dim,
        shared_expert_intermediate_size=shape.expert_dim,
        num_experts=shape.experts,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        linear_num_key_heads=key_heads,
        linear_num_value_heads=value_heads,
        linear_key_head_dim=shape.head_dim,
        linear_value_head_dim=shape.head_dim,
        max_position_embeddings=max(shape.seq, 4096),
    )


def _deepseek_v3_config(shape: Shape):
    """DeepseekV3Config at the shape's sizes, with its own routing: sigmoid scores, the top-k renormalised
    (``norm_topk_prob``) and scaled by 2.5 (``routed_scaling_factor``); RoPE on pairs (``rope_interleave``) at theta
    10000, without YaRN (which changes constants, not the work)."""
    import transformers

    q_rank, kv_rank = shape.latent or (None, 4 * shape.head_dim)
    groups, groups_kept = shape.groups or (1, 1)
    fields = _shared_fields(shape)
    del fields["head_dim"]  # transformers' DeepSeek-V3 takes it to be the rotated part's width
    fields["intermediate_size"] = (shape.top_k + shape.shared_experts) * shape.expert_dim  # the dense layers'
    return transformers.DeepseekV3Config(
        **fields,
        moe_intermediate_size=shape.expert_dim,
        n_routed_experts=shape.experts,
        n_shared_experts=shape.shared_experts,
        n_group=groups,
        topk_group=groups_kept,
        first_k_dense_replace=shape.dense_layers,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        q_lora_rank=q_rank,
        kv_lora_rank=kv_rank,
        qk_nope_head_dim=shape.head_dim,
        qk_rope_head_dim=shape.head_dim // 2,
        v_head_dim=shape.head_dim,
        max_position_embeddings=max(shape.seq, 4096),
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rope_interleave=True,
        num_mtp_layers=0,  # transformers' causal LM neither saves nor runs a multi-token-prediction layer
    )


def _perturb_off_init(reference) -> None:
    """Move what transformers initialises to a constant or near zero, so the logit check covers those weights too:
    norms (exactly 1), biases (exactly 0: gpt-oss's attention, router and experts), sinks (N(0, 0.02): a sink
    that small is invisible next to a softmax over hundreds of keys) and DeepSeek-V3's ``e_score_correction_bias``
    (a buffer at 0: moved, it changes which experts a token gets)."""
    import torch

    scales = {"norm.weight": 0.1, "bias": 0.1, "sinks": 1.0}
    with torch.no_grad():  # in parameter order, so a Qwen3-MoE draws what it drew when only its norms moved
        for name, param in reference.named_parameters():
            scale = next((scale for suffix, scale in scales.items() if name.endswith(suffix)), None)
            if scale is not None:
                param.add_(scale * torch.randn_like(param))
        for name, buffer in reference.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.add_(0.1 * torch.randn_like(buffer))


def positions(batch: int, seq: int) -> np.ndarray:
    return np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq)).copy()
