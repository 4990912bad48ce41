"""Routing strategies: which experts each token goes to, with what weights, and router statistics."""

from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from eqmoe.config import RouterConfig
from eqmoe.nn._init import normal


class Routing(NamedTuple):
    """A routing decision for a flat list of tokens."""

    weights: Float[Array, "tokens k"]  # combine weights, in the activation dtype
    experts: Int[Array, "tokens k"]  # expert index of each of the k slots
    logits: Float[Array, "tokens experts"]  # router logits, float32
    probs: Float[Array, "tokens experts"]  # router scores over all experts, float32


class RouterStats(NamedTuple):
    """Per-MoE-layer routing statistics over the real (unmasked) tokens.

    The sums are kept (not only the means) so that losses pooled over layers, such as HF's
    load-balancing loss, can be formed exactly from them.
    """

    expert_counts: Float[Array, "*layers experts"]  # top-k slots choosing each expert
    prob_sum: Float[Array, "*layers experts"]  # sum of router probabilities per expert
    num_tokens: Float[Array, "*layers"]
    load_balance: Float[Array, "*layers"]  # this layer's E * sum_e f_e * P_e
    z_loss: Float[Array, "*layers"]  # mean logsumexp(logits)^2

    @property
    def mean_probs(self) -> Float[Array, "*layers experts"]:
        return self.prob_sum / jnp.maximum(self.num_tokens, 1.0)[..., None]

    @property
    def load(self) -> Float[Array, "*layers experts"]:
        """Fraction of the routed slots each expert received (sums to 1 per layer)."""
        return self.expert_counts / jnp.maximum(self.expert_counts.sum(-1, keepdims=True), 1.0)


def softmax_top_k(
    logits: Float[Array, "tokens experts"], top_k: int, renormalize: bool
) -> tuple[Float[Array, "tokens k"], Int[Array, "tokens k"], Float[Array, "tokens experts"]]:
    """HF Qwen3MoeTopKRouter: ``p = softmax(logits)`` over all experts in float32, the ``top_k``
    largest, optionally divided by their sum (``norm_topk_prob``)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights, experts, probs


class Router(eqx.Module):
    """A linear gate ``logits = x @ W`` followed by a routing strategy from the config."""

    weight: Float[Array, "embed experts"]
    config: RouterConfig = eqx.field(static=True)

    def __init__(self, embed_dim: int, config: RouterConfig, *, std: float, dtype: DTypeLike, key: PRNGKeyArray):
        self.weight = normal(key, (embed_dim, config.num_experts), std, dtype)
        self.config = config

    def __call__(self, x: Float[Array, "tokens embed"]) -> Routing:
        logits = x @ self.weight
        weights, experts, probs = softmax_top_k(logits, self.config.top_k, self.config.renormalize)
        return Routing(weights.astype(x.dtype), experts, logits.astype(jnp.float32), probs)


def router_stats(routing: Routing, token_mask: Bool[Array, " tokens"]) -> RouterStats:
    """Statistics of one layer's routing over the tokens where ``token_mask`` is true."""
    num_experts = routing.probs.shape[-1]
    valid = token_mask.astype(jnp.float32)
    chosen = jax.nn.one_hot(routing.experts, num_experts, dtype=jnp.float32).sum(axis=1)
    expert_counts = (chosen * valid[:, None]).sum(axis=0)
    prob_sum = (routing.probs * valid[:, None]).sum(axis=0)
    num_tokens = valid.sum()
    denominator = jnp.maximum(num_tokens, 1.0)
    load_balance = num_experts * jnp.sum((expert_counts / denominator) * (prob_sum / denominator))
    lse = jax.nn.logsumexp(routing.logits, axis=-1)
    z_loss = jnp.sum(jnp.square(lse) * valid) / denominator
    return RouterStats(expert_counts, prob_sum, num_tokens, load_balance, z_loss)
