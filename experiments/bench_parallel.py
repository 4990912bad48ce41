"""One train step on one device and on device meshes, side by side: compiled collectives and step time.

    python -m experiments.bench_parallel                       # 8 simulated CPU devices, four meshes
    python -m experiments.bench_parallel --meshes data=2,expert=4 --batch-size 32 --seq-len 128

Counts the collectives in each compiled step's HLO (all-to-all, all-reduce, all-gather, reduce-scatter,
collective-permute) and prints the expert-parallel all-to-all volume per MoE layer from its formula
(``eqmoe.nn.expert_parallel``). On simulated CPU devices every "device" shares the same cores, so the
step times show overhead, not speed-up.
"""

import os
import re
import sys
import time
from dataclasses import dataclass

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "") and "jax" not in sys.modules:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import tyro  # noqa: E402

from eqmoe import Transformer, parallel  # noqa: E402
from eqmoe.train.optimizer import OptimizerConfig, make_optimizer  # noqa: E402
from eqmoe.train.state import init_state  # noqa: E402
from eqmoe.train.step import Batch, make_train_step  # noqa: E402
from experiments.options import PresetOptions, ShapeOptions

COLLECTIVES = ("all-to-all", "all-reduce", "all-gather", "reduce-scatter", "collective-permute")


@dataclass(frozen=True)
class Args(PresetOptions, ShapeOptions):
    meshes: tuple[str, ...] = ("data=8", "fsdp=8", "data=2,expert=4", "data=2,tensor=2,expert=2")
    """Meshes to compare with one device."""
    repeats: int = 5
    """Timed steps per configuration (the median is reported)."""


def collective_counts(hlo: str) -> dict[str, int]:
    """How many times each collective appears as an instruction in compiled HLO text."""
    return {name: len(re.findall(rf"= [^=]*\b{name}(-start)?\(", hlo)) for name in COLLECTIVES}


def _step_and_state(config, parallelism):
    model = Transformer(config, key=jax.random.key(0))
    optimizer, schedule = make_optimizer(OptimizerConfig(), eqx.filter(model, eqx.is_array), embed_dim=config.embed_dim)
    state = init_state(model, optimizer, key=jax.random.key(1), parallelism=parallelism)
    return make_train_step(optimizer, schedule), state


def measure(config, mesh: str | None, batch: int, seq: int, repeats: int) -> tuple[float, dict[str, int]]:
    """Median step seconds and the collective counts of the compiled step."""
    p = None if mesh is None else parallel.make_parallelism(mesh)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size, (batch, seq), dtype=np.int32)
    ones = np.ones((batch, seq), np.int32)
    positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq))
    with parallel.activate(p):
        step, state = _step_and_state(config, p)
        put = parallel.global_batch
        data = Batch(put(tokens, p), put(ones, p), put(positions, p), put(ones.astype(bool), p))
        hlo = step.lower(data, state).compile().compiled.as_text()
        state, terms = step(data, state)
        jax.block_until_ready(terms)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            state, terms = step(data, state)
            jax.block_until_ready(terms)
            times.append(time.perf_counter() - start)
    return float(np.median(times)), collective_counts(hlo)


def main(args: Args) -> None:
    config = args.preset_config()
    print(
        f"{args.preset}, batch {args.batch_size} x {args.seq_len}, {jax.device_count()} {jax.default_backend()} devices"
    )
    base, _ = measure(config, None, args.batch_size, args.seq_len, args.repeats)
    print(f"{'mesh':<28}{'step ms':>9}{'vs 1 dev':>10}  " + "  ".join(f"{c:>18}" for c in COLLECTIVES))
    print(f"{'one device':<28}{base * 1e3:>9.1f}{1.0:>10.2f}")
    moe = config.moe
    for mesh in args.meshes:
        seconds, counts = measure(config, mesh, args.batch_size, args.seq_len, args.repeats)
        print(
            f"{mesh:<28}{seconds * 1e3:>9.1f}{seconds / base:>10.2f}  "
            + "  ".join(f"{counts[c]:>18}" for c in COLLECTIVES)
        )
        p = parallel.parse_mesh(mesh, jax.device_count())
        if moe is not None and p["expert"] > 1:
            shards = p["data"] * p["fsdp"] * p["expert"]
            slots = args.batch_size * args.seq_len // shards * moe.router.top_k
            elements = 2 * p["expert"] * slots * config.embed_dim
            print(
                f"{'':<28}expert all-to-all per MoE layer and device, forward: 2 x {p['expert']} x {slots} slots x "
                f"{config.embed_dim} = {elements:,} elements ({elements * 4 / 2**20:.2f} MiB in float32)"
            )


if __name__ == "__main__":
    main(tyro.cli(Args))
