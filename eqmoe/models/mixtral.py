"""The Mixtral family (Hugging Face ``model_type`` ``"mixtral"``): published presets, the ``config.json`` reader
and writer and the checkpoint name map.

Mixtral is Qwen3-MoE's decoder without QK-norm: every layer is MoE, the router takes a float32 softmax over all
experts, keeps the top-k and divides them by their sum (eqmoe's ``softmax_top_k`` with ``renormalize``), and
the auxiliary loss is transformers' pooled ``load_balancing_loss_func`` (eqmoe's ``hf_pooled``).
"""

from typing import Any

from eqmoe.config import (
    AttentionConfig,
    LossConfig,
    ModelConfig,
    MoEConfig,
    NormConfig,
    RopeScaling,
    RouterConfig,
)
from eqmoe.models.family import Family, TensorName, attention_names, layer_slots, outer_names, register
from eqmoe.models.field_map import Field, FieldMap, Fixed
from eqmoe.models.hf_config import all_moe_rule, decoder_fields, rope_rule

NAME = "mixtral"


def _mixtral(
    *,
    vocab: int,
    embed: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    experts: int,
    top_k: int,
    expert_dim: int,
    theta: float,
    rope_scaling: RopeScaling | None = None,
    tie: bool = False,
    eps: float = 1e-5,
    aux_coef: float = 0.001,
) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab,
        embed_dim=embed,
        attention=AttentionConfig(
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rope_theta=theta,
            rope_scaling=rope_scaling,
            qk_norm="none",
        ),
        layers=("moe",) * layers,
        moe=MoEConfig(
            router=RouterConfig(num_experts=experts, top_k=top_k, strategy="softmax_top_k", renormalize=True),
            expert_dim=expert_dim,
        ),
        norm=NormConfig(eps=eps, ffn_placement="pre"),
        loss=LossConfig(load_balance="hf_pooled", load_balance_weight=aux_coef),
        tie_embeddings=tie,
        family=NAME,
    )


PRESETS: dict[str, ModelConfig] = {
    # mistralai/Mixtral-8x7B-v0.1 config.json (rope_theta 1e6, rms_norm_eps 1e-5, sliding_window null).
    "mixtral-8x7b": _mixtral(
        vocab=32000,
        embed=4096,
        layers=32,
        heads=32,
        kv_heads=8,
        head_dim=128,
        experts=8,
        top_k=2,
        expert_dim=14336,
        theta=1e6,
    ),
}


# --- Hugging Face config.json: transformers' MixtralConfig --------------------------------------------------

FIELD_MAP = FieldMap(
    model_type=NAME,
    architecture="MixtralForCausalLM",
    label="Mixtral",
    template=PRESETS["mixtral-8x7b"],
    entries=(
        *decoder_fields(kv_default=8, eps=1e-5),
        Field("intermediate_size", "moe.expert_dim", kind="positive"),
        Field("num_local_experts", "moe.router.num_experts", 8, kind="positive", aliases=("num_experts",)),
        Field("num_experts_per_tok", "moe.router.top_k", 2, kind="positive"),
        Field("router_aux_loss_coef", "loss.load_balance_weight", 0.001, kind="number", read=float),
        all_moe_rule("Mixtral"),
        rope_rule(4096 * 32, "Mixtral"),
        Fixed("hidden_act", "silu"),
        Fixed("attention_dropout", 0.0),
        Fixed("router_jitter_noise", 0.0),
        # transformers masks every layer to this window; the released files have null
        Fixed("sliding_window", None),
    ),
)


def config_from_hf(hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """A :class:`ModelConfig` from a Hugging Face Mixtral ``config.json`` dictionary (:data:`FIELD_MAP`)."""
    return FIELD_MAP.read(hf, source)


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dictionary for ``config``; a ``ValueError`` names the first field
    that transformers' Mixtral cannot express (:data:`FIELD_MAP`)."""
    return FIELD_MAP.write(config)


# --- Checkpoint name map ---------------------------------------------------------------------------

# Hub expert names: w1 = gate, w3 = up, w2 = down (transformers 5 fuses them on load and splits them on save).
_EXPERT_WEIGHTS = (("w1", "gate"), ("w3", "up"), ("w2", "down"))


def checkpoint_names(config: ModelConfig) -> list[TensorName]:
    """Every tensor of a Hugging Face Mixtral checkpoint for ``config``, in the Hub's key names (those
    transformers' ``save_pretrained`` writes: ``block_sparse_moe.gate`` and ``experts.{j}.w1/w2/w3``)."""
    names = outer_names(config)
    for layer, s, r, u, kind in layer_slots(config):
        block = ("segments", s, "blocks", u)
        prefix = f"model.layers.{layer}."
        names += attention_names(prefix, block, r, config, kind)
        names.append(
            TensorName(prefix + "block_sparse_moe.gate.weight", (*block, "ffn", "router", "gate", "weight"), (r,), 1)
        )
        for j in range(config.moe.router.num_experts):
            for hub, leaf in _EXPERT_WEIGHTS:
                key = prefix + f"block_sparse_moe.experts.{j}.{hub}.weight"
                names.append(TensorName(key, (*block, "ffn", "experts", leaf, "weight"), (r, j), 1))
    return names


FAMILY = register(
    Family(
        name=NAME,
        presets=PRESETS,
        hf_model_type=NAME,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        field_map=FIELD_MAP,
        checkpoint_names=checkpoint_names,
    )
)
