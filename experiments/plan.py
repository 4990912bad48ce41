"""Plan a run before paying for it: per-device memory and FLOPs of the real train step, without the hardware.

    python -m experiments.plan --preset qwen3-30b-a3b --meshes fsdp=8,expert=8 --batch-size 256 --seq-len 4096 \\
        --dtype bfloat16
    python -m experiments.plan --preset qwen3-moe-tiny --meshes data=1 --remats none block      # table over remat
    python -m experiments.plan --preset envy-switch-base --meshes data=8 fsdp=8 data=2,expert=4 --json
    python -m experiments.plan --preset gpt-oss-120b --lora-rank 16 --dtype bfloat16 --device-gib 80  # fits?

The train step is lowered and compiled by XLA on abstract inputs (``jax.ShapeDtypeStruct`` with the mesh's
shardings, on simulated CPU devices; nothing of the model's size is allocated), and its compiled memory
and cost analyses are printed next to the analytic estimate of ``eqmoe.analysis.plan`` (formulas in its
docstring). Several ``--meshes`` or ``--remats`` values print one row per combination. When XLA cannot
compile a configuration here, the row says where it failed and shows the analytic estimate alone.

XLA here is XLA:CPU: GPU and TPU compilers fuse and schedule differently (flash attention, for one, never
materialises the [T, T] scores), so the compiled temp bytes are a CPU-compiler figure; parameters,
optimizer state and arguments are exact for any backend.
"""

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Literal

import tyro

from experiments.options import DispatchOption, DtypeOption, JsonOptions, LoRAOptions, PresetOptions, ShapeOptions


@dataclass(frozen=True)
class Args(PresetOptions, ShapeOptions, DtypeOption, DispatchOption, LoRAOptions, JsonOptions):
    meshes: tuple[str, ...] = ("data=1",)
    """Mesh or meshes to plan, e.g. fsdp=64,expert=16 (simulated CPU devices are created to match)."""
    remats: tuple[Literal["none", "dots", "offload", "block"], ...] = ("none",)
    """Remat policy or policies to plan: none keeps every activation, dots keeps matmul and kernel outputs, offload
    moves them to host memory, block recomputes each layer unit."""
    peak_tflops: float | None = None
    """Peak FLOP/s per device in TFLOP/s, for the tokens/s estimate (default: this machine's device's specified peak
    for --dtype, eqmoe.flops.SPECIFIED_PEAKS, e.g. 197 on a TPU v5e in bfloat16; elsewhere 989, an H100 SXM's bfloat16
    dense peak)."""
    mfu: float = 0.4
    """Model FLOPs utilisation assumed for the tokens/s estimate."""
    freeze: tuple[str, ...] = ()
    """Parameter roles left untrained, e.g. router embedding (no gradients or optimizer state)."""
    compile: bool = True
    """Compile with XLA (off: the analytic estimate only)."""
    device_gib: float | None = None
    """Memory of one device in GiB (e.g. 80): each row then says whether its peak fits, analytic and compiled."""


FP8_BLOCK = (128, 128)  # DeepSeek-V3's published weight_block_size, for --fp8-base


def _devices_needed(meshes: tuple[str, ...]) -> int:
    from eqmoe.parallel import mesh_sizes  # imports JAX but starts no backend: XLA_FLAGS can still be set

    return max(math.prod(abs(size) for size in mesh_sizes(spec).values()) for spec in meshes)


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**30:,.3f}"


def plan(args: Args) -> list[dict]:
    """One record per (mesh, remat): analytic and compiled bytes per device, FLOPs, planning cost."""
    import jax

    from eqmoe import flops, parallel
    from eqmoe.analysis import plan as planning
    from eqmoe.config_io import apply_overrides
    from eqmoe.nn.dispatch import BACKENDS

    if args.dispatch not in (None, "auto") and args.dispatch not in BACKENDS:
        raise ValueError(f"--dispatch {args.dispatch!r} is invalid; allowed: auto | {' | '.join(BACKENDS.names())}")
    from eqmoe.train.optimizer import OptimizerConfig

    lora = args.lora()
    training = planning.Training(OptimizerConfig(freeze=args.freeze), lora, FP8_BLOCK if args.fp8_base else None)
    rows = []
    for spec in args.meshes:
        needed = _devices_needed((spec,))
        if "-1" in spec or needed > jax.device_count():
            raise ValueError(f"--meshes {spec}: give every axis a size; {jax.device_count()} devices exist")
        p = parallel.make_parallelism(spec, devices=jax.devices()[:needed])
        for remat in args.remats:
            config = args.preset_config()
            config = config.replace(remat=remat, dtype=args.dtype, param_dtype="float32")
            if args.dispatch not in (None, "auto") and config.moe is not None:
                config = apply_overrides(config, {"moe.dispatch": args.dispatch})
            estimate = planning.estimate(config, p, args.batch_size, args.seq_len, training)
            total_flops, active_flops = planning.flops_per_token(config, args.seq_len)
            devices = math.prod(p.mesh.shape.values())
            peak = args.peak_tflops or flops.specified_peak_tflops(jax.devices()[0].device_kind, args.dtype) or 989.0
            tokens_per_second = args.mfu * peak * 1e12 * devices / active_flops
            record = {
                "mesh": spec,
                "remat": remat,
                "devices": devices,
                "analytic": {**estimate._asdict(), "argument": estimate.argument, "temp": estimate.temp},
                "flops_per_token": {"total_params": total_flops, "active_params": active_flops},
                "tokens_per_second_at_mfu": tokens_per_second,
                "peak_tflops": peak,
                "frozen": dict(zip(("parameters", "bytes"), planning.frozen_storage(config, training), strict=True)),
                "cache_bytes_per_token": dict(
                    zip(("kept", "expanded"), planning.cache_bytes_per_token(config), strict=True)
                ),
                "decoding_cache": _decoding_cache(planning.decoding_cache(config, args.seq_len)),
                "compiled": None,
                "compile_error": None,
            }
            if args.compile:
                try:
                    compiled = planning.compile_step(config, p, args.batch_size, args.seq_len, training)
                    record["compiled"] = compiled._asdict()
                except Exception as error:  # a compiler failure is a result here, reported beside the estimate
                    record["compile_error"] = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
            if args.device_gib is not None:
                limit, analytic, compiled = args.device_gib * 2**30, record["analytic"], record["compiled"]
                peak = None if compiled is None else compiled["argument"] + compiled["temp"]
                record["fits"] = {
                    "device_gib": args.device_gib,
                    "analytic": analytic["argument"] + analytic["temp"] <= limit,
                    "compiled": None if peak is None else peak <= limit,
                }
            rows.append(record)
    return rows


def _decoding_cache(cache) -> dict:
    """One sequence's decoding cache (``eqmoe.analysis.plan.DecodingCache``) as the JSON record holds it."""
    return {
        "seq": cache.seq,
        "bytes_per_token": round(cache.per_token),
        "expanded_bytes_per_token": round(cache.expanded_per_token),
        "state_bytes_per_sequence": round(cache.state),
        "bytes_per_sequence": round(cache.total),
        "expanded_bytes_per_sequence": round(cache.expanded_total),
        "growing_layers": cache.growing_layers,
        "state_layers": cache.state_layers,
    }


def _cache(cache: dict) -> str:
    """The decoding cache of one sequence: what grows with its length and what does not."""
    kept, expanded = cache["bytes_per_token"], cache["expanded_bytes_per_token"]
    line = f"decoding cache {kept:,} bytes/token"
    if kept != expanded:
        line += f" ({expanded:,} with every head's keys and values expanded)"
    if cache["state_bytes_per_sequence"]:
        line += (
            f" in {cache['growing_layers']} layers + {cache['state_bytes_per_sequence']:,} bytes/sequence of "
            f"recurrent state in {cache['state_layers']} layers (any length)"
        )
    return line + f": {cache['bytes_per_sequence'] / 2**20:,.1f} MiB per {cache['seq']:,}-token sequence"


def _frozen(args: Args, frozen: dict) -> str | None:
    """The line on what the step holds but never updates (None when it trains everything)."""
    count, size = frozen["parameters"], frozen["bytes"]
    if not count:
        return None
    held = "block-FP8 values and scales, dequantized layer by layer" if args.fp8_base else f"in {args.dtype}"
    return (
        f"{'':<29}frozen: {count:,} parameters in {size / 2**30:,.3f} GiB over the whole model "
        f"({size / count:.3f} bytes/parameter: {held})"
    )


def _fits(fits: dict, peak: float, compiled_peak: float | None) -> str:
    """The row's ``fits`` record as a line, with the peaks it was judged on."""
    verdict = lambda fits_here: "yes" if fits_here else "no"  # noqa: E731
    line = f"fits in {fits['device_gib']:g} GiB per device: analytic {verdict(fits['analytic'])} ({_gib(peak)} GiB)"
    if fits["compiled"] is not None:
        line += f", XLA compiled {verdict(fits['compiled'])} ({_gib(compiled_peak)} GiB)"
    return line


def table(args: Args, rows: list[dict]) -> str:
    lines = [
        f"{args.preset}: batch {args.batch_size} x {args.seq_len}, {args.dtype}; bytes per device in GiB "
        "(analytic / XLA compiled)",
        f"{'mesh':<22}{'remat':<7}{'params':>9}{'opt':>9}{'grads+upd':>10}{'activ.':>10}{'argument':>19}"
        f"{'temp':>21}{'output':>10}{'peak':>23}",
    ]
    for row in rows:
        a, c = row["analytic"], row["compiled"]
        peak = a["argument"] + a["temp"]
        compiled_peak = None if c is None else c["argument"] + c["temp"]
        lines.append(
            f"{row['mesh']:<22}{row['remat']:<7}{_gib(a['parameters']):>9}{_gib(a['optimizer']):>9}"
            f"{_gib(a['gradients']):>10}{_gib(a['activations']):>10}"
            f"{_gib(a['argument']):>9} / {_gib(c and c['argument']):>7}"
            f"{_gib(a['temp']):>10} / {_gib(c and c['temp']):>8}"
            f"{_gib(c and c['output']):>10}{_gib(peak):>11} / {_gib(compiled_peak):>9}"
        )
        flops = row["flops_per_token"]
        line = (
            f"{'':<29}model FLOPs/token {flops['total_params']:.3e} (all params) {flops['active_params']:.3e} "
            f"(active); {row['tokens_per_second_at_mfu']:,.0f} tok/s at MFU {args.mfu} x {row['peak_tflops']:g} "
            f"TFLOP/s x {row['devices']} devices; {_cache(row['decoding_cache'])}"
        )
        if c is not None:
            xla = "-" if c["flops"] is None else f"{c['flops'] * row['devices'] / (args.batch_size * args.seq_len):.3e}"
            line += f"; XLA cost analysis {xla} FLOPs/token (loop bodies counted once)"
            line += f"; lower {c['lower_seconds']:.1f}s, compile {c['compile_seconds']:.1f}s"
        lines.append(line)
        if (frozen := _frozen(args, row["frozen"])) is not None:
            lines.append(frozen)
        if "fits" in row:
            lines.append(f"{'':<29}{_fits(row['fits'], peak, compiled_peak)}")
        if row["compile_error"]:
            lines.append(f"{'':<29}XLA could not compile this here ({row['compile_error']}); analytic only")
    return "\n".join(lines)


def main(args: Args) -> int:
    from experiments._cli import guarded

    needed = guarded("plan", _devices_needed, args.meshes)
    if needed is None:
        return 2
    if "jax" not in sys.modules or not sys.modules["jax"]._src.xla_bridge._backends:
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={needed}".strip()
    started = time.perf_counter()
    rows = guarded("plan", plan, args)
    if rows is None:
        return 2
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(table(args, rows))
        print(f"planning took {time.perf_counter() - started:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(tyro.cli(Args)))
