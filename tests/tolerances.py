"""Float32 tolerances by the backend the tests run on.

On a TPU v5e, with every matmul at ``highest`` precision (conftest), blockwise and dense attention still differed by
up to 2.8e-5 of a gradient's largest entry in float32 (the q projection's gradient: 5.9e-4 at a scale of 20.8),
against under 1e-5 on the CPU: the chip's own float32 exponentials and reciprocals, which no precision flag changes.
"""

import jax

FLOAT32 = 1e-4 if jax.default_backend() == "tpu" else 1e-5
"""Absolute tolerance of a float32 comparison, relative to the compared array's scale (at least 1)."""
