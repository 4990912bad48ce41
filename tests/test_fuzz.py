"""Fuzzing: random configs either name the bad field or build a model with finite outputs; random and
truncated input files give a clear error, never a hang or an interpreter crash."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from eqmoe import Transformer, presets
from eqmoe.checkpoints import hf
from eqmoe.config import ModelConfig
from eqmoe.config_io import config_from_dict, config_to_dict
from eqmoe.data import load_conversations, load_tokenizer
from eqmoe.registries import check_names

FIELDS = {f.name for f in dataclasses.fields(ModelConfig)} | {
    "num_heads", "num_kv_heads", "head_dim", "rope_theta", "rope_layout", "qk_norm", "eps", "ffn_placement",
    "stats_dtype", "num_experts", "top_k", "strategy", "renormalize", "capacity_factor", "num_groups",
    "bias_update_rate", "routed_scaling_factor", "expert_dim", "dispatch", "block_size", "load_balance",
    "load_balance_weight", "router_z_loss_weight", "output_z_loss_weight", "unit", "repeats",
}  # fmt: skip
SMALL = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def configs(draw):
    """Mostly valid field values, each replaced by an invalid one now and then."""

    def pick(valid, invalid):
        return draw(st.sampled_from(valid if draw(st.integers(0, 99)) < 88 else invalid))

    values = config_to_dict(presets.get("qwen3-moe-micro"))
    values.update(vocab_size=pick([16, 64], [0, -2]), embed_dim=pick([8, 16], [0, -8]))
    values["attention"].update(
        num_heads=pick([2, 4], [0, -1]),
        num_kv_heads=pick([1, 2], [0, 3]),
        head_dim=pick([4, 8], [0, 3]),
        qk_norm=pick(["none", "before_rope", "after_rope"], ["sideways"]),
    )
    values["moe"]["router"].update(
        num_experts=pick([4, 6], [0, -3]),
        top_k=pick([1, 2], [0, 9]),
        strategy=pick(["softmax_top_k", "top_k_softmax", "top2_gating", "sigmoid_top_k"], ["x"]),
        capacity_factor=pick([None, 0.5, 2.0], [-1.0, 0.0]),
        bias_update_rate=pick([0.0, 0.01], [-0.1]),
    )
    values["moe"].update(expert_dim=pick([8, 16], [-4]), block_size=pick([4, 128], [0]))
    values["norm"]["ffn_placement"] = pick(["pre", "post", "hybrid"], ["middle"])
    values["layers"] = [{"unit": pick([["moe"], ["dense", "moe"]], [[], ["attn"]]), "repeats": pick([1, 2], [0])}]
    values["mlp_dim"] = pick([16], [None, 0])
    return values


@SMALL
@given(configs())
def test_random_configs_name_the_field_or_run_finite(values):
    try:
        config = config_from_dict(values)
        check_names(config)  # the registered names, checked where parts are looked up
    except ValueError as error:
        message = str(error)
        assert any(name in message for name in FIELDS), message
        event("rejected with a ValueError")
        return
    event("built and ran")
    model = Transformer(config, key=jax.random.key(0))
    tokens = jnp.arange(8, dtype=jnp.int32)[None] % config.vocab_size
    output = model(tokens)
    assert np.isfinite(np.asarray(output.logits)).all()


def _mangled(original: bytes, data) -> bytes:
    choice = data.draw(st.sampled_from(["truncate", "random", "flip"]))
    if choice == "truncate":
        return original[: data.draw(st.integers(0, max(len(original) - 1, 0)))]
    if choice == "random":
        return data.draw(st.binary(max_size=200))
    position = data.draw(st.integers(0, len(original) - 1))
    return original[:position] + bytes([original[position] ^ data.draw(st.integers(1, 255))]) + original[position + 1 :]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    from tests.conftest import save_tiny_hf

    folder = tmp_path_factory.mktemp("tiny_hf")
    save_tiny_hf(folder)
    return folder


@SMALL
@given(data=st.data())
def test_mangled_files_give_clear_errors(tmp_path_factory, hf_folder, data):
    folder = tmp_path_factory.mktemp("mangled")
    kind = data.draw(st.sampled_from(["jsonl", "tokenizer", "config", "safetensors"]))
    if kind == "jsonl":
        original = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
        path = folder / "chats.jsonl"
        path.write_bytes(_mangled((original + "\n").encode(), data))
        load = lambda: load_conversations(path)  # noqa: E731
    elif kind == "tokenizer":
        original = json.dumps({"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0}, "unk_token": "a"}})
        path = folder / "tokenizer.json"
        path.write_bytes(_mangled(original.encode(), data))
        load = lambda: load_tokenizer(path)  # noqa: E731
    else:
        for name in ("config.json", "model.safetensors"):
            (folder / name).write_bytes((hf_folder / name).read_bytes())
        target = folder / ("config.json" if kind == "config" else "model.safetensors")
        raw = target.read_bytes()
        if kind == "safetensors":  # mangle the JSON header (the first 8 + n bytes), keep the tensor bytes
            size = int.from_bytes(raw[:8], "little")
            raw = _mangled(raw[: 8 + size], data) + raw[8 + size :]
        else:
            raw = _mangled(raw, data)
        target.write_bytes(raw)
        load = lambda: hf.load(folder)  # noqa: E731
    try:
        load()
    except (ValueError, FileNotFoundError) as error:
        assert str(error).strip()
