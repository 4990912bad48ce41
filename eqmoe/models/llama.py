"""The Llama family (Hugging Face ``model_type`` ``"llama"``): the dense decoder most checkpoints share, a start for
sparse upcycling (``experiments.upcycle``).

Every layer is grouped-query attention without QK-norm and a dense SwiGLU of width ``intermediate_size``.
``attention_bias`` puts a bias on all four projections (eqmoe's ``bias="qkvo"``); ``mlp_bias`` (biases on the SwiGLU)
is refused, eqmoe's dense FFN has none. ``head_dim`` is ``hidden_size // num_attention_heads`` when absent or null;
Llama 3.1's ``llama3`` RoPE scaling is read as transformers reads it (:mod:`eqmoe.models.hf_rope`).
``pretraining_tp`` is read by transformers' config and by no part of its model.
"""

from typing import Any

from eqmoe.config import AttentionConfig, ModelConfig, NormConfig, RopeScaling
from eqmoe.models import qwen3_moe
from eqmoe.models.family import Family, register
from eqmoe.models.field_map import Field, FieldMap, Fixed, Known
from eqmoe.models.hf_config import all_dense_rule, decoder_fields, on_off, rope_rule

NAME = "llama"


def _llama(
    *,
    vocab: int,
    embed: int,
    layers: int,
    heads: int,
    kv_heads: int,
    mlp_dim: int,
    theta: float,
    head_dim: int | None = None,
    rope_scaling: RopeScaling | None = None,
    tie: bool = False,
    eps: float = 1e-5,
) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab,
        embed_dim=embed,
        attention=AttentionConfig(
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim or embed // heads,
            rope_theta=theta,
            rope_scaling=rope_scaling,
            qk_norm="none",
        ),
        layers=("dense",) * layers,
        mlp_dim=mlp_dim,
        norm=NormConfig(eps=eps, ffn_placement="pre"),
        tie_embeddings=tie,
        family=NAME,
    )


PRESETS: dict[str, ModelConfig] = {
    # meta-llama/Llama-3.1-8B config.json (rope_theta 5e5 with llama3 scaling, rms_norm_eps 1e-5).
    "llama-3.1-8b": _llama(
        vocab=128256,
        embed=4096,
        layers=32,
        heads=32,
        kv_heads=8,
        mlp_dim=14336,
        theta=5e5,
        rope_scaling=RopeScaling(
            rope_type="llama3",
            factor=8.0,
            original_max_position_embeddings=8192,
            max_position_embeddings=131072,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
        ),
    ),
    "llama-micro": _llama(vocab=512, embed=64, layers=4, heads=4, kv_heads=2, mlp_dim=64, theta=1e4),
}


# --- Hugging Face config.json: transformers' LlamaConfig --------------------------------------------------

FIELD_MAP = FieldMap(
    model_type=NAME,
    architecture="LlamaForCausalLM",
    label="Llama",
    template=PRESETS["llama-micro"],
    entries=(
        *decoder_fields(eps=1e-6),
        Field("intermediate_size", "mlp_dim", kind="positive"),
        Field(
            "attention_bias",
            "attention.bias",
            False,
            kind="bool",
            read=lambda on: "qkvo" if on else "none",
            write=on_off("qkvo", "none", "attention_bias"),
        ),
        all_dense_rule("Llama"),
        rope_rule(2048, "Llama"),
        Fixed("hidden_act", "silu"),
        Fixed("mlp_bias", False),
        Fixed("attention_dropout", 0.0),
        Known(("pretraining_tp",)),
    ),
)


def config_from_hf(hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """A :class:`ModelConfig` from a Hugging Face Llama ``config.json`` dictionary (:data:`FIELD_MAP`)."""
    return FIELD_MAP.read(hf, source)


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dictionary for ``config``; a ``ValueError`` names the first field that
    transformers' Llama cannot express (:data:`FIELD_MAP`)."""
    return FIELD_MAP.write(config)


FAMILY = register(
    Family(
        name=NAME,
        presets=PRESETS,
        hf_model_type=NAME,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        field_map=FIELD_MAP,
        # the names transformers' Llama and Qwen3 share (no q_norm/k_norm without QK-norm)
        checkpoint_names=qwen3_moe.checkpoint_names,
    )
)
