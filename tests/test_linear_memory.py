"""A Qwen3-Next-shaped model's training memory is linear in the sequence length.

Three gated DeltaNet layers and one full-attention layer (blockwise attention), compiled forward + backward on one
row of 2,048, 8,192 and 32,768 tokens: XLA's temporary bytes may grow at most 4.5x per 4x the tokens. Nothing runs;
the chunked delta rule keeps one state per chunk and blockwise attention no ``[seq, seq]`` scores, so a quadratic
term would show here as 16x.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

from eqmoe.config import LinearAttentionConfig
from eqmoe.config_io import apply_overrides
from eqmoe.model import Transformer
from eqmoe.models.qwen3_next import hybrid
from eqmoe.train.step import Batch, batch_loss

LENGTHS = (2048, 8192, 32768)
# XLA:CPU's LLVM optimisation level changes the machine code, not the buffers: the temporary bytes are the same at
# level 0 (checked at 2,048 tokens: 96,512,560 either way), and compiling takes half as long.
FAST_CODEGEN = {"xla_backend_optimization_level": 0}


def _config():
    linear = LinearAttentionConfig(key_heads=2, value_heads=4, key_head_dim=16, value_head_dim=16, projection="grouped")
    config = hybrid(
        vocab=128,
        embed=64,
        layers=4,  # three linear layers, then full attention
        heads=2,
        kv_heads=1,
        head_dim=32,
        linear=linear,
        experts=4,
        top_k=2,
        expert_dim=32,
        shared_dim=32,
        mlp_dim=None,
        theta=1e4,
        family="qwen3_next",
    )
    config = config.replace(dtype="float32", param_dtype="float32")
    return apply_overrides(config, {"attention.backend": "blockwise"})


def _temp_bytes(config, seq: int) -> int:
    """XLA's temporary bytes of the loss's gradient on one packed row of ``seq`` tokens (abstract inputs)."""
    model = eqx.filter_eval_shape(Transformer, config, key=jax.random.key(0))
    params, static = eqx.partition(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))

    def loss(params, batch):
        return batch_loss(eqx.combine(params, static), batch)[0]

    dtypes = (jnp.int32, jnp.int32, jnp.int32, jnp.bool_)
    batch = jax.eval_shape(lambda: Batch(*(jnp.zeros((1, seq), dtype) for dtype in dtypes)))
    compiled = jax.jit(jax.grad(loss)).lower(params, batch).compile(FAST_CODEGEN)
    return compiled.memory_analysis().temp_size_in_bytes


# -m slow (about 30 s: three compiles of the whole model): the delta rule's own memory is checked linear in
# tests/test_delta_rule.py, the planner's estimate of the model's in tests/test_plan.py (hybrid, linear in length)
@pytest.mark.slow
def test_hybrid_training_memory_grows_linearly_with_the_length():
    config = _config()
    assert [layer.attention for layer in config.layers] == ["gated_deltanet"] * 3 + ["gqa"]
    temps = [_temp_bytes(config, seq) for seq in LENGTHS]
    for seq, temp in zip(LENGTHS, temps, strict=True):
        print(f"{seq:>6} tokens: temp {temp / 2**20:8.1f} MiB, {temp / seq:,.0f} bytes/token")
    growth = [long / short for short, long in zip(temps[:-1], temps[1:], strict=True)]
    print("growth per 4x tokens:", ", ".join(f"{g:.2f}x" for g in growth))
    assert all(g <= 4.5 for g in growth), (temps, growth)
