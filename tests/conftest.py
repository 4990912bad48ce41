"""Shared fixtures: tiny random Hugging Face Qwen3-MoE models written with ``save_pretrained``."""

import gc
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

pytest.register_assert_rewrite("tests.hf_families")

# The suite compiles hundreds of small programs that then run for milliseconds: XLA's CPU backend without its
# LLVM optimisation passes compiles them in about two thirds of the time, and with its older loop emitters in place
# of the fusion emitters (MLIR) in about two thirds again (measured on 2 cores: tests/test_attention.py 50 s -> 29 s,
# tests/test_deepseek.py with test_stack_and_dispatch.py 104 s -> 69 s; the whole suite 16:00 -> 10:05); both compute
# the same functions, the code they make runs slower (1.2-1.5x on the bench rows), so a test that measures execution
# takes them off (FAST_COMPILE_FLAGS). Set before JAX starts its backend; inherited by the subprocesses the tests
# launch. A flag the user set is left alone.
FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
FAST_COMPILE_FLAGS = tuple(flag.split("=")[0] for flag in FAST_COMPILE)
for _flag in FAST_COMPILE:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

# ``auto`` backends follow their static rule in the suite (eqmoe.autotune): a run's numbers must not depend on
# how loaded the machine was when it timed the candidates, and timing every candidate would compile each one.
# tests/test_autotune.py measures on purpose. Inherited by the subprocesses the tests launch.
os.environ.setdefault("EQMOE_AUTO", "rule")

# Many tests (and the commands they launch) compile the same programs: one compilation cache for the whole run,
# every worker and subprocess included, removed when the run ends. A user's own cache setting is left alone. Only
# programs that took a second or more to compile are written: writing every one of the many small programs cost
# more than it saved (tests/test_gpt_oss.py with test_glm4_moe.py: 101 s with all written, 93 s with none or these).
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="eqmoe-tests-jax-cache-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "1"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"


def pytest_configure(config):
    import jax

    if jax.default_backend() == "tpu":  # a TPU multiplies float32 in bfloat16 passes unless asked for more
        jax.config.update("jax_default_matmul_precision", "highest")


def pytest_runtest_logreport(report):
    """With EQMOE_FAILURES_AT_ONCE set (experiments/tpu_check.sh sets it), each failure's message is printed as the
    test ends, not in the summary at the end: a run cut by a time limit still says why each test failed."""
    if report.failed and os.environ.get("EQMOE_FAILURES_AT_ONCE"):
        text = report.longreprtext
        print(f"\n--- {report.nodeid} ({report.when}) failed:\n{text[-int(os.environ['EQMOE_FAILURES_AT_ONCE']) :]}")


def pytest_unconfigure(config):
    if _OWN_CACHE and not hasattr(config, "workerinput"):  # the controlling process made it
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


# Tests that launch long subprocesses or whole commands start first, so that at the end of a run no worker
# waits on one of them while the other is idle.
_START_FIRST = ("test_parallel.py", "test_notebooks.py", "test_reliability.py", "test_resume_execution.py")


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: not any(name in item.nodeid for name in _START_FIRST))


TINY_HF = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=24,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


def save_tiny_hf(folder: Path, seed: int = 0, **overrides):
    """A random ``Qwen3MoeForCausalLM`` saved to ``folder``; returns the torch model in eval mode."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(**{**TINY_HF, **overrides})
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():  # HF zero-initialises nothing we test, but norms start at exactly 1: perturb them.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(folder)
    return model


def load_reference(folder: Path):
    """The saved model read back by transformers with the eager (reference) attention and experts."""
    transformers = pytest.importorskip("transformers")
    return transformers.Qwen3MoeForCausalLM.from_pretrained(
        folder, attn_implementation="eager", experts_implementation="eager"
    ).eval()


def kill_when(process: subprocess.Popen, ready, timeout: float = 240) -> str:
    """SIGKILL ``process`` as soon as ``ready()``; its stderr."""
    deadline = time.monotonic() + timeout
    while not ready() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ready(), process.communicate()[1][-3000:]
    process.send_signal(signal.SIGKILL)
    return process.communicate()[1]


MAPPINGS = Path("/proc/self/maps")


@pytest.fixture(autouse=True)
def _free_compiled_programs():
    """Drop every compiled program once the process holds many memory mappings.

    Each XLA:CPU executable keeps its own mappings; one process running the whole suite otherwise passes
    Linux's default limit of 65,530 (``vm.max_map_count``) and the next compile segfaults.
    """
    yield
    # 25,000 below the limit: room for the programs of the next test
    if MAPPINGS.exists() and MAPPINGS.read_bytes().count(b"\n") > 40_000:
        import jax

        jax.clear_caches()
        gc.collect()


@pytest.fixture(autouse=True)
def _tokenized_cache_in_tmp(tmp_path_factory, monkeypatch):
    """Tokenised data files are cached under a per-session temporary folder, never in the user's cache."""
    monkeypatch.setenv("EQMOE_CACHE", str(tmp_path_factory.getbasetemp() / "eqmoe-cache"))
