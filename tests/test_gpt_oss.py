"""gpt-oss parity with Hugging Face transformers (the numerical reference), fp32 on CPU: logits, losses and gradients
(sinks included) of tiny random GptOssForCausalLM models with windows smaller than the prompts, alternating and
irregular ``layer_types`` and YaRN; the bit-exact round trip; the published MXFP4 layout; decoding with the
window ring; the published configs and parameter counts."""

import dataclasses
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqmoe.checkpoints import hf
from eqmoe.inference import generate
from eqmoe.models import gpt_oss
from tests import hf_families as shared
from tests.mxfp4_files import mxfp4_folder_from
from tests.test_qwen3_parity import _our_loss

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=24,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=8,
)
CASES = {
    # transformers' defaults: sliding / full alternating from layer 0, YaRN x32 (truncate false), window 8
    "alternating-window-8": {},
    # an irregular layout with a window of 16, YaRN x4 truncated, clamps and a sigmoid gain that bite
    "irregular-window-16": dict(
        num_hidden_layers=4,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        sliding_window=16,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "truncate": True,
        },
        swiglu_limit=0.3,
        swiglu_alpha=1.2,
        num_key_value_heads=1,
    ),
}


def perturb(name: str, tensor) -> None:
    """Norms, biases and sinks off their initial values, sinks large enough to take a real share of each softmax,
    the matrices five times transformers' initial spread (the router's choices and the clamps then matter)."""
    if name.endswith(("norm.weight", "bias")):
        tensor.add_(0.2 * torch.randn_like(tensor))
    elif name.endswith("sinks"):
        tensor.normal_(0.0, 1.0)
    elif name.endswith(("_proj", "proj.weight", "router.weight")):
        tensor.mul_(5.0)


GPT_OSS = shared.Family("gpt_oss", transformers.GptOssForCausalLM, TINY, perturb)
saved = shared.saved_fixture(GPT_OSS, CASES)


def test_config_reads_as_gpt_oss(saved):
    config = hf.read_config(saved)
    reference = transformers.GptOssConfig.from_pretrained(saved)
    windows = [reference.sliding_window if kind == "sliding_attention" else None for kind in reference.layer_types]
    assert [layer.window for layer in config.layers] == windows
    assert config.attention.sinks and config.attention.bias == "qkvo" and config.attention.qk_norm == "none"
    moe = config.moe
    assert moe.activation == "clamped_swiglu" and moe.expert_bias and moe.router.gate_bias
    assert (moe.swiglu_limit, moe.swiglu_alpha) == (reference.swiglu_limit, reference.swiglu_alpha)
    assert moe.router.strategy == "top_k_softmax" and config.attention.rope_scaling.rope_type == "yarn"


def test_logits_match_transformers(saved):
    """Two rows of 300 tokens: every sliding layer sees far more than its window."""
    shared.assert_logits_match(GPT_OSS.reference(saved), hf.load(saved))


def test_loss_and_aux_loss_match_transformers(tmp_path):
    GPT_OSS.save_tiny(tmp_path, seed=3, router_aux_loss_coef=0.02)
    shared.assert_loss_and_aux_loss_match(GPT_OSS.reference(tmp_path), hf.load(tmp_path), weight=0.02)


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_match_torch(tmp_path, case):
    """Every parameter's gradient, the sinks', router bias' and expert biases' included, on padded rows of 64 tokens
    (windows of 8 and 16)."""
    GPT_OSS.save_tiny(tmp_path, seed=4, router_aux_loss_coef=0.05, **CASES[case])
    reference, model = GPT_OSS.reference(tmp_path), hf.load(tmp_path)
    ids, mask, labels = shared.padded_batch(reference.config.vocab_size, seq=64)
    reference(ids, attention_mask=mask, labels=labels, output_router_logits=True).loss.backward()
    # gpt-oss's files hold the experts fused as transformers does in memory: its parameter names are the files'
    expected = {name: param.grad.numpy() for name, param in reference.named_parameters()}
    grads, _ = eqx.filter_jit(jax.grad(_our_loss(model, ids, mask), has_aux=True))(model)
    ours = hf.state_dict(grads)
    assert shared.largest(expected, "sinks") > 1e-4 and shared.largest(expected, "gate_up_proj_bias") > 1e-3
    shared.assert_gradients_match(ours, expected)


def test_hf_to_eqmoe_to_hf_is_bit_exact(saved, tmp_path):
    shared.assert_round_trip_bit_exact(GPT_OSS, saved, tmp_path / "back")


def test_hub_key_names(saved):
    from safetensors.numpy import load_file

    assert shared.named_keys(GPT_OSS, saved) == set(load_file(saved / "model.safetensors"))


def test_published_mxfp4_folder_loads_every_weight_and_the_logits_of_transformers(tmp_path):
    """A tiny model in the published layout (experts as MXFP4 blocks and scales, the rest as they were): every
    weight equals the NumPy dequantization of the same bytes, and the logits equal those of
    ``GptOssForCausalLM.from_pretrained`` on that folder (transformers dequantizes on CPU)."""
    GPT_OSS.save_tiny(tmp_path / "plain", seed=5, hidden_size=64, intermediate_size=32, head_dim=16)
    expected = mxfp4_folder_from(tmp_path / "plain", tmp_path / "mxfp4")
    model = hf.load(tmp_path / "mxfp4", dtype="float32")
    loaded = hf.state_dict(model)
    assert set(loaded) == set(expected)
    for key, value in expected.items():
        np.testing.assert_array_equal(loaded[key], value, err_msg=key)
    reference = transformers.GptOssForCausalLM.from_pretrained(
        tmp_path / "mxfp4", dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    shared.assert_logits_match(reference, model)


def test_convert_of_an_mxfp4_folder_says_its_output_is_unquantized(tmp_path, capsys):
    from experiments import convert

    GPT_OSS.save_tiny(tmp_path / "plain", seed=5, hidden_size=64, intermediate_size=32, head_dim=16)
    mxfp4_folder_from(tmp_path / "plain", tmp_path / "mxfp4")
    assert convert.main(convert.Args(hf=tmp_path / "mxfp4", out=tmp_path / "ckpt")) == 0
    assert "holds MXFP4 expert weights, dequantized" in capsys.readouterr().out
    assert convert.main(convert.Args(checkpoint=tmp_path / "ckpt", to_hf=tmp_path / "back")) == 0
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert "quantization_config" not in written and written["model_type"] == "gpt_oss"


def _generate_both(model, reference, prompt: np.ndarray, mask: np.ndarray, new: int):
    with torch.no_grad():
        theirs = reference.generate(
            torch.as_tensor(prompt), attention_mask=torch.as_tensor(mask), max_new_tokens=new, do_sample=False
        ).numpy()
    ours = np.asarray(generate(model, jnp.asarray(prompt), max_new_tokens=new, prompt_mask=jnp.asarray(mask, bool)))
    return ours, theirs


def test_decoding_with_the_window_ring_equals_the_full_cache_and_transformers(tmp_path):
    """Greedy tokens over a prompt and a continuation longer than the window (8), left-padded rows included: the
    ring of ``window`` slots, the full cache and transformers' ``generate`` agree."""
    GPT_OSS.save_tiny(tmp_path, seed=6, eos_token_id=None, pad_token_id=0)
    ring = hf.load(tmp_path)
    assert ring.config.attention.sliding_cache == "ring"
    cache = ring.init_cache(2, 40)
    assert cache.layers[0][0].keys.shape[-2] == 8 and cache.layers[1][0].keys.shape[-2] == 40  # sliding, full
    full_config = ring.config.replace(attention=dataclasses.replace(ring.config.attention, sliding_cache="full"))
    full = ring.with_config(full_config)
    prompt = np.random.default_rng(0).integers(1, 97, (2, 13))
    mask = np.ones_like(prompt)
    mask[1, :4] = 0
    prompt[1, :4] = 0
    reference = GPT_OSS.reference(tmp_path)
    ours, theirs = _generate_both(ring, reference, prompt, mask, 12)
    np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(_generate_both(full, reference, prompt, mask, 12)[0], ours)


# --- the published configs ------------------------------------------------------------------------------------


def _published(**changes) -> dict:
    """openai/gpt-oss-20b's config.json (as on the Hub); ``changes`` with ``...`` drop a key."""
    config = {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": 200002,
        "experts_per_token": 4,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2880,
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_attention_heads": 64,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 24,
        "num_key_value_heads": 8,
        "num_local_experts": 32,
        "output_router_logits": False,
        "pad_token_id": 199999,
        "quantization_config": {
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
            "quant_method": "mxfp4",
        },
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "transformers_version": "4.55.0.dev0",
        "use_cache": True,
        "vocab_size": 201088,
    }
    return {key: value for key, value in {**config, **changes}.items() if value is not ...}


GPT_OSS_120B = dict(  # openai/gpt-oss-120b's differences from gpt-oss-20b
    num_hidden_layers=36, num_local_experts=128, layer_types=["sliding_attention", "full_attention"] * 18
)


@pytest.mark.parametrize(("preset", "changes"), [("gpt-oss-20b", {}), ("gpt-oss-120b", GPT_OSS_120B)])
def test_published_config_reads_as_the_preset_listing_what_transformers_ignores(tmp_path, capsys, preset, changes):
    folder = shared.write_config(tmp_path / preset, _published(**changes))
    assert hf.read_config(folder) == gpt_oss.PRESETS[preset]
    ignored = [line for line in capsys.readouterr().err.splitlines() if "ignored" in line]
    assert len(ignored) == 1 and "experts_per_token" in ignored[0] and "initial_context_length" in ignored[0]


@pytest.mark.parametrize(
    ("preset", "changes", "parameters", "active"),
    [("gpt-oss-20b", {}, 20_914_757_184, 3.61e9), ("gpt-oss-120b", GPT_OSS_120B, 116_829_156_672, 5.13e9)],
)
def test_published_parameter_count_equals_transformers(capsys, tmp_path, preset, changes, parameters, active):
    """The total equals transformers' meta-device count; the active count without the embedding is the model card's
    (3.61B and 5.13B: 4 of the experts' matrices and biases)."""
    report = shared.param_report(preset, capsys)
    folder = shared.write_config(tmp_path / preset, _published(**changes))
    reference = transformers.GptOssConfig.from_pretrained(folder)
    assert shared.parameter_count(GPT_OSS.on_meta(reference)) == parameters
    assert report["total"] == parameters
    embedding = reference.vocab_size * reference.hidden_size
    assert abs(report["active"] - embedding - active) < 0.005e9, report["active"]


def test_absent_rope_and_head_fields_take_transformers_defaults(tmp_path):
    """GptOssConfig without RoPE keys is YaRN x32 at theta 150000; without head_dim or num_key_value_heads, 64 and 8
    (a null for either is refused, as transformers' strict config refuses it)."""
    bare = _published(rope_scaling=..., rope_theta=..., head_dim=..., num_key_value_heads=...)
    config = hf.read_config(shared.write_config(tmp_path / "bare", bare))
    assert config == gpt_oss.PRESETS["gpt-oss-20b"]
    reference = transformers.GptOssConfig.from_pretrained(tmp_path / "bare")
    assert (reference.head_dim, reference.num_key_value_heads, reference.rope_parameters["factor"]) == (64, 8, 32.0)
    for key in ("head_dim", "num_key_value_heads"):
        shared.assert_refused(tmp_path / key, _published(**{key: None}), key)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("hidden_act", "gelu"),
        ("attention_dropout", 0.1),
        ("layer_types", ["sliding_attention"] * 3),  # not one per layer
        ("layer_types", ["chunked_attention"] * 24),
        ("sliding_window", None),  # sliding layers without a window
        ("swiglu_limit", -1.0),
    ],
)
def test_unsupported_field_is_refused_naming_field_and_file(tmp_path, field, value):
    shared.assert_refused(tmp_path / "model", _published(**{field: value}), field)


def test_save_refuses_what_gpt_oss_cannot_express(tmp_path):
    config = gpt_oss.PRESETS["gpt-oss-20b"]
    two_windows = config.replace(layers=(config.layers[0], dataclasses.replace(config.layers[0], window=64)))
    with pytest.raises(ValueError, match="one sliding window"):
        gpt_oss.FIELD_MAP.write(two_windows)
    dense = config.replace(layers=("dense",) * 2, mlp_dim=8)
    with pytest.raises(ValueError, match="layers"):
        gpt_oss.FIELD_MAP.write(dense)
    written = gpt_oss.FIELD_MAP.write(config)
    assert json.loads(json.dumps(written))["layer_types"][:2] == ["sliding_attention", "full_attention"]


def test_every_field_transformers_writes_loads(tmp_path):
    config = hf.read_config(shared.write_config(tmp_path / "full", GPT_OSS.full_config()))
    assert config.attention.num_kv_heads == 2 and config.layers[0].window == 8 and config.layers[1].window is None


def test_a_sliding_layer_costs_its_window_in_the_plan():
    """The planner's attention FLOPs of a sliding layer grow with the window, a full layer's with the length."""
    from eqmoe.nn.gqa import GroupedQueryAttention
    from eqmoe.nn.kinds import PlanShape

    config = gpt_oss.PRESETS["gpt-oss-20b"]
    shape = PlanShape(rows=1, seq=8192, bytes=2)
    sliding = GroupedQueryAttention.plan(config, config.layers[0], shape)
    full = GroupedQueryAttention.plan(config, config.layers[1], shape)
    # blockwise tiles of 256: a sliding query block visits 2 tiles, a full one 16.5 on average
    assert sliding.flops < full.flops / 8 and sliding.cache < full.cache / 20


def test_generate_chat_renders_harmony_and_stops_on_return(tmp_path, capsys):
    """``generate --chat`` on a gpt-oss folder with gpt-oss's published template: the prompt is the harmony render
    with its generation prompt and the reasoning effort asked for; decoding stops on ``<|return|>`` or ``<|call|>``
    and runs through ``<|end|>`` (which stop ids a harmony folder gives: tests/test_harmony_chat.py)."""
    from pathlib import Path

    from experiments import generate as generate_cli
    from tests.chat_fixtures import write_harmony_tokenizer_folder

    template = (Path(__file__).parent / "templates" / "gpt_oss.jinja").read_text(encoding="utf-8")
    folder = write_harmony_tokenizer_folder(tmp_path / "hf", template)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    GPT_OSS.save_tiny(folder, seed=7, vocab_size=len(tokenizer))
    args = generate_cli.Args(
        hf=folder, prompt="hi", chat=True, max_new_tokens=6, json=True, template_var=("reasoning_effort=high",)
    )
    assert generate_cli.main(args) == 0
    result = json.loads(capsys.readouterr().out)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False, reasoning_effort="high"
    )
    assert result["prompt"] == rendered and "Reasoning: high" in rendered
    stops = {tokenizer.convert_tokens_to_ids(token) for token in ("<|return|>", "<|call|>")}
    new = result["new_ids"]
    assert not stops & set(new[:-1]) and (len(new) == 6 or new[-1] in stops)
