"""LoRA SFT of a tiny HF Qwen3-MoE end to end: the loss falls, the base stays bit-identical, the checkpoints
hold only what training changed (the base is found by its content digest), and both exports (merged weights,
a PEFT adapter folder on the base) give the adapter model's logits in transformers."""

import dataclasses
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqmoe.checkpoints import hf
from eqmoe.checkpoints.model_checkpoint import load_model
from eqmoe.checkpoints.orbax import Checkpointer
from eqmoe.lora import has_lora
from eqmoe.params import ParamInfo, Role, param_info
from experiments import check_logits, convert, generate, sft
from tests.conftest import load_reference, save_tiny_hf

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")


def _leaves_by_role(model) -> list[tuple[Role, np.ndarray]]:
    arrays = eqx.filter(model, eqx.is_array)
    infos = jax.tree.leaves(param_info(arrays), is_leaf=lambda x: isinstance(x, ParamInfo))
    return [(info.role, np.asarray(leaf)) for info, leaf in zip(infos, jax.tree.leaves(arrays), strict=True)]


def _logits(model, ids) -> np.ndarray:
    return np.asarray(eqx.filter_jit(lambda m, t: m(t).logits)(model, jnp.asarray(ids)))


@pytest.mark.filterwarnings("ignore:The following (rank|alpha)_pattern keys:RuntimeWarning")  # PEFT's, spurious
def test_lora_sft_from_hf_adapter_checkpoints_and_both_exports(tmp_path, capsys, monkeypatch):
    # Wider initial weights than HF's 0.02: with a frozen random head the adapters need logits that can move.
    save_tiny_hf(tmp_path / "hf", vocab_size=300, num_hidden_layers=2, initializer_range=0.3)
    run = sft.RunOptions(
        steps=40, out_dir=tmp_path / "run", checkpoint_every=20, eval_every=1000, log_every=5, samples=0
    )
    args = sft.Args(
        model=sft.ModelOptions(
            init_from_hf=tmp_path / "hf", lora_rank=8, lora_targets=("attention", "experts"), lora_dropout=0.05
        ),
        data=sft.DataOptions(seq_len=64, batch_size=8, train_examples=400, eval_examples=16),
        optim=dataclasses.replace(sft.Args().optim, learning_rate=1e-2, warmup_steps=3, freeze=("router",)),
        run=run,
    )
    finished = []
    train = sft.loop.train
    monkeypatch.setattr(sft.loop, "train", lambda *a, **k: finished.append(train(*a, **k)) or finished[-1])
    summary = sft.run(args)
    counts = summary["parameters"]
    assert 0 < counts["trainable"] < 0.5 * counts["total"]  # a 32-wide toy: rank 8 is a quarter of its width
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    losses = [float(line.split('"cross_entropy": ')[1].split(",")[0]) for line in lines if '"cross_entropy"' in line]
    assert np.mean(losses[-3:]) < 0.8 * losses[0]

    # In memory after training: every base weight (router included) bit-identical to the HF folder's.
    base = hf.load(tmp_path / "hf")
    after = [leaf for role, leaf in _leaves_by_role(finished[0].state.model) if role is not Role.ADAPTER]
    for before, now in zip(jax.tree.leaves(eqx.filter(base, eqx.is_array)), after, strict=True):
        np.testing.assert_array_equal(now, before)

    # The checkpoints hold the adapters and their optimizer state, no base weight; the base is recorded.
    with Checkpointer(tmp_path / "run" / "checkpoints", keep_last=None) as checkpointer:
        metadata = checkpointer.metadata()
        model_paths = [p for p in checkpointer.leaf_paths() if p.startswith(".model.")]
    assert metadata["base"]["format"] == "hf" and len(metadata["base"]["sha256"]) == 64
    assert model_paths and all(".adapter." in p for p in model_paths)  # adapters only (a matrix carries its own)
    trained, _ = load_model(tmp_path / "run" / "checkpoints")
    assert has_lora(trained)
    ids = np.random.default_rng(0).integers(0, 300, (2, 24))
    ours = _logits(trained, ids)
    np.testing.assert_array_equal(ours, _logits(finished[0].state.model, ids))
    assert np.max(np.abs(ours - _logits(base, ids))) > 1e-3  # the adapters were trained

    assert convert.main(convert.Args(checkpoint=tmp_path / "run" / "checkpoints", to_hf=tmp_path / "merged")) == 0
    assert "LoRA adapters merged" in capsys.readouterr().out
    with torch.no_grad():
        merged = load_reference(tmp_path / "merged")(torch.as_tensor(ids)).logits.numpy()
    np.testing.assert_allclose(ours, merged, atol=1e-4, rtol=0)

    out = tmp_path / "adapters"
    assert convert.main(convert.Args(checkpoint=tmp_path / "run" / "checkpoints", to_hf=out, adapter_only=True)) == 0
    with torch.no_grad():
        on_base = peft.PeftModel.from_pretrained(load_reference(tmp_path / "hf"), out)(torch.as_tensor(ids)).logits
    np.testing.assert_allclose(ours, on_base.numpy(), atol=1e-4, rtol=0)

    # generate and check_logits read the adapter checkpoint (its base from the recorded folder).
    assert (
        generate.main(generate.Args(checkpoint=tmp_path / "run" / "checkpoints", prompt="12+7", max_new_tokens=4)) == 0
    )
    peft_check = check_logits.Args(hf=tmp_path / "hf", peft=out, checkpoint=tmp_path / "run" / "checkpoints")
    assert check_logits.main(dataclasses.replace(peft_check, max_kl=1e-6)) == 0
    assert "PASS" in capsys.readouterr().out

    # The base moved: found with --base; then a base with one changed weight is refused by its digest.
    shutil.move(tmp_path / "hf", tmp_path / "moved")
    capsys.readouterr()
    assert convert.main(convert.Args(checkpoint=tmp_path / "run" / "checkpoints", to_hf=tmp_path / "x")) == 2
    assert "its base model" in capsys.readouterr().err and not (tmp_path / "x").exists()
    moved = convert.Args(checkpoint=tmp_path / "run" / "checkpoints", to_hf=tmp_path / "x", base=tmp_path / "moved")
    assert convert.main(moved) == 0
    reference = load_reference(tmp_path / "moved")
    with torch.no_grad():
        reference.model.layers[0].self_attn.q_proj.weight[0, 0] += 1e-3
    reference.save_pretrained(tmp_path / "moved")
    capsys.readouterr()
    assert convert.main(dataclasses.replace(moved, to_hf=tmp_path / "y")) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "differs from the one it was trained on" in err and not (tmp_path / "y").exists()

    # Resuming the run from another base is refused before any step.
    resumed = dataclasses.replace(args, run=dataclasses.replace(run, resume=True, steps=41))
    resumed = dataclasses.replace(resumed, model=dataclasses.replace(args.model, init_from_hf=tmp_path / "moved"))
    assert sft.main(resumed) == 2
    assert "was trained on the base model" in capsys.readouterr().err
