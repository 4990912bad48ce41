"""One optimizer step and one evaluation step, compiled with ``eqx.filter_jit``."""

from collections.abc import Callable, Iterator

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from eqmoe import parallel
from eqmoe.data import packing
from eqmoe.losses import objective
from eqmoe.model import Transformer
from eqmoe.nn.routing_stats import RouterStats, max_violation
from eqmoe.params import Role, role_mask
from eqmoe.progress import phase_bar
from eqmoe.train.balance import update_router_biases
from eqmoe.train.state import TrainState

Metrics = dict[str, Float[Array, ""]]
RoutingSums = dict[str, Float[Array, "..."]]  # :func:`_routing_sums`


class Batch(eqx.Module):
    """A training batch as device arrays: packed rows and the mask of the targets that count."""

    tokens: Int[Array, "batch seq"]
    segment_ids: Int[Array, "batch seq"]
    positions: Int[Array, "batch seq"]
    target_mask: Bool[Array, "batch seq"]  # target_mask[b, t]: predicting tokens[b, t] from t - 1 counts


def device_batch(
    rows: packing.PackedRows, parallelism: parallel.Parallelism | None = None, *, process_local: bool = True
) -> Batch:
    """Packed NumPy rows as a device :class:`Batch`, with the next-token target mask.

    On a mesh the batch is split over the ``batch`` rule's axes: ``rows`` are this process's slice of the
    global batch (``process_local``, training data from ``PackedDataset.batch_at(shard=...)``) or the whole
    batch, held by every process (held-out data)."""
    put = parallel.global_batch if process_local else parallel.replicated_batch
    return Batch(
        tokens=put(rows.tokens, parallelism),
        segment_ids=put(rows.segment_ids, parallelism),
        positions=put(rows.positions, parallelism),
        target_mask=put(packing.target_mask(rows), parallelism),
    )


def held_out_batches(rows: packing.PackedRows, batch_size: int) -> Iterator[tuple[Batch, np.ndarray, np.ndarray]]:
    """Every held-out row once, in device batches of ``batch_size`` rows: ``(batch, index, real)`` where
    ``index`` are the rows taken and ``real`` is false for the all-padding rows that fill the last batch
    (padding has no targets, so token-weighted sums are exact). Replicated on the current mesh."""
    count = len(rows.tokens)
    for start in phase_bar(range(0, count, batch_size), "evaluating", unit="batch"):
        index = np.arange(start, start + batch_size) % count
        real = np.arange(batch_size) + start < count
        chunk = packing.PackedRows(*(np.where(real[:, None], np.asarray(array)[index], 0) for array in rows))
        yield device_batch(chunk, parallel.current(), process_local=False), index, real


def batch_loss(
    model: Transformer, batch: Batch, key: PRNGKeyArray | None = None
) -> tuple[Float[Array, ""], tuple[Metrics, RoutingSums | None]]:
    """The configured objective on a packed batch (padding, segment id 0, is masked everywhere), its
    terms and each MoE layer's routing sums (:func:`_routing_sums`; ``None`` without MoE layers). ``key``: the
    step's training-time randomness (LoRA dropout)."""
    chunked = model.config.output_chunk > 0  # the loss takes the output layer in chunks
    output = model(
        batch.tokens,
        segment_ids=batch.segment_ids,
        positions=batch.positions,
        token_mask=batch.segment_ids != 0,
        key=key,
        logits=not chunked,
    )
    head = model.cast(model.config.dtype).head if chunked else None
    loss, terms = objective(output, batch.tokens, batch.target_mask, model.config, head)
    sums = None if output.aux is None else _routing_sums(output.aux)
    if sums is not None:
        terms.update(_routing_terms(sums))
    terms["target_tokens"] = jnp.sum(batch.target_mask[:, 1:]).astype(jnp.float32)
    return loss, (terms, sums)


def _routing_sums(stats: RouterStats) -> RoutingSums:
    """The additive part of each MoE layer's routing statistics: under accumulation these add up over the
    micro-batches and the step's routing terms are taken of the sums (exactly the whole batch's)."""
    return {
        "expert_counts": stats.expert_counts,
        "dropped": stats.dropped,
        "entropy_sum": stats.entropy_sum,
        "num_tokens": stats.num_tokens,
    }


def _routing_terms(sums: RoutingSums) -> Metrics:
    """Router entropy (1 = uniform), the dropped fraction and the load balance of a batch's routing sums, per MoE
    layer too (lists in metrics.jsonl, one tracker scalar per layer): a dead or hot expert in one layer is hidden by
    the means over layers. Ratios of sums, so under accumulation never averaged."""
    expert_counts = sums["expert_counts"]
    num_experts = expert_counts.shape[-1]
    assignments = jnp.maximum(expert_counts.sum(-1), 1.0)
    entropy = sums["entropy_sum"] / jnp.maximum(sums["num_tokens"], 1.0) / jnp.log(max(num_experts, 2))
    load = expert_counts / assignments[..., None]
    shares = load * num_experts  # 1 = uniform
    max_vio = max_violation(expert_counts)
    return {
        "router_entropy": jnp.mean(entropy),
        "router_entropy_by_layer": entropy,
        "dropped_fraction_by_layer": sums["dropped"] / assignments,
        "load_cv": jnp.mean(jnp.std(load, axis=-1) / jnp.maximum(jnp.mean(load, axis=-1), 1e-9)),
        "load_max_over_mean": jnp.mean(jnp.max(load, -1) * num_experts),  # 1 = perfectly balanced
        "load_cv_by_layer": jnp.std(shares, axis=-1),
        "load_max_minus_min_by_layer": jnp.max(shares, -1) - jnp.min(shares, -1),  # in uniform shares
        "max_vio": jnp.mean(max_vio),
        "max_vio_by_layer": max_vio,
    }


def make_train_step(
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
    trained: Callable[[Role], bool] | None = None,
    micro_batches: int = 1,
) -> Callable[[Batch, TrainState], tuple[TrainState, Metrics]]:
    """``train_step(batch, state) -> (state, metrics)``; the state's buffers are donated.

    After the optimizer update, routers with a selection bias are rebalanced from this batch's loads
    (:func:`eqmoe.train.balance.update_router_biases`), unless the router is frozen (``--freeze router``, or the
    base of a LoRA model): the bias decides routing as much as the router's weights do, and a PEFT adapter
    folder could not carry a moved one."""

    return eqx.filter_jit(train_step_fn(optimizer, schedule, trained, micro_batches), donate="all-except-first")


def _micro_batches(batch: Batch, count: int) -> Batch:
    """``[count * rows, seq]`` as ``[count, rows, seq]``: micro-batch ``j`` is rows ``j, j + count, ...``, so each
    device's block of rows (the batch axis is split in blocks) stays on it."""
    return jax.tree.map(lambda x: jnp.moveaxis(x.reshape(-1, count, *x.shape[1:]), 1, 0), batch)


def accumulated_loss_and_grads(loss_of, part, batch: Batch, count: int, key):
    """The gradient of the whole batch's objective taken over ``count`` micro-batches in a ``lax.scan``, so that
    activations are held for one micro-batch at a time. Each micro-batch's terms count by its share of the batch's
    target tokens: cross-entropy (a mean over target tokens) equals the whole batch's and the router losses are
    the token-weighted mean of the micro-batches'; the routing sums add up, and router entropy, the dropped
    fraction and the load balance (CV, max over mean, MaxVio) are taken of the summed ones. Returns
    ``(terms, routing sums, grads)`` like one batch."""
    micro = _micro_batches(batch, count)
    targets = jnp.sum(micro.target_mask[:, :, 1:], axis=(1, 2)).astype(jnp.float32)
    shares = targets / jnp.maximum(jnp.sum(targets), 1.0)

    def one(carry, inputs):
        index, share, rows = inputs

        def weighted(p):
            loss, aux = loss_of(p, rows, jax.random.fold_in(key, index))
            return loss * share, aux

        (_, (terms, sums)), grads = eqx.filter_value_and_grad(weighted, has_aux=True)(part)
        terms = {name: value if name == "target_tokens" else value * share for name, value in terms.items()}
        step = (terms, sums, grads)  # routing sums and target tokens add up; the rest is weighted
        return step if carry is None else jax.tree.map(jnp.add, carry, step), None

    first = jax.tree.map(lambda x: x[0], micro)
    shapes = eqx.filter_eval_shape(lambda: one(None, (0, shares[0], first))[0])
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
    (terms, sums, grads), _ = jax.lax.scan(one, zeros, (jnp.arange(count), shares, micro))
    if sums is not None:  # ratios of the whole batch's sums, not means of the micro-batches' ratios
        terms.update(_routing_terms(sums))
    return terms, sums, grads


def train_step_fn(
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
    trained: Callable[[Role], bool] | None = None,
    micro_batches: int = 1,
) -> Callable[[Batch, TrainState], tuple[TrainState, Metrics]]:
    """The un-compiled train step (for lowering on abstract inputs, as ``experiments.plan`` does).

    ``trained`` (``eqmoe.train.optimizer.trained_roles``) says which roles are differentiated: the others
    (frozen roles, the base weights of a LoRA model) are constants of the loss, so no gradient of theirs is
    computed, and the optimizer, which keeps no state for them, gives them no update: they are the same buffers."""
    trained = trained or (lambda role: role.trained)

    def train_step(batch: Batch, state: TrainState) -> tuple[TrainState, Metrics]:
        differentiated, constant = eqx.partition(state.model, role_mask(state.model, trained))
        step_key = jax.random.fold_in(state.key, state.step)  # the next state's key; this step's randomness below
        dropout_key = jax.random.fold_in(step_key, 0)
        if micro_batches == 1:
            loss_of = lambda part, batch: batch_loss(eqx.combine(part, constant), batch, dropout_key)  # noqa: E731
            (_, (terms, routing)), grads = eqx.filter_value_and_grad(loss_of, has_aux=True)(differentiated, batch)
        else:
            loss_of = lambda part, rows, key: batch_loss(eqx.combine(part, constant), rows, key)  # noqa: E731
            terms, routing, grads = accumulated_loss_and_grads(
                loss_of, differentiated, batch, micro_batches, dropout_key
            )
        params = eqx.filter(state.model, eqx.is_array)
        updates, opt_state = optimizer.update(grads, state.opt_state, params)
        model = eqx.apply_updates(state.model, updates)
        if routing is not None and trained(Role.ROUTER):
            model = update_router_biases(model, routing["expert_counts"])
        terms["grad_norm"] = optax.tree.norm(grads)
        terms["learning_rate"] = schedule(state.step)
        new_state = TrainState(model, opt_state, state.step + 1, state.data_step + 1, step_key)
        return parallel.constrain(new_state), terms

    return train_step


def exact_match_counts(logits: Float[Array, "batch seq vocab"], batch: Batch) -> tuple[Int[Array, ""], Int[Array, ""]]:
    """``(documents whose every target token is the argmax, documents with targets)`` in a packed batch.

    Teacher-forced argmax over a whole answer (its closing token included) succeeds exactly when
    greedy decoding reproduces that answer, so this is greedy exact match without a decoding loop.
    """
    predicted = jnp.argmax(logits[:, :-1], axis=-1)
    targets = batch.target_mask[:, 1:]
    wrong = (predicted != batch.tokens[:, 1:]) & targets
    segments = batch.segment_ids[:, 1:]
    rows = jnp.arange(segments.shape[0])[:, None]
    slots = segments.shape[1] + 1
    wrong_per_doc = jnp.zeros((segments.shape[0], slots), jnp.int32).at[rows, segments].add(wrong)
    targets_per_doc = jnp.zeros((segments.shape[0], slots), jnp.int32).at[rows, segments].add(targets)
    has_targets = (targets_per_doc > 0).at[:, 0].set(False)
    return jnp.sum(has_targets & (wrong_per_doc == 0)), jnp.sum(has_targets)


@eqx.filter_jit
def routing_eval_step(
    model: Transformer, batch: Batch, token_domains: Float[Array, "batch seq domains"] | None = None
) -> tuple[Metrics, RouterStats | None]:
    """The loss terms on a batch, without gradients, and the router statistics of every MoE layer (with
    per-domain assignment counts when ``token_domains``, one-hot per token, is given)."""
    output = model(
        batch.tokens, segment_ids=batch.segment_ids, positions=batch.positions, token_mask=batch.segment_ids != 0
    )
    _, terms = objective(output, batch.tokens, batch.target_mask, model.config)
    terms["target_tokens"] = jnp.sum(batch.target_mask[:, 1:]).astype(jnp.float32)
    return terms, output.stats(token_domains)


@eqx.filter_jit
def eval_step(model: Transformer, batch: Batch) -> Metrics:
    """The loss terms on a batch, without gradients, plus exact-match counts of whole answers."""
    output = model(
        batch.tokens, segment_ids=batch.segment_ids, positions=batch.positions, token_mask=batch.segment_ids != 0
    )
    _, terms = objective(output, batch.tokens, batch.target_mask, model.config)
    correct, documents = exact_match_counts(output.logits, batch)
    terms["target_tokens"] = jnp.sum(batch.target_mask[:, 1:]).astype(jnp.float32)
    terms["exact_match_correct"] = correct.astype(jnp.float32)
    terms["exact_match_documents"] = documents.astype(jnp.float32)
    return terms
