"""Training losses: next-token cross-entropy and the router losses, every term reported separately."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from eqmoe.config import ModelConfig
from eqmoe.model import ModelOutput
from eqmoe.nn.router import RouterStats


def next_token_cross_entropy(
    logits: Float[Array, "batch seq vocab"], tokens: Int[Array, "batch seq"], target_mask: Bool[Array, "batch seq"]
) -> Float[Array, ""]:
    """Mean cross-entropy of predicting ``tokens[:, t + 1]`` from position ``t``, in float32, over the
    targets where ``target_mask`` is true (HF ``ForCausalLMLoss`` with ignore index -100)."""
    logits = logits[:, :-1].astype(jnp.float32)
    targets = tokens[:, 1:]
    keep = target_mask[:, 1:].astype(jnp.float32)
    target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    losses = jax.nn.logsumexp(logits, axis=-1) - target_logits
    return jnp.sum(losses * keep) / jnp.maximum(keep.sum(), 1.0)


def pooled_load_balance(aux: RouterStats) -> Float[Array, ""]:
    """HF ``load_balancing_loss_func``: ``E * sum_e f_e * P_e`` with ``f_e`` (top-k slots per token
    choosing ``e``) and ``P_e`` (mean probability) pooled over all MoE layers and all real tokens."""
    num_experts = aux.expert_counts.shape[-1]
    rows = jnp.maximum(aux.num_tokens.sum(), 1.0)
    return num_experts * jnp.sum((aux.expert_counts.sum(0) / rows) * (aux.prob_sum.sum(0) / rows))


def objective(
    output: ModelOutput, tokens: Int[Array, "batch seq"], target_mask: Bool[Array, "batch seq"], config: ModelConfig
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """The training loss ``CE + load_balance_weight * LB + z_loss_weight * Z`` and each of its terms."""
    cross_entropy = next_token_cross_entropy(output.logits, tokens, target_mask)
    terms = {"cross_entropy": cross_entropy}
    loss = cross_entropy
    if output.aux is not None and config.moe is not None:
        router = config.moe.router
        terms["load_balance"] = pooled_load_balance(output.aux)
        terms["router_z_loss"] = jnp.mean(output.aux.z_loss)
        loss = loss + router.load_balance_weight * terms["load_balance"] + router.z_loss_weight * terms["router_z_loss"]
    terms["loss"] = loss
    return loss, terms
