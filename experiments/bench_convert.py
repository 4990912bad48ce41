"""Peak memory and time of checkpoint conversion on a synthetic multi-GB Qwen3-MoE checkpoint.

    python -m experiments.bench_convert --gigabytes 4 --workdir /tmp/bench_convert

Writes a random Hugging Face folder of about ``--gigabytes`` of float32 tensors in shards, then runs
``experiments.convert`` both ways (HF -> eqmoe, eqmoe -> HF) each in its own process and prints, per
direction, the wall time and the peak resident memory (``ru_maxrss`` of the child) next to the checkpoint
size. A converter that holds the model once reads about 1.0x plus the Python/JAX baseline (~0.3 GB).
"""

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import tyro

from experiments.options import JsonFileOptions


@dataclass(frozen=True)
class Args(JsonFileOptions):
    gigabytes: float = 4.0
    """Approximate checkpoint size (float32)."""
    workdir: Path = Path("/tmp/bench_convert")
    """Scratch folder (replaced)."""
    shard: str = "1GB"
    """Shard size of the synthetic input and of the exported output."""


def _make_checkpoint(folder: Path, gigabytes: float, shard: str) -> int:
    import jax

    from eqmoe import Transformer, presets
    from eqmoe.checkpoints import hf

    base = presets.get("qwen3-moe-tiny")
    per_layer_bytes = 4 * 3 * base.moe.router.num_experts * base.embed_dim * base.moe.expert_dim
    layers = max(1, round(gigabytes * 1e9 / per_layer_bytes))
    config = base.replace(layers=("moe",) * layers)
    hf.save(Transformer(config, key=jax.random.key(0)), folder, max_shard_size=shard)
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def _peak_of(command: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS bytes of ``command`` run as a child process (``wait4`` gives its own rusage)."""
    start = time.perf_counter()
    child = subprocess.Popen(command)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise subprocess.CalledProcessError(child.returncode, command)
    return time.perf_counter() - start, usage.ru_maxrss * 1024


def main(args: Args) -> None:
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    make = [
        sys.executable,
        "-c",
        f"from experiments.bench_convert import _make_checkpoint as m; "
        f"print(m(__import__('pathlib').Path({str(args.workdir / 'hf')!r}), {args.gigabytes}, {args.shard!r}))",
    ]
    subprocess.run(make, check=True)
    size = sum(p.stat().st_size for p in (args.workdir / "hf").glob("*.safetensors"))
    convert = [sys.executable, "-m", "experiments.convert"]
    rows = []
    for name, extra in (
        ("hf -> eqmoe", ["--hf", str(args.workdir / "hf"), "--out", str(args.workdir / "ckpt")]),
        (
            "eqmoe -> hf",
            [
                "--checkpoint",
                str(args.workdir / "ckpt"),
                "--to-hf",
                str(args.workdir / "back"),
                "--max-shard-size",
                args.shard,
            ],
        ),
    ):
        seconds, peak = _peak_of(convert + extra)
        rows.append({"direction": name, "seconds": seconds, "peak_rss_bytes": peak, "peak_over_size": peak / size})
    print(f"checkpoint: {size / 1e9:.2f} GB float32 in {len(list((args.workdir / 'hf').glob('*.safetensors')))} shards")
    print(f"{'direction':<12}  {'seconds':>8}  {'peak RSS GB':>11}  {'peak / size':>11}")
    for row in rows:
        print(
            f"{row['direction']:<12}  {row['seconds']:>8.1f}  {row['peak_rss_bytes'] / 1e9:>11.2f}  "
            f"{row['peak_over_size']:>11.2f}"
        )
    if args.json_out is not None:
        args.json_out.write_text(json.dumps({"checkpoint_bytes": size, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main(tyro.cli(Args))
