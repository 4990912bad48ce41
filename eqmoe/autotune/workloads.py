"""The programs ``auto`` times: a MoE layer per dispatch backend, an attention call per attention backend, each run
as :data:`LAYERS` layers run as the model runs its layers."""

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from eqmoe.autotune.timing import Workload, at_settings, label, off_platform, unlabel
from eqmoe.config import ModelConfig
from eqmoe.nn import megablox, splash
from eqmoe.nn._init import Init
from eqmoe.nn.context import attention_mask
from eqmoe.nn.moe import MoE
from eqmoe.nn.stack import REMAT_POLICIES, unroll_of
from eqmoe.registries import ATTENTION_BACKENDS, DISPATCH_BACKENDS

MEMORY_FACTOR = 4.0
# Layers per timed program. In a layer scan what a layer keeps for the backward pass is written to stacked buffers
# and read back, which one call alone does not pay: on the sft quickstart's shapes dense attention took 0.84-0.93x
# blockwise's time alone, 1.3-1.75x in a scan of two, and made the whole train step 1.13-1.20x slower. Two layers are
# the fewest that keep it as the model does.
LAYERS = 2
DISPATCH, ATTENTION = "moe.dispatch", "attention.backend"
TILES, BLOCK = "moe.tiles", "attention.block_size"  # set beside a kernel chosen at one of its tilings
# The grouped-matmul tilings timed on a TPU (rows, in, out): MaxText's default first, then what came close on one v5e
# chip for coarse experts (1024 -> 3584: 19.5, 20.1, 20.5 ms forward + backward) and fine ones (1024, 256, 256); a tile
# larger than its dimension shrinks to it (eqmoe.nn.megablox). (1024, 1024, 1024) ran out of VMEM there.
GMM_TILES = ((512, 1024, 1024), (1024, 512, 512), (512, 512, 512), (1024, 256, 256))
# those that divide the sequence: 1024 won at 2048 tokens on one v5e chip (heads of 128: 5.3 ms against 5.5 at 512 and
# 8.5 at 256, forward + backward)
SPLASH_BLOCKS = (1024, 512)
# The smallest blockwise tile timed. Half a row of 128 tokens (the sft quickstart's) made its CPU train step 1.1x faster
# than one tile of the whole row (88 against 97 ms); tiles of 32 made it slower (115 ms): more, smaller operations.
MIN_TILE = 64


def stacked(tree, layers: int = LAYERS):
    """``layers`` copies of ``tree``'s array leaves along a new leading axis, one per layer as the model stacks
    them (stacked on the host: an eager stack would compile a program per shape)."""
    return jax.tree.map(lambda x: jax.device_put(np.stack([np.asarray(x)] * layers)) if eqx.is_array(x) else x, tree)


def _normal(rng: np.random.Generator, shape: tuple[int, ...], dtype) -> jax.Array:
    """Standard normal inputs drawn on the host: ``jax.random.normal`` compiles a program per shape, which took
    seconds of each measurement on a 2-core CPU for arrays timed for milliseconds."""
    return jax.device_put(rng.standard_normal(shape, dtype=np.float32).astype(dtype))


def as_layers(apply, config: ModelConfig):
    """``apply(differentiable, *rest)`` over each layer of a :func:`stacked` ``differentiable`` as the model runs
    its layers (:class:`eqmoe.nn.stack.RepeatedUnit`): in a ``lax.scan``, or a Python loop with
    ``scan_layers=False``, each layer recomputed in the backward pass with ``remat="block"``. Returns the layers'
    outputs stacked."""

    def run(stacked, *rest):
        params, static = eqx.partition(stacked, eqx.is_array)

        def layer(carry, layer_params):
            return carry, apply(eqx.combine(layer_params, static), *rest)

        policy = REMAT_POLICIES.get(config.remat)
        if policy is not None:
            layer = jax.checkpoint(layer, policy=policy)
        count = len(jax.tree.leaves(params)[0])
        if config.scan_layers:
            return jax.lax.scan(layer, None, params, unroll=unroll_of(count, config))[1]
        return jnp.stack([layer(None, jax.tree.map(lambda x, i=i: x[i], params))[1] for i in range(count)])

    return run


def _layers_text(config: ModelConfig) -> str:
    how = ("scanned" if unroll_of(LAYERS, config) == 1 else "scanned, unrolled") if config.scan_layers else "unrolled"
    return f"{LAYERS} {how} layers" + (f", remat {config.remat}" if REMAT_POLICIES.get(config.remat) else "")


def _layers_key(config: ModelConfig) -> dict:
    """How the timed layers ran, in the cache key: a choice measured another way is measured again."""
    return {
        "layers": LAYERS,
        "scan_layers": config.scan_layers,
        "scan_unroll": unroll_of(LAYERS, config),
        "remat": config.remat,
    }


def _loss_and_grads(apply, training: bool):
    """``apply(differentiable, *rest)`` as a jitted forward, or forward + backward of a fixed linear loss."""
    if not training:
        return eqx.filter_jit(apply)

    def loss(differentiable, *rest):
        out = apply(differentiable, *rest)
        return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape)))

    return eqx.filter_jit(eqx.filter_grad(loss))


class DispatchWorkload(Workload):
    field, setting = DISPATCH, TILES

    def __init__(self, config: ModelConfig, tokens: int, training: bool):
        self.config, self.tokens, self.training = config, tokens, training
        moe = config.moe
        self.description = (
            f"{tokens} tokens x {config.embed_dim}, {moe.router.num_experts} experts top-{moe.router.top_k} of width "
            f"{moe.expert_dim}, {config.dtype}, {_layers_text(config)}, {'forward+backward' if training else 'forward'}"
        )
        self.key = {
            "tokens": tokens,
            "embed": config.embed_dim,
            # what the layer's cost depends on (how the router scores experts does not change it)
            "experts": moe.router.num_experts,
            "top_k": moe.router.top_k,
            "capacity_factor": moe.router.capacity_factor,
            "groups": moe.router.num_groups,
            "expert_dim": moe.expert_dim,
            "shared_width": moe.shared_width,
            "activation": moe.activation,
            "expert_bias": moe.expert_bias,
            "block_size": moe.block_size,
            "dtype": config.dtype,
            "training": training,
            **_layers_key(config),
        }

    def candidates(self) -> tuple[str, ...]:
        names = DISPATCH_BACKENDS.names()
        if "gmm" in names and off_platform(DISPATCH_BACKENDS.get("gmm").platforms) is None:
            return at_settings(names, "gmm", self._distinct_tiles())
        return names

    def _distinct_tiles(self) -> tuple[tuple[int, int, int], ...]:
        """:data:`GMM_TILES` less those that run as an earlier one does at this layer's shapes (the same program
        compiled and timed twice)."""
        moe = self.config.moe
        slots, widths = self.tokens * moe.router.top_k, (self.config.embed_dim, moe.expert_dim)
        first: dict[tuple[int, ...], tuple[int, int, int]] = {}
        for tiles in GMM_TILES:
            first.setdefault(megablox.kernel_tiles(slots, widths, tiles), tiles)
        return tuple(first.values())

    def eligible(self, label: str, candidates: tuple[str, ...]) -> str | None:
        name, _ = unlabel(label)
        if (why := off_platform(DISPATCH_BACKENDS.get(name).platforms)) is not None:
            return why
        if not self._runs(name):
            return "needs a capacity factor" if name == "capacity" else "refuses this config"
        least = min(self._bytes(unlabel(other)[0]) for other in candidates if self._runs(unlabel(other)[0]))
        if self._bytes(name) > MEMORY_FACTOR * least:
            return f"plans {self._bytes(name) / least:.0f}x the activations of the leanest"
        return None

    @functools.cache  # noqa: B019 (a workload lives for one resolve call)
    def _runs(self, name: str) -> bool:
        """Whether the backend's own config check accepts this layer."""
        check = DISPATCH_BACKENDS.get(name).check
        try:
            check is None or check(self.config.moe)
        except ValueError:
            return False
        return True

    def _bytes(self, name: str) -> float:
        moe, c = self.config.moe, jnp.dtype(self.config.dtype).itemsize
        return DISPATCH_BACKENDS.get(name).estimate(moe, self.tokens, self.config.embed_dim, moe.expert_dim, c)

    def program(self, label: str):
        config, dtype = self.config, jnp.dtype(self.config.dtype)
        init = Init(config.init, config.init_std, dtype)
        name, tiles = unlabel(label)
        moe = dataclasses.replace(config.moe, dispatch=name)
        if tiles is not None:
            moe = dataclasses.replace(moe, tiles=tuple(int(t) for t in tiles.split(",")))
        layer = MoE(config.embed_dim, moe, init=init, key=jax.random.key(0))
        x = _normal(np.random.default_rng(1), (1, self.tokens, config.embed_dim), dtype)
        apply = as_layers(lambda layer, x: layer(x)[0], config)
        return _loss_and_grads(apply, self.training), (stacked(layer), x)


class AttentionWorkload(Workload):
    field, setting = ATTENTION, BLOCK

    def __init__(self, config: ModelConfig, rows: int, seq: int, training: bool):
        attention = config.attention
        self.config, self.rows, self.seq, self.training = config, rows, seq, training
        latent = attention.latent
        self.kv_heads = attention.num_heads if latent is not None else attention.num_kv_heads
        self.group = attention.num_heads // self.kv_heads
        self.qk_dim = attention.head_dim
        self.v_dim = latent.value_dim if latent is not None else attention.head_dim
        self.description = (
            f"{rows} x {seq} tokens, {attention.num_heads} heads over {self.kv_heads} key/value heads of "
            f"{self.qk_dim}/{self.v_dim}, {config.dtype}, {_layers_text(config)}, "
            f"{'forward+backward' if training else 'forward'}"
        )
        self.key = {
            "rows": rows,
            "seq": seq,
            "heads": attention.num_heads,
            "kv_heads": self.kv_heads,
            "qk_dim": self.qk_dim,
            "v_dim": self.v_dim,
            "sinks": attention.sinks,
            "block_size": attention.block_size,
            "dtype": config.dtype,
            "training": training,
            **_layers_key(config),
        }

    def candidates(self) -> tuple[str, ...]:
        names = ATTENTION_BACKENDS.names()
        blocks = [b for b in SPLASH_BLOCKS if self.seq % b == 0]
        if "splash" in names and off_platform(splash.PLATFORMS) is None and blocks:
            names = at_settings(names, "splash", blocks)
        half = -(-self.seq // 16) * 8
        if "blockwise" in names and self.seq <= self.config.attention.block_size and half >= MIN_TILE:
            # a row in one tile computes every score the causal mask hides; in two tiles a quarter of them is skipped
            names = tuple(c for n in names for c in ((n, label(n, half)) if n == "blockwise" else (n,)))
        return names

    def eligible(self, label: str, candidates: tuple[str, ...]) -> str | None:
        name, _ = unlabel(label)
        if name == "splash":
            return off_platform(splash.PLATFORMS) or splash.refusal(self.seq, self.seq)
        if name == "dense" and self.seq > self.config.attention.block_size:
            return f"quadratic memory: {self.seq} tokens exceed one tile of {self.config.attention.block_size}"
        if name == "cudnn":  # packed rows and padding are masks of their own: the fused kernel refuses them
            return "needs a plain causal mask, which packed rows are not"
        return None

    def program(self, label: str):
        name, block = unlabel(label)
        dtype, attention = jnp.dtype(self.config.dtype), self.config.attention
        block_size = attention.block_size if block is None else int(block)
        rng, shape = np.random.default_rng(2), (self.rows, self.kv_heads, self.seq)
        q = _normal(rng, (*shape[:2], self.group, self.seq, self.qk_dim), dtype)
        k = _normal(rng, (*shape, self.qk_dim), dtype)
        v = _normal(rng, (*shape, self.v_dim), dtype)
        segments = jnp.ones((self.rows, self.seq), jnp.int32)
        mask = attention_mask(segments, segments > 0)
        sinks = jnp.zeros((self.kv_heads, self.group), jnp.float32) if attention.sinks else None
        backend = ATTENTION_BACKENDS.get(name)
        extra = {} if sinks is None else {"sinks": sinks}

        def apply(qkv, mask):
            q, k, v = qkv
            scale = self.qk_dim**-0.5
            return backend(q, k, v, mask, scale=scale, block_size=block_size, window=None, **extra)

        return _loss_and_grads(as_layers(apply, self.config), self.training), (stacked((q, k, v)), mask)
