"""Scale-out on simulated CPU devices: the mesh tests (``tests/mesh_cases.py``) in a process of their own with 8
simulated CPU devices, and a run over two processes of one device each.

The device count is fixed when JAX starts, and the rest of the suite runs on one device; a separate process keeps the
two settings apart. The two-process run needs no such process: its processes are commands of their own, and the run
it is compared with is this one's single device.
"""

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mesh_cases_on_eight_simulated_devices():
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"}
    command = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "tests/mesh_cases.py"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in summary and "skipped" not in summary, summary


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_together(processes, stderr_files, timeout: float) -> None:
    """Waits for every process; one that fails ends the others at once (they would wait on it in a collective).
    Past ``timeout`` each process left is made to print its Python stacks (faulthandler, on SIGABRT) before it ends.
    The message holds every failed process's error."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
        if any(p.returncode not in (None, 0) for p in processes):
            break
        time.sleep(0.5)
    timed_out = time.monotonic() >= deadline
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGABRT if timed_out else signal.SIGKILL)
    for process in processes:
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    failed = [
        f"process {i} (of {len(processes)}, exit {process.returncode}):\n{path.read_text()[-3000:]}"
        for i, (process, path) in enumerate(zip(processes, stderr_files, strict=True))
        if process.returncode != 0
    ]
    assert not failed, ("timed out; " if timed_out else "") + "\n".join(failed)


def test_two_processes_match_one(tmp_path):
    from experiments import sft

    flags = dict(seq_len=64, batch_size=8, train_examples=300, eval_examples=16, steps=5, checkpoint_every=5)
    words = [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()] + ["--eval-every=100", "--samples=0"]
    port = _free_port()
    xla_flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env = {**os.environ, "XLA_FLAGS": " ".join([*xla_flags, "--xla_force_host_platform_device_count=1"])}
    command = [sys.executable, "-X", "faulthandler", "-m", "experiments.sft", *words, "--mesh=data=2"]
    command.append(f"--out-dir={tmp_path / 'two'}")
    stderr_files = [tmp_path / f"stderr{i}" for i in range(2)]  # files: a full pipe no one reads stalls a process
    with contextlib.ExitStack() as files:
        processes = [
            subprocess.Popen(
                [*command, f"--coordinator=127.0.0.1:{port}", "--num-processes=2", f"--process-id={i}"],
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=files.enter_context(path.open("w")),
            )
            for i, path in enumerate(stderr_files)
        ]
        _wait_together(processes, stderr_files, timeout=300)
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    args = sft.Args(
        data=dataclasses.replace(
            sft.DataOptions(), **{k: flags[k] for k in ("seq_len", "batch_size")}, train_examples=300, eval_examples=16
        ),
        run=sft.RunOptions(steps=5, checkpoint_every=5, eval_every=100, samples=0, out_dir=tmp_path / "one"),
    )
    one = sft.run(args)
    assert abs(two["final_loss"] - one["final_loss"]) < 1e-5
    assert abs(two["eval_loss"] - one["eval_loss"]) < 1e-5
