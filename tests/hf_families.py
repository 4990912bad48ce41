"""What the Hugging Face family tests (test_mixtral.py, test_olmoe.py, test_qwen2_moe.py, test_glm4_moe.py) share:
tiny random transformers models saved to a folder and read back as the eager reference, the batches, and the
checks every family passes the same way against transformers (fp32 on CPU): logits, losses, gradients, the
bit-exact HF -> eqmoe -> HF round trip, the Hub's tensor names, the config allow-list's refusals and the
published parameter counts. A family's own configs and checks stay in its file."""

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from eqmoe.checkpoints import hf
from eqmoe.models import family as families
from experiments.param_report import Args, main
from tests.test_qwen3_parity import _our_loss, _reference_gradients

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SEQ = 300


def perturb_norms(name: str, tensor) -> None:
    """Norm weights moved off exactly 1, transformers' initial value (at which a misplaced norm goes unseen)."""
    if name.endswith("norm.weight"):
        tensor.add_(0.1 * torch.randn_like(tensor))


def perturb_router_and_norms(name: str, tensor) -> None:
    """For DeepSeek-style routers: norms and biases off their initial values, the router spread out (transformers
    starts it near 0, every sigmoid score ~0.5) and ``e_score_correction_bias`` nonzero, so that every part matters
    and the correction bias changes which experts are chosen."""
    if name.endswith(("norm.weight", ".bias")):
        tensor.add_(0.1 * torch.randn_like(tensor))
    elif name.endswith("mlp.gate.weight"):
        tensor.normal_(0.0, 0.3)
    elif name.endswith("e_score_correction_bias"):
        tensor.normal_(0.0, 0.2)


@dataclasses.dataclass(frozen=True)
class Family:
    """A transformers MoE family under test: ``name`` is eqmoe's name for it, ``model_class`` transformers'
    causal LM, ``tiny`` the config fields its tests start from, and ``perturb`` moves one named parameter or
    buffer of a fresh random model off the value transformers initialises it at, so that every part matters."""

    name: str
    model_class: type
    tiny: dict
    perturb: Callable[[str, object], None] = perturb_norms

    def hf_config(self, **overrides):
        """transformers' config of ``tiny`` with ``overrides``; a None drops the field (transformers derives it)."""
        fields = {**self.tiny, **overrides}
        return self.model_class.config_class(**{key: value for key, value in fields.items() if value is not None})

    def save_tiny(self, folder: Path, seed: int = 0, **overrides) -> None:
        """A random model of ``hf_config(**overrides)`` saved to ``folder``, every parameter then every buffer
        passed through ``perturb``."""
        config = self.hf_config(**overrides)
        torch.manual_seed(seed)
        model = self.model_class(config).eval()
        with torch.no_grad():
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
                self.perturb(name, tensor)
        model.save_pretrained(folder)

    def reference(self, folder: Path):
        """The saved model read back by transformers with the eager (reference) attention and experts."""
        return self.model_class.from_pretrained(
            folder, attn_implementation="eager", experts_implementation="eager"
        ).eval()

    def full_config(self, **overrides) -> dict:
        """Every field transformers' config serialises, defaults included (``use_diff=False``)."""
        return json.loads(self.hf_config(**overrides).to_json_string(use_diff=False))

    def on_meta(self, config):
        """transformers' model of ``config`` on the meta device: the published sizes' shapes without memory."""
        with torch.device("meta"):
            return self.model_class(config)


def saved_fixture(family: Family, cases: dict[str, dict]):
    """The ``saved`` fixture: a folder holding ``family``'s tiny model for each of ``cases``, seeded by the case
    name's length."""

    @pytest.fixture(params=list(cases), name="saved")
    def saved(request, tmp_path):
        family.save_tiny(tmp_path, seed=len(request.param), **cases[request.param])
        return tmp_path

    return saved


def padded_batch(vocab: int, seq: int = SEQ):
    """Right-padded rows of different lengths, as a tokenizer with padding would give: ids, mask, labels."""
    ids = torch.randint(0, vocab, (3, seq), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, seq - 70 :] = 0
    mask[2, 40:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask, ids.masked_fill(mask == 0, -100)


def assert_logits_match(reference, model) -> None:
    """eqmoe's logits within 1e-4 of transformers' on two random rows of ``SEQ`` tokens."""
    ids = torch.randint(0, reference.config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits.numpy()
    logits = np.asarray(eqx.filter_jit(lambda model, ids: model(ids).logits)(model, jnp.asarray(ids.numpy())))
    assert logits.shape == expected.shape, (logits.shape, expected.shape)
    error = np.abs(logits - expected).max()
    assert error <= 1e-4, error


def losses(reference, model, **forward):
    """transformers' output (``forward`` passed to it) and eqmoe's loss and its terms on the padded batch."""
    ids, mask, labels = padded_batch(reference.config.vocab_size)
    with torch.no_grad():
        out = reference(ids, attention_mask=mask, labels=labels, **forward)
    loss, terms = eqx.filter_jit(_our_loss(model, ids, mask))(model)
    return out, loss, terms


def assert_loss_and_aux_loss_match(reference, model, weight: float):
    """The aux loss, the cross-entropy and their sum (the aux loss times ``weight``, the config's
    router_aux_loss_coef) equal transformers'; its ``load_balancing_loss_func`` is eqmoe's ``hf_pooled``.
    Returns transformers' output."""
    loss_config = model.config.loss
    assert loss_config.load_balance == "hf_pooled" and loss_config.load_balance_weight == weight, loss_config
    out, loss, terms = losses(reference, model, output_router_logits=True)
    np.testing.assert_allclose(float(terms["load_balance"]), out.aux_loss.item(), rtol=1e-5)
    np.testing.assert_allclose(float(loss), out.loss.item(), rtol=1e-5)
    hf_cross_entropy = out.loss.item() - weight * out.aux_loss.item()
    np.testing.assert_allclose(float(terms["cross_entropy"]), hf_cross_entropy, rtol=1e-5)
    return out


def gradients(reference, model, **forward) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """eqmoe's and torch's gradients of the loss on a 64-token padded batch (``forward`` passed to transformers),
    under checkpoint names; a tied lm_head is left out of torch's (the embedding's tensor: its gradient is the
    sum)."""
    ids, mask, labels = padded_batch(reference.config.vocab_size, seq=64)
    reference(ids, attention_mask=mask, labels=labels, **forward).loss.backward()
    expected = _reference_gradients(reference)
    if reference.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    grads, _ = eqx.filter_jit(jax.grad(_our_loss(model, ids, mask), has_aux=True))(model)
    return hf.state_dict(grads), expected


def assert_gradients_match(ours: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    """The same tensors, each within 1e-4 of torch's."""
    assert set(ours) == set(expected), set(ours) ^ set(expected)
    for key, value in ours.items():
        np.testing.assert_allclose(value, expected[key], atol=1e-4, rtol=0, err_msg=key)


def largest(tensors: dict[str, np.ndarray], part: str) -> float:
    """The largest magnitude among the tensors whose name holds ``part``: a gradient check is only as strong as
    the gradients it compares are large."""
    return max(np.abs(value).max() for key, value in tensors.items() if part in key)


def transformers_config(family: Family, folder: Path, derive_head_dim: bool = False) -> dict:
    """transformers' config read from ``folder`` as a dict; with ``derive_head_dim`` an unset head_dim is filled
    in as transformers derives it (eqmoe writes the head_dim it uses)."""
    config = family.model_class.config_class.from_pretrained(folder).to_dict()
    config.pop("_name_or_path", None)
    if derive_head_dim:
        config["head_dim"] = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config


def assert_round_trip_bit_exact(family: Family, saved: Path, back: Path, derive_head_dim: bool = False) -> None:
    """HF -> eqmoe -> HF writes every tensor back bit for bit, and a config.json that reads back as the same
    transformers config and the same eqmoe config."""
    hf.save(hf.load(saved), back)
    original, written = load_file(saved / "model.safetensors"), load_file(back / "model.safetensors")
    assert set(original) == set(written), set(original) ^ set(written)
    for key, value in original.items():
        np.testing.assert_array_equal(written[key], value, err_msg=key)
    written_config, original_config = (transformers_config(family, f, derive_head_dim) for f in (back, saved))
    assert written_config == original_config, {
        key: (written_config.get(key), original_config.get(key))
        for key in written_config.keys() | original_config.keys()
        if written_config.get(key) != original_config.get(key)
    }
    assert hf.read_config(back) == hf.read_config(saved)


def named_keys(family: Family, folder: Path) -> set[str]:
    """The tensor names eqmoe's name map gives for the config in ``folder``."""
    return {name.key for name in families.get(family.name).checkpoint_names(hf.read_config(folder))}


def write_config(folder: Path, config: dict) -> Path:
    """``folder`` holding ``config`` as its config.json."""
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def assert_refused(folder: Path, config: dict, field: str) -> None:
    """read_config refuses ``config`` written to ``folder`` in one line naming ``field`` and the file once."""
    write_config(folder, config)
    with pytest.raises(ValueError) as excinfo:
        hf.read_config(folder)
    message = str(excinfo.value)
    assert "\n" not in message and message.count(str(folder / "config.json")) == 1, message
    assert field in message, message


def assert_ignored(folder: Path, config: dict, key: str, capsys) -> None:
    """read_config accepts ``config`` written to ``folder``, reading it as without ``key`` (a key transformers does
    not read for the family), and lists ``key`` on one "ignored" line naming the file."""
    plain = hf.read_config(write_config(folder / "plain", {k: v for k, v in config.items() if k != key}))
    capsys.readouterr()
    assert hf.read_config(write_config(folder / "with", config)) == plain
    lines = [line for line in capsys.readouterr().err.splitlines() if "ignored" in line]
    assert len(lines) == 1 and str(folder / "with" / "config.json") in lines[0] and key in lines[0], lines


def param_report(preset: str, capsys) -> dict:
    """experiments/param_report.py's JSON report of ``preset``."""
    assert main(Args(preset=preset, json=True)) == 0
    return json.loads(capsys.readouterr().out)


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())
