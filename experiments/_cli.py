"""What the experiments' command lines treat as an expected failure: one line on stderr and exit code 2."""

import errno

EXPECTED = (ValueError, FileNotFoundError, FileExistsError, PermissionError)
DISK_ERRNOS = (errno.ENOSPC, errno.EROFS)  # a full or read-only disk under the output folder


def is_expected_failure(error: BaseException) -> bool:
    """Bad input or an unusable output location, as opposed to a bug (which keeps its traceback)."""
    return isinstance(error, EXPECTED) or (isinstance(error, OSError) and error.errno in DISK_ERRNOS)
