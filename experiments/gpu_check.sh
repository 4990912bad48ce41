#!/usr/bin/env bash
# The speed benchmarks on a GPU, in bfloat16: every bench_model row against transformers (forward and train step),
# then bench_moe's dispatch backends against transformers' MoE block, then one table of eqmoe's fraction of the
# measured matmul peak and its speed over transformers'. Sized for about 8 minutes on an H100, compilation included.
#
#     bash experiments/gpu_check.sh          # from anywhere; it runs in the repository root
#
# The logs, the JSON results and the table are written under $OUT when it is set (else under a new temporary
# folder, named at the end). Wheels in .whl/ are installed into /tmp/site first: a machine whose Python lacks a
# package eqmoe needs (tyro, beartype, tensorboardX, ...) gets it that way. GPU_CHECK_MODEL_FLAGS and
# GPU_CHECK_MOE_FLAGS add flags to each command; with GPU_CHECK_ALLOW_CPU=1 it also runs where JAX has no GPU (a
# try of the script itself, with small shapes in those flags).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
python=${PYTHON:-python3}
out=${OUT:-$(mktemp -d -t gpu_check.XXXXXX)}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false # JAX would hold most of the GPU's memory, and torch runs there too

if compgen -G ".whl/*.whl" >/dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

backend=$("$python" -c 'import jax; print(jax.default_backend())')
if [ "$backend" != gpu ] && [ "${GPU_CHECK_ALLOW_CPU:-0}" != 1 ]; then
    echo "gpu_check: JAX runs on $backend, not a GPU; GPU_CHECK_ALLOW_CPU=1 runs it anyway" >&2
    exit 2
fi
rows=$("$python" -c 'from experiments._bench_rows import SHAPES; print(*SHAPES)')

# 8192^2: a 4096^2 product takes a fraction of a millisecond on an H100, too short to time from the host
# shellcheck disable=SC2086  # $rows and the extra flags are lists of words
"$python" -m experiments.bench_model --shape $rows --dtype bfloat16 --repeats 3 --peak-size 8192 \
    --json-out "$out/bench_model.json" ${GPU_CHECK_MODEL_FLAGS:-} 2>&1 | tee "$out/bench_model.log"
# shellcheck disable=SC2086
"$python" -m experiments.bench_moe --backends sorted ragged_dot dense capacity --dtype bfloat16 --repeats 3 \
    --peak-size 8192 --json-out "$out/bench_moe.json" ${GPU_CHECK_MOE_FLAGS:-} 2>&1 | tee "$out/bench_moe.log"

"$python" - "$out" <<'EOF' | tee "$out/gpu_check.md"
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
model = json.loads((out / "bench_model.json").read_text())
moe = json.loads((out / "bench_moe.json").read_text())
lines: dict[str, dict[str, tuple]] = {}
for row in model["rows"]:
    lines.setdefault(row["shape"], {})[row["pass"]] = (row["eqmoe_of_peak"], row["ratio"])
for name, entry in moe["rows"].items():
    if name != "transformers":
        passes = {"forward": entry["forward"], "train": entry["forward_backward"]}
        lines[f"moe {name}"] = {key: (value["of_peak"], value["speedup_vs_hf"]) for key, value in passes.items()}


def cells(measured: tuple | None) -> list[str]:
    of_peak, versus = measured or (None, None)
    return ["-" if of_peak is None else f"{100 * of_peak:.1f}%", "-" if versus is None else f"{versus:.2f}x"]


table = [["row", "forward of peak", "forward vs HF", "train of peak", "train vs HF"]]
table += [[name, *cells(passes.get("forward")), *cells(passes.get("train"))] for name, passes in lines.items()]
widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
print(f"\neqmoe on {model['machine']['jax_devices'][0]}, bfloat16, torch on {model['machine']['torch_device']}:")
for index, line in enumerate(table):
    print("| " + " | ".join(cell.rjust(width) for cell, width in zip(line, widths)) + " |")
    if index == 0:
        print("|" + "|".join("-" * (width + 2) for width in widths) + "|")
print(
    "vs HF = eqmoe tokens/s over transformers' (> 1: eqmoe faster); of peak = model FLOPs per second over the "
    f"bfloat16 matmul peak measured in each run ({model['machine']['matmul_peak_gflops']:,.0f} and "
    f"{moe['matmul_peak_gflops']:,.0f} GFLOP/s). moe rows: one MoE layer of bench_moe's shape ({moe['args']['tokens']}"
    " tokens), train = its forward+backward; moe dense_swiglu is the dense SwiGLU of equal active FLOPs."
)
EOF
echo "gpu_check: logs, JSON and the table in $out"
