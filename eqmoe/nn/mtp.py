"""The multi-token-prediction layers DeepSeek-V3's files hold after the decoder (``model.layers.61.*``).

Depth ``k`` predicts the token ``k + 1`` ahead from the previous depth's hidden state ``h`` and the embedding of the
token ``k`` ahead: ``h' = block(eh_proj([enorm(embed(t_{i+k})); hnorm(h_i)]))``, logits ``head(head_norm(h'))``
(DeepSeek-V3 report, section 2.2). The files carry their own copy of the embedding and the output head per layer.
The causal LM's loss never reads these layers; eqmoe keeps them so a checkpoint goes out as it came in, with the
role ``Role.MTP`` for every parameter inside (not trained, no adapters, counted apart).
"""

from typing import ClassVar

import jax
from jaxtyping import Array, Float, PRNGKeyArray

from eqmoe.config import LayerKind, ModelConfig
from eqmoe.nn.block import Block, model_init
from eqmoe.nn.linear import Linear
from eqmoe.nn.norm import RMSNorm
from eqmoe.params import Layer, Role, param


class MTPLayer(Layer):
    """One multi-token-prediction depth: its norms, ``eh_proj`` ``[2 embed -> embed]``, one decoder block of the
    last layer's kind, ``head_norm`` and its copies of the embedding and the output head."""

    parameter_role: ClassVar[Role] = Role.MTP
    holds_adapters: ClassVar[bool] = False

    embed: Float[Array, "vocab embed"] = param(Role.EMBEDDING)
    enorm: RMSNorm
    hnorm: RMSNorm
    eh_proj: Linear
    block: Block
    head_norm: RMSNorm
    head: Float[Array, "embed vocab"] = param(Role.OUTPUT)

    def __init__(self, config: ModelConfig, *, key: PRNGKeyArray):
        k_embed, k_proj, k_block, k_head = jax.random.split(key, 4)
        init, dim = model_init(config), config.embed_dim
        norm = dict(eps=config.norm.eps, dtype=init.dtype, stats_dtype=config.norm.stats_dtype)
        self.embed = init.embedding(k_embed, config.vocab_size, dim)
        self.enorm, self.hnorm, self.head_norm = RMSNorm(dim, **norm), RMSNorm(dim, **norm), RMSNorm(dim, **norm)
        self.eh_proj = Linear(
            (2 * dim,), (dim,), role=Role.ATTENTION, in_axes=("mlp",), out_axes=("embed",), init=init, key=k_proj
        )
        last = config.layers[-1]
        self.block = Block(LayerKind(last.attention, "moe" if config.moe else "dense"), config, key=k_block)
        self.head = init.weight(k_head, (dim, config.vocab_size), fan_in=dim)
