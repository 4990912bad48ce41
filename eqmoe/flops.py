"""Model FLOPs per token, from the config: what the model's arithmetic costs, whatever the kernels run.

A forward pass multiplies each parameter a token touches once (``2 N``: its top-k routed experts only, the router,
the shared experts, the output layer; the embedding lookup none) and adds each attention kind's own count of its
scores and values over the keys a query sees (:meth:`eqmoe.nn.kinds.AttentionKind.forward_flops`: causal rows see
``(T + 1) / 2`` keys on average, sliding windows fewer; a linear-attention layer its recurrence's products). A
training step is three forward passes' worth (the backward pass multiplies twice as much). What a kernel adds is not
counted: recomputation under remat or in a blockwise backward pass, padded or dropped capacity slots, the tiles a
blockwise kernel computes beyond the causal triangle. Packed documents are counted as if each row were one (their
block-diagonal mask would lower the attention term). MFU is these FLOPs per second over the device's peak.
"""

import math
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp

from eqmoe.config import ModelConfig
from eqmoe.model import Transformer
from eqmoe.params import param_infos
from eqmoe.registries import ATTENTION_KINDS


def matmul_parameters(config: ModelConfig, every_expert: bool = False) -> int:
    """The parameters one token multiplies: all but the embedding table (unless it is also the tied output layer), the
    routed experts' ``top_k`` of ``num_experts`` (all of them with ``every_expert``, as the dense reference dispatch
    computes), the multi-token-prediction layers not at all (the causal LM does not run them)."""
    model = eqx.filter_eval_shape(Transformer, config, key=jax.random.key(0))
    model = eqx.tree_at(lambda m: m.mtp, model, ())
    leaves = [x for x in jax.tree.leaves(model) if isinstance(x, jax.ShapeDtypeStruct)]
    count = sum(math.prod(x.shape) for x in leaves)
    if not config.tie_embeddings:
        count -= config.vocab_size * config.embed_dim
    if config.moe is not None and not every_expert:
        router = config.moe.router
        routed = sum(math.prod(x.shape) for x, info in zip(leaves, param_infos(model), strict=True) if info.routed)
        count -= routed // router.num_experts * (router.num_experts - router.top_k)
    return count


def forward_flops_per_token(config: ModelConfig, seq: int, causal: bool = True, every_expert: bool = False) -> float:
    """One forward pass's FLOPs per token of ``seq``-token rows: ``2 N`` plus every layer's attention count."""
    attention = sum(
        ATTENTION_KINDS.get(layer.attention).forward_flops(config, layer, seq, causal) for layer in config.layers
    )
    return 2 * matmul_parameters(config, every_expert) + attention


def model_flops_per_token(config: ModelConfig, seq: int) -> float:
    """A training step's model FLOPs per token: three forward passes' worth (no recomputation counted)."""
    return 3 * forward_flops_per_token(config, seq)


def measure_peak_tflops(size: int = 4096, repeats: int = 5, dtype: str = "float32") -> float:
    """This device's matmul rate in ``dtype``, TFLOP/s: the median of ``repeats`` timed ``[size, size] @ [size, size]``
    products (after one to compile), the peak MFU is taken against when none is given."""
    a = jnp.ones((size, size), jnp.dtype(dtype))
    product = jax.jit(jnp.dot)
    product(a, a).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        product(a, a).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times) / 1e12
