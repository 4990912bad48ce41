"""GLM-4.5 MoE parity with Hugging Face transformers (the numerical reference), fp32 on CPU: logits, loss and
gradients of tiny random Glm4MoeForCausalLM models, group-limited routing with a nonzero
e_score_correction_bias, that bias loaded as eqmoe's aux-loss-free selection bias and trained on, HF -> eqmoe
-> HF round trips, the skipped multi-token-prediction layers, the config allow-list and the published
sizes' parameter counts."""

import dataclasses
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from eqmoe import Transformer
from eqmoe.checkpoints import hf
from eqmoe.models import glm4_moe
from eqmoe.nn.moe import MoE
from eqmoe.train.optimizer import OptimizerConfig, make_optimizer
from eqmoe.train.state import init_state
from eqmoe.train.step import Batch, make_train_step
from tests import hf_families as shared

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    attention_bias=True,
    use_qk_norm=False,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)
CASES = {  # None drops the field (transformers then derives it)
    # (a) 16 experts in 4 groups, 2 kept; a dense first layer; q/k/v biases; half the head rotates; GQA, untied.
    "grouped-biased-untied": {},
    # (b) one group; per-head QK-norm; a quarter of the head rotates; every layer MoE; two shared experts;
    # raw top-k weights; a single KV head; tied embeddings; head_dim derived from hidden_size / heads.
    "qk-norm-tied": dict(
        hidden_size=64,
        head_dim=None,
        num_key_value_heads=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        use_qk_norm=True,
        attention_bias=False,
        first_k_dense_replace=0,
        n_shared_experts=2,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
    ),
}


GLM = shared.Family("glm4_moe", transformers.Glm4MoeForCausalLM, TINY, shared.perturb_router_and_norms)
saved = shared.saved_fixture(GLM, CASES)


def test_config_reads_as_glm(saved):
    config = hf.read_config(saved)
    reference = transformers.Glm4MoeConfig.from_pretrained(saved)
    attention, router = config.attention, config.moe.router
    head_dim = getattr(reference, "head_dim", reference.hidden_size // reference.num_attention_heads)
    assert config.family == "glm4_moe" and attention.head_dim == head_dim
    assert attention.rotary_dim == int(head_dim * reference.rope_parameters["partial_rotary_factor"])
    assert attention.bias == ("qkv" if reference.attention_bias else "none")
    assert attention.qk_norm == ("before_rope" if reference.use_qk_norm else "none")
    assert config.ffn_kinds() == tuple(
        "dense" if i < reference.first_k_dense_replace else "moe" for i in range(reference.num_hidden_layers)
    )
    assert router.strategy == "sigmoid_top_k" and router.renormalize == reference.norm_topk_prob
    assert (router.expert_groups, router.expert_groups_kept) == (reference.n_group, reference.topk_group)
    assert router.routed_scaling_factor == reference.routed_scaling_factor and router.bias_update_rate == 0.001
    assert config.moe.shared_width == reference.moe_intermediate_size * reference.n_shared_experts
    assert not config.moe.shared_expert_gate and config.loss.load_balance_weight == 0.0
    assert config.tie_embeddings == reference.tie_word_embeddings


def test_logits_match_transformers(saved):
    shared.assert_logits_match(GLM.reference(saved), hf.load(saved))


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def _chosen(logits, bias, top_k, groups, kept):
    """transformers' Glm4MoeTopkRouter selection in NumPy: the ``top_k`` experts by ``sigmoid + bias`` among
    the ``kept`` groups with the largest sum of their two best choice scores. ``[tokens, experts]`` one-hot."""
    choice = _sigmoid(logits.astype(np.float64)) + bias
    tokens, experts = choice.shape
    by_group = np.sort(choice.reshape(tokens, groups, -1), axis=-1)[..., -2:].sum(-1)
    best_groups = np.argsort(-by_group, axis=-1, kind="stable")[:, :kept]
    allowed = np.zeros((tokens, groups), bool)
    np.put_along_axis(allowed, best_groups, True, axis=-1)
    masked = np.where(np.repeat(allowed, experts // groups, axis=-1), choice, -np.inf)
    chosen = np.zeros_like(choice, dtype=bool)
    np.put_along_axis(chosen, np.argsort(-masked, axis=-1, kind="stable")[:, :top_k], True, axis=-1)
    return chosen


def _router_biases(folder: Path) -> list[np.ndarray]:
    """Each MoE layer's e_score_correction_bias in the checkpoint, in layer order."""
    tensors = load_file(folder / "model.safetensors")
    keys = sorted((k for k in tensors if k.endswith("e_score_correction_bias")), key=lambda k: int(k.split(".")[2]))
    return [tensors[k] for k in keys]


def _reference_choices(reference, ids, folder: Path) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per MoE layer, transformers' router logits and the experts it chose for every token (re-derived)."""
    config = reference.config
    with torch.no_grad():
        router_logits = [logits.numpy() for logits in reference(ids, output_router_logits=True).router_logits]
    biases = _router_biases(folder)
    assert len(router_logits) == len(biases) > 0
    choices = [
        _chosen(logits, bias, config.num_experts_per_tok, config.n_group, config.topk_group)
        for logits, bias in zip(router_logits, biases, strict=True)
    ]
    return router_logits, choices


def test_group_limited_selection_with_the_correction_bias_matches_transformers(tmp_path):
    """Config (a): keeping 2 of 4 groups and the loaded correction bias both change which experts are chosen,
    and eqmoe's per-layer expert counts equal transformers' choices (re-derived in NumPy from its logits)."""
    GLM.save_tiny(tmp_path, seed=5)
    reference = GLM.reference(tmp_path)
    model = hf.load(tmp_path)
    config = reference.config
    ids = torch.randint(0, config.vocab_size, (2, shared.SEQ), generator=torch.Generator().manual_seed(3))
    router_logits, choices = _reference_choices(reference, ids, tmp_path)
    counts = np.asarray(model(jnp.asarray(ids.numpy())).aux.expert_counts)
    np.testing.assert_array_equal(counts, np.stack([c.sum(0) for c in choices]))

    k = config.num_experts_per_tok
    for logits, bias, chosen in zip(router_logits, _router_biases(tmp_path), choices, strict=True):
        ungrouped = _chosen(logits, bias, k, 1, 1)
        unbiased = _chosen(logits, np.zeros_like(bias), k, config.n_group, config.topk_group)
        assert (ungrouped != chosen).any(axis=-1).mean() > 0.05  # group limiting changes many tokens' experts
        assert (unbiased != chosen).any(axis=-1).mean() > 0.05  # so does the correction bias


def test_loss_matches_transformers(saved):
    """transformers' GLM has no auxiliary loss (its output's loss is the cross-entropy alone, and eqmoe's GLM
    config trains none), so the cross-entropy is the whole comparison."""
    out, loss, terms = shared.losses(GLM.reference(saved), hf.load(saved))
    assert out.aux_loss is None
    np.testing.assert_allclose(float(terms["cross_entropy"]), out.loss.item(), rtol=1e-5)
    np.testing.assert_allclose(float(loss), out.loss.item(), rtol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_match_torch(tmp_path, case):
    """e_score_correction_bias is a buffer in torch (no gradient); eqmoe's selection bias gets exactly none."""
    GLM.save_tiny(tmp_path, seed=4, **CASES[case])
    ours, expected = shared.gradients(GLM.reference(tmp_path), hf.load(tmp_path))
    for key in [k for k in ours if k.endswith("e_score_correction_bias")]:
        np.testing.assert_array_equal(ours.pop(key), 0.0, err_msg=key)
    shared.assert_gradients_match(ours, expected)
    assert shared.largest(ours, ".mlp.experts.") > 1e-3
    assert shared.largest(ours, ".shared_experts.") > 1e-3


def _routers(model: Transformer) -> list:
    """Every MoE layer's router in layer order (stacked repeats sliced out)."""
    routers = []
    for segment in model.segments:
        for r in range(segment.repeats):
            for block in segment.blocks:
                if isinstance(block.ffn, MoE):
                    routers.append(jax.tree.map(lambda leaf, r=r: leaf[r], block.ffn.router))
    return routers


def test_correction_bias_loads_as_the_selection_bias_trains_and_exports(tmp_path):
    """Must-show 3: e_score_correction_bias loads as eqmoe's aux-loss-free selection bias, one train step
    moves it by exactly ``rate * sign(mean load - load)`` (the loads being transformers' choices on the
    batch), and the export writes the moved bias back as e_score_correction_bias."""
    GLM.save_tiny(tmp_path / "hf", seed=6, num_hidden_layers=2, first_k_dense_replace=0)  # 2 MoE layers, 1 scan
    reference = GLM.reference(tmp_path / "hf")
    model = hf.load(tmp_path / "hf")
    loaded = _router_biases(tmp_path / "hf")
    for router, bias in zip(_routers(model), loaded, strict=True):
        assert router.bias.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(router.bias), bias)

    tokens = torch.randint(0, reference.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(4))
    _, choices = _reference_choices(reference, tokens, tmp_path / "hf")
    counts = [c.sum(0).astype(np.float32) for c in choices]
    rate = np.float32(model.config.moe.router.bias_update_rate)
    expected = [bias + rate * np.sign(c.mean() - c) for bias, c in zip(loaded, counts, strict=True)]
    assert all((np.sign(c.mean() - c) != 0).any() for c in counts)

    optimizer, schedule = make_optimizer(
        OptimizerConfig(learning_rate=1e-3, warmup_steps=0), eqx.filter(model, eqx.is_array), embed_dim=32
    )
    state = init_state(model, optimizer, key=jax.random.key(0))
    ids = jnp.asarray(tokens.numpy())
    batch = Batch(ids, jnp.ones_like(ids), jnp.broadcast_to(jnp.arange(32), ids.shape), jnp.ones(ids.shape, bool))
    new_state, _ = make_train_step(optimizer, schedule)(batch, state)
    trained = new_state.model
    for router, bias in zip(_routers(trained), expected, strict=True):
        np.testing.assert_array_equal(np.asarray(router.bias), bias)

    hf.save(trained, tmp_path / "back")
    for exported, bias in zip(_router_biases(tmp_path / "back"), expected, strict=True):
        np.testing.assert_array_equal(exported, bias)
    back = GLM.reference(tmp_path / "back")
    for layer, bias in zip(back.model.layers, expected, strict=True):
        np.testing.assert_array_equal(layer.mlp.gate.e_score_correction_bias.numpy(), bias)


def test_hf_to_eqmoe_to_hf_is_bit_exact(saved, tmp_path):
    shared.assert_round_trip_bit_exact(GLM, saved, tmp_path / "back", derive_head_dim=True)


def test_hub_key_names(saved):
    keys = set(load_file(saved / "model.safetensors"))
    config = hf.read_config(saved)
    last = config.num_layers - 1
    assert f"model.layers.{last}.mlp.gate.e_score_correction_bias" in keys
    assert {f"model.layers.{last}.mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")} <= keys
    assert {f"model.layers.{last}.mlp.experts.3.{p}_proj.weight" for p in ("gate", "up", "down")} <= keys
    assert ("model.layers.0.self_attn.q_proj.bias" in keys) == (config.attention.bias == "qkv")
    assert "model.layers.0.self_attn.o_proj.bias" not in keys
    assert shared.named_keys(GLM, saved) == keys


def test_mtp_layer_tensors_are_skipped_as_transformers_skips_them(tmp_path):
    """The Hub's checkpoints hold the multi-token-prediction layer as ``model.layers.46.*`` (Air) or
    ``model.layers.92.*``; transformers ignores those tensors and so does eqmoe, and other strays still fail."""
    GLM.save_tiny(tmp_path / "hf", seed=7)
    path = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(path)
    mtp = {
        "model.layers.46.eh_proj.weight": np.ones((32, 64), np.float32),
        "model.layers.46.mlp.gate.e_score_correction_bias": np.ones(16, np.float32),
        "model.layers.92.enorm.weight": np.ones(32, np.float32),
    }
    save_file({**tensors, **mtp}, str(path), metadata={"format": "pt"})
    GLM.reference(tmp_path / "hf")  # transformers loads it (and says nothing of the MTP tensors it skips)
    model = hf.load(tmp_path / "hf")
    for key, value in hf.state_dict(model).items():
        np.testing.assert_array_equal(value, tensors[key], err_msg=key)
    hf.save(model, tmp_path / "back")
    assert set(load_file(tmp_path / "back" / "model.safetensors")) == set(tensors)

    save_file({**tensors, "model.layers.5.eh_proj.weight": np.ones((32, 64), np.float32)}, str(path))
    with pytest.raises(ValueError, match=r"unexpected tensor model\.layers\.5\.eh_proj\.weight"):
        hf.load(tmp_path / "hf")


def _published(**changes) -> dict:
    """GLM-4.5-Air's config.json as the Hub publishes it (transformers 4.54's form: top-level rope_theta and
    partial_rotary_factor, rope_scaling null, torch_dtype, the MTP layer count), with ``changes``."""
    config = {
        "architectures": ["Glm4MoeForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "pad_token_id": 151329,
        "eos_token_id": [151329, 151336, 151338],
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "partial_rotary_factor": 0.5,
        "initializer_range": 0.02,
        "intermediate_size": 10944,
        "max_position_embeddings": 131072,
        "model_type": "glm4_moe",
        "moe_intermediate_size": 1408,
        "norm_topk_prob": True,
        "num_attention_heads": 96,
        "n_group": 1,
        "topk_group": 1,
        "n_routed_experts": 128,
        "n_shared_experts": 1,
        "routed_scaling_factor": 1.0,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 1,
        "num_hidden_layers": 46,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.54.0",
        "use_cache": True,
        "use_qk_norm": False,
        "vocab_size": 151552,
    }
    return {key: value for key, value in {**config, **changes}.items() if value is not ...}


GLM_45 = dict(  # zai-org/GLM-4.5's differences from GLM-4.5-Air
    hidden_size=5120,
    intermediate_size=12288,
    num_hidden_layers=92,
    moe_intermediate_size=1536,
    n_routed_experts=160,
    first_k_dense_replace=3,
    use_qk_norm=True,
    routed_scaling_factor=2.5,
)


@pytest.mark.parametrize(("preset", "changes"), [("glm-4.5-air", {}), ("glm-4.5", GLM_45)])
def test_published_config_reads_as_the_preset(tmp_path, preset, changes):
    folder = shared.write_config(tmp_path / preset, _published(**changes))
    assert hf.read_config(folder) == glm4_moe.PRESETS[preset]
    reference = transformers.Glm4MoeConfig.from_pretrained(folder)
    assert reference.rope_parameters == {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}


def test_partial_rotary_factor_defaults_to_half_and_full_rotary_round_trips(tmp_path):
    """Without partial_rotary_factor anywhere transformers' GLM rotates half of each head; with 1.0 (written
    by eqmoe for a fully rotating head) the whole head."""
    config = hf.read_config(shared.write_config(tmp_path / "default", _published(partial_rotary_factor=...)))
    assert config.attention.rotary_dim == 64
    reference = transformers.Glm4MoeConfig.from_pretrained(tmp_path / "default")
    assert reference.rope_parameters["partial_rotary_factor"] == 0.5
    full = config.replace(attention=dataclasses.replace(config.attention, rotary_dim=None))
    written = glm4_moe.config_to_hf(full)
    assert written["rope_parameters"]["partial_rotary_factor"] == 1.0
    assert hf.read_config(shared.write_config(tmp_path / "full", written)).attention.rotary_dim is None


def _count(config) -> tuple[int, int]:
    """transformers' parameter count on the meta device, and its e_score_correction_bias buffers."""
    model = GLM.on_meta(config)
    buffers = sum(b.numel() for name, b in model.named_buffers() if name.endswith("e_score_correction_bias"))
    return shared.parameter_count(model), buffers


@pytest.mark.parametrize(
    ("preset", "changes", "parameters", "biases"),
    [
        ("glm-4.5-air", {}, 106_852_245_504, 45 * 128),
        ("glm-4.5", GLM_45, 352_797_814_784, 89 * 160),
    ],
)
def test_published_parameter_count_equals_transformers(capsys, tmp_path, preset, changes, parameters, biases):
    """param_report counts every array of the model, so the selection biases too: transformers' parameters
    plus its e_score_correction_bias buffers (one per routed expert of each MoE layer)."""
    report = shared.param_report(preset, capsys)
    folder = shared.write_config(tmp_path / preset, _published(**changes))
    assert _count(transformers.Glm4MoeConfig.from_pretrained(folder)) == (parameters, biases)
    assert report["total"] == parameters + biases
    bias_rows = [row for row in report["parameters"] if row["path"].endswith("router.bias")]
    assert sum(row["count"] for row in bias_rows) == biases


def test_every_field_transformers_writes_loads(tmp_path):
    config = hf.read_config(shared.write_config(tmp_path / "full", GLM.full_config()))
    assert config.attention.num_kv_heads == 2 and config.norm.eps == 1e-5 and config.attention.rotary_dim == 8
    assert config.moe.router.expert_groups == 4


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("hidden_act", "gelu"),
        ("attention_dropout", 0.1),
        ("n_group", 3),  # does not divide the 16 experts
        ("topk_group", 5),  # more than the 4 groups
        ("n_shared_experts", 0),
        ("routed_scaling_factor", "2.5"),
        ("use_qk_norm", "yes"),
    ],
)
def test_unsupported_field_is_refused_naming_field_and_file(tmp_path, field, value):
    shared.assert_refused(tmp_path / "model", {**GLM.full_config(), field: value}, field)


def test_save_refuses_what_glm_cannot_express(tmp_path):
    GLM.save_tiny(tmp_path / "hf")
    config = hf.read_config(tmp_path / "hf")
    moe, attention = config.moe, config.attention
    refused = {
        "layers": config.replace(layers=tuple(["moe", "dense", "moe"])),
        "attention.bias": config.replace(attention=dataclasses.replace(attention, bias="qkvo")),
        "moe.router.bias_update_rate": config.replace(
            moe=dataclasses.replace(moe, router=dataclasses.replace(moe.router, bias_update_rate=0.0))
        ),
        "moe.shared_expert_gate": config.replace(moe=dataclasses.replace(moe, shared_expert_gate=True)),
        "moe.router.strategy": config.replace(
            moe=dataclasses.replace(moe, router=dataclasses.replace(moe.router, strategy="softmax_top_k"))
        ),
    }
    for field, bad in refused.items():
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            glm4_moe.config_to_hf(bad)
    abstract = eqx.filter_eval_shape(Transformer, refused["layers"], key=jax.random.key(0))
    with pytest.raises(ValueError, match="layers"):
        hf.save(abstract, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("key", "value"), [("foo", 1)])
def test_a_key_transformers_ignores_is_accepted_and_listed(tmp_path, capsys, key, value):
    """Not a field of transformers' config for this model type: transformers ignores it; eqmoe too, saying so."""
    shared.assert_ignored(tmp_path, {**GLM.full_config(), key: value}, key, capsys)
