"""Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5): the ``gated_deltanet`` attention kind.

Per token, as transformers' ``Qwen3NextGatedDeltaNet`` computes it::

    q, k, v, z, b, a = input projections of x           (LinearAttentionConfig.projection: their layout)
    q, k, v = silu(causal depthwise conv([q; k; v]))      (kernel conv_kernel, over the last tokens)
    q, k = l2norm(q), l2norm(k);  q = q / sqrt(key_head_dim)
    beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)
    o = gated delta rule(q, k, v, g, beta)                (eqmoe.nn.delta_rule; state [key_dim, value_dim])
    y = out_proj(RMSNorm(o) * silu(z))                    (a plain-weight norm over value_head_dim)

Each key head serves ``value_heads / key_heads`` consecutive value heads. Packed documents start from a zero state
and an empty convolution window; a padding token leaves both as they were (its decay is 1 and its update 0; it
enters the window as zeros, which for left and right padding is the window without it).

Decoding keeps, per layer, the last ``conv_kernel - 1`` inputs of the convolution and the float32 recurrent state:
memory that does not grow with the sequence. One new token runs the recurrence; a prompt runs the chunked form
from the state.
"""

from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from eqmoe.config import LayerKind, LinearAttentionConfig, ModelConfig
from eqmoe.nn._init import Init
from eqmoe.nn.context import Context
from eqmoe.nn.delta_rule import chunked_delta_rule, recurrent_delta_rule
from eqmoe.nn.kinds import AttentionKind, Cost, PlanShape
from eqmoe.nn.linear import Linear
from eqmoe.nn.norm import RMSNorm
from eqmoe.params import Role, param
from eqmoe.registries import ATTENTION_KINDS
from eqmoe.tensor_names import TensorName, linear_names


class RecurrentCache(NamedTuple):
    """One gated DeltaNet layer's decoding state: the convolution's last inputs (compute dtype) and the delta rule's
    state (float32). In a scanned segment every leaf carries a leading ``repeats`` axis."""

    window: Float[Array, "*repeats batch kernel channels"]
    state: Float[Array, "*repeats batch heads key_dim value_dim"]


def _l2norm(x: Float[Array, "*b dim"]) -> Float[Array, "*b dim"]:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _causal_conv(
    x: Float[Array, "batch seq channels"], weight: Float[Array, "channels kernel"], same: list[Bool[Array, "batch seq"]]
) -> Float[Array, "batch seq channels"]:
    """``sum_j weight[:, K-1-j] * x[t-j]`` over the taps ``j`` whose token is in ``t``'s document (``same[j-1]``)."""
    kernel = weight.shape[1]
    out = x * weight[:, kernel - 1].astype(x.dtype)
    for j in range(1, kernel):
        shifted = jnp.pad(x, ((0, 0), (j, 0), (0, 0)))[:, : x.shape[1]]
        out = out + jnp.where(same[j - 1][..., None], shifted, 0) * weight[:, kernel - 1 - j].astype(x.dtype)
    return out


def _shifted_equal(ids: Int[Array, "batch seq"], j: int) -> Bool[Array, "batch seq"]:
    """Whether token ``t - j`` exists and has the id of token ``t``."""
    earlier = jnp.pad(ids, ((0, 0), (j, 0)), constant_values=-1)[:, : ids.shape[1]]
    return earlier == ids


def _last_valid(rows: Float[Array, "batch n channels"], valid: Bool[Array, "batch n"], count: int) -> Array:
    """The last ``count`` rows of each batch row whose ``valid`` is true, in order (there are at least ``count``)."""
    rank = jnp.cumsum(valid, axis=1)
    wanted = rank[:, -1:, None] - count + 1 + jnp.arange(count)[None, None, :]  # [batch, 1, count]
    pick = valid[..., None] & (rank[..., None] == wanted)  # [batch, n, count]
    return jnp.einsum("bnk,bnc->bkc", pick.astype(rows.dtype), rows)


@ATTENTION_KINDS.register("gated_deltanet")
class GatedDeltaNet(AttentionKind):
    """The linear-attention layer of Qwen3-Next and Qwen3.5 (``AttentionConfig.linear`` gives its widths).

    Projections, by ``LinearAttentionConfig.projection``: ``"grouped"`` holds ``qkvz`` and ``ba`` (Qwen3-Next's
    ``in_proj_qkvz``/``in_proj_ba``, per key head ``[q, k, v..., z...]`` and ``[b..., a...]``); ``"flat"`` holds
    ``qkv``, ``z``, ``b``, ``a`` (Qwen3.5's ``in_proj_qkv`` etc.). Each is a LoRA target
    (``linear_attention.qkvz``...), as is ``out``.
    """

    adapter_group = "linear_attention"
    hf_module = "linear_attn"

    qkvz: Linear | None
    ba: Linear | None
    qkv: Linear | None
    z: Linear | None
    b: Linear | None
    a: Linear | None
    conv: Float[Array, "linear conv"] = param(Role.ATTENTION)
    dt_bias: Float[Array, " linear"] = param(Role.BIAS)
    A_log: Float[Array, " linear"] = param(Role.BIAS)
    norm: RMSNorm
    out: Linear
    config: LinearAttentionConfig = eqx.field(static=True)

    def __init__(self, config: ModelConfig, layer: LayerKind, *, init: Init, key: PRNGKeyArray):
        linear, embed = config.attention.linear, config.embed_dim
        heads, group = linear.value_heads, linear.group
        key_width, value_width = linear.key_heads * linear.key_head_dim, heads * linear.value_head_dim
        keys = iter(jax.random.split(key, 8))
        project = dict(role=Role.ATTENTION, in_axes=("embed",), out_axes=("linear",), init=init)

        def proj(width: int) -> Linear:
            return Linear((embed,), (width,), key=next(keys), **project)

        self.qkvz = self.ba = self.qkv = self.z = self.b = self.a = None
        if linear.projection == "grouped":
            per_key_head = 2 * linear.key_head_dim + 2 * group * linear.value_head_dim
            self.qkvz = proj(linear.key_heads * per_key_head)
            self.ba = proj(2 * heads)
        else:
            self.qkv = proj(2 * key_width + value_width)
            self.z, self.b, self.a = proj(value_width), proj(heads), proj(heads)
        self.conv = init.weight(next(keys), (linear.conv_channels, linear.conv_kernel), fan_in=linear.conv_kernel)
        self.dt_bias = jnp.ones((heads,), init.dtype)
        self.A_log = jnp.log(jax.random.uniform(next(keys), (heads,), jnp.float32, 0.01, 16.0)).astype(init.dtype)
        self.norm = RMSNorm(linear.value_head_dim, eps=config.norm.eps, dtype=init.dtype)
        self.out = Linear(
            (value_width,),
            (embed,),
            role=Role.ATTENTION,
            in_axes=("linear",),
            out_axes=("embed",),
            init=init,
            key=next(keys),
        )
        self.config = linear

    def _inputs(self, flat: Float[Array, "tokens embed"], keys: list | None) -> tuple[Array, Array, Array, Array]:
        """``[q; k; v]`` in the convolution's channel order (every query head, every key head, every value head),
        ``z`` ``[tokens, value_heads, value_head_dim]``, ``b`` and ``a`` ``[tokens, value_heads]``."""
        c, tokens = self.config, flat.shape[0]
        key_of = (lambda i: None) if keys is None else (lambda i: keys[i])  # noqa: E731
        if c.projection == "flat":
            z = self.z(flat, key_of(1)).reshape(tokens, c.value_heads, c.value_head_dim)
            return self.qkv(flat, key_of(0)), z, self.b(flat, key_of(2)), self.a(flat, key_of(3))
        grouped = self.qkvz(flat, key_of(0)).reshape(tokens, c.key_heads, -1)
        dk, grouped_v = c.key_head_dim, c.group * c.value_head_dim
        q, k, v, z = jnp.split(grouped, [dk, 2 * dk, 2 * dk + grouped_v], axis=-1)
        b, a = jnp.split(self.ba(flat, key_of(1)).reshape(tokens, c.key_heads, 2 * c.group), 2, axis=-1)
        mixed = jnp.concatenate([t.reshape(tokens, -1) for t in (q, k, v)], axis=-1)
        z = z.reshape(tokens, c.value_heads, c.value_head_dim)
        return mixed, z, b.reshape(tokens, -1), a.reshape(tokens, -1)

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        context: Context,
        cache: RecurrentCache | None = None,
        key: PRNGKeyArray | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], RecurrentCache | None]:
        c = self.config
        batch, seq, embed = x.shape
        keys = None if key is None else [jax.random.fold_in(key, i) for i in range(5)]
        valid = context.token_mask
        mixed, z, b, a = self._inputs(x.reshape(batch * seq, embed), keys)
        mixed = mixed.reshape(batch, seq, -1) * valid[..., None].astype(x.dtype)

        window = c.conv_kernel - 1
        if cache is None:
            documents = context.segment_ids
            same = [_shifted_equal(documents, j) for j in range(1, c.conv_kernel)]
            conv_out = _causal_conv(mixed, self.conv, same)
            resets = (documents != jnp.pad(documents, ((0, 0), (1, 0)))[:, :seq]) & valid
            resets = resets.at[:, 0].set(False)
        else:  # one document per row: the window's inputs precede these tokens
            joined = jnp.concatenate([cache.window.astype(mixed.dtype), mixed], axis=1)
            whole = [jnp.ones((batch, window + seq), bool)] * window
            conv_out = _causal_conv(joined, self.conv, whole)[:, window:]
            joined_valid = jnp.concatenate([jnp.ones((batch, window), bool), valid], axis=1)
            new_window = _last_valid(joined, joined_valid, window) if window else cache.window
            resets = None
        conv_out = jax.nn.silu(conv_out)

        key_width = c.key_heads * c.key_head_dim
        q, k, v = jnp.split(conv_out, [key_width, 2 * key_width], axis=-1)
        q = _l2norm(q.reshape(batch, seq, c.key_heads, c.key_head_dim).astype(jnp.float32))
        k = _l2norm(k.reshape(batch, seq, c.key_heads, c.key_head_dim).astype(jnp.float32))
        q, k = (jnp.repeat(t, c.group, axis=2) for t in (q * c.key_head_dim**-0.5, k))
        v = v.reshape(batch, seq, c.value_heads, c.value_head_dim)
        beta = jax.nn.sigmoid(b).astype(jnp.float32).reshape(batch, seq, -1)
        decay = jax.nn.softplus(a.astype(jnp.float32).reshape(batch, seq, -1) + self.dt_bias.astype(jnp.float32))
        g = -jnp.exp(self.A_log.astype(jnp.float32)) * decay
        beta, g = (jnp.where(valid[..., None], t, 0.0) for t in (beta, g))  # padding: an identity step

        initial = None if cache is None else cache.state
        if cache is not None and seq == 1:
            out, state = recurrent_delta_rule(q, k, v, g, beta, initial_state=initial)
        else:
            out, state = chunked_delta_rule(
                q, k, v, g, beta, resets=resets, initial_state=initial, chunk_size=c.chunk_size
            )
        z = z.reshape(out.shape)
        gated = self.norm(out.astype(x.dtype)).astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
        gated = gated.astype(x.dtype).reshape(batch * seq, -1)
        y = self.out(gated, None if keys is None else keys[4]).reshape(batch, seq, embed)
        if cache is not None:
            cache = RecurrentCache(new_window.astype(cache.window.dtype), state.astype(cache.state.dtype))
        return y, cache

    @classmethod
    def init_cache(cls, config: ModelConfig, layer: LayerKind, batch: int, max_len: int, dtype) -> RecurrentCache:
        """An empty window and a zero state: the same size whatever ``max_len``."""
        c = config.attention.linear
        return RecurrentCache(
            jnp.zeros((batch, c.conv_kernel - 1, c.conv_channels), dtype),
            jnp.zeros((batch, c.value_heads, c.key_head_dim, c.value_head_dim), jnp.float32),
        )

    @classmethod
    def plan(cls, config: ModelConfig, layer: LayerKind, shape: PlanShape) -> Cost:
        """Per token, every figure independent of the length (the widths are replicated over the mesh).

        Kept for the backward pass (calibrated on XLA:CPU like the other kinds): in the compute dtype the input
        and output, the projections' outputs, the convolution's input, its ``conv_kernel - 1`` shifted taps, its
        output and activation (``K + 3`` copies of the channels), the rule's output, ``z``, the gated norm's input
        and output; in float32 the queries and keys before and after their norm, the queries, keys, values, decays
        and write strengths per value head in chunks, the rule's output and the gate; and the
        float32 state at each chunk's start, ``value_heads * key_dim * value_dim * 4 / chunk`` (the chunk's
        ``[C, C]`` matrices and the system's inverse are recomputed from it). Once per step, the backward pass's float32
        cotangents of the chunked inputs and outputs and one chunk's ``[C, C]`` matrices.

        FLOPs, per token and value head (``C`` the chunk, ``dk``/``dv`` the key/value widths), counted as
        :mod:`eqmoe.nn.delta_rule` executes them (two per multiply-add, whole ``[C, C]`` products, masked after): the
        products ``k k^T`` and ``q k^T`` (``4 C dk``), ``attention @ delta`` (``2 C dv``) and the state's ``w S``,
        ``q S``, ``k^T delta`` (``6 dk dv``); the inverse of the unit triangular system by recursive doubling
        (per chunk, ``n`` = ``C`` rounded up to a power of two: ``2 n (n^2 - 1) / 3`` for the blocks' products and
        ``n^2 / 2`` per level for picking the blocks out) and its product with both right-hand sides
        (``2 C (dk + dv)``). Training counts it by ``GroupedQueryAttention.plan``'s rule, the forward plus a backward
        pass of twice its products plus what the backward pass recomputes (blockwise attention: its scores): here
        the whole chunk, which runs under ``jax.checkpoint``, so four times the forward. Chunks pad a length that is
        not a multiple of ``C``. The convolution's and the norms' products are its parameters' (``6 N``).

        Decoding state, per sequence whatever its length (``Cost.state``): the convolution's last
        ``conv_kernel - 1`` inputs in the compute dtype and the float32 state."""
        c, bytes_ = config.attention.linear, shape.bytes
        dk, dv, heads, channels = c.key_head_dim, c.value_head_dim, c.value_heads, c.conv_channels
        chunk = min(c.chunk_size, shape.seq)
        padded = -(-shape.seq // chunk) * chunk / shape.seq  # chunked tokens per token
        chunked = heads * (2 * dk + dv + 2)  # queries, keys, values, decays, write strengths per value head
        kept = bytes_ * (2 * config.embed_dim + (c.conv_kernel + 3) * channels + 5 * heads * dv + 2 * heads)
        kept += 4 * (4 * c.key_heads * dk + chunked + 2 * heads * dv) + 4 * heads * dk * dv / chunk
        per_step = shape.tokens * padded * 4 * 2 * (chunked + heads * dv) + 4 * shape.rows * heads * 4 * chunk**2
        flops = 4 * cls.forward_flops(config, layer, shape.seq)
        state = bytes_ * (c.conv_kernel - 1) * channels + 4 * heads * dk * dv
        return Cost(kept, per_step, flops=flops, state=state)

    @classmethod
    def forward_flops(cls, config: ModelConfig, layer: LayerKind, seq: int, causal: bool = True) -> float:
        """The chunked delta rule's products per token (:meth:`plan` lists them), the same causal or not: a
        recurrence sees only the past."""
        c = config.attention.linear
        dk, dv = c.key_head_dim, c.value_head_dim
        chunk = min(c.chunk_size, seq)
        padded = -(-seq // chunk) * chunk / seq  # chunked tokens per token
        n = 1 << (chunk - 1).bit_length()
        inverse = (2 * n * (n * n - 1) / 3 + (n.bit_length() - 1) * n * n / 2) / chunk
        forward = 4 * chunk * dk + 2 * chunk * dv + 6 * dk * dv + inverse + 2 * chunk * (dk + dv)
        return c.value_heads * padded * forward

    @classmethod
    def checkpoint_names(
        cls, config: ModelConfig, layer: LayerKind, prefix: str, path: tuple, index: tuple[int, ...]
    ) -> list[TensorName]:
        """transformers' names under ``linear_attn.``: the projections (``in_proj_qkvz``, ``in_proj_ba`` or
        ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``), ``conv1d.weight`` ``[channels, 1, kernel]``,
        ``dt_bias``, ``A_log``, ``norm.weight`` and ``out_proj``."""
        c = config.attention.linear
        fields = ("qkvz", "ba") if c.projection == "grouped" else ("qkv", "z", "b", "a")
        names = []
        for field in fields:
            names += linear_names(f"{prefix}in_proj_{field}", (*path, field), index)
        names += linear_names(prefix + "out_proj", (*path, "out"), index)
        stored = (c.conv_channels, 1, c.conv_kernel)
        names.append(TensorName(prefix + "conv1d.weight", (*path, "conv"), index, stored=stored))
        for leaf in ("dt_bias", "A_log"):
            names.append(TensorName(prefix + leaf, (*path, leaf), index))
        names.append(TensorName(prefix + "norm.weight", (*path, "norm", "weight"), index))
        return names

    @classmethod
    def check(cls, config: ModelConfig, layer: LayerKind) -> None:
        if config.attention.linear is None:
            raise ValueError("attention.linear is None; allowed: a LinearAttentionConfig (the layer's widths)")
        if layer.window is not None:
            raise ValueError(f"window={layer.window}; allowed: None (linear attention has no sliding window)")
