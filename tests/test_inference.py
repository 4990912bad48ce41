"""KV-cache decoding: cached logits equal the uncached forward pass, greedy generation equals the argmax
of a full recomputation at every step, sampling is reproducible, eos stops a row, and the CLI."""

import dataclasses
import functools
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqmoe import presets
from eqmoe.config import segments
from eqmoe.inference import dropless, generate, init_cache, sample
from eqmoe.model import Transformer

QWEN = presets.get("qwen3-moe-tiny").replace(
    vocab_size=64, embed_dim=32, mlp_dim=48, layers=tuple(["dense", "moe", "moe"])
)
ENVY = presets.get("envy-test")  # interleaved RoPE, QK-norm after RoPE, (dense, moe) unit, capacity 2.0 in 2 groups
# Capacity factor = number of experts: a group's capacity is its size, so nothing is ever dropped, the
# capacity dispatch (with its groups) stays exact and decoding can be compared with recomputation.
ENVY_NO_DROPS = ENVY.replace(
    moe=dataclasses.replace(ENVY.moe, router=dataclasses.replace(ENVY.moe.router, capacity_factor=8.0))
)
# Prompt shapes: three envy rows make every decoding step 3 tokens for 2 router groups (padded to 4).
CASES = {"qwen3-moe-tiny-small": (QWEN, (2, 6)), "envy-test-no-drops": (ENVY_NO_DROPS, (3, 6))}
NEW = 6  # new tokens in every test below, so that each program compiles once per model
PROMPT_SHAPE = CASES["qwen3-moe-tiny-small"][1]


@functools.cache
def _model(config) -> Transformer:
    """A random model; ``unsafe_rbg`` keys make its initialisation program quick to compile."""
    if config is ENVY_NO_DROPS:  # the same parameters as envy-test
        return _model(ENVY).with_config(config, allow=("moe.router.capacity_factor",))
    return eqx.filter_jit(Transformer)(config, key=jax.random.key(0, impl="unsafe_rbg"))


@eqx.filter_jit
def _uncached(model, tokens, token_mask):
    return model(tokens, token_mask=token_mask).logits


@eqx.filter_jit
def _cached(model, tokens, cache):
    out = model(tokens, cache=cache)
    return out.logits, out.cache


def _prompt(config, batch, length, seed=1):
    return jax.random.randint(jax.random.key(seed), (batch, length), 0, config.vocab_size)


def _assert_argmax_of_recomputation(model, tokens, prompt_lens, lengths=None):
    """Each token of row ``b`` after its first ``prompt_lens[b]`` (and before ``lengths[b]``) is the argmax
    of the uncached model run on the tokens before it: the prefix right-padded to the full width with
    the padding masked out, so one compilation serves every step (causal attention and masked padding,
    which takes no expert capacity, leave the prefix's logits unchanged)."""
    tokens, prompt_lens = np.asarray(tokens), np.asarray(prompt_lens)[:, None]
    lengths = np.full(tokens.shape[0], tokens.shape[1]) if lengths is None else np.asarray(lengths)
    for step in range(tokens.shape[1] - int(prompt_lens.min())):
        length = prompt_lens + step  # [batch, 1]
        real = np.arange(tokens.shape[1]) < length
        logits = np.asarray(_uncached(model, jnp.asarray(np.where(real, tokens, 0)), jnp.asarray(real)))
        for row in np.flatnonzero(length[:, 0] < lengths):
            at = length[row, 0]
            assert tokens[row, at] == np.argmax(logits[row, at - 1]), (row, at)


@pytest.mark.parametrize("name", list(CASES))
def test_cached_decoding_matches_full_recomputation(name):
    """Greedy generation, then three checks against the uncached model:

    - each generated token is the argmax of the uncached model run on prompt + the tokens so far;
    - the cached prefill's logits equal the uncached forward pass;
    - every single-token cached step's logits equal the uncached forward pass at that position."""
    config, shape = CASES[name]
    model, prompt = _model(config), _prompt(config, *shape)
    batch, plen = shape
    tokens = np.asarray(generate(model, prompt, max_new_tokens=NEW))
    assert tokens.shape == (batch, plen + NEW)
    np.testing.assert_array_equal(tokens[:, :plen], prompt)
    _assert_argmax_of_recomputation(model, tokens, [plen] * batch)

    full = _uncached(model, jnp.asarray(tokens), jnp.ones(tokens.shape, bool))
    logits, cache = _cached(model, prompt, init_cache(model, batch, plen + NEW))
    np.testing.assert_allclose(logits, full[:, :plen], atol=1e-5, rtol=0)
    for position in range(plen, plen + NEW):
        logits, cache = _cached(model, jnp.asarray(tokens[:, position : position + 1]), cache)
        np.testing.assert_allclose(logits[:, 0], full[:, position], atol=1e-5, rtol=0)
    assert int(cache.index) == plen + NEW and bool(cache.valid.all())


def test_prefill_equals_the_uncached_forward_with_capacity_drops_and_an_unrolled_stack():
    """envy-test as configured (capacity 2.0 in 2 groups) drops assignments; a cached prefill routes the
    same way. The cached model here is unrolled (scan_layers=False), the reference scanned."""
    scanned = _model(ENVY)
    unrolled = scanned.with_config(ENVY.replace(scan_layers=False))
    prompt = _prompt(ENVY, 2, 8, seed=4)
    full = eqx.filter_jit(lambda m, t: m(t))(scanned, prompt)
    assert float(full.aux.dropped.sum()) > 0
    cached = eqx.filter_jit(lambda m, t, c: m(t, cache=c))(unrolled, prompt, init_cache(unrolled, 2, 11))
    np.testing.assert_allclose(cached.logits, full.logits, atol=1e-5, rtol=0)
    np.testing.assert_allclose(cached.aux.dropped, full.aux.dropped)
    repeats = segments(ENVY.layers)[0].repeats
    for leaf in jax.tree.leaves(cached.cache.layers):  # one (keys, values) per block of the (dense, moe) unit
        assert leaf.shape == (repeats, 2, ENVY.attention.num_kv_heads, 11, ENVY.attention.head_dim)
    assert len(cached.cache.layers) == 1 and len(cached.cache.layers[0]) == 2
    assert int(cached.cache.index) == 8 and cached.cache.valid[:, :8].all() and not cached.cache.valid[:, 8:].any()


def test_dropless_gives_the_same_parameters_without_capacity():
    model = _model(ENVY)
    free = dropless(model)
    assert free.config.moe.router.capacity_factor is None and free.config.moe.router.num_groups == 1
    assert free.config.replace(moe=ENVY.moe) == ENVY
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(free), strict=True):
        assert a is b
    assert dropless(_model(QWEN)) is _model(QWEN)


def test_sampling_is_reproducible_and_a_tiny_nucleus_is_greedy():
    model = _model(QWEN)
    prompt = _prompt(QWEN, *PROMPT_SHAPE)
    sampled = functools.partial(generate, model, prompt, max_new_tokens=NEW, temperature=1.0)
    first = sampled(key=jax.random.key(1))
    np.testing.assert_array_equal(first, sampled(key=jax.random.key(1)))
    assert not np.array_equal(first, sampled(key=jax.random.key(2)))
    greedy = generate(model, prompt, max_new_tokens=NEW)
    np.testing.assert_array_equal(sampled(key=jax.random.key(3), top_p=1e-6), greedy)
    with pytest.raises(ValueError, match="needs key"):
        generate(model, prompt, max_new_tokens=NEW, temperature=0.5)


def test_sample_keeps_the_nucleus_and_follows_the_temperature():
    """Probabilities 0.5, 0.3, 0.15, 0.05: top_p=0.6 keeps the first two (0.5 < 0.6 <= 0.8)."""
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 4000))
    draws = np.asarray(sample(logits, jax.random.key(0), 1.0, 0.6))
    assert set(np.unique(draws)) == {0, 1}
    np.testing.assert_allclose(np.mean(draws == 0), 0.5 / 0.8, atol=0.03)
    hot = np.asarray(sample(logits, jax.random.key(0), 100.0, 1.0))  # nearly uniform
    np.testing.assert_allclose(np.bincount(hot, minlength=4) / hot.size, 0.25, atol=0.03)
    np.testing.assert_array_equal(sample(logits, None, 0.0), 0)


def test_eos_stops_a_row_and_fills_it_with_eos():
    model = _model(QWEN)
    prompt = _prompt(QWEN, *PROMPT_SHAPE)
    plen = prompt.shape[1]
    greedy = np.asarray(generate(model, prompt, max_new_tokens=NEW))
    eos = int(greedy[0, plen + 1])  # row 0 produces it as its second new token
    stopped = np.asarray(generate(model, prompt, max_new_tokens=NEW, eos_id=eos))
    for row in range(prompt.shape[0]):
        hits = np.flatnonzero(greedy[row, plen:] == eos)
        end = plen + (hits[0] + 1 if hits.size else NEW)
        np.testing.assert_array_equal(stopped[row, :end], greedy[row, :end])
        assert (stopped[row, end:] == eos).all()
    assert (stopped[0, plen + 1 :] == eos).all()


def test_left_padded_prompts_generate_like_unpadded_ones():
    """Row 0 is the shared prompt, row 1 a 4-token prompt left-padded by 2; RoPE positions of row 1
    start at 0 at its first real token, so its continuation is that of the 4-token prompt alone."""
    model = _model(QWEN)
    prompt = _prompt(QWEN, *PROMPT_SHAPE)
    short = _prompt(model.config, 1, 4, seed=11)[0]
    batch = prompt.at[1].set(jnp.pad(short, (2, 0)))
    mask = jnp.arange(PROMPT_SHAPE[1]) >= jnp.asarray([[0], [2]])
    padded = generate(model, batch, max_new_tokens=NEW, prompt_mask=mask)
    np.testing.assert_array_equal(padded[0], generate(model, prompt, max_new_tokens=NEW)[0])
    np.testing.assert_array_equal(padded[1, 2:6], short)
    unpadded = jnp.stack([padded[0], jnp.pad(padded[1, 2:], (0, 2))])  # row 1: 4 + NEW tokens, then filler
    _assert_argmax_of_recomputation(model, unpadded, [PROMPT_SHAPE[1], 4], lengths=[unpadded.shape[1], 4 + NEW])
    with pytest.raises(ValueError, match="left padding"):
        generate(model, batch, max_new_tokens=NEW, prompt_mask=mask[:, ::-1])


# --- the command line -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    from eqmoe.checkpoints import hf

    folder = tmp_path_factory.mktemp("generate") / "hf"
    hf.save(_model(QWEN), folder)
    words = ["<unk>", "</s>"] + [str(i) for i in range(QWEN.vocab_size - 2)]
    tokenizer = Tokenizer(WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    return folder


def test_cli_generates_text(hf_folder, capsys):
    from experiments.generate import Args, main

    assert main(Args(prompt="3 4 5", hf=hf_folder, max_new_tokens=4)) == 0
    words = capsys.readouterr().out.split()
    # Word "n" is id n + 2 (after <unk> and </s>); eos (id 1, from generation_config.json) ends the text.
    expected = np.asarray(generate(_model(QWEN), jnp.asarray([[5, 6, 7]]), max_new_tokens=4, eos_id=1))[0]
    expected = expected[: 4 + list(expected[3:]).index(1)] if 1 in expected[3:] else expected
    assert words == [str(i - 2) if i > 1 else "</s>" for i in expected]
    assert main(Args(prompt="3 4 5", hf=hf_folder, max_new_tokens=4, temperature=0.8, top_p=0.9, seed=1)) == 0


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(hf=None), "give one of --hf DIR"),
        (dict(hf="missing"), "model folder not found"),
        (dict(tokenizer="nope.json"), "tokenizer not found"),
        (dict(top_p=0.0), "--top-p"),
        (dict(prompt="   "), "empty"),
    ],
)
def test_cli_errors_are_one_line_and_exit_2(hf_folder, tmp_path, capsys, changes, message):
    from experiments.generate import Args, main

    changes = {k: (tmp_path / v if isinstance(v, str) and k != "prompt" else v) for k, v in changes.items()}
    assert main(Args(**{"prompt": "1 2", "hf": hf_folder, **changes})) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
