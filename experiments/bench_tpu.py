"""Whole-model train steps on one accelerator chip: MFU at published models' proportions, beside the chip's ceilings.

    python -m experiments.bench_tpu                       # every row (on a TPU v5e: about 5 minutes)
    python -m experiments.bench_tpu --rows mixtral qwen3  # some rows
    python -m experiments.bench_tpu --json-out bench_tpu.json

Each row is a model sized for one 16 GiB chip at a published model's proportions (4 layers or more, a 32,000-token
vocabulary), trained with AdamW in bfloat16 compute over float32 parameters on random tokens. ``auto`` chooses the
attention and dispatch backends and their tiles by timing them on the row's shapes (on a TPU: ``splash`` and
``gmm``), ``--remat auto`` the least recomputation whose compiled step fits (:mod:`eqmoe.train.memory_fit`). MFU is
the model FLOPs of :mod:`eqmoe.flops` (no recomputation) per second over the chip's specified bf16 peak.

Beside each row, its ceilings, each timed forward + backward in the same process at the row's own shapes:

- ``splash``: the bare splash kernel (``jax.experimental.pallas.ops.tpu.splash_attention``) on the row's queries,
  keys and values, and eqmoe's ``splash`` backend on the same (the backend's cost over the kernel's: mask handling,
  layout);
- ``gmm``: the bare megablox kernel's three expert products on rows sorted by expert at the best of
  :data:`eqmoe.autotune.workloads.GMM_TILES`, and at the tiles the row runs with; then the whole MoE layer (router,
  sorting, gathers, products, combine) at those tiles, over the products alone;
- ``peak``: an 8192^3 bf16 matmul.
"""

import dataclasses
import functools
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import tyro

SEQ = 2048
VOCAB = 32000


@dataclass(frozen=True)
class Args:
    rows: tuple[str, ...] = ("mixtral", "qwen3", "deepseek", "gpt_oss", "qwen3_next")
    """Rows to run: mixtral qwen3 deepseek gpt_oss qwen3_next."""
    batch_size: int = 8
    """Rows per batch (per optimizer step in training; the global batch on a mesh)."""
    steps: int = 6
    """Timed steps per row (after one compiling step and one warm-up step)."""
    peak_tflops: float | None = None
    """The chip's peak (default: its specified bf16 peak, eqmoe.flops.SPECIFIED_PEAKS)."""
    json_out: Path | None = None
    """Also write the results to this JSON file."""
    output_chunk: int = 0
    """Take each row's output layer and loss this many positions at a time (ModelConfig.output_chunk; 0: whole rows):
    less memory for the logits, so a lighter remat policy may fit."""
    profile: int = 0
    """Also trace this many steps of each row (XLA's own trace) and print where the step's time goes, by operation
    kind, pass and source line (as ``experiments.profile_step``)."""


def _configs():
    """Each row's model config, by the published model it follows."""
    from eqmoe import presets
    from eqmoe.config import LayerKind

    def sized(name, embed, attention, moe, layers, **fields):
        base = presets.get(name)
        return base.replace(
            vocab_size=VOCAB,
            embed_dim=embed,
            attention=dataclasses.replace(base.attention, **attention),
            moe=dataclasses.replace(base.moe, router=dataclasses.replace(base.moe.router, **moe.pop("router")), **moe),
            layers=layers,
            dtype="bfloat16",
            param_dtype="float32",
            **fields,
        )

    moe = LayerKind("gqa", "moe")
    return {
        # Mixtral 8x7B: 8 experts top-2 of width 3.5x the model's; 32 heads of 128 over 8 -> 8 over 2
        "mixtral": sized(
            "mixtral-8x7b", 1024, dict(num_heads=8, num_kv_heads=2), dict(router=dict(), expert_dim=3584), (moe,) * 4
        ),
        # Qwen3-30B-A3B: 128 experts top-8 of width 3/8 of the model's, heads of 128 (twice the model's width)
        "qwen3": sized(
            "qwen3-30b-a3b", 768, dict(num_heads=12, num_kv_heads=2), dict(router=dict(), expert_dim=288), (moe,) * 4
        ),
        # DeepSeek-V3: latent attention (heads of 128 + 64 rotated, values of 128), 256 experts top-8 in 8 groups
        # keeping 4, one shared expert, the first layer dense
        "deepseek": sized(
            "deepseek-v3",
            768,
            dict(
                num_heads=8,
                num_kv_heads=8,
                head_dim=192,
                latent=dataclasses.replace(
                    presets.get("deepseek-v3").attention.latent, q_rank=384, kv_rank=256, rope_dim=64, value_dim=128
                ),
            ),
            dict(router=dict(), expert_dim=256, shared_expert_dim=256),
            (LayerKind("mla", "dense"),) + (LayerKind("mla", "moe"),) * 3,
            mlp_dim=9 * 256,
            mtp_layers=0,
        ),
        # gpt-oss: sinks, sliding windows of 128 alternating with full layers, 32 experts top-4 as wide as the model
        "gpt_oss": sized(
            "gpt-oss-20b",
            768,
            dict(num_heads=12, num_kv_heads=2, head_dim=64),
            dict(router=dict(), expert_dim=768),
            (LayerKind("gqa", "moe", 128), moe) * 2,
        ),
        # Qwen3-Next: three gated DeltaNet layers before each gated full-attention layer, 512 experts top-10 of width
        # a quarter of the model's, one shared expert
        "qwen3_next": sized(
            "qwen3-next-80b-a3b",
            512,
            dict(
                num_heads=4,
                num_kv_heads=1,
                head_dim=128,
                rotary_dim=32,
                linear=dataclasses.replace(
                    presets.get("qwen3-next-80b-a3b").attention.linear,
                    key_heads=4,
                    value_heads=8,
                    key_head_dim=64,
                    value_head_dim=64,
                ),
            ),
            dict(router=dict(), expert_dim=128, shared_expert_dim=128),
            (LayerKind("gated_deltanet", "moe"),) * 3 + (moe,),
        ),
    }


def _timed(function, *arguments, repeats: int = 5) -> float:
    """Median seconds of ``repeats`` calls after one (compiling) call, as ``auto`` times its candidates."""
    from eqmoe.autotune.timing import time_calls

    return time_calls(function, arguments, best=None, repeats=repeats)


def _train_row(config, batch: int, steps: int, traced_steps: int = 0, peak: float = 0.0) -> dict:
    """The row's train step: backends and remat chosen as a run chooses them, then timed."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np

    from eqmoe import autotune, flops
    from eqmoe.model import Transformer
    from eqmoe.train import memory_fit
    from eqmoe.train.optimizer import OptimizerConfig, make_optimizer, trained_roles
    from eqmoe.train.state import init_state
    from eqmoe.train.step import Batch, make_train_step

    started = time.perf_counter()
    resolved = autotune.resolve(config.replace(remat="auto"), batch, SEQ)
    config = resolved.config
    auto_seconds = time.perf_counter() - started
    model = Transformer(config, key=jax.random.key(0))
    params = eqx.filter(model, eqx.is_array)
    optimizer, schedule = make_optimizer(OptimizerConfig(warmup_steps=1), params, embed_dim=config.embed_dim)
    trained = trained_roles(OptimizerConfig(), params)
    state = init_state(model, optimizer, key=jax.random.key(1))
    del model, params
    tokens = jax.random.randint(jax.random.key(2), (batch, SEQ), 0, config.vocab_size, jnp.int32)
    data = Batch(
        tokens=tokens,
        segment_ids=jnp.ones((batch, SEQ), jnp.int32),
        positions=jnp.broadcast_to(jnp.arange(SEQ, dtype=jnp.int32), (batch, SEQ)),
        target_mask=jnp.ones((batch, SEQ), bool).at[:, 0].set(False),
    )
    started = time.perf_counter()
    state, step = memory_fit.fit(
        state,
        optimizer,
        lambda: make_train_step(optimizer, schedule, trained),
        data,
        stated_gib=None,
        rows=batch,
        grad_accum=1,
    )
    compile_seconds = time.perf_counter() - started
    times = []
    for index in range(steps + 1):
        started = time.perf_counter()
        state, terms = step(data, state)
        jax.block_until_ready(terms["loss"])
        if index:  # the first call after compiling settles allocations
            times.append(time.perf_counter() - started)
    seconds = statistics.median(times)
    model_flops = flops.model_flops_per_token(config, SEQ) * batch * SEQ
    if traced_steps:
        state = _print_profile(step, data, state, traced_steps, seconds, model_flops, peak)
    return {
        "backends": dict(resolved.choices),
        "remat": state.model.config.remat,
        "step_ms": seconds * 1e3,
        "tokens_per_second": batch * SEQ / seconds,
        "model_tflops": model_flops / seconds / 1e12,
        "loss": float(np.asarray(terms["loss"])),
        "auto_s": auto_seconds,
        "compile_s": compile_seconds,
        "config": config,
    }


def _print_profile(step, data, state, calls: int, seconds: float, model_flops: float, peak: float):
    """Where the compiled step's time goes, from XLA's trace of ``calls`` steps; the state after them."""
    from eqmoe.analysis.xla_profile import profile
    from experiments.profile_step import report, summarise

    holder = [state]

    def call():
        holder[0], terms = step(data, holder[0])
        return terms

    try:
        compiled = step if hasattr(step, "compiled") else step.lower(data, state).compile()
        traced = profile(call, compiled.compiled.as_text(), calls, seconds)
        entry = summarise(traced, model_flops / 1e9, peak * 1e3, ops=12)
        print(report({"shape": "train step", "pass": "", **entry}, top=16), file=sys.stderr, flush=True)
    except Exception as error:  # the trace is a diagnosis: a failure to read it leaves the row's figures
        print(f"  profile failed: {type(error).__name__}: {str(error)[:300]}", file=sys.stderr)
    return holder[0]


def _ceilings(config, batch: int) -> tuple[dict | None, dict]:
    """The row's ceilings (:func:`_attention_programs`, :func:`_moe_programs`): every program compiled side by side,
    then each timed alone. A tiling the kernel refuses at these shapes is left out and named on stderr."""
    from eqmoe.autotune.timing import compiled_side_by_side

    attention = _attention_programs(config, batch)
    moe, summarise_moe = _moe_programs(config, batch)
    seconds = {}
    for name, result in compiled_side_by_side({**attention, **moe}).items():
        if isinstance(result, Exception):
            if not name.startswith("products"):
                raise result
            print(f"  gmm {name}: {type(result).__name__}: {str(result)[:100]}", file=sys.stderr)
            continue
        seconds[name] = _timed(result[0], *result[1])
    return (_attention_summary(config, batch, seconds) if attention else None), summarise_moe(seconds)


def _attention_programs(config, batch: int) -> dict:
    """The bare splash kernel and eqmoe's ``splash`` backend, forward + backward, on the row's attention shapes
    (none where the row's attention is not splash)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib

    from eqmoe.nn import splash
    from eqmoe.nn.context import attention_mask

    attention = config.attention
    if not any(kind.attention in ("gqa", "mla") for kind in config.layers) or attention.backend != "splash":
        return {}
    kv_heads, group, qk, vd = _attention_shape(config)
    keys = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(keys[0], (batch, kv_heads, group, SEQ, qk), jnp.bfloat16)
    k = jax.random.normal(keys[1], (batch, kv_heads, SEQ, qk), jnp.bfloat16)
    v = jax.random.normal(keys[2], (batch, kv_heads, SEQ, vd), jnp.bfloat16)
    ones = jnp.ones((batch, SEQ), jnp.int32)
    mask = attention_mask(ones, ones > 0)
    block = splash.block_for(SEQ, attention.block_size)

    def loss(out):
        return jnp.sum(out.astype(jnp.float32))

    backend = jax.jit(
        jax.grad(
            lambda q, k, v: loss(
                splash.splash_attention(q, k, v, mask, scale=qk**-0.5, block_size=attention.block_size)
            ),
            argnums=(0, 1, 2),
        )
    )
    kernel = splash._kernel(kv_heads * group, SEQ, None, block, jax.default_backend() not in splash.PLATFORMS)
    segments = kernel_lib.SegmentIds(q=ones, kv=ones)
    flat_q = q.reshape(batch, kv_heads * group, SEQ, qk)
    bare = jax.jit(jax.grad(lambda q, k, v: loss(jax.vmap(kernel)(q, k, v, segments)), argnums=(0, 1, 2)))
    return {"splash bare": lambda: (bare, (flat_q, k, v)), "splash backend": lambda: (backend, (q, k, v))}


def _attention_shape(config) -> tuple[int, int, int, int]:
    """Key/value heads, queries per key/value head, query/key width, value width."""
    attention = config.attention
    latent = attention.latent
    kv_heads = attention.num_heads if latent is not None else attention.num_kv_heads
    return (
        kv_heads,
        attention.num_heads // kv_heads,
        attention.head_dim,
        latent.value_dim if latent else attention.head_dim,
    )


def _attention_summary(config, batch: int, seconds: dict) -> dict:
    from eqmoe.nn import splash

    _, _, qk, vd = _attention_shape(config)
    bare_s, backend_s = seconds["splash bare"], seconds["splash backend"]
    causal_flops = 3.5 * 2 * batch * config.attention.num_heads * SEQ * (SEQ + 1) / 2 * (qk + vd)  # fwd 1, bwd 2.5
    return {
        "block": splash.block_for(SEQ, config.attention.block_size),
        "bare_ms": bare_s * 1e3,
        "backend_ms": backend_s * 1e3,
        "bare_tflops": causal_flops / bare_s / 1e12,
        "backend_over_bare": backend_s / bare_s,
    }


def _moe_programs(config, batch: int):
    """The MoE layer at the row's tiles, and its expert products alone at each of :data:`GMM_TILES` and the row's
    own; with what makes the summary of their seconds (the layer over its products, those over the best tiles)."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    from eqmoe.autotune.workloads import GMM_TILES
    from eqmoe.nn import megablox
    from eqmoe.nn._init import Init
    from eqmoe.nn.moe import MoE

    moe = config.moe
    tokens, d, f = batch * SEQ, config.embed_dim, moe.expert_dim
    experts, top_k = moe.router.num_experts, moe.router.top_k
    rows = tokens * top_k
    x = jax.random.normal(jax.random.key(4), (1, tokens, d), jnp.bfloat16)
    layer = MoE(d, moe, init=Init("normal", 0.02, jnp.dtype("bfloat16")), key=jax.random.key(5))

    def layer_loss(layer, x):
        return jnp.sum(layer(x)[0].astype(jnp.float32))

    sizes = jnp.full((experts,), rows // experts, jnp.int32)  # balanced groups, the products' own cost
    w_in = jax.random.normal(jax.random.key(6), (experts, d, f), jnp.bfloat16)
    w_out = jax.random.normal(jax.random.key(7), (experts, f, d), jnp.bfloat16)
    interpret = jax.default_backend() not in megablox.PLATFORMS  # a try of the bench off the TPU

    def products(tiles):
        padded = megablox.padded_rows(rows, tiles)
        lhs = jax.random.normal(jax.random.key(8), (padded, d), jnp.bfloat16)
        fitted = lambda k, n: (megablox.row_tile(padded, tiles), megablox._fit(k, tiles[1]), megablox._fit(n, tiles[2]))  # noqa: E731

        def loss(lhs, w_gate, w_up, w_down):
            gate = gmm(lhs, w_gate, sizes, jnp.bfloat16, fitted(d, f), interpret=interpret)
            up = gmm(lhs, w_up, sizes, jnp.bfloat16, fitted(d, f), interpret=interpret)
            out = gmm(jax.nn.silu(gate) * up, w_down, sizes, jnp.bfloat16, fitted(f, d), interpret=interpret)
            return jnp.sum(out.astype(jnp.float32))

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))), (lhs, w_in, w_in, w_out)

    tilings = tuple(dict.fromkeys((*GMM_TILES, moe.tiles)))
    programs = {"moe layer": lambda: (eqx.filter_jit(eqx.filter_grad(layer_loss)), (layer, x))}
    programs.update({f"products {tiles}": functools.partial(products, tiles) for tiles in tilings})

    def summary(seconds: dict) -> dict:
        by_tiles = {tiles: seconds[f"products {tiles}"] for tiles in tilings if f"products {tiles}" in seconds}
        best = min(by_tiles, key=by_tiles.get)
        product_flops = 3 * 2 * rows * d * f * 3  # gate, up, down; forward + backward
        ours = by_tiles.get(moe.tiles, float("nan"))
        return {
            "tiles": list(moe.tiles),
            "best_tiles": list(best),
            "products_ms": ours * 1e3,
            "best_products_ms": by_tiles[best] * 1e3,
            "best_products_tflops": product_flops / by_tiles[best] / 1e12,
            "layer_ms": seconds["moe layer"] * 1e3,
            "layer_over_products": seconds["moe layer"] / ours,
            "products_over_best": ours / by_tiles[best],
        }

    return programs, summary


def main(args: Args) -> None:
    import jax
    import jax.numpy as jnp

    from eqmoe import flops

    device = jax.devices()[0]
    peak, source = (args.peak_tflops, "given") if args.peak_tflops else flops.device_peak_tflops("bfloat16")
    a = jnp.ones((8192, 8192), jnp.bfloat16)
    matmul = 2 * 8192**3 / _timed(jax.jit(jnp.dot), a, a) / 1e12
    print(f"{device.device_kind}: peak {peak:.1f} TFLOP/s ({source}); 8192^3 bf16 matmul {matmul:.1f} TFLOP/s")
    configs = _configs()
    results = []
    for name in args.rows:
        config = configs[name].replace(output_chunk=args.output_chunk)
        print(f"== {name}", file=sys.stderr)
        started = time.perf_counter()
        try:
            row = _train_row(config, args.batch_size, args.steps, args.profile, peak)
            row["mfu"] = row["model_tflops"] / peak
            used = row.pop("config")
            ceilings_started = time.perf_counter()
            row["attention"], row["moe"] = _ceilings(used, args.batch_size)
            row["ceilings_s"] = time.perf_counter() - ceilings_started
            row["row_s"] = time.perf_counter() - started
        except Exception as error:  # a row that fails is a result: its line says why, the others still run
            row = {"error": f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"}
        row["row"] = name
        results.append(row)
        print(_line(row), flush=True)
    summary = {"device": device.device_kind, "peak_tflops": peak, "matmul_tflops": matmul, "rows": results}
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(summary, indent=1, default=str))


def _line(row: dict) -> str:
    if "error" in row:
        return f"{row['row']:<11} failed: {row['error']}"
    text = (
        f"{row['row']:<11} MFU {row['mfu']:6.1%}  {row['tokens_per_second']:>9,.0f} tok/s"
        f"  step {row['step_ms']:7.1f} ms"
        f"  remat {row['remat']:<7} {row['backends']}"
    )
    if row["attention"]:
        a = row["attention"]
        text += (
            f"\n            splash block {a['block']}: bare {a['bare_ms']:.1f} ms ({a['bare_tflops']:.0f} TFLOP/s),"
            f" backend {a['backend_ms']:.1f} ms ({a['backend_over_bare']:.2f}x)"
        )
    m = row["moe"]
    text += (
        f"\n            gmm tiles {m['tiles']}: products {m['products_ms']:.1f} ms ({m['products_over_best']:.2f}x the"
        f" best {m['best_tiles']} {m['best_products_ms']:.1f} ms, {m['best_products_tflops']:.0f} TFLOP/s);"
        f" MoE layer {m['layer_ms']:.1f} ms ({m['layer_over_products']:.2f}x its products)"
        f"\n            seconds: auto {row['auto_s']:.0f}, remat and step compile {row['compile_s']:.0f},"
        f" ceilings {row['ceilings_s']:.0f}, row {row['row_s']:.0f}"
    )
    return text


if __name__ == "__main__":
    main(tyro.cli(Args))
