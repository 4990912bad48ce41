"""Scale-out on simulated CPU devices: meshes, sharding rules, expert parallelism and resharded checkpoints. Run by
``tests/test_parallel.py`` in a process of its own with 8 CPU devices, so the rest of the suite keeps the one-device
setting (two processes of one device each: ``tests/test_parallel.py`` itself)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqmoe import Transformer, parallel, presets
from eqmoe.checkpoints.orbax import Checkpointer
from eqmoe.config_io import apply_overrides
from eqmoe.train.optimizer import OptimizerConfig, make_optimizer
from eqmoe.train.state import abstract_state, init_state
from eqmoe.train.step import Batch, batch_loss, make_train_step
from tests.test_lora_experts import MESHES as LORA_MESHES
from tests.test_lora_experts import mesh_case as lora_mesh_case

MESHES = ["data=8", "fsdp=8", "data=2,expert=4", "data=2,tensor=2,expert=2"]
pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (run by tests/test_parallel.py)")


def test_mesh_specs_and_rules():
    assert parallel.parse_mesh("data=2,expert=4", 8) == {"data": 2, "fsdp": 1, "expert": 4, "tensor": 1}
    assert parallel.parse_mesh("fsdp=-1,tensor=2", 8) == {"data": 1, "fsdp": 4, "expert": 1, "tensor": 2}
    for spec, error in [
        ("data=3", "3 devices named but 8 are present"),
        ("data=-1,fsdp=-1", "only one axis may be -1"),
        ("pipeline=2", "AXIS=SIZE with AXIS one of"),
        ("data=two", "not an integer"),
        ("data=2,data=4", "given twice"),
    ]:
        with pytest.raises(ValueError, match=error):
            parallel.parse_mesh(spec, 8)
    rules = parallel.parse_rules("embed=,experts=expert+tensor")
    assert rules["embed"] == () and rules["experts"] == ("expert", "tensor") and rules["vocab"] == ("tensor",)
    with pytest.raises(ValueError, match="unknown mesh axis 'pipe'"):
        parallel.parse_rules("embed=pipe")
    p = parallel.make_parallelism("data=2,tensor=2,expert=2")
    assert p.spec(("experts", "embed", "expert_mlp"), (8, 64, 64)) == jax.sharding.PartitionSpec(
        "expert", None, "tensor"
    )
    assert p.spec(("kv_heads",), (3,)) == jax.sharding.PartitionSpec(None)  # 3 heads do not split in 2


def _batch(p, rows=16, seq=32):
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (rows, seq), 0, 260), np.int32)
    segments = np.ones((rows, seq), np.int32)
    segments[::3, seq // 2 :] = 2  # packed rows: two documents
    segments[1, -5:] = 0  # and padding
    positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (rows, seq)).copy()
    target = (segments > 0) & np.concatenate([np.zeros((rows, 1), bool), segments[:, 1:] == segments[:, :-1]], 1)
    put = parallel.global_batch
    return Batch(put(tokens, p), put(segments, p), put(positions, p), put(target, p))


def _loss_and_grads(model, batch):
    (loss, _), grads = eqx.filter_jit(eqx.filter_value_and_grad(batch_loss, has_aux=True))(model, batch)
    return float(loss), jax.tree.leaves(grads)


# The decoder fields the other families add, all at once: OLMoE's attention (biases on q/k/v/o, the norm over
# the whole projection, clip_qkv), GLM-4.5's partial RoPE and group-limited sigmoid routing with a selection
# bias, Qwen2-MoE's gated shared expert.
FAMILY_FIELDS = {
    "attention.bias": "qkvo",
    "attention.qk_norm_scope": "projection",
    "attention.clip_qkv": 2.0,
    "attention.rotary_dim": 8,
    "moe.shared_experts": 1,
    "moe.shared_expert_gate": True,
    "moe.router.strategy": "sigmoid_top_k",
    "moe.router.bias_update_rate": 0.001,
    "moe.router.expert_groups": 4,
    "moe.router.expert_groups_kept": 2,
    # gpt-oss's
    "attention.sinks": True,
    "moe.expert_bias": True,
    "moe.router.gate_bias": True,
    "moe.activation": "clamped_swiglu",
    "moe.swiglu_limit": 1.0,
}


def _hybrid(micro):
    """``micro``'s widths as Qwen3-Next lays them out: three gated DeltaNet layers (chunks of 16: two per row of the
    batch, whose packed documents and padding then cross a chunk) before a gated full-attention layer."""
    from eqmoe.config import LinearAttentionConfig
    from eqmoe.models.qwen3_next import hybrid

    attention, moe = micro.attention, micro.moe
    linear = LinearAttentionConfig(key_heads=2, value_heads=4, key_head_dim=8, value_head_dim=8, chunk_size=16)
    return hybrid(
        vocab=micro.vocab_size,
        embed=micro.embed_dim,
        layers=4,
        heads=attention.num_heads,
        kv_heads=attention.num_kv_heads,
        head_dim=attention.head_dim,
        linear=linear,
        experts=moe.router.num_experts,
        top_k=moe.router.top_k,
        expert_dim=moe.expert_dim,
        shared_dim=moe.expert_dim,
        mlp_dim=None,
        theta=1e4,
        family="qwen3_next",
    )


@pytest.mark.parametrize(
    ("mesh", "variant"),
    [("fsdp=8", "dropless")]
    # under -m slow: plain data parallelism (also the data axis of the other meshes, and the two-process run);
    # data=2,expert=4 (test_train_step_keeps_the_state_sharded_and_matches_one_device's step on it, its gradients in
    # Adam's first moment, and the forward passes of the generation and lm-eval cases); every axis at once (the
    # capacity case's plain attention, the family-fields case's dropless dispatch, the hybrid's softmax router)
    + [pytest.param(mesh, "dropless", marks=pytest.mark.slow) for mesh in MESHES if mesh != "fsdp=8"]
    # capacity dispatch on the mesh with every axis at once; on each other mesh under -m slow
    + [("data=2,tensor=2,expert=2", "capacity")]
    + [pytest.param(mesh, "capacity", marks=pytest.mark.slow) for mesh in MESHES[:-1]]
    + [("data=2,tensor=2,expert=2", "family-fields")]  # every axis at once; data=2,expert=4 under -m slow
    + [pytest.param("data=2,expert=4", "family-fields", marks=pytest.mark.slow)]
    + [("data=2,tensor=2,expert=2", "hybrid")],  # Qwen3-Next's linear and gated full attention, every axis at once
)
def test_one_step_on_a_mesh_matches_one_device(mesh, variant):
    config = presets.get("qwen3-moe-micro")
    if variant == "hybrid":
        config = _hybrid(config)
    if variant == "capacity":
        overrides = {"moe.router.strategy": "top2_gating", "moe.router.capacity_factor": 2.0}
        config = apply_overrides(config, {**overrides, "moe.router.num_groups": 2})
    if variant == "family-fields":
        config = apply_overrides(config, FAMILY_FIELDS)
    model = Transformer(config, key=jax.random.key(0))
    loss, grads = _loss_and_grads(model, _batch(None))
    p = parallel.make_parallelism(mesh)
    with parallel.activate(p):
        sharded = parallel.shard(model, p)
        mesh_loss, mesh_grads = _loss_and_grads(sharded, _batch(p))
    assert abs(mesh_loss - loss) < 1e-5
    for single, split in zip(grads, mesh_grads, strict=True):
        np.testing.assert_allclose(np.asarray(split), np.asarray(single), atol=1e-4, rtol=0)
    w_gate = sharded.segments[0].blocks[0].ffn.experts.gate.weight  # [layers, experts, embed, expert_dim]
    local = w_gate.addressable_shards[0].data.shape
    assert local[1] == config.moe.router.num_experts // p.size("expert")
    assert local[2] == config.embed_dim // p.size("fsdp") and local[3] == config.moe.expert_dim // p.size("tensor")


def test_train_step_keeps_the_state_sharded_and_matches_one_device():
    config = presets.get("qwen3-moe-micro")
    model = Transformer(config, key=jax.random.key(0))
    optimizer, schedule = make_optimizer(OptimizerConfig(warmup_steps=0), eqx.filter(model, eqx.is_array), embed_dim=64)
    step = make_train_step(optimizer, schedule)
    copy = jax.tree.map(lambda x: jnp.copy(x) if eqx.is_array(x) else x, model)  # the step donates its state
    single, _ = step(_batch(None), init_state(copy, optimizer, key=jax.random.key(1)))
    p = parallel.make_parallelism("data=2,expert=4")
    with parallel.activate(p):
        state = init_state(model, optimizer, key=jax.random.key(1), parallelism=p)
        split, _ = step(_batch(p), state)
    w_gate = split.model.segments[0].blocks[0].ffn.experts.gate.weight
    assert w_gate.sharding.spec[1] == "expert"
    leaves = [jax.tree.leaves(eqx.filter(state, eqx.is_array)) for state in (single, split)]
    for a, b in zip(*leaves, strict=True):
        if jnp.issubdtype(a.dtype, jnp.floating):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=0)


def test_checkpoint_saved_on_one_mesh_restores_on_another_and_on_one_device(tmp_path):
    config = presets.get("qwen3-moe-micro")
    model = Transformer(config, key=jax.random.key(0))
    optimizer, _ = make_optimizer(OptimizerConfig(), eqx.filter(model, eqx.is_array), embed_dim=64)
    saved_on = parallel.make_parallelism("data=2,expert=4")
    state = init_state(model, optimizer, key=jax.random.key(1), parallelism=saved_on)
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(1, state, {"note": "data=2,expert=4"})
    expected = [np.asarray(x) for x in jax.tree.leaves(eqx.filter(state.model, eqx.is_array))]
    target = abstract_state(lambda: model, optimizer, key=jax.random.key(1))
    for mesh in ("data=8", None):
        p = None if mesh is None else parallel.make_parallelism(mesh)
        with Checkpointer(tmp_path) as checkpointer:
            restored, _ = checkpointer.restore(1, target if p is None else parallel.abstract_sharded(target, p))
        leaves = jax.tree.leaves(eqx.filter(restored.model, eqx.is_array))
        for want, got in zip(expected, leaves, strict=True):
            np.testing.assert_array_equal(np.asarray(got), want)
        if p is not None:
            assert leaves[0].sharding.mesh.shape["data"] == 8
        else:
            assert len(leaves[0].sharding.device_set) == 1


def test_generation_on_an_expert_mesh_matches_one_device():
    from eqmoe.inference import generate

    model = Transformer(presets.get("qwen3-moe-micro"), key=jax.random.key(0))
    prompt = jax.random.randint(jax.random.key(3), (2, 8), 0, 260)
    expected = generate(model, prompt, max_new_tokens=6)
    p = parallel.make_parallelism("data=2,expert=4")
    with parallel.activate(p):
        tokens = generate(parallel.shard(model, p), prompt, max_new_tokens=6)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(expected))


def test_plan_on_a_mesh_splits_the_arguments_exactly():
    from eqmoe.analysis import plan

    config = presets.get("qwen3-moe-tiny")
    one = plan.estimate(config, parallel.make_parallelism("data=1", devices=jax.devices()[:1]), 16, 128)
    p = parallel.make_parallelism("data=2,fsdp=4")
    estimate, compiled = plan.estimate(config, p, 16, 128), plan.compile_step(config, p, 16, 128)
    assert estimate.argument == pytest.approx(compiled.argument, rel=0.01)
    assert estimate.parameters < one.parameters / 3  # embed split over fsdp=4, norms replicated


def test_hf_folder_loads_straight_onto_the_mesh_one_slice_at_a_time(tmp_path):
    """A bfloat16 Hugging Face folder read onto fsdp=8: bf16 by default, each device holding its share, the host
    one device slice at a time, and the one-device load's parameters bit for bit.

    Host memory is what tracemalloc sees of numpy's allocations. On CPU devices XLA adopts each aligned host slice
    as that device's buffer, so the load's growth is the model itself; what the host held beyond the devices is the
    peak above the end, and the largest buffer left is one device's slice, not a stacked tensor."""
    import collections
    import tracemalloc

    import ml_dtypes
    import torch

    from eqmoe.checkpoints import hf
    from tests.conftest import save_tiny_hf

    # Wide enough (about 3 MB) that a whole stacked expert tensor would stand out against one device's slice.
    wide = dict(hidden_size=128, moe_intermediate_size=128, intermediate_size=256, vocab_size=1024)
    save_tiny_hf(tmp_path, mlp_only_layers=[0], **wide).to(torch.bfloat16).save_pretrained(tmp_path)
    hf.load(tmp_path)  # traces the model once, so tracing's caches stay out of the figures
    p = parallel.make_parallelism("fsdp=8")
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    model = hf.load(tmp_path, parallelism=p)
    after, peak = tracemalloc.get_traced_memory()
    buffers = tracemalloc.take_snapshot().filter_traces([tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)])
    tracemalloc.stop()

    leaves = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    model_bytes, largest = sum(leaf.nbytes for leaf in leaves), max(leaf.nbytes for leaf in leaves)
    assert {leaf.dtype for leaf in leaves} == {jnp.dtype(ml_dtypes.bfloat16)}
    per_device = collections.Counter()
    for leaf in leaves:
        for shard in leaf.addressable_shards:
            per_device[shard.device] += shard.data.nbytes
    largest_buffer = max((trace.size for trace in buffers.traces), default=0)
    print(f"\nmodel {model_bytes} B (largest leaf {largest} B); most on one device {max(per_device.values())} B")
    print(f"host: +{after - before} B at the end, +{peak - before} B at the peak; largest buffer {largest_buffer} B")
    assert len(per_device) == 8 and max(per_device.values()) < model_bytes / 4
    assert peak - after < largest / 2  # never a whole stacked tensor on the host beside the devices' memory
    assert largest_buffer < largest / 4

    exact = hf.load(tmp_path, dtype="float32")  # bf16 files read exactly into float32 on one device
    for got, want in zip(leaves, jax.tree.leaves(eqx.filter(exact, eqx.is_array)), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want).astype(ml_dtypes.bfloat16))
    # (a sharded model computes what one device does: the one-step cases above)


def test_lm_eval_log_likelihoods_on_a_mesh_equal_one_device():
    from eqmoe.evaluation.scoring import score

    model = Transformer(presets.get("qwen3-moe-tiny").replace(vocab_size=64, init_std=0.2), key=jax.random.key(0))
    rng = np.random.default_rng(0)
    requests = [(rng.integers(0, 64, int(n)).tolist(), int(n) - 3) for n in rng.integers(5, 40, 12)]
    expected = score(model, requests, batch_size=8)
    p = parallel.make_parallelism("data=2,expert=4")  # batch rows split, experts dispatched across devices
    with parallel.activate(p):
        got = score(parallel.shard(model, p), requests, batch_size=8)
    np.testing.assert_allclose([s.logprob for s in got], [s.logprob for s in expected], rtol=1e-5, atol=1e-4)
    assert [s.greedy for s in got] == [s.greedy for s in expected]


@pytest.mark.parametrize("mesh", LORA_MESHES)
def test_expert_parallel_lora_adapters_match_one_device(mesh):
    """tests/test_lora_experts.py's adapted MoE layer: its output and gradients on the mesh equal one device's."""
    lora_mesh_case(mesh)
