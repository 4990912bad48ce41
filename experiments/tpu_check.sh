#!/usr/bin/env bash
# Prepare and check a TPU: install what eqmoe needs, run the kernel and parity tests on the chip, a TPU bench row and
# the quickstart; then one table. Two more parts on request: the memory fit (a step that does not fit, then the same
# with --remat auto) and the planner against the chip's compiled memory. On one fresh v5e chip (2026-12-08) the whole
# default check took 528 s: install 27 s (torch beside the rest), the kernel and parity tests 205 s (21 passed, 1
# skipped), the mixtral bench row 200 s (auto timing the kernels 75 s, the remat policies and step compiled 43 s,
# the ceilings 36 s), the quickstart 86 s. Every bench row takes 200-300 s there (Qwen3-Next's over 300 s), so all
# five do not fit in the same 10 minutes: TPU_CHECK_BENCH_FLAGS="--rows mixtral qwen3 deepseek gpt_oss qwen3_next"
# runs them (about 20 minutes); the fit part takes 209-281 s and then 109 s, the plan part 70-90 s a preset.
#
#     bash experiments/tpu_check.sh                   # install tests bench quickstart
#     bash experiments/tpu_check.sh fit tests         # some parts, in the order given: install tests bench quickstart fit plan
#     TPU_CHECK_PART_SECONDS=240 bash experiments/tpu_check.sh tests   # each part stopped after 240 s (its log kept)
#     TPU_CHECK_SECONDS=600 bash experiments/tpu_check.sh   # the whole check stopped after 600 s, its table still printed
#     TPU_CHECK_TESTS="tests/test_gpt_oss.py" bash experiments/tpu_check.sh tests   # other test files on the chip
#
# A machine without internet installs from wheels in .whl/ (and its own package index where pip is pointed at one:
# PIP_INDEX_URL; TPU_CHECK_TORCH=0 leaves out torch, which only the parity tests' reference needs); the machine's JAX
# stays first on the path. Wheels for such a machine, fetched where there is internet (what a package index may lack:
# the parity tests need transformers 5.25, which needs huggingface_hub 2.4 or later):
#     pip download --only-binary=:all: --python-version 3.11 --platform manylinux_2_28_x86_64 \
#         --platform manylinux2014_x86_64 -d .whl equinox tyro beartype tiktoken tensorboardX "transformers==5.25.0" accelerate
# TPU_CHECK_BENCH_FLAGS replaces the bench part's flags (default --rows mixtral). Logs, JSON and the table go under
# $OUT when it is set, else under a new temporary folder named at the end. One program holds the chip at a time, so
# everything runs in turn and the tests in one process. auto's timings on the chip are copied beside the logs
# (auto_backends.json); under $EQMOE_CACHE on the next machine they spare timing the same shapes again.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
python=${PYTHON:-python3}
out=${OUT:-$(mktemp -d -t tpu_check.XXXXXX)}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# compiled programs kept across the parts and later checks on the same machine (the refused step and --remat auto
# compile the same policies; a rerun compiles nothing it compiled before)
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/eqmoe-jax-cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-2}
parts=${*:-install tests bench quickstart}
for part in $parts; do
    case $part in install | tests | bench | quickstart | fit | plan) ;;
    *) echo "tpu_check: unknown part '$part'; allowed: install tests bench quickstart fit plan" >&2 && exit 2 ;;
    esac
done
declare -a table=()
row() { table+=("| $1 | $2 | $3 |"); }
timed() { # name, command...: run it under the part's limit and what is left of the check's; log, status, seconds
    local name=$1 started=$SECONDS status seconds=${TPU_CHECK_PART_SECONDS:-}
    shift
    if [ -n "${TPU_CHECK_SECONDS:-}" ]; then  # the whole check's limit: a part gets what is left of it
        local left=$((TPU_CHECK_SECONDS - SECONDS - 15))  # 15 s kept for the table
        [ $left -lt 10 ] && echo "(not run: TPU_CHECK_SECONDS=$TPU_CHECK_SECONDS spent)" >"$out/$name.log" \
            && echo "$name: not run, TPU_CHECK_SECONDS spent" >&2 && return 124
        [ -z "$seconds" ] || [ "$left" -lt "$seconds" ] && seconds=$left
    fi
    local limit=()
    [ -n "$seconds" ] && limit=(timeout --signal=TERM --kill-after=10 "$seconds")
    "${limit[@]}" "$@" >"$out/$name.log" 2>&1
    status=$?
    [ $status = 124 ] && printf '\n(stopped after its %s s)\n' "$seconds" >>"$out/$name.log"
    echo "$name: exit $status in $((SECONDS - started)) s (log: $out/$name.log)" >&2
    return $status
}

site=${EQMOE_SITE:-/tmp/eqmoe-site}  # where install puts everything but JAX and torch
torch_site=$site-torch

install_part() {
    # every dependency but JAX itself (the machine's TPU build stays), from the wheels here or the package index
    deps=$("$python" - <<'EOF'
import re
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
skip = {"jax", "torch", "wandb", "nbclient", "nbformat", "ipykernel", "datasets", "tensorboard", "ruff", "peft", "lm-eval"}
wanted = project["dependencies"] + project["optional-dependencies"]["test"]
name = lambda d: re.split("[<>=!~;\\[]", d)[0].strip()  # noqa: E731
print(" ".join(d.replace(" ", "") for d in wanted if name(d) not in skip and name(d) != project["name"]))
EOF
)
    links=(--find-links .whl)
    [ -d /opt/wheels ] && links+=(--find-links /opt/wheels)  # torch's CPU build, for the parity tests' reference
    # a command, not a shell function: timed runs it under `timeout`, which runs programs only
    local pip=("$python" -m pip install -q --no-compile --only-binary=:all: --upgrade "${links[@]}" --target)
    local install=("${pip[@]}" "$site") torch_pid=""
    rm -rf "$site" "$torch_site"  # pip --target replaces a package's folder but keeps an older version's metadata
    if [ "${TPU_CHECK_TORCH:-1}" = 1 ]; then  # into a folder of its own, beside the rest rather than after it:
        # torch's 836 MB took 43 s of the 50-72 s install; accelerate is transformers' MXFP4 reader
        "${pip[@]}" "$torch_site" torch accelerate >"$out/install_torch.log" 2>&1 &
        torch_pid=$!
    fi
    # shellcheck disable=SC2086  # $deps is a list of requirements
    if timed install "${install[@]}" $deps; then
        result="$(echo $deps | wc -w) requirements"
        status=0
    else  # one missing package stops pip's whole resolution: each on its own, naming the ones that cannot be had
        missing=()
        for dep in $deps; do "${install[@]}" "$dep" >>"$out/install.log" 2>&1 || missing+=("$dep"); done
        result="not installed: ${missing[*]:-none}"
        status=${#missing[@]}
    fi
    if [ -n "$torch_pid" ]; then
        wait "$torch_pid" && result+=", torch and accelerate" || { result+=", torch failed (install_torch.log)"; status=1; }
    fi
    row install "exit $status" "$result"
}

on_path() { # the installed folder after the machine's own JAX, then the project
    local folder
    for folder in "$site" "$torch_site"; do
        [ -d "$folder" ] && [[ ":${PYTHONPATH:-}:" != *":$folder:"* ]] && export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$folder
    done
    [[ ":${PYTHONPATH:-}:" != *":$PWD:"* ]] && export PYTHONPATH=${PYTHONPATH:-}:$PWD
    return 0
}

tests_part() { # the kernels on the chip, then the parity tests with the chip's kernels chosen by auto's rule
    # -v: each test's verdict as it ends, so a log cut by the time limit still names what failed
    # shellcheck disable=SC2086  # TPU_CHECK_TESTS: a list of test files
    # EQMOE_FAILURES_AT_ONCE: each failure's message as the test ends (tests/conftest.py), kept by a cut log too
    EQMOE_FAILURES_AT_ONCE=3000 timed tests "$python" -m pytest -p no:cacheprovider -n 0 -v -o console_output_style=times \
        --tb=short -rfE -m "not slow" ${TPU_CHECK_TESTS:-tests/test_tpu_kernels.py tests/test_qwen3_parity.py}
    local status=$?
    local counts
    counts=$(grep -cE " PASSED( |$)" "$out/tests.log")" passed, "$(grep -cE " FAILED( |$)" "$out/tests.log")" failed, "
    counts+=$(grep -cE " SKIPPED( |$)" "$out/tests.log")" skipped"
    row "kernel and parity tests" "exit $status" "$counts; $(tail -1 "$out/tests.log" | cut -c1-200)"
}

bench_part() {
    # shellcheck disable=SC2086  # extra flags, e.g. --rows mixtral qwen3
    timed bench "$python" -m experiments.bench_tpu --json-out "$out/bench_tpu.json" ${TPU_CHECK_BENCH_FLAGS:---rows mixtral}
    row "bench_tpu" "exit $?" "see below"
}

quickstart_part() {
    local started=$SECONDS status accuracy
    timed quickstart "$python" -m experiments.sft --out-dir "$out/sft" --overwrite
    status=$?
    accuracy=$("$python" -c "import json; print(json.load(open('$out/sft/summary.json'))['eval_accuracy'])" 2>/dev/null)
    rm -rf "$out/sft/checkpoints"  # the device tool brings back files two folders down at most; they are not the result
    row "quickstart (sft)" "exit $status" "$((SECONDS - started)) s, held-out exact match ${accuracy:-?}"
}

fit_part() { # 16 x 2048 tokens, 8 MoE layers of 64 experts top-8, embed 1024: 36 GiB without remat
    local status written
    local fit=(--dtype bfloat16 --steps 4 --log-every 2 --eval-every 1000 --seq-len 2048 --batch-size 16
        --override embed_dim=1024 'layers=["moe","moe","moe","moe","moe","moe","moe","moe"]' moe.router.num_experts=64
        moe.router.top_k=8 moe.expert_dim=256 attention.num_heads=16 attention.num_kv_heads=4 attention.head_dim=64)
    timed fit_refused "$python" -m experiments.pretrain "${fit[@]}" --out-dir "$out/fit_refused"
    status=$?
    written=$([ -e "$out/fit_refused" ] && echo "run folder written" || echo "no run folder")
    row "step that does not fit" "exit $status" "$(tail -1 "$out/fit_refused.log" | cut -c1-300); $written"
    timed fit_auto "$python" -m experiments.pretrain "${fit[@]}" --remat auto --out-dir "$out/fit_auto"
    row "same step, --remat auto" "exit $?" "$(grep -h 'auto remat' "$out/fit_auto.log" | cut -c1-200); $(grep -h 'MFU' "$out/fit_auto.log" | tail -1)"
    rm -rf "$out/fit_auto/checkpoints"
}

plan_part() { # the analytic memory against the chip's compiled memory, single device
    # at widths of whole 128-lane tiles: the chip pads an array's last dimension to 128 lanes, so the small presets'
    # 32-wide heads and 8-expert router tensors held 4-16x their bytes there (2026-12-07, none: compiled 2-3x the
    # analytic; block, which keeps only embed-wide layer inputs: 0.81-1.30x). At these widths (same chip and day):
    # analytic / compiled none 0.86x, 0.94x, 0.87x; block 1.47x, 1.66x, 1.46x (the chip keeps far less of the output
    # layer than the float32 logits and their gradient the analytic side counted, calibrated on XLA:CPU); block as a
    # TPU lays it out by phases (eqmoe.analysis.plan.estimate): 0.97x, 0.95x, 0.98x of the same compiled bytes
    local preset
    for preset in qwen3-moe-tiny envy-test deepseek-v3-micro; do
        timed "plan_$preset" "$python" -m experiments.plan --preset "$preset" --batch-size 8 --seq-len 1024 \
            --override embed_dim=1024 attention.head_dim=128 vocab_size=32000 moe.expert_dim=512 \
            --dtype bfloat16 --remats none block --json
        row "plan $preset" "exit $?" "$("$python" - "$out/plan_$preset.log" <<'EOF'
import json, sys
text = open(sys.argv[1]).read()
if "[" not in text or "]" not in text:  # stopped before its JSON
    sys.exit(print("no result (see the log)"))
rows = json.loads(text[text.index("["):text.rindex("]") + 1])
print("; ".join(
    f"{r['remat']}: analytic {(r['analytic']['argument'] + r['analytic']['temp']) / 2**30:.3f} GiB, "
    f"compiled {(r['compiled']['argument'] + r['compiled']['temp']) / 2**30:.3f} GiB "
    f"({(r['analytic']['argument'] + r['analytic']['temp']) / (r['compiled']['argument'] + r['compiled']['temp']):.2f}x)"
    for r in rows))
EOF
)"
    done
}

on_path
backend=$("$python" -c 'import jax; d = jax.devices()[0]; print(jax.default_backend(), "|", d.device_kind)' 2>/dev/null)
echo "tpu_check: ${backend:-JAX not importable yet}" >&2
for part in $parts; do
    "${part}_part"
    on_path  # after install, the installed folder
done

row "whole check" "-" "$SECONDS s for: $parts"
{
    echo "## tpu_check on $backend"
    echo
    echo "| part | status | result |"
    echo "|---|---|---|"
    printf '%s\n' "${table[@]}"
    if [ -f "$out/bench.log" ]; then
        echo
        echo '```'
        grep -v "^auto \|^==\|^  gmm \|hugepages\|warnings.warn" "$out/bench.log"
        echo '```'
    fi
} | tee "$out/tpu_check.md"
# auto's timings on this chip: put back under $EQMOE_CACHE on a fresh machine, a later check skips timing the same shapes
cache=$("$python" -c 'from eqmoe.cache import cache_root; print(cache_root() / "auto_backends.json")' 2>/dev/null)
[ -f "$cache" ] && cp "$cache" "$out/auto_backends.json"
echo "tpu_check: logs and results in $out" >&2
