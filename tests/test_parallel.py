"""The mesh tests (``tests/mesh_cases.py``) in a process of their own with 8 simulated CPU devices.

The device count is fixed when JAX starts, and the rest of the suite runs on one device; a separate
process keeps the two settings apart. The cases run in two processes (the two-process run apart from the rest) so
that the suite's workers share them.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("selection", ["two_processes", "not two_processes"])
def test_mesh_cases_on_eight_simulated_devices(selection):
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"}
    command = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-k", selection]
    command.append("tests/mesh_cases.py")
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in summary and "skipped" not in summary, summary
