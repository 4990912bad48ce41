"""LoRA over a base held in block-FP8 (``hf.load(..., keep_fp8=True)``, ``sft --fp8-base``): the steps are those on
the dequantized base, the base takes one byte per parameter plus its scales (and ``plan`` counts it so), and a run's
merged export is the dequantized base plus the adapters in transformers.

The folder is a tiny DeepSeek-V3 in the published layout (tests/test_fp8_files.py writes it: block-FP8 attention,
dense-MLP, expert and shared-expert weights with float32 scale grids, a multi-token-prediction layer) in 14 x 10 blocks,
which divide none of its matrices: every weight has partial blocks at both edges. Three layers, the last two MoE, so
the MoE segment scans two stacked repeats of each FP8 weight (and its experts stack eight)."""

import dataclasses
import math
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqmoe.analysis import plan as planning
from eqmoe.checkpoints import hf
from eqmoe.checkpoints.model_checkpoint import load_model
from eqmoe.checkpoints.orbax import Checkpointer
from eqmoe.inference import generate
from eqmoe.lora import LoRAConfig, add_lora, merge_lora
from eqmoe.nn.fp8 import FP8, BlockFP8Weight, dequantized, held_bytes, is_block_fp8
from eqmoe.nn.linear import LowRank
from eqmoe.params import ParamInfo, Role, param_info
from eqmoe.train.optimizer import OptimizerConfig, make_optimizer, trained_roles
from eqmoe.train.state import hold_frozen, init_state
from eqmoe.train.step import Batch, make_train_step
from experiments import convert, sft
from experiments import plan as plan_command
from tests.test_fp8_files import DEEPSEEK_PARTIAL, V3, _deepseek_folder, _with_mtp

torch = pytest.importorskip("torch")

LORA = LoRAConfig(rank=4, alpha=8.0, targets=("attention", "experts"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The block-FP8 folder (vocabulary 300: the byte tokenizer's 260 ids fit, for sft)."""
    root = tmp_path_factory.mktemp("fp8_lora")
    V3.save_tiny(root / "saved", seed=7, vocab_size=300, n_routed_experts=8, initializer_range=0.3)
    _with_mtp(root / "saved", root / "mtp")
    _deepseek_folder(root / "mtp", root / "fp8", False, DEEPSEEK_PARTIAL)
    return root / "fp8"


def _batch(vocab: int) -> Batch:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (2, 12))
    segments = np.ones((2, 12), np.int32)
    segments[1, 8:] = 0  # padding
    positions = np.broadcast_to(np.arange(12), (2, 12))
    return Batch(*(jnp.asarray(x, jnp.int32) for x in (tokens, segments, positions)), jnp.asarray(segments != 0))


def _steps(model, dispatch: str, count: int = 2):
    """The losses and gradient norms of ``count`` LoRA steps from ``model`` (adapters drawn with one key), the
    adapters after them and the model."""
    model = model.with_config(model.config.replace(moe=dataclasses.replace(model.config.moe, dispatch=dispatch)))
    model = add_lora(model, LORA, key=jax.random.key(3))
    optim = OptimizerConfig(learning_rate=3e-2, warmup_steps=0, weight_decay=0.0).for_run(count)
    params = eqx.filter(model, eqx.is_array)
    optimizer, schedule = make_optimizer(optim, params, embed_dim=model.config.embed_dim)
    trained = trained_roles(optim, params)
    state = init_state(hold_frozen(model, trained), optimizer, key=jax.random.key(0))
    step, batch, losses = make_train_step(optimizer, schedule, trained), _batch(model.config.vocab_size), []
    for _ in range(count):
        state, metrics = step(batch, state)
        losses.append((float(metrics["loss"]), float(metrics["grad_norm"])))
    adapters = [np.asarray(leaf) for leaf, info in _with_roles(state.model) if info.role is Role.ADAPTER]
    return losses, adapters, state.model


def _with_roles(model) -> list[tuple[jax.Array, ParamInfo]]:
    arrays = eqx.filter(model, eqx.is_array)
    infos = jax.tree.leaves(param_info(arrays), is_leaf=lambda x: isinstance(x, ParamInfo))
    return list(zip(jax.tree.leaves(arrays), infos, strict=True))


# ragged_dot (the accelerator path) with -m slow: the FP8 container and its recomputed product are the same code
# under both backends, and ragged_dot's own numbers equal sorted's in tests/test_stack_and_dispatch.py
@pytest.mark.parametrize("dispatch", ["sorted", pytest.param("ragged_dot", marks=pytest.mark.slow)])
def test_a_lora_step_on_the_fp8_base_is_the_step_on_its_dequantization(folder, dispatch):
    """Two steps (the second with adapters the first moved), float32 compute: the losses and gradient norms equal
    those of the same steps on ``hf.load``'s dequantized base (1e-5 relative), so do the adapters, and the FP8 base
    comes out unchanged. ``sorted`` runs the grouped kernel's hand-written backward pass over the experts,
    ``ragged_dot`` the experts' own products."""
    held = hf.load(folder, dtype="float32", keep_fp8=True)
    losses, adapters, after = _steps(held, dispatch)
    want_losses, want_adapters, _ = _steps(hf.load(folder, dtype="float32"), dispatch)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert losses[1][0] < losses[0][0]
    for got, want in zip(adapters, want_adapters, strict=True):
        # Adam divides each gradient by its own size: float noise of a near-zero gradient moves an element by up to lr
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    reloaded = hf.load(folder, dtype="float32", keep_fp8=True)  # the step donated the state it started from
    before = [x for x in jax.tree.leaves(reloaded, is_leaf=is_block_fp8) if is_block_fp8(x)]
    now = [x for x in jax.tree.leaves(after, is_leaf=is_block_fp8) if is_block_fp8(x)]
    assert len(now) == len(before) > 0
    for a, b in zip(now, before, strict=True):
        assert a.values.dtype == FP8
        np.testing.assert_array_equal(np.asarray(a.values), np.asarray(b.values))


def test_the_fp8_base_takes_one_byte_a_parameter_and_plan_counts_it(folder, capsys):
    """Leaf bytes of the loaded model: every quantized weight of the files (attention, dense MLP, experts, shared
    experts, in the decoder and the MTP layer) is held as FP8 values plus float32 scales, everything else as
    ``hf.load`` reads it; the roles and axes are the weight's. ``plan`` counts a DeepSeek-V3 LoRA base at ~1 byte."""
    held = hf.load(folder, dtype="float32", keep_fp8=True)
    plain = hf.load(folder, dtype="float32")
    weights = [(p, x) for p, x in jax.tree_util.tree_leaves_with_path(held, is_leaf=is_block_fp8) if is_block_fp8(x)]
    # leaves: the dense segment's attention and MLP, the MoE segment's (two repeats stacked) and the MTP layer's
    # attention, routed experts and shared expert
    assert len(weights) == (5 + 3) + 2 * (5 + 3 + 3)
    count, size = held_bytes(held)
    scales = sum(math.prod(x.scales.shape) for _, x in weights)
    assert size == count + 4 * scales and size < 1.06 * count  # 14 x 10 blocks: 4 bytes per 140 parameters or fewer
    leaves = lambda m: jax.tree.leaves(eqx.filter(m, eqx.is_array))  # noqa: E731
    total = sum(x.nbytes for x in leaves(held))
    assert total == sum(x.nbytes for x in leaves(plain)) - 4 * count + size  # float32 elsewhere, as before

    infos = param_info(held)
    experts = infos.segments[1].blocks[0].ffn.experts.down.weight
    assert experts.values == ParamInfo(Role.EXPERT, ("layers", "experts", "expert_mlp", "embed"))
    assert experts.scales == ParamInfo(Role.EXPERT, ("layers", "experts", "expert_mlp", "embed"))
    o = infos.segments[0].blocks[0].attention.o.weight  # [heads, value_dim] -> embed: the grid's input spans both
    assert o.scales == ParamInfo(Role.ATTENTION, ("layers", "fp8_blocks", "embed"))
    assert infos.mtp[0].block.ffn.experts.gate.weight.values.role is Role.MTP

    # the planner's DeepSeek-V3: its published 128 x 128 blocks
    training = planning.Training(lora=LoRAConfig(rank=16), fp8_block=(128, 128))
    config = plan_command.Args(preset="deepseek-v3").preset_config().replace(dtype="bfloat16")
    frozen, frozen_bytes = planning.frozen_storage(config, training)
    assert frozen > 6.7e11 and 1.0 < frozen_bytes / frozen < 1.005  # bf16 embeddings, head, norms and routers
    args = plan_command.Args(preset="deepseek-v3", lora_rank=16, fp8_base=True, compile=False, dtype="bfloat16")
    assert plan_command.main(args) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "frozen:" in line)
    assert float(re.search(r"\(([\d.]+) bytes/parameter: block-FP8", line).group(1)) < 1.005, line


def test_fp8_weights_are_never_trained(folder, tmp_path, capsys):
    """Without LoRA the optimizer would update the FP8 weights: refused in one line, by make_optimizer, sft and plan."""
    held = hf.load(folder, dtype="float32", keep_fp8=True)
    with pytest.raises(ValueError, match="held in block-FP8 .* never trained") as error:
        make_optimizer(OptimizerConfig(), eqx.filter(held, eqx.is_array), embed_dim=held.config.embed_dim)
    assert "\n" not in str(error.value)
    capsys.readouterr()
    args = sft.Args(model=sft.ModelOptions(init_from_hf=folder, fp8_base=True), run=sft.RunOptions(out_dir=tmp_path))
    assert sft.main(args) == 2
    assert plan_command.main(plan_command.Args(preset="deepseek-v3", fp8_base=True, compile=False)) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2 and all("--fp8-base needs --lora-rank" in line for line in errors), errors


def test_merging_an_adapter_over_the_fp8_base_gives_the_dequantized_weight_plus_the_adapter(folder):
    held = add_lora(hf.load(folder, dtype="float32", keep_fp8=True), LORA, key=jax.random.key(1))
    plain = add_lora(hf.load(folder, dtype="float32"), LORA, key=jax.random.key(1))
    is_adapter = lambda x: isinstance(x, LowRank)  # noqa: E731
    nonzero = lambda m: jax.tree.map(  # noqa: E731 (B is zero at the start)
        lambda x: eqx.tree_at(lambda a: a.b, x, x.b + 0.05) if is_adapter(x) else x, m, is_leaf=is_adapter
    )
    merged, want = eqx.filter_jit(lambda m: merge_lora(nonzero(m)))(held), eqx.filter_jit(merge_lora)(nonzero(plain))
    q = merged.segments[1].blocks[0].attention.q_b
    assert not is_block_fp8(q.weight) and q.weight.dtype == jnp.float32 and q.adapter is None
    assert is_block_fp8(merged.segments[0].blocks[0].ffn.down.weight)  # no adapter on the dense MLP: kept FP8
    got = jax.tree_util.tree_leaves_with_path(eqx.filter_jit(dequantized)(merged))
    for (path, value), wanted in zip(got, jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(value), np.asarray(wanted), err_msg=jax.tree_util.keystr(path))


# -m slow (49 s): its parts run by default, a LoRA step on the FP8 base (the step test), merging over it, decoding
# from it and the option's refusals above; this is the whole sft command around them, resume and both exports
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Data has no positive values")  # two steps' plots
def test_sft_on_the_fp8_base_resumes_and_exports_the_merged_model(folder, tmp_path, capsys, monkeypatch):
    """Two sft steps with ``--fp8-base`` (and ``--freeze router``), one more step resumed, a merged export:
    transformers' logits on it are eqmoe's of the trained FP8-resident model, and so are those of the checkpoint read
    back over the dequantized folder. The checkpoints hold the adapters and the router's selection bias (kept whatever
    trains), no base weight; the PEFT export is written."""
    run = sft.RunOptions(steps=2, out_dir=tmp_path / "run", checkpoint_every=2, eval_every=1000, log_every=1, samples=0)
    args = sft.Args(
        model=sft.ModelOptions(init_from_hf=folder, lora_rank=4, lora_targets=("attention", "experts"), fp8_base=True),
        data=sft.DataOptions(seq_len=32, batch_size=4, train_examples=40, eval_examples=4),
        optim=dataclasses.replace(sft.Args().optim, learning_rate=1e-2, warmup_steps=0, freeze=("router",)),
        run=run,
    )
    finished = []
    train = sft.loop.train
    monkeypatch.setattr(sft.loop, "train", lambda *a, **k: finished.append(train(*a, **k)) or finished[-1])
    assert sft.main(args) == 0
    err = capsys.readouterr().err
    assert "--fp8-base: " in err and "bytes/parameter" in err
    trained = finished[-1].state.model
    assert any(is_block_fp8(x) for x in jax.tree.leaves(trained, is_leaf=is_block_fp8))

    resumed = dataclasses.replace(args, run=dataclasses.replace(run, resume=True, steps=3))
    assert sft.main(resumed) == 0
    assert "resumed from step 2" in capsys.readouterr().err
    trained = finished[-1].state.model
    with Checkpointer(tmp_path / "run" / "checkpoints", keep_last=None) as checkpointer:
        saved = [p for p in checkpointer.leaf_paths() if p.startswith(".model.")]
    assert saved and all(".adapter." in p or p.endswith(".router.bias") for p in saved)  # no base weight

    ids = np.random.default_rng(1).integers(0, 300, (2, 16))
    ours = np.asarray(eqx.filter_jit(lambda m, t: m(t).logits)(trained, jnp.asarray(ids)))
    restored, _ = load_model(tmp_path / "run" / "checkpoints")  # the base read dequantized from the folder
    np.testing.assert_allclose(np.asarray(restored(jnp.asarray(ids)).logits), ours, rtol=0, atol=1e-5)
    assert convert.main(convert.Args(checkpoint=tmp_path / "run" / "checkpoints", to_hf=tmp_path / "merged")) == 0
    with torch.no_grad():
        reference = V3.reference(tmp_path / "merged").float()
        theirs = reference(torch.as_tensor(ids)).logits.numpy()
    np.testing.assert_allclose(theirs, ours, rtol=0, atol=1e-4)
    adapters = tmp_path / "adapters"
    assert (
        convert.main(convert.Args(checkpoint=tmp_path / "run" / "checkpoints", to_hf=adapters, adapter_only=True)) == 0
    )
    assert (adapters / "adapter_model.safetensors").is_file()


# -m slow (12 s): every product reading the FP8 base, kv_b's dequantization included, is checked by the step test
@pytest.mark.slow
def test_greedy_generation_reads_the_fp8_base(folder):
    """Decoding through the latent cache (queries absorbing ``kv_b``, read dequantized) gives the tokens of the
    dequantized base."""
    prompt = jnp.asarray(np.random.default_rng(2).integers(0, 300, (2, 5)))
    held = generate(hf.load(folder, dtype="float32", keep_fp8=True), prompt, max_new_tokens=4)
    np.testing.assert_array_equal(
        np.asarray(held), np.asarray(generate(hf.load(folder, dtype="float32"), prompt, max_new_tokens=4))
    )


def test_the_weight_container_dequantizes_like_numpy():
    """``values * scale`` per block of the flattened ``[fan_in, fan_out]`` matrix, partial blocks at both edges, for a
    weight with two input axes and stacked copies."""
    rng = np.random.default_rng(0)
    values = rng.normal(size=(2, 3, 5, 7)).astype(np.float32)  # [copies, heads, head_dim, out]: fan_in 15
    scales = rng.uniform(0.5, 2, size=(2, 4, 3)).astype(np.float32)  # 4 x 3 blocks of 4 x 3
    weight = BlockFP8Weight(jnp.asarray(values, FP8), jnp.asarray(scales), (4, 3), in_dims=2, out_dims=1)
    stored = np.asarray(weight.values, np.float32).reshape(2, 15, 7)
    rows, cols = np.arange(15)[:, None] // 4, np.arange(7)[None, :] // 3
    want = (stored * scales[:, rows, cols]).reshape(values.shape)
    np.testing.assert_array_equal(np.asarray(weight.dequantize()), want)
    np.testing.assert_array_equal(np.asarray(weight[1].dequantize()), want[1])
    assert weight.shape == values.shape and weight.nbytes == values.size + 4 * scales.size
