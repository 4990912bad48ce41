"""Expert pruning (experiments.prune_experts, eqmoe.surgery): the REAP, frequency, router-weight and EAN scores against
a NumPy computation of their formulas from the safetensors weights and transformers' own MoE inputs; pruned and merged
folders that transformers loads with logits equal to eqmoe's; bad requests refused in one line with nothing written."""

import dataclasses
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from eqmoe import presets
from eqmoe.checkpoints import hf
from eqmoe.checkpoints.model_checkpoint import save_model
from eqmoe.model import Transformer
from eqmoe.surgery.expert_stats import Batch, collect_expert_stats
from experiments import prune_experts
from tests.conftest import load_reference, save_tiny_hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SMALL = dict(num_hidden_layers=2)  # 8 experts top-2, renormalised


def _word_tokenizer(path, size: int = 50) -> None:
    """A whitespace word tokenizer of the numbers ``0..size-4`` with the document delimiter and padding ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<|endoftext|>", "<|pad|>"] + [str(i) for i in range(size - 3)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))


def _calibration_text(path, words: int = 400) -> None:
    rng = np.random.default_rng(3)
    path.write_text(" ".join(str(i) for i in rng.integers(0, 48, words)) + "\n")


def _prune(capsys, source, out, **fields) -> tuple[int, str, str]:
    capsys.readouterr()
    fields = fields if "checkpoint" in fields else {"hf": source, **fields}
    code = prune_experts.main(prune_experts.Args(out_dir=out, **fields))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _transformers_logits(folder, ids: np.ndarray) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.numpy()


def _max_logit_difference(folder, vocab: int) -> float:
    ids = np.random.default_rng(1).integers(0, vocab, (2, 40))
    ours = np.asarray(eqx.filter_jit(lambda m, t: m(t).logits)(hf.load(folder), jnp.asarray(ids)))
    return float(np.abs(ours - _transformers_logits(folder, ids)).max())


# --- (a) the scores against NumPy ----------------------------------------------------------------------------------


def _numpy_scores(weights: dict, inputs: np.ndarray, layer: int, top_k: int) -> dict[str, np.ndarray]:
    """REAP, frequency, router-weight and EAN of one Qwen3-MoE layer from its safetensors weights and its MoE inputs
    ``[tokens, embed]``: softmax router, top-k renormalised, SwiGLU experts ``down(silu(gate x) * up x)``."""
    prefix = f"model.layers.{layer}.mlp."
    logits = inputs @ weights[prefix + "gate.weight"].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    gates = np.take_along_axis(probs, chosen, -1)
    gates /= gates.sum(-1, keepdims=True)
    experts = probs.shape[1]
    reap, counts, gate_sums, norm_sums = (np.zeros(experts) for _ in range(4))
    for j in range(experts):
        gate, up, down = (weights[f"{prefix}experts.{j}.{name}_proj.weight"] for name in ("gate", "up", "down"))
        g = inputs @ gate.T
        out = ((g / (1 + np.exp(-g))) * (inputs @ up.T)) @ down.T
        routed, rank = np.nonzero(chosen == j)
        counts[j] = len(routed)
        gate_sums[j] = gates[routed, rank].sum()
        reap[j] = (gates[routed, rank] * np.linalg.norm(out[routed], axis=-1)).sum() / max(len(routed), 1)
        norm_sums[j] = np.linalg.norm(out[routed], axis=-1).sum()
    tokens = len(inputs)
    return {"reap": reap, "frequency": counts / tokens, "router-weight": gate_sums / tokens, "ean": norm_sums / tokens}


def test_reap_frequency_router_weight_and_ean_scores_equal_their_formulas_in_numpy(tmp_path):
    save_tiny_hf(tmp_path, **SMALL)
    reference = load_reference(tmp_path)
    weights = {key: value.astype(np.float64) for key, value in load_file(tmp_path / "model.safetensors").items()}
    ids = np.random.default_rng(0).integers(0, 97, (3, 48)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, 30:] = 0  # right padding: left out of the statistics (and invisible to the real tokens before it)
    # transformers' MoE inputs (after post_attention_layernorm), captured where its MoE block reads them
    captured = {}
    hooks = [
        layer.mlp.register_forward_pre_hook(lambda _, args, i=i: captured.__setitem__(i, args[0].detach().numpy()))
        for i, layer in enumerate(reference.model.layers)
    ]
    with torch.no_grad():
        reference(torch.as_tensor(ids), attention_mask=torch.as_tensor(mask))
    for hook in hooks:
        hook.remove()

    positions = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape)
    stats = collect_expert_stats(hf.load(tmp_path), [Batch(ids, mask.astype(np.int32), positions)])
    assert stats.tokens == mask.sum() and stats.layers.tolist() == [0, 1]
    real = mask.reshape(-1).astype(bool)
    for layer in (0, 1):
        inputs = captured[layer].reshape(-1, captured[layer].shape[-1])[real].astype(np.float64)
        expected = _numpy_scores(weights, inputs, layer, top_k=2)
        for criterion, values in expected.items():
            np.testing.assert_allclose(stats.scores(criterion)[layer], values, rtol=2e-5, atol=1e-7, err_msg=criterion)
        assert stats.counts[layer].sum() == 2 * mask.sum()


# --- (b) pruned folders in transformers ----------------------------------------------------------------------------


@pytest.fixture(name="qwen3")
def _qwen3(tmp_path):
    source = tmp_path / "source"
    save_tiny_hf(source, **SMALL)
    _word_tokenizer(source / "tokenizer.json")
    _calibration_text(tmp_path / "calibration.txt")
    return source, tmp_path / "calibration.txt"


@pytest.mark.parametrize("merge", [False, True], ids=["prune", "merge"])
def test_a_qwen3_moe_cut_to_half_its_experts_loads_in_transformers_with_equal_logits(qwen3, tmp_path, capsys, merge):
    source, data = qwen3
    out = tmp_path / "pruned"
    code, printed, err = _prune(capsys, source, out, data=(data,), keep=4, merge=merge, calibration_tokens=256)
    assert code == 0, err
    assert "reap scores" in printed and "8 routed experts per layer" in printed
    config = json.loads((out / "config.json").read_text())
    assert config["num_experts"] == 4 and config["num_experts_per_tok"] == 2
    assert {"tokenizer.json", "expert_scores.json", "expert_scores.png"} <= {p.name for p in out.iterdir()}
    report = json.loads((out / "expert_scores.json").read_text())
    assert report["calibration_tokens"] == 256 and len(report["kept"]) == 2
    for layer, kept in enumerate(report["kept"]):  # the four best REAP scores of each layer
        assert sorted(kept) == sorted(np.argsort(report["scores"]["reap"][layer])[::-1][:4].tolist())
    original, written = load_file(source / "model.safetensors"), load_file(out / "model.safetensors")
    for layer, kept in enumerate(report["kept"]):
        gate = f"model.layers.{layer}.mlp.gate.weight"
        np.testing.assert_array_equal(written[gate], original[gate][kept])
        if not merge:  # the kept experts as they were
            for new, old in enumerate(kept):
                key = "model.layers.{}.mlp.experts.{}.down_proj.weight"
                np.testing.assert_array_equal(written[key.format(layer, new)], original[key.format(layer, old)])
    assert (report["merged_into_kept"] is not None) == merge
    error = _max_logit_difference(out, 97)
    assert error <= 1e-4, error


def test_a_deepseek_v3_with_grouped_sigmoid_routing_cut_to_half_loads_with_equal_logits(tmp_path, capsys):
    from tests.test_deepseek import V3, V3_CASES

    source = tmp_path / "source"
    V3.save_tiny(source, **V3_CASES["latent-yarn-grouped"])
    _word_tokenizer(source / "tokenizer.json")
    _calibration_text(tmp_path / "calibration.txt")
    out = tmp_path / "pruned"
    code, _, err = _prune(capsys, source, out, data=(tmp_path / "calibration.txt",), ratio=0.5, calibration_tokens=256)
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    assert (config["n_routed_experts"], config["n_group"], config["n_shared_experts"]) == (8, 4, 1)
    kept = json.loads((out / "expert_scores.json").read_text())["kept"][0]
    assert [e // 4 for e in kept] == [0, 0, 1, 1, 2, 2, 3, 3]  # two of each group of four
    original, written = load_file(source / "model.safetensors"), load_file(out / "model.safetensors")
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    np.testing.assert_array_equal(written[bias], original[bias][kept])
    shared = "model.layers.1.mlp.shared_experts.up_proj.weight"
    np.testing.assert_array_equal(written[shared], original[shared])
    error = _max_logit_difference(out, 97)
    assert error <= 1e-4, error


def test_conversations_calibrate_through_the_chat_template(tmp_path, capsys):
    source = tmp_path / "source"
    save_tiny_hf(source, **SMALL, vocab_size=260)  # no tokenizer file: eqmoe's byte tokenizer and ChatML
    chats = tmp_path / "chats.jsonl"
    turns = [[{"role": "user", "content": f"{a}+{a}?"}, {"role": "assistant", "content": str(2 * a)}] for a in range(9)]
    chats.write_text("".join(json.dumps({"messages": messages}) + "\n" for messages in turns))
    code, printed, err = _prune(capsys, source, tmp_path / "pruned", data=(chats,), keep=6, calibration_tokens=10_000)
    assert code == 0, err
    texts = [f"<|im_start|>user\n{a}+{a}?<|im_end|>\n<|im_start|>assistant\n{2 * a}<|im_end|>\n" for a in range(9)]
    # one id per byte, one per special token (two <|im_start|> and two <|im_end|> a conversation), and the delimiter
    expected = sum(
        len(text.encode()) - 2 * (len("<|im_start|>") - 1) - 2 * (len("<|im_end|>") - 1) + 1 for text in texts
    )
    report = json.loads((tmp_path / "pruned" / "expert_scores.json").read_text())
    assert report["calibration_tokens"] == expected


# Every other family with routed experts, pruned and merged: gpt-oss by default (its softmax over the top-k logits,
# router and expert biases, clamped SwiGLU and fused interleaved gate_up_proj), the rest with -m slow.
OTHER_FAMILIES = ("gpt_oss", "mixtral", "olmoe", "qwen2_moe", "glm4_moe", "deepseek_v2", "qwen3_next", "qwen3_5_moe")


@pytest.mark.parametrize(
    "family", [f if f == "gpt_oss" else pytest.param(f, marks=pytest.mark.slow) for f in OTHER_FAMILIES]
)
def test_every_family_with_routed_experts_cut_to_half_loads_with_equal_logits(family, tmp_path, capsys):
    from tests.test_family_commands import _saver

    source = tmp_path / "source"
    _saver(family)(source, seed=0)
    _word_tokenizer(source / "tokenizer.json")
    _calibration_text(tmp_path / "calibration.txt")
    router = hf.read_config(source).moe.router
    keep = max(router.top_k, router.num_experts // 2)
    for merge in (False, True):
        out = tmp_path / f"pruned-{merge}"
        fields = dict(data=(tmp_path / "calibration.txt",), keep=keep, merge=merge, calibration_tokens=256)
        code, _, err = _prune(capsys, source, out, **fields)
        assert code == 0, err
        assert hf.read_config(out).moe.router.num_experts == keep
        error = _max_logit_difference(out, hf.read_config(out).vocab_size)
        assert error <= 1e-4, (merge, error)


# --- (c) bad requests ----------------------------------------------------------------------------------------------


def test_bad_requests_are_one_line_exit_2_and_write_nothing(tmp_path, capsys):
    from tests.test_deepseek import V3, V3_CASES

    moe, dense, grouped = tmp_path / "moe", tmp_path / "dense", tmp_path / "grouped"
    save_tiny_hf(moe, **SMALL)
    micro = presets.get("qwen3-moe-micro")
    all_dense = micro.replace(layers=tuple(dataclasses.replace(layer, ffn="dense") for layer in micro.layers))
    save_model(Transformer(all_dense, key=jax.random.key(0)), dense)  # no routed layer
    envy = tmp_path / "envy"  # AXLearn's Top2Gating with capacity: an expert's capacity depends on the expert count
    save_model(Transformer(presets.get("envy-test"), key=jax.random.key(0)), envy)
    V3.save_tiny(grouped, **V3_CASES["latent-yarn-grouped"])  # 16 experts in 4 groups
    qwen3_dense = tmp_path / "qwen3"
    transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(
            vocab_size=97,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        )
    ).save_pretrained(qwen3_dense)
    cases = [
        (moe, dict(keep=12), "keep 12 experts: the layers have 8 experts"),
        (moe, dict(keep=1), "keep 1 experts: the layers have 8 experts top-2"),
        (moe, dict(keep=4, ratio=0.5), "give one of --keep N"),
        (None, dict(checkpoint=dense, keep=4), "no routed experts (a dense model)"),
        (qwen3_dense, dict(keep=4), "no routed experts (a dense model)"),  # a dense family's own folder
        (grouped, dict(keep=6), "group-limited routing over 4 groups"),
        (None, dict(checkpoint=envy, keep=4), "routing strategy 'top2_gating': pruning is defined for softmax or"),
    ]
    for source, fields, expected in cases:
        out = tmp_path / "out"
        code, _, err = _prune(capsys, source, out, **fields)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("prune_experts: "), (fields, err)
        assert expected in lines[0], lines[0]
        assert not out.exists() and not list(tmp_path.glob(".out*")), fields
