"""How the experiments' command lines fail: an expected failure is one line on stderr and exit code 2;
anything else (a bug) keeps its traceback."""

import errno
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from eqmoe import parallel

Args = TypeVar("Args")
Result = TypeVar("Result")


class UsageError(Exception):
    """A failure the user can fix (a bad flag combination, a missing input): reported as one line."""


# FloatingPointError: training stopped on a non-finite loss, with the step and term named.
EXPECTED = (UsageError, ValueError, FileNotFoundError, FileExistsError, PermissionError, FloatingPointError)
DISK_ERRNOS = (errno.ENOSPC, errno.EROFS)  # a full or read-only disk under the output folder


def is_expected_failure(error: BaseException) -> bool:
    """Bad input or an unusable output location, as opposed to a bug (which keeps its traceback)."""
    return isinstance(error, EXPECTED) or (isinstance(error, OSError) and error.errno in DISK_ERRNOS)


def guarded(name: str, run: Callable[[Args], Result], args: Args) -> Result | None:
    """``run(args)``; on an expected failure print ``name: message`` (on one line) and return ``None``."""
    try:
        return run(args)
    except Exception as error:
        if not is_expected_failure(error):
            raise
        print(f"{name}: {' '.join(str(error).split())}", file=sys.stderr)
        return None


@dataclass(frozen=True)
class MeshOptions:
    mesh: str | None = None
    """Device mesh, e.g. data=2,expert=4 or fsdp=-1 (default: one device). Axes: data, fsdp, expert, tensor."""
    rules: str = ""
    """Logical-axis rule overrides, e.g. embed=,experts=expert (see eqmoe.parallel.DEFAULT_RULES)."""
    coordinator: str | None = None
    """host:port of process 0 for a multi-process run (or JAX_COORDINATOR_ADDRESS)."""
    num_processes: int | None = None
    """Processes in a multi-process run (or JAX_NUM_PROCESSES)."""
    process_id: int | None = None
    """This process's index in a multi-process run (or JAX_PROCESS_ID)."""

    def build(self) -> parallel.Parallelism | None:
        """Join the multi-process run if one is asked for, then the mesh (``None``: one device)."""
        joined = parallel.initialize_distributed(self.coordinator, self.num_processes, self.process_id)
        if self.mesh is None and not joined:
            return None
        return parallel.make_parallelism(self.mesh or "data=-1", self.rules)
