"""What the speed benchmarks (``bench_model``, ``bench_moe``) need of the machine: where torch runs beside JAX, a call
timed to its end on both frameworks, the two frameworks timed in turn, and the matmul peak in the dtype being timed."""

import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from eqmoe.flops import measure_peak_tflops

# JAX takes most of a GPU's memory when its backend starts, and torch is timed on the same GPU: allocate as needed
# (read when the backend starts, which no import does)
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def torch_device() -> str:
    """``"cuda"`` where JAX runs on a GPU and torch sees one, else ``"cpu"``: transformers is timed on the device
    eqmoe runs on, or the ratio would compare a GPU with the CPU."""
    import torch

    return "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"


def finish(result) -> None:
    """Wait until ``result`` is computed: JAX's arrays are asynchronous, and so is torch on a GPU (on the CPU it
    returns finished)."""
    jax.block_until_ready(result)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def matmul_peak_gflops(size: int, dtype: str, repeats: int = 5) -> float:
    """This device's rate for a ``[size, size] @ [size, size]`` product in ``dtype``, GFLOP/s (the median of
    ``repeats``)."""
    return 1e3 * measure_peak_tflops(size, repeats, dtype)


SETTLE_S = 0.25
"""Idle seconds after every timed call while torch runs on the CPU: its OpenMP workers keep spinning on the
cores for a while after a call returns, and the call timed next would share the machine with them."""
CALL_SECONDS = 0.08


def matmul_rates_gflops(
    rows: int, inner: int, cols: int, dtype: str, device: str, repeats: int = 5, settle_s: float = SETTLE_S
) -> dict:
    """GFLOP/s of one ``[rows, inner] @ [inner, cols]`` product in ``dtype`` by each framework's own kernel: XLA's
    (``jnp.dot``, what eqmoe's matmuls run) and torch's (``torch.mm`` on ``device``, what transformers' run). Each
    is the median of ``repeats`` timed calls of back-to-back products, as many as take about
    :data:`CALL_SECONDS` (so that the dispatch of each product is a small share), after a warm-up call and
    ``settle_s`` idle seconds (:data:`SETTLE_S`)."""
    import torch

    flop = 2 * rows * inner * cols
    rng = np.random.default_rng(0)
    left, right = (rng.standard_normal(shape, np.float32) for shape in ((rows, inner), (inner, cols)))
    ours = jax.jit(jnp.dot)
    ours_args = tuple(jnp.asarray(a, jnp.dtype(dtype)) for a in (left, right))
    theirs_args = tuple(torch.from_numpy(a).to(device, getattr(torch, dtype)) for a in (left, right))

    def rate(product, args) -> float:
        # counted by time, not by FLOPs: a fixed 20 GFLOP took 4 s a call for a [16 x 32] @ [32 x 64] product
        finish(product(*args))
        one = min(_seconds(lambda: finish(product(*args))) for _ in range(3))
        products = max(1, min(100_000, round(CALL_SECONDS / max(one, 1e-7))))

        def call():
            for _ in range(products):
                result = product(*args)
            finish(result)

        call()
        time.sleep(settle_s)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        return flop * products / statistics.median(times) / 1e9

    return {"jnp_dot_gflops": rate(ours, ours_args), "torch_mm_gflops": rate(torch.mm, theirs_args)}


def _seconds(function: Callable[[], Any]) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def interleaved(
    ours: Callable[[], Any], theirs: Callable[[], Any], repeats: int, settle_s: float = SETTLE_S
) -> dict[str, float]:
    """First-call seconds and median seconds of ``ours`` and ``theirs`` over ``repeats`` timed calls each, each
    call timed to its end (:func:`finish`) and followed by ``settle_s`` idle seconds.

    The sides alternate in two blocks each (ours, theirs, ours, theirs), and every block opens with an
    untimed call. Alternating call by call measures each framework in the other's wake: on this machine
    eqmoe's wide train step took 3.2 s alone and 10.6 s straight after torch's, the kernel zeroing the
    pages torch had just released (``clear_page`` 87% of the samples); the call after that is back to
    3.2 s. A user runs one framework per process, so each side is timed once it has the machine."""

    def seconds(fn: Callable[[], Any]) -> float:
        start = time.perf_counter()
        finish(fn())
        elapsed = time.perf_counter() - start
        time.sleep(settle_s)
        return elapsed

    first_ours, first_theirs = seconds(ours), seconds(theirs)
    times: dict[str, list[float]] = {"ours": [], "theirs": []}
    per_block = [repeats - repeats // 2, repeats // 2]
    for count in per_block:
        for side, fn in (("ours", ours), ("theirs", theirs)):
            if count:
                seconds(fn)  # the block's untimed opening call
            times[side].extend(seconds(fn) for _ in range(count))
    return {
        "eqmoe_first_s": first_ours,
        "hf_first_s": first_theirs,
        "eqmoe_s": statistics.median(times["ours"]),
        "hf_s": statistics.median(times["theirs"]),
    }
