"""Training: optimizer (and, as they land, train state, steps and the loop)."""

from eqmoe.train.optimizer import OptimizerConfig, envy_optimizer, make_optimizer

__all__ = ["OptimizerConfig", "envy_optimizer", "make_optimizer"]
