"""Model families (:mod:`eqmoe.models.family`): one file each, which registers itself; imported here."""

from eqmoe.models import envy, glm4_moe, mixtral, olmoe, qwen2_moe, qwen3_moe  # noqa: F401 (each registers its family)
from eqmoe.models.family import FAMILIES, Family, get, register

__all__ = ["FAMILIES", "Family", "get", "register"]
