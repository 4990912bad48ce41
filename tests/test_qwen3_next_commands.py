"""Qwen3-Next and Qwen3.5-MoE (hybrid gated DeltaNet linear attention) through the commands, cheaply: convert,
check_logits against transformers, generate from the recurrent state, and both exports of a model whose adapters
sit on the full attention, the linear attention and the experts (the merged folder transformers loads, the PEFT
folder peft puts on the transformers base), without a training run: the adapters get random values. The whole
path with ``sft --init-from-hf`` is tests/test_family_commands.py's (``-m slow`` for these families); the
parity of logits, gradients and greedy decoding (left-padded rows included) is tests/test_qwen3_next.py's.

The tiny models and the multimodal Qwen3.5 saver here are also tests/test_family_commands.py's."""

import dataclasses
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from eqmoe.checkpoints import hf
from eqmoe.checkpoints.model_checkpoint import load_model, save_model
from eqmoe.checkpoints.peft import save_adapters
from eqmoe.checkpoints.run_metadata import RunMetadata
from eqmoe.lora import LoRAConfig, add_lora, merge_lora, targets
from experiments import check_logits, convert, generate
from tests import hf_families as shared
from tests.test_convert import _word_tokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

# Two layers, one of each attention kind; the linear attention's two key heads each serve two value heads.
TINY = dict(
    vocab_size=300,
    hidden_size=32,
    num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    num_experts=4,
    num_experts_per_tok=2,
    initializer_range=0.1,
    eos_token_id=1,
)
TARGETS = ("attention", "linear_attention", "experts")
# transformers' module names of the linear attention's matrices, by layout
LINEAR_MODULES = {
    "qwen3_next": ["linear_attn.in_proj_ba", "linear_attn.in_proj_qkvz", "linear_attn.out_proj"],
    "qwen3_5_moe": [f"linear_attn.{name}" for name in ("in_proj_a", "in_proj_b", "in_proj_qkv", "in_proj_z")]
    + ["linear_attn.out_proj"],
}


def perturb(name: str, tensor) -> None:
    """The zero-centred norms, the gated norm and the decay constants off their initial values."""
    if "norm" in name or name.endswith(("dt_bias", "A_log")):
        tensor.add_(0.1 * torch.randn_like(tensor))


QWEN3_NEXT = shared.Family("qwen3_next", transformers.Qwen3NextForCausalLM, {**TINY, "intermediate_size": 32}, perturb)


def save_multimodal(folder, seed: int = 0, **text) -> None:
    """A tiny ``Qwen3_5MoeForConditionalGeneration`` (``model_type`` ``qwen3_5_moe``) in the published layout:
    ``text_config`` holds :data:`TINY` with ``text``, the language model sits under ``model.language_model.*`` beside
    a one-block vision tower ``model.visual.*``."""
    config = transformers.Qwen3_5MoeConfig(
        text_config={**TINY, **text},
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32),
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3_5MoeForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            perturb(name, tensor)
    model.save_pretrained(folder)


SAVERS = {"qwen3_next": QWEN3_NEXT.save_tiny, "qwen3_5_moe": save_multimodal}


def _transformers(folder, adapter=None):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    return model if adapter is None else peft.PeftModel.from_pretrained(model, adapter).eval()


def _reference_logits(folder, ids: np.ndarray, adapter=None) -> np.ndarray:
    with torch.no_grad():
        return _transformers(folder, adapter)(torch.as_tensor(ids)).logits.numpy()


def _with_random_adapters(model, lora: LoRAConfig):
    """``model`` with adapters on ``lora.targets``, every ``B`` random (a fresh adapter's is zero)."""
    model = add_lora(model, lora, key=jax.random.key(1))
    found = lambda m: [linear.adapter.b for _, _, linear in targets(m, lora)]  # noqa: E731
    rng = np.random.default_rng(2)
    return eqx.tree_at(found, model, [jnp.asarray(0.3 * rng.normal(size=b.shape), b.dtype) for b in found(model)])


def _max_differences(out: str) -> list[float]:
    """check_logits' ``max|diff|`` column, one per prompt."""
    return [float(line.split()[-1]) for line in out.splitlines() if line.split() and line.split()[0].isdigit()]


@pytest.mark.filterwarnings("ignore:The following (rank|alpha)_pattern keys:RuntimeWarning")  # PEFT's, spurious
@pytest.mark.parametrize("family", ["qwen3_next", pytest.param("qwen3_5_moe", marks=pytest.mark.slow)])
def test_converts_generates_and_exports_adapters_that_transformers_and_peft_load(family, tmp_path, capsys):
    """Two eqmoe programs in all (the decoder's, the adapted model's forward): check_logits compares the LoRA
    checkpoint, adapters unmerged, with transformers on the merged folder, then with PEFT's adapters on the base."""
    SAVERS[family](tmp_path / "hf")
    _word_tokenizer(tmp_path / "hf" / "tokenizer.json", 300)
    assert hf.read_config(tmp_path / "hf").family == family
    assert convert.main(convert.Args(hf=tmp_path / "hf", out=tmp_path / "ckpt")) == 0

    # greedy decoding from the convolution window and the recurrent state gives transformers' tokens
    prompt = "3 4 5 6 7 8"
    assert generate.main(generate.Args(prompt=prompt, checkpoint=tmp_path / "ckpt", max_new_tokens=4, json=True)) == 0
    ours = json.loads(capsys.readouterr().out.splitlines()[-1])
    with torch.no_grad():
        theirs = _transformers(tmp_path / "hf").generate(
            torch.as_tensor([ours["prompt_ids"]]), max_new_tokens=4, do_sample=False, eos_token_id=1
        )
    assert ours["new_ids"] == theirs[0, len(ours["prompt_ids"]) :].tolist()

    # adapters on both attention kinds and the experts, saved as a LoRA run's checkpoint, exported both ways
    lora = LoRAConfig(rank=2, alpha=4.0, targets=TARGETS)
    adapted = _with_random_adapters(load_model(tmp_path / "ckpt")[0], lora)
    save_model(adapted, tmp_path / "lora", metadata=RunMetadata(adapted.config, lora=dataclasses.asdict(lora)))
    assert convert.main(convert.Args(checkpoint=tmp_path / "lora", to_hf=tmp_path / "merged")) == 0
    assert convert.main(convert.Args(checkpoint=tmp_path / "lora", to_hf=tmp_path / "adapter", adapter_only=True)) == 0
    fields = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    attention = ["self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj"]
    assert fields["target_modules"] == sorted(attention + LINEAR_MODULES[family])
    assert fields["target_parameters"] == ["experts.down_proj", "experts.gate_up_proj"]
    # the causal-LM model's names: a multimodal folder's language model is its model.*
    tensors = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert all(key.startswith("base_model.model.model.layers.") for key in tensors)

    ids = np.random.default_rng(0).integers(0, 300, (1, 16))
    base = _reference_logits(tmp_path / "hf", ids)
    assert np.abs(_reference_logits(tmp_path / "merged", ids) - base).max() > 1e-2  # the adapters matter
    assert np.abs(_reference_logits(tmp_path / "hf", ids, tmp_path / "adapter") - base).max() > 1e-2
    capsys.readouterr()
    for folder, adapter in ((tmp_path / "merged", None), (tmp_path / "hf", tmp_path / "adapter")):
        checked = check_logits.Args(hf=folder, peft=adapter, checkpoint=tmp_path / "lora", prompts=(prompt,))
        assert check_logits.main(checked) == 0
        out = capsys.readouterr().out
        assert "PASS" in out and max(_max_differences(out)) <= 1e-4, out


@pytest.mark.filterwarnings("ignore:The following (rank|alpha)_pattern keys:RuntimeWarning")  # PEFT's, spurious
def test_multimodal_folder_adapters_are_named_as_the_causal_lm_holds_them(tmp_path):
    """Qwen3.5's published layout (``model.language_model.*``, flat linear-attention projections): the PEFT folder
    names ``AutoModelForCausalLM``'s modules (``model.layers.*``), and on the base folder it gives the logits of the
    merged export. No eqmoe program runs: the eqmoe side of both exports is the code the Qwen3-Next case checks."""
    save_multimodal(tmp_path / "hf")
    lora = LoRAConfig(rank=2, alpha=4.0, targets=TARGETS, dropout=0.1)
    adapted = _with_random_adapters(hf.load(tmp_path / "hf"), lora)
    # as PEFT's module targets, the linear attention's adapters take dropout in training; the experts' do not
    dropouts = {group: linear.adapter.dropout for group, _, linear in targets(adapted, lora)}
    assert dropouts == {"attention": 0.1, "linear_attention": 0.1, "experts": 0.0}
    hf.save(merge_lora(adapted), tmp_path / "merged")
    save_adapters(adapted, tmp_path / "adapter")
    fields = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    attention = ["self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj"]
    assert fields["target_modules"] == sorted(attention + LINEAR_MODULES["qwen3_5_moe"])
    tensors = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert all(key.startswith("base_model.model.model.layers.") for key in tensors)

    ids = np.random.default_rng(0).integers(0, 300, (2, 24))
    merged = _reference_logits(tmp_path / "merged", ids)
    assert np.abs(merged - _reference_logits(tmp_path / "hf", ids)).max() > 1e-2  # the adapters matter
    np.testing.assert_allclose(_reference_logits(tmp_path / "hf", ids, tmp_path / "adapter"), merged, atol=1e-5, rtol=0)
