"""Block-FP8 folders (DeepSeek-V3's published layout): every weight loads as the NumPy dequantization of its bytes,
the model computes transformers' logits of those weights, and any other quantization is refused before anything
is written.

The folders are a tiny Qwen3-MoE rewritten here in the block-FP8 layout, with 16 x 24 blocks that divide none of
its 56 x 40, 40 x 56 and 28 x 40 matrices, so every matrix has partial blocks at its bottom and right edges.
transformers reads such a folder on CPU only where the blocks divide the weights (it dequantizes, and refuses a
partial block): its logits are compared on the same folder written with 4 x 8 blocks, and for 16 x 24 blocks on a
plain folder of the NumPy-dequantized weights.

The ``deepseek`` tests do the same for the layout itself: a tiny DeepSeek-V3 saved by transformers, with a
multi-token-prediction layer added, rewritten as DeepSeek-V3's published files are (see :func:`_deepseek_folder`).
"""

import json
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tyro
from safetensors.numpy import load_file, save_file

from eqmoe import parallel
from eqmoe.checkpoints import hf
from eqmoe.checkpoints.model_checkpoint import load_model
from experiments import convert
from tests.conftest import load_reference, save_tiny_hf
from tests.test_deepseek import V3, _with_mtp

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PARTIAL, WHOLE = (16, 24), (4, 8)  # blocks that divide none of the matrices / all of them
SHAPES = dict(
    hidden_size=40,
    head_dim=14,
    intermediate_size=56,
    moe_intermediate_size=56,
    num_hidden_layers=2,
    num_experts=4,
)
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn


def _spread(scales: np.ndarray, shape: tuple[int, int], block: tuple[int, int]) -> np.ndarray:
    """Each block's scale at every element of its block (fancy indexing: independent of the library's loop)."""
    rows, cols = np.arange(shape[0])[:, None] // block[0], np.arange(shape[1])[None, :] // block[1]
    return scales[rows, cols]


def _quantize(weight: np.ndarray, ue8m0: bool, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """float8_e4m3fn values and float32 per-block scales (powers of two with ``ue8m0``) such that
    values * scales ~ weight, the largest magnitude of each block mapped to at most 448."""
    grid = tuple(-(-size // b) for size, b in zip(weight.shape, block, strict=True))
    padded = np.zeros((grid[0] * block[0], grid[1] * block[1]), np.float32)
    padded[: weight.shape[0], : weight.shape[1]] = np.abs(weight)
    scales = np.maximum(padded.reshape(grid[0], block[0], grid[1], block[1]).max(axis=(1, 3)), 1e-12) / E4M3_MAX
    if ue8m0:
        scales = 2.0 ** np.ceil(np.log2(scales))
    scales = scales.astype(np.float32)
    return (weight / _spread(scales, weight.shape, block)).astype(ml_dtypes.float8_e4m3fn), scales


def _decode_exponents(exponents: np.ndarray) -> np.ndarray:
    """UE8M0 bytes as the scales they mean, 2 ** (byte - 127), by arithmetic rather than a dtype cast."""
    return np.ldexp(np.float32(1.0), exponents.astype(np.int32) - 127).astype(np.float32)


def _fp8_folder(plain, folder, ue8m0: bool, block: tuple[int, int]) -> dict[str, np.ndarray]:
    """Write ``plain``'s model to ``folder`` in the block-FP8 layout; the NumPy dequantization of what was
    written (unquantized tensors as stored). Float scales go in one file; UE8M0 scales are split over two shards,
    layer 0's as float32 powers of two beside the weights and layer 1's as exponent bytes in a shard of their own
    (attention's as F8_E8M0, the experts' as U8, as MXFP8 checkpoints write them)."""
    tensors = load_file(plain / hf.SINGLE_FILE)
    shards: list[dict[str, np.ndarray]] = [{}, {}]
    expected = {}
    for key, weight in tensors.items():
        if not key.endswith("proj.weight"):  # norms, embeddings, the head and router gates stay unquantized
            shards[0][key] = expected[key] = weight
            continue
        values, scales = _quantize(weight, ue8m0, block)
        shards[0][key] = values
        if ue8m0 and ".layers.1." in key:
            exponents = (np.log2(scales) + 127).astype(np.uint8)
            scales = _decode_exponents(exponents)
            stored = exponents if ".experts." in key else exponents.view(ml_dtypes.float8_e8m0fnu)
            shards[1][key + "_scale_inv"] = stored
        else:
            shards[0][key + "_scale_inv"] = scales
        expected[key] = values.astype(np.float32) * _spread(scales, weight.shape, block)
    folder.mkdir()
    config = json.loads((plain / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        **({"scale_fmt": "ue8m0"} if ue8m0 else {}),
    }
    (folder / "config.json").write_text(json.dumps(config))
    if not shards[1]:
        save_file(shards[0], str(folder / hf.SINGLE_FILE), metadata={"format": "pt"})
        return expected
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    (folder / hf.INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return expected


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plain")
    save_tiny_hf(folder, **SHAPES)
    return folder


def _folders(plain, root, block) -> dict[str, tuple]:
    """``{"float": (folder, expected), "ue8m0": (folder, expected)}``: a block-FP8 folder of each scale format and
    the NumPy dequantization of every tensor it holds."""
    return {kind: (root / kind, _fp8_folder(plain, root / kind, kind == "ue8m0", block)) for kind in ("float", "ue8m0")}


@pytest.fixture(scope="module")
def fp8(plain, tmp_path_factory):
    return _folders(plain, tmp_path_factory.mktemp("fp8"), PARTIAL)


def test_the_folders_hold_the_published_layout(fp8):
    """What the tests below load: F8_E4M3 weights, F32 / F8_E8M0 / U8 scales on partial-block grids."""
    folder, _ = fp8["ue8m0"]
    headers = {}
    for path in folder.glob("*.safetensors"):
        with open(path, "rb") as handle:
            headers.update(json.loads(handle.read(int.from_bytes(handle.read(8), "little"))))
    q = "model.layers.1.self_attn.q_proj.weight"
    assert headers[q]["dtype"] == "F8_E4M3" and headers[q]["shape"] == [56, 40]
    assert headers[q + "_scale_inv"]["dtype"] == "F8_E8M0" and headers[q + "_scale_inv"]["shape"] == [4, 2]
    assert headers["model.layers.1.mlp.experts.0.down_proj.weight_scale_inv"]["dtype"] == "U8"
    k_scales = headers["model.layers.0.self_attn.k_proj.weight_scale_inv"]
    assert k_scales["dtype"] == "F32" and k_scales["shape"] == [2, 2]  # 28 x 40 in 16 x 24 blocks


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["float", "ue8m0"])
def test_every_weight_is_the_numpy_dequantization(fp8, plain, kind, dtype):
    folder, expected = fp8[kind]
    loaded = hf.state_dict(hf.load(folder, dtype=dtype))
    assert set(loaded) == set(expected)  # the *_scale_inv companions are consumed, not parameters
    original = load_file(plain / hf.SINGLE_FILE)
    for key, value in loaded.items():
        assert value.dtype == np.dtype(dtype), key
        want = expected[key].astype(dtype).astype(np.float32)
        np.testing.assert_array_equal(value.astype(np.float32), want, err_msg=key)
        if key.endswith("proj.weight"):  # quantized: close to the original, yet not it
            assert 0 < np.abs(expected[key] - original[key]).max() <= np.abs(original[key]).max() / 8, key


def test_placing_slice_by_slice_reads_the_same_weights(fp8):
    """With a mesh every device's slice is read, and dequantized, on its own."""
    folder, _ = fp8["ue8m0"]
    one = parallel.make_parallelism("data=1", devices=jax.devices()[:1])
    placed, plain = hf.state_dict(hf.load(folder, parallelism=one)), hf.state_dict(hf.load(folder))
    for key, value in placed.items():
        np.testing.assert_array_equal(value, plain[key], err_msg=key)


def _assert_same_logits(reference, folder):
    ids = torch.randint(0, reference.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = reference(ids).logits.numpy()
    logits = np.asarray(hf.load(folder, dtype="float32")(jnp.asarray(ids.numpy())).logits)
    np.testing.assert_allclose(logits, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind", ["float", "ue8m0"])
def test_logits_equal_transformers_on_the_same_folder(plain, kind, tmp_path):
    """Whole blocks: transformers dequantizes the folder itself (on CPU it does, here into float32)."""
    folder = tmp_path / kind
    _fp8_folder(plain, folder, kind == "ue8m0", WHOLE)
    reference = transformers.Qwen3MoeForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    assert {p.dtype for p in reference.parameters()} == {torch.float32}
    _assert_same_logits(reference, folder)


@pytest.mark.parametrize("kind", ["float", "ue8m0"])
def test_logits_equal_transformers_on_the_dequantized_weights(fp8, plain, kind, tmp_path):
    """Partial blocks, which transformers refuses: its logits on a plain folder of the NumPy-dequantized weights."""
    folder, expected = fp8[kind]
    shutil.copyfile(plain / "config.json", tmp_path / "config.json")
    save_file(expected, str(tmp_path / hf.SINGLE_FILE), metadata={"format": "pt"})
    _assert_same_logits(load_reference(tmp_path), folder)


def test_convert_says_the_output_is_unquantized_and_export_writes_it_so(fp8, tmp_path, capsys):
    folder, expected = fp8["ue8m0"]
    capsys.readouterr()
    assert convert.main(convert.Args(hf=folder, out=tmp_path / "ckpt", save_dtype="bfloat16")) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if "block-FP8" in line]
    assert len(notes) == 1 and "16x24 blocks" in notes[0] and notes[0].endswith("unquantized bfloat16"), out

    hf.save(load_model(tmp_path / "ckpt")[0], tmp_path / "hf")
    assert "quantization_config" not in json.loads((tmp_path / "hf" / "config.json").read_text())
    written = load_file(tmp_path / "hf" / hf.SINGLE_FILE)
    assert set(written) == set(expected)
    for key, value in written.items():
        assert value.dtype == ml_dtypes.bfloat16, key
        np.testing.assert_array_equal(value, expected[key].astype(ml_dtypes.bfloat16), err_msg=key)


def _with_quantization(plain, folder, quantization_config):
    folder.mkdir()
    (folder / hf.SINGLE_FILE).symlink_to(plain / hf.SINGLE_FILE)
    config = json.loads((plain / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return folder


def test_other_quantization_is_refused_and_nothing_is_written(plain, tmp_path, capsys):
    int4 = {"quant_method": "compressed-tensors", "format": "pack-quantized"}  # Kimi K2-Thinking's INT4
    folder = _with_quantization(plain, tmp_path / "int4", int4)
    capsys.readouterr()
    assert convert.main(convert.Args(hf=folder, out=tmp_path / "ckpt")) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "'compressed-tensors'" in err and str(folder / "config.json") in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["int4"]  # no output, no staging folder left behind

    for method in ("awq", "bitsandbytes"):
        folder = _with_quantization(plain, tmp_path / method, {"quant_method": method})
        with pytest.raises(ValueError, match=rf"config.json: quantization_config.quant_method='{method}' is not"):
            hf.load(folder)


def test_a_scale_grid_of_the_wrong_shape_names_the_file_and_tensor(fp8, tmp_path):
    from safetensors import torch as torch_safetensors  # NumPy's reader has no FP8 dtypes

    folder, _ = fp8["float"]
    tensors = torch_safetensors.load_file(folder / hf.SINGLE_FILE)
    key = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    tensors[key] = torch.ones(2, 2)  # 40 x 56 in 16 x 24 blocks is a 3 x 3 grid
    (tmp_path / "bad").mkdir()
    shutil.copyfile(folder / "config.json", tmp_path / "bad" / "config.json")
    torch_safetensors.save_file(tensors, str(tmp_path / "bad" / hf.SINGLE_FILE))
    with pytest.raises(ValueError) as error:
        hf.load(tmp_path / "bad")
    message = str(error.value)
    assert "\n" not in message and str(tmp_path / "bad" / hf.SINGLE_FILE) in message
    assert f"{key} has shape [2, 2], expected [3, 3]" in message


# DeepSeek-V3. 2 layers (a dense one, an MoE one of 8 experts in 4 groups) and the MTP layer (model.layers.2.*):
# q_a 24 x 32, q_b 48 x 24, kv_a_proj_with_mqa 20 x 32 (kv_lora_rank 16 + qk_rope 4), kv_b 80 x 16, o 32 x 48,
# dense MLP 48 x 32 / 32 x 48, experts and the shared expert 16 x 32 / 32 x 16, eh_proj 32 x 64. 14 x 10 blocks divide
# none of these sizes (16 x 24 would divide q_b and o_proj whole), so every quantized matrix has partial blocks at its
# bottom and its right edge; 4 x 8 blocks divide them all, for transformers.
DEEPSEEK_SHAPES = dict(num_hidden_layers=2, n_routed_experts=8)
DEEPSEEK_PARTIAL = (14, 10)
MTP = "model.layers.2."


def _published_fp8(key: str, eh_proj: bool) -> bool:
    """Whether DeepSeek-V3's published files store ``key`` as block-FP8: every linear weight of attention and of the
    MLPs (dense, routed and shared experts), in the MTP layer's block as in the decoder's. The embeddings, lm_head,
    the MTP layer's shared_head.head, the norms and the router (``mlp.gate.weight`` bf16,
    ``e_score_correction_bias`` float32) are unquantized. So is the MTP layer's ``eh_proj`` as published (vLLM and
    SGLang read it as a plain bf16 Linear); other MTP checkpoints quantize it, which ``eh_proj`` toggles."""
    if key.endswith("eh_proj.weight"):
        return eh_proj
    return key.endswith(("_proj.weight", "kv_a_proj_with_mqa.weight"))


def _deepseek_folder(source, folder, ue8m0: bool, block: tuple[int, int]) -> dict[str, np.ndarray]:
    """Write ``source``'s DeepSeek-V3 (with its MTP layer) to ``folder`` as the published files are: block-FP8
    weights with float32 ``weight_scale_inv`` grids (powers of two under ue8m0, as DeepSeek-V3.1 stores them)
    beside them, the unquantized tensors bf16 but the correction bias float32, the MTP layer in a shard of its own
    (the last, as published), ``config.json`` saying ``dtype`` bfloat16 and the ``quantization_config``. The float
    folder leaves ``eh_proj`` unquantized as published, the ue8m0 one quantizes it. Returns the NumPy dequantization
    of every tensor written, in float32."""
    tensors = load_file(source / hf.SINGLE_FILE)
    shards: list[dict[str, np.ndarray]] = [{}, {}]
    expected = {}
    for key, weight in tensors.items():
        shard = shards[key.startswith(MTP)]
        if not _published_fp8(key, eh_proj=ue8m0):
            stored = weight if key.endswith("e_score_correction_bias") else weight.astype(ml_dtypes.bfloat16)
            shard[key], expected[key] = stored, stored.astype(np.float32)
            continue
        values, scales = _quantize(weight, ue8m0, block)
        shard[key], shard[key + "_scale_inv"] = values, scales
        expected[key] = values.astype(np.float32) * _spread(scales, weight.shape, block)
    folder.mkdir()
    config = json.loads((source / "config.json").read_text())
    config["dtype"] = "bfloat16"
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        **({"scale_fmt": "ue8m0"} if ue8m0 else {}),
    }
    (folder / "config.json").write_text(json.dumps(config))
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    (folder / hf.INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return expected


@pytest.fixture(scope="module")
def deepseek_plain(tmp_path_factory):
    """transformers' tiny DeepSeek-V3 with an MTP layer's tensors added (float32, unquantized)."""
    root = tmp_path_factory.mktemp("deepseek")
    V3.save_tiny(root / "saved", seed=5, **DEEPSEEK_SHAPES)
    _with_mtp(root / "saved", root / "mtp")
    return root / "mtp"


@pytest.fixture(scope="module")
def deepseek(deepseek_plain, tmp_path_factory):
    """``{"float": (folder, expected), "ue8m0": (folder, expected)}`` in 14 x 10 blocks."""
    root = tmp_path_factory.mktemp("deepseek_fp8")
    kinds = ("float", "ue8m0")
    return {
        kind: (root / kind, _deepseek_folder(deepseek_plain, root / kind, kind == "ue8m0", DEEPSEEK_PARTIAL))
        for kind in kinds
    }


def _headers(folder) -> dict[str, dict]:
    headers = {}
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as handle:
            header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
        headers.update({key: {**value, "file": path.name} for key, value in header.items() if key != "__metadata__"})
    return headers


def test_deepseek_folders_hold_the_published_layout(deepseek):
    """F8_E4M3 linear weights on F32 scale grids with partial blocks at both edges, in the MTP layer too; bf16
    embeddings, heads, norms and router, the float32 correction bias; the MTP layer in the last shard."""
    attention = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    for kind, (folder, _) in deepseek.items():
        headers = _headers(folder)
        quantized = {key for key, value in headers.items() if value["dtype"] == "F8_E4M3"}
        # 5 attention matrices a layer; layer 0's dense MLP; 8 experts and a shared expert in layer 1 and the MTP's
        assert len(quantized) == 5 * 3 + 3 + 2 * (8 + 1) * 3 + (kind == "ue8m0"), kind
        assert {f"model.layers.{i}.self_attn.{part}.weight" for i in (0, 1, 2) for part in attention} < quantized
        assert {"model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.experts.7.up_proj.weight"} < quantized
        assert {f"{MTP}mlp.experts.7.gate_proj.weight", f"{MTP}mlp.shared_experts.down_proj.weight"} < quantized
        assert (f"{MTP}eh_proj.weight" in quantized) == (kind == "ue8m0")
        for key in quantized:
            rows, cols = headers[key]["shape"]
            assert rows % DEEPSEEK_PARTIAL[0] and cols % DEEPSEEK_PARTIAL[1], key  # partial blocks at both edges
            grid = [-(-rows // DEEPSEEK_PARTIAL[0]), -(-cols // DEEPSEEK_PARTIAL[1])]
            assert headers[key + "_scale_inv"]["dtype"] == "F32" and headers[key + "_scale_inv"]["shape"] == grid
        kv_a = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
        assert headers[kv_a]["shape"] == [20, 32] and headers[kv_a + "_scale_inv"]["shape"] == [2, 4]
        scales = {key + "_scale_inv" for key in quantized}
        assert {key for key, value in headers.items() if value["dtype"] == "F32"} - scales == {
            "model.layers.1.mlp.gate.e_score_correction_bias",
            f"{MTP}mlp.gate.e_score_correction_bias",
        }
        bf16 = {key for key, value in headers.items() if value["dtype"] == "BF16"}
        assert len(headers) == len(quantized) + len(scales) + 2 + len(bf16)  # nothing else
        assert {
            "model.embed_tokens.weight",
            "lm_head.weight",
            "model.norm.weight",
            "model.layers.0.self_attn.kv_a_layernorm.weight",
            "model.layers.1.mlp.gate.weight",
            f"{MTP}mlp.gate.weight",
            f"{MTP}embed_tokens.weight",
            f"{MTP}shared_head.head.weight",
            f"{MTP}enorm.weight",
        } < bf16
        assert {(key.startswith(MTP), value["file"]) for key, value in headers.items()} == {
            (False, "model-00001-of-00002.safetensors"),
            (True, "model-00002-of-00002.safetensors"),
        }


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["float", "ue8m0"])
def test_deepseek_every_weight_is_the_numpy_dequantization(deepseek, deepseek_plain, kind, dtype):
    """The MTP layer included; bfloat16 parameters are the float32 dequantization rounded once (the correction bias
    is float32 state in eqmoe whatever the parameter dtype, the float32 it is stored as)."""
    folder, expected = deepseek[kind]
    model = hf.load(folder, dtype=dtype)
    assert model.config.mtp_layers == 1 and len(model.mtp) == 1
    loaded = hf.state_dict(model)
    assert set(loaded) == set(expected)  # every tensor, MTP layer's too; the *_scale_inv companions consumed
    # the MTP layer: layer 1's tensors and its own embedding, enorm, hnorm, eh_proj, head norm and head
    assert sum(key.startswith(MTP) for key in loaded) == sum(key.startswith("model.layers.1.") for key in loaded) + 6
    original = load_file(deepseek_plain / hf.SINGLE_FILE)
    for key, value in loaded.items():
        want = expected[key]
        if key.endswith("e_score_correction_bias"):
            assert value.dtype == np.float32, key
        else:
            assert value.dtype == np.dtype(dtype), key
            want = want.astype(dtype)
        np.testing.assert_array_equal(value, want, err_msg=key)
        if _published_fp8(key, eh_proj=kind == "ue8m0"):  # quantized: close to the original, yet not it
            assert 0 < np.abs(expected[key] - original[key]).max() <= np.abs(original[key]).max() / 8, key
    if dtype == "bfloat16" and kind == "float":  # rounding the FP8 values and the scales to bf16 first would differ
        key = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
        twice = (expected[key].astype(ml_dtypes.bfloat16) != _rounded_twice(folder, key)).mean()
        assert twice > 0.1, twice


def _rounded_twice(folder, key) -> np.ndarray:
    """``key`` dequantized in bfloat16 arithmetic (values and scales cast first): what rounding once is not."""
    from safetensors import torch as torch_safetensors  # NumPy's reader has no FP8 dtypes

    tensors = torch_safetensors.load_file(folder / "model-00001-of-00002.safetensors")
    values = tensors[key].to(torch.bfloat16)
    scales = tensors[key + "_scale_inv"].to(torch.bfloat16)
    spread = scales.repeat_interleave(DEEPSEEK_PARTIAL[0], 0).repeat_interleave(DEEPSEEK_PARTIAL[1], 1)
    return (values * spread[: values.shape[0], : values.shape[1]]).float().numpy().astype(ml_dtypes.bfloat16)


def _deepseek_reference(folder):
    return transformers.DeepseekV3ForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()


def test_deepseek_logits_equal_transformers_on_the_same_folder(deepseek_plain, tmp_path):
    """Whole 4 x 8 blocks: transformers dequantizes the DeepSeek-V3 folder itself (its MTP layer it ignores). One
    scale format here and the other below: the weights of both are compared exactly above."""
    folder = tmp_path / "ue8m0"
    _deepseek_folder(deepseek_plain, folder, True, WHOLE)
    reference = _deepseek_reference(folder)
    assert {p.dtype for p in reference.parameters()} == {torch.float32}
    _assert_same_logits(reference, folder)


def test_deepseek_logits_equal_transformers_on_the_dequantized_weights(deepseek, deepseek_plain, tmp_path):
    """Partial 14 x 10 blocks: transformers' logits on a plain folder of the NumPy-dequantized weights."""
    folder, expected = deepseek["float"]
    shutil.copyfile(deepseek_plain / "config.json", tmp_path / "config.json")
    decoder = {key: value for key, value in expected.items() if not key.startswith(MTP)}
    save_file(decoder, str(tmp_path / hf.SINGLE_FILE), metadata={"format": "pt"})
    _assert_same_logits(_deepseek_reference(tmp_path), folder)


def test_deepseek_convert_writes_unquantized_bfloat16_with_the_mtp_layer(deepseek, tmp_path, capsys):
    """``convert --hf FP8 --out CKPT`` then ``convert --checkpoint CKPT --to-hf OUT``, flags as typed: bfloat16 (the
    dtype the folder declares), no quantization_config, the MTP layer's tensors kept; each tensor the dequantized
    float32 rounded once (the correction bias float32, as the published files and eqmoe keep it)."""
    folder, expected = deepseek["float"]
    capsys.readouterr()
    assert convert.main(tyro.cli(convert.Args, args=["--hf", str(folder), "--out", str(tmp_path / "ckpt")])) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "block-FP8" in line]
    assert len(notes) == 1 and "14x10 blocks" in notes[0] and notes[0].endswith("unquantized bfloat16"), notes
    args = ["--checkpoint", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "hf")]
    assert convert.main(tyro.cli(convert.Args, args=args)) == 0

    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "quantization_config" not in config and config["num_nextn_predict_layers"] == 1
    assert config["dtype"] == "bfloat16"
    written = load_file(tmp_path / "hf" / hf.SINGLE_FILE)
    assert set(written) == set(expected) and any(key.startswith(MTP) for key in written)
    for key, value in written.items():
        want = expected[key] if key.endswith("e_score_correction_bias") else expected[key].astype(ml_dtypes.bfloat16)
        assert value.dtype == want.dtype, key
        np.testing.assert_array_equal(value, want, err_msg=key)
