"""Named model configurations: ``eqmoe.presets.get("qwen3-30b-a3b")``."""

from eqmoe.config import ModelConfig
from eqmoe.models.family import all_presets

_REGISTRY: dict[str, ModelConfig] = all_presets()


def names() -> list[str]:
    """Every preset name, sorted."""
    return sorted(_REGISTRY)


def get(name: str) -> ModelConfig:
    """The preset called ``name``; a ``ValueError`` listing the known names otherwise."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(names())}")
    return _REGISTRY[name]
