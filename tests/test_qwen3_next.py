"""Qwen3-Next and Qwen3.5-MoE parity with Hugging Face transformers (its torch reference path for the gated delta
rule and the short convolution: no fused kernel is installed), fp32 on CPU: logits, losses and every parameter's
gradient of tiny random models, padded rows and lengths that are not a multiple of the chunk; a packed row against
each document run alone; the published multimodal Qwen3.5 layout; bit-exact round trips; greedy generation from the
recurrent state; the published configs and parameter counts."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from eqmoe.checkpoints import hf
from eqmoe.inference import generate
from eqmoe.models import qwen3_5_moe, qwen3_next
from tests import hf_families as shared
from tests.test_qwen3_parity import _our_loss, _reference_gradients

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TEXT = dict(
    vocab_size=97,
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
    num_experts=4,
    num_experts_per_tok=2,
)


def perturb(name: str, tensor) -> None:
    """Every zero-centred norm, the gated norm, the decay constants and the convolution off their initial values, the
    matrices three times transformers' spread (the experts and gates then matter)."""
    if "norm" in name or name.endswith(("dt_bias", "A_log")):
        tensor.add_(0.3 * torch.randn_like(tensor))
    elif name.endswith("conv1d.weight"):
        tensor.normal_(0.0, 0.5)
    elif name.endswith(("proj.weight", "gate.weight", "gate_up_proj", "down_proj")):
        tensor.mul_(3.0)


QWEN3_NEXT = shared.Family("qwen3_next", transformers.Qwen3NextForCausalLM, {**TEXT, "intermediate_size": 40}, perturb)
QWEN3_5 = shared.Family("qwen3_5_moe_text", transformers.Qwen3_5MoeForCausalLM, TEXT, perturb)
FAMILIES = {"qwen3_next": QWEN3_NEXT, "qwen3_5_moe_text": QWEN3_5}
CASES = {
    # transformers' defaults: every 4th layer full attention (-m slow where the irregular case covers its code)
    "qwen3_next": (QWEN3_NEXT, {}),
    # an irregular layout with a dense layer and one key head per two value heads
    "qwen3_next-irregular": (
        QWEN3_NEXT,
        dict(
            layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
            mlp_only_layers=[1],
            linear_num_key_heads=1,
            linear_num_value_heads=2,
        ),
    ),
    "qwen3_5_moe_text": (QWEN3_5, {}),
}


SLOW = pytest.mark.slow  # the same code runs in the case left in the default suite


def _cases(slow: tuple[str, ...]) -> list:
    return [pytest.param(name, marks=SLOW) if name in slow else name for name in CASES]


def _families(slow: tuple[str, ...]) -> list:
    return [pytest.param(name, marks=SLOW) if name in slow else name for name in FAMILIES]


@pytest.fixture(params=_cases(slow=("qwen3_next",)), name="saved")
def saved_fixture(request, tmp_path):
    family, overrides = CASES[request.param]
    family.save_tiny(tmp_path, seed=len(request.param), **overrides)
    return family, tmp_path


def test_logits_match_transformers(saved):
    """Two rows of 300 tokens: four chunks of 64 and a partial one."""
    family, folder = saved
    shared.assert_logits_match(family.reference(folder), hf.load(folder))


@pytest.mark.parametrize("name", _families(slow=("qwen3_5_moe_text",)))
def test_loss_and_aux_loss_match_transformers(tmp_path, name):
    family = FAMILIES[name]
    family.save_tiny(tmp_path, seed=3, router_aux_loss_coef=0.02)
    shared.assert_loss_and_aux_loss_match(family.reference(tmp_path), hf.load(tmp_path), weight=0.02)


@pytest.mark.parametrize("case", _cases(slow=("qwen3_next",)))
def test_gradients_of_every_parameter_match_torch(tmp_path, case):
    """On right-padded rows of 64 tokens (one of them shorter than a chunk of 64 after its padding): every projection,
    the convolution, ``A_log``, ``dt_bias``, the gated norm and the zero-centred norms."""
    family, overrides = CASES[case]
    family.save_tiny(tmp_path, seed=4, router_aux_loss_coef=0.05, **overrides)
    reference, model = family.reference(tmp_path), hf.load(tmp_path)
    ids, mask, labels = shared.padded_batch(reference.config.vocab_size, seq=70)
    reference(ids, attention_mask=mask, labels=labels, output_router_logits=True).loss.backward()
    expected = _reference_gradients(reference)
    grads, _ = eqx.filter_jit(jax.grad(_our_loss(model, ids, mask), has_aux=True))(model)
    ours = hf.state_dict(grads)
    for part in ("A_log", "dt_bias", "conv1d", "linear_attn.norm", "q_norm"):
        assert shared.largest(expected, part) > 1e-4, part
    shared.assert_gradients_match(ours, expected)


def test_left_padded_rows_give_the_logits_of_transformers(tmp_path):
    """Left padding (as a batch of prompts has it): the padded positions leave the convolution window and the state
    as they were, which is what transformers' zeroed padding gives at the start of a row."""
    QWEN3_NEXT.save_tiny(tmp_path, seed=5)
    reference, model = QWEN3_NEXT.reference(tmp_path), hf.load(tmp_path)
    ids = torch.randint(1, 97, (2, 90), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :27] = 0
    with torch.no_grad():
        expected = reference(ids, attention_mask=mask).logits.numpy()
    tokens, token_mask = jnp.asarray(ids.numpy()), jnp.asarray(mask.numpy().astype(bool))
    logits = np.asarray(model(tokens, token_mask=token_mask).logits)
    real = mask.numpy().astype(bool)
    assert np.abs(logits - expected)[real].max() <= 1e-4


def test_packed_row_equals_each_document_run_alone(tmp_path):
    """Documents of 70, 100 and 123 tokens packed in one row (positions restarting): each document's logits equal
    transformers' on that document alone, so the state and the convolution window restart at every document."""
    QWEN3_NEXT.save_tiny(tmp_path, seed=6)
    reference, model = QWEN3_NEXT.reference(tmp_path), hf.load(tmp_path)
    lengths = (70, 100, 123)
    docs = [torch.randint(0, 97, (1, n), generator=torch.Generator().manual_seed(n)) for n in lengths]
    tokens = jnp.asarray(torch.cat(docs, dim=1).numpy())
    segments = jnp.asarray(np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)])[None], jnp.int32)
    positions = jnp.asarray(np.concatenate([np.arange(n) for n in lengths])[None], jnp.int32)
    packed = np.asarray(model(tokens, segment_ids=segments, positions=positions).logits)[0]
    start = 0
    for doc, n in zip(docs, lengths, strict=True):
        with torch.no_grad():
            alone = reference(doc).logits.numpy()[0]
        assert np.abs(packed[start : start + n] - alone).max() <= 1e-4, n
        start += n


def test_hf_to_eqmoe_to_hf_is_bit_exact(saved, tmp_path):
    family, folder = saved
    shared.assert_round_trip_bit_exact(family, folder, tmp_path / "back")
    assert shared.named_keys(family, folder) == set(load_file(folder / "model.safetensors"))


def _multimodal_folder(folder, seed: int = 7, **text):
    """A tiny Qwen3_5MoeForConditionalGeneration in the published layout: ``text_config``, the language model under
    ``model.language_model.*``, a vision tower ``model.visual.*`` and ``mtp.*`` tensors (random)."""
    config = transformers.Qwen3_5MoeConfig(
        text_config={**TEXT, **text},
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32),
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3_5MoeForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            perturb(name, tensor)
    model.save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["mtp.fc.weight"] = np.ones((32, 64), np.float32)
    tensors["mtp.norm.weight"] = np.zeros((32,), np.float32)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return model


def _fused(source, folder) -> None:
    """``source``'s folder with every layer's experts stored as the published Qwen3.5 files store them, stacked:
    ``mlp.experts.gate_up_proj [E, 2I, H]`` and ``mlp.experts.down_proj [E, H, I]``."""
    folder.mkdir()
    (folder / "config.json").write_text((source / "config.json").read_text())
    tensors = load_file(source / "model.safetensors")
    for prefix in sorted({key.split("experts.")[0] for key in tensors if ".experts.0.gate_proj" in key}):
        experts = sorted(
            {int(key[len(prefix) + 8 :].split(".")[0]) for key in tensors if key.startswith(prefix + "experts.")}
        )
        take = lambda j, part, prefix=prefix: tensors.pop(f"{prefix}experts.{j}.{part}.weight")  # noqa: E731
        gate_up = [np.concatenate([take(j, "gate_proj"), take(j, "up_proj")]) for j in experts]
        tensors[prefix + "experts.gate_up_proj"] = np.stack(gate_up)
        tensors[prefix + "experts.down_proj"] = np.stack([take(j, "down_proj") for j in experts])
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_published_multimodal_layout_loads_the_language_model(tmp_path, capsys):
    """The language model of a multimodal folder, its experts stacked as the published files hold them, gives the
    logits of transformers' model on text; the vision tower and the multi-token-prediction tensors are skipped and
    listed on one line; the export is the language model in the same layout (experts per expert, as transformers
    saves them), which AutoModelForCausalLM loads with the same logits, every tensor bit for bit."""
    reference = _multimodal_folder(tmp_path / "saved")
    _fused(tmp_path / "saved", tmp_path / "mm")
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in load_file(tmp_path / "mm" / "model.safetensors")
    model = hf.load(tmp_path / "mm")
    assert model.config.family == "qwen3_5_moe"
    skipped = [line for line in capsys.readouterr().err.splitlines() if "skipped" in line]
    assert len(skipped) == 1 and "model.visual.*" in skipped[0] and "mtp.*" in skipped[0], skipped
    ids = torch.randint(0, 97, (2, shared.SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(input_ids=ids).logits.numpy()
    logits = np.asarray(eqx.filter_jit(lambda model, ids: model(ids).logits)(model, jnp.asarray(ids.numpy())))
    assert np.abs(logits - expected).max() <= 1e-4
    hf.save(model, tmp_path / "back")
    written = load_file(tmp_path / "back" / "model.safetensors")
    original = load_file(tmp_path / "saved" / "model.safetensors")
    assert set(written) == {key for key in original if not key.startswith(("model.visual.", "mtp."))}
    for key, value in written.items():
        np.testing.assert_array_equal(value, original[key], err_msg=key)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager").eval()
    shared.assert_logits_match(back, model)
    assert hf.read_config(tmp_path / "back") == model.config.replace(dtype="float32", param_dtype="float32")


def test_image_inputs_are_refused_in_one_line():
    from eqmoe.data.chat import check_conversation

    image = [{"role": "user", "content": [{"type": "image", "image": "cat.png"}, {"type": "text", "text": "what?"}]}]
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]: a 'image' part is not supported") as error:
        check_conversation(image)
    assert "\n" not in str(error.value)


def test_multi_token_prediction_layer_is_kept_and_exported(tmp_path, capsys):
    """``mtp.*`` of a folder declaring ``mtp_num_hidden_layers: 1`` loads into the model's ``mtp`` part (the causal
    LM's logits unchanged) and is written back bit for bit; a folder declaring it without the tensors (transformers'
    own saves) loads without it, says so on one line, and its export declares it again."""
    QWEN3_NEXT.save_tiny(tmp_path / "plain", seed=10, mtp_num_hidden_layers=1)
    plain = hf.load(tmp_path / "plain")
    assert plain.config.mtp_layers == 0 and "multi-token-prediction" in capsys.readouterr().err
    tensors = load_file(tmp_path / "plain" / "model.safetensors")
    rng = np.random.default_rng(0)
    extra = {
        key.replace("model.layers.3.", "mtp.layers.0."): rng.normal(size=value.shape).astype(np.float32)
        for key, value in tensors.items()
        if key.startswith("model.layers.3.")
    }
    extra.update(
        {
            "mtp.fc.weight": rng.normal(size=(32, 64)).astype(np.float32),
            "mtp.pre_fc_norm_embedding.weight": rng.normal(size=32).astype(np.float32),
            "mtp.pre_fc_norm_hidden.weight": rng.normal(size=32).astype(np.float32),
            "mtp.norm.weight": rng.normal(size=32).astype(np.float32),
        }
    )
    (tmp_path / "mtp").mkdir()
    (tmp_path / "mtp" / "config.json").write_text((tmp_path / "plain" / "config.json").read_text())
    save_file({**tensors, **extra}, tmp_path / "mtp" / "model.safetensors", metadata={"format": "pt"})
    model = hf.load(tmp_path / "mtp")
    assert model.config.mtp_layers == 1
    np.testing.assert_array_equal(np.asarray(model.mtp[0].eh_proj.weight), extra["mtp.fc.weight"].T)
    tokens = jnp.asarray(rng.integers(0, 97, (1, 9)))
    np.testing.assert_array_equal(np.asarray(model(tokens).logits), np.asarray(plain(tokens).logits))
    hf.save(model, tmp_path / "back")
    written = load_file(tmp_path / "back" / "model.safetensors")
    for key, value in {**tensors, **extra}.items():
        np.testing.assert_array_equal(written[key], value, err_msg=key)
    hf.save(plain, tmp_path / "plain-back")
    assert json.loads((tmp_path / "plain-back" / "config.json").read_text())["mtp_num_hidden_layers"] == 1


def _generate_both(model, reference, prompt: np.ndarray, mask: np.ndarray, new: int):
    with torch.no_grad():
        theirs = reference.generate(
            torch.as_tensor(prompt), attention_mask=torch.as_tensor(mask), max_new_tokens=new, do_sample=False
        ).numpy()
    ours = np.asarray(generate(model, jnp.asarray(prompt), max_new_tokens=new, prompt_mask=jnp.asarray(mask, bool)))
    return ours, theirs


@pytest.mark.parametrize("name", _families(slow=("qwen3_5_moe_text",)))
def test_greedy_generation_from_the_recurrent_state_equals_transformers(tmp_path, name):
    """A 70-token prompt (a chunk and a partial one), a left-padded row, then 12 tokens one at a time from the
    convolution window and the recurrent state."""
    family = FAMILIES[name]
    family.save_tiny(tmp_path, seed=8, eos_token_id=None, pad_token_id=0)
    model, reference = hf.load(tmp_path), family.reference(tmp_path)
    prompt = np.random.default_rng(0).integers(1, 97, (2, 70))
    mask = np.ones_like(prompt)
    mask[1, :9] = 0
    prompt[1, :9] = 0
    ours, theirs = _generate_both(model, reference, prompt, mask, 12)
    np.testing.assert_array_equal(ours, theirs)


def test_decoding_token_by_token_equals_the_whole_sequence(tmp_path):
    """The recurrent path (one token at a time from the cache) gives the chunked path's logits at every step."""
    QWEN3_NEXT.save_tiny(tmp_path, seed=9)
    model = hf.load(tmp_path)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 97, (2, 20)))
    whole = np.asarray(model(tokens).logits)
    cache = model.init_cache(2, 20)
    step = eqx.filter_jit(lambda model, token, cache: model(token, cache=cache))
    steps = []
    for t in range(20):
        out = step(model, tokens[:, t : t + 1], cache)
        cache = out.cache
        steps.append(np.asarray(out.logits)[:, 0])
    np.testing.assert_allclose(np.stack(steps, axis=1), whole, atol=1e-5, rtol=0)


# --- the published configs ------------------------------------------------------------------------------------


def _qwen3_next_published(**changes) -> dict:
    """Qwen/Qwen3-Next-80B-A3B-Instruct's config.json (as on the Hub); ``changes`` with ``...`` drop a key."""
    config = {
        "architectures": ["Qwen3NextForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151645,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 5120,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "model_type": "qwen3_next",
        "moe_intermediate_size": 512,
        "norm_topk_prob": True,
        "num_attention_heads": 16,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "num_hidden_layers": 48,
        "num_key_value_heads": 2,
        "output_router_logits": False,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000000,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 512,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.0.dev0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }
    return {key: value for key, value in {**config, **changes}.items() if value is not ...}


def _qwen3_5_published(**text_changes) -> dict:
    """Qwen/Qwen3.5-35B-A3B's config.json: the multimodal model, its language model in ``text_config``."""
    text = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "bos_token_id": 248044,
        "dtype": "bfloat16",
        "eos_token_id": 248044,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 10,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 262144,
        "model_type": "qwen3_5_moe_text",
        "moe_intermediate_size": 512,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": 16,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 40,
        "num_key_value_heads": 2,
        "output_router_logits": False,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 512,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": 248320,
    }
    text = {key: value for key, value in {**text, **text_changes}.items() if value is not ...}
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "image_token_id": 248056,
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "tie_word_embeddings": False,
        "transformers_version": "4.57.0.dev0",
        "video_end_token_id": 248058,
        "video_start_token_id": 248057,
        "video_token_id": 248057,
        "vision_config": {"depth": 27, "hidden_size": 1152, "model_type": "qwen3_5_moe", "out_hidden_size": 2048},
        "vision_end_token_id": 248054,
        "vision_start_token_id": 248053,
    }


def test_published_configs_read_as_the_presets_listing_what_transformers_ignores(tmp_path, capsys):
    assert (
        hf.read_config(shared.write_config(tmp_path / "next", _qwen3_next_published()))
        == qwen3_next.PRESETS["qwen3-next-80b-a3b"]
    )
    ignored = [line for line in capsys.readouterr().err.splitlines() if "ignored" in line]
    assert len(ignored) == 1 and "use_sliding_window" in ignored[0], ignored
    config = hf.read_config(shared.write_config(tmp_path / "q35", _qwen3_5_published()))
    assert config == qwen3_5_moe.PRESETS["qwen3.5-35b-a3b"]
    ignored = [line for line in capsys.readouterr().err.splitlines() if "ignored" in line]
    assert len(ignored) == 1 and "text_config.mtp_use_dedicated_embeddings" in ignored[0], ignored
    assert "mrope" not in ignored[0] and "mtp_num_hidden_layers" not in ignored[0]


@pytest.mark.parametrize(
    ("preset", "published", "reference_config", "model_class", "parameters"),
    [
        (
            "qwen3-next-80b-a3b",
            _qwen3_next_published,
            transformers.Qwen3NextConfig,
            transformers.Qwen3NextForCausalLM,
            79_674_391_296,
        ),
        (
            "qwen3.5-35b-a3b",
            lambda: _qwen3_5_published()["text_config"],
            transformers.Qwen3_5MoeTextConfig,
            transformers.Qwen3_5MoeForCausalLM,
            34_660_610_688,
        ),
    ],
)
def test_published_parameter_count_equals_transformers(
    tmp_path, capsys, preset, published, reference_config, model_class, parameters
):
    """``param_report``'s total equals transformers' meta-device count of the published config (the language model:
    no vision tower, no multi-token-prediction layer)."""
    report = shared.param_report(preset, capsys)
    folder = shared.write_config(tmp_path / preset, published())
    with torch.device("meta"):
        reference = model_class(reference_config.from_pretrained(folder))
    count = shared.parameter_count(reference)
    assert report["total"] == count
    if parameters is not None:
        assert count == parameters


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("hidden_act", "gelu"),
        ("layer_types", ["linear_attention"] * 3),  # not one per layer
        ("layer_types", ["sliding_attention"] * 48),
        ("linear_num_value_heads", 24),  # not a multiple of the 16 key heads
        ("head_dim", None),
        ("partial_rotary_factor", 0.0),
        ("full_attention_interval", 0),
    ],
)
def test_unsupported_field_is_refused_naming_field_and_file(tmp_path, field, value):
    if field == "full_attention_interval":  # read only without layer_types
        config = _qwen3_next_published(full_attention_interval=0)
        shared.assert_refused(tmp_path / "model", config, field)
        return
    shared.assert_refused(tmp_path / "model", _qwen3_next_published(**{field: value}), field)


def test_multimodal_export_config_reads_back(tmp_path):
    config = qwen3_5_moe.PRESETS["qwen3.5-35b-a3b"]
    written = qwen3_5_moe.MULTIMODAL_FIELD_MAP.write(config)
    assert written["model_type"] == "qwen3_5_moe" and written["text_config"]["model_type"] == "qwen3_5_moe_text"
    assert hf.read_config(shared.write_config(tmp_path / "m", json.loads(json.dumps(written)))) == config
