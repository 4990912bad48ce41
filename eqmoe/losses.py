"""Training losses: next-token cross-entropy, output z-loss and the router losses, every term reported.

The router statistics come from the routing the model returns (``ModelOutput.aux``,
:mod:`eqmoe.nn.routing_stats`); the load-balancing forms are registered in :data:`eqmoe.registries.LOAD_BALANCE`
(name -> function of the stacked :class:`~eqmoe.nn.routing_stats.RouterStats` giving the scalar), and
:func:`objective` reports every form and trains the one ``LossConfig.load_balance`` names.

Padding (``token_mask`` false, ``target_mask`` false) changes no term: the router statistics, capacity
included, count real tokens only, and means over groups or documents skip those without any.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from eqmoe import parallel
from eqmoe.config import ModelConfig
from eqmoe.model import ModelOutput
from eqmoe.nn.routing_stats import pooled_load_balance  # noqa: F401 (its public home before it moved)
from eqmoe.registries import LOAD_BALANCE


def next_token_losses(
    logits: Float[Array, "batch seq vocab"], tokens: Int[Array, "batch seq"], target_mask: Bool[Array, "batch seq"]
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """Mean cross-entropy of predicting ``tokens[:, t + 1]`` from position ``t`` and mean
    ``logsumexp(logits)^2`` (the output z-loss), in float32, over the targets where ``target_mask`` is
    true (HF ``ForCausalLMLoss`` with ignore index -100)."""
    keep = target_mask[:, 1:].astype(jnp.float32)
    count = jnp.maximum(keep.sum(), 1.0)
    cross_entropy, z = _summed_losses(logits[:, :-1].astype(jnp.float32), tokens[:, 1:], keep)
    return cross_entropy / count, z / count


def _summed_losses(
    logits: Float[Array, "batch seq vocab"], targets: Int[Array, "batch seq"], keep: Float[Array, "batch seq"]
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """The summed cross-entropy of ``targets`` and the summed ``logsumexp(logits)^2``, each position weighted by
    ``keep``."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.sum((lse - target_logits) * keep), jnp.sum(jnp.square(lse) * keep)


def next_token_losses_in_chunks(
    hidden: Float[Array, "batch seq embed"],
    head: Callable[[Float[Array, "batch chunk embed"]], Float[Array, "batch chunk vocab"]],
    tokens: Int[Array, "batch seq"],
    target_mask: Bool[Array, "batch seq"],
    chunk: int,
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """:func:`next_token_losses` of ``head(hidden)``, taking ``chunk`` positions at a time: each chunk's logits are
    made, reduced to their log-sum-exp and target logit, and made again in the backward pass, so no more than one
    chunk's ``[batch, chunk, vocab]`` float32 logits (and their gradient) exist at once. The same sums, added chunk
    by chunk."""
    batch, seq, _ = hidden.shape
    # position t predicts token t + 1; the last position predicts nothing
    targets = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))
    keep = jnp.pad(target_mask[:, 1:], ((0, 0), (0, 1))).astype(jnp.float32)
    chunk = min(chunk, seq)
    extra = -seq % chunk  # a last, partial chunk is padded with positions that keep nothing
    if extra:
        hidden, targets, keep = (
            jnp.pad(x, ((0, 0), (0, extra)) + ((0, 0),) * (x.ndim - 2)) for x in (hidden, targets, keep)
        )
    count = (seq + extra) // chunk

    def chunks(x):  # [batch, seq, ...] -> [count, batch, chunk, ...]
        return jnp.moveaxis(x.reshape(batch, count, chunk, *x.shape[2:]), 1, 0)

    @jax.checkpoint
    def add(sums, part):
        states, chunk_targets, chunk_keep = part
        logits = parallel.constrain_activation(head(states), ("batch", "seq", "vocab")).astype(jnp.float32)
        part_sums = _summed_losses(logits, chunk_targets, chunk_keep)
        return (sums[0] + part_sums[0], sums[1] + part_sums[1]), None

    zero = jnp.zeros((), jnp.float32)
    (cross_entropy, z), _ = jax.lax.scan(add, (zero, zero), (chunks(hidden), chunks(targets), chunks(keep)))
    total = jnp.maximum(keep.sum(), 1.0)
    return cross_entropy / total, z / total


def next_token_cross_entropy(
    logits: Float[Array, "batch seq vocab"], tokens: Int[Array, "batch seq"], target_mask: Bool[Array, "batch seq"]
) -> Float[Array, ""]:
    """The cross-entropy half of :func:`next_token_losses`."""
    return next_token_losses(logits, tokens, target_mask)[0]


def objective(
    output: ModelOutput,
    tokens: Int[Array, "batch seq"],
    target_mask: Bool[Array, "batch seq"],
    config: ModelConfig,
    head: Callable | None = None,
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """The training loss and every term, trained or not.

    ``loss = CE + output_z_loss_weight * output_z + load_balance_weight * LB[load_balance]
    + router_z_loss_weight * router_z + mtp_weight * MTP`` with the weights and the load-balancing form from
    ``config.loss`` (``MTP``: :func:`mtp_cross_entropy`, where the model computed its layers' logits). An output
    called with ``logits=False`` (``config.output_chunk``) gives its final hidden states and ``head`` its output layer.
    Every form registered in :data:`LOAD_BALANCE` is reported as ``load_balance_{name}``.
    """
    weights = config.loss
    if output.logits is None:  # the model left its output layer, ``head``, to be taken in chunks
        cross_entropy, output_z = next_token_losses_in_chunks(
            output.hidden, head, tokens, target_mask, config.output_chunk
        )
    else:
        cross_entropy, output_z = next_token_losses(output.logits, tokens, target_mask)
    terms = {"cross_entropy": cross_entropy, "output_z_loss": output_z}
    loss = cross_entropy + weights.output_z_loss_weight * output_z
    stats = output.aux
    if stats is not None:
        balance = {name: form(stats) for name, form in LOAD_BALANCE.items()}
        terms.update({f"load_balance_{name}": value for name, value in balance.items()})
        terms["load_balance"] = balance[weights.load_balance]
        terms["router_z_loss"] = jnp.mean(stats.z_loss)
        terms["dropped_fraction"] = jnp.mean(stats.dropped_fraction)
        loss = loss + weights.load_balance_weight * terms["load_balance"]
        loss = loss + weights.router_z_loss_weight * terms["router_z_loss"]
    if output.mtp_logits is not None:
        terms["mtp_cross_entropy"] = mtp_cross_entropy(output, tokens, target_mask)
        loss = loss + weights.mtp_weight * terms["mtp_cross_entropy"]
    terms["loss"] = loss
    return loss, terms


def mtp_cross_entropy(
    output: ModelOutput, tokens: Int[Array, "batch seq"], target_mask: Bool[Array, "batch seq"]
) -> Float[Array, ""]:
    """The mean over depths of each multi-token-prediction depth's cross-entropy: depth ``k``'s logits at ``i``
    against token ``i + k + 1``, where that token is a target in the same packed document as ``i``."""
    segments = output.segment_ids if output.segment_ids is not None else jnp.zeros_like(tokens)
    losses = []
    for depth, logits in enumerate(output.mtp_logits, start=1):
        seq = tokens.shape[1] - depth
        # position m of the shifted arrays holds token i + depth with i = m - 1 the position predicting it
        same_document = segments[:, depth:] == jnp.concatenate([segments[:, :1], segments[:, : seq - 1]], axis=1)
        losses.append(
            next_token_cross_entropy(logits[:, :seq], tokens[:, depth:], target_mask[:, depth:] & same_document)
        )
    return jnp.mean(jnp.stack(losses))
