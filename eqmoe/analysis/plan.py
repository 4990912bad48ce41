"""Plan a run before paying for it: per-device memory and FLOPs of one train step, analytic and compiled.

:func:`compile_step` lowers and compiles the real train step on abstract inputs (``jax.ShapeDtypeStruct``
carrying the mesh's shardings; nothing of the model's size is allocated) and reads XLA's memory and cost
analyses. :func:`estimate` computes the same quantities from the config alone.

Analytic model, per device (``b = batch / (data * fsdp * expert)`` rows of ``T`` tokens; ``c`` compute-dtype
bytes; widths already divided by their mesh axes as the sharding rules split them):

- parameters ``P_local * 4`` (float32 storage; ``P_local`` from each leaf's local shard shape; parameters the step
  never updates, frozen or a LoRA base, are held in the compute dtype: ``c`` bytes each; a LoRA base held in block-FP8,
  ``Training.fp8_block``, takes one byte each plus a float32 scale per block);
- optimizer state ``2 * P_local * 4`` (Adam's two moments);
- gradients and the optimizer's update ``2 * P_local * 4``;
- activations kept for the backward pass, per layer and token (``remat="none"``):
  attention ``c * (4 D + 2 (H + 2 Hkv) hd + H hd) + 4 H`` (projections, the output and the float32
  log-sum-exp the blockwise backward pass starts from) plus ``c * 6 D`` of residual-stream copies
  (calibrated on XLA:CPU); the ``dense`` attention backend keeps ``10 H T`` more (float32 scores and
  probabilities, 8 H T, and about 2 H T more XLA keeps beside them). Blockwise attention adds, once per
  step, its float32 query-gradient buffer ``4 H hd`` per token and about one float32 ``[rows, H, B, B]`` tile;
  a gated DeltaNet (linear attention) layer keeps a length-independent amount per token (its projections,
  convolution taps, float32 chunked inputs and one float32 state per chunk: ``GatedDeltaNet.plan``) and adds once
  per step its float32 chunked cotangents;
  MoE FFN ``c * (2 D + k (2 D + 3 F)) + 4 * 3 E`` (router logits, probabilities, choice), dense FFN
  ``c * (2 D + 3 M)``; plus the output layer ``4 * 2 V`` per token (logits and their gradient: with the
  flat output matmul XLA keeps no third copy); with ``output_chunk`` only one chunk's positions hold them at once.
  With ``remat="block"`` each layer keeps its input ``c * D`` per token and about three quarters of one repeat
  unit's activations are live during its recomputation. XLA:CPU keeps nearly the sum of all this at once; a TPU
  peaks in one phase at a time, so there (``platform="tpu"``) the temporaries are the largest of: the output layer
  (``(4 + c) V`` per position, the float32 logits and their compute-dtype copy, with the embedding and output
  matrices in the compute dtype and the layer inputs), the layers' backward pass (the float32 gradients, the layer
  inputs and one unit recomputed) and the update (gradients and update);
- output (the new parameters and optimizer state, donated in place) equals parameters + optimizer state.

Model FLOPs per token (:mod:`eqmoe.flops`, the count training logs and ``bench_model`` take MFU from):
``6 N_active`` plus three times each attention kind's forward count (grouped-query attention ``4 H hd`` per visible
key, ``(T + 1) / 2`` keys on a causal row), with ``N_active`` the parameters a token touches (embedding lookup
excluded): its top-k experts only; recomputation is not counted. The kinds' ``Cost.flops`` are what their kernels
execute (blockwise attention's causal tiles and recomputed scores, ``14 H hd T (n + 1) / 2n``; a linear-attention
layer's chunks four times), the figure an estimate of step time would use.

Decoding cache (:func:`decoding_cache`): each attention kind's keys and values per token (``Cost.cache``) times the
length, plus each recurrent layer's state per sequence (``Cost.state``: a linear-attention layer's convolution window
and float32 state, the same at any length).
"""

import math
import time
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp

from eqmoe import flops, parallel
from eqmoe.config import ModelConfig, segments
from eqmoe.lora import LoRAConfig, add_lora
from eqmoe.model import Transformer
from eqmoe.nn.fp8 import is_block_fp8
from eqmoe.nn.kinds import Cost, PlanShape
from eqmoe.nn.linear import block_fp8_like
from eqmoe.params import ParamInfo, Role, param_info, param_infos
from eqmoe.registries import ATTENTION_KINDS, FFN_KINDS
from eqmoe.train.optimizer import OptimizerConfig, make_optimizer, trained_roles
from eqmoe.train.state import abstract_state, hold_frozen
from eqmoe.train.step import Batch, train_step_fn


class Memory(NamedTuple):
    """Bytes per device."""

    parameters: float
    optimizer: float
    gradients: float
    activations: float  # analytic: activations kept for backward; XLA: temp minus the gradients estimate
    batch: float
    output: float

    @property
    def argument(self) -> float:
        """What the step receives: parameters, optimizer state and the batch (XLA's argument size)."""
        return self.parameters + self.optimizer + self.batch

    @property
    def temp(self) -> float:
        """What the step allocates while running: gradients and activations (XLA's temp size)."""
        return self.gradients + self.activations

    @property
    def peak(self) -> float:
        """Arguments plus temporaries (outputs alias the donated arguments)."""
        return self.argument + self.temp


class Training(NamedTuple):
    """What a step trains: the optimizer settings (``freeze``) and LoRA adapters, if any; ``fp8_block``: the
    ``(b_in, b_out)`` blocks of a LoRA base held in block-FP8 (its attention, dense-FFN and expert matrices, as
    DeepSeek-V3 publishes them; ``None``: held as the other frozen parameters)."""

    optimizer: OptimizerConfig = OptimizerConfig()
    lora: LoRAConfig | None = None
    fp8_block: tuple[int, int] | None = None


def _local_size(leaf: jax.ShapeDtypeStruct) -> int:
    return math.prod(leaf.sharding.shard_shape(leaf.shape)) if leaf.sharding is not None else math.prod(leaf.shape)


def _model_fn(config: ModelConfig, lora: LoRAConfig | None, fp8_block: tuple[int, int] | None = None):
    def build():
        model = Transformer(config, key=jax.random.key(0))
        model = model if lora is None else add_lora(model, lora, key=jax.random.key(1))
        return model if fp8_block is None else block_fp8_like(model, fp8_block)

    return build


def _abstract(config: ModelConfig, p: parallel.Parallelism, batch: int, seq: int, training: Training | None = None):
    """The sharded abstract train state, its static part, the batch and the optimizer pieces."""
    training = training or Training()
    build = _model_fn(config, training.lora, training.fp8_block)
    model = eqx.filter_eval_shape(build)
    optimizer, schedule = make_optimizer(training.optimizer, model, embed_dim=config.embed_dim)
    trained = trained_roles(training.optimizer, model)
    held = lambda: hold_frozen(build(), trained)  # noqa: E731
    state = abstract_state(held, optimizer, key=jax.random.key(1))
    state = parallel.abstract_sharded(state, p)
    rows = p.sharding(("batch", "seq"), (batch, seq))
    dtypes = (jnp.int32, jnp.int32, jnp.int32, jnp.bool_)
    shapes = jax.eval_shape(lambda: Batch(*(jnp.zeros((batch, seq), d) for d in dtypes)))
    data = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rows), shapes)
    return state, data, optimizer, schedule


def frozen_storage(config: ModelConfig, training: Training | None = None) -> tuple[int, int]:
    """``(parameters, bytes)`` the step holds but never updates (a LoRA base, frozen roles; not the router bias),
    over the whole model: in the compute dtype, or a block-FP8 base's values at one byte each plus its scales."""
    training = training or Training()
    build = _model_fn(config, training.lora, training.fp8_block)
    trained = trained_roles(training.optimizer, eqx.filter_eval_shape(build))
    model = eqx.filter_eval_shape(lambda: hold_frozen(build(), trained))
    count = size = 0

    def add(info, node):
        nonlocal count, size
        role = (info.values if is_block_fp8(info) else info).role
        if role is None or role is Role.ROUTER_BIAS or trained(role):
            return
        count += math.prod(node.shape)
        size += node.nbytes if is_block_fp8(node) else math.prod(node.shape) * node.dtype.itemsize

    is_leaf = lambda x: isinstance(x, ParamInfo) or is_block_fp8(x)  # noqa: E731
    jax.tree.map(add, param_info(model), model, is_leaf=is_leaf)
    return count, size


def plan_shape(config: ModelConfig, p: parallel.Parallelism, batch: int, seq: int) -> PlanShape:
    """One device's share of a step of ``batch`` rows of ``seq`` tokens on ``p``'s mesh."""
    shards = math.prod(p.size(a) for a in p.mesh_axes("batch"))
    rows = batch // shards if batch % shards == 0 else batch
    return PlanShape(rows, seq, jnp.dtype(config.dtype).itemsize, p.size("tensor"), p.size("expert"))


def layer_costs(config: ModelConfig, shape: PlanShape) -> list[tuple[Cost, Cost]]:
    """``(attention, FFN)`` planner estimates of every layer, from its kinds' own ``plan``."""
    return [
        (
            ATTENTION_KINDS.get(layer.attention).plan(config, layer, shape),
            FFN_KINDS.get(layer.ffn).plan(config, layer, shape),
        )
        for layer in config.layers
    ]


def estimate(
    config: ModelConfig,
    p: parallel.Parallelism,
    batch: int,
    seq: int,
    training: Training | None = None,
    platform: str | None = None,
) -> Memory:
    """The analytic :class:`Memory` of one train step (see the module docstring for the formulas) as XLA lays it
    out on ``platform`` (default: JAX's backend here). With frozen roles or LoRA (``training``) only the trained
    parameters have gradients and optimizer state."""
    training = training or Training()
    state, _, _, _ = _abstract(config, p, batch, seq, training)
    leaves = [x for x in jax.tree.leaves(state.model) if isinstance(x, jax.ShapeDtypeStruct)]
    params = sum(_local_size(x) * x.dtype.itemsize for x in leaves)  # frozen ones in the compute dtype
    is_trained = trained_roles(training.optimizer, state.model)
    infos = param_infos(state.model)
    trained = sum(_local_size(x) for x, info in zip(leaves, infos, strict=True) if is_trained(info.role))
    shape = plan_shape(config, p, batch, seq)
    c, d = shape.bytes, config.embed_dim
    residual = c * _RESIDUAL_COPIES * d
    costs = layer_costs(config, shape)
    layers = [attention.activations + ffn.activations + residual for attention, ffn in costs]
    # "dots" keeps the matmul and kernel outputs, most of what "none" keeps (its figure is an upper bound); "offload"
    # keeps them in host memory, so the device holds what "block" holds
    if config.remat in ("block", "offload"):
        # Layer inputs stay; one repeat unit is recomputed at a time and its backward frees activations as
        # it consumes them (about three quarters of the unit's are live at once on XLA:CPU).
        units, start = [], 0
        for segment in segments(config.layers):
            units.append(sum(layers[start : start + len(segment.unit)]))
            start += segment.num_layers
        kept = c * d * len(layers) + 0.75 * max(units)
    else:
        kept = sum(layers)
    vocab = shape.split(config.vocab_size)
    output_layer = 4 * 2 * vocab  # per position whose logits exist at once
    at_once = shape.tokens if not config.output_chunk else shape.rows * min(config.output_chunk, shape.seq)
    per_step = max(attention.per_step for attention, _ in costs)
    activations = shape.tokens * kept + at_once * output_layer + per_step
    gradients = 2 * 4 * trained  # the gradients and the optimizer's update of the trained parameters
    if config.remat in ("block", "offload") and (platform or jax.default_backend()) == "tpu":
        # A TPU's recomputing step peaks in one phase at a time, where XLA:CPU keeps nearly the sum (a GPU is not
        # measured: the sum, an upper bound, stays there): the output layer (float32 logits, their compute-dtype
        # copy, the embedding and output matrices in the compute dtype, the layer inputs; no gradient yet), the
        # layers' backward pass (the gradients, one unit recomputed) or the update. On one v5e chip (8 x 1024
        # tokens, vocabulary 32,000) the sum was 1.46-1.66x the compiled bytes.
        inputs = shape.tokens * c * d * len(layers)
        matrices = c * vocab * d * (1 if config.tie_embeddings else 2)
        output_phase = inputs + matrices + at_once * (4 + c) * vocab
        layers_phase = 4 * trained + inputs + shape.tokens * 0.75 * max(units) + per_step
        activations = max(output_phase, layers_phase, gradients) - gradients
    return Memory(
        parameters=params,
        optimizer=2 * 4 * trained,
        gradients=gradients,
        activations=float(activations),
        batch=float(13 * shape.tokens),  # three int32 arrays and a bool mask
        output=params + 2 * 4 * trained,
    )


# Calibrated on XLA:CPU with the small presets (see experiments.plan's note): per layer and token XLA keeps
# about six more embed-width vectors than the named activations (residual-stream copies, norm statistics,
# the scan's stacked carries).
_RESIDUAL_COPIES = 6


class Compiled(NamedTuple):
    """XLA's view of the compiled step, per device, and what planning it cost."""

    argument: float
    output: float
    alias: float
    temp: float
    flops: float | None  # XLA cost analysis, per device
    lower_seconds: float
    compile_seconds: float


def compile_step(
    config: ModelConfig, p: parallel.Parallelism, batch: int, seq: int, training: Training | None = None
) -> Compiled:
    """Lower and compile the real train step on abstract sharded inputs and read XLA's analyses."""
    training = training or Training()
    started = time.perf_counter()
    state, data, optimizer, schedule = _abstract(config, p, batch, seq, training)
    dynamic, static = eqx.partition(state, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    step = train_step_fn(optimizer, schedule, trained_roles(training.optimizer, state.model))
    with parallel.activate(p):
        lowered = jax.jit(lambda d, b: step(b, eqx.combine(d, static)), donate_argnums=0).lower(dynamic, data)
        lowered_at = time.perf_counter()
        compiled = lowered.compile()
    compiled_at = time.perf_counter()
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    return Compiled(
        argument=float(memory.argument_size_in_bytes),
        output=float(memory.output_size_in_bytes),
        alias=float(memory.alias_size_in_bytes),
        temp=float(memory.temp_size_in_bytes),
        flops=None if not cost or "flops" not in cost else float(cost["flops"]),
        lower_seconds=lowered_at - started,
        compile_seconds=compiled_at - lowered_at,
    )


def active_parameters(config: ModelConfig) -> tuple[int, int]:
    """``(total, active per token)`` parameter counts, embedding lookup excluded from active."""
    model = eqx.filter_eval_shape(Transformer, config, key=jax.random.key(0))
    # the multi-token-prediction layers are not run by the causal LM's step
    model = eqx.tree_at(lambda m: m.mtp, model, ())
    leaves = [x for x in jax.tree.leaves(model) if isinstance(x, jax.ShapeDtypeStruct)]
    total = sum(math.prod(x.shape) for x in leaves)
    # The embedding lookup costs no matmul; a tied embedding is also the output layer, which does.
    active = total if config.tie_embeddings else total - config.vocab_size * config.embed_dim
    if config.moe is not None:
        router = config.moe.router
        infos = param_infos(model)
        routed = sum(math.prod(x.shape) for x, info in zip(leaves, infos, strict=True) if info.routed)
        active -= routed // router.num_experts * (router.num_experts - router.top_k)
    return total, active


def cache_bytes_per_token(config: ModelConfig) -> tuple[int, int]:
    """Bytes the decoding cache holds per token in the compute dtype, summed over layers: each attention kind's own
    figure (grouped-query keys and values ``2 Hkv hd``; latent attention its latent and shared rotated key), and
    what caching every head's keys and values would take instead (the same for a kind that keeps them). A recurrent
    layer's state does not grow with the length: it is :func:`decoding_cache`'s ``state``, not counted here."""
    shape = PlanShape(1, 1, jnp.dtype(config.dtype).itemsize)
    costs = [ATTENTION_KINDS.get(layer.attention).plan(config, layer, shape) for layer in config.layers]
    return round(sum(c.cache for c in costs)), round(sum(c.expanded_cache or c.cache for c in costs))


class DecodingCache(NamedTuple):
    """The decoding cache of one sequence of ``seq`` tokens, in bytes."""

    seq: int
    per_token: float  # keys and values per token, summed over the layers that keep them (a ring: its share)
    expanded_per_token: float  # the same with every head's keys and values (latent attention keeps less)
    state: float  # per sequence whatever its length: the recurrent layers' states (linear attention)
    growing_layers: int  # layers whose cache grows with the length
    state_layers: int  # layers that keep a state of fixed size

    @property
    def total(self) -> float:
        """Bytes per sequence of ``seq`` tokens."""
        return self.seq * self.per_token + self.state

    @property
    def expanded_total(self) -> float:
        return self.seq * self.expanded_per_token + self.state


def decoding_cache(config: ModelConfig, seq: int) -> DecodingCache:
    """The decoding cache of one ``seq``-token sequence from each attention kind's ``plan``: ``Cost.cache`` bytes per
    token (keys and values, a sliding ring only its window's) and ``Cost.state`` bytes per sequence."""
    shape = PlanShape(1, seq, jnp.dtype(config.dtype).itemsize)
    costs = [ATTENTION_KINDS.get(layer.attention).plan(config, layer, shape) for layer in config.layers]
    return DecodingCache(
        seq=seq,
        per_token=float(sum(c.cache for c in costs)),
        expanded_per_token=float(sum(c.expanded_cache or c.cache for c in costs)),
        state=float(sum(c.state for c in costs)),
        growing_layers=sum(c.cache > 0 for c in costs),
        state_layers=sum(c.state > 0 for c in costs),
    )


def flops_per_token(config: ModelConfig, seq: int) -> tuple[float, float]:
    """``(every expert, top-k experts)`` model FLOPs of a training step per token (:mod:`eqmoe.flops`:
    three forward passes of ``2 N`` plus each attention kind's own count; no recomputation)."""
    every = 3 * flops.forward_flops_per_token(config, seq, every_expert=True)
    return float(every), float(flops.model_flops_per_token(config, seq))
