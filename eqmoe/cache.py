"""Where eqmoe keeps what it can recompute (tokenised data, file digests)."""

import os
from pathlib import Path


def cache_root() -> Path:
    """``$EQMOE_CACHE``, else ``$XDG_CACHE_HOME/eqmoe``, else ``~/.cache/eqmoe``."""
    root = os.environ.get("EQMOE_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "eqmoe"
    return Path(root)
