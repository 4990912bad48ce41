"""Write a folder under a temporary name beside its destination and rename it into place when complete."""

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def staged_folder(folder: Path, *, overwrite: bool) -> Iterator[Path]:
    """Yield an empty staging folder next to ``folder``; on success it replaces ``folder``, on any error it
    is deleted and ``folder`` is untouched. An existing ``folder`` is refused unless ``overwrite``."""
    if folder.exists() and not overwrite:
        raise FileExistsError(f"{folder}: already exists (pass overwrite=True to replace it)")
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        yield staging
        umask = os.umask(0)
        os.umask(umask)
        staging.chmod(0o777 & ~umask)  # mkdtemp makes it private; the result should look like a mkdir
        if folder.exists():
            shutil.rmtree(folder)
        staging.rename(folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
