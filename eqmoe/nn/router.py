"""Routing strategies: which experts each token goes to, and with what weights.

Each strategy is a short function from router logits to ``(weights, experts)``; capacity (dropping)
is applied on top of any of them. Every strategy is registered in :data:`eqmoe.registries.ROUTER_STRATEGIES`
(also :data:`STRATEGIES` here) under the name ``RouterConfig.strategy`` uses; ``Router`` looks it up there, and
a config naming another is refused. Adding one is a function and a registration line::

    def my_route(logits, config: RouterConfig, bias):  # -> (weights [tokens, k], experts [tokens, k])
        ...

    STRATEGIES.register("my_route", Strategy(my_route))
"""

from collections.abc import Callable
from typing import ClassVar, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from eqmoe.config import RouterConfig
from eqmoe.nn._init import Init
from eqmoe.nn.linear import Linear
from eqmoe.params import Layer, Role, param
from eqmoe.registries import ROUTER_STRATEGIES


class Routing(NamedTuple):
    """A routing decision for a flat list of tokens (in groups of equal size, in order): what a MoE layer
    returns beside its output, from which losses and analyses compute their statistics
    (:func:`eqmoe.nn.routing_stats.router_stats`). Stacked by the layer scan, every field gains a leading
    axis of MoE layers."""

    weights: Float[Array, "*layers tokens k"]  # combine weights in the activation dtype; 0 where dropped
    experts: Int[Array, "*layers tokens k"]  # expert of each of the k assignments, best first
    kept: Bool[Array, "*layers tokens k"]  # false where capacity dropped the assignment (or the token is padding)
    positions: Int[Array, "*layers tokens k"]  # slot in the expert's buffer within the group (capacity routing)
    logits: Float[Array, "*layers tokens experts"]  # router logits, float32

    @property
    def probs(self) -> Float[Array, "*layers tokens experts"]:
        """Softmax over all experts, float32 (the load-balance losses' ``P``)."""
        return jax.nn.softmax(self.logits, axis=-1)


# --- strategies: logits -> (weights, experts) ------------------------------------------------------
#
# ``bias`` (aux-loss-free balancing) shifts which experts are chosen, never their weights.


class ExpertGroups(NamedTuple):
    """Group-limited routing (``RouterConfig.expert_groups``, ``expert_groups_kept``): ``count`` contiguous
    groups of experts, only the ``kept`` best of which a token may choose from."""

    count: int = 1
    kept: int | None = None
    score: str = "top2_sum"  # a group's score: the sum of its two best choice scores, or its best ("max")

    @property
    def limits(self) -> bool:
        return self.count > 1 and self.kept is not None and self.kept < self.count


NO_GROUPS = ExpertGroups()


def _limit_to_best_groups(
    choice: Float[Array, "tokens experts"], groups: ExpertGroups
) -> Float[Array, "tokens experts"]:
    """DeepSeek-V3: each group scores the sum of its two best choice scores (DeepSeek-V2: its best one); the
    experts outside the ``groups.kept`` best groups get ``-inf`` so the top-k never picks them (V2 fills them with
    0, which no positive softmax score loses to, so the choice is the same)."""
    tokens, experts = choice.shape
    grouped = choice.reshape(tokens, groups.count, experts // groups.count)
    group_scores = grouped.max(axis=-1) if groups.score == "max" else jax.lax.top_k(grouped, 2)[0].sum(axis=-1)
    _, best = jax.lax.top_k(group_scores, groups.kept)
    keep = jax.nn.one_hot(best, groups.count, dtype=jnp.int32).sum(axis=1) > 0
    return jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(tokens, experts)


def _select(
    scores: Float[Array, "tokens experts"],
    top_k: int,
    bias: Float[Array, " experts"] | None,
    groups: ExpertGroups = NO_GROUPS,
) -> tuple[Float[Array, "tokens k"], Int[Array, "tokens k"]]:
    """The ``top_k`` experts by ``scores + bias`` (among the best groups' experts with ``groups``) and their
    (unbiased) scores, best first."""
    if bias is None and not groups.limits:
        weights, experts = jax.lax.top_k(scores, top_k)
        return weights, experts
    choice = scores if bias is None else scores + jax.lax.stop_gradient(bias).astype(scores.dtype)
    if groups.limits:
        choice = _limit_to_best_groups(jax.lax.stop_gradient(choice), groups)
    _, experts = jax.lax.top_k(jax.lax.stop_gradient(choice), top_k)
    return jnp.take_along_axis(scores, experts, axis=-1), experts


def softmax_top_k(
    logits: Float[Array, "tokens experts"],
    top_k: int,
    renormalize: bool,
    bias: Float[Array, " experts"] | None = None,
    groups: ExpertGroups = NO_GROUPS,
) -> tuple[Float[Array, "tokens k"], Int[Array, "tokens k"]]:
    """HF Qwen3MoeTopKRouter: ``p = softmax(logits)`` in float32, the ``top_k`` largest, divided by
    their sum when ``renormalize`` (``norm_topk_prob``). With ``top_k=1`` and no renormalisation this
    is Switch routing: the weight is the raw probability, so the LM loss trains the router."""
    weights, experts = _select(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), top_k, bias, groups)
    if renormalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights, experts


def top_k_softmax(
    logits: Float[Array, "tokens experts"],
    top_k: int,
    bias: Float[Array, " experts"] | None = None,
    groups: ExpertGroups = NO_GROUPS,
) -> tuple[Float[Array, "tokens k"], Int[Array, "tokens k"]]:
    """MaxText: the ``top_k`` largest logits, softmax over those only. With ``top_k=1`` the weight is
    exactly 1.0, so the router gets no gradient from the LM loss (only from auxiliary losses)."""
    top_logits, experts = _select(logits.astype(jnp.float32), top_k, bias, groups)
    return jax.nn.softmax(top_logits, axis=-1), experts


def top2_gating(
    logits: Float[Array, "tokens experts"],
    bias: Float[Array, " experts"] | None = None,
    groups: ExpertGroups = NO_GROUPS,
) -> tuple[Float[Array, "tokens 2"], Int[Array, "tokens 2"]]:
    """AXLearn Top2Gating: ``p = softmax(logits)``; expert 1 = argmax p, expert 2 = argmax of the rest;
    ``g_i = p_i / (p_1 + p_2 + 1e-9)``."""
    weights, experts = _select(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), 2, bias, groups)
    return weights / (weights.sum(axis=-1, keepdims=True) + 1e-9), experts


def sigmoid_top_k(
    logits: Float[Array, "tokens experts"],
    top_k: int,
    renormalize: bool,
    bias: Float[Array, " experts"] | None = None,
    groups: ExpertGroups = NO_GROUPS,
) -> tuple[Float[Array, "tokens k"], Int[Array, "tokens k"]]:
    """DeepSeek-V3: independent scores ``s = sigmoid(logits)``, the ``top_k`` largest (by ``s + bias``),
    divided by their sum (plus 1e-20) when ``renormalize``."""
    weights, experts = _select(jax.nn.sigmoid(logits.astype(jnp.float32)), top_k, bias, groups)
    if renormalize:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return weights, experts


# --- the registry: RouterConfig.strategy -> Strategy ------------------------------------------------------

Route = Callable[
    [Float[Array, "tokens experts"], RouterConfig, Float[Array, " experts"] | None],
    tuple[Float[Array, "tokens k"], Int[Array, "tokens k"]],
]


class Strategy(NamedTuple):
    """A registered routing strategy.

    **Arguments:**

    - `route`: ``route(logits, config, bias) -> (weights, experts)``: float32 router logits
      ``[tokens, experts]``, the :class:`RouterConfig` and the aux-loss-free selection bias (``None``
      without one; it may change which experts are chosen, never their weights) to the ``top_k`` combine
      weights and expert ids per token, best first.
    - `check`: optional ``check(config)`` run by ``RouterConfig.__post_init__``, raising ``ValueError``
      for settings the strategy cannot honour.
    """

    route: Route
    check: Callable[[RouterConfig], None] | None = None


def _needs_top_k_2(config: RouterConfig) -> None:
    if config.top_k != 2:
        raise ValueError(f"RouterConfig.top_k={config.top_k!r} is invalid; allowed: 2 with strategy='top2_gating'")


def expert_groups(config: RouterConfig) -> ExpertGroups:
    return ExpertGroups(config.expert_groups, config.expert_groups_kept, config.expert_group_score)


STRATEGIES = ROUTER_STRATEGIES
STRATEGIES.register(
    "softmax_top_k", Strategy(lambda x, c, b: softmax_top_k(x, c.top_k, c.renormalize, b, expert_groups(c)))
)
STRATEGIES.register("top_k_softmax", Strategy(lambda x, c, b: top_k_softmax(x, c.top_k, b, expert_groups(c))))
STRATEGIES.register("top2_gating", Strategy(lambda x, c, b: top2_gating(x, b, expert_groups(c)), check=_needs_top_k_2))
STRATEGIES.register(
    "sigmoid_top_k", Strategy(lambda x, c, b: sigmoid_top_k(x, c.top_k, c.renormalize, b, expert_groups(c)))
)


# --- capacity ------------------------------------------------------------------------------------------


def expert_capacity(group_size: int, num_experts: int, capacity_factor: float) -> int:
    """AXLearn/GShard: ``C = max(1, int(S * capacity_factor / E))`` assignments per expert per group."""
    return max(1, int(group_size * capacity_factor / num_experts))


def group_capacity(
    valid: Bool[Array, "groups size"], num_experts: int, capacity_factor: float
) -> Int[Array, " groups"]:
    """:func:`expert_capacity` of each group's real tokens, so that padding neither takes capacity from
    real tokens nor adds any: a packed row routes the same however much padding follows it. Never more
    than the static buffer, ``expert_capacity(size, ...)``."""
    size = valid.shape[1]
    full = expert_capacity(size, num_experts, capacity_factor)
    real = valid.sum(axis=1, dtype=jnp.int32)
    partial = jnp.maximum(1, jnp.floor(real.astype(jnp.float32) * capacity_factor / num_experts).astype(jnp.int32))
    # A group without padding keeps the exact Python value: float32 may round a boundary case differently.
    return jnp.where(real == size, full, jnp.minimum(partial, full))


def capacity_positions(
    experts: Int[Array, "groups size k"],
    valid: Bool[Array, "groups size"],
    num_experts: int,
    capacity: int | Int[Array, " groups"],
) -> tuple[Int[Array, "groups size k"], Bool[Array, "groups size k"]]:
    """Buffer slot of every assignment and whether it fits under ``capacity`` (one for all groups, or
    one per group).

    All rank-1 assignments are placed before any rank-2 one; within a rank, earlier tokens first
    (slot = exclusive running count within the group, offset by what earlier ranks kept). Padding
    tokens take no slot.
    """
    capacity = jnp.broadcast_to(jnp.asarray(capacity, jnp.int32), experts.shape[:1])[:, None]
    filled = jnp.zeros((experts.shape[0], num_experts), jnp.int32)
    positions, kept = [], []
    for rank in range(experts.shape[-1]):
        chosen = jax.nn.one_hot(experts[..., rank], num_experts, dtype=jnp.int32) * valid[..., None]
        slots = jnp.cumsum(chosen, axis=1) - chosen + filled[:, None, :]
        position = jnp.sum(slots * chosen, axis=-1)
        keep = valid & (position < capacity)
        filled = filled + jnp.sum(chosen * keep[..., None], axis=1)
        positions.append(position)
        kept.append(keep)
    return jnp.stack(positions, axis=-1), jnp.stack(kept, axis=-1)


class Router(Layer):
    """A linear gate ``logits = gate(x)`` (with a bias under ``gate_bias``) followed by the configured strategy and
    optional capacity (per group of ``RouterConfig.num_groups``, from the group's real tokens: :func:`group_capacity`).

    ``bias`` is the aux-loss-free selection bias (float32, zeros at init) when
    ``config.bias_update_rate > 0``, else ``None``. It is state, not a trained parameter: the optimizer
    leaves it alone and :func:`eqmoe.train.balance.update_router_biases` moves it after each step.
    """

    adapter_group: ClassVar[str] = "router"

    gate: Linear
    bias: Float[Array, " gates"] | None = param(Role.ROUTER_BIAS)
    config: RouterConfig = eqx.field(static=True)

    def __init__(self, embed_dim: int, config: RouterConfig, *, init: Init, key: PRNGKeyArray):
        # "gates": one score per expert, never split over devices (every device picks top-k over all experts).
        self.gate = Linear(
            (embed_dim,),
            (config.num_experts,),
            role=Role.ROUTER,
            in_axes=("embed",),
            out_axes=("gates",),
            init=init,
            key=key,
            bias=config.gate_bias,
        )
        self.bias = jnp.zeros(config.num_experts, jnp.float32) if config.bias_update_rate > 0 else None
        self.config = config

    def __call__(self, x: Float[Array, "tokens embed"], token_mask: Bool[Array, " tokens"]) -> Routing:
        config = self.config
        logits = self.gate(x).astype(jnp.float32)
        weights, experts = STRATEGIES.get(config.strategy).route(logits, config, self.bias)
        if config.routed_scaling_factor != 1.0:
            weights = weights * config.routed_scaling_factor
        if config.capacity_factor is None:
            kept = jnp.broadcast_to(token_mask[:, None], experts.shape)
            positions = jnp.zeros_like(experts)
        else:
            groups = _groups(x.shape[0], config.num_groups)
            group_mask = token_mask.reshape(groups, -1)
            positions, kept = capacity_positions(
                experts.reshape(groups, -1, config.top_k),
                group_mask,
                config.num_experts,
                group_capacity(group_mask, config.num_experts, config.capacity_factor),
            )
            positions, kept = positions.reshape(experts.shape), kept.reshape(experts.shape)
            weights = jnp.where(kept, weights, 0.0)
        return Routing(weights.astype(x.dtype), experts, kept, positions, logits)


def _groups(tokens: int, num_groups: int) -> int:
    if tokens % num_groups:
        raise ValueError(f"RouterConfig.num_groups={num_groups} does not divide the {tokens} tokens of the batch")
    return num_groups
