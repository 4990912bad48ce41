"""Qwen3-MoE parity with Hugging Face transformers (the numerical reference), fp32 on CPU."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqmoe.checkpoints import hf
from eqmoe.losses import objective
from tests.conftest import load_reference, save_tiny_hf

torch = pytest.importorskip("torch")

CASES = {
    "gqa-renormalized": {},
    "raw-topk-weights": dict(norm_topk_prob=False, num_key_value_heads=1),
    "sparse-step-2": dict(decoder_sparse_step=2),
    "mlp-only-layers": dict(mlp_only_layers=[0, 2], num_hidden_layers=5),
    "tied-embeddings": dict(tie_word_embeddings=True, num_experts_per_tok=3, num_experts=6),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, case):
    save_tiny_hf(tmp_path, seed=len(case), **CASES[case])
    reference = load_reference(tmp_path)
    model = hf.load(tmp_path)
    ids = torch.randint(0, reference.config.vocab_size, (4, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits.numpy()
    logits = np.asarray(model(jnp.asarray(ids.numpy())).logits)
    assert logits.shape == expected.shape
    assert np.abs(logits - expected).max() <= 1e-4


def test_layer_layout_follows_hf_rule(tmp_path):
    save_tiny_hf(tmp_path, mlp_only_layers=[0, 2], num_hidden_layers=5)
    model = hf.load(tmp_path)
    assert model.config.ffn_kinds() == ("dense", "moe", "dense", "moe", "moe")


def _padded_batch(vocab: int):
    """Right-padded rows of different lengths, as a tokenizer with padding would give."""
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, vocab, (3, 11), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, 7:] = 0
    mask[2, 4:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def _our_loss(model, ids, mask):
    tokens, token_mask = jnp.asarray(ids.numpy()), jnp.asarray(mask.numpy().astype(bool))

    def loss_fn(model):
        output = model(tokens, token_mask=token_mask)
        return objective(output, tokens, token_mask, model.config)

    return loss_fn


def test_loss_and_aux_loss_match_transformers(tmp_path):
    save_tiny_hf(tmp_path, seed=3, decoder_sparse_step=2, router_aux_loss_coef=0.02)
    reference = load_reference(tmp_path)
    model = hf.load(tmp_path)
    ids, mask, labels = _padded_batch(reference.config.vocab_size)
    with torch.no_grad():
        out = reference(ids, attention_mask=mask, labels=labels, output_router_logits=True)
    loss, terms = _our_loss(model, ids, mask)(model)
    np.testing.assert_allclose(float(terms["load_balance"]), out.aux_loss.item(), rtol=1e-5)
    np.testing.assert_allclose(float(loss), out.loss.item(), rtol=1e-5)
    assert float(terms["cross_entropy"]) < float(loss)


def _reference_gradients(reference) -> dict[str, np.ndarray]:
    """torch gradients under checkpoint names (transformers keeps experts fused in memory)."""
    grads = {}
    for name, param in reference.named_parameters():
        grad = param.grad.numpy()
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, width = name.removesuffix("gate_up_proj"), grad.shape[1] // 2
            for j in range(grad.shape[0]):
                grads[f"{prefix}{j}.gate_proj.weight"] = grad[j, :width]
                grads[f"{prefix}{j}.up_proj.weight"] = grad[j, width:]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for j in range(grad.shape[0]):
                grads[f"{prefix}{j}.down_proj.weight"] = grad[j]
        else:
            grads[name] = grad
    return grads


# dense is the reference the other backends are held to (tests/test_stack_and_dispatch.py): with -m slow
@pytest.mark.parametrize("backend", ["auto", pytest.param("dense", marks=pytest.mark.slow), "ragged_dot"])
def test_gradients_match_torch(tmp_path, backend):
    save_tiny_hf(tmp_path, seed=4, mlp_only_layers=[1], router_aux_loss_coef=0.05)
    reference = load_reference(tmp_path)
    model = hf.load(tmp_path)
    model = model.with_config(model.config.replace(moe=dataclasses.replace(model.config.moe, dispatch=backend)))
    ids, mask, labels = _padded_batch(reference.config.vocab_size)
    reference(ids, attention_mask=mask, labels=labels, output_router_logits=True).loss.backward()
    expected = _reference_gradients(reference)

    grads, _ = jax.grad(_our_loss(model, ids, mask), has_aux=True)(model)
    ours = hf.state_dict(grads)
    assert set(ours) == set(expected)
    for key, value in ours.items():
        np.testing.assert_allclose(value, expected[key], atol=1e-4, rtol=0, err_msg=key)
    assert max(np.abs(v).max() for k, v in ours.items() if ".experts." in k) > 1e-3


def test_bfloat16_logits_close_to_transformers_bfloat16(tmp_path):
    """bfloat16 on both sides: not bit-exact (XLA keeps fused intermediates in float32 and top-k ties
    break differently from torch), so the bar is the logit checker's: KL per position and top-1."""
    save_tiny_hf(tmp_path, seed=7)
    reference = pytest.importorskip("transformers").Qwen3MoeForCausalLM.from_pretrained(
        tmp_path, dtype=torch.bfloat16, attn_implementation="eager", experts_implementation="eager"
    )
    model = hf.load(tmp_path, dtype="bfloat16")
    ids = torch.randint(0, reference.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference.eval()(ids).logits.float().numpy()
    logits = np.asarray(eqx.filter_jit(model)(jnp.asarray(ids.numpy())).logits.astype(jnp.float32))
    log_p, log_q = jax.nn.log_softmax(expected), jax.nn.log_softmax(logits)
    kl = np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)
    assert kl.max() < 1e-3
    assert np.mean(expected.argmax(-1) == logits.argmax(-1)) >= 0.9
