"""The train state: everything a run needs to continue exactly where it stopped, as one pytree."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Int, PRNGKeyArray

from eqmoe import parallel
from eqmoe.model import Transformer
from eqmoe.nn.fp8 import is_block_fp8
from eqmoe.params import Role, role_mask


class TrainState(eqx.Module):
    """Model, optimizer state, step counter, data position and PRNG key.

    ``data_step`` is the loader position: the data order depends only on the seed and this counter,
    so restoring the state resumes the exact batch sequence of an uninterrupted run.
    """

    model: Transformer
    opt_state: optax.OptState
    step: Int[Array, ""]
    data_step: Int[Array, ""]
    key: PRNGKeyArray


def init_state(
    model: Transformer,
    optimizer: optax.GradientTransformation,
    *,
    key: PRNGKeyArray,
    parallelism: parallel.Parallelism | None = None,
) -> TrainState:
    """A fresh state at step 0 for ``model``, laid out on ``parallelism``'s mesh when one is given."""
    model = parallel.shard(model, parallelism)  # the optimizer moments are then created beside their parameters
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    # Separate buffers: the train step donates the state, and one buffer cannot be donated twice.
    step, data_step = jnp.zeros([], jnp.int32), jnp.zeros([], jnp.int32)
    state = TrainState(model=model, opt_state=opt_state, step=step, data_step=data_step, key=key)
    return parallel.shard(state, parallelism)


def abstract_state(model_fn, optimizer: optax.GradientTransformation, *, key: PRNGKeyArray) -> TrainState:
    """The state's shapes and dtypes (``jax.ShapeDtypeStruct`` leaves), built without allocating:
    the target of a checkpoint restore. ``model_fn()`` builds the model."""
    return eqx.filter_eval_shape(lambda: init_state(model_fn(), optimizer, key=key))


def hold_frozen(model: Transformer, trained: Callable[[Role], bool]) -> Transformer:
    """``model`` with every parameter the optimizer never updates (``trained(role)`` false: frozen roles, a LoRA
    model's base weights) held in the compute dtype. Each forward pass casts all parameters to that dtype
    first, so the numbers are the same and a bfloat16 run's frozen base takes half the memory. Router biases,
    moved outside the optimizer, keep their dtype, and a base held in block-FP8 (:mod:`eqmoe.nn.fp8`) stays so."""
    target = jnp.dtype(model.config.dtype)
    frozen = role_mask(model, lambda role: role is not Role.ROUTER_BIAS and not trained(role))

    def hold(frozen, leaf):
        if is_block_fp8(leaf):
            return leaf
        if frozen and eqx.is_array(leaf) and jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.dtype != target:
            return leaf.astype(target)
        return leaf

    return jax.tree.map(hold, frozen, model, is_leaf=is_block_fp8)


def param_count(state: TrainState) -> int:
    return sum(x.size for x in jax.tree.leaves(eqx.filter(state.model, eqx.is_array)))
