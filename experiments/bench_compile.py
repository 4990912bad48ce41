"""How the compile time of a training step grows with depth, scanned (``lax.scan``) versus unrolled.

    python -m experiments.bench_compile --layers 4 48 --batch-size 2 --seq-len 64 --json-out compile.json
    python -m experiments.bench_compile --layers 4 48 --window 16        # sliding and full layers alternating

For each depth, builds ``qwen3-moe-tiny`` with that many MoE layers (shapes only, via
``eqx.filter_eval_shape``: nothing is allocated), then times ``jax.jit(step).lower(...)`` and
``.compile()`` of ``step = jax.value_and_grad(loss)``, ``loss`` being ``eqmoe.losses.objective``.
With ``scan_layers=True`` the program holds one copy of the repeat unit whatever the depth, so its
compile time should stay nearly flat; unrolled, it grows with the number of layers. With ``--window`` the
layers alternate sliding (that window) and full attention, as gpt-oss's ``layer_types``: the segments derived
from the per-layer list are one scan over ``layers / 2`` repeats of a two-layer unit.
"""

import json
import time
from dataclasses import asdict, dataclass

import equinox as eqx
import jax
import jax.numpy as jnp
import tyro

from eqmoe.config import LayerKind, ModelConfig, segments
from eqmoe.losses import objective
from eqmoe.model import Transformer
from experiments.options import JsonFileOptions, PresetOptions, ShapeOptions


@dataclass(frozen=True)
class Args(PresetOptions, ShapeOptions, JsonFileOptions):
    preset: str = "qwen3-moe-tiny"
    batch_size: int = 2
    seq_len: int = 64

    layers: tuple[int, ...] = (4, 48)
    """Depths to compare (number of MoE layers); the ratio is last / first."""

    window: int | None = None
    """Alternate sliding layers of this window with full ones (default: every layer full)."""


@dataclass(frozen=True)
class Timing:
    layers: int
    scan_layers: bool
    lower_s: float  # tracing + lowering to StableHLO
    compile_s: float  # XLA compilation
    hlo_lines: int  # size of the lowered StableHLO module

    @property
    def total_s(self) -> float:
        return self.lower_s + self.compile_s


def time_compile(config: ModelConfig, batch: int, seq: int) -> tuple[float, float, int]:
    """Seconds to lower and to compile one forward+backward of ``config``, and the StableHLO size."""
    abstract = eqx.filter_eval_shape(Transformer, config, key=jax.random.key(0))
    params, static = eqx.partition(abstract, lambda leaf: isinstance(leaf, jax.ShapeDtypeStruct))

    def loss(params, tokens):
        output = eqx.combine(params, static)(tokens)
        return objective(output, tokens, jnp.ones(tokens.shape, bool), config)[0]

    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    start = time.perf_counter()
    lowered = jax.jit(jax.value_and_grad(loss)).lower(params, tokens)
    lowered_at = time.perf_counter()
    lowered.compile()
    compiled_at = time.perf_counter()
    return lowered_at - start, compiled_at - lowered_at, lowered.as_text().count("\n")


def main(args: Args) -> int:
    base = args.preset_config()

    def config(layers: int, scan: bool) -> ModelConfig:
        if args.window is None:
            return base.replace(layers=("moe",) * layers, scan_layers=scan)
        if layers % 2:
            raise SystemExit(f"--window alternates sliding and full layers: --layers {layers} must be even")
        unit = (LayerKind(ffn="moe", window=args.window), LayerKind(ffn="moe"))
        return base.replace(layers=unit * (layers // 2), scan_layers=scan)

    time_compile(config(min(args.layers), True), args.batch_size, args.seq_len)  # warm-up: backend start, caches
    timings = [
        Timing(layers, scan, *time_compile(config(layers, scan), args.batch_size, args.seq_len))
        for scan in (True, False)
        for layers in args.layers
    ]

    backend = jax.default_backend()
    pattern = "every layer full" if args.window is None else f"sliding (window {args.window}) and full alternating"
    units = ", ".join(
        f"{len(s.unit)}-layer unit x {s.repeats}" for s in segments(config(max(args.layers), True).layers)
    )
    print(f"{args.preset}, batch {args.batch_size}, seq {args.seq_len}, backend {backend}, jax {jax.__version__}")
    print(f"layers: {pattern}; {max(args.layers)} layers scan as {units}")
    print(f"{'mode':<9} {'layers':>6} {'lower s':>8} {'compile s':>10} {'total s':>8} {'hlo lines':>10}")
    for t in timings:
        mode = "scan" if t.scan_layers else "unrolled"
        times = f"{t.lower_s:>8.2f} {t.compile_s:>10.2f} {t.total_s:>8.2f}"
        print(f"{mode:<9} {t.layers:>6} {times} {t.hlo_lines:>10}")
    first, last = args.layers[0], args.layers[-1]
    ratios = {}
    for scan in (True, False):
        by_depth = {t.layers: t for t in timings if t.scan_layers == scan}
        mode = "scan" if scan else "unrolled"
        ratios[mode] = by_depth[last].total_s / by_depth[first].total_s
        print(f"ratio {last}/{first} total time, {mode}: {ratios[mode]:.2f}x")

    if args.json_out is not None:
        results = [{**asdict(t), "total_s": t.total_s} for t in timings]
        report = {
            "preset": args.preset,
            "window": args.window,
            "batch": args.batch_size,
            "seq": args.seq_len,
            "backend": backend,
            "jax": jax.__version__,
            "results": results,
            f"ratio_{last}_over_{first}": ratios,
        }
        args.json_out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(tyro.cli(Args)))
