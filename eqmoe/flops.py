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


# Dense matmul peaks per chip by specification, TFLOP/s: bfloat16 (float16 the same) and float32 where the device has
# a rate of its own for it. A TPU's float32 product runs as bfloat16 passes by default: judged by the bf16 peak.
# NVIDIA figures are the dense (not 2:4-sparse) tensor-core rates, float32 as TF32.
SPECIFIED_PEAKS: dict[str, dict[str, float]] = {
    "TPU v4": {"bfloat16": 275.0},
    "TPU v5 lite": {"bfloat16": 197.0},  # v5e, as JAX names it
    "TPU v5e": {"bfloat16": 197.0},
    "TPU v5": {"bfloat16": 459.0},  # v5p
    "TPU v5p": {"bfloat16": 459.0},
    "TPU v6 lite": {"bfloat16": 918.0},  # v6e (Trillium)
    "TPU v6e": {"bfloat16": 918.0},
    "NVIDIA A100-SXM4-40GB": {"bfloat16": 312.0, "float32": 156.0},
    "NVIDIA A100-SXM4-80GB": {"bfloat16": 312.0, "float32": 156.0},
    "NVIDIA A100 80GB PCIe": {"bfloat16": 312.0, "float32": 156.0},
    "NVIDIA H100 80GB HBM3": {"bfloat16": 989.0, "float32": 495.0},
    "NVIDIA H100 PCIe": {"bfloat16": 756.0, "float32": 378.0},
    "NVIDIA H200": {"bfloat16": 989.0, "float32": 495.0},
    "NVIDIA L4": {"bfloat16": 121.0, "float32": 60.0},
    "NVIDIA A10G": {"bfloat16": 70.0, "float32": 35.0},
}


def specified_peak_tflops(device_kind: str, dtype: str) -> float | None:
    """The peak a ``dtype`` run on a device of ``device_kind`` (``jax.devices()[0].device_kind``) is judged by:
    its specified rate for that dtype (float16 as bfloat16; float32 on a TPU as bfloat16, the passes it runs as);
    ``None`` for a device not in :data:`SPECIFIED_PEAKS` (a CPU: measure it)."""
    peaks = SPECIFIED_PEAKS.get(device_kind)
    if peaks is None:
        return None
    name = "bfloat16" if jnp.dtype(dtype) in (jnp.dtype("bfloat16"), jnp.dtype("float16")) else "float32"
    return peaks.get(name, peaks["bfloat16"] if device_kind.startswith("TPU") else None)


def device_peak_tflops(dtype: str, device=None) -> tuple[float, str]:
    """``(TFLOP/s, where it comes from)`` for MFU: the device's specified peak for ``dtype``, else its matmul rate in
    ``dtype`` measured now (a CPU, or a device kind not in the table)."""
    device = device or jax.local_devices()[0]
    specified = specified_peak_tflops(device.device_kind, dtype)
    if specified is not None:
        return specified, f"{device.device_kind} {jnp.dtype(dtype).name} peak by specification"
    measured = measure_peak_tflops(size=2048, dtype=str(jnp.dtype(dtype)))
    return measured, f"{jnp.dtype(dtype).name} matmul measured on {device.device_kind}"


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
