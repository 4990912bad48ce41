"""Autoregressive generation with a KV cache: greedy, or temperature with nucleus (top-p) sampling.

    cache = model.init_cache(batch, max_len)
    out = model(prompt, cache=cache)                      # prefill: every prompt token at once
    out = model(next_token[:, None], cache=out.cache)     # one step: one token per row

``generate`` runs exactly that: the prompt in one call, then one token per row per step inside a
``lax.while_loop``, all in one ``eqx.filter_jit`` program (compiled once per model, prompt shape and
``max_new_tokens``, not per token or per sampling setting), ending as soon as every row has produced
``eos_id``.

MoE routing while decoding is the configured one, capacity included (a prefill equals the uncached
forward pass); a step whose tokens do not split into ``RouterConfig.num_groups`` groups is padded with
masked tokens (see :class:`eqmoe.nn.moe.MoE`). Capacity routing is not causal (a later
token's first choice can evict an earlier token's second), so with drops a decoded continuation can
differ from re-running the whole sequence; :func:`dropless` gives the same parameters without capacity.
"""

import dataclasses
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from eqmoe.model import KVCache, ModelOutput, Transformer
from eqmoe.nn.gqa import LayerCache

__all__ = ["KVCache", "LayerCache", "ModelOutput", "dropless", "generate", "init_cache", "sample"]


def init_cache(model: Transformer, batch: int, max_len: int, dtype: str | None = None) -> KVCache:
    """An empty :class:`KVCache` with ``max_len`` slots per row, in ``dtype`` (default: the compute dtype):
    :meth:`Transformer.init_cache`, each layer's entry what its attention kind keeps."""
    return model.init_cache(batch, max_len, dtype)


def dropless(model: Transformer) -> Transformer:
    """The same parameters with dropless routing (``capacity_factor=None``, one group).

    Without capacity every row decodes independently of the others in the batch and a cached
    continuation equals re-running the whole sequence. A model without capacity is returned as is.
    """
    config = model.config
    if config.moe is None or config.moe.router.capacity_factor is None:
        return model
    router = dataclasses.replace(config.moe.router, capacity_factor=None, num_groups=1)
    dispatch = "auto" if config.moe.dispatch == "capacity" else config.moe.dispatch
    new = config.replace(moe=dataclasses.replace(config.moe, router=router, dispatch=dispatch))
    return model.with_config(new, allow=("moe.router.capacity_factor", "moe.router.num_groups"))


def sample(
    logits: Float[Array, "batch vocab"],
    key: PRNGKeyArray | None,
    temperature: float | Float[Array, ""] = 0.0,
    top_p: float | Float[Array, ""] = 1.0,
    *,
    greedy: bool | None = None,
) -> Int[Array, " batch"]:
    """The next token of every row: the argmax when ``greedy`` (default: ``temperature == 0``), else a
    draw from ``softmax(logits / temperature)`` restricted to the nucleus: the most probable tokens
    whose probabilities, taken largest first, first reach ``top_p`` (always at least the top token;
    tokens tied with the smallest kept probability are kept too)."""
    if greedy is None:
        greedy = float(temperature) == 0.0
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if key is None:
        raise ValueError("sample: temperature > 0 needs a PRNG key")
    logits = logits.astype(jnp.float32) / temperature
    probs = jax.nn.softmax(logits, axis=-1)
    descending = -jnp.sort(-probs, axis=-1)
    before = jnp.cumsum(descending, axis=-1) - descending  # probability mass strictly above each token
    kept = jnp.maximum(jnp.sum(before < top_p, axis=-1, keepdims=True), 1)
    threshold = jnp.take_along_axis(descending, kept - 1, axis=-1)
    logits = jnp.where(probs >= threshold, logits, -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def generate(
    model: Transformer,
    prompt: Int[Array, "batch prompt"],
    *,
    max_new_tokens: int,
    key: PRNGKeyArray | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_id: int | Sequence[int] | None = None,
    prompt_mask: Bool[Array, "batch prompt"] | None = None,
    vocab_limit: int | None = None,
) -> Int[Array, "batch total"]:
    """``prompt`` followed by ``max_new_tokens`` generated tokens per row: ``[batch, prompt + new]``.

    - ``temperature == 0``: greedy (argmax); ``key`` is not needed.
    - ``temperature > 0``: sample from ``softmax(logits / temperature)`` within the top-``top_p``
      nucleus (:func:`sample`); step ``i`` uses ``jax.random.fold_in(key, i)``, so a key fixes the output.
    - ``eos_id``: an id or several (a chat model stops on its end-of-turn token and on the
      ``generation_config.json`` ids); a row stops after producing one and every later position of that row
      is the first of them; decoding ends once every row has stopped (the output keeps its full width).
    - ``prompt_mask``: false at padding for a batch of prompts of different lengths, which must be
      left-padded (real tokens at the end of each row); RoPE positions count real tokens only.
    - ``vocab_limit``: only ids below it are produced (a tokenizer smaller than the model's padded
      vocabulary: an id it cannot decode is never chosen).

    The prompt is processed in one call and each new token in one cached step, all in one compiled
    program (``eqx.filter_jit``), compiled once per model, prompt shape and ``max_new_tokens``:
    temperature, top-p, eos and greedy/sampling are inputs to it, not constants.
    """
    if prompt.ndim != 2 or prompt.shape[1] < 1:
        raise ValueError(f"generate: prompt must be [batch, prompt >= 1] token ids, got shape {prompt.shape}")
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens={max_new_tokens} must be at least 1")
    if temperature < 0:
        raise ValueError(f"generate: temperature={temperature} must be >= 0 (0 is greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"generate: top_p={top_p} must be in (0, 1]")
    greedy = temperature == 0
    if not greedy and key is None:
        raise ValueError("generate: sampling (temperature > 0) needs key=jax.random.key(seed)")
    vocab = model.config.vocab_size
    eos_ids = [] if eos_id is None else [int(i) for i in np.atleast_1d(eos_id)]
    for i in eos_ids:
        if not 0 <= i < vocab:
            raise ValueError(f"generate: eos_id={i} is outside the vocabulary 0..{vocab - 1}")
    if vocab_limit is not None and not 0 < vocab_limit <= vocab:
        raise ValueError(f"generate: vocab_limit={vocab_limit} must be in 1..{vocab}")
    if prompt_mask is None:
        prompt_mask = jnp.ones(prompt.shape, bool)
    else:
        _check_left_padded(prompt_mask)
    if key is None:
        key = jax.random.key(0)  # unused when greedy; keeps one program signature
    return _generate(
        model,
        prompt.astype(jnp.int32),
        prompt_mask,
        key,
        jnp.asarray(greedy),
        jnp.asarray(1.0 if greedy else temperature, jnp.float32),
        jnp.asarray(top_p, jnp.float32),
        jnp.asarray(eos_ids or [-1], jnp.int32),
        jnp.asarray(vocab if vocab_limit is None else vocab_limit, jnp.int32),
        max_new_tokens=max_new_tokens,
    )


def _check_left_padded(prompt_mask: Bool[Array, "batch prompt"]) -> None:
    if isinstance(prompt_mask, jax.core.Tracer):
        return
    mask = np.asarray(prompt_mask)
    if not mask[:, -1].all():
        raise ValueError("generate: prompt_mask must be true at the last position of every row (left padding)")
    if (mask[:, 1:] < mask[:, :-1]).any():
        raise ValueError("generate: prompt_mask must be left padding (false only before a row's first real token)")


@eqx.filter_jit
def _generate(
    model: Transformer,
    prompt: Int[Array, "batch prompt"],
    prompt_mask: Bool[Array, "batch prompt"],
    key: PRNGKeyArray,
    greedy: Bool[Array, ""],
    temperature: Float[Array, ""],
    top_p: Float[Array, ""],
    eos_ids: Int[Array, " eos"],
    vocab_limit: Int[Array, ""],
    *,
    max_new_tokens: int,
) -> Int[Array, "batch total"]:
    """One program for every decoding mode: only the shapes (and the model) are static, so changing
    ``temperature``, ``top_p``, the eos ids or greedy/sampling does not recompile. ``eos_ids = [-1]``: none."""
    batch, prompt_len = prompt.shape
    total = prompt_len + max_new_tokens
    model = model.cast(model.config.dtype)  # once, not in every step

    def pick(logits, step):
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits, -jnp.inf)
        step_key = jax.random.fold_in(key, step)
        return jax.lax.cond(
            greedy,
            lambda: sample(logits, None, greedy=True),
            lambda: sample(logits, step_key, temperature, top_p, greedy=False),
        )

    # The last new token is never fed back, so prompt + new - 1 slots suffice.
    cache = model.init_cache(batch, total - 1)
    out = model(prompt, token_mask=prompt_mask, cache=cache)
    first = pick(out.logits[:, -1], 0)
    filler = jnp.maximum(eos_ids[0], 0)
    tokens = jnp.full((batch, total), filler, jnp.int32)
    tokens = tokens.at[:, :prompt_len].set(prompt).at[:, prompt_len].set(first)
    done = jnp.isin(first, eos_ids)  # never true for -1

    def keep_going(state):
        step, _, _, _, done = state
        return (step < max_new_tokens) & ~jnp.all(done)

    def decode_step(state):
        step, tokens, cache, last, done = state
        out = model(last[:, None], cache=cache)
        token = jnp.where(done, filler, pick(out.logits[:, 0], step))
        tokens = jax.lax.dynamic_update_slice(tokens, token[:, None], (0, prompt_len + step))
        return step + 1, tokens, out.cache, token, done | jnp.isin(token, eos_ids)

    state = (jnp.ones((), jnp.int32), tokens, out.cache, first, done)
    _, tokens, _, _, _ = jax.lax.while_loop(keep_going, decode_step, state)
    return tokens
