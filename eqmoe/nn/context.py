"""What every layer knows about the tokens besides their vectors: positions, who may see whom, the cache slot.

:class:`AttentionMask` describes visibility per token (never as a ``[batch, queries, keys]`` tensor), so
blockwise kernels can skip whole tiles; :class:`Context` bundles it with the RoPE positions, the real-token mask
and, when decoding, the cache slot the new tokens are written to. The model builds one context per call and
every layer reads what its kind needs from it.
"""

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int


class AttentionMask(eqx.Module):
    """Which keys each query sees.

    Query ``q`` sees key ``t`` when ``key_index[t] <= query_index[q]`` (causal), both lie in the same packed
    document (``query_segment == key_segment``) and the key is a real token (``key_valid``, HF's
    ``attention_mask``); a sliding layer (``window``, a static argument of the kernels) sees only keys with
    ``key_index[t] > query_index[q] - window``. ``plain_causal`` is a static promise that nothing but causality
    masks anything (one document, no padding, queries and keys the same tokens), which lets fused kernels run.
    """

    query_index: Int[Array, " queries"]
    key_index: Int[Array, " keys"]
    query_segment: Int[Array, "batch queries"]
    key_segment: Int[Array, "batch keys"]
    key_valid: Bool[Array, "batch keys"]
    plain_causal: bool = eqx.field(static=True, default=False)

    def dense(self, window: int | None = None) -> Bool[Array, "batch queries keys"]:
        """The mask as a tensor (the reference backend; quadratic in length)."""
        causal = self.key_index[None, :] <= self.query_index[:, None]
        if window is not None:
            causal = causal & (self.key_index[None, :] > self.query_index[:, None] - window)
        same = self.query_segment[:, :, None] == self.key_segment[:, None, :]
        return causal[None] & same & self.key_valid[:, None, :]


def attention_mask(segment_ids: Int[Array, "batch seq"], token_mask: Bool[Array, "batch seq"]) -> AttentionMask:
    """The training mask: causal, within each packed document (equal ``segment_ids``), real keys only."""
    index = jnp.arange(segment_ids.shape[1], dtype=jnp.int32)
    return AttentionMask(index, index, segment_ids, segment_ids, token_mask)


def causal_mask(batch: int, seq: int) -> AttentionMask:
    """Plain causal attention over ``seq`` tokens of one document each, no padding."""
    index = jnp.arange(seq, dtype=jnp.int32)
    zeros = jnp.zeros((batch, seq), jnp.int32)
    return AttentionMask(index, index, zeros, zeros, jnp.ones((batch, seq), bool), plain_causal=True)


def cache_mask(index: Int[Array, ""], seq: int, valid: Bool[Array, "batch max_len"]) -> AttentionMask:
    """``seq`` new tokens written at cache slots ``index ..``: each sees the valid slots up to its own."""
    batch, max_len = valid.shape
    zeros = jnp.zeros((batch, max_len), jnp.int32)
    slots = index + jnp.arange(seq, dtype=jnp.int32)
    return AttentionMask(slots, jnp.arange(max_len, dtype=jnp.int32), zeros[:, :seq], zeros, valid)


class Context(eqx.Module):
    """The call's token facts, shared by every layer.

    - ``positions``: RoPE position of each token (restarting at every packed document).
    - ``token_mask``: false at padding.
    - ``segment_ids``: packed document of each token (0 for padding; all one document without packing).
    - ``mask``: who sees whom (:class:`AttentionMask`).
    - ``cache_index``: when decoding, the cache slot the first of these tokens is written to (``None``: no cache).
    """

    positions: Int[Array, "batch seq"]
    token_mask: Bool[Array, "batch seq"]
    segment_ids: Int[Array, "batch seq"]
    mask: AttentionMask
    cache_index: Int[Array, ""] | None = None

    @property
    def decoding(self) -> bool:
        return self.cache_index is not None
