"""The DeepSeek-V2 family (Hugging Face ``model_type`` ``"deepseek_v2"``): DeepSeek-V2, V2-Lite, V2.5 and
DeepSeek-Coder-V2.

DeepSeek-V3's decoder (:mod:`eqmoe.models.deepseek_v3`: latent attention, dense first layers, shared experts) with
the older router and no rope-layout choice:

- router: ``p = softmax(float32 logits)``, the ``top_k`` largest (``topk_method: greedy``) or those among the
  ``topk_group`` best of ``n_group`` groups, a group scored by its best expert (``group_limited_greedy``; the others
  are masked with 0), times ``routed_scaling_factor``; never divided by their sum (transformers' V2 router does not
  read ``norm_topk_prob``) and no selection bias;
- RoPE always on interleaved pairs (transformers rotates them as complex numbers);
- ``first_k_dense_replace`` defaults to 0; no multi-token-prediction layers.
"""

from collections.abc import Mapping
from typing import Any

from eqmoe.config import ModelConfig, RopeScaling
from eqmoe.models import glm4_moe
from eqmoe.models.deepseek_v3 import deepseek, mla_fields
from eqmoe.models.family import Family, TensorName, register
from eqmoe.models.field_map import Field, FieldMap, Fixed, Rule, show
from eqmoe.models.hf_config import dense_first_rule

NAME = "deepseek_v2"
LABEL = "DeepSeek-V2"
_METHODS = ("greedy", "group_limited_greedy")


def _v2(**sizes) -> ModelConfig:
    return deepseek(
        family=NAME,
        strategy="softmax_top_k",
        renormalize=False,
        group_score="max",
        bias_update_rate=0.0,
        **sizes,
    )


PRESETS: dict[str, ModelConfig] = {
    # deepseek-ai/DeepSeek-V2-Lite config.json: no query latent, 64 experts top-6 greedy, two shared, YaRN x40
    "deepseek-v2-lite": _v2(
        vocab=102400,
        embed=2048,
        layers=27,
        dense_layers=1,
        heads=16,
        q_rank=None,
        kv_rank=512,
        nope=128,
        rope=64,
        value=128,
        experts=64,
        top_k=6,
        expert_dim=1408,
        mlp_dim=10944,
        shared_experts=2,
        scaling_factor=1.0,
        groups=1,
        groups_kept=1,
        theta=10000.0,
        rope_scaling=RopeScaling(
            "yarn",
            40.0,
            original_max_position_embeddings=4096,
            max_position_embeddings=163840,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=0.707,
            mscale_all_dim=0.707,
        ),
    ),
}


def _routing_read(hf: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``topk_method``, ``n_group``, ``topk_group`` <-> the router's group limiting: ``greedy`` ignores the groups."""
    method = hf.get("topk_method", "greedy")
    if method not in _METHODS:
        raise ValueError(f"{source}: topk_method={show(method)} is not supported; allowed: {' | '.join(_METHODS)}")
    groups, kept = hf.get("n_group"), hf.get("topk_group")
    if method == "greedy":  # the groups limit nothing; kept as "every group" so that an export writes them back
        experts = hf.get("n_routed_experts", 64)
        whole = isinstance(groups, int) and not isinstance(groups, bool) and groups >= 1 and experts % groups == 0
        groups = groups if whole else 1
        return {"moe.router.expert_groups": groups, "moe.router.expert_groups_kept": None if kept is None else groups}
    for key, value in (("n_group", groups), ("topk_group", kept)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{source}: {key}={show(value)} is invalid with topk_method 'group_limited_greedy'")
    return {"moe.router.expert_groups": groups, "moe.router.expert_groups_kept": kept}


def _routing_write(config: ModelConfig) -> dict[str, Any]:
    router = config.moe.router
    kept = router.expert_groups if router.expert_groups_kept is None else router.expert_groups_kept
    if kept == router.expert_groups:
        declared = router.expert_groups > 1 or router.expert_groups_kept is not None
        groups = router.expert_groups if declared else None
        return {"topk_method": "greedy", "n_group": groups, "topk_group": groups}
    return {"topk_method": "group_limited_greedy", "n_group": router.expert_groups, "topk_group": kept}


def _never(renormalize: bool) -> bool:
    if renormalize:
        raise ValueError("allowed: False (transformers' DeepSeek-V2 router never renormalises)")
    return False


FIELD_MAP = FieldMap(
    model_type=NAME,
    architecture="DeepseekV2ForCausalLM",
    label=LABEL,
    template=PRESETS["deepseek-v2-lite"],
    entries=(
        *mla_fields(LABEL, 2048),
        Field("n_routed_experts", "moe.router.num_experts", 64, kind="positive", aliases=("num_experts",)),
        Field("num_experts_per_tok", "moe.router.top_k", kind="positive"),
        Field("routed_scaling_factor", "moe.router.routed_scaling_factor", 1.0, kind="positive_number", read=float),
        Rule(
            ("topk_method", "n_group", "topk_group"),
            ("moe.router.expert_groups", "moe.router.expert_groups_kept"),
            _routing_read,
            _routing_write,
        ),
        # transformers' V2 router never reads it: weights are not renormalised whatever it says
        Field("norm_topk_prob", "moe.router.renormalize", False, kind="bool", read=lambda _: False, write=_never),
        Fixed("mlp_bias", False, written=False),
        dense_first_rule(LABEL, 0, attention="mla"),
    ),
)


def checkpoint_names(config: ModelConfig) -> list[TensorName]:
    """Every tensor of a Hugging Face DeepSeek-V2 checkpoint for ``config``: DeepSeek-V3's names without the
    selection bias (the router has none)."""
    return glm4_moe.checkpoint_names(config)


FAMILY = register(
    Family(name=NAME, presets=PRESETS, hf_model_type=NAME, field_map=FIELD_MAP, checkpoint_names=checkpoint_names)
)
