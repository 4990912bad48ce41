"""Every Hugging Face family through the commands a user runs, with no family named outside its file: convert to
an eqmoe checkpoint, check_logits against transformers, generate, LoRA SFT from the HF folder, and both exports
(merged weights that transformers loads, a PEFT adapter folder that peft puts on the transformers base)."""

import dataclasses

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest

from eqmoe.checkpoints import hf
from eqmoe.checkpoints.model_checkpoint import load_model
from experiments import check_logits, convert, generate, sft
from tests.test_convert import _word_tokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _saver(family: str):
    from tests import (
        test_deepseek,
        test_dense_families,
        test_glm4_moe,
        test_gpt_oss,
        test_mixtral,
        test_olmoe,
        test_qwen2_moe,
        test_qwen3_next_commands,
    )

    families = (
        test_mixtral.MIXTRAL,
        test_olmoe.OLMOE,
        test_qwen2_moe.QWEN2_MOE,
        test_glm4_moe.GLM,
        test_deepseek.V3,
        test_deepseek.V2,
        test_gpt_oss.GPT_OSS,
        test_dense_families.QWEN3,
        test_dense_families.LLAMA,
    )
    # Qwen3-Next and the multimodal Qwen3.5 folder (its language model's fields in text_config)
    savers = {hf_family.name: hf_family.save_tiny for hf_family in families} | test_qwen3_next_commands.SAVERS
    return savers[family]


def _logits(model, ids: np.ndarray) -> np.ndarray:
    return np.asarray(eqx.filter_jit(lambda m, t: m(t).logits)(model, jnp.asarray(ids)))


def _reference_logits(folder, ids: np.ndarray, adapter=None) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.numpy()


# LoRA targets: attention and routed experts everywhere; the dense FFNs too where a family has them (Qwen2-MoE's
# shared experts, GLM-4.5's dense first layer and shared experts).
TARGETS = {
    "mixtral": ("attention", "experts"),
    "olmoe": ("attention", "experts"),
    "qwen2_moe": ("attention", "experts", "mlp"),
    "glm4_moe": ("attention", "experts", "mlp"),
    "deepseek_v3": ("attention", "experts"),
    "deepseek_v2": ("attention", "experts"),
    "gpt_oss": ("attention", "experts"),
    "qwen3_next": ("attention", "linear_attention", "experts"),
    "qwen3_5_moe": ("attention", "linear_attention", "experts"),
    "qwen3": ("attention", "mlp"),  # the dense families
    "llama": ("attention", "mlp"),
}
# transformers' initializer_range: gpt-oss's saver scales the matrices by 5 after transformers initialises them
# (tests/test_gpt_oss.perturb); the hybrid families' linear attention sums over every earlier token
SPREAD = {"gpt_oss": 0.06, "qwen3_next": 0.1, "qwen3_5_moe": 0.1}


@pytest.mark.filterwarnings("ignore:The following (rank|alpha)_pattern keys:RuntimeWarning")  # PEFT's, spurious
# The commands are the same code for every family; what is a family's own (its field map, names, numbers) each
# family's parity and round-trip tests cover. One family runs them by default, gpt-oss (sinks, sliding layers, expert
# biases, and its fused interleaved gate_up_proj in PEFT's layout); every family with -m slow (DeepSeek-V3's latent
# attention: its cache in tests/test_deepseek.py, its LoRA run and exports in tests/test_fp8_lora.py; Qwen3-Next's and
# Qwen3.5's linear attention: every command but the training run in tests/test_qwen3_next_commands.py).
@pytest.mark.parametrize(
    "family",
    [family if family == "gpt_oss" else pytest.param(family, marks=pytest.mark.slow) for family in TARGETS],
)
def test_every_family_converts_checks_generates_and_fine_tunes(family, tmp_path, capsys):
    spread = SPREAD.get(family, 0.3)
    _saver(family)(tmp_path / "hf", vocab_size=300, num_hidden_layers=2, initializer_range=spread, eos_token_id=1)
    _word_tokenizer(tmp_path / "hf" / "tokenizer.json", 300)
    assert hf.read_config(tmp_path / "hf").family == family

    assert convert.main(convert.Args(hf=tmp_path / "hf", out=tmp_path / "ckpt")) == 0
    assert check_logits.main(check_logits.Args(hf=tmp_path / "hf", checkpoint=tmp_path / "ckpt")) == 0
    assert "PASS" in capsys.readouterr().out
    assert generate.main(generate.Args(prompt="3 4 5", checkpoint=tmp_path / "ckpt", max_new_tokens=3)) == 0
    assert capsys.readouterr().out.split()[:3] == ["3", "4", "5"]

    # LoRA SFT from the HF folder, router frozen
    run = sft.RunOptions(steps=4, out_dir=tmp_path / "run", checkpoint_every=4, eval_every=1000, log_every=2, samples=0)
    args = sft.Args(
        model=sft.ModelOptions(init_from_hf=tmp_path / "hf", lora_rank=4, lora_targets=TARGETS[family]),
        data=sft.DataOptions(seq_len=64, batch_size=4, train_examples=40, eval_examples=4),
        optim=dataclasses.replace(sft.Args().optim, learning_rate=1e-2, warmup_steps=1, freeze=("router",)),
        run=run,
    )
    # the built-in tasks are byte text: the word tokenizer steps aside, and the folder's 300 rows fit the 260 bytes
    (tmp_path / "hf" / "tokenizer.json").rename(tmp_path / "words.json")
    too_short = dataclasses.replace(args, data=dataclasses.replace(args.data, seq_len=8))
    assert sft.main(too_short) == 2 and "no training token left" in capsys.readouterr().err
    assert sft.main(args) == 0
    checkpoints = tmp_path / "run" / "checkpoints"
    trained, _ = load_model(checkpoints)
    ids = np.random.default_rng(0).integers(0, 300, (2, 40))
    ours = _logits(trained, ids)
    assert np.abs(ours - _logits(hf.load(tmp_path / "hf"), ids)).max() > 1e-3  # the adapters changed something

    # At initializer_range 0.3 (logits up to ~7) transformers' own float32 logits are up to 1.7e-4 from its float64
    # ones (DeepSeek-V2; eqmoe's are within 1.2e-4 of those): 2e-4
    assert convert.main(convert.Args(checkpoint=checkpoints, to_hf=tmp_path / "merged")) == 0
    np.testing.assert_allclose(_reference_logits(tmp_path / "merged", ids), ours, atol=2e-4)
    assert convert.main(convert.Args(checkpoint=checkpoints, to_hf=tmp_path / "adapter", adapter_only=True)) == 0
    np.testing.assert_allclose(_reference_logits(tmp_path / "hf", ids, tmp_path / "adapter"), ours, atol=2e-4)
