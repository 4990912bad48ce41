"""LoRA SFT of a tiny HF Qwen3-MoE end to end: the loss falls, the base stays bit-identical, and the merged
export read by transformers gives the adapter model's logits."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqmoe.checkpoints import hf
from eqmoe.checkpoints.model_checkpoint import load_model
from eqmoe.lora import has_lora
from eqmoe.nn._params import Role, param_info
from experiments import convert, sft
from tests.conftest import load_reference, save_tiny_hf

torch = pytest.importorskip("torch")


def test_lora_sft_from_hf_then_merged_export_matches_transformers(tmp_path, capsys):
    # Wider initial weights than HF's 0.02: with a frozen random head the adapters need logits that can move.
    save_tiny_hf(tmp_path / "hf", vocab_size=300, num_hidden_layers=2, initializer_range=0.3)
    run = sft.RunOptions(
        steps=40, out_dir=tmp_path / "run", checkpoint_every=40, eval_every=1000, log_every=5, samples=0
    )
    args = sft.Args(
        model=sft.ModelOptions(init_from_hf=tmp_path / "hf", lora_rank=8, lora_targets=("attention", "experts")),
        data=sft.DataOptions(seq_len=64, batch_size=8, train_examples=400, eval_examples=16),
        optim=dataclasses.replace(sft.Args().optim, learning_rate=1e-2, warmup_steps=3),
        run=run,
    )
    summary = sft.run(args)
    counts = summary["parameters"]
    assert 0 < counts["trainable"] < 0.5 * counts["total"]  # a 32-wide toy: rank 8 is a quarter of its width
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    losses = [float(line.split('"cross_entropy": ')[1].split(",")[0]) for line in lines if '"cross_entropy"' in line]
    assert np.mean(losses[-3:]) < 0.8 * losses[0]

    trained, metadata = load_model(tmp_path / "run" / "checkpoints")
    assert has_lora(trained) and metadata["lora"]["rank"] == 8
    base = hf.load(tmp_path / "hf")
    infos = jax.tree.leaves(param_info(eqx.filter(trained, eqx.is_array)), is_leaf=lambda x: hasattr(x, "role"))
    trained_leaves = [
        leaf
        for info, leaf in zip(infos, jax.tree.leaves(eqx.filter(trained, eqx.is_array)), strict=True)
        if info.role is not Role.ADAPTER
    ]
    for before, after in zip(jax.tree.leaves(eqx.filter(base, eqx.is_array)), trained_leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(after), np.asarray(before))  # the base is bit-identical

    assert convert.main(convert.Args(checkpoint=tmp_path / "run" / "checkpoints", to_hf=tmp_path / "merged")) == 0
    assert "LoRA adapters merged" in capsys.readouterr().out
    ids = np.random.default_rng(0).integers(0, 300, (2, 24))
    ours = np.asarray(eqx.filter_jit(lambda m, t: m(t).logits)(trained, jnp.asarray(ids)))
    with torch.no_grad():
        reference = load_reference(tmp_path / "merged")(torch.as_tensor(ids)).logits.numpy()
    unmerged = np.asarray(eqx.filter_jit(lambda m, t: m(t).logits)(base, jnp.asarray(ids)))
    assert np.max(np.abs(ours - unmerged)) > 1e-3  # the adapters were trained
    np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0)
