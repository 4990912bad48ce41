"""AdamW with warmup + cosine decay, global-norm clipping, weight-decay masks and mup-simple scaling.

One :class:`OptimizerConfig` covers both conventions in use:

- optax/PyTorch AdamW: ``p -= lr_t * (adam(g) + wd * p)`` (decay scaled by the learning rate);
- AXLearn (``decay_scaled_by_schedule=True``): ``p -= lr_t * adam(g) + wd * (lr_t / lr_peak) * p``
  (decoupled weight decay scaled by the schedule only).

``mup_base_dim`` enables AXLearn's "mup-simple": Adam updates of attention, dense-FFN and expert weights
are multiplied by ``min(mup_base_dim / embed_dim, 1)``; the router gate, embedding and norms are not.

Parameters that are not trained (the router's selection bias, moved by :mod:`eqmoe.train.balance`; the
roles in ``freeze``; everything but the adapters of a LoRA model) get no update and no optimizer state.
Every mask reads the :class:`eqmoe.nn.Role` each parameter declares.
"""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from eqmoe.config import _check, _positive
from eqmoe.nn.fp8 import is_block_fp8
from eqmoe.params import ParamInfo, Role, param_info, param_infos, role_mask

FREEZABLE = tuple(role.value for role in Role if role.trained and role is not Role.ADAPTER)
_ALIASES = {"embeddings": "embedding", "experts": "expert", "norms": "norm", "routers": "router"}


@dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer and learning-rate schedule.

    The schedule warms up linearly from 0 over ``warmup_steps`` and then follows a cosine to
    ``learning_rate * final_lr_ratio`` at ``decay_steps`` (``None``: constant after warmup; ``"steps"``: at the
    run's last step, so a run extended with ``--resume`` changes its schedule from there, while a number keeps
    it: one long run's schedule).
    """

    learning_rate: float | None = 3e-4
    """Peak learning rate (None: the command's default for the starting model, which it reports)."""
    warmup_steps: int = 100
    """Linear warmup from 0 to the peak."""
    decay_steps: int | Literal["steps"] | None = None
    """Step at which the cosine reaches its end value (None: constant after warmup; steps: the run's --steps)."""
    final_lr_ratio: float = 0.1
    """End of the cosine as a fraction of the peak."""
    b1: float = 0.9
    """Adam first-moment decay."""
    b2: float = 0.95
    """Adam second-moment decay."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay (not applied to norm scales unless decay_norms)."""
    decay_scaled_by_schedule: bool = False
    """AXLearn convention: decay scaled by lr_t / lr_peak instead of by lr_t."""
    decay_norms: bool = False
    """Also decay RMSNorm scales and biases."""
    clip_norm: float | None = 1.0
    """Clip gradients to this global norm (None: no clipping)."""
    mup_base_dim: int | None = None
    """mup-simple: scale matrix updates by min(mup_base_dim / embed_dim, 1) (None: off)."""
    freeze: tuple[str, ...] = ()
    """Parameter roles left untrained (no gradient, no optimizer state), e.g. --freeze router embedding. A model with
    LoRA adapters trains its adapters only."""

    def __post_init__(self):
        if self.learning_rate is not None:
            _positive("OptimizerConfig", learning_rate=self.learning_rate)
        _positive("OptimizerConfig", eps=self.eps)
        _check(self.warmup_steps >= 0, "OptimizerConfig", "warmup_steps", self.warmup_steps, "an integer >= 0")
        _check(0 <= self.final_lr_ratio <= 1, "OptimizerConfig", "final_lr_ratio", self.final_lr_ratio, "0..1")
        for name in ("b1", "b2"):
            _check(0 <= getattr(self, name) < 1, "OptimizerConfig", name, getattr(self, name), "0 <= value < 1")
        _check(self.weight_decay >= 0, "OptimizerConfig", "weight_decay", self.weight_decay, "a number >= 0")
        if self.clip_norm is not None:
            _positive("OptimizerConfig", clip_norm=self.clip_norm)
        if self.decay_steps not in (None, "steps"):
            _positive("OptimizerConfig", decay_steps=self.decay_steps)
        if self.mup_base_dim is not None:
            _positive("OptimizerConfig", mup_base_dim=self.mup_base_dim)
        for name in self.freeze:
            if _ALIASES.get(name, name) not in FREEZABLE:
                allowed = " | ".join(FREEZABLE)
                raise ValueError(f"OptimizerConfig.freeze: {name!r} is not a role; allowed: {allowed}")

    def for_run(self, steps: int, learning_rate: float | None = None) -> "OptimizerConfig":
        """This config for a run of ``steps`` steps: ``decay_steps="steps"`` becomes ``steps`` and an unset learning
        rate ``learning_rate``."""
        return dataclasses.replace(
            self,
            decay_steps=steps if self.decay_steps == "steps" else self.decay_steps,
            learning_rate=self.learning_rate if self.learning_rate is not None else learning_rate,
        )

    def frozen_roles(self) -> frozenset[Role]:
        return frozenset(Role(_ALIASES.get(name, name)) for name in self.freeze)


def envy_optimizer(embed_dim: int) -> OptimizerConfig:
    """AXLearn's Envy optimizer (non-test sizes): clip 1.0; AdamW b1 0.9, b2 0.95, eps 1e-8, lr 0.01;
    decoupled weight decay 1e-4 scaled by the schedule only; 5000 warmup steps, cosine to lr/200 at
    250k steps; mup-simple with base dimension 768 (``embed_dim`` only documents the resulting factor)."""
    del embed_dim
    return OptimizerConfig(
        learning_rate=0.01,
        warmup_steps=5000,
        decay_steps=250_000,
        final_lr_ratio=1 / 200,
        b1=0.9,
        b2=0.95,
        eps=1e-8,
        weight_decay=1e-4,
        decay_scaled_by_schedule=True,
        clip_norm=1.0,
        mup_base_dim=768,
    )


def learning_rate_schedule(config: OptimizerConfig) -> optax.Schedule:
    if config.learning_rate is None or config.decay_steps == "steps":
        raise ValueError("OptimizerConfig: learning_rate or decay_steps unresolved (see OptimizerConfig.for_run)")
    if config.decay_steps is None:
        return optax.join_schedules(
            [
                optax.linear_schedule(0.0, config.learning_rate, config.warmup_steps),
                optax.constant_schedule(config.learning_rate),
            ],
            [config.warmup_steps],
        )
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.learning_rate,
        warmup_steps=config.warmup_steps,
        decay_steps=max(config.decay_steps, config.warmup_steps + 1),
        end_value=config.learning_rate * config.final_lr_ratio,
    )


def trained_roles(config: OptimizerConfig, params) -> Callable[[Role], bool]:
    """Whether the optimizer trains a role: not the router bias (moved by the balance rule), not a frozen
    role, and, when ``params`` hold LoRA adapters, nothing but the adapters."""
    frozen = config.frozen_roles()
    adapters = any(info.role is Role.ADAPTER for info in param_infos(params))
    # the multi-token-prediction layers train only where the objective reads them
    model_config = getattr(params, "config", None)
    mtp = model_config is not None and model_config.loss.mtp_weight > 0

    def trained(role: Role) -> bool:
        updated = role.trained or (role is Role.MTP and mtp)
        return updated and role not in frozen and (role is Role.ADAPTER or not adapters)

    return trained


def _check_declared(params) -> None:
    infos = jax.tree_util.tree_leaves_with_path(param_info(params))
    undeclared = [jax.tree_util.keystr(path) for path, info in infos if info.role is None]
    if undeclared:
        raise ValueError(
            f"make_optimizer: {undeclared[0]} is an array outside any eqmoe.nn.Layer, so it has no declared role "
            "(decay, mup and training all depend on the role)"
        )


def _check_fp8_frozen(params, is_trained: Callable[[Role], bool]) -> None:
    """A weight held in block-FP8 (:mod:`eqmoe.nn.fp8`) is never trained: a one-line ``ValueError`` naming the first
    one the optimizer would update."""
    infos = param_info(params)
    held = jax.tree_util.tree_leaves_with_path(infos, is_leaf=is_block_fp8)
    for path, node in held:
        if is_block_fp8(node) and isinstance(node.values, ParamInfo) and is_trained(node.values.role):
            raise ValueError(
                f"make_optimizer: {jax.tree_util.keystr(path)} is held in block-FP8 and its role "
                f"{node.values.role.value!r} would be trained; an FP8 weight is never trained: train LoRA adapters "
                "over it (--lora-rank) or load the base dequantized"
            )


def decays(config: OptimizerConfig, role: Role) -> bool:
    """Whether weight decay applies: every parameter but the norm scales and biases (unless ``decay_norms``),
    as transformers' Trainer leaves them out."""
    return config.decay_norms or role not in (Role.NORM, Role.BIAS)


class _CountState(NamedTuple):
    count: jax.Array


def _decay_scaled_by_schedule(rate: float, schedule: optax.Schedule, peak: float) -> optax.GradientTransformation:
    """Adds ``-rate * schedule(step) / peak * p`` to the (already learning-rate-scaled) update."""

    def init(params):
        del params
        return _CountState(jnp.zeros([], jnp.int32))

    def update(updates, state, params):
        factor = -rate * schedule(state.count) / peak
        updates = jax.tree.map(lambda u, p: u + (factor * p).astype(u.dtype), updates, params)
        return updates, _CountState(state.count + 1)

    return optax.GradientTransformation(init, update)


def make_optimizer(
    config: OptimizerConfig, params, *, embed_dim: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optax transformation for ``params`` (the array leaves of a model) and its schedule."""
    _check_declared(params)
    schedule = learning_rate_schedule(config)
    decay_mask = lambda tree: role_mask(tree, lambda role: decays(config, role))  # noqa: E731
    steps = [] if config.clip_norm is None else [optax.clip_by_global_norm(config.clip_norm)]
    steps.append(optax.scale_by_adam(b1=config.b1, b2=config.b2, eps=config.eps))
    if config.mup_base_dim is not None:
        factor = min(config.mup_base_dim / embed_dim, 1.0)
        steps.append(optax.masked(optax.scale(factor), lambda tree: role_mask(tree, lambda role: role.hidden_matrix)))
    if config.decay_scaled_by_schedule:
        steps.append(optax.scale_by_learning_rate(schedule))
        decay = _decay_scaled_by_schedule(config.weight_decay, schedule, config.learning_rate)
        steps.append(optax.masked(decay, decay_mask))
    else:
        steps.append(optax.add_decayed_weights(config.weight_decay, decay_mask))
        steps.append(optax.scale_by_learning_rate(schedule))
    optimizer = optax.chain(*steps)

    is_trained = trained_roles(config, params)
    _check_fp8_frozen(params, is_trained)
    return _trained_only(optimizer, is_trained), schedule


def _trained_only(inner: optax.GradientTransformation, is_trained: Callable[[Role], bool]):
    """``inner`` on the trained parameters alone: it keeps no state for the others and returns ``None`` updates
    for them, which ``eqx.apply_updates`` skips (their gradients, ``None`` or zeros, are ignored)."""

    def trained(tree):
        return eqx.filter(tree, role_mask(tree, is_trained))

    def init(params):
        return inner.init(trained(params))

    def update(updates, state, params=None):
        return inner.update(trained(updates), state, None if params is None else trained(params))

    return optax.GradientTransformation(init, update)


def model_params(model: eqx.Module):
    """The array leaves an optimizer updates."""
    return eqx.filter(model, eqx.is_array)


def parameter_counts(model, config: OptimizerConfig) -> dict[str, int | float]:
    """Total and trainable parameter counts of ``model`` under ``config`` (frozen roles, LoRA)."""
    params = eqx.filter(model, eqx.is_array)
    is_trained = trained_roles(config, params)
    infos, leaves = param_infos(params), jax.tree.leaves(params)
    total = sum(leaf.size for leaf in leaves)
    trainable = sum(leaf.size for info, leaf in zip(infos, leaves, strict=True) if is_trained(info.role))
    return {"total": total, "trainable": trainable, "trainable_fraction": trainable / max(total, 1)}
