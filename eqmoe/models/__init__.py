"""Model families (:mod:`eqmoe.models.family`): one file each, which registers itself; imported here."""

from eqmoe.models import envy, mixtral, qwen3_moe  # noqa: F401 (each registers its family)
from eqmoe.models.family import FAMILIES, Family, get, register

__all__ = ["FAMILIES", "Family", "get", "register"]
