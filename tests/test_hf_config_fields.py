"""The Qwen3-MoE ``config.json`` as transformers reads it: every field transformers writes loads; a field it reads
at a value eqmoe does not compute fails ``hf.read_config`` with one line naming the field and the file; a field it
does not read is accepted and listed on one "ignored" line."""

import json
from pathlib import Path

import pytest

from eqmoe.checkpoints import hf
from tests.conftest import TINY_HF

transformers = pytest.importorskip("transformers")


def _write(folder: Path, config: dict) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _full_config() -> dict:
    """Every field transformers' Qwen3MoeConfig serialises, defaults included (``use_diff=False``)."""
    return json.loads(transformers.Qwen3MoeConfig(**TINY_HF).to_json_string(use_diff=False))


def _refusal(tmp_path: Path, config: dict) -> str:
    folder = _write(tmp_path / "model", config)
    with pytest.raises(ValueError) as excinfo:
        hf.read_config(folder)
    message = str(excinfo.value)
    assert "\n" not in message
    assert message.count(str(folder / "config.json")) == 1, message
    return message


def test_every_field_transformers_writes_loads(tmp_path):
    full = _full_config()
    config = hf.read_config(_write(tmp_path / "full", full))
    assert config.attention.rope_scaling is None and config.attention.head_dim == TINY_HF["head_dim"]
    transformers.Qwen3MoeConfig(**TINY_HF).save_pretrained(tmp_path / "saved")  # the diff form save_pretrained writes
    assert hf.read_config(tmp_path / "saved") == config


def test_older_field_names_load(tmp_path):
    config = {k: v for k, v in _full_config().items() if k not in ("rope_parameters", "dtype", "num_local_experts")}
    config.update(
        rope_theta=10000.0,
        rope_scaling=None,
        torch_dtype="bfloat16",
        num_experts=TINY_HF["num_experts"],
        max_window_layers=4,
        _name_or_path="Qwen/Qwen3-30B-A3B",
        architectures=["Qwen3MoeForCausalLM"],
    )
    assert hf.read_config(_write(tmp_path / "old", config)) == hf.read_config(_write(tmp_path / "new", _full_config()))


def test_a_field_transformers_ignores_is_accepted_and_listed(tmp_path, capsys):
    folder = _write(tmp_path / "model", {**_full_config(), "foo": 1, "qkv_bias": False})
    assert hf.read_config(folder) == hf.read_config(_write(tmp_path / "plain", _full_config()))
    lines = [line for line in capsys.readouterr().err.splitlines() if "ignored" in line]
    assert (
        lines[0] == f"{folder / 'config.json'}: ignored (transformers does not read them for qwen3_moe): foo, qkv_bias"
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("use_sliding_window", True),
        ("attention_bias", True),
        ("attention_dropout", 0.1),
        ("hidden_act", "gelu"),
        ("partial_rotary_factor", 0.5),
        ("is_encoder_decoder", True),
    ],
)
def test_known_field_with_an_unsupported_value_is_refused(tmp_path, field, value):
    message = _refusal(tmp_path, {**_full_config(), field: value})
    assert f"{field}={json.dumps(value)}" in message


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope", "proportional"])
def test_rope_type_eqmoe_does_not_compute_is_refused(tmp_path, rope_type):
    rope = {"rope_type": rope_type, "rope_theta": 10000.0, "factor": 2.0}
    message = _refusal(tmp_path, {**_full_config(), "rope_parameters": rope})
    assert f"rope_type {rope_type!r}" in message and "rope_parameters" in message


@pytest.mark.parametrize(
    ("rope", "named"),
    [
        ({"rope_type": "linear"}, "'factor'"),
        ({"rope_type": "linear", "factor": "2"}, "rope_parameters.factor"),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}, "'high_freq_factor'"),
        ({"rope_type": "yarn", "factor": 4.0, "truncate": None}, "rope_parameters.truncate"),
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0},
            "original_max_position_embeddings",
        ),
        ({"rope_type": "default", "partial_rotary_factor": 0.5}, "rope_parameters.partial_rotary_factor"),
    ],
)
def test_bad_rope_parameters_name_the_key(tmp_path, rope, named):
    message = _refusal(tmp_path, {**_full_config(), "rope_parameters": {**rope, "rope_theta": 10000.0}})
    assert named in message


def test_bad_rope_scaling_names_the_legacy_field(tmp_path):
    config = {k: v for k, v in _full_config().items() if k != "rope_parameters"}
    message = _refusal(tmp_path, {**config, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    assert "rope_scaling" in message and "rope_type 'dynamic'" in message


@pytest.mark.parametrize(
    ("rope", "ignored"),
    [
        ({"rope_type": "linear", "factor": 2.0, "beta_fast": 8.0}, "rope_parameters.beta_fast"),
        ({"rope_type": "default", "factor": 2.0}, "rope_parameters.factor"),
    ],
)
def test_a_rope_key_its_type_does_not_read_is_ignored_and_listed(tmp_path, capsys, rope, ignored):
    """transformers' RoPE initialisation reads only its type's keys and ignores (warns about) the rest."""
    config = hf.read_config(
        _write(tmp_path / "model", {**_full_config(), "rope_parameters": {**rope, "rope_theta": 1e4}})
    )
    assert config.attention.rope_theta == 1e4
    assert ignored in capsys.readouterr().err
