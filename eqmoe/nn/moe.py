"""The MoE layer: router, experts and a dispatch backend."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from eqmoe import parallel
from eqmoe.config import MoEConfig
from eqmoe.nn import dispatch
from eqmoe.nn._init import Init
from eqmoe.nn._params import Layer, Role, param
from eqmoe.nn.expert_parallel import expert_parallel
from eqmoe.nn.mlp import SwiGLU
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

    With ``MoEConfig.shared_experts`` the output adds ``shared_expert(x)`` (times ``sigmoid(x @ shared_gate)``
    when gated): a dense SwiGLU outside the dispatch, so every backend and expert parallelism run it alike.
    """

    router: Router
    experts: dispatch.Experts
    shared_expert: SwiGLU | None
    shared_gate: Float[Array, "embed gates"] | None = param(Role.MLP)
    config: MoEConfig = eqx.field(static=True)

    def __init__(self, embed_dim: int, config: MoEConfig, *, init: Init, key: PRNGKeyArray):
        k_router, k_experts = jax.random.split(key)
        # the shared experts' keys are drawn aside, so a model without them initialises as it always has
        k_shared, k_gate = jax.random.split(jax.random.fold_in(key, 1))
        self.router = Router(embed_dim, config.router, init=init, key=k_router)
        self.experts = dispatch.Experts(
            config.router.num_experts, embed_dim, config.expert_dim, init=init, key=k_experts
        )
        shared = config.shared_width
        self.shared_expert = SwiGLU(embed_dim, shared, init=init, key=k_shared) if shared else None
        gated = shared and config.shared_expert_gate
        self.shared_gate = init.weight(k_gate, (embed_dim, 1), fan_in=embed_dim) if gated else None
        self.config = config

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        token_mask: Bool[Array, "batch seq"] | None = None,
        token_domains: Float[Array, "batch seq domains"] | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], RouterStats]:
        """``key``: randomness of training-time LoRA dropout in the shared expert's adapters (None: none)."""
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
        if self.shared_expert is not None:
            shared = self.shared_expert(flat, key)
            if self.shared_gate is not None:
                # float32 then one rounding, as torch's sigmoid of a half-precision tensor
                gate = jax.nn.sigmoid((flat @ self.shared_gate.astype(flat.dtype)).astype(jnp.float32))
                shared = gate.astype(shared.dtype) * shared
            y = y + shared
        stats = router_stats(routing, token_mask, self.config.router.num_groups, token_domains, segment_ids)
        return y.reshape(batch, seq, embed), stats
