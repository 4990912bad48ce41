"""The checkpoint names of the multi-token-prediction layers (:class:`eqmoe.nn.mtp.MTPLayer`) as DeepSeek-V3's
published folders name them: ``model.layers.{L + j}.*`` after the ``L`` decoder layers."""

from eqmoe.config import LayerKind, ModelConfig
from eqmoe.models.family import TensorName, swiglu_names
from eqmoe.registries import ATTENTION_KINDS


def mtp_names(config: ModelConfig) -> list[TensorName]:
    """Every tensor of ``config.mtp_layers`` multi-token-prediction layers: ``embed_tokens`` and ``shared_head.head``
    (copies of the main model's embedding and head, marked ``duplicate``), ``enorm``, ``hnorm``, ``eh_proj``,
    ``shared_head.norm`` and the decoder block's own tensors (its norms, its attention as its kind names it, its
    router with the selection bias, experts and shared experts)."""
    names = []
    last = config.layers[-1]
    for j in range(config.mtp_layers):
        prefix, path = f"model.layers.{config.num_layers + j}.", ("mtp", j)
        block = (*path, "block")
        head = ("embed",) if config.tie_embeddings else ("lm_head",)
        names += [
            # the embedding and the output head are the main model's, repeated in the files
            TensorName(prefix + "embed_tokens.weight", ("embed",), (), duplicate=True),
            TensorName(prefix + "shared_head.head.weight", head, (), 0 if config.tie_embeddings else 1, duplicate=True),
            TensorName(prefix + "enorm.weight", (*path, "enorm", "weight"), ()),
            TensorName(prefix + "hnorm.weight", (*path, "hnorm", "weight"), ()),
            TensorName(prefix + "eh_proj.weight", (*path, "eh_proj", "weight"), (), 1),
            TensorName(prefix + "shared_head.norm.weight", (*path, "head_norm", "weight"), ()),
            TensorName(prefix + "input_layernorm.weight", (*block, "attn_norm", "weight"), ()),
            TensorName(prefix + "post_attention_layernorm.weight", (*block, "pre_norm", "weight"), ()),
        ]
        kind = LayerKind(last.attention, "moe" if config.moe else "dense")  # eqmoe.nn.mtp.mtp_layer_kind
        attention = ATTENTION_KINDS.get(kind.attention)
        names += attention.checkpoint_names(config, kind, prefix + "self_attn.", (*block, "attention"), ())
        ffn, mlp = (*block, "ffn"), prefix + "mlp."
        if config.moe is None:
            names += swiglu_names(mlp, ffn, ())
            continue
        names.append(TensorName(mlp + "gate.weight", (*ffn, "router", "gate", "weight"), (), 1))
        if config.moe.router.bias_update_rate > 0:
            names.append(TensorName(mlp + "gate.e_score_correction_bias", (*ffn, "router", "bias"), ()))
        for e in range(config.moe.router.num_experts):
            names += swiglu_names(mlp + f"experts.{e}.", (*ffn, "experts"), (e,))
        if config.moe.shared_experts:
            names += swiglu_names(mlp + "shared_experts.", (*ffn, "shared_expert"), ())
    return names
