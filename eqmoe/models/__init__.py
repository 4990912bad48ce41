"""Model families (:mod:`eqmoe.models.family`): one file each, which registers itself; imported here."""

from eqmoe.models import (  # noqa: F401 (each registers its family)
    deepseek_v2,
    deepseek_v3,
    envy,
    glm4_moe,
    gpt_oss,
    llama,
    mixtral,
    olmoe,
    qwen2_moe,
    qwen3,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
)
from eqmoe.models.family import FAMILIES, Family, get, register

__all__ = ["FAMILIES", "Family", "get", "register"]
