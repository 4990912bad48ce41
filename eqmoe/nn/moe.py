"""The MoE layer: router, experts and a dispatch backend: the ``moe`` FFN kind."""

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from eqmoe import parallel
from eqmoe.config import LayerKind, ModelConfig, MoEConfig
from eqmoe.nn import dispatch
from eqmoe.nn._init import Init
from eqmoe.nn.activations import ExpertActivation
from eqmoe.nn.context import Context
from eqmoe.nn.expert_parallel import expert_parallel
from eqmoe.nn.experts import RoutedExperts
from eqmoe.nn.kinds import Cost, FFNKind, PlanShape
from eqmoe.nn.linear import Linear
from eqmoe.nn.mlp import SwiGLU
from eqmoe.nn.router import Router, Routing
from eqmoe.params import Role
from eqmoe.registries import FFN_KINDS


def expert_parallel_applies(config: MoEConfig, parallelism: parallel.Parallelism | None, tokens: int) -> bool:
    """Whether a MoE layer runs with expert parallelism (:mod:`eqmoe.nn.expert_parallel`): dropless routing with
    a backend other than ``dense``, on a mesh with an ``expert`` axis, over ``tokens`` that split evenly over the
    ``batch`` axes (a decoding step of one token does not: it runs the plain backend on the sharded weights)."""
    if parallelism is None or parallelism.size("expert") <= 1:
        return False
    if config.router.capacity_factor is not None or dispatch.backend_name(config) == "dense":
        return False
    shards = 1
    for axis in parallelism.mesh_axes("batch"):
        shards *= parallelism.size(axis)
    return tokens % shards == 0


@FFN_KINDS.register("moe")
class MoE(FFNKind):
    """A routed-expert FFN over all tokens of the batch at once (HF Qwen3MoeSparseMoeBlock).

    Returns the layer output and its :class:`~eqmoe.nn.router.Routing` (padding included: statistics count the
    real tokens, :mod:`eqmoe.nn.routing_stats`). Capacity routing is left to XLA's SPMD partitioner on a mesh;
    dropless routing runs with expert parallelism where :func:`expert_parallel_applies`.

    With ``MoEConfig.shared_experts`` the output adds ``shared_expert(x)`` (times ``sigmoid(x @ shared_gate)``
    when gated): a dense SwiGLU outside the dispatch, so every backend and expert parallelism run it alike.
    """

    routed: ClassVar[bool] = True

    router: Router
    experts: RoutedExperts
    shared_expert: SwiGLU | None
    shared_gate: Linear | None
    config: MoEConfig = eqx.field(static=True)

    def __init__(self, embed_dim: int, config: MoEConfig, *, init: Init, key: PRNGKeyArray):
        k_router, k_experts = jax.random.split(key)
        # the shared experts' keys are drawn aside, so a model without them initialises as it always has
        k_shared, k_gate = jax.random.split(jax.random.fold_in(key, 1))
        self.router = Router(embed_dim, config.router, init=init, key=k_router)
        self.experts = RoutedExperts(
            config.router.num_experts,
            embed_dim,
            config.expert_dim,
            init=init,
            key=k_experts,
            bias=config.expert_bias,
            activation=ExpertActivation.of(config),
        )
        shared = config.shared_width
        self.shared_expert = SwiGLU(embed_dim, shared, init=init, key=k_shared) if shared else None
        gated = shared and config.shared_expert_gate
        gate = dict(role=Role.MLP, in_axes=("embed",), out_axes=("gates",), init=init, key=k_gate)
        self.shared_gate = Linear((embed_dim,), (1,), **gate) if gated else None
        self.config = config

    @classmethod
    def build(cls, config: ModelConfig, layer: LayerKind, *, init: Init, key: PRNGKeyArray) -> "MoE":
        return cls(config.embed_dim, config.moe, init=init, key=key)

    def __call__(
        self, x: Float[Array, "batch seq embed"], context: Context | None = None, key: PRNGKeyArray | None = None
    ) -> tuple[Float[Array, "batch seq embed"], Routing]:
        """``context``: the real-token mask (all real without one); ``key``: the randomness of training-time
        adapter dropout in the shared expert (``None``: none). While decoding, a step whose tokens do not split
        into ``RouterConfig.num_groups`` equal groups is flattened into one row and padded with masked tokens
        (they take no expert capacity and are left out of the statistics)."""
        batch, seq, embed = x.shape
        token_mask = jnp.ones((batch, seq), bool) if context is None else context.token_mask
        flat, mask = x.reshape(batch * seq, embed), token_mask.reshape(-1)
        pad = -flat.shape[0] % self.config.router.num_groups if context is not None and context.decoding else 0
        if pad:
            flat = jnp.concatenate([flat, jnp.zeros((pad, embed), flat.dtype)])
            mask = jnp.concatenate([mask, jnp.zeros((pad,), bool)])
        y, routing = self._routed(flat, mask)
        if pad:
            y, routing = y[: batch * seq], jax.tree.map(lambda leaf: leaf[: batch * seq], routing)
        if self.shared_expert is not None:
            shared, _ = self.shared_expert(flat[: batch * seq], key=key)
            if self.shared_gate is not None:
                # float32 then one rounding, as torch's sigmoid of a half-precision tensor
                gate = jax.nn.sigmoid(self.shared_gate(flat[: batch * seq]).astype(jnp.float32))
                shared = gate.astype(shared.dtype) * shared
            y = y + shared
        return y.reshape(batch, seq, embed), routing

    def _routed(self, flat: Float[Array, "tokens embed"], mask: Bool[Array, " tokens"]) -> tuple[Array, Routing]:
        routing = self.router(flat, mask)
        parallelism = parallel.current()
        if expert_parallel_applies(self.config, parallelism, flat.shape[0]):
            return expert_parallel(flat, routing, self.experts, self.config, parallelism), routing
        return dispatch.resolve(self.config)(flat, routing, self.experts, self.config), routing

    @classmethod
    def plan(cls, config: ModelConfig, layer: LayerKind, shape: PlanShape) -> Cost:
        """Kept per token: the FFN input and its norm, the router's logits, probabilities and choice, the shared
        experts' gate/up/product, and the expert compute's own activations from the registered estimate of the
        backend that runs (:data:`eqmoe.registries.DISPATCH_BACKENDS`), or the padded buffers of the
        expert-parallel path on a mesh with an ``expert`` axis."""
        moe, d, c = config.moe, config.embed_dim, shape.bytes
        router = moe.router
        k, experts, f = router.top_k, router.num_experts, shape.split(moe.expert_dim)
        routing = c * 2 * d + 4 * 3 * experts + c * 3 * shape.split(moe.shared_width)
        name = dispatch.backend_name(moe)
        dropless = router.capacity_factor is None and name != "dense"
        if dropless and shape.expert > 1:
            # Expert parallel: send and receive buffers padded to P * T*k rows, local compute on all of them.
            return Cost(routing + c * shape.expert * k * (4 * d + 3 * f))
        return Cost(routing + dispatch.BACKENDS.get(name).estimate(moe, shape.tokens, d, f, c))

    @classmethod
    def check(cls, config: ModelConfig, layer: LayerKind) -> None:
        if config.moe is None:
            raise ValueError("ModelConfig.moe=None is invalid; allowed: a MoEConfig (a layer has 'moe' FFN)")
