"""How the experiments' command lines fail: an expected failure is one line on stderr and exit code 2;
anything else (a bug) keeps its traceback."""

import errno
import sys
from collections.abc import Callable
from typing import TypeVar

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
