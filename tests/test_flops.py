"""The analytic FLOP count (:mod:`eqmoe.flops`) against XLA's count of the same forward pass, and the MFU
arithmetic the training logs carry."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqmoe import Transformer, flops, presets
from eqmoe.config_io import apply_overrides
from eqmoe.nn.kinds import keys_seen

SEQ = 128


def _xla_forward_flops(config) -> float:
    """XLA's FLOPs of one forward pass (logits) of a row of ``SEQ`` tokens, per token."""
    model = eqx.filter_eval_shape(Transformer, config, key=jax.random.key(0))
    params, static = eqx.partition(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    tokens = jax.ShapeDtypeStruct((1, SEQ), jnp.int32)
    forward = jax.jit(lambda params, tokens: eqx.combine(params, static)(tokens).logits)
    compiled = forward.lower(params, tokens).compile()
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list | tuple) else analysis
    return analysis["flops"] / SEQ


def _config(layers: tuple[str, ...], tie: bool):
    """qwen3-moe-micro's widths with ``layers`` (dense and MoE), tied or not, computed by the reference kernels:
    every expert on every token, every query against every key (what XLA's count then counts), the layers unrolled
    (XLA's cost analysis counts a scan's body once, whatever its length)."""
    config = presets.get("qwen3-moe-micro").replace(layers=layers, mlp_dim=192, tie_embeddings=tie, scan_layers=False)
    return apply_overrides(config, {"moe.dispatch": "dense", "attention.backend": "dense"})


@pytest.mark.parametrize(
    ("layers", "tie"),
    [(("dense", "moe"), False), (("moe", "moe"), True), (("dense", "dense"), True)],
    ids=["dense-and-moe-untied", "moe-tied", "dense-tied"],
)
def test_flop_count_is_within_5_percent_of_xla_on_a_forward_pass(layers, tie):
    """Counted as the reference kernels compute (every expert, no causal skipping), the analytic forward FLOPs are
    XLA's within 5%; XLA's count adds the elementwise work (norms, softmax, SwiGLU) the analytic one leaves out."""
    config = _config(layers, tie)
    counted = flops.forward_flops_per_token(config, SEQ, causal=False, every_expert=True)
    measured = _xla_forward_flops(config)
    print(f"{layers} tied={tie}: counted {counted:,.0f} FLOPs/token, XLA {measured:,.0f} ({counted / measured:.3f})")
    assert abs(counted / measured - 1) <= 0.05, (counted, measured)


def test_model_flops_count_top_k_experts_and_the_causal_half():
    """The model FLOPs a training step is credited with: top-k of the experts (not all), causal rows' ``(T + 1) / 2``
    keys, three forward passes; a tied embedding counts once, as the output layer."""
    config = _config(("moe", "moe"), tie=False)
    every = flops.forward_flops_per_token(config, SEQ, causal=False, every_expert=True)
    model = flops.forward_flops_per_token(config, SEQ)
    moe, attention = config.moe, config.attention
    experts = 2 * 2 * 3 * config.embed_dim * moe.expert_dim * (moe.router.num_experts - moe.router.top_k)
    scores = 2 * 4 * attention.num_heads * attention.head_dim * (SEQ - (SEQ + 1) / 2)
    assert every - model == pytest.approx(experts + scores)
    assert flops.model_flops_per_token(config, SEQ) == pytest.approx(3 * model)
    untied = flops.matmul_parameters(config)
    assert flops.matmul_parameters(config.replace(tie_embeddings=True)) == untied  # the output layer, once


def test_keys_a_query_sees_on_average_equal_counting_them():
    for seq, window in [(1, None), (7, None), (64, 16), (64, 64), (10, 3)]:
        visible = [min(t + 1, window or seq) for t in range(seq)]
        assert keys_seen(seq, window, causal=True) == pytest.approx(np.mean(visible))
        assert keys_seen(seq, window, causal=False) == seq


def test_measured_peak_is_a_positive_rate():
    assert 0 < flops.measure_peak_tflops(size=256, repeats=3) < 1e4


def test_every_registered_attention_kind_counts_its_flops():
    from eqmoe.config import LinearAttentionConfig
    from eqmoe.models.qwen3_next import hybrid

    linear = LinearAttentionConfig(key_heads=1, value_heads=2, key_head_dim=8, value_head_dim=8)
    config = hybrid(
        vocab=64, embed=32, layers=4, heads=2, kv_heads=1, head_dim=16, linear=linear, experts=4, top_k=2,
        expert_dim=16, shared_dim=16, mlp_dim=None, theta=1e4, family="qwen3_next",
    )  # fmt: skip
    assert flops.model_flops_per_token(config, 256) > 0
    deepseek = presets.get("deepseek-v3-micro")
    assert flops.model_flops_per_token(deepseek, 256) > 3 * 2 * flops.matmul_parameters(deepseek)
