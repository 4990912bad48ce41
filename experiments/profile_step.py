"""Where a benchmark row's forward pass and train step spend their time: XLA's own trace of the compiled program.

    python -m experiments.profile_step                           # bench_model's rows, forward and train step
    python -m experiments.profile_step --shape fine --passes train --top 12 --json-out fine.json
    python -m experiments.profile_step --shape fine --passes train --layers separate   # what the layer scan costs

Each row is ``bench_model``'s (the same random model read back from a transformers folder, the same batch, the same
``auto`` backends chosen by measurement). The program is compiled once, its median wall time taken over
``--repeats`` calls, then ``--repeats`` more calls are traced with ``jax.profiler``
(:mod:`eqmoe.analysis.xla_profile`): every operation's own time by kind (matmul, elementwise, gather/scatter, sort,
data movement, loop control), by pass (forward, backward, update, unattributed) and by the source line that
made it.

It answers, per row: what fraction of this machine's matmul peak the step reaches (the model's FLOPs, as
``bench_model`` counts them, over the wall time); how fast its matmuls themselves run (their HLO FLOPs over their own
time, against the same peak); and the **ceiling**: the fraction of peak the step would reach if every operation but
its matmuls took no time, i.e. the model's FLOPs over the matmuls' own time. A row below its target with a ceiling
near its achieved figure is bound by how fast this machine multiplies matrices of its shapes; one far below its
ceiling is bound by the rest, which the table names.

``--layers separate`` measures what the stacked layout costs: each layer's parameters (and so their gradients and
optimizer moments) become arrays of their own, run by a Python loop, so nothing is sliced out of or written into a
stacked array and no per-layer output is stacked. It is a measurement, not a training mode: the program grows with
the depth (compile time too), which the stacked ``lax.scan`` exists to avoid.
"""

import dataclasses
import gc
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import tyro

from eqmoe import autotune, flops
from eqmoe.analysis.xla_profile import KINDS, Profile, profile
from eqmoe.nn.block import Block
from eqmoe.nn.stack import RepeatedUnit, interleave_routings
from eqmoe.train.logging import write_json_atomic
from experiments._bench_device import matmul_peak_gflops
from experiments._bench_passes import copy_arrays, eqmoe_batch, eqmoe_logits
from experiments._bench_rows import DEFAULT_ROWS, PASSES, SHAPES, build_models
from experiments._cli import UsageError, guarded


@dataclass(frozen=True)
class Args:
    shape: tuple[str, ...] = DEFAULT_ROWS
    """Benchmark rows (experiments/_bench_rows.py)."""
    passes: tuple[Literal["forward", "train"], ...] = PASSES
    repeats: int = 5
    """Timed calls (the median is the step's time), then as many traced calls."""
    top: int = 6
    """Source lines listed per pass, by own time."""
    ops: int = 6
    """Operations other than matmuls listed per pass, by own time, with their result shapes."""
    peak_size: int = 4096
    """The square float32 matmul (median of 5) whose rate is the peak."""
    seed: int = 0
    """Seed of the weights and the token ids (as bench_model's)."""
    json_out: Path | None = None
    """Also write the results to this JSON file."""
    layers: Literal["stacked", "separate"] = "stacked"
    """How the layers' parameters are held: stacked and scanned (eqmoe's layout) or each layer's arrays apart."""


def _compiled(model, batch, pass_name: str, seed: int):
    """``(call, hlo_text)``: one call of the row's program, compiled once (a train step carries its donated state)."""
    if pass_name == "forward":
        compiled = eqmoe_logits.lower(model, batch).compile()
        return (lambda: compiled(model, batch)), compiled.compiled.as_text()
    from eqmoe.train.optimizer import OptimizerConfig, make_optimizer
    from eqmoe.train.state import init_state
    from eqmoe.train.step import make_train_step

    model = copy_arrays(model)
    optimizer, schedule = make_optimizer(
        OptimizerConfig(warmup_steps=0), eqx.filter(model, eqx.is_array), embed_dim=model.config.embed_dim
    )
    holder = [init_state(model, optimizer, key=jax.random.key(seed + 1))]
    compiled = make_train_step(optimizer, schedule).lower(batch, holder[0]).compile()

    def call():
        holder[0], metrics = compiled(batch, holder[0])
        return holder[0], metrics

    return call, compiled.compiled.as_text()


class SeparateLayers(eqx.Module):
    """A :class:`~eqmoe.nn.stack.RepeatedUnit`'s repeats as separate units, each holding its own arrays, run in a
    Python loop (no cache, no dropout: the benchmark's passes use neither)."""

    units: tuple[tuple[Block, ...], ...]

    def __init__(self, stacked: RepeatedUnit):
        params, static = eqx.partition(stacked.blocks, eqx.is_array)
        self.units = tuple(
            eqx.combine(jax.tree.map(lambda leaf, i=i: leaf[i], params), static) for i in range(stacked.repeats)
        )

    def __call__(self, x, context, cache=None, key=None):
        per_unit = []
        for unit in self.units:
            routings = []
            for block in unit:
                x, routing, _ = block(x, context, None, None)
                routings.append(routing)
            per_unit.append(tuple(r for r in routings if r is not None))
        routings = jax.tree.map(lambda *xs: jnp.stack(xs), *per_unit)  # as the scan stacks them: [repeats, ...]
        return x, interleave_routings(routings), None


def _median_seconds(call, repeats: int) -> float:
    jax.block_until_ready(call())  # the first call allocates
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def row_profile(name: str, pass_name: str, model, repeats: int, seed: int, peak_gflops: float, ops: int) -> dict:
    """One row's pass: its wall time, fraction of peak, its traced time by kind, pass and origin, and its ``ops``
    largest operations other than matmuls."""
    shape = SHAPES[name]
    ids = np.random.default_rng(seed).integers(0, shape.vocab, (shape.batch, shape.seq))
    call, hlo = _compiled(model, eqmoe_batch(ids), pass_name, seed)
    seconds = _median_seconds(call, repeats)
    model_gflop = shape.batch * shape.seq * flops.forward_flops_per_token(model.config, shape.seq) / 1e9
    model_gflop *= 1 if pass_name == "forward" else 3
    entry = summarise(profile(call, hlo, repeats, seconds), model_gflop, peak_gflops, ops)
    return {"shape": name, "pass": pass_name, **entry}


def summarise(traced: Profile, model_gflop: float, peak_gflops: float, ops: int) -> dict:
    """A traced program's wall time, fraction of peak, traced time by kind, pass and origin, and its ``ops`` largest
    operations other than matmuls (what :func:`report` prints)."""
    seconds = traced.wall_seconds
    matmul = traced.by_kind.get("matmul")
    matmul_seconds = matmul.seconds if matmul else float("nan")

    def lines(table, limit=None):
        ordered = sorted(table.items(), key=lambda item: -item[1].seconds)[:limit]
        return [{"name": key, "ms": line.seconds * 1e3, "share": line.seconds / traced.traced_seconds,
                 "gflop": line.flops / 1e9, "count": line.count} for key, line in ordered]  # fmt: skip

    others = [(traced.info[name], line) for name, line in traced.ops.items() if traced.info[name].kind != "matmul"]
    operations = [
        {"name": op.name, "ms": line.seconds * 1e3, "share": line.seconds / traced.traced_seconds,
         "count": line.count, "kind": op.kind, "pass": op.pass_, "where": op.where, "shape": op.shape}
        for op, line in sorted(others, key=lambda item: -item[1].seconds)[:ops]
    ]  # fmt: skip
    return {
        "ms": seconds * 1e3,
        "model_gflop": model_gflop,
        "of_peak": model_gflop / seconds / peak_gflops,
        "traced_ms": traced.traced_seconds * 1e3,
        "matmul_gflop": (matmul.flops if matmul else 0.0) / 1e9,
        "matmul_of_peak": traced.matmul_rate() / 1e9 / peak_gflops,
        "ceiling_of_peak": model_gflop / matmul_seconds / peak_gflops,
        "kinds": lines(traced.by_kind),
        "passes": lines(traced.by_pass),
        "where": lines(traced.by_where),
        "operations": operations,
    }


def report(entry: dict, top: int) -> str:
    name, pass_name = entry["shape"], entry["pass"]
    if entry.get("layers") == "separate":
        pass_name += " (separate layers)"
    out = [
        f"{name} {pass_name}: {entry['ms']:.1f} ms, {entry['model_gflop']:.2f} model GFLOP, {entry['of_peak']:.1%} of "
        f"peak; traced own time {entry['traced_ms']:.1f} ms; matmuls {entry['matmul_gflop']:.2f} GFLOP "
        f"({entry['matmul_gflop'] / entry['model_gflop']:.2f}x the model's) at {entry['matmul_of_peak']:.1%} of peak; "
        f"ceiling (all else free) {entry['ceiling_of_peak']:.1%}",
        "  by kind: " + ", ".join(f"{k['name']} {k['ms']:.1f} ms ({k['share']:.0%})" for k in entry["kinds"]),
        "  by pass: " + ", ".join(f"{k['name']} {k['ms']:.1f} ms ({k['share']:.0%})" for k in entry["passes"]),
        "  by source:",
        *(f"    {k['name']}: {k['ms']:.1f} ms ({k['share']:.0%}){_gflop(k)}" for k in entry["where"][:top]),
        "  largest other operations (own time per step, executions, kind, pass, source, result shape):",
        *(
            f"    {o['ms']:.1f} ms ({o['share']:.0%}) x{o['count']:g} {o['kind']}, {o['pass']}, {o['where']}, "
            f"{list(o['shape']) if o['shape'] is not None else 'tuple'}: {o['name']}"
            for o in entry["operations"]
        ),
    ]
    return "\n".join(out)


def _gflop(line: dict) -> str:
    return f", {line['gflop']:.2f} GFLOP" if line["gflop"] else ""


def table(entries: list[dict]) -> str:
    header = "| row | pass | ms | of peak | matmul share | matmuls' own rate | ceiling | largest other kind |"
    rows = [header, "|---|---|---|---|---|---|---|---|"]
    for e in entries:
        share = next((k["share"] for k in e["kinds"] if k["name"] == "matmul"), 0.0)
        other = next((k for k in e["kinds"] if k["name"] != "matmul"), {"name": "-", "share": 0.0})
        rows.append(
            f"| {e['shape']} | {e['pass']} | {e['ms']:.1f} | {e['of_peak']:.1%} | {share:.0%} | "
            f"{e['matmul_of_peak']:.1%} of peak | {e['ceiling_of_peak']:.1%} | {other['name']} {other['share']:.0%} |"
        )
    return "\n".join(rows)


def run(args: Args) -> dict:
    unknown = [name for name in args.shape if name not in SHAPES]
    if unknown:
        raise UsageError(f"--shape {' '.join(unknown)}: unknown; allowed: {', '.join(SHAPES)}")
    if args.repeats < 1:
        raise UsageError(f"--repeats={args.repeats} is invalid; allowed: a positive number")
    peak = matmul_peak_gflops(args.peak_size, "float32")
    print(f"matmul peak: {peak:.1f} GFLOP/s (float32 {args.peak_size}^2 jnp.dot, median of 5); kinds: {KINDS}")
    entries = []
    for name in args.shape:
        gc.collect()  # the previous row's model and state, before this row allocates its own
        jax.clear_caches()
        shape = SHAPES[name]
        _, model = build_models(shape, args.seed)
        resolved = autotune.resolve(model.config, shape.batch, shape.seq)
        model = model.with_config(resolved.config)
        if args.layers == "separate":
            model = eqx.tree_at(lambda m: m.segments, model, tuple(SeparateLayers(s) for s in model.segments))
        for pass_name in args.passes:
            entry = row_profile(name, pass_name, model, args.repeats, args.seed, peak, args.ops)
            entry["backends"] = dict(resolved.choices)
            entry["layers"] = args.layers
            entries.append(entry)
            print(report(entry, args.top), flush=True)
    results = {"peak_gflops": peak, "args": dataclasses.asdict(args), "rows": entries}
    print(table(entries))
    if args.json_out is not None:
        write_json_atomic(args.json_out, results)
    return results


def main(args: Args) -> int:
    return 0 if guarded("profile_step", run, args) is not None else 2


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Args)))
