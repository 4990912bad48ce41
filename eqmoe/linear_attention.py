"""The widths of gated DeltaNet linear attention (Qwen3-Next, Qwen3.5), the config of the ``gated_deltanet`` kind.

Kept beside :class:`eqmoe.config.AttentionConfig` (as ``AttentionConfig.linear``): a model mixing linear and full
attention layers (Hugging Face ``layer_types``) keeps the full layers' widths there and these here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from eqmoe._checks import _check, _one_of, _positive, execution


@dataclass(frozen=True)
class LinearAttentionConfig:
    """A gated delta rule over ``value_heads`` heads whose queries and keys come from ``key_heads`` heads.

    - ``key_heads``, ``key_head_dim``: query/key heads and their width (``linear_num_key_heads``,
      ``linear_key_head_dim``); each serves ``value_heads / key_heads`` consecutive value heads.
    - ``value_heads``, ``value_head_dim``: the heads of the recurrent state ``[key_head_dim, value_head_dim]`` and of
      the output (``linear_num_value_heads``, ``linear_value_head_dim``).
    - ``conv_kernel``: the causal depthwise convolution over queries, keys and values (``linear_conv_kernel_dim``).
    - ``projection``: how the input projections are laid out, as the checkpoints hold them: ``"grouped"`` is
      Qwen3-Next's fused ``in_proj_qkvz`` / ``in_proj_ba``, grouped per key head (``q, k, v, z`` of a key head's
      value heads side by side); ``"flat"`` is Qwen3.5's ``in_proj_qkv`` (all queries, keys, values), ``in_proj_z``,
      ``in_proj_b``, ``in_proj_a``. The function computed is the same.
    - ``chunk_size`` (execution): tokens per chunk of the chunked delta rule (64 as transformers).
    """

    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4
    projection: Literal["grouped", "flat"] = "flat"
    chunk_size: int = execution(64)

    def __post_init__(self):
        owner = "LinearAttentionConfig"
        _positive(
            owner,
            key_heads=self.key_heads,
            value_heads=self.value_heads,
            key_head_dim=self.key_head_dim,
            value_head_dim=self.value_head_dim,
            conv_kernel=self.conv_kernel,
            chunk_size=self.chunk_size,
        )
        _check(
            self.value_heads % self.key_heads == 0,
            owner,
            "value_heads",
            self.value_heads,
            f"a multiple of key_heads={self.key_heads}",
        )
        _one_of(owner, "projection", self.projection, ("grouped", "flat"))

    @property
    def group(self) -> int:
        """Value heads per key head."""
        return self.value_heads // self.key_heads

    @property
    def conv_channels(self) -> int:
        """Channels of the short convolution: every query, key and value."""
        return 2 * self.key_heads * self.key_head_dim + self.value_heads * self.value_head_dim
