"""Log-likelihoods of token sequences, batched by length with right padding the model ignores.

A request is ``(tokens, first)``: the model reads ``tokens[:-1]`` and each position ``i >= first - 1`` is scored
on predicting ``tokens[i + 1]`` (lm-eval's causal layout: the input is context + continuation without its last
token). Requests are sorted by length, cut into batches of ``batch_size`` rows (the last one padded with empty
rows), and each batch is padded to a bucket length (:func:`bucket_length`), so one compiled program serves every
batch of a bucket instead of one program per request length.
"""

from collections.abc import Sequence
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from eqmoe.model import Transformer


class Scored(NamedTuple):
    logprob: float  # sum of log p(token) over the scored positions
    greedy: bool  # every scored token is the argmax of its prediction


def bucket_length(length: int, limit: int | None = None) -> int:
    """``length`` rounded up to 16, 24, 32, 48, 64, 96, ... (a power of two or 1.5 times one), at most ``limit``
    when it is at least ``length``: at most a third of a batch is padding, and few lengths get compiled."""
    size = 16
    while size < length:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return size if limit is None or limit < length else min(size, limit)


@eqx.filter_jit
def token_logprobs(
    model: Transformer,
    tokens: Int[Array, "batch seq"],
    mask: Bool[Array, "batch seq"],
    targets: Int[Array, "batch seq"],
) -> tuple[Float[Array, "batch seq"], Bool[Array, "batch seq"]]:
    """Per position: log p(``targets``) under the model reading ``tokens`` (padding where ``mask`` is false, never
    attended to), and whether the target is the argmax. Softmax in float32, as lm-eval's log_softmax."""
    logits = model(tokens, token_mask=mask).logits.astype(jnp.float32)
    target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    logprob = target_logits - jax.nn.logsumexp(logits, axis=-1)
    return logprob, jnp.argmax(logits, axis=-1) == targets


def score(
    model: Transformer,
    requests: Sequence[tuple[Sequence[int], int]],
    *,
    batch_size: int,
    max_length: int | None = None,
    pad_id: int = 0,
) -> list[Scored]:
    """:class:`Scored` for each ``(tokens, first)`` request, in the order given (see the module docstring).
    ``tokens`` must already fit: ``len(tokens) - 1 <= max_length``."""
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i][0]))
    results: list[Scored | None] = [None] * len(requests)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        width = bucket_length(max(len(requests[i][0]) - 1 for i in chunk), max_length)
        tokens = np.full((batch_size, width), pad_id, np.int32)
        targets = np.full((batch_size, width), pad_id, np.int32)
        mask = np.zeros((batch_size, width), bool)
        mask[:, 0] = True  # a padding row reads one token, so no row is entirely padding
        for row, index in enumerate(chunk):
            ids = np.asarray(requests[index][0], np.int32)
            tokens[row, : len(ids) - 1] = ids[:-1]
            targets[row, : len(ids) - 1] = ids[1:]
            mask[row, : len(ids) - 1] = True
        logprob, greedy = jax.device_get(token_logprobs(model, tokens, mask, targets))
        for row, index in enumerate(chunk):
            ids, first = requests[index]
            scored = slice(first - 1, len(ids) - 1)
            results[index] = Scored(float(logprob[row, scored].sum()), bool(greedy[row, scored].all()))
    return results  # type: ignore[return-value]
