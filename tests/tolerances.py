"""Float32 tolerances by the backend the tests run on.

On a TPU v5e, with every matmul at ``highest`` precision (conftest), blockwise and dense attention still differed by
up to 2.8e-5 of a gradient's largest entry in float32 (the q projection's gradient: 5.9e-4 at a scale of 20.8),
against under 1e-5 on the CPU: the chip's own float32 exponentials and reciprocals, which no precision flag changes.
A gradient summed over many positions (a norm's weight) differed by 1.7e-4 of its scale (6.2e-4 at 3.6), so the
chip's tolerance leaves three times that. Elementwise float32 math (a softmax, a sigmoid) differed there by up to
4.8e-6 relative (DeepSeek-V2's routing weights), against 1e-6 of the CPU.
"""

import jax

ON_TPU = jax.default_backend() == "tpu"
FLOAT32 = 5e-4 if ON_TPU else 1e-5
"""Absolute tolerance of a float32 comparison, relative to the compared array's scale (at least 1)."""

ELEMENTWISE = 2e-5 if ON_TPU else 1e-6
"""Relative tolerance of float32 elementwise math against a NumPy re-derivation."""
