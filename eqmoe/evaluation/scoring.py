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
    last: Int[Array, " batch"],
) -> tuple[Float[Array, "batch seq"], Bool[Array, "batch seq"], Float[Array, "batch vocab"]]:
    """Per position: log p(``targets``) under the model reading ``tokens`` (padding where ``mask`` is false, never
    attended to) and whether the target is the argmax; and each row's whole log-distribution at position ``last``
    (its last real token: what every request sharing the row's input but not its last token is scored from). Softmax
    in float32, as lm-eval's log_softmax."""
    logits = model(tokens, token_mask=mask).logits.astype(jnp.float32)
    target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    logprob = target_logits - jax.nn.logsumexp(logits, axis=-1)
    final = jax.nn.log_softmax(logits[jnp.arange(tokens.shape[0]), last], axis=-1)
    return logprob, jnp.argmax(logits, axis=-1) == targets, final


def score(
    model: Transformer,
    requests: Sequence[tuple[Sequence[int], int]],
    *,
    batch_size: int,
    max_length: int | None = None,
    pad_id: int = 0,
) -> list[Scored]:
    """:class:`Scored` for each ``(tokens, first)`` request, in the order given (see the module docstring).
    ``tokens`` must already fit: ``len(tokens) - 1 <= max_length``.

    Requests whose inputs are the same (a multiple-choice question with one-token answers) are read once, as
    lm-eval's transformers backend does: they differ only in the last token, scored from the row's last
    log-distribution."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, (ids, _) in enumerate(requests):
        groups.setdefault(tuple(ids[:-1]), []).append(index)
    inputs = sorted(groups, key=lambda key: -len(key))
    results: list[Scored | None] = [None] * len(requests)
    for start in range(0, len(inputs), batch_size):
        chunk = inputs[start : start + batch_size]
        width = bucket_length(max(len(key) for key in chunk), max_length)
        tokens = np.full((batch_size, width), pad_id, np.int32)
        targets = np.full((batch_size, width), pad_id, np.int32)
        mask = np.zeros((batch_size, width), bool)
        mask[:, 0] = True  # a padding row reads one token, so no row is entirely padding
        last = np.zeros(batch_size, np.int32)
        for row, key in enumerate(chunk):
            ids = np.asarray(requests[groups[key][0]][0], np.int32)
            tokens[row, : len(key)] = key
            targets[row, : len(key)] = ids[1:]
            mask[row, : len(key)] = True
            last[row] = len(key) - 1
        logprob, greedy, final = jax.device_get(token_logprobs(model, tokens, mask, targets, last))
        for row, key in enumerate(chunk):
            best = int(np.argmax(final[row]))
            for index in groups[key]:
                ids, first = requests[index]
                before = slice(first - 1, len(key) - 1)  # every scored position but the last
                total = float(logprob[row, before].sum() + final[row, ids[-1]])
                results[index] = Scored(total, bool(greedy[row, before].all()) and best == ids[-1])
    return results  # type: ignore[return-value]
