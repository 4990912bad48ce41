"""The MoE layer: router, experts and a dispatch backend."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from eqmoe import parallel
from eqmoe.config import MoEConfig
from eqmoe.nn import dispatch
from eqmoe.nn._init import Init
from eqmoe.nn._params import Layer
from eqmoe.nn.expert_parallel import expert_parallel
from eqmoe.nn.router import Router, RouterStats, router_stats


class MoE(Layer):
    """A routed-expert FFN over all tokens of the batch at once (HF Qwen3MoeSparseMoeBlock).

    On a mesh with an ``expert`` axis the dropless path runs with expert parallelism
    (:mod:`eqmoe.nn.expert_parallel`) when the tokens split evenly over the ``batch`` axes (a decoding
    step of one token does not: it runs the plain backend on the sharded weights); capacity routing is
    left to XLA's SPMD partitioner.

    Returns the layer output and its :class:`RouterStats` over the tokens where ``token_mask`` is true
    (with per-domain counts when ``token_domains``, one-hot ``[batch, seq, domains]``, is given), the
    per-sequence balance taken per packed document of ``segment_ids`` (each row one without them).
    """

    router: Router
    experts: dispatch.Experts
    config: MoEConfig = eqx.field(static=True)

    def __init__(self, embed_dim: int, config: MoEConfig, *, init: Init, key: PRNGKeyArray):
        k_router, k_experts = jax.random.split(key)
        self.router = Router(embed_dim, config.router, init=init, key=k_router)
        self.experts = dispatch.Experts(
            config.router.num_experts, embed_dim, config.expert_dim, init=init, key=k_experts
        )
        self.config = config

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        token_mask: Bool[Array, "batch seq"] | None = None,
        token_domains: Float[Array, "batch seq domains"] | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], RouterStats]:
        batch, seq, embed = x.shape
        flat = x.reshape(batch * seq, embed)
        if token_mask is None:
            token_mask = jnp.ones((batch, seq), bool)
        routing = self.router(flat, token_mask.reshape(-1))
        parallelism = parallel.current()
        dropless = self.config.router.capacity_factor is None and self.config.dispatch != "dense"
        if (
            dropless
            and parallelism is not None
            and parallelism.size("expert") > 1
            and parallelism.splits(flat, "batch")
        ):
            y = expert_parallel(flat, routing, self.experts, self.config, parallelism)
        else:
            y = dispatch.resolve(self.config)(flat, routing, self.experts, self.config)
        stats = router_stats(routing, token_mask, self.config.router.num_groups, token_domains, segment_ids)
        return y.reshape(batch, seq, embed), stats
