"""``auto`` by measurement: the MoE dispatch and the attention backend a run uses, timed on its own shapes.

Before a run's first compile, each ``"auto"`` execution field (``moe.dispatch``, ``attention.backend``) is
resolved by timing every eligible registered backend on the run's shapes (a MoE layer, or an attention call,
over the tokens of one micro-batch; forward and backward for training): a few calls each after a warm-up call,
the fastest median wins. Each candidate runs as :data:`LAYERS` layers run as the model runs its layers
(:func:`_as_layers`: scanned, rematerialised as the config says), so that what it keeps for the backward pass
costs what it costs in the model. A backend is eligible when it can run the config (its own check, a trace that
does not refuse) and keeps memory in the order of the best: a dispatch backend whose planned activations exceed
:data:`MEMORY_FACTOR` times the smallest is not timed, and ``dense`` attention only when a whole row fits in
one tile (``seq <= block_size``); it keeps the probabilities for the backward pass, which the blockwise kernel
recomputes.

The choice and its timings are printed in one line per field, cached per (device kind, shapes, dtype,
candidates) in ``auto_backends.json`` under :func:`eqmoe.cache.cache_root`, and recorded in the run's metadata,
so a resumed run takes the recorded choice and stays exact. A field set to a backend's name is never touched.
``EQMOE_AUTO=rule`` keeps the static rules (:func:`eqmoe.nn.dispatch.backend_name`,
:func:`eqmoe.nn.attention_backends.backend_name`) without timing anything: runs that must not depend on the
machine's timings (the test suite) set it. On a mesh of several devices the rules apply too: the layers then run
sharded, which one device's timing does not describe.
"""

import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from eqmoe.cache import cache_root
from eqmoe.config import ModelConfig
from eqmoe.nn import splash
from eqmoe.nn._init import Init
from eqmoe.nn.context import attention_mask
from eqmoe.nn.moe import MoE
from eqmoe.nn.stack import REMAT_POLICIES
from eqmoe.registries import ATTENTION_BACKENDS, DISPATCH_BACKENDS

ENV = "EQMOE_AUTO"
MEMORY_FACTOR = 4.0
REPEATS = 3
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


@dataclass(frozen=True)
class Measurement:
    """How one ``auto`` field was resolved: ``how`` is ``"measured"``, ``"cached"`` or ``"recorded by the run"`` (a
    resumed run's choice); ``seconds`` the median seconds per call of each timed backend; ``skipped`` why
    the others were not timed."""

    field: str
    choice: str
    how: str
    workload: str = ""
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    settings: dict[str, str] = dataclasses.field(default_factory=dict)  # e.g. {"moe.tiles": "512,1024,1024"}

    def choices(self) -> dict[str, str]:
        """The execution fields this choice sets: the backend's and, for a kernel timed at several tilings, its
        tiling's."""
        return {self.field: self.choice, **self.settings}

    def line(self) -> str:
        timed = ", ".join(
            f"{name} {seconds * 1e3:.2f} ms" for name, seconds in sorted(self.seconds.items(), key=_by_time)
        )
        setting = "".join(f", {name}={value}" for name, value in self.settings.items())
        parts = [f"auto {self.field} -> {self.choice!r}{setting} ({self.how}"]
        if self.workload:
            parts.append(f" on {self.workload}")
        parts.append(f": {timed}" if timed else "")
        parts.append(")")
        if self.skipped:
            parts.append("; not timed: " + "; ".join(f"{name} ({why})" for name, why in self.skipped.items()))
        return "".join(parts)


def _by_time(item: tuple[str, float]) -> float:
    return item[1]


@dataclass(frozen=True)
class Resolved:
    """A config whose ``auto`` fields name backends, and how each was chosen."""

    config: ModelConfig
    choices: dict[str, str] = field(default_factory=dict)
    measurements: tuple[Measurement, ...] = ()


def resolve(
    config: ModelConfig,
    rows: int,
    seq: int,
    *,
    training: bool = True,
    recorded: dict[str, str] | None = None,
    devices: int = 1,
    cache: Path | None = None,
    report=None,
) -> Resolved:
    """``config`` with its ``auto`` backends chosen for ``rows`` sequences of ``seq`` tokens per device.
    ``recorded``: the choices a run stored (taken as they are); ``devices``: the devices the run spans (above one,
    the rules apply); ``cache``: the cache file (default under :func:`eqmoe.cache.cache_root`); ``report``: where
    each line goes (default: standard error)."""
    recorded = recorded or {}
    report = report or (lambda line: print(line, file=sys.stderr))
    use_rule = os.environ.get(ENV, "measure") == "rule" or devices > 1
    cache = cache or cache_root() / "auto_backends.json"
    measurements = []
    if config.moe is not None and config.moe.dispatch == "auto":
        if DISPATCH in recorded:
            measurements.append(_recorded(DISPATCH, recorded, TILES))
        elif not use_rule:  # the rule applies where the layer runs, as it always has
            measurements.append(_cached_or_timed(_DispatchWorkload(config, rows * seq, training), cache))
    if _has_softmax_attention(config) and config.attention.backend == "auto":
        if ATTENTION in recorded:
            measurements.append(_recorded(ATTENTION, recorded, BLOCK))
        elif not use_rule:
            measurements.append(_cached_or_timed(_AttentionWorkload(config, rows, seq, training), cache))
    for measurement in measurements:
        report(measurement.line())
    choices = {name: value for m in measurements for name, value in m.choices().items()}
    return Resolved(_with_choices(config, choices), choices, tuple(measurements))


def _recorded(field: str, recorded: dict[str, str], setting: str) -> Measurement:
    settings = {setting: recorded[setting]} if setting in recorded else {}
    return Measurement(field, recorded[field], "recorded by the run", settings=settings)


def _with_choices(config: ModelConfig, choices: dict[str, str]) -> ModelConfig:
    if DISPATCH in choices:
        DISPATCH_BACKENDS.get(choices[DISPATCH])  # an unknown recorded name raises, naming the registered ones
        moe = dataclasses.replace(config.moe, dispatch=choices[DISPATCH])
        if TILES in choices:
            moe = dataclasses.replace(moe, tiles=tuple(int(t) for t in choices[TILES].split(",")))
        config = dataclasses.replace(config, moe=moe)
    if ATTENTION in choices:
        ATTENTION_BACKENDS.get(choices[ATTENTION])
        attention = dataclasses.replace(config.attention, backend=choices[ATTENTION])
        if BLOCK in choices:
            attention = dataclasses.replace(attention, block_size=int(choices[BLOCK]))
        config = dataclasses.replace(config, attention=attention)
    return config


def _has_softmax_attention(config: ModelConfig) -> bool:
    return any(kind.attention != "gated_deltanet" for kind in config.layers)


class _Workload:
    """One field's candidates on one shape: ``key`` identifies it in the cache, ``eligible`` says why a candidate
    is not timed (``None``: timed), ``program(label)`` is ``(jitted function, arguments)``. A candidate is a
    backend's name, or ``name[setting]`` for a kernel timed at one of several tilings (:func:`_label`)."""

    field: str
    setting: str  # the execution field a candidate's tiling sets
    description: str
    key: dict

    def candidates(self) -> tuple[str, ...]:
        raise NotImplementedError

    def eligible(self, name: str, candidates: tuple[str, ...]) -> str | None:
        return None

    def program(self, label: str):
        raise NotImplementedError

    def measurement(self, label: str, how: str, **details) -> Measurement:
        name, setting = _unlabel(label)
        settings = {} if setting is None else {self.setting: setting}
        return Measurement(self.field, name, how, self.description, settings=settings, **details)


def _label(name: str, setting: tuple[int, ...] | int) -> str:
    """``gmm[512,1024,1024]``: a backend at one tiling."""
    values = setting if isinstance(setting, tuple) else (setting,)
    return f"{name}[{','.join(str(v) for v in values)}]"


def _unlabel(label: str) -> tuple[str, str | None]:
    name, bracket, setting = label.partition("[")
    return name, setting.rstrip("]") if bracket else None


def _off_platform(platforms: tuple[str, ...] | None) -> str | None:
    """Why a kernel made for ``platforms`` is not timed here (``None``: it is)."""
    platform = jax.default_backend()
    if platforms is None or platform in platforms:
        return None
    return f"a {'/'.join(p.upper() for p in platforms)} kernel (interpret mode on {platform.upper()})"


def _cached_or_timed(workload: _Workload, cache: Path) -> Measurement:
    candidates = workload.candidates()
    device = jax.devices()[0]
    key = json.dumps(
        {
            **workload.key,
            "field": workload.field,
            "device": f"{device.platform}:{device.device_kind}",
            "candidates": candidates,
        },
        sort_keys=True,
    )
    entries = _read_cache(cache)
    entry = entries.get(key)
    if isinstance(entry, dict) and entry.get("choice") in candidates:
        return workload.measurement(entry["choice"], "cached", seconds=entry.get("seconds", {}))
    skipped = {name: why for name in candidates if (why := workload.eligible(name, candidates)) is not None}
    seconds = {}
    for name in candidates:
        if name in skipped:
            continue
        try:
            seconds[name] = _time(*workload.program(name), best=min(seconds.values(), default=None))
        except (ValueError, TypeError, NotImplementedError) as error:  # a backend that refuses this config
            skipped[name] = str(error).splitlines()[0][:120]
        except jax.errors.JaxRuntimeError as error:  # e.g. XLA:CPU's dense emulation of ragged_dot at 256 experts
            if "RESOURCE_EXHAUSTED" not in str(error):
                raise
            skipped[name] = "out of memory"
    if not seconds:
        raise ValueError(f"auto {workload.field}: no registered backend can run {workload.description}: {skipped}")
    choice = min(seconds, key=seconds.__getitem__)
    _write_cache(cache, {**entries, key: {"choice": choice, "seconds": seconds}})
    return workload.measurement(choice, "measured", seconds=seconds, skipped=skipped)


def _time(function, arguments, *, best: float | None) -> float:
    """Median seconds of :data:`REPEATS` calls after a warm-up (compiling) call; a backend already ten times slower
    than the best after one call is not called again."""
    jax.block_until_ready(function(*arguments))
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        jax.block_until_ready(function(*arguments))
        times.append(time.perf_counter() - started)
        if best is not None and times[-1] > 10 * best:
            break
    return statistics.median(times)


def _read_cache(path: Path) -> dict:
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or damaged: measure again
        return {}
    return entries if isinstance(entries, dict) else {}


def _write_cache(path: Path, entries: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps(entries, indent=1, sort_keys=True))
        os.replace(partial, path)
    except OSError as error:  # a read-only cache costs a measurement next time, nothing else
        print(f"auto: could not write {path} ({error})", file=sys.stderr)


def _stacked(tree, layers: int = LAYERS):
    """``layers`` copies of ``tree``'s array leaves along a new leading axis, one per layer as the model stacks
    them (stacked on the host: an eager stack would compile a program per shape)."""
    return jax.tree.map(lambda x: jax.device_put(np.stack([np.asarray(x)] * layers)) if eqx.is_array(x) else x, tree)


def _normal(rng: np.random.Generator, shape: tuple[int, ...], dtype) -> jax.Array:
    """Standard normal inputs drawn on the host: ``jax.random.normal`` compiles a program per shape, which took
    seconds of each measurement on a 2-core CPU for arrays timed for milliseconds."""
    return jax.device_put(rng.standard_normal(shape, dtype=np.float32).astype(dtype))


def _as_layers(apply, config: ModelConfig):
    """``apply(differentiable, *rest)`` over each layer of a :func:`_stacked` ``differentiable`` as the model runs
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
        if config.scan_layers:
            return jax.lax.scan(layer, None, params)[1]
        count = len(jax.tree.leaves(params)[0])
        return jnp.stack([layer(None, jax.tree.map(lambda x, i=i: x[i], params))[1] for i in range(count)])

    return run


def _layers_text(config: ModelConfig) -> str:
    how = "scanned" if config.scan_layers else "unrolled"
    return f"{LAYERS} {how} layers" + (f", remat {config.remat}" if REMAT_POLICIES.get(config.remat) else "")


def _layers_key(config: ModelConfig) -> dict:
    """How the timed layers ran, in the cache key: a choice measured another way is measured again."""
    return {"layers": LAYERS, "scan_layers": config.scan_layers, "remat": config.remat}


def _loss_and_grads(apply, training: bool):
    """``apply(differentiable, *rest)`` as a jitted forward, or forward + backward of a fixed linear loss."""
    if not training:
        return eqx.filter_jit(apply)

    def loss(differentiable, *rest):
        out = apply(differentiable, *rest)
        return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape)))

    return eqx.filter_jit(eqx.filter_grad(loss))


class _DispatchWorkload(_Workload):
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
        if "gmm" in names and _off_platform(DISPATCH_BACKENDS.get("gmm").platforms) is None:
            names = tuple(
                label for name in names for label in ([_label(name, t) for t in GMM_TILES] if name == "gmm" else [name])
            )
        return names

    def eligible(self, label: str, candidates: tuple[str, ...]) -> str | None:
        name, _ = _unlabel(label)
        if (why := _off_platform(DISPATCH_BACKENDS.get(name).platforms)) is not None:
            return why
        if not self._runs(name):
            return "needs a capacity factor" if name == "capacity" else "refuses this config"
        least = min(self._bytes(_unlabel(other)[0]) for other in candidates if self._runs(_unlabel(other)[0]))
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
        name, tiles = _unlabel(label)
        moe = dataclasses.replace(config.moe, dispatch=name)
        if tiles is not None:
            moe = dataclasses.replace(moe, tiles=tuple(int(t) for t in tiles.split(",")))
        layer = MoE(config.embed_dim, moe, init=init, key=jax.random.key(0))
        x = _normal(np.random.default_rng(1), (1, self.tokens, config.embed_dim), dtype)
        apply = _as_layers(lambda layer, x: layer(x)[0], config)
        return _loss_and_grads(apply, self.training), (_stacked(layer), x)


class _AttentionWorkload(_Workload):
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
        if "splash" in names and _off_platform(splash.PLATFORMS) is None and blocks:
            names = tuple(
                label for name in names for label in ([_label(name, b) for b in blocks] if name == "splash" else [name])
            )
        return names

    def eligible(self, label: str, candidates: tuple[str, ...]) -> str | None:
        name, _ = _unlabel(label)
        if name == "splash":
            return _off_platform(splash.PLATFORMS) or splash.refusal(self.seq, self.seq)
        if name == "dense" and self.seq > self.config.attention.block_size:
            return f"quadratic memory: {self.seq} tokens exceed one tile of {self.config.attention.block_size}"
        if name == "cudnn":  # packed rows and padding are masks of their own: the fused kernel refuses them
            return "needs a plain causal mask, which packed rows are not"
        return None

    def program(self, label: str):
        name, block = _unlabel(label)
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

        return _loss_and_grads(_as_layers(apply, self.config), self.training), (_stacked((q, k, v)), mask)
