"""A new attention kind is a class and a registration, and everything else follows: this file registers two kinds
of its own (nothing under ``eqmoe/`` knows them) and uses each through the per-layer list, in training
(``pretrain --override``), in decoding (``generate`` with their own caches), in the planner and as LoRA targets.

- :class:`LatentAttention` has parameter shapes of its own, values narrower than its queries and keys, and a
  decoding cache of one ``[max_len, rank]`` latent per row (keys and values are rebuilt from it), not
  ``[kv_heads, max_len, head_dim]`` keys and values.
- :class:`ToyRecurrent` is a linear-attention layer, ``S_t = S_{t-1} + k_t v_t^T``, ``y_t = q_t S_t`` per head, over
  inputs passed through a causal depthwise convolution of width 4: its decoding state is ``[heads, dk, dv]`` plus
  the convolution's last 3 inputs, with no sequence axis; packed documents restart it, padding leaves it as it is.
"""

import contextlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array, Float

from eqmoe import parallel, presets
from eqmoe.analysis import plan
from eqmoe.config import AttentionConfig, LayerKind, ModelConfig
from eqmoe.config_io import apply_overrides
from eqmoe.inference import generate
from eqmoe.lora import LoRAConfig, add_lora, lora_targets, targets
from eqmoe.model import Transformer
from eqmoe.nn import AttentionKind, Cost, Linear, PlanShape
from eqmoe.nn.attention_backends import attend
from eqmoe.nn.mlp import silu
from eqmoe.params import Role, param
from eqmoe.registries import ATTENTION_KINDS

# --- a latent attention kind ---------------------------------------------------------------------------------


class LatentAttention(AttentionKind):
    """Queries per head from ``x``; keys and values per head from one shared latent ``down(x)`` of width ``rank``,
    which is all the cache keeps. Values are half as wide as queries and keys. No RoPE (a latent cache would have
    to remember each key's position)."""

    q: Linear
    down: Linear
    k_up: Linear
    v_up: Linear
    o: Linear
    config: AttentionConfig = eqx.field(static=True)

    def __init__(self, config: ModelConfig, layer: LayerKind, *, init, key):
        a, embed = config.attention, config.embed_dim
        heads, width, rank = a.num_heads, a.head_dim, a.head_dim
        kq, kd, kk, kv, ko = jax.random.split(key, 5)
        linear = dict(role=Role.ATTENTION, init=init)
        self.q = Linear((embed,), (heads, width), in_axes=("embed",), out_axes=("heads", "head_dim"), key=kq, **linear)
        self.down = Linear((embed,), (rank,), in_axes=("embed",), out_axes=("head_dim",), key=kd, **linear)
        self.k_up = Linear(
            (rank,), (heads, width), in_axes=("head_dim",), out_axes=("heads", "head_dim"), key=kk, **linear
        )
        self.v_up = Linear(
            (rank,), (heads, width // 2), in_axes=("head_dim",), out_axes=("heads", "head_dim"), key=kv, **linear
        )
        self.o = Linear(
            (heads, width // 2), (embed,), in_axes=("heads", "head_dim"), out_axes=("embed",), key=ko, **linear
        )
        self.config = a

    def __call__(self, x, context, cache=None, key=None):
        batch, seq, embed = x.shape
        flat = x.reshape(batch * seq, embed)
        latent = self.down(flat).reshape(batch, seq, -1)
        if cache is not None:
            cache = jax.lax.dynamic_update_slice(cache, latent.astype(cache.dtype), (0, context.cache_index, 0))
            latent = cache.astype(x.dtype)
        keys = latent.shape[1]
        heads, width = self.q.weight.shape[-2:]
        q = self.q(flat).reshape(batch, seq, heads, 1, width).transpose(0, 2, 3, 1, 4)
        k = self.k_up(latent.reshape(batch * keys, -1)).reshape(batch, keys, heads, width).transpose(0, 2, 1, 3)
        v = self.v_up(latent.reshape(batch * keys, -1)).reshape(batch, keys, heads, -1).transpose(0, 2, 1, 3)
        assert v.shape[-1] != q.shape[-1]  # a value width of its own
        out = attend(self.config, q, k, v, context.mask, scale=width**-0.5, window=None)
        return self.o(out.transpose(0, 3, 1, 2, 4).reshape(batch * seq, -1)).reshape(batch, seq, embed), cache

    @classmethod
    def init_cache(cls, config, layer, batch, max_len, dtype):
        return jnp.zeros((batch, max_len, config.attention.head_dim), dtype)

    LATENT_BYTES = 1_000_003  # a figure of its own, to find in the plan

    @classmethod
    def plan(cls, config, layer, shape: PlanShape) -> Cost:
        a = config.attention
        flops = (
            4 * a.num_heads * a.head_dim * shape.seq + 2 * shape.seq * a.head_dim * a.num_heads * a.head_dim * 3 // 2
        )
        return Cost(cls.LATENT_BYTES, flops=flops, cache=shape.bytes * a.head_dim)


# --- a recurrent kind ----------------------------------------------------------------------------------------

WIDTH = 4  # the convolution's taps: each step keeps the last WIDTH - 1 inputs


class ToyRecurrent(AttentionKind):
    """Per head ``S_t = S_{t-1} + k_t v_t^T``, ``y_t = q_t S_t`` over ``silu(causal depthwise conv(x W_qkv))``.
    Training runs the same step as decoding in a ``lax.scan`` over the tokens."""

    qkv: Linear
    taps: Float[Array, "head_dim mlp"] = param(Role.ATTENTION)
    o: Linear
    heads: int = eqx.field(static=True)
    dim: int = eqx.field(static=True)

    def __init__(self, config: ModelConfig, layer: LayerKind, *, init, key):
        a, embed = config.attention, config.embed_dim
        self.heads, self.dim = a.num_heads, a.head_dim
        k_in, k_taps, k_out = jax.random.split(key, 3)
        self.qkv = Linear(
            (embed,),
            (3 * a.num_heads * a.head_dim,),
            role=Role.ATTENTION,
            in_axes=("embed",),
            out_axes=("mlp",),
            init=init,
            key=k_in,
        )
        self.taps = init.weight(k_taps, (WIDTH, 3 * a.num_heads * a.head_dim), fan_in=WIDTH)
        self.o = Linear(
            (a.num_heads * a.head_dim,),
            (embed,),
            role=Role.ATTENTION,
            in_axes=("mlp",),
            out_axes=("embed",),
            init=init,
            key=k_out,
        )

    def __call__(self, x, context, cache=None, key=None):
        batch, seq, embed = x.shape
        channels, heads, dim = self.taps.shape[-1], self.heads, self.dim
        u = self.qkv(x.reshape(batch * seq, embed)).reshape(batch, seq, channels)
        state = jnp.zeros((batch, heads, dim, dim), jnp.float32) if cache is None else cache["state"]
        window = jnp.zeros((batch, WIDTH - 1, channels), x.dtype) if cache is None else cache["window"].astype(x.dtype)
        previous = jnp.concatenate([context.segment_ids[:, :1], context.segment_ids[:, :-1]], axis=1)
        starts = context.segment_ids != previous
        if cache is None:
            starts = starts.at[:, 0].set(True)

        def step(carry, inputs):
            state, window = carry
            u_t, valid, start = inputs
            state = jnp.where(start[:, None, None, None], 0.0, state)
            window = jnp.where(start[:, None, None], 0.0, window)
            recent = jnp.concatenate([window, u_t[:, None]], axis=1)
            mixed = silu(jnp.einsum("bwc,wc->bc", recent, self.taps.astype(u_t.dtype)))
            q, k, v = (part.reshape(batch, heads, dim).astype(jnp.float32) for part in jnp.split(mixed, 3, axis=-1))
            new_state = state + jnp.einsum("bhk,bhv->bhkv", k, v)
            y = jnp.einsum("bhk,bhkv->bhv", q, new_state)
            keep = valid[:, None, None, None]
            state = jnp.where(keep, new_state, state)
            window = jnp.where(valid[:, None, None], recent[:, 1:], window)
            return (state, window), jnp.where(valid[:, None, None], y, 0.0).astype(x.dtype)

        inputs = (jnp.moveaxis(u, 1, 0), context.token_mask.T, starts.T)
        (state, window), y = jax.lax.scan(step, (state, window), inputs)
        out = self.o(jnp.moveaxis(y, 0, 1).reshape(batch * seq, -1)).reshape(batch, seq, embed)
        return out, None if cache is None else {"state": state, "window": window.astype(cache["window"].dtype)}

    @classmethod
    def init_cache(cls, config, layer, batch, max_len, dtype):
        a = config.attention
        channels = 3 * a.num_heads * a.head_dim
        return {
            "state": jnp.zeros((batch, a.num_heads, a.head_dim, a.head_dim), jnp.float32),
            "window": jnp.zeros((batch, WIDTH - 1, channels), dtype),
        }

    @classmethod
    def plan(cls, config, layer, shape: PlanShape) -> Cost:
        a = config.attention
        return Cost(shape.bytes * 6 * a.num_heads * a.head_dim, flops=6 * a.num_heads * a.head_dim**2, cache=0.0)


@contextlib.contextmanager
def _registered():
    with (
        ATTENTION_KINDS.registered("latent_test", LatentAttention),
        ATTENTION_KINDS.registered("recurrent_test", ToyRecurrent),
    ):
        yield


def _micro(*kinds: str) -> ModelConfig:
    layers = [{"attention": kind, "ffn": "moe"} for kind in kinds]
    return apply_overrides(presets.get("qwen3-moe-micro"), {"layers": layers})


# --- training through the per-layer list and pretrain --override -------------------------------------------


# -m slow (29 s): a registered attention kind other than gqa trains through pretrain and decodes from its own cache
# by default in tests/test_deepseek.py (the mla kind: test_pretrain_trains_the_mtp_objective and the greedy
# generation test), and both test-local kinds decode from their caches below
@pytest.mark.slow
def test_both_kinds_train_through_pretrain_override(tmp_path):
    from experiments import generate as generate_cli
    from experiments import pretrain

    layers = '[{"attention": "latent_test", "ffn": "moe"}, "moe", {"attention": "recurrent_test", "ffn": "moe"}, "moe"]'
    with _registered():
        args = pretrain.Args(
            model=pretrain.ModelOptions(override=(f"layers={layers}",)),
            data=pretrain.DataOptions(seq_len=32, batch_size=4, chars_per_domain=4_000, eval_chars_per_domain=800),
            run=pretrain.RunOptions(steps=30, out_dir=tmp_path, checkpoint_every=30, eval_every=30, log_every=10),
        )
        summary = pretrain.run(args)
        assert [layer["attention"] for layer in summary["config"]["layers"]] == [
            "latent_test",
            "gqa",
            "recurrent_test",
            "gqa",
        ]
        losses = [line for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
        first, last = (float(__import__("json").loads(line)["loss"]) for line in (losses[0], losses[-1]))
        assert np.isfinite(last) and last < first, (first, last)

        # generate from the run's checkpoint: both kinds decode from their own caches
        result = generate_cli.run(
            generate_cli.Args(checkpoint=tmp_path / "checkpoints", prompt="1 + 2 = ", max_new_tokens=6)
        )
        from eqmoe.checkpoints.model_checkpoint import load_model

        model, _ = load_model(tmp_path / "checkpoints")
        ids = result["prompt_ids"] + result["new_ids"]
        logits = eqx.filter_jit(lambda m, t: m(t).logits)(model, jnp.asarray([ids], jnp.int32))
        prompt = len(result["prompt_ids"])
        recomputed = np.asarray(jnp.argmax(logits[0, prompt - 1 : len(ids) - 1], -1)).tolist()
        assert recomputed == result["new_ids"], "cached decoding must equal the full forward pass"


# --- decoding, with padding ------------------------------------------------------------------------------


def test_cached_decoding_equals_the_full_forward_pass_for_left_padded_prompts():
    with _registered():
        config = _micro("latent_test", "recurrent_test", "gqa", "recurrent_test")
        model = Transformer(config, key=jax.random.key(3))
        model = jax.tree.map(
            lambda x: x * 4 if eqx.is_inexact_array(x) and x.ndim >= 2 else x, model
        )  # decisive logits
        prompt = jax.random.randint(jax.random.key(4), (2, 7), 0, config.vocab_size)
        mask = jnp.asarray([[False, False, True, True, True, True, True], [True] * 7])
        tokens = generate(model, prompt, max_new_tokens=6, prompt_mask=mask)
        cache = model.init_cache(2, 12)
        (latent,), (recurrent,) = cache.layers[0], cache.layers[1]  # one segment per layer: no unit repeats
        assert latent.shape == (1, 2, 12, 16)  # one [max_len, rank] latent per row
        assert recurrent["state"].shape == (1, 2, 4, 16, 16) and recurrent["window"].shape == (1, 2, 3, 3 * 4 * 16)
        for row in range(2):
            real = tokens[row][np.asarray(jnp.concatenate([mask[row], jnp.ones(6, bool)]))]
            logits = model(real[None]).logits[0]
            np.testing.assert_array_equal(np.argmax(logits[-7:-1], -1), np.asarray(real[-6:]))


def test_the_recurrent_kind_restarts_at_packed_documents():
    with _registered():
        config = _micro("recurrent_test", "recurrent_test", "recurrent_test", "recurrent_test")
        model = Transformer(config, key=jax.random.key(5))
        first = jax.random.randint(jax.random.key(6), (1, 5), 0, config.vocab_size)
        second = jax.random.randint(jax.random.key(7), (1, 6), 0, config.vocab_size)
        packed = jnp.concatenate([first, second], axis=1)
        segments = jnp.asarray([[1] * 5 + [2] * 6])
        positions = jnp.asarray([list(range(5)) + list(range(6))])
        together = model(packed, segment_ids=segments, positions=positions).logits[0]
        np.testing.assert_allclose(together[:5], model(first).logits[0], atol=1e-5)
        np.testing.assert_allclose(together[5:], model(second).logits[0], atol=1e-5)


# --- the planner and LoRA ---------------------------------------------------------------------------------


def test_the_planner_estimates_each_kind_by_its_own_plan():
    with _registered():
        latent, plain = _micro("latent_test", "gqa", "latent_test", "gqa"), _micro("gqa", "gqa", "gqa", "gqa")
        p = parallel.make_parallelism("data=1", devices=jax.devices()[:1])
        batch, seq = 4, 32
        difference = plan.estimate(latent, p, batch, seq).activations - plan.estimate(plain, p, batch, seq).activations
        gqa = ATTENTION_KINDS.get("gqa").plan(plain, plain.layers[0], plan.plan_shape(plain, p, batch, seq))
        assert difference == batch * seq * 2 * (LatentAttention.LATENT_BYTES - gqa.activations)
        compiled = plan.compile_step(latent, p, batch, seq)
        assert compiled.temp > 0 and compiled.flops > 0
        recurrent = _micro("recurrent_test", "gqa", "gqa", "gqa")
        assert plan.flops_per_token(recurrent, seq) != plan.flops_per_token(plain, seq)


def test_the_new_kinds_matrices_are_lora_targets():
    with _registered():
        assert {"attention.down", "attention.k_up", "attention.v_up", "attention.qkv"} <= set(lora_targets())
        config = _micro("latent_test", "recurrent_test", "gqa", "gqa")
        model = Transformer(config, key=jax.random.key(0))
        adapted = add_lora(model, LoRAConfig(rank=2, targets=("attention",)), key=jax.random.key(1))
        names = {(type(linear).__name__, name) for _, name, linear in targets(adapted) if linear.adapter is not None}
        assert {name for _, name in names} >= {"q", "down", "k_up", "v_up", "o", "qkv", "k", "v"}
        tokens = jax.random.randint(jax.random.key(2), (2, 9), 0, config.vocab_size)
        np.testing.assert_allclose(adapted(tokens).logits, model(tokens).logits, atol=1e-5)  # B = 0: unchanged
        only = add_lora(model, LoRAConfig(rank=2, targets=("attention.down",)), key=jax.random.key(1))
        assert [name for _, name, linear in targets(only) if linear.adapter is not None] == ["down"]
