"""The multi-token-prediction layers DeepSeek-V3's files hold after the decoder (``model.layers.61.*``).

Depth ``k`` predicts the token ``k + 1`` ahead from the previous depth's hidden state and the embedding of the token
``k`` ahead, through one decoder block (DeepSeek-V3 report, section 2.2; transformers' ``MtpLayer``)::

    h^k_i = head_norm_k(block_k(eh_proj_k([enorm_k(embed(t_{i+k})) ; hnorm_k(h^{k-1}_i)])))
    logits^k_i = head(h^k_i)                              predicting t_{i+k+1}

with ``h^0`` the main model's output after its final norm, and the main model's embedding and output head (the
published files repeat them per layer, equal). The block's RoPE positions are those of the tokens it reads,
``i + k``. The causal LM's output never runs these layers; with ``LossConfig.mtp_weight`` the training objective
adds their mean cross-entropy. Every parameter inside has the role ``Role.MTP``: trained only under that objective,
never adapted, counted apart.
"""

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from eqmoe.config import LayerKind, ModelConfig
from eqmoe.nn.block import Block, model_init
from eqmoe.nn.context import Context
from eqmoe.nn.linear import Linear
from eqmoe.nn.norm import RMSNorm
from eqmoe.nn.router import Routing
from eqmoe.params import Layer, Role


class MTPLayer(Layer):
    """One multi-token-prediction depth: ``enorm``, ``hnorm``, ``eh_proj`` ``[2 embed -> embed]``, one decoder block
    (routed experts where the model has them, the last layer's attention kind) and ``head_norm``."""

    parameter_role: ClassVar[Role] = Role.MTP
    holds_adapters: ClassVar[bool] = False

    enorm: RMSNorm
    hnorm: RMSNorm
    eh_proj: Linear
    block: Block
    head_norm: RMSNorm

    def __init__(self, config: ModelConfig, *, key: PRNGKeyArray):
        k_proj, k_block = jax.random.split(key)
        init, dim = model_init(config), config.embed_dim
        self.enorm, self.hnorm, self.head_norm = (RMSNorm.of(config.norm, dim, init.dtype) for _ in range(3))
        self.eh_proj = Linear(
            (2 * dim,), (dim,), role=Role.ATTENTION, in_axes=("mlp",), out_axes=("embed",), init=init, key=k_proj
        )
        self.block = Block(mtp_layer_kind(config), config, key=k_block)

    def __call__(
        self,
        hidden: Float[Array, "batch seq embed"],
        embedded_ahead: Float[Array, "batch seq embed"],
        context: Context,
        key: PRNGKeyArray | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], Routing | None]:
        """``h^k`` (after ``head_norm``) from ``h^{k-1}`` and the embeddings of the tokens ``k`` ahead."""
        batch, seq, dim = hidden.shape
        joined = jnp.concatenate([self.enorm(embedded_ahead), self.hnorm(hidden)], axis=-1)
        h = self.eh_proj(joined.reshape(batch * seq, 2 * dim)).reshape(batch, seq, dim)
        h, routing, _ = self.block(h, context, None, key)
        return self.head_norm(h), routing


def mtp_layer_kind(config: ModelConfig) -> LayerKind:
    """The block of a multi-token-prediction layer: the last layer's attention, routed experts where the model has
    them (transformers builds it with ``first_k_dense_replace = 0``)."""
    return LayerKind(config.layers[-1].attention, "moe" if config.moe is not None else "dense")


def predict_ahead(
    layers: tuple[MTPLayer, ...],
    hidden: Float[Array, "batch seq embed"],
    tokens: Int[Array, "batch seq"],
    embed: Float[Array, "vocab embed"],
    head,
    context: Context,
    key: PRNGKeyArray | None = None,
) -> Float[Array, "depth batch seq vocab"]:
    """Every depth's logits: depth ``k`` at position ``i`` predicts ``t_{i+k+1}`` (positions whose ahead tokens fall
    past the row read token 0; the objective masks their targets). ``head`` maps normed states to logits."""
    logits = []
    for depth, layer in enumerate(layers, start=1):
        ahead = jnp.pad(tokens[:, depth:], ((0, 0), (0, depth)))
        shifted = eqx.tree_at(lambda c: c.positions, context, context.positions + depth)
        layer_key = None if key is None else jax.random.fold_in(key, depth)
        hidden, _ = layer(hidden, embed[ahead], shifted, layer_key)
        logits.append(head(hidden))
    return jnp.stack(logits)
