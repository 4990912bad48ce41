"""What the speed benchmarks (``bench_model``, ``bench_moe``) need of the machine: where torch runs beside JAX, a call
timed to its end on both frameworks, and the matmul peak in the dtype being timed."""

import os
import sys

import jax

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
