"""HF <-> eqmoe checkpoint conversion: bit-exact round trips, sharding, training checkpoints, bad input."""

import json
import shutil

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from safetensors.numpy import load_file

from eqmoe.checkpoints import hf
from eqmoe.checkpoints.model_checkpoint import load_model, save_model
from eqmoe.checkpoints.orbax import Checkpointer
from eqmoe.config_io import config_to_dict
from eqmoe.train.state import init_state
from experiments import check_logits, convert, generate
from tests.conftest import load_reference, save_tiny_hf

torch = pytest.importorskip("torch")


def _tensors(folder):
    """Every tensor of an HF folder, single file or sharded."""
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def _word_tokenizer(path, size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "</s>"] + [str(i) for i in range(size - 2)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))


def _convert(capsys, **fields) -> tuple[int, str]:
    capsys.readouterr()  # drop what earlier steps printed (transformers' progress bars)
    code = convert.main(convert.Args(**fields))
    return code, capsys.readouterr().err


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hf_to_checkpoint_to_hf_is_bit_exact_with_its_side_files(tmp_path, capsys, dtype):
    save_tiny_hf(tmp_path / "hf", mlp_only_layers=[2], tie_word_embeddings=dtype == "bfloat16")
    if dtype == "bfloat16":  # a Hub-style bf16 checkpoint: the conversion keeps bf16 unless told otherwise
        load_reference(tmp_path / "hf").to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    _word_tokenizer(tmp_path / "hf" / "tokenizer.json", 50)  # vocabulary 97 padded beyond the tokenizer
    assert _convert(capsys, hf=tmp_path / "hf", out=tmp_path / "ckpt") == (0, "")
    model, metadata = load_model(tmp_path / "ckpt")
    assert model.embed.dtype == np.dtype(dtype) and metadata.source == str(tmp_path / "hf")
    assert _convert(capsys, checkpoint=tmp_path / "ckpt", to_hf=tmp_path / "back") == (0, "")

    original, back = _tensors(tmp_path / "hf"), _tensors(tmp_path / "back")
    assert set(back) == set(original) - ({"lm_head.weight"} if dtype == "bfloat16" else set())
    for key, value in back.items():
        assert value.dtype == original[key].dtype and value.tobytes() == original[key].tobytes(), key
    for name in ("tokenizer.json", "generation_config.json"):
        assert (tmp_path / "back" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes()


def test_sharded_input_and_output_and_transformers_loads_the_result(tmp_path, capsys):
    save_tiny_hf(tmp_path / "single").save_pretrained(tmp_path / "hf", max_shard_size="30KB")
    assert (tmp_path / "hf" / hf.INDEX_FILE).is_file()
    assert _convert(capsys, hf=tmp_path / "hf", out=tmp_path / "ckpt")[0] == 0
    code, _ = _convert(capsys, checkpoint=tmp_path / "ckpt", to_hf=tmp_path / "back", max_shard_size="40KB")
    assert code == 0
    index = json.loads((tmp_path / "back" / hf.INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 1
    ids = torch.tensor(np.random.default_rng(0).integers(0, 97, (2, 10)))
    with torch.no_grad():
        expected = load_reference(tmp_path / "single")(ids).logits
        np.testing.assert_array_equal(load_reference(tmp_path / "back")(ids).logits, expected)


def test_check_logits_and_generate_read_a_converted_checkpoint(tmp_path, capsys):
    save_tiny_hf(tmp_path / "hf")
    _word_tokenizer(tmp_path / "hf" / "tokenizer.json", 97)
    assert _convert(capsys, hf=tmp_path / "hf", out=tmp_path / "ckpt")[0] == 0
    assert check_logits.main(check_logits.Args(hf=tmp_path / "hf", checkpoint=tmp_path / "ckpt")) == 0
    assert "PASS" in capsys.readouterr().out

    model, metadata = load_model(tmp_path / "ckpt")
    experts = model.segments[0].blocks[0].ffn.experts  # perturb expert 3 of layer 1
    perturbed = eqx.tree_at(
        lambda m: m.segments[0].blocks[0].ffn.experts.down.weight, model, experts.down.weight.at[1, 3].add(0.5)
    )
    save_model(perturbed, tmp_path / "perturbed", extra_files=hf.side_files(tmp_path / "ckpt"))
    prompts = (" ".join(str(i) for i in range(40)),)  # enough distinct tokens to reach every expert
    args = check_logits.Args(hf=tmp_path / "hf", checkpoint=tmp_path / "perturbed", prompts=prompts)
    assert check_logits.main(args) == 1
    assert "FAIL" in capsys.readouterr().out

    assert generate.main(generate.Args(prompt="3 4 5", checkpoint=tmp_path / "ckpt", max_new_tokens=3)) == 0
    words = capsys.readouterr().out.split()
    assert words[:3] == ["3", "4", "5"] and len(words) >= 4


def test_a_training_checkpoint_exports_its_model_only(tmp_path, capsys):
    save_tiny_hf(tmp_path / "hf")
    model = hf.load(tmp_path / "hf")
    state = init_state(model, optax.adam(1e-3), key=jax.random.key(0))
    with Checkpointer(tmp_path / "run" / "checkpoints") as checkpointer:
        checkpointer.save(5, state, {"config": config_to_dict(model.config), "tokenizer": None})
    loaded, metadata = load_model(tmp_path / "run" / "checkpoints")
    assert metadata.tokenizer is None and metadata.bytes_tokenizer
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(model), strict=True):
        np.testing.assert_array_equal(a, b)
    assert _convert(capsys, checkpoint=tmp_path / "run" / "checkpoints", to_hf=tmp_path / "back")[0] == 0
    original = _tensors(tmp_path / "hf")
    for key, value in _tensors(tmp_path / "back").items():
        assert value.tobytes() == original[key].tobytes(), key
    # Trained on bytes (tokenizer None): generate falls back to the byte tokenizer.
    code = generate.main(generate.Args(prompt="0", checkpoint=tmp_path / "run" / "checkpoints", max_new_tokens=2))
    assert code == 0


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    save_tiny_hf(tmp_path / "hf")
    (tmp_path / "empty").mkdir()
    shutil.copytree(tmp_path / "hf", tmp_path / "gpt2")
    config = json.loads((tmp_path / "gpt2" / "config.json").read_text())
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    shutil.copytree(tmp_path / "hf", tmp_path / "big_tokenizer")
    _word_tokenizer(tmp_path / "big_tokenizer" / "tokenizer.json", 120)
    (tmp_path / "taken").mkdir()
    cases = [
        (dict(hf=tmp_path / "empty", out=tmp_path / "o1"), "no config.json"),
        (dict(hf=tmp_path / "gpt2", out=tmp_path / "o2"), "model_type 'gpt2' is not supported"),
        (dict(hf=tmp_path / "big_tokenizer", out=tmp_path / "o3"), "the tokenizer has 120 ids but"),
        (dict(hf=tmp_path / "hf", out=tmp_path / "taken"), "already exists (pass --overwrite"),
        (dict(hf=tmp_path / "hf"), "give either --hf DIR --out DIR"),
        (dict(checkpoint=tmp_path / "empty", to_hf=tmp_path / "o4"), "no finished checkpoint"),
        (dict(checkpoint=tmp_path / "missing", to_hf=tmp_path / "o5"), "checkpoint folder not found"),
    ]
    for fields, message in cases:
        code, err = _convert(capsys, **fields)
        assert code == 2 and message in err and err.count("\n") == 1, (fields, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big_tokenizer", "empty", "gpt2", "hf", "taken"]
    assert _convert(capsys, hf=tmp_path / "hf", out=tmp_path / "taken", overwrite=True)[0] == 0
    assert load_model(tmp_path / "taken")[0].config.vocab_size == 97

    save_tiny_hf(tmp_path / "wide", vocab_size=120)
    capsys.readouterr()
    assert check_logits.main(check_logits.Args(hf=tmp_path / "wide", checkpoint=tmp_path / "taken")) == 2
    err = capsys.readouterr().err
    assert "vocabulary of 97 ids, but" in err and err.count("\n") == 1


def test_restoring_a_field_checks_its_layout(tmp_path):
    save_tiny_hf(tmp_path / "hf")
    model = hf.load(tmp_path / "hf")
    with Checkpointer(tmp_path / "ck") as checkpointer:
        checkpointer.save(1, {"model": model, "other": np.zeros(3)}, {})
        abstract = eqx.filter_eval_shape(lambda: model)
        restored, _ = checkpointer.restore(None, abstract, field="model")
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(model), strict=True))
        with pytest.raises(ValueError, match="no field 'optimizer'"):
            checkpointer.restore(None, abstract, field="optimizer")
        with pytest.raises(ValueError, match="does not match"):
            checkpointer.restore(None, {"other": jax.ShapeDtypeStruct((4,), np.float64)}, field="other")
