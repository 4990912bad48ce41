"""Bad Hugging Face checkpoints give a clear error naming the problem; good ones (single, sharded, bf16) load.

Every checkpoint here is written with ``safetensors.numpy`` (no torch): a two-layer Qwen3-MoE whose first
layer is dense (``mlp_only_layers=[0]``) and second is MoE with four experts.
"""

import json
import re
import struct
from pathlib import Path

import equinox as eqx
import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from eqmoe.checkpoints import hf
from eqmoe.model import Transformer
from eqmoe.models.qwen3_moe import checkpoint_names

HF_CONFIG = {
    "model_type": "qwen3_moe",
    "vocab_size": 61,
    "hidden_size": 16,
    "intermediate_size": 24,
    "moe_intermediate_size": 8,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "decoder_sparse_step": 1,
    "mlp_only_layers": [0],
    "tie_word_embeddings": False,
}

EXPERT_KEY = "model.layers.1.mlp.experts.2.up_proj.weight"
DENSE_KEY = "model.layers.0.mlp.gate_proj.weight"


def _write_config(folder: Path, config: dict) -> None:
    (folder / "config.json").write_text(json.dumps(config))


def _expected_tensors(folder: Path) -> dict[str, tuple[int, ...]]:
    """Every checkpoint key of the config in ``folder`` and its torch-layout shape."""
    config = hf.read_config(folder)
    abstract = eqx.filter_eval_shape(Transformer, config, key=jax.random.key(0))
    leaves = {hf._leaf_path(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(abstract)}
    return {name.key: name.checkpoint_shape(leaves[name.path].shape) for name in checkpoint_names(config)}


def _random_tensors(shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {key: rng.standard_normal(shape).astype(np.float32) for key, shape in shapes.items()}


def _message(excinfo) -> str:
    return str(excinfo.value)


@pytest.fixture
def shapes(tmp_path_factory) -> dict[str, tuple[int, ...]]:
    folder = tmp_path_factory.mktemp("shapes")
    _write_config(folder, HF_CONFIG)
    return _expected_tensors(folder)


@pytest.fixture
def tensors(shapes) -> dict[str, np.ndarray]:
    return _random_tensors(shapes)


@pytest.fixture
def folder(tmp_path, tensors) -> Path:
    """A valid single-file checkpoint folder."""
    path = tmp_path / "ckpt"
    path.mkdir()
    _write_config(path, HF_CONFIG)
    save_file(tensors, str(path / hf.SINGLE_FILE))
    return path


def _rewrite(folder: Path, tensors: dict[str, np.ndarray]) -> None:
    save_file(tensors, str(folder / hf.SINGLE_FILE))


def _leaves(model) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree.leaves(eqx.filter(model, eqx.is_array))]


# --- a valid checkpoint ----------------------------------------------------------------------------


def test_fixture_covers_dense_and_moe_layers(shapes):
    assert DENSE_KEY in shapes and EXPERT_KEY in shapes
    assert shapes["model.embed_tokens.weight"] == (61, 16)
    assert shapes["lm_head.weight"] == (61, 16)
    assert shapes[DENSE_KEY] == (24, 16)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (16, 24)
    assert shapes["model.layers.1.mlp.gate.weight"] == (4, 16)
    assert shapes[EXPERT_KEY] == (8, 16)
    assert shapes["model.layers.1.mlp.experts.0.down_proj.weight"] == (16, 8)
    assert shapes["model.layers.1.self_attn.q_proj.weight"] == (16, 16)
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (8, 16)
    assert shapes["model.layers.1.self_attn.o_proj.weight"] == (16, 16)
    assert shapes["model.layers.1.self_attn.q_norm.weight"] == (4,)
    assert not any(key.startswith("model.layers.0.mlp.experts") for key in shapes)


def test_valid_folder_loads(folder, tensors):
    model = hf.load(folder)
    assert isinstance(model, Transformer)
    assert model.config.ffn_kinds() == ("dense", "moe")
    np.testing.assert_array_equal(np.asarray(model.embed), tensors["model.embed_tokens.weight"])
    np.testing.assert_array_equal(np.asarray(model.lm_head), tensors["lm_head.weight"].T)
    np.testing.assert_array_equal(np.asarray(model.final_norm.weight), tensors["model.norm.weight"])
    assert all(leaf.dtype == np.float32 for leaf in _leaves(model))


# --- tensors that do not match the config -----------------------------------------------------------


def test_missing_tensor(folder, tensors):
    del tensors[EXPERT_KEY]
    _rewrite(folder, tensors)
    with pytest.raises(ValueError) as excinfo:
        hf.load(folder)
    message = _message(excinfo)
    assert "missing" in message
    assert EXPERT_KEY in message
    assert "(8, 16)" in message  # the shape it should have had


def test_unexpected_tensor(folder, tensors):
    tensors["model.layers.7.mlp.surprise.weight"] = np.zeros((3, 3), np.float32)
    _rewrite(folder, tensors)
    with pytest.raises(ValueError) as excinfo:
        hf.load(folder)
    message = _message(excinfo)
    assert "unexpected" in message
    assert "model.layers.7.mlp.surprise.weight" in message


def test_wrong_shape(folder, tensors):
    tensors[DENSE_KEY] = np.zeros((16, 24), np.float32)  # transposed: [in, out] instead of [out, in]
    _rewrite(folder, tensors)
    with pytest.raises(ValueError) as excinfo:
        hf.load(folder)
    message = _message(excinfo)
    assert DENSE_KEY in message
    assert "expected (24, 16)" in message
    assert "found (16, 24)" in message


def test_several_problems_are_listed_in_one_error(folder, tensors):
    del tensors[EXPERT_KEY]
    del tensors["model.norm.weight"]
    tensors["model.layers.1.self_attn.k_proj.weight"] = np.zeros((16, 16), np.float32)
    tensors["extra.weight"] = np.zeros((2,), np.float32)
    _rewrite(folder, tensors)
    with pytest.raises(ValueError) as excinfo:
        hf.load(folder)
    message = _message(excinfo)
    assert str(folder) in message
    for needle in (
        f"missing tensor {EXPERT_KEY}",
        "missing tensor model.norm.weight",
        "wrong shape for model.layers.1.self_attn.k_proj.weight: expected (8, 16), found (16, 16)",
        "unexpected tensor extra.weight",
    ):
        assert needle in message
    assert len(re.findall(r"^\s+(missing|wrong shape|unexpected)", message, flags=re.MULTILINE)) == 4


# --- broken files --------------------------------------------------------------------------------------


@pytest.mark.parametrize("cut", ["half", "five_bytes", "header_only"])
def test_truncated_safetensors_file(folder, cut):
    path = folder / hf.SINGLE_FILE
    data = path.read_bytes()
    (header_size,) = struct.unpack("<Q", data[:8])
    keep = {"half": len(data) // 2, "five_bytes": 5, "header_only": 8 + header_size}[cut]
    assert keep < len(data)
    path.write_bytes(data[:keep])
    with pytest.raises(ValueError) as excinfo:
        hf.load(folder)
    message = _message(excinfo)
    assert str(path) in message
    assert "safetensors" in message


def test_empty_safetensors_file(folder):
    (folder / hf.SINGLE_FILE).write_bytes(b"")
    with pytest.raises(ValueError, match=re.escape(str(folder / hf.SINGLE_FILE))):
        hf.load(folder)


def test_no_weights_file(folder):
    (folder / hf.SINGLE_FILE).unlink()
    with pytest.raises(FileNotFoundError) as excinfo:
        hf.load(folder)
    message = _message(excinfo)
    assert hf.SINGLE_FILE in message and hf.INDEX_FILE in message


# --- config.json ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["hidden_size", "vocab_size", "num_experts_per_tok", "moe_intermediate_size"])
def test_config_missing_required_field(folder, field):
    config = dict(HF_CONFIG)
    del config[field]
    _write_config(folder, config)
    with pytest.raises(ValueError) as excinfo:
        hf.load(folder)
    message = _message(excinfo)
    assert repr(field) in message
    assert "config.json" in message
    assert "missing" in message


def test_config_missing_expert_count(folder):
    config = dict(HF_CONFIG)
    del config["num_local_experts"]
    _write_config(folder, config)
    with pytest.raises(ValueError, match="num_experts"):
        hf.load(folder)


def test_config_missing_intermediate_size_with_a_dense_layer(folder):
    config = dict(HF_CONFIG)
    del config["intermediate_size"]
    _write_config(folder, config)
    with pytest.raises(ValueError, match=r"config\.json: missing field 'intermediate_size'"):
        hf.load(folder)


def test_config_not_json(folder):
    (folder / "config.json").write_text('{"model_type": "qwen3_moe", "hidden_size": 16,')
    with pytest.raises(ValueError) as excinfo:
        hf.load(folder)
    message = _message(excinfo)
    assert str(folder / "config.json") in message
    assert "JSON" in message


def test_config_not_a_json_object(folder):
    (folder / "config.json").write_text("[1, 2, 3]")
    with pytest.raises(ValueError, match=re.escape(str(folder / "config.json"))):
        hf.load(folder)


def test_config_not_utf8(folder):
    (folder / "config.json").write_bytes(b"\xff\xfe\x00garbage\x80")
    with pytest.raises(ValueError, match=re.escape(str(folder / "config.json"))):
        hf.load(folder)


def test_no_config_json(folder):
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf.load(folder)


def test_folder_does_not_exist(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        hf.load(missing)


def test_wrong_model_type(folder):
    _write_config(folder, {**HF_CONFIG, "model_type": "gpt2"})
    with pytest.raises(ValueError) as excinfo:
        hf.load(folder)
    message = _message(excinfo)
    assert "model_type" in message
    assert "'gpt2'" in message
    assert "qwen3_moe" in message


def test_invalid_architecture_in_config_names_the_field(folder):
    _write_config(folder, {**HF_CONFIG, "num_key_value_heads": 3})
    with pytest.raises(ValueError) as excinfo:
        hf.load(folder)
    message = _message(excinfo)
    assert "config.json" in message
    assert "num_key_value_heads=3" in message  # the config.json key, not eqmoe's field


# --- sharded checkpoints -------------------------------------------------------------------------------


def _shard(folder: Path, tensors: dict[str, np.ndarray]) -> dict[str, str]:
    """Replace the single file with two shards and an index; return the weight map."""
    (folder / hf.SINGLE_FILE).unlink()
    keys = sorted(tensors)
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    halves = (keys[: len(keys) // 2], keys[len(keys) // 2 :])
    weight_map = {}
    for name, half in zip(names, halves, strict=True):
        save_file({key: tensors[key] for key in half}, str(folder / name))
        weight_map.update(dict.fromkeys(half, name))
    _write_index(folder, weight_map)
    return weight_map


def _write_index(folder: Path, weight_map: dict[str, str]) -> None:
    (folder / hf.INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_sharded_checkpoint_equals_single_file(folder, tensors):
    single = hf.load(folder)
    weight_map = _shard(folder, tensors)
    assert len(set(weight_map.values())) == 2
    assert not (folder / hf.SINGLE_FILE).exists()
    sharded = hf.load(folder)
    assert jax.tree.structure(single) == jax.tree.structure(sharded)
    same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), single, sharded)
    assert all(jax.tree.leaves(same))
    assert len(jax.tree.leaves(same)) == len(_leaves(single))


def test_shard_outside_the_folder_is_refused(folder, tensors):
    weight_map = _shard(folder, tensors)
    # A real safetensors file next to the folder: the refusal must not depend on it being missing.
    save_file({EXPERT_KEY: tensors[EXPERT_KEY]}, str(folder.parent / "evil.safetensors"))
    weight_map[EXPERT_KEY] = "../evil.safetensors"
    _write_index(folder, weight_map)
    with pytest.raises(ValueError) as excinfo:
        hf.load(folder)
    message = _message(excinfo)
    assert "../evil.safetensors" in message
    assert "outside" in message
    assert hf.INDEX_FILE in message


def test_shard_with_absolute_path_is_refused(folder, tensors):
    weight_map = _shard(folder, tensors)
    outside = folder.parent / "abs.safetensors"
    save_file({EXPERT_KEY: tensors[EXPERT_KEY]}, str(outside))
    weight_map[EXPERT_KEY] = str(outside)
    _write_index(folder, weight_map)
    with pytest.raises(ValueError, match="outside"):
        hf.load(folder)


def test_index_names_a_shard_without_the_key(folder, tensors):
    weight_map = _shard(folder, tensors)
    holder = weight_map[EXPERT_KEY]
    other = next(name for name in set(weight_map.values()) if name != holder)
    weight_map[EXPERT_KEY] = other
    _write_index(folder, weight_map)
    with pytest.raises(ValueError) as excinfo:
        hf.load(folder)
    message = _message(excinfo)
    assert EXPERT_KEY in message
    assert other in message
    assert "does not hold" in message


def test_index_missing_a_key_reports_it_missing(folder, tensors):
    weight_map = _shard(folder, tensors)
    del weight_map[EXPERT_KEY]
    _write_index(folder, weight_map)
    with pytest.raises(ValueError, match=rf"missing tensor {re.escape(EXPERT_KEY)}"):
        hf.load(folder)


def test_index_not_json(folder, tensors):
    _shard(folder, tensors)
    (folder / hf.INDEX_FILE).write_text("{not json")
    with pytest.raises(ValueError) as excinfo:
        hf.load(folder)
    assert hf.INDEX_FILE in _message(excinfo)


def test_index_without_weight_map(folder, tensors):
    _shard(folder, tensors)
    (folder / hf.INDEX_FILE).write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError) as excinfo:
        hf.load(folder)
    message = _message(excinfo)
    assert hf.INDEX_FILE in message
    assert "weight_map" in message


def test_index_names_a_shard_that_does_not_exist(folder, tensors):
    weight_map = _shard(folder, tensors)
    weight_map[EXPERT_KEY] = "model-00003-of-00002.safetensors"
    _write_index(folder, weight_map)
    with pytest.raises(FileNotFoundError, match="model-00003-of-00002.safetensors"):
        hf.load(folder)


# --- bfloat16 -------------------------------------------------------------------------------------------


def test_bfloat16_tensors_load(folder, tensors):
    bf16 = {key: value.astype(ml_dtypes.bfloat16) for key, value in tensors.items()}
    _rewrite(folder, bf16)
    with open(folder / hf.SINGLE_FILE, "rb") as handle:
        (header_size,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(header_size))
    assert header[EXPERT_KEY]["dtype"] == "BF16"

    model = hf.load(folder)  # float32 parameters from bf16 tensors
    rounded = {key: value.astype(np.float32) for key, value in bf16.items()}
    assert not np.array_equal(rounded["model.embed_tokens.weight"], tensors["model.embed_tokens.weight"])
    np.testing.assert_array_equal(np.asarray(model.embed), rounded["model.embed_tokens.weight"])
    np.testing.assert_array_equal(np.asarray(model.lm_head), rounded["lm_head.weight"].T)

    # Every parameter equals the float32 checkpoint's, rounded to bf16.
    _rewrite(folder, rounded)
    reference = hf.load(folder)
    same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), model, reference)
    assert all(jax.tree.leaves(same))


def test_bfloat16_tensors_load_as_bfloat16_params(folder, tensors):
    bf16 = {key: value.astype(ml_dtypes.bfloat16) for key, value in tensors.items()}
    _rewrite(folder, bf16)
    model = hf.load(folder, dtype="bfloat16")
    assert model.config.param_dtype == "bfloat16"
    assert all(leaf.dtype == ml_dtypes.bfloat16 for leaf in _leaves(model))
    np.testing.assert_array_equal(np.asarray(model.embed), bf16["model.embed_tokens.weight"])


def test_hand_written_bf16_file_reads_back(tmp_path):
    """The byte layout of a BF16 tensor, written without safetensors: the reader must agree with it."""
    values = np.array([[1.0, -2.5, 3.140625], [0.0, 1e-3, -7.0]], np.float32).astype(ml_dtypes.bfloat16)
    raw = values.tobytes()
    header = json.dumps(
        {"__metadata__": {"format": "pt"}, "x": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, len(raw)]}}
    ).encode()
    header += b" " * (-len(header) % 8)
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + raw)

    from eqmoe.checkpoints.safetensors_io import SafetensorsFile

    file = SafetensorsFile(path)
    assert file.keys() == ["x"]
    assert file.shape("x") == (2, 3)
    assert file.dtype("x") == "BF16"
    read = file.read("x")
    assert read.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(read, values)


# --- malformed config and index fields ---


def test_config_decoder_sparse_step_zero(folder):
    _write_config(folder, {**HF_CONFIG, "decoder_sparse_step": 0})
    with pytest.raises(ValueError, match="decoder_sparse_step"):
        hf.load(folder)


def test_config_unsupported_rope_type_names_the_file_once(folder):
    _write_config(folder, {**HF_CONFIG, "rope_parameters": {"rope_type": "dynamic", "factor": 4.0}})
    with pytest.raises(ValueError) as excinfo:
        hf.load(folder)
    message = _message(excinfo)
    assert "rope_type 'dynamic'" in message
    assert message.count(str(folder / "config.json")) == 1, message


def test_index_weight_map_not_an_object(folder, tensors):
    _shard(folder, tensors)
    (folder / hf.INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": sorted(tensors)}))
    with pytest.raises(ValueError, match=re.escape(hf.INDEX_FILE)):
        hf.load(folder)


def test_integer_tensor_is_refused(folder, tensors):
    key = "model.norm.weight"
    tensors[key] = np.ones(tensors[key].shape, np.int32)
    save_file(tensors, folder / hf.SINGLE_FILE)
    with pytest.raises(ValueError, match=re.escape(f"wrong dtype for {key}")):
        hf.load(folder)


@pytest.mark.parametrize(
    ("field", "value"),
    [("hidden_size", "16"), ("num_key_value_heads", 0), ("mlp_only_layers", "0"), ("rope_parameters", [1])],
)
def test_config_field_of_wrong_type(folder, field, value):
    _write_config(folder, {**HF_CONFIG, field: value})
    with pytest.raises(ValueError, match=field):
        hf.load(folder)
