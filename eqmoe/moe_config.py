"""The routed-expert part of a model's configuration (``ModelConfig.moe`` and ``ModelConfig.loss``): which experts a
token goes to, the experts themselves and how they are dispatched, and the losses that train the router."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from eqmoe._checks import _check, _one_of, _positive, _whole, execution


@dataclass(frozen=True)
class RouterConfig:
    """Which experts a token goes to and with what weight.

    ``strategy``, a name registered in :data:`eqmoe.registries.ROUTER_STRATEGIES` (built in, in
    :mod:`eqmoe.nn.router`; a new one is a function and a registration):

    - ``"softmax_top_k"``: softmax over all experts, the ``top_k`` largest; divided by their sum when
      ``renormalize`` (HF Qwen3 ``norm_topk_prob``). ``top_k=1, renormalize=False`` is Switch routing.
    - ``"top_k_softmax"``: the ``top_k`` largest logits, softmax over those only (MaxText).
    - ``"top2_gating"``: AXLearn Top2Gating: softmax, top-2, ``g_i / (g1 + g2 + 1e-9)``.
    - ``"sigmoid_top_k"``: independent ``sigmoid(logit)`` scores, the ``top_k`` largest, divided by their
      sum when ``renormalize`` (DeepSeek-V3).

    ``bias_update_rate > 0`` gives the router a per-expert selection bias (aux-loss-free balancing,
    DeepSeek-V3): experts are chosen by ``score + bias`` but weighted by the score alone, and after
    every optimizer step the train step moves the bias by ``rate * sign(mean load - load)`` (the bias
    is not trained by the gradient and not decayed). ``routed_scaling_factor`` multiplies the final
    combine weights (DeepSeek-V3 uses 2.5 with renormalised sigmoid scores).

    ``capacity_factor`` (``None`` = dropless) caps each expert at ``max(1, int(S * factor / E))``
    assignments per group of ``S`` tokens (the batch's tokens split into ``num_groups`` groups); every
    rank-1 assignment is placed before any rank-2 one, earlier tokens first within a rank; a dropped
    assignment contributes nothing and the kept weights are not renormalised.

    ``expert_groups > 1`` is DeepSeek-V3's group-limited routing: the experts split into ``expert_groups``
    contiguous groups, each scored by the sum of its two best choice scores (the strategy's scores plus the
    selection bias), and the top-k is taken among the experts of the ``expert_groups_kept`` best groups only
    (``None``: every group). ``expert_group_score`` says how a group is scored: ``"top2_sum"`` (DeepSeek-V3, the sum
    of its two best) or ``"max"`` (DeepSeek-V2's ``group_limited_greedy``, its best).

    ``gate_bias`` gives the router's linear gate a trained bias, ``logits = x @ W + b`` (gpt-oss).
    """

    num_experts: int
    top_k: int
    strategy: str = "softmax_top_k"
    renormalize: bool = True
    capacity_factor: float | None = None
    num_groups: int = 1
    bias_update_rate: float = 0.0
    routed_scaling_factor: float = 1.0
    expert_groups: int = 1
    expert_groups_kept: int | None = None
    expert_group_score: Literal["top2_sum", "max"] = "top2_sum"
    gate_bias: bool = False

    def __post_init__(self):
        _positive("RouterConfig", num_experts=self.num_experts, top_k=self.top_k, num_groups=self.num_groups)
        _check(self.bias_update_rate >= 0, "RouterConfig", "bias_update_rate", self.bias_update_rate, "a number >= 0")
        _check(
            self.top_k <= self.num_experts, "RouterConfig", "top_k", self.top_k, f"1..num_experts={self.num_experts}"
        )
        _positive("RouterConfig", expert_groups=self.expert_groups)
        groups, kept = self.expert_groups, self.expert_groups_kept
        _check(
            self.num_experts % groups == 0,
            "RouterConfig",
            "expert_groups",
            groups,
            f"a divisor of num_experts={self.num_experts}",
        )
        _one_of("RouterConfig", "expert_group_score", self.expert_group_score, ("top2_sum", "max"))
        _check(
            groups == 1 or self.num_experts // groups >= 2 or self.expert_group_score == "max",
            "RouterConfig",
            "expert_groups",
            groups,
            "1, or groups of at least 2 experts (a group scores by its two best)",
        )
        _check(kept is None or 1 <= kept <= groups, "RouterConfig", "expert_groups_kept", kept, f"None | 1..{groups}")
        eligible = (groups if kept is None else kept) * (self.num_experts // groups)
        _check(
            self.top_k <= eligible,
            "RouterConfig",
            "top_k",
            self.top_k,
            f"1..{eligible} (the experts of the expert_groups_kept={kept} groups)",
        )
        _positive("RouterConfig", routed_scaling_factor=self.routed_scaling_factor)
        if self.capacity_factor is not None:
            _positive("RouterConfig", capacity_factor=self.capacity_factor)


@dataclass(frozen=True)
class LossConfig:
    """Which losses enter the training objective, and with what weights (all are reported regardless).

    ``load_balance`` picks the load-balancing form that is trained, a name registered in
    :data:`eqmoe.registries.LOAD_BALANCE` (every registered form is reported):

    - ``"hf_pooled"``: HF ``E * sum_e f_e P_e`` with top-k fractions pooled over all MoE layers and tokens;
    - ``"axlearn_top1"``: ``E^2 * mean_{groups, e}(f_e P_e)`` with ``f_e`` the top-1 fraction, per layer;
    - ``"maxtext_sequence"``: ``E^2 * mean_{d, e}(density P)`` per packed document ``d`` (a row holds several),
      averaged over layers;
    - ``"micro_batch"``: ``hf_pooled`` taken on each slice of ``balance_micro_batch_rows`` consecutive rows alone and
      averaged over the slices (Qiu et al. 2025's micro-batch balance; ``hf_pooled`` is their global batch). The
      rows are those of one forward pass: with gradient accumulation, of each accumulated micro-batch. When
      ``balance_micro_batch_rows`` does not divide them, the last slice holds the rows left over (and counts as
      much as a whole one). With ``balance_micro_batch_rows`` the rows each device holds, each device's rows are
      balanced alone.

    ``router_z_loss_weight`` multiplies ``mean(logsumexp(router_logits)^2)``; ``output_z_loss_weight``
    multiplies ``mean(logsumexp(output_logits)^2)`` over the target tokens. ``mtp_weight`` multiplies the mean over
    the multi-token-prediction depths of their cross-entropy (DeepSeek-V3's lambda: 0.3, then 0.1; needs
    ``ModelConfig.mtp_layers``).
    """

    load_balance: str = "hf_pooled"
    load_balance_weight: float = 0.001
    router_z_loss_weight: float = 0.0
    output_z_loss_weight: float = 0.0
    mtp_weight: float = 0.0
    balance_micro_batch_rows: int = 1

    def __post_init__(self):
        for name in ("load_balance_weight", "router_z_loss_weight", "output_z_loss_weight", "mtp_weight"):
            _check(getattr(self, name) >= 0, "LossConfig", name, getattr(self, name), "a number >= 0")
        _whole("LossConfig", "balance_micro_batch_rows", self.balance_micro_batch_rows, 1)


@dataclass(frozen=True)
class MoEConfig:
    """A routed-expert FFN: the router, each expert's SwiGLU width and the dispatch backend.

    ``dispatch``, a backend registered in :data:`eqmoe.registries.DISPATCH_BACKENDS` (with its planner estimate)
    or ``"auto"``: ``"dense"`` runs every expert on every token (the reference); ``"sorted"`` sorts
    token slots by expert into blocks of ``block_size`` rows and runs grouped matmuls (dropless);
    ``"ragged_dot"`` sorts them without padding and calls ``jax.lax.ragged_dot`` (dropless, the GPU/TPU
    path); ``"gmm"`` sorts them, pads them to whole row tiles and runs the TPU's grouped-matmul kernel in
    ``tiles = (rows, in, out)`` (dropless; Pallas interpret mode off the TPU, for checking); ``"capacity"`` is the
    GShard einsum over ``[groups, S, E, C]`` buffers (needs a capacity factor); ``"auto"`` is chosen by timing
    every eligible backend on a training run's shapes (:mod:`eqmoe.autotune`; ``gmm`` on the TPU, at several
    tiles), else (``EQMOE_AUTO=rule``, meshes, inference) it picks ``capacity`` for capacity routing, ``sorted`` on
    CPU, ``gmm`` on TPU and ``ragged_dot`` on GPU.
    Every backend gives the same numbers for the same routing.

    ``shared_experts`` SwiGLU experts of width ``shared_expert_dim`` (``None``: ``expert_dim``) see every token
    and are added to the routed output; being all active they are one SwiGLU of width
    ``shared_experts * shared_expert_dim`` (GLM-4.5, DeepSeek). ``shared_expert_gate`` multiplies their output
    by ``sigmoid(x @ w)``, one learned scalar gate per token (Qwen2-MoE).

    ``activation``, a name registered in :data:`eqmoe.registries.FFN_ACTIVATIONS`, is the routed experts' gated unit
    between their input and output sides (:mod:`eqmoe.nn.activations`): ``"swiglu"`` is ``silu(gate) * up``;
    ``"clamped_swiglu"`` is gpt-oss's ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)`` with the gate clamped above
    at ``swiglu_limit`` and up clamped to ``+-swiglu_limit`` (the two constants are read by it alone).
    ``expert_bias`` gives every routed expert's gate, up and down matrices a bias (gpt-oss).
    """

    router: RouterConfig
    expert_dim: int
    shared_experts: int = 0
    shared_expert_dim: int | None = None
    shared_expert_gate: bool = False
    activation: str = "swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    expert_bias: bool = False
    dispatch: str = execution("auto")
    block_size: int = execution(64)
    tiles: tuple[int, int, int] = execution((512, 1024, 1024))

    def __post_init__(self):
        _positive("MoEConfig", expert_dim=self.expert_dim, block_size=self.block_size)
        _check(
            len(self.tiles) == 3 and all(isinstance(t, int) and t > 0 for t in self.tiles),
            "MoEConfig",
            "tiles",
            self.tiles,
            "three positive integers (rows, in, out)",
        )
        _positive("MoEConfig", swiglu_alpha=self.swiglu_alpha, swiglu_limit=self.swiglu_limit)
        _check(self.shared_experts >= 0, "MoEConfig", "shared_experts", self.shared_experts, "an integer >= 0")
        if self.shared_expert_dim is not None:
            _positive("MoEConfig", shared_expert_dim=self.shared_expert_dim)
        _check(
            self.shared_experts > 0 or not self.shared_expert_gate,
            "MoEConfig",
            "shared_expert_gate",
            self.shared_expert_gate,
            "False (shared_experts=0: nothing to gate)",
        )

    @property
    def shared_width(self) -> int:
        """The width of the one SwiGLU the shared experts make up (0 without any)."""
        return self.shared_experts * (self.shared_expert_dim or self.expert_dim)
