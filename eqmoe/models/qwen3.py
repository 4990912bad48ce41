"""The Qwen3 family (Hugging Face ``model_type`` ``"qwen3"``): Qwen3-MoE's dense sibling, the checkpoints sparse
upcycling starts from (``experiments.upcycle``).

Every layer is grouped-query attention with per-head QK-norm before RoPE (one ``[head_dim]`` scale each for queries
and keys, as Qwen3-MoE's) and a dense SwiGLU of width ``intermediate_size``. transformers' ``attention_bias`` puts a
bias on all four projections (eqmoe's ``bias="qkvo"``). ``head_dim`` is 128 when the file leaves it out (Qwen3Config's
default, not ``hidden_size // num_attention_heads``), and ``num_key_value_heads`` 32 (null: the head count).
Sliding windows are refused: transformers applies them only with ``use_sliding_window``.
"""

from typing import Any

from eqmoe.config import AttentionConfig, ModelConfig, NormConfig, RopeScaling
from eqmoe.models import qwen3_moe
from eqmoe.models.family import Family, register
from eqmoe.models.field_map import Field, FieldMap, Fixed, Known
from eqmoe.models.hf_config import all_dense_rule, full_attention_rule, on_off, rope_rule

NAME = "qwen3"


def _qwen3(
    *,
    vocab: int,
    embed: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    mlp_dim: int,
    theta: float,
    rope_scaling: RopeScaling | None = None,
    tie: bool = False,
    eps: float = 1e-6,
) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab,
        embed_dim=embed,
        attention=AttentionConfig(
            num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rope_theta=theta, rope_scaling=rope_scaling
        ),
        layers=("dense",) * layers,
        mlp_dim=mlp_dim,
        norm=NormConfig(eps=eps, ffn_placement="pre"),
        tie_embeddings=tie,
        family=NAME,
    )


PRESETS: dict[str, ModelConfig] = {
    # Qwen/Qwen3-0.6B and Qwen/Qwen3-8B config.json (rope_theta 1e6, rms_norm_eps 1e-6, head_dim 128).
    "qwen3-0.6b": _qwen3(
        vocab=151936, embed=1024, layers=28, heads=16, kv_heads=8, head_dim=128, mlp_dim=3072, theta=1e6, tie=True
    ),
    "qwen3-8b": _qwen3(
        vocab=151936, embed=4096, layers=36, heads=32, kv_heads=8, head_dim=128, mlp_dim=12288, theta=1e6
    ),
    # qwen3-moe-micro's shapes with one dense FFN per layer: upcycled to 8 experts top-2, it is that preset's layout.
    "qwen3-micro": _qwen3(vocab=512, embed=64, layers=4, heads=4, kv_heads=2, head_dim=16, mlp_dim=64, theta=1e4),
}


# --- Hugging Face config.json: transformers' Qwen3Config --------------------------------------------------


def _kv_heads(hf) -> Any:
    """Qwen3Config: 32 when absent; a null is the head count (its ``__post_init__``)."""
    return 32 if "num_key_value_heads" not in hf else hf.get("num_attention_heads")


FIELD_MAP = FieldMap(
    model_type=NAME,
    architecture="Qwen3ForCausalLM",
    label="Qwen3",
    template=PRESETS["qwen3-micro"],
    entries=(
        Field("vocab_size", "vocab_size", kind="positive"),
        Field("hidden_size", "embed_dim", kind="positive"),
        Field("num_attention_heads", "attention.num_heads", kind="positive"),
        Field("num_key_value_heads", "attention.num_kv_heads", _kv_heads, kind="positive", nullable=True),
        # a null head_dim is refused: transformers' attention then scales by None ** -0.5
        Field("head_dim", "attention.head_dim", 128, kind="positive"),
        Field("rms_norm_eps", "norm.eps", 1e-6, kind="positive_number", read=float),
        Field("tie_word_embeddings", "tie_embeddings", False, kind="bool"),
        Field("intermediate_size", "mlp_dim", kind="positive"),
        Field(
            "attention_bias",
            "attention.bias",
            False,
            kind="bool",
            read=lambda on: "qkvo" if on else "none",
            write=on_off("qkvo", "none", "attention_bias"),
        ),
        all_dense_rule("Qwen3"),
        full_attention_rule(),
        rope_rule(32768, "Qwen3"),
        Fixed("hidden_act", "silu"),
        Fixed("use_sliding_window", False),
        Fixed("attention_dropout", 0.0),
        Known(("sliding_window", "max_window_layers")),  # read only with use_sliding_window
    ),
)


def config_from_hf(hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """A :class:`ModelConfig` from a Hugging Face Qwen3 ``config.json`` dictionary (:data:`FIELD_MAP`)."""
    return FIELD_MAP.read(hf, source)


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dictionary for ``config``; a ``ValueError`` names the first field that
    transformers' Qwen3 cannot express (:data:`FIELD_MAP`)."""
    return FIELD_MAP.write(config)


FAMILY = register(
    Family(
        name=NAME,
        presets=PRESETS,
        hf_model_type=NAME,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        field_map=FIELD_MAP,
        # Qwen3-MoE's names for its dense layers: the attention, norms and mlp.{gate,up,down}_proj of every layer
        checkpoint_names=qwen3_moe.checkpoint_names,
    )
)
