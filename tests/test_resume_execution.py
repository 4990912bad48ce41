"""A resumed run may change how the model is executed (remat, dispatch, dtype) and its objective (loss
weights), never its architecture: the config's fields declare their kind once, and ``--resume`` and
``Transformer.with_config`` compare the architecture only."""

import dataclasses
import json
import shutil

import jax
import pytest

from eqmoe import Transformer, presets
from eqmoe.checkpoints.orbax import Checkpointer
from eqmoe.config import (
    LossConfig,
    ModelConfig,
    MoEConfig,
    field_kind,
)
from eqmoe.config_io import apply_overrides, architecture_differences
from eqmoe.inference import dropless
from experiments import pretrain, sft
from experiments._cli import UsageError

MICRO = presets.get("qwen3-moe-micro")


def test_every_field_declares_its_kind_where_it_is_defined():
    assert [f.name for f in dataclasses.fields(ModelConfig) if field_kind(ModelConfig, f.name) == "execution"] == [
        "dtype",
        "scan_layers",
        "scan_unroll",
        "remat",
        "mtp_layers_declared",  # what a config.json declared beyond the layers its folder holds
        "output_chunk",
    ]
    assert field_kind(ModelConfig, "loss") == "objective"
    assert field_kind(ModelConfig, "param_dtype") == "architecture"  # the dtype the checkpoint stores
    assert field_kind(MoEConfig, "dispatch") == field_kind(MoEConfig, "block_size") == "execution"
    assert field_kind(MICRO.attention, "backend") == field_kind(MICRO.attention, "block_size") == "execution"
    with pytest.raises(ValueError, match="no field 'remat_policy'"):
        field_kind(ModelConfig, "remat_policy")


def test_architecture_differences_skip_execution_and_objective_fields():
    changed = apply_overrides(
        MICRO,
        {
            "remat": "block",
            "dtype": "bfloat16",
            "scan_layers": False,
            "scan_unroll": 4,
            "output_chunk": 8,
            "moe.dispatch": "dense",
            "moe.block_size": 16,
            "attention.backend": "dense",
            "attention.block_size": 32,
            "loss.load_balance_weight": 0.5,
            "loss.router_z_loss_weight": 0.1,
        },
    )
    assert architecture_differences(MICRO, changed) == []
    other = apply_overrides(changed, {"moe.router.top_k": 1, "param_dtype": "bfloat16", "norm.eps": 1e-5})
    assert architecture_differences(MICRO, other) == [
        ("moe.router.top_k", 2, 1),
        ("norm.eps", 1e-6, 1e-5),
        ("param_dtype", "float32", "bfloat16"),
    ]
    dense = MICRO.replace(moe=None, mlp_dim=64, layers=("dense",) * 2)
    assert architecture_differences(MICRO, dense) == [
        ("layers", MICRO.layers, dense.layers),
        ("mlp_dim", MICRO.mlp_dim, 64),
        ("moe", MICRO.moe, None),
    ]


def test_with_config_changes_execution_and_objective_and_refuses_another_architecture():
    model = Transformer(MICRO, key=jax.random.key(0))
    config = MICRO.replace(remat="block", loss=LossConfig(load_balance_weight=0.1))
    assert model.with_config(config).config == config
    with pytest.raises(ValueError, match=r"routed_scaling_factor 1.0 \(model\) vs 2.0 \(new\)"):
        model.with_config(apply_overrides(MICRO, {"moe.router.routed_scaling_factor": 2.0}))  # same shapes
    capacity = apply_overrides(MICRO, {"moe.router.capacity_factor": 2.0, "moe.dispatch": "capacity"})
    with pytest.raises(ValueError, match="capacity_factor None"):
        model.with_config(capacity)
    assert dropless(model.with_config(capacity, allow=("moe.router.capacity_factor",))).config.moe.dispatch == "auto"


# The commands (sft defaults: batch 16 x 128 tokens, in warmup) with fewer built-in conversations
# and no samples. With test_sft's faster settings (batch 4 x 64, lr 3e-3 after 5 warmup steps) the loss
# spikes, and the float rounding of another remat/dispatch (1 ulp at the first steps) grows to ~1e-5 by
# step 40, the same for an uninterrupted run with that remat/dispatch: a property of the execution, not of the
# resume. 24 steps, resumed at 12, keep the resume and the change of execution in view at half the cost.
STEPS = 24


def _sft(out_dir, steps, resume=False, checkpoint_every=400, **model):
    return sft.Args(
        model=sft.ModelOptions(**model),
        data=sft.DataOptions(train_examples=5_000, eval_examples=16),
        run=sft.RunOptions(
            steps=steps, out_dir=out_dir, samples=0, log_every=1, resume=resume, checkpoint_every=checkpoint_every
        ),
    )


def _losses(out_dir) -> dict[int, float]:
    records = (json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def _stored_config(out_dir) -> dict:
    with Checkpointer(out_dir / "checkpoints", keep_last=None) as checkpointer:
        return checkpointer.metadata()["config"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted sft run of STEPS steps and, as a run stopped half way leaves it, its folder up to the
    checkpoint at STEPS // 2 (in warmup, a run of STEPS // 2 steps takes the same steps)."""
    root = tmp_path_factory.mktemp("resume")
    straight = sft.run(_sft(root / "straight", STEPS, checkpoint_every=STEPS // 2))
    shutil.copytree(root / "straight", root / "first")
    shutil.rmtree(root / "first" / "checkpoints" / str(STEPS))
    (root / "first" / "summary.json").unlink()
    return root, straight


def test_sft_resumes_with_another_remat_and_dispatch(runs, tmp_path):
    root, straight = runs
    run = tmp_path / "run"
    shutil.copytree(root / "first", run)
    resumed = sft.run(_sft(run, STEPS, resume=True, remat="block", dispatch="dense"))  # both changes at once
    assert abs(resumed["final_loss"] - straight["final_loss"]) <= 1e-6
    losses, expected = _losses(run), _losses(root / "straight")
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert all(losses[step] == expected[step] for step in range(1, STEPS // 2 + 1))  # kept as written
    assert max(abs(losses[step] - expected[step]) for step in range(STEPS // 2 + 1, STEPS + 1)) <= 1e-6
    # The resumed model ran with the new settings, and its checkpoint stores them.
    summary = json.loads((run / "summary.json").read_text())
    for config in (_stored_config(run), summary["config"]):
        assert (config["remat"], config["moe"]["dispatch"]) == ("block", "dense")


def test_the_dispatch_option_is_validated_in_sft_and_pretrain():
    config = sft.execution_config(MICRO, sft.ModelOptions(dispatch="dense"))
    assert config.moe.dispatch == "dense" and config.param_dtype == "float32"
    refused = r"--dispatch: .*dispatch='fast' is invalid; allowed: .*dense.*sorted"
    with pytest.raises(UsageError, match=refused):
        sft.execution_config(MICRO, sft.ModelOptions(dispatch="fast"))
    # --dispatch is applied after --override, as in sft
    options = pretrain.ModelOptions(dispatch="dense", override=("moe.dispatch=sorted",))
    assert pretrain.model_config(options).moe.dispatch == "dense"
    with pytest.raises(UsageError, match=refused):
        pretrain.model_config(pretrain.ModelOptions(dispatch="fast"))


def _pretrain(out_dir, steps, *override, resume=False, dispatch=None):
    return pretrain.Args(
        data=pretrain.DataOptions(seq_len=64, batch_size=4, chars_per_domain=6_000, eval_chars_per_domain=1_500),
        run=pretrain.RunOptions(steps=steps, out_dir=out_dir, checkpoint_every=2, eval_every=100, resume=resume),
        model=pretrain.ModelOptions(override=override, dispatch=dispatch),
    )


def test_pretrain_resume_takes_new_execution_and_loss_overrides_and_refuses_another_architecture(tmp_path, capsys):
    out = tmp_path / "run"
    pretrain.run(_pretrain(out, 2))
    assert pretrain.main(_pretrain(out, 4, "moe.router.top_k=1", "remat=block", resume=True)) == 2
    err = capsys.readouterr().err
    assert (
        f"--resume: the checkpoint in {out} has a different architecture: moe.router.top_k 2 (checkpoint) vs 1 (now)"
        in err
    )
    assert err.rstrip().endswith("(now)")  # the only difference: remat may change
    new = ("moe.dispatch=dense", "remat=block", "loss.load_balance_weight=0.01")
    assert pretrain.main(_pretrain(out, 4, *new, resume=True)) == 0
    assert "resumed from step 2" in capsys.readouterr().err
    stored = _stored_config(out)
    assert (stored["moe"]["dispatch"], stored["remat"], stored["loss"]["load_balance_weight"]) == (
        "dense",
        "block",
        0.01,
    )
    # --dispatch may change on resume too, and wins over the stored --override
    resumed = pretrain.replay_stored_arguments(_pretrain(out, 6, resume=True, dispatch="sorted"), pretrain.Args())
    assert resumed.model.override == new and pretrain.model_config(resumed.model).moe.dispatch == "sorted"
