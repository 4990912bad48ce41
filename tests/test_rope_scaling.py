"""RoPE scaling (``linear``, ``yarn``, ``llama3``) as Hugging Face configs carry it: the frequencies and attention
factor equal transformers' ``ROPE_INIT_FUNCTIONS``, whole models match transformers past the original context,
and the scaling survives HF -> eqmoe -> HF and eqmoe's own config metadata."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from eqmoe.checkpoints import hf
from eqmoe.config import AttentionConfig, RopeScaling
from eqmoe.config_io import apply_overrides, architecture_differences, config_from_dict, config_to_dict
from eqmoe.models.qwen3_moe import config_from_hf
from eqmoe.nn.rope import rope_frequencies, rope_tables
from tests.conftest import TINY_HF, load_reference, save_tiny_hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
rope_utils = pytest.importorskip("transformers.modeling_rope_utils")

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
PARAMETERS = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": YARN,
    "yarn-mscale": {
        **YARN,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
        "beta_fast": 16.0,
        "beta_slow": 2,
        "truncate": False,
    },
    "yarn-attention-factor": {**YARN, "attention_factor": 0.8},
    "yarn-factor-from-lengths": {**YARN, "factor": None},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


def _hf_config(parameters: dict, head_dim: int, theta: float) -> dict:
    """A Qwen3-MoE config.json dictionary with ``parameters`` as its RoPE and a 256-token context."""
    rope = {**parameters, "rope_theta": theta}
    return {
        **TINY_HF,
        "model_type": "qwen3_moe",
        "head_dim": head_dim,
        "max_position_embeddings": 256,
        "rope_parameters": rope,
    }


@pytest.mark.parametrize("head_dim", [16, 128])
@pytest.mark.parametrize("theta", [1e4, 1e6])
@pytest.mark.parametrize("case", list(PARAMETERS))
def test_frequencies_and_attention_factor_match_transformers(case, theta, head_dim):
    config = _hf_config(PARAMETERS[case], head_dim, theta)
    attention = config_from_hf(json.loads(json.dumps(config))).attention
    ours, our_factor = rope_frequencies(attention.head_dim, attention.rope_theta, attention.rope_scaling)
    reference_config = transformers.Qwen3MoeConfig(**{k: v for k, v in config.items() if k != "model_type"})
    if case == "default":
        inv_freq, factor = (
            transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeRotaryEmbedding.compute_default_rope_parameters(
                reference_config
            )
        )
    else:
        inv_freq, factor = rope_utils.ROPE_INIT_FUNCTIONS[PARAMETERS[case]["rope_type"]](reference_config, "cpu")
    np.testing.assert_allclose(ours, inv_freq.numpy(), rtol=1e-6, atol=0)
    assert our_factor == pytest.approx(factor, rel=1e-6)
    assert ours.dtype == np.float32


def test_attention_factor_multiplies_cos_and_sin():
    scaling = RopeScaling("yarn", 4.0, 64, attention_factor=0.5)
    positions = jnp.arange(100)[None]
    cos, sin = rope_tables(positions, 16, 1e4, jnp.float32, scaling=scaling)
    inv_freq, _ = rope_frequencies(16, 1e4, scaling)
    angles = np.arange(100)[:, None] * inv_freq
    np.testing.assert_allclose(cos[0, :, :8], 0.5 * np.cos(angles), atol=1e-6)
    np.testing.assert_allclose(sin[0, :, 8:], 0.5 * np.sin(angles), atol=1e-6)
    plain, _ = rope_tables(positions, 16, 1e4, jnp.float32)
    assert np.abs(np.asarray(plain) - np.asarray(cos) / 0.5).max() > 0.1  # the scaled angles differ


MODELS = {
    "yarn": YARN,
    "linear": PARAMETERS["linear"],
    "llama3": PARAMETERS["llama3"],
}


@pytest.mark.parametrize("case", list(MODELS))
def test_logits_match_transformers_beyond_the_original_context(tmp_path, case):
    rope = {**MODELS[case], "rope_theta": 10000.0}
    save_tiny_hf(tmp_path, seed=4, max_position_embeddings=256, rope_parameters=rope)
    reference = load_reference(tmp_path)
    model = hf.load(tmp_path)
    assert model.config.attention.rope_scaling.rope_type == case
    ids = torch.randint(0, reference.config.vocab_size, (2, 200), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = reference(ids).logits.numpy()
    logits = np.asarray(model(jnp.asarray(ids.numpy())).logits)
    assert np.abs(logits - expected).max() <= 1e-4


def test_yarn_loss_aux_loss_and_gradients_match_transformers(tmp_path):
    """Qwen3's documented long-context setting: yarn, 200-token padded rows past the 64-token original context."""
    import jax

    from tests.test_qwen3_parity import _our_loss, _reference_gradients

    rope = {**PARAMETERS["yarn-mscale"], "rope_theta": 10000.0}
    save_tiny_hf(tmp_path, seed=6, max_position_embeddings=256, rope_parameters=rope, router_aux_loss_coef=0.05)
    reference, model = load_reference(tmp_path), hf.load(tmp_path)
    ids = torch.randint(0, reference.config.vocab_size, (2, 200), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, 150:] = 0
    out = reference(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), output_router_logits=True)
    out.loss.backward()
    (loss, terms), grads = jax.value_and_grad(_our_loss(model, ids, mask), has_aux=True)(model)
    np.testing.assert_allclose(float(loss), out.loss.item(), rtol=1e-5)
    np.testing.assert_allclose(float(terms["load_balance"]), out.aux_loss.item(), rtol=1e-5)
    expected, ours = _reference_gradients(reference), hf.state_dict(grads)
    assert set(ours) == set(expected)
    for key, value in ours.items():
        np.testing.assert_allclose(value, expected[key], atol=1e-4, rtol=0, err_msg=key)


@pytest.mark.parametrize("case", ["yarn-mscale", "llama3"])
def test_hf_to_eqmoe_to_hf_keeps_the_rope_fields(tmp_path, case):
    save_tiny_hf(tmp_path / "hf", max_position_embeddings=256, rope_parameters={**PARAMETERS[case], "rope_theta": 1e6})
    hf.save(hf.load(tmp_path / "hf"), tmp_path / "back")
    original, back = (json.loads((tmp_path / name / "config.json").read_text()) for name in ("hf", "back"))
    for field in ("rope_parameters", "max_position_embeddings"):
        assert back[field] == original[field], field
    assert hf.read_config(tmp_path / "back") == hf.read_config(tmp_path / "hf")


def test_legacy_rope_scaling_and_rope_theta_read_like_rope_parameters():
    modern = _hf_config(PARAMETERS["yarn"], 16, 1e6)
    legacy = {k: v for k, v in modern.items() if k != "rope_parameters"}
    legacy.update(rope_theta=1e6, rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 64})
    assert config_from_hf(legacy) == config_from_hf(modern)


def test_missing_original_length_is_max_position_embeddings_as_in_transformers():
    config = _hf_config({"rope_type": "yarn", "factor": 4.0}, 16, 1e4)
    assert config_from_hf(config).attention.rope_scaling.original_max_position_embeddings == 256


def test_checkpoint_metadata_and_overrides_carry_the_scaling():
    config = config_from_hf(_hf_config(PARAMETERS["yarn-mscale"], 16, 1e4))
    values = json.loads(json.dumps(config_to_dict(config)))
    assert config_from_dict(values) == config
    changed = apply_overrides(config, {"attention.rope_scaling.factor": 8})
    assert changed.attention.rope_scaling.factor == 8.0
    assert architecture_differences(config, changed) == [("attention.rope_scaling.factor", 4.0, 8.0)]
    assert apply_overrides(config, {"attention.rope_scaling": None}).attention.rope_scaling is None
    with pytest.raises(ValueError, match=r"RopeScaling\.factor=-1\.0"):
        apply_overrides(config, {"attention.rope_scaling.factor": -1})


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        (dict(rope_type="linear", factor=0.0), "factor=0.0"),
        (dict(rope_type="linear", factor=2.0, beta_fast=8.0), "beta_fast=8.0"),
        (dict(rope_type="linear", factor=2.0, original_max_position_embeddings=64), "original_max_position_embeddings"),
        (dict(rope_type="yarn", factor=2.0), "original_max_position_embeddings=None"),
        (dict(rope_type="yarn", factor=None, original_max_position_embeddings=64), "factor=None"),
        (dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=64, low_freq_factor=1.0), "low_freq"),
        (dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=64, attention_factor=0.0), "attention"),
        (dict(rope_type="llama3", factor=8.0, original_max_position_embeddings=64, low_freq_factor=1.0), "high_freq"),
        (
            dict(
                rope_type="llama3",
                factor=8.0,
                original_max_position_embeddings=64,
                low_freq_factor=2.0,
                high_freq_factor=2.0,
            ),
            "high_freq_factor=2.0",
        ),
    ],
)
def test_invalid_scaling_names_the_field(changes, field):
    with pytest.raises(ValueError, match=r"RopeScaling\." + field.replace(".", r"\.")):
        AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=16, rope_scaling=RopeScaling(**changes))
