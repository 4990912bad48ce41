"""The TPU's kernels as registered backends, checked in Pallas interpret mode on the CPU against the references:
``splash`` attention against ``dense`` (windows, sinks, packed documents, padding, grouped queries, a value width of
its own), megablox's grouped matmul against ``jax.lax.ragged_dot`` and the ``gmm`` dispatch against ``dense``
(ragged groups, empty experts, a group larger than a tile, biases, adapters); ``auto``'s candidates on a TPU.

On a TPU the same tests run on the chip (``experiments/tpu_check.sh``); float32 products there are compared at
``highest`` precision."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqmoe import autotune
from eqmoe.attention_config import AttentionConfig
from eqmoe.autotune import timing, workloads
from eqmoe.moe_config import MoEConfig, RouterConfig
from eqmoe.nn import megablox, splash
from eqmoe.nn._init import Init
from eqmoe.nn.attention_backends import backend_name, dense_attention
from eqmoe.nn.context import attention_mask, causal_mask
from eqmoe.nn.linear import ExpertLinear, LowRank
from eqmoe.nn.moe import MoE
from eqmoe.params import Role

SEQ = 256  # two blocks of 128: the smallest sequence with a causal block boundary


@pytest.fixture(autouse=True)
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def _qkv(batch, kv_heads, group, qk_dim, v_dim, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (batch, kv_heads, group, SEQ, qk_dim))
    k = jax.random.normal(keys[1], (batch, kv_heads, SEQ, qk_dim))
    v = jax.random.normal(keys[2], (batch, kv_heads, SEQ, v_dim))
    return q, k, v, keys[3]


def _values_and_grads(backend, q, k, v, mask, window, sinks):
    def loss(q, k, v, sinks):
        out = backend(q, k, v, mask, scale=q.shape[-1] ** -0.5, block_size=128, window=window, sinks=sinks)
        return jnp.sum(jnp.sin(out)), out

    argnums = (0, 1, 2) if sinks is None else (0, 1, 2, 3)
    (_, out), grads = jax.value_and_grad(loss, argnums=argnums, has_aux=True)(q, k, v, sinks)
    return out, grads


@pytest.mark.parametrize(
    ("window", "with_sinks"), [(None, False), (64, True)], ids=["causal-packed-padded", "window-sinks"]
)
def test_splash_equals_dense_with_documents_padding_groups_and_a_value_width_of_its_own(window, with_sinks):
    # two kv heads serving two query heads each; values narrower than queries (latent attention's layout)
    q, k, v, key = _qkv(2, 2, 2, 64, 32)
    # row 0: two packed documents, then padding (segment 0, not a valid key); row 1: one document
    segments = jnp.array([[1] * 100 + [2] * 150 + [0] * 6, [3] * SEQ])
    mask = attention_mask(segments, segments > 0)
    sinks = jax.random.normal(key, (2, 2)) if with_sinks else None
    out, grads = _values_and_grads(splash.splash_attention, q, k, v, mask, window, sinks)
    ref_out, ref_grads = _values_and_grads(dense_attention, q, k, v, mask, window, sinks)
    # interpret mode on a CPU: float32 throughout. On a TPU the kernel's float32 products at "highest" precision
    # still differed from dense by up to 1.1e-4 in 2 of 65,536 outputs (one v5e chip).
    atol = (5e-4, 2e-3) if jax.default_backend() == "tpu" else (2e-5, 1e-4)
    np.testing.assert_allclose(out, ref_out, atol=atol[0])
    assert np.all(np.asarray(out[0, :, :, 250:]) == 0)  # padded queries see no key: output 0, as dense gives
    for grad, ref in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(grad, ref, atol=atol[1])


def test_splash_refuses_in_one_line_what_the_kernel_cannot_compute():
    q, k, v, _ = _qkv(1, 1, 1, 64, 64)
    with pytest.raises(ValueError, match="multiple of 128; got 200") as error:
        splash.splash_attention(
            q[..., :200, :], k[:, :, :200], v[:, :, :200], causal_mask(1, 200), scale=1.0, block_size=128
        )
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="queries that are the keys"):
        splash.splash_attention(q[..., :128, :], k, v, causal_mask(1, SEQ), scale=1.0, block_size=128)


def test_auto_takes_splash_on_a_tpu_only_where_the_kernel_computes_the_call():
    config, mask = AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=64), causal_mask(1, SEQ)
    assert backend_name(config, mask, jnp.bfloat16, platform="tpu", lengths=(2048, 2048)) == "splash"
    assert backend_name(config, mask, jnp.bfloat16, platform="tpu", lengths=(1, 2048)) == "blockwise"  # decoding
    assert backend_name(config, mask, jnp.bfloat16, platform="tpu", lengths=(100, 100)) == "blockwise"
    assert backend_name(config, mask, jnp.bfloat16, platform="cpu", lengths=(2048, 2048)) == "blockwise"
    assert (
        splash.block_for(2048, 512) == 512 and splash.block_for(384, 256) == 128 and splash.block_for(256, 1024) == 256
    )


def _expert_linear(bias: bool, rank: int | None, experts=4, fan_in=128, fan_out=64):
    init = Init("normal", 0.5, jnp.dtype("float32"))
    linear = ExpertLinear(
        experts,
        (fan_in,),
        (fan_out,),
        role=Role.EXPERT,
        in_axes=("embed",),
        out_axes=("expert_mlp",),
        init=init,
        key=jax.random.key(1),
        bias=bias,
    )
    if bias:  # not the zeros it starts from
        linear = eqx.tree_at(lambda w: w.bias, linear, jax.random.normal(jax.random.key(2), linear.bias.shape))
    if rank is not None:
        a = jax.random.normal(jax.random.key(3), (experts, fan_in, rank)) * 0.1
        b = jax.random.normal(jax.random.key(4), (experts, rank, fan_out)) * 0.1
        adapter = LowRank.holding(a, b, scale=2.0)
        linear = eqx.tree_at(lambda w: w.adapter, linear, adapter, is_leaf=lambda node: node is None)
    return linear


@pytest.mark.parametrize(("bias", "rank"), [(False, None), (True, 4)], ids=["plain", "bias-adapter"])
def test_the_grouped_product_equals_ragged_dot_with_empty_groups_and_a_group_past_one_tile(bias, rank):
    linear = _expert_linear(bias, rank)
    sizes = jnp.array([300, 0, 17, 0], jnp.int32)  # 300 rows span three tiles of 128; two experts get none
    tiles = (128, 128, 128)
    rows = megablox.padded_rows(int(sizes.sum()), tiles)
    x = jax.random.normal(jax.random.key(5), (rows, 128))
    real = int(sizes.sum())

    def loss(linear, x, product):
        return jnp.sum(jnp.sin(product(linear, x)[:real]))

    grouped = lambda w, x: w.grouped(x, sizes, tiles)  # noqa: E731
    ragged = lambda w, x: w.ragged(x, sizes)  # noqa: E731
    np.testing.assert_allclose(grouped(linear, x)[:real], ragged(linear, x)[:real], atol=1e-4)
    (ours, d_x), (reference, d_x_reference) = (
        jax.grad(loss, argnums=(0, 1))(linear, x, product) for product in (grouped, ragged)
    )
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(reference), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-3)
    # the padding rows' gradient is the kernel's to leave unwritten: the dispatch drops those rows
    np.testing.assert_allclose(d_x[:real], d_x_reference[:real], atol=1e-4)


def test_gmm_dispatch_equals_dense_in_outputs_and_gradients():
    def layer(dispatch):
        config = MoEConfig(
            RouterConfig(num_experts=8, top_k=2),
            expert_dim=64,
            expert_bias=True,
            dispatch=dispatch,
            tiles=(128, 128, 128),
        )
        return MoE(32, config, init=Init("normal", 0.1, jnp.dtype("float32")), key=jax.random.key(0))

    x = jax.random.normal(jax.random.key(1), (2, 100, 32))  # 400 slots: padded to four row tiles

    def loss(layer, x):
        return jnp.sum(jnp.sin(layer(x)[0]))

    ours = eqx.filter_value_and_grad(loss)(layer("gmm"), x)
    reference = eqx.filter_value_and_grad(loss)(layer("dense"), x)
    np.testing.assert_allclose(ours[0], reference[0], rtol=1e-5)
    for a, b in zip(
        jax.tree.leaves(eqx.filter(ours[1], eqx.is_array)),
        jax.tree.leaves(eqx.filter(reference[1], eqx.is_array)),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, atol=1e-4)


def _chip_accepts(block, array):
    """Mosaic's rule for a block's last two dimensions (the chip refuses others at lowering; interpret mode does
    not check): each divisible by 8 and 128 respectively, or the whole dimension."""
    (a, b), (rows, columns) = block, array
    return (a % 8 == 0 or a == rows) and (b % 128 == 0 or b == columns)


def test_every_kernel_call_of_a_forward_and_backward_has_blocks_the_chip_accepts(monkeypatch):
    calls = []
    real_gmm, real_tgmm = megablox._kernels.gmm, megablox._kernels.tgmm

    def gmm(lhs, rhs, sizes, dtype, tiling, *rest, transpose_rhs=False, **options):
        tm, tk, tn = tiling
        calls.append(("gmm", (tm, tk), lhs.shape))
        calls.append(("gmm", (tn, tk) if transpose_rhs else (tk, tn), rhs.shape[1:]))
        calls.append(("gmm", (tm, tn), (lhs.shape[0], rhs.shape[1] if transpose_rhs else rhs.shape[2])))
        return real_gmm(lhs, rhs, sizes, dtype, tiling, *rest, transpose_rhs=transpose_rhs, **options)

    def tgmm(lhs, rhs, sizes, dtype, tiling, *rest, **options):
        tm, tk, tn = tiling
        calls.extend([("tgmm", (tk, tm), lhs.shape), ("tgmm", (tm, tn), rhs.shape)])
        calls.append(("tgmm", (tk, tn), (lhs.shape[0], rhs.shape[1])))
        return real_tgmm(lhs, rhs, sizes, dtype, tiling, *rest, **options)

    monkeypatch.setattr(megablox._kernels, "gmm", gmm)
    monkeypatch.setattr(megablox._kernels, "tgmm", tgmm)
    sizes = jnp.array([100, 0, 28], jnp.int32)
    for fan_in, fan_out in [(32, 96), (96, 32), (384, 288), (64, 640)]:  # narrower than a lane, and ragged tiles
        x = jax.random.normal(jax.random.key(0), (128, fan_in))
        w = jax.random.normal(jax.random.key(1), (3, fan_in, fan_out))
        jax.grad(lambda x, w: jnp.sum(megablox.gmm(x, w, sizes, (128, 256, 256)) ** 2), argnums=(0, 1))(x, w)
    assert {kernel for kernel, _, _ in calls} == {"gmm", "tgmm"}
    refused = [(kernel, block, array) for kernel, block, array in calls if not _chip_accepts(block, array)]
    assert not refused, refused


def test_bfloat16_kernels_are_traced_at_one_pass_under_a_program_wide_highest_precision(monkeypatch):
    # the chip refuses a float32 contraction of bfloat16 operands ("Mosaic failed to compile TPU kernel: Bad lhs
    # type", one v5e chip, the bf16 parity test under highest); interpret mode accepts it, so the precision in force
    # when each kernel is traced is what this checks, forward and backward
    from jax.experimental import pallas

    traced_at = []
    real_pallas_call = pallas.pallas_call

    def pallas_call(*args, **options):
        traced_at.append(jax.config.jax_default_matmul_precision)
        return real_pallas_call(*args, **options)

    monkeypatch.setattr(pallas, "pallas_call", pallas_call)
    x = jax.random.normal(jax.random.key(0), (128, 32), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (3, 32, 96), jnp.bfloat16)
    sizes = jnp.array([100, 0, 28], jnp.int32)
    jax.grad(lambda x, w: jnp.sum(megablox.gmm(x, w, sizes, (128, 128, 128)).astype(jnp.float32)), (0, 1))(x, w)
    q, k, v, key = (a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a for a in _qkv(1, 1, 2, 64, 64))
    segments = jnp.ones((1, SEQ), jnp.int32)
    sinks = jax.random.normal(key, (1, 2))
    _values_and_grads(splash.splash_attention, q, k, v, attention_mask(segments, segments > 0), None, sinks)
    assert len(traced_at) >= 6, traced_at  # gmm, its two backward products; splash forward, dq, dk/dv
    assert "highest" not in traced_at, traced_at
    assert jax.config.jax_default_matmul_precision == "highest"  # float32 callers keep what they asked for


def test_tiles_shrink_to_the_dimensions_they_cut():
    assert megablox._fit(768, 1024) == 768 and megablox._fit(3584, 1024) == 896 and megablox._fit(288, 1024) == 256
    assert megablox._fit(64, 128) == 64
    assert megablox.row_tile(400, (512, 1024, 1024)) == 512 and megablox.padded_rows(400, (512, 1024, 1024)) == 512
    assert megablox.row_tile(100, (512, 1024, 1024)) == 128
    assert megablox.padded_rows(300, (128, 128, 128)) == 384


def test_auto_times_the_kernels_at_each_tiling_on_a_tpu_and_records_the_tiling(monkeypatch):
    from eqmoe import presets

    config = presets.get("qwen3-moe-micro")
    monkeypatch.setattr(timing.jax, "default_backend", lambda: "tpu")
    wide = config.replace(embed_dim=1024, moe=dataclasses.replace(config.moe, expert_dim=3584))
    assert [label for label in workloads.DispatchWorkload(wide, 2048, True).candidates() if "[" in label] == [
        timing.label("gmm", tiles) for tiles in workloads.GMM_TILES
    ]
    # the micro preset's experts (64 -> 64): every tile shrinks to 64, so the tilings differ only in their rows
    dispatch = workloads.DispatchWorkload(config, 2048, True)
    labels = dispatch.candidates()
    assert [label for label in labels if label.startswith("gmm")] == ["gmm[512,1024,1024]", "gmm[1024,512,512]"]
    assert dispatch.eligible(labels[-1], labels) is None
    attention = workloads.AttentionWorkload(config, 2, 1024, True)
    assert [label for label in attention.candidates() if label.startswith("splash")] == [
        "splash[1024]",
        "splash[512]",
    ]
    measurement = dispatch.measurement("gmm[1024,256,256]", "measured")
    assert measurement.choices() == {"moe.dispatch": "gmm", "moe.tiles": "1024,256,256"}
    chosen = autotune._with_choices(
        config, {**measurement.choices(), "attention.backend": "splash", "attention.block_size": "512"}
    )
    assert chosen.moe.tiles == (1024, 256, 256) and chosen.moe.dispatch == "gmm"
    assert (chosen.attention.backend, chosen.attention.block_size) == ("splash", 512)
    assert "gmm" in measurement.line() and "moe.tiles=1024,256,256" in measurement.line()


@pytest.mark.skipif(jax.default_backend() in megablox.PLATFORMS, reason="what auto does off the TPU")
def test_off_the_tpu_auto_does_not_time_the_kernels():
    from eqmoe import presets

    dispatch = workloads.DispatchWorkload(presets.get("qwen3-moe-micro"), 256, True)
    labels = dispatch.candidates()
    assert "gmm" in labels and "interpret mode" in dispatch.eligible("gmm", labels)
