"""eqmoe: Mixture-of-Experts language models as pure equinox pytrees."""

from eqmoe import presets
from eqmoe.config import AttentionConfig, LayerKind, ModelConfig, MoEConfig, NormConfig, RouterConfig, Segment
from eqmoe.model import ModelOutput, Transformer

__all__ = [
    "AttentionConfig",
    "LayerKind",
    "ModelConfig",
    "ModelOutput",
    "MoEConfig",
    "NormConfig",
    "RouterConfig",
    "Segment",
    "Transformer",
    "presets",
]
