"""DeepSeek-V3 and DeepSeek-V2 parity with Hugging Face transformers (the numerical reference), fp32 on CPU:
logits, loss and gradients of tiny random DeepseekV3ForCausalLM / DeepseekV2ForCausalLM models (multi-head latent
attention with and without the query latent, YaRN with mscale, interleaved and half-split RoPE, group-limited
routing with the correction bias, V2's softmax greedy and group-limited-greedy routers, shared experts, a dense first
layer), HF -> eqmoe -> HF round trips with and without multi-token-prediction tensors, the config allow-list and the
published sizes' parameter counts."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from eqmoe.checkpoints import hf
from eqmoe.models import deepseek_v2, deepseek_v3
from tests import hf_families as shared
from tests import tolerances

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}
V3_TINY = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=12,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    max_position_embeddings=512,
    rope_parameters=YARN,
    rope_interleave=True,
    tie_word_embeddings=False,
)
V3_CASES = {
    # (a) query latent, YaRN with mscale folded into the scale and a cos/sin factor of its own (mscale differs from
    # mscale_all_dim), 16 experts in 4 groups (2 kept), a dense layer; rms_norm_eps unlike the latent norms' 1e-6.
    "latent-yarn-grouped": dict(rope_parameters={**YARN, "mscale": 1.0}, rms_norm_eps=1e-5),
    # (b) no query latent (one q_proj), plain RoPE half-split, one group, raw top-k weights, two shared experts,
    # every layer MoE.
    "q-proj-half-split": dict(
        q_lora_rank=None,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
        max_position_embeddings=None,  # plain RoPE reads no context length: the export writes the default
        rope_interleave=False,
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        n_shared_experts=2,
        first_k_dense_replace=0,
        routed_scaling_factor=1.0,
    ),
}
V2_TINY = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=None,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=12,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_shared_experts=2,
    first_k_dense_replace=1,
    topk_method="greedy",
    routed_scaling_factor=1.0,
    max_position_embeddings=512,
    rope_parameters=YARN,
    tie_word_embeddings=False,
)
V2_CASES = {
    # (c) V2-Lite's shape: no query latent, softmax greedy top-k, not renormalised, YaRN.
    "lite-greedy": {},
    # (d) full V2's router: group_limited_greedy (a group scores its best expert), a query latent, scaled weights;
    # with -m slow (the router alone is re-derived in NumPy by default: test_v2_group_limited_greedy_selection_...)
    "group-limited-greedy": dict(
        q_lora_rank=24,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=16.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=None,
    ),
}


V3 = shared.Family("deepseek_v3", transformers.DeepseekV3ForCausalLM, V3_TINY, shared.perturb_router_and_norms)
V2 = shared.Family("deepseek_v2", transformers.DeepseekV2ForCausalLM, V2_TINY, shared.perturb_router_and_norms)
ALL = [(V3, name, case) for name, case in V3_CASES.items()] + [(V2, name, case) for name, case in V2_CASES.items()]
IDS = [f"{family.name}-{name}" for family, name, _ in ALL]
# with -m slow: V3's (b) (its q_proj is V2-Lite's (c), its half-split RoPE and one-group raw-weight routing with two
# shared experts over MoE-only layers GLM-4.5's qk-norm-tied case) and V2's (d) (its router: the NumPy test below)
SLOW = {"deepseek_v3-q-proj-half-split", "deepseek_v2-group-limited-greedy"}
PARAMS = [
    pytest.param(case, id=i, marks=[pytest.mark.slow] if i in SLOW else []) for case, i in zip(ALL, IDS, strict=True)
]


@pytest.fixture(params=PARAMS, name="saved")
def _saved(request, tmp_path):
    family, name, case = request.param
    family.save_tiny(tmp_path, seed=len(name), **case)
    return family, tmp_path


def test_logits_loss_and_gradients_match_transformers(saved):
    family, folder = saved
    reference, model = family.reference(folder), hf.load(folder)
    shared.assert_logits_match(reference, model)
    out, loss, terms = shared.losses(reference, model)
    np.testing.assert_allclose(float(terms["cross_entropy"]), out.loss.item(), rtol=1e-5)
    np.testing.assert_allclose(float(loss), out.loss.item(), rtol=1e-5)
    ours, expected = shared.gradients(reference, model)
    for key in [k for k in ours if k.endswith("e_score_correction_bias")]:  # a buffer in torch: no gradient
        np.testing.assert_array_equal(ours.pop(key), 0.0, err_msg=key)
    shared.assert_gradients_match(ours, expected)
    for part in ("kv_a_proj_with_mqa", "kv_b_proj", "kv_a_layernorm", ".mlp.experts.", ".shared_experts."):
        assert shared.largest(ours, part) > 1e-4, part


def test_round_trip_is_bit_exact(saved, tmp_path):
    family, folder = saved
    shared.assert_round_trip_bit_exact(family, folder, tmp_path / "back")


def _with_mtp(folder, into) -> dict[str, np.ndarray]:
    """``folder`` copied to ``into`` with a multi-token-prediction layer's tensors added (random, named as published
    DeepSeek-V3 folders name ``model.layers.{L}.*``: a copy of layer L-1's tensors plus its own pieces)."""
    tensors = load_file(folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    last, mtp = config["num_hidden_layers"] - 1, config["num_hidden_layers"]
    rng = np.random.default_rng(0)
    extra = {
        key.replace(f"model.layers.{last}.", f"model.layers.{mtp}."): rng.normal(size=value.shape).astype(value.dtype)
        for key, value in tensors.items()
        if key.startswith(f"model.layers.{last}.")
    }
    hidden = config["hidden_size"]
    extra |= {
        f"model.layers.{mtp}.enorm.weight": rng.normal(size=hidden).astype(np.float32),
        f"model.layers.{mtp}.hnorm.weight": rng.normal(size=hidden).astype(np.float32),
        f"model.layers.{mtp}.eh_proj.weight": rng.normal(size=(hidden, 2 * hidden)).astype(np.float32),
        f"model.layers.{mtp}.shared_head.norm.weight": rng.normal(size=hidden).astype(np.float32),
        f"model.layers.{mtp}.shared_head.head.weight": tensors["lm_head.weight"],
        f"model.layers.{mtp}.embed_tokens.weight": tensors["model.embed_tokens.weight"],
    }
    into.mkdir()
    save_file({**tensors, **extra}, into / "model.safetensors", metadata={"format": "pt"})
    (into / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return extra


def test_multi_token_prediction_tensors_are_kept_and_exported(tmp_path, capsys):
    """A folder holding the MTP layer loads it into the model's own ``mtp`` part (the causal LM's logits are
    unchanged) and exports it back bit for bit; a transformers-saved folder whose config says one MTP layer but
    holds none loads without it and says so on one line."""
    V3.save_tiny(tmp_path / "plain", seed=3)
    assert json.loads((tmp_path / "plain" / "config.json").read_text()).get("num_nextn_predict_layers", 1) == 1
    plain = hf.load(tmp_path / "plain")
    assert plain.config.mtp_layers == 0 and "multi-token-prediction" in capsys.readouterr().err

    extra = _with_mtp(tmp_path / "plain", tmp_path / "mtp")
    model = hf.load(tmp_path / "mtp")
    assert model.config.mtp_layers == 1 and len(model.mtp) == 1
    np.testing.assert_array_equal(np.asarray(model.mtp[0].eh_proj.weight), extra["model.layers.2.eh_proj.weight"].T)
    ids = jnp.arange(40).reshape(2, 20) % 97
    np.testing.assert_array_equal(np.asarray(model(ids).logits), np.asarray(plain(ids).logits))
    hf.save(model, tmp_path / "back")
    written = load_file(tmp_path / "back" / "model.safetensors")
    for key, value in {**load_file(tmp_path / "mtp" / "model.safetensors")}.items():
        np.testing.assert_array_equal(written[key], value, err_msg=key)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["num_nextn_predict_layers"] == 1

    # the model holds one embedding and one head: a copy that differs is refused, naming it
    tensors = load_file(tmp_path / "mtp" / "model.safetensors")
    tensors["model.layers.2.shared_head.head.weight"] = tensors["model.layers.2.shared_head.head.weight"] + 1
    save_file(tensors, tmp_path / "mtp" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"^[^\n]*model\.layers\.2\.shared_head\.head\.weight differs"):
        hf.load(tmp_path / "mtp")


def test_kimi_k2_model_type_reads_as_deepseek_v3(tmp_path):
    """Kimi K2's folders say ``model_type: kimi_k2`` with ``DeepseekV3ForCausalLM``; they read against
    DeepseekV3Config's keys, and the keys it does not define (``topk_method``, ``scoring_func``...) are listed."""
    config = {**V3.full_config(), "model_type": "kimi_k2", "topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    folder = shared.write_config(tmp_path / "kimi", config)
    assert hf.read_config(folder) == hf.read_config(shared.write_config(tmp_path / "v3", V3.full_config()))
    assert "topk_method" in deepseek_v3.FAMILY.ignored_keys(config)


def test_v2_refuses_what_it_cannot_compute(tmp_path):
    for field, value in (("topk_method", "noaux_tc"), ("mlp_bias", True), ("hidden_act", "gelu")):
        shared.assert_refused(tmp_path / field, {**V2.full_config(), field: value}, field)
    assert deepseek_v2.FAMILY.ignored_keys({**V2.full_config(), "scoring_func": "softmax"}) == ["scoring_func"]


# --- the published configs ------------------------------------------------------------------------------------

_V3_PUBLISHED = {  # deepseek-ai/DeepSeek-V3 config.json (V3.1 and R1 differ in none of these)
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}
_KIMI_K2 = {  # moonshotai/Kimi-K2-Instruct config.json
    **_V3_PUBLISHED,
    "model_type": "kimi_k2",
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 131072,
    "n_group": 1,
    "n_routed_experts": 384,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0,
    "rope_scaling": {
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827,
    "topk_group": 1,
    "vocab_size": 163840,
}
_MOONLIGHT = {  # moonshotai/Moonlight-16B-A3B config.json
    **{key: value for key, value in _V3_PUBLISHED.items() if key != "quantization_config"},
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "first_k_dense_replace": 1,
    "hidden_size": 2048,
    "intermediate_size": 11264,
    "max_position_embeddings": 8192,
    "moe_intermediate_size": 1408,
    "n_group": 1,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_attention_heads": 16,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 27,
    "num_key_value_heads": 16,
    "num_nextn_predict_layers": 0,
    "q_lora_rank": None,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.446,
    "topk_group": 1,
    "vocab_size": 163840,
}
_V2_LITE = {  # deepseek-ai/DeepSeek-V2-Lite config.json
    "architectures": ["DeepseekV2ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 10944,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 27,
    "num_key_value_heads": 16,
    "pretraining_tp": 1,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "greedy",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 102400,
}


@pytest.mark.parametrize(
    ("preset", "published", "family", "total", "mtp"),
    [
        ("deepseek-v3", _V3_PUBLISHED, V3, 671_026_404_352, 13_463_426_304),
        ("kimi-k2", _KIMI_K2, V3, 1_026_408_209_408, 0),
        ("moonlight-16b-a3b", _MOONLIGHT, V3, 15_960_108_544, 0),
        ("deepseek-v2-lite", _V2_LITE, V2, 15_706_484_224, 0),
    ],
)
def test_published_configs_read_as_the_presets_and_count_as_transformers(
    capsys, tmp_path, preset, published, family, total, mtp
):
    """The published config.json reads as the preset; param_report's total equals transformers' parameters on the
    meta device plus its e_score_correction_bias buffers (eqmoe counts the selection bias it moves), and the
    multi-token-prediction layer (DeepSeek-V3's 14B in its files, with the copies of the embedding and head it shares;
    not in transformers' causal LM) is counted apart."""
    folder = shared.write_config(tmp_path / preset, published)
    assert hf.read_config(folder) == (deepseek_v3.PRESETS | deepseek_v2.PRESETS)[preset]
    reference = family.on_meta(family.model_class.config_class.from_pretrained(folder))
    biases = sum(b.numel() for name, b in reference.named_buffers() if name.endswith("e_score_correction_bias"))
    assert shared.parameter_count(reference) == total
    report = shared.param_report(preset, capsys)
    assert (report["total"], report["mtp_in_files"]) == (total + biases, mtp)


def test_greedy_generation_from_the_latent_cache_equals_the_expanded_cache_and_transformers(tmp_path):
    """Left-padded prompts and 40 new tokens: decoding straight from the cached latents (``kv_b`` absorbed into the
    queries and the output, the default) gives the tokens of rebuilding every cached key and value first
    (``latent.decode="expanded"``), and both those of transformers' ``generate`` (greedy). The logits of one step
    agree to float rounding."""
    import dataclasses

    from eqmoe.inference import generate

    V3.save_tiny(tmp_path, seed=9, num_hidden_layers=2)  # a dense layer and a routed one
    reference, model = V3.reference(tmp_path), hf.load(tmp_path)
    latent = dataclasses.replace(model.config.attention.latent, decode="expanded")
    expanded = model.with_config(
        model.config.replace(attention=dataclasses.replace(model.config.attention, latent=latent))
    )
    assert model.config.attention.latent.decode == "absorbed"
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    ids = ids.masked_fill(mask == 0, 0)
    with torch.no_grad():
        expected = reference.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False).numpy()
    prompt, prompt_mask = jnp.asarray(ids.numpy()), jnp.asarray(mask.numpy() == 1)
    for decoder in (model, expanded):
        ours = generate(decoder, prompt, max_new_tokens=40, prompt_mask=prompt_mask)
        np.testing.assert_array_equal(np.asarray(ours), expected)
    steps = [m(prompt, token_mask=prompt_mask, cache=m.init_cache(2, 12)) for m in (model, expanded)]
    np.testing.assert_allclose(np.asarray(steps[0].logits), np.asarray(steps[1].logits), atol=1e-5, rtol=0)


def test_dense_and_blockwise_attention_agree_on_packed_rows(tmp_path):
    """Latent attention's values are narrower than its queries: the blockwise kernel (tiles of 16, so several per
    row) and the dense reference give the same logits on packed documents, and attention never crosses them."""
    import dataclasses

    V3.save_tiny(tmp_path, seed=2, num_hidden_layers=2, first_k_dense_replace=2)  # attention is what is compared
    model = hf.load(tmp_path)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 97, (2, 64)))
    segments = jnp.asarray(np.repeat([[1, 2, 3, 4], [1, 1, 2, 2]], 16, axis=1))

    def logits(backend: str, **inputs):
        attention = dataclasses.replace(model.config.attention, backend=backend, block_size=16)
        return np.asarray(model.with_config(model.config.replace(attention=attention))(ids, **inputs).logits)

    blockwise = logits("blockwise", segment_ids=segments)
    np.testing.assert_allclose(blockwise, logits("dense", segment_ids=segments), atol=2e-5, rtol=0)
    # row 0's second document alone, at the positions it has in the packed row
    attention = dataclasses.replace(model.config.attention, backend="dense")
    dense = model.with_config(model.config.replace(attention=attention))
    alone = dense(ids[:1, 16:32], positions=jnp.arange(16, 32)[None]).logits
    np.testing.assert_allclose(blockwise[0, 16:32], np.asarray(alone[0]), atol=2e-5, rtol=0)
    assert np.abs(blockwise[0, 16:32] - logits("dense")[0, 16:32]).max() > 1e-3  # packing changed what it sees


def _transformers_mtp(reference, tensors: dict[str, np.ndarray], layer: int):
    """transformers' ``MtpModel`` (one depth) on ``reference``, its weights copied from the published names
    ``model.layers.{layer}.*`` (per-expert tensors fused into its ``gate_up_proj`` / ``down_proj``)."""
    from transformers.modeling_layers import MtpModel

    mtp = MtpModel(reference, 1).eval()
    prefix, state = f"model.layers.{layer}.", {}
    for key, value in tensors.items():
        if not key.startswith(prefix) or ".experts." in key or "embed_tokens" in key or "shared_head.head" in key:
            continue
        name = key[len(prefix) :]
        if name.startswith(("enorm", "hnorm", "eh_proj")):
            state[f"layers.0.{name}"] = value
        elif name.startswith("shared_head.norm"):
            state["layers.0.post_norm.weight"] = value
        else:
            state[f"layers.0.mtp_block.{name}"] = value
    experts = reference.config.n_routed_experts
    expert = lambda e, part: tensors[f"{prefix}mlp.experts.{e}.{part}.weight"]  # noqa: E731
    state["layers.0.mtp_block.mlp.experts.gate_up_proj"] = np.stack(
        [np.concatenate([expert(e, "gate_proj"), expert(e, "up_proj")]) for e in range(experts)]
    )
    state["layers.0.mtp_block.mlp.experts.down_proj"] = np.stack([expert(e, "down_proj") for e in range(experts)])
    missing, unexpected = mtp.load_state_dict({k: torch.as_tensor(v) for k, v in state.items()}, strict=False)
    assert not unexpected and not [m for m in missing if "embed_tokens" not in m and "shared_head" not in m], missing
    return mtp


def test_mtp_logits_and_loss_equal_transformers_mtp_model(tmp_path):
    """Depth 1's logits equal transformers' MtpModel on the same weights (1e-4), and eqmoe's MTP loss term equals a
    NumPy cross-entropy over them; the causal LM's logits and loss are unchanged by it."""
    import dataclasses

    from eqmoe.losses import objective

    V3.save_tiny(tmp_path / "plain", seed=6, num_hidden_layers=1, first_k_dense_replace=0)
    extra = _with_mtp(tmp_path / "plain", tmp_path / "mtp")
    tensors = {**load_file(tmp_path / "mtp" / "model.safetensors"), **extra}
    model = hf.load(tmp_path / "mtp")
    model = model.with_config(
        model.config.replace(loss=dataclasses.replace(model.config.loss, mtp_weight=0.3)), allow=()
    )
    reference = V3.reference(tmp_path / "plain")
    mtp = _transformers_mtp(reference, tensors, layer=1)
    ids = torch.randint(0, 97, (2, 48), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(48)[None].expand(2, -1)
    with torch.no_grad():
        hidden = reference.model(ids).last_hidden_state
        ahead = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
        expected = mtp._project_to_logits(mtp.forward_layer(0, hidden, positions + 1, None, input_ids=ahead)).numpy()

    output = model(jnp.asarray(ids.numpy()))
    ours = np.asarray(output.mtp_logits[0])
    np.testing.assert_allclose(ours[:, :-1], expected[:, :-1], atol=1e-4, rtol=0)  # the last has no token ahead

    mask = jnp.ones(ids.shape, bool)
    _, terms = objective(output, jnp.asarray(ids.numpy()), mask, model.config)
    logits = expected[:, :-2].astype(np.float64)  # position i predicts token i + 2
    targets = ids.numpy()[:, 2:]
    log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    numpy_ce = np.mean(log_z - np.take_along_axis(logits, targets[..., None], -1)[..., 0])
    np.testing.assert_allclose(float(terms["mtp_cross_entropy"]), numpy_ce, rtol=1e-5)
    np.testing.assert_allclose(float(terms["loss"]), float(terms["cross_entropy"]) + 0.3 * numpy_ce, rtol=1e-5)


def test_v2_group_limited_greedy_selection_matches_the_published_rule():
    """DeepSeek-V2's ``group_limited_greedy`` as transformers' DeepseekV2TopkRouter computes it, in NumPy: softmax
    scores, each group scored by its best expert, the ``topk_group`` best groups kept (others masked with 0), the
    ``top_k`` largest kept scores times ``routed_scaling_factor``, not renormalised."""
    from eqmoe.config import RouterConfig
    from eqmoe.nn.router import STRATEGIES

    config = RouterConfig(
        num_experts=16,
        top_k=4,
        renormalize=False,
        routed_scaling_factor=16.0,
        expert_groups=4,
        expert_groups_kept=2,
        expert_group_score="max",
    )
    logits = np.random.default_rng(0).normal(0, 2, (500, 16)).astype(np.float32)
    weights, experts = STRATEGIES.get("softmax_top_k").route(jnp.asarray(logits), config, None)
    weights = np.asarray(weights) * config.routed_scaling_factor

    scores = np.exp(logits - logits.max(-1, keepdims=True))
    scores /= scores.sum(-1, keepdims=True)
    best_groups = np.argsort(-scores.reshape(500, 4, 4).max(-1), axis=-1, kind="stable")[:, :2]
    keep = np.zeros((500, 4), bool)
    np.put_along_axis(keep, best_groups, True, axis=-1)
    masked = np.where(np.repeat(keep, 4, axis=-1), scores, 0.0)
    chosen = np.argsort(-masked, axis=-1, kind="stable")[:, :4]
    np.testing.assert_array_equal(np.sort(np.asarray(experts), -1), np.sort(chosen, -1))
    expected = np.take_along_axis(masked, chosen, -1) * 16.0
    np.testing.assert_allclose(np.sort(weights, -1), np.sort(expected, -1), rtol=tolerances.ELEMENTWISE)
    ungrouped = np.argsort(-scores, axis=-1, kind="stable")[:, :4]
    assert (np.sort(ungrouped, -1) != np.sort(chosen, -1)).any(-1).mean() > 0.05  # the groups change the choice


def test_the_mtp_objective_trains_both_predictions():
    """Adam on ``loss = CE + 0.3 MTP`` over a fixed batch of ``deepseek-v3-micro``: both cross-entropies fall, and
    the MTP layer's parameters (role ``mtp``) receive a gradient."""
    import equinox as eqx
    import jax
    import optax

    from eqmoe import Transformer, presets
    from eqmoe.config_io import apply_overrides
    from eqmoe.losses import objective

    two_layers = [{"attention": "mla", "ffn": "dense"}, {"attention": "mla", "ffn": "moe"}]
    config = apply_overrides(presets.get("deepseek-v3-micro"), {"loss.mtp_weight": 0.3, "layers": two_layers})
    model = Transformer(config, key=jax.random.key(0))
    text = np.frombuffer(b"the cat sat on the mat; the dog sat on the log. " * 12, np.uint8).astype(np.int32)
    tokens = jnp.asarray(text[: 4 * 64].reshape(4, 64))
    mask = jnp.ones(tokens.shape, bool)
    params, static = eqx.partition(model, eqx.is_array)

    def loss(p):
        return objective(eqx.combine(p, static)(tokens), tokens, mask, config)

    optimizer = optax.adam(3e-3)

    @eqx.filter_jit
    def step(p, state):
        (_, terms), grads = jax.value_and_grad(loss, has_aux=True)(p)
        updates, state = optimizer.update(grads, state, p)
        return optax.apply_updates(p, updates), state, terms, grads

    state, history = optimizer.init(params), []
    for _ in range(15):
        params, state, terms, grads = step(params, state)
        history.append(terms)
    for term in ("cross_entropy", "mtp_cross_entropy"):
        assert float(history[-1][term]) < float(history[0][term]) - 0.5, term
    assert float(jnp.abs(grads.mtp[0].eh_proj.weight).max()) > 0


# -m slow (37 s): the objective's training runs by default (test_the_mtp_objective_trains_both_predictions); this is
# the pretrain command around it
@pytest.mark.slow
def test_pretrain_trains_the_mtp_objective(tmp_path):
    """``pretrain --preset deepseek-v3-micro --override loss.mtp_weight=0.3``: the MTP term is logged, both
    cross-entropies fall, and the MTP layer (frozen without the objective) is trained."""
    import json

    from eqmoe.checkpoints.model_checkpoint import load_model
    from eqmoe.config import LossConfig
    from eqmoe.params import Role
    from eqmoe.train.optimizer import OptimizerConfig, trained_roles
    from experiments import pretrain

    args = pretrain.Args(
        model=pretrain.ModelOptions(preset="deepseek-v3-micro", override=("loss.mtp_weight=0.3",)),
        data=pretrain.DataOptions(seq_len=64, batch_size=8, chars_per_domain=6_000, eval_chars_per_domain=1_500),
        run=pretrain.RunOptions(steps=24, out_dir=tmp_path, checkpoint_every=24, eval_every=24, log_every=4),
    )
    pretrain.run(args)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [row for row in rows if "mtp_cross_entropy" in row]
    assert len(logged) >= 5
    for term in ("cross_entropy", "mtp_cross_entropy"):
        assert logged[-1][term] < logged[0][term] - 0.5, (term, logged[0][term], logged[-1][term])
    trained, _ = load_model(tmp_path / "checkpoints")
    assert trained_roles(OptimizerConfig(), trained)(Role.MTP)
    without = trained.with_config(trained.config.replace(loss=LossConfig()))
    assert not trained_roles(OptimizerConfig(), without)(Role.MTP)
