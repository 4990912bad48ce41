"""MXFP4 folders (gpt-oss's published expert weights): every expert parameter reads as the published equation of its
bytes and as transformers' own conversion of them, bit for bit; bad pairs and unknown quantizations are one line.

The bytes are random (every byte value, so every nibble in both positions, and every finite scale exponent) or
written by :mod:`tests.mxfp4_files` from tiny unquantized experts, the blocks and scales of one layer in different
shards.
"""

import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from eqmoe.checkpoints import mxfp4, quantized
from eqmoe.checkpoints.safetensors_io import SafetensorsFile
from tests.mxfp4_files import QUANTIZATION_CONFIG, mxfp4_folder_from, quantize_mxfp4, write_mxfp4_folder

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)  # OCP MX v1.0
GATE_UP, DOWN = "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"


def _published(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The published equation, element by element along the last axis and in float64: value ``j`` of a row is the
    low nibble of byte ``j // 2`` of its group when ``j`` is even, the high nibble when odd, times
    ``2 ** (scale - 127)``; then transformers' transpose of the last two axes."""
    experts, rows, groups, _ = blocks.shape
    out = np.empty((experts, rows, groups * 32), np.float64)
    for j in range(groups * 32):
        byte = blocks[:, :, j // 32, (j % 32) // 2]
        code = byte & 0x0F if j % 2 == 0 else byte >> 4
        out[:, :, j] = E2M1[code] * 2.0 ** (scales[:, :, j // 32].astype(np.int64) - 127)
    with np.errstate(over="ignore"):  # 6 * 2 ** 127 is beyond float32: inf, as in float32 arithmetic
        return np.swapaxes(out, 1, 2).astype(np.float32)


def _bits(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).view(np.uint32)


def _files(folder) -> dict[str, SafetensorsFile]:
    files = {}
    for path in sorted(folder.glob("*.safetensors")):
        file = SafetensorsFile(path)
        files.update(dict.fromkeys(file.keys(), file))
    return files


def _read_all(folder) -> dict[str, np.ndarray]:
    scheme = quantized.read_scheme(folder)
    assert scheme == mxfp4.MXFP4()
    tensors = quantized.dequantizing(_files(folder), scheme)
    return {key: tensors[key].read(key) for key in tensors}


def _random_bytes(rng, experts=3, rows=40, groups=3) -> tuple[np.ndarray, np.ndarray]:
    """Random codes with every byte value among them and random exponents with every finite one (0 ... 254)."""
    blocks = rng.integers(0, 256, (experts, rows, groups, 16), dtype=np.uint8)
    blocks.reshape(-1)[:256] = np.arange(256, dtype=np.uint8)
    scales = rng.integers(0, 255, (experts, rows, groups), dtype=np.uint8)
    scales.reshape(-1)[:255] = np.arange(255, dtype=np.uint8)
    return blocks, scales


def _write(folder, shards: list[dict[str, np.ndarray]], config=None):
    folder.mkdir(exist_ok=True)
    for index, shard in enumerate(shards):
        save_file(shard, str(folder / f"model-{index:05d}.safetensors"))
    (folder / "config.json").write_text(json.dumps(config or {"quantization_config": QUANTIZATION_CONFIG}))
    return folder


@pytest.fixture
def random_folder(tmp_path):
    """Random bytes for both expert parameters, each parameter's blocks and scales in different shards, beside an
    unquantized bias."""
    rng = np.random.default_rng(0)
    tensors = {GATE_UP: _random_bytes(rng), DOWN: _random_bytes(rng, rows=48, groups=2)}
    bias = rng.standard_normal((3, 40)).astype(ml_dtypes.bfloat16)
    shards = [
        {GATE_UP + "_blocks": tensors[GATE_UP][0], DOWN + "_scales": tensors[DOWN][1], GATE_UP + "_bias": bias},
        {GATE_UP + "_scales": tensors[GATE_UP][1], DOWN + "_blocks": tensors[DOWN][0]},
    ]
    return _write(tmp_path / "random", shards), tensors, bias


def test_random_bytes_read_as_the_published_equation(random_folder):
    folder, tensors, bias = random_folder
    read = _read_all(folder)
    assert sorted(read) == sorted([GATE_UP, DOWN, GATE_UP + "_bias"])  # the parts are consumed
    for name, (blocks, scales) in tensors.items():
        expected = _published(blocks, scales)
        assert read[name].dtype == np.float32 and read[name].shape == expected.shape, name
        np.testing.assert_array_equal(_bits(read[name]), _bits(expected), err_msg=name)
    assert read[GATE_UP + "_bias"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(read[GATE_UP + "_bias"], bias)


def test_virtual_weights_have_transformers_unquantized_shape_and_a_float_dtype(random_folder):
    folder, _, _ = random_folder
    tensors = quantized.dequantizing(_files(folder), quantized.read_scheme(folder))
    assert tensors[GATE_UP].shape(GATE_UP) == (3, 96, 40)  # [E, cols, rows] of the stored [3, 40, 96]
    assert tensors[DOWN].shape(DOWN) == (3, 64, 48)
    assert tensors[GATE_UP].dtype(GATE_UP) == "F32"
    assert not isinstance(tensors[GATE_UP], quantized.DequantizedWeight)  # hold_fp8 leaves it dequantized


def test_random_bytes_read_as_transformers_converts_them(random_folder):
    torch = pytest.importorskip("torch")
    convert = pytest.importorskip("transformers.integrations.mxfp4").convert_moe_packed_tensors
    folder, tensors, _ = random_folder
    read = _read_all(folder)
    for name, (blocks, scales) in tensors.items():
        theirs = convert(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32).numpy()
        np.testing.assert_array_equal(_bits(read[name]), _bits(theirs), err_msg=name)
        bf16 = convert(torch.from_numpy(blocks), torch.from_numpy(scales))  # transformers' default: bfloat16
        ours = read[name].astype(ml_dtypes.bfloat16).view(np.uint16)
        np.testing.assert_array_equal(ours, bf16.view(torch.int16).numpy().view(np.uint16), err_msg=name)


def test_the_nan_exponent_255_reads_as_transformers_reads_it():
    torch = pytest.importorskip("torch")
    convert = pytest.importorskip("transformers.integrations.mxfp4").convert_moe_packed_tensors
    blocks = np.arange(256, dtype=np.uint8).reshape(1, 8, 2, 16)
    scales = np.full((1, 8, 2), 255, np.uint8)
    theirs = convert(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32).numpy()
    np.testing.assert_array_equal(mxfp4.dequantize(blocks, scales).swapaxes(1, 2), theirs)  # 0 or +-inf


def test_quantized_experts_round_trip_and_keep_the_rest(tmp_path):
    rng = np.random.default_rng(1)
    hidden, intermediate = 64, 32
    tensors = {
        GATE_UP: rng.standard_normal((2, hidden, 2 * intermediate)).astype(np.float32),
        DOWN: (rng.standard_normal((2, intermediate, hidden)) * 1e-3).astype(np.float32),
        "model.norm.weight": rng.standard_normal(hidden).astype(np.float32),
    }
    expected = write_mxfp4_folder(tmp_path / "mx", tensors, {"model_type": "gpt_oss"})
    read = _read_all(tmp_path / "mx")
    assert sorted(read) == sorted(tensors)
    for name in tensors:
        np.testing.assert_array_equal(_bits(read[name]), _bits(expected[name]), err_msg=name)
    np.testing.assert_array_equal(read["model.norm.weight"], tensors["model.norm.weight"])
    for name in (GATE_UP, DOWN):  # within half the widest E2M1 step (2) of the scale, under 2 * largest / 6
        stored = np.swapaxes(tensors[name], 1, 2).reshape(2, -1, 32)
        error = np.abs(np.swapaxes(read[name] - tensors[name], 1, 2).reshape(stored.shape))
        assert (error <= np.abs(stored).max(axis=-1, keepdims=True) / 3 + 1e-30).all(), name
        assert np.abs(read[name] - tensors[name]).max() > 0  # the weights went through FP4


def test_quantize_chooses_the_smallest_power_of_two_scale_that_fits():
    groups = np.array([6.0, 6.5, 0.75, 0.0, 1e-3])[:, None] * np.eye(1, 32)  # each group's largest, then zeros
    blocks, scales = quantize_mxfp4(groups[None].astype(np.float32))
    assert scales.reshape(-1).tolist() == [127, 128, 124, 0, 127 - 12]  # 2**ceil(log2(largest / 6))
    assert (blocks.reshape(5, 16)[:, 0] & 0x0F).tolist() == [7, 5, 7, 0, 6]  # 6; 6.5/2 -> 3; 6; 0; 1e-3/2**-12 -> 4


def test_transformers_loads_a_folder_the_helper_writes_as_eqmoe_reads_it(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.GptOssConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["full_attention"],
    )
    torch.manual_seed(0)
    transformers.GptOssForCausalLM(config).save_pretrained(tmp_path / "plain")
    expected = mxfp4_folder_from(tmp_path / "plain", tmp_path / "mx")
    theirs = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "mx", dtype=torch.float32).state_dict()
    read = _read_all(tmp_path / "mx")
    assert sorted(read) == sorted(expected)
    for name, value in read.items():
        np.testing.assert_array_equal(_bits(value), _bits(expected[name]), err_msg=name)
        np.testing.assert_array_equal(_bits(value), _bits(theirs[name].numpy()), err_msg=name)


def _error(folder) -> str:
    with pytest.raises(ValueError) as error:
        quantized.dequantizing(_files(folder), quantized.read_scheme(folder))
    message = str(error.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize(
    "change, phrase",
    [
        (lambda b, s: {"_blocks": b}, f"{GATE_UP}_blocks has no {GATE_UP}_scales"),
        (lambda b, s: {"_scales": s}, f"{GATE_UP}_scales has no {GATE_UP}_blocks"),
        (lambda b, s: {"_blocks": b.astype(np.int8), "_scales": s}, f"{GATE_UP}_blocks is stored I8, not U8"),
        (lambda b, s: {"_blocks": b, "_scales": s.astype(np.float32)}, f"{GATE_UP}_scales is stored F32, not U8"),
        (
            lambda b, s: {"_blocks": b, "_scales": s[:, :, :1]},
            f"{GATE_UP}_scales has shape [3, 40, 1], expected [3, 40, 3]",
        ),
        (
            lambda b, s: {"_blocks": b[..., :8], "_scales": s},
            f"{GATE_UP}_blocks has shape [3, 40, 3, 8], expected [experts, rows, cols / 32, 16]",
        ),
        (lambda b, s: {"_blocks": b, "_scales": s, "": np.zeros(3)}, f"{GATE_UP} is stored unquantized besides"),
    ],
    ids=["no-scales", "no-blocks", "blocks-dtype", "scales-dtype", "scales-shape", "blocks-shape", "both"],
)
def test_a_bad_pair_is_one_line_naming_the_file_and_tensor(tmp_path, change, phrase):
    parts = change(*_random_bytes(np.random.default_rng(2)))
    folder = _write(tmp_path / "bad", [{GATE_UP + suffix: array for suffix, array in parts.items()}])
    message = _error(folder)
    assert f"{folder / 'model-00000.safetensors'}: {phrase}" in message, message


def test_every_bad_pair_is_in_the_one_error(tmp_path):
    blocks, scales = _random_bytes(np.random.default_rng(3))
    folder = _write(tmp_path / "bad", [{GATE_UP + "_blocks": blocks}, {DOWN + "_scales": scales}])
    message = _error(folder)
    assert f"{folder / 'model-00000.safetensors'}: {GATE_UP}_blocks has no" in message
    assert f"{folder / 'model-00001.safetensors'}: {DOWN}_scales has no" in message


def test_read_scheme_accepts_mxfp4_and_names_both_methods_when_refusing(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gpt_oss", "quantization_config": QUANTIZATION_CONFIG})
    )
    scheme = quantized.read_scheme(tmp_path)
    assert scheme == mxfp4.MXFP4() and f"{scheme.describe()} weights" == "MXFP4 expert weights"
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "awq", "bits": 4}}))
    with pytest.raises(ValueError) as error:
        quantized.read_scheme(tmp_path)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"{tmp_path / 'config.json'}: quantization_config.quant_method")
    assert "'awq' is not supported" in message and "'fp8'" in message and "'mxfp4'" in message
