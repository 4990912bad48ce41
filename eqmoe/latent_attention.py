"""The widths of multi-head latent attention (DeepSeek-V2/V3), the config of the ``mla`` attention kind.

Kept beside :class:`eqmoe.config.AttentionConfig` (as ``AttentionConfig.latent``), whose ``num_heads``, ``head_dim``
(the query/key width, ``qk_nope_head_dim + qk_rope_head_dim``), RoPE and bias fields it shares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from eqmoe._checks import _check, _one_of, _positive, execution


@dataclass(frozen=True)
class LatentAttentionConfig:
    """Queries, keys and values of every head rebuilt from two low-rank latents.

    - ``q_rank``: queries through ``x -> q_a (q_rank) -> RMSNorm -> q_b`` (Hugging Face ``q_lora_rank``);
      ``None`` projects them in one matrix (DeepSeek-V2-Lite).
    - ``kv_rank``: keys and values from one latent of this width per token (``kv_lora_rank``), normed, then
      expanded per head by ``kv_b``; beside it ``kv_a`` gives one ``rope_dim``-wide key shared by all heads.
    - ``rope_dim``: the width of the rotated slice at the end of each query and key head (``qk_rope_head_dim``); the
      first ``AttentionConfig.head_dim - rope_dim`` dimensions (``qk_nope_head_dim``) are not rotated.
    - ``value_dim``: each head's value width (``v_head_dim``), which may differ from its query/key width.
    - ``norm_eps``: the epsilon of the two latent norms, which transformers builds with the module default
      (1e-6), not ``rms_norm_eps``.
    - ``decode`` (execution): how attention reads a decoding cache, which holds the latents either way.
      ``"absorbed"`` folds ``kv_b``'s key half into the queries and its value half into the output, so the queries
      attend to the cached latents directly (one shared key head of ``kv_rank + rope_dim``: the reason MLA exists);
      ``"expanded"`` rebuilds every cached token's per-head keys and values first, as transformers does.
    """

    kv_rank: int
    rope_dim: int
    value_dim: int
    q_rank: int | None = None
    norm_eps: float = 1e-6
    decode: Literal["absorbed", "expanded"] = execution("absorbed")

    def __post_init__(self):
        owner = "LatentAttentionConfig"
        _positive(owner, kv_rank=self.kv_rank, value_dim=self.value_dim, norm_eps=self.norm_eps)
        _check(self.q_rank is None or self.q_rank > 0, owner, "q_rank", self.q_rank, "None | a positive number")
        _check(self.rope_dim > 0 and self.rope_dim % 2 == 0, owner, "rope_dim", self.rope_dim, "a positive even number")
        _one_of(owner, "decode", self.decode, ("absorbed", "expanded"))
