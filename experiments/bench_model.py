"""Whole-model speed: eqmoe against Hugging Face transformers' Qwen3-MoE, DeepSeek-V3, gpt-oss and Qwen3-Next, same
weights and batch.

    python -m experiments.bench_model                                   # small, wide, long, fine, deepseek
    python -m experiments.bench_model --shape fine deepseek --dtype bfloat16
    python -m experiments.bench_model --shape small-train --repeats 3   # one row, one pass
    python -m experiments.bench_model --shape wide --breakdown          # + attention / MoE / dense / norm / head
    python -m experiments.bench_model --shape long --seq-len 2048 --json-out model.json
    python -m experiments.bench_model --shape gpt-oss --breakdown       # + sliding vs full attention layers
    python -m experiments.bench_model --shape qwen3-next --breakdown    # + one linear layer at 2k, 8k and 32k tokens

Each row (:mod:`experiments._bench_rows`) builds a random ``transformers.Qwen3MoeForCausalLM`` (small, wide, long;
fine: 128 experts top-8 as Qwen3-30B-A3B), ``DeepseekV3ForCausalLM`` (deepseek: 256 experts top-8 in groups, a shared
expert, latent attention), ``GptOssForCausalLM`` or ``Qwen3NextForCausalLM`` (eager attention and experts, float32;
Qwen3-Next's gated delta rule and convolution on transformers' torch path), saves it and loads the folder with
``eqmoe.checkpoints.hf.load``; the max |logit difference| on the batch must be below ``--logit-tolerance`` before
anything is timed. With ``--dtype bfloat16`` both forward passes hold their weights in bfloat16, and both train steps
keep float32 weights and optimizer state and compute in bfloat16 (eqmoe's compute dtype, torch's ``autocast``).
Where JAX runs on a GPU, torch runs on it too. Passes:

- ``forward``: the logits of the batch (torch under ``inference_mode``; eqmoe jitted, as ``batch_loss``
  calls the model: one packed segment, all tokens real).
- ``train``: one optimizer step. eqmoe runs the project's own ``make_train_step`` (donated state, the
  configured objective: CE + 0.001 * pooled load balance, every reported metric) with
  ``OptimizerConfig(warmup_steps=0)``: AdamW lr 3e-4, b1 0.9, b2 0.95, eps 1e-8, weight decay 0.1 except
  norm scales and biases, global-norm clip 1.0. transformers runs ``model(ids, labels=ids,
  output_router_logits=True).loss`` (CE + router_aux_loss_coef * aux), ``backward``,
  ``clip_grad_norm_(1.0)`` and ``torch.optim.AdamW`` with the same values and the same decay groups. DeepSeek-V3
  trains no auxiliary loss on either side (eqmoe moves its selection bias instead, as the family does).

The two frameworks alternate in one process, in blocks of calls that each open with an untimed call
(see :func:`interleaved`); on the CPU torch uses ``os.cpu_count()`` threads, as XLA:CPU does. The first call of
each side (eqmoe: compilation + one run) is reported apart from the medians of ``--repeats`` timed calls.
``ratio`` = eqmoe tokens/s / transformers tokens/s (> 1: eqmoe is faster). ``--breakdown`` times single
components on the row's shapes, forward and forward+backward (the gradient of ``sum(out * g)``, fixed
random ``g``, w.r.t. the inputs and parameters); there ``ratio`` = transformers ms / eqmoe ms. In a model whose
layers differ in window (gpt-oss) the attention of its first sliding and of its first full layer are timed apart,
and one more line gives eqmoe's sliding / full attention time: the blockwise kernel never visits the tiles outside
a window, while transformers' eager attention computes every score and masks the rest. In a hybrid model (Qwen3-Next)
the attention of its first linear (gated DeltaNet) and of its first full layer are timed apart, and its linear layer is
also timed alone at ``--linear-lengths`` tokens per row (forward+backward, eqmoe only): its time per token and XLA's
compiled temporary bytes should stay flat as the length grows (the chunked delta rule is linear in it).

Against the limit: each row's model FLOPs (:mod:`eqmoe.flops`: a forward pass, or three for a train step;
top-k experts, causal attention at ``(T + 1) / 2`` keys, no recomputation) over its median time, in GFLOP/s and as
the fraction of this machine's matmul peak in ``--dtype``, the median of 5 ``[--peak-size]^2`` ``jnp.dot`` products
timed in the same process (both frameworks' rows are divided by the same peak). The last table gives each row's
fraction of the peak and speed against transformers, forward and train.
"""

import copy
import dataclasses
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import tyro

from eqmoe import autotune, flops
from eqmoe.nn import dispatch
from experiments._bench_device import finish, matmul_peak_gflops, torch_device
from experiments._bench_rows import DEFAULT_ROWS, PASSES, SHAPES, Shape, build_models
from experiments._cli import UsageError, guarded
from experiments.options import DispatchOption, DtypeOption, JsonFileOptions

LINEAR = "gated_deltanet"  # the linear-attention kind: Qwen3-Next's gated DeltaNet layers


@dataclass(frozen=True)
class Args(DispatchOption, DtypeOption, JsonFileOptions):
    shape: tuple[str, ...] = ()
    """Rows to run: small, wide, long, fine, deepseek, gpt-oss, qwen3-next, or NAME-PASS for one pass (e.g.
    small-train); default small, wide, long, fine and deepseek."""
    layers: int | None = None
    """Override the decoder layers of every selected row."""
    embed: int | None = None
    """Override the model width."""
    heads: int | None = None
    """Override the query heads."""
    kv_heads: int | None = None
    """Override the key/value heads."""
    head_dim: int | None = None
    """Override the head dimension."""
    experts: int | None = None
    """Override the number of experts."""
    top_k: int | None = None
    """Override the experts per token."""
    expert_dim: int | None = None
    """Override each expert's SwiGLU width."""
    vocab: int | None = None
    """Override the vocabulary size."""
    window: int | None = None
    """Override the sliding layers' window (rows that have them: gpt-oss)."""
    batch_size: int | None = None
    """Rows per batch (default: each benchmark row's own)."""
    seq_len: int | None = None
    """Tokens per row (default: each benchmark row's own)."""
    repeats: int = 5
    """Timed calls per side and measurement (the median is reported), in two blocks alternating with the other side."""
    breakdown: bool = False
    """Also time the components (attention, sliding or linear and full apart where layers differ, MoE, equal-FLOP
    dense SwiGLU, RMSNorm, embed+head+loss); with linear layers also one of them alone at --linear-lengths."""
    linear_lengths: tuple[int, ...] = (2048, 8192, 32768)
    """Tokens per row at which --breakdown times one linear (gated DeltaNet) layer alone, forward+backward."""
    peak_size: int = 4096
    """The square matmul in --dtype (median of 5) whose rate is this machine's peak in the table."""
    hf_adamw: Literal["default", "foreach", "fused"] = "default"
    """torch.optim.AdamW implementation (default: torch's own choice, the per-tensor loop on CPU)."""
    logit_tolerance: float = 1e-3
    """Stop before timing when max |logit diff| between the two models in float32 exceeds this (in another --dtype
    its difference there is printed too)."""
    seed: int = 0
    """Seed of the weights, the token ids and the cotangents."""


def selected_rows(args: Args) -> list[tuple[str, Shape, tuple[str, ...]]]:
    """``(name, shape with the overrides applied, passes)`` for every row ``args`` asks for."""
    given = {**{f.name: getattr(args, f.name, None) for f in dataclasses.fields(Shape)}, "batch": args.batch_size}
    given["seq"] = args.seq_len
    overrides = {name: value for name, value in given.items() if value is not None}
    rows: dict[str, list[str]] = {}
    for entry in args.shape or DEFAULT_ROWS:
        name, pass_name = _row_and_pass(entry)
        if name not in SHAPES:
            allowed = ", ".join([*SHAPES, *(f"{s}-{p}" for s in SHAPES for p in PASSES)])
            raise UsageError(f"--shape {entry} is unknown; allowed: {allowed}")
        if args.window is not None and SHAPES[name].window is None:
            raise UsageError(f"--window={args.window} is invalid for --shape {entry}: its layers have no window")
        passes = rows.setdefault(name, [])
        passes.extend(p for p in ((pass_name,) if pass_name else PASSES) if p not in passes)
    selected = [
        (name, dataclasses.replace(SHAPES[name], **overrides), tuple(p for p in PASSES if p in passes))
        for name, passes in rows.items()
    ]
    for name, shape, _ in selected:
        _check_latent_and_groups(name, shape)
    return selected


def _check_latent_and_groups(name: str, shape: Shape) -> None:
    """What a DeepSeek-V3 row's overrides must keep: a key/value head per query head (its attention expands the
    latent per head) and experts that split into the row's groups, enough of them kept to choose ``top_k``."""
    if shape.latent is not None and shape.kv_heads != shape.heads:
        raise UsageError(
            f"--kv-heads={shape.kv_heads} is invalid for --shape {name}: its latent attention has one key/value head "
            f"per query head; allowed: {shape.heads} (--heads)"
        )
    if shape.groups is not None:
        groups, kept = shape.groups
        if shape.experts % groups or shape.top_k > kept * (shape.experts // groups):
            raise UsageError(
                f"--experts={shape.experts} --top-k={shape.top_k} is invalid for --shape {name}: its experts split "
                f"into {groups} equal groups and a token chooses among {kept} of them; allowed: a multiple of {groups} "
                f"experts, top-k at most {kept} groups' experts"
            )


def _row_and_pass(entry: str) -> tuple[str, str]:
    """``NAME`` -> ``(NAME, "")``, ``NAME-PASS`` -> ``(NAME, PASS)``; a row's name may hold a dash (gpt-oss)."""
    name, _, pass_name = entry.rpartition("-")
    if entry in SHAPES or pass_name not in PASSES:
        return entry, ""
    return name, pass_name


def machine() -> dict:
    import torch
    import transformers

    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "jax_backend": jax.default_backend(),
        "jax_devices": [str(d) for d in jax.devices()],
        "jax": jax.__version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_device": torch_device(),
        "transformers": transformers.__version__,
        "load_average_at_start": os.getloadavg(),
    }


# --- timing ------------------------------------------------------------------------------------------


SETTLE_S = 0.25
"""Idle seconds after every timed call while torch runs on the CPU: its OpenMP workers keep spinning on the
cores for a while after a call returns, and the call timed next would share the machine with them."""


def interleaved(
    ours: Callable[[], Any], theirs: Callable[[], Any], repeats: int, settle_s: float = SETTLE_S
) -> dict[str, float]:
    """First-call seconds and median seconds of ``ours`` and ``theirs`` over ``repeats`` timed calls each, each
    call timed to its end (:func:`experiments._bench_device.finish`) and followed by ``settle_s`` idle seconds.

    The sides alternate in two blocks each (ours, theirs, ours, theirs), and every block opens with an
    untimed call. Alternating call by call measures each framework in the other's wake: on this machine
    eqmoe's wide train step took 3.2 s alone and 10.6 s straight after torch's, the kernel zeroing the
    pages torch had just released (``clear_page`` 87% of the samples); the call after that is back to
    3.2 s. A user runs one framework per process, so each side is timed once it has the machine."""

    def seconds(fn: Callable[[], Any]) -> float:
        start = time.perf_counter()
        finish(fn())
        elapsed = time.perf_counter() - start
        time.sleep(settle_s)
        return elapsed

    first_ours, first_theirs = seconds(ours), seconds(theirs)
    times: dict[str, list[float]] = {"ours": [], "theirs": []}
    per_block = [repeats - repeats // 2, repeats // 2]
    for count in per_block:
        for side, fn in (("ours", ours), ("theirs", theirs)):
            if count:
                seconds(fn)  # the block's untimed opening call
            times[side].extend(seconds(fn) for _ in range(count))
    return {
        "eqmoe_first_s": first_ours,
        "hf_first_s": first_theirs,
        "eqmoe_s": statistics.median(times["ours"]),
        "hf_s": statistics.median(times["theirs"]),
    }


# --- the two models' passes ----------------------------------------------------------------------------


def _copy_arrays(tree):
    """``tree`` with fresh buffers (the train step donates its state; the forward pass keeps the original)."""
    return jax.tree.map(lambda leaf: jnp.asarray(np.array(leaf)) if eqx.is_array(leaf) else leaf, tree)


def _eqmoe_batch(ids: np.ndarray):
    """The train step's ``Batch``: one segment per row (id 1; 0 is padding), positions 0.., every target."""
    from eqmoe.train.step import Batch

    return Batch(
        tokens=jnp.asarray(ids.astype(np.int32)),
        segment_ids=jnp.asarray(np.ones(ids.shape, np.int32)),
        positions=jnp.asarray(_positions(*ids.shape)),
        target_mask=jnp.asarray(np.ones(ids.shape, bool)),
    )


def _positions(batch: int, seq: int) -> np.ndarray:
    return np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq)).copy()


@eqx.filter_jit
def _eqmoe_logits(model, batch):
    """The logits as ``eqmoe.train.step.batch_loss`` computes them."""
    mask = batch.segment_ids != 0
    return model(batch.tokens, segment_ids=batch.segment_ids, positions=batch.positions, token_mask=mask).logits


def _eqmoe_train(model, batch, seed: int) -> Callable[[], Any]:
    """One call of the project's jitted train step per call; the donated state is carried between calls."""
    from eqmoe.train.optimizer import OptimizerConfig, make_optimizer
    from eqmoe.train.state import init_state
    from eqmoe.train.step import make_train_step

    model = _copy_arrays(model)
    optimizer, schedule = make_optimizer(
        OptimizerConfig(warmup_steps=0), eqx.filter(model, eqx.is_array), embed_dim=model.config.embed_dim
    )
    holder = [init_state(model, optimizer, key=jax.random.key(seed + 1))]
    step = make_train_step(optimizer, schedule)

    def call():
        holder[0], metrics = step(batch, holder[0])
        return holder[0], metrics

    return call


def _hf_train(reference, ids, adamw: str, dtype: str) -> Callable[[], Any]:
    """transformers' own loss, backward, clipping and AdamW with eqmoe's OptimizerConfig defaults, on the device of
    ``ids``: float32 weights, the forward pass under ``autocast`` to ``dtype`` unless that is float32."""
    import torch

    from eqmoe.train.optimizer import OptimizerConfig

    config = OptimizerConfig(warmup_steps=0)
    model = copy.deepcopy(reference).to(ids.device).train()
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if _decays(n)], "weight_decay": config.weight_decay},
        {"params": [p for n, p in named if not _decays(n)], "weight_decay": 0.0},
    ]
    flags = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}[adamw]
    optimizer = torch.optim.AdamW(
        groups, lr=config.learning_rate, betas=(config.b1, config.b2), eps=config.eps, **flags
    )
    params = [p for _, p in named]

    autocast = dict(device_type=ids.device.type, dtype=getattr(torch, dtype), enabled=dtype != "float32")

    def call():
        with torch.autocast(**autocast):
            loss = model(ids, labels=ids, output_router_logits=True, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, config.clip_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return None

    return call


def _decays(name: str) -> bool:
    """eqmoe's decay rule (``eqmoe.train.optimizer.decays``) on a transformers parameter name: no decay on norm
    scales and biases (Qwen3-Next's ``dt_bias`` and ``A_log`` are biases there); gpt-oss's sinks decay as eqmoe's
    do."""
    return not name.endswith(("norm.weight", "bias", "A_log"))


# --- components (--breakdown) ------------------------------------------------------------------------


@dataclass
class Component:
    """One sub-computation on both sides: ``ours(diff, const)`` in JAX and ``theirs(*diff, *const)`` in
    torch; gradients are taken w.r.t. ``diff`` (modules and floating inputs), never ``const``."""

    name: str
    ours: Callable
    our_diff: tuple
    our_const: tuple
    theirs: Callable
    their_diff: tuple
    their_const: tuple


def eqmoe_block(model, layer: int):
    """The block of decoder layer ``layer``: its segment's leaves carry a leading ``repeats`` axis; take the layer's
    repeat."""
    from eqmoe.models.family import layer_slots

    _, segment, repeat, position, _ = next(slot for slot in layer_slots(model.config) if slot[0] == layer)
    take = lambda leaf: jnp.asarray(np.asarray(leaf)[repeat]) if eqx.is_array(leaf) else leaf  # noqa: E731
    return jax.tree.map(take, model.segments[segment].blocks[position])


def attention_layers(config) -> dict[str, int]:
    """The layers whose attention the breakdown times, by component name: layer 0 (``attention``) or, where some
    layers slide and some attend fully, the first of each (``attention_sliding``, ``attention_full``): their costs
    differ by the window, so one layer would speak for half the model. Likewise a hybrid model's first linear layer
    (``attention_linear``) and first full one."""
    linear = [i for i, kind in enumerate(config.layers) if kind.attention == LINEAR]
    if linear:
        full = [i for i, kind in enumerate(config.layers) if kind.attention != LINEAR]
        return {"attention_linear": linear[0], **({"attention_full": full[0]} if full else {})}
    windows = [kind.window for kind in config.layers]
    sliding = [i for i, window in enumerate(windows) if window is not None]
    full = [i for i, window in enumerate(windows) if window is None]
    if not (sliding and full):
        return {"attention": 0}
    return {"attention_sliding": sliding[0], "attention_full": full[0]}


def eqmoe_attention_sublayer(block, shape: Shape) -> tuple[Callable, tuple]:
    """``(fn, const)``: ``fn((attn_norm, attention, x), const)`` is the block's attention sub-layer, called with
    the context the model builds for a train batch (one packed segment per row, every token real)."""
    from eqmoe.nn.context import Context, attention_mask

    batch, seq = shape.batch, shape.seq

    @jax.jit
    def context(segment_ids, positions, token_mask):  # one compilation, not one per eager op
        return Context(positions, token_mask, segment_ids, attention_mask(segment_ids, token_mask))

    const = context(np.ones((batch, seq), np.int32), _positions(batch, seq), np.ones((batch, seq), bool))

    def fn(diff, const):
        norm, attention, x = diff
        return attention(norm(x), const[0])[0]

    return fn, (const,)


def eqmoe_backends(model, shape: Shape) -> str:
    """The MoE dispatch and attention backends the model resolves to on this platform (for the printout)."""
    from eqmoe.nn.attention_backends import backend_name
    from eqmoe.nn.context import attention_mask

    moe = dispatch.resolve(model.config.moe).__name__
    ones = jax.ShapeDtypeStruct((shape.batch, shape.seq), jnp.int32)
    mask = jax.eval_shape(attention_mask, ones, ones.update(dtype=jnp.bool_))
    attention = backend_name(model.config.attention, mask, model.config.dtype, sinks=model.config.attention.sinks)
    return f"moe {moe}, attention {attention}"


def attention_component(name: str, index: int, shape: Shape, model, reference, x, x_t) -> Component:
    """The attention sub-layer (norm, then attention) of decoder layer ``index``; transformers' gets the RoPE and
    the additive mask its model builds for that layer (a sliding one: query q sees keys q - W < k <= q)."""
    import torch
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    block, layer = eqmoe_block(model, index), reference.model.layers[index]
    ours, const = eqmoe_attention_sublayer(block, shape)
    if model.config.layers[index].attention == LINEAR:  # no positions, no mask: every token real, one document
        return Component(
            name, ours, (block.attn_norm, block.attention, x), const,
            lambda norm, attn, x: attn(norm(x)), (layer.input_layernorm, layer.linear_attn, x_t), (),
        )  # fmt: skip
    position_ids = torch.arange(shape.seq)[None].expand(shape.batch, -1)
    with torch.no_grad():
        rope = reference.model.rotary_emb(x_t, position_ids=position_ids)
    sliding = getattr(layer.self_attn, "sliding_window", None) is not None
    make_mask = create_sliding_window_causal_mask if sliding else create_causal_mask
    mask = make_mask(
        config=reference.config, inputs_embeds=x_t, attention_mask=None, cache=None, position_ids=position_ids
    )
    return Component(
        name, ours, (block.attn_norm, block.attention, x), const,
        lambda norm, attn, x, rope, mask: attn(norm(x), position_embeddings=rope, attention_mask=mask)[0],
        (layer.input_layernorm, layer.self_attn, x_t), (rope, mask),
    )  # fmt: skip


def _hidden(output):
    """A transformers MoE block's hidden states: gpt-oss's returns ``(hidden, router_scores)``."""
    return output[0] if isinstance(output, tuple) else output


def components(shape: Shape, model, reference, rng: np.random.Generator) -> list[Component]:
    """Attention (:func:`attention_layers`), MoE, equal-FLOP dense SwiGLU, RMSNorm and embed+final
    norm+lm_head+CE, same weights."""
    import torch

    from eqmoe.losses import next_token_cross_entropy
    from eqmoe.nn._init import Init
    from eqmoe.nn.mlp import SwiGLU

    def to_torch(x, grad: bool = False):
        return torch.from_numpy(np.array(x)).requires_grad_(grad)

    x = jnp.asarray(rng.standard_normal((shape.batch, shape.seq, shape.embed), np.float32))
    block, layer = eqmoe_block(model, 0), reference.model.layers[0]
    h = eqx.filter_jit(lambda norm, x: norm(x))(block.pre_norm, x)  # the MoE's input: normed activations
    token_mask = jnp.asarray(np.ones((shape.batch, shape.seq), bool))
    ids = jnp.asarray(rng.integers(0, shape.vocab, (shape.batch, shape.seq), dtype=np.int32))

    x_t, h_t, ids_t = to_torch(x, True), to_torch(h, True), torch.from_numpy(np.array(ids)).long()
    attentions = [
        attention_component(name, index, shape, model, reference, x, x_t)
        for name, index in attention_layers(model.config).items()
    ]

    width = shape.top_k * shape.expert_dim
    init = Init("normal", 0.02, jnp.dtype("float32"))
    abstract = eqx.filter_eval_shape(SwiGLU, shape.embed, width, init=init, key=jax.random.key(0))
    dense = jax.tree.map(lambda leaf: jnp.asarray(0.02 * rng.standard_normal(leaf.shape, np.float32)), abstract)
    linears = [torch.nn.Linear(*w.shape, bias=False) for w in (dense.gate.weight, dense.up.weight, dense.down.weight)]
    with torch.no_grad():
        for linear, w in zip(linears, (dense.gate.weight, dense.up.weight, dense.down.weight), strict=True):
            linear.weight.copy_(to_torch(w).T)

    def head(diff, const):  # the model's own output path on the embedded tokens
        embed, final_norm, lm_head = diff
        tokens, target_mask = const
        model_head = eqx.tree_at(lambda m: (m.embed, m.final_norm, m.lm_head), model, (embed, final_norm, lm_head))
        return next_token_cross_entropy(model_head.output_logits(embed[tokens]), tokens, target_mask)

    def hf_head(embed, norm, lm_head, tokens):
        return reference.loss_function(lm_head(norm(embed(tokens))), tokens, shape.vocab)

    return [
        *attentions,
        Component(
            "moe", lambda diff, const: diff[0](diff[1])[0], (block.ffn, h), (),
            lambda mlp, h: _hidden(mlp(h)), (layer.mlp, h_t), (),
        ),
        Component(
            f"dense_swiglu_{width}", lambda diff, const: diff[0](diff[1])[0], (dense, h), (),
            lambda gate, up, down, h: down(torch.nn.functional.silu(gate(h)) * up(h)), (*linears, h_t), (),
        ),
        Component(
            "rmsnorm", lambda diff, const: diff[0](diff[1]), (block.attn_norm, x), (),
            lambda norm, x: norm(x), (layer.input_layernorm, x_t), (),
        ),
        Component(
            "embed_head_loss", head, (model.embed, model.final_norm, model.lm_head), (ids, token_mask),
            hf_head, (reference.model.embed_tokens, reference.model.norm, reference.lm_head), (ids_t,),
        ),
    ]  # fmt: skip


def time_component(component: Component, repeats: int, rng: np.random.Generator) -> list[dict]:
    """Forward and forward+backward of one component on both sides: timings and max |forward diff|."""
    import torch

    c = component
    forward = eqx.filter_jit(c.ours)
    started = time.perf_counter()
    ours_out = jax.block_until_ready(forward(c.our_diff, c.our_const))
    first = {"eqmoe_first_s": time.perf_counter() - started}
    started = time.perf_counter()
    with torch.inference_mode():
        theirs_out = c.theirs(*c.their_diff, *c.their_const)
    first["hf_first_s"] = time.perf_counter() - started
    diff = float(np.abs(np.asarray(ours_out) - theirs_out.numpy()).max())
    cotangent_t = torch.from_numpy(rng.standard_normal(ours_out.shape, np.float32))
    cotangent = jnp.asarray(cotangent_t.numpy())
    backward = eqx.filter_jit(eqx.filter_grad(lambda d, const, g: jnp.sum(c.ours(d, const) * g)))

    def hf_forward():
        with torch.inference_mode():
            return c.theirs(*c.their_diff, *c.their_const)

    def hf_backward():
        for item in c.their_diff:
            if isinstance(item, torch.nn.Module):
                item.zero_grad(set_to_none=True)
            else:
                item.grad = None
        c.theirs(*c.their_diff, *c.their_const).backward(cotangent_t)

    results = []
    for pass_name, ours, theirs in (
        ("forward", lambda: forward(c.our_diff, c.our_const), hf_forward),
        ("fwd+bwd", lambda: backward(c.our_diff, c.our_const, cotangent), hf_backward),
    ):
        timing = interleaved(ours, theirs, repeats)
        if pass_name == "forward":
            timing.update(first)  # the check's calls were the first
        entry = {"component": c.name, "pass": pass_name, "eqmoe_ms": timing["eqmoe_s"] * 1e3}
        entry.update(hf_ms=timing["hf_s"] * 1e3, ratio=timing["hf_s"] / timing["eqmoe_s"], max_abs_diff=diff)
        entry.update(eqmoe_compile_s=timing["eqmoe_first_s"], hf_first_call_s=timing["hf_first_s"])
        results.append(entry)
    return results


def linear_scaling(name: str, shape: Shape, model, lengths: tuple[int, ...], repeats: int, seed: int) -> list[dict]:
    """The first linear layer's attention sub-layer (norm, then gated DeltaNet) alone at each of ``lengths`` tokens
    per row (``shape.batch`` rows): forward+backward, the gradient of ``sum(out * g)`` w.r.t. the input and the
    parameters, jitted; the median of ``repeats`` calls after an untimed one, per token, and XLA's compiled
    temporary bytes. ``[]`` for a model without linear layers."""
    layer = attention_layers(model.config).get("attention_linear")
    if layer is None:
        return []
    block, rng = eqmoe_block(model, layer), np.random.default_rng(seed)
    entries = []
    for seq in lengths:
        ours, const = eqmoe_attention_sublayer(block, dataclasses.replace(shape, seq=seq))
        x, g = (jnp.asarray(rng.standard_normal((shape.batch, seq, shape.embed), np.float32)) for _ in range(2))
        backward = eqx.filter_jit(eqx.filter_grad(lambda diff, const, g, ours=ours: jnp.sum(ours(diff, const) * g)))
        started = time.perf_counter()
        compiled = backward.lower((block.attn_norm, block.attention, x), const, g).compile()  # once, also timed
        compile_s = time.perf_counter() - started
        diff = (block.attn_norm, block.attention, x)
        jax.block_until_ready(compiled(diff, const, g))  # the untimed call
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            jax.block_until_ready(compiled(diff, const, g))
            times.append(time.perf_counter() - started)
        seconds, tokens = statistics.median(times), shape.batch * seq
        temp = compiled.compiled.memory_analysis().temp_size_in_bytes
        entries.append(
            {"shape": name, "layer": layer, "tokens": tokens, "batch": shape.batch, "seq": seq}
            | {"eqmoe_ms": seconds * 1e3, "us_per_token": seconds / tokens * 1e6, "compile_s": compile_s}
            | {"temp_bytes": temp, "temp_bytes_per_token": temp / tokens}
        )
        del compiled, diff, x, g
    for entry in entries:
        entry["per_token_over_first"] = entry["us_per_token"] / entries[0]["us_per_token"]
        entry["temp_per_token_over_first"] = entry["temp_bytes_per_token"] / entries[0]["temp_bytes_per_token"]
    return entries


def _linear_scaling_table(entries: list[dict]) -> str:
    cells = [
        [e["shape"], str(e["layer"]), f"{e['batch']}x{e['seq']}", f"{e['eqmoe_ms']:.1f}", f"{e['us_per_token']:.2f}"]
        + [f"{e['per_token_over_first']:.2f}", f"{e['temp_bytes'] / 2**20:,.1f}", f"{e['temp_bytes_per_token']:,.0f}"]
        + [f"{e['temp_per_token_over_first']:.2f}"]
        for e in entries
    ]
    header = ["shape", "layer", "tokens", "fwd+bwd ms", "us/token", "vs first", "temp MiB", "temp B/token", "vs first"]
    return _table(header, cells)


# --- the benchmark -----------------------------------------------------------------------------------


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda cells: "| " + " | ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def run(args: Args) -> dict:
    """Every selected row (and its breakdown): the results that ``--json-out`` writes."""
    if args.repeats < 1:
        raise UsageError(f"--repeats={args.repeats} is invalid; allowed: a positive number")
    if args.breakdown and args.dtype != "float32":
        raise UsageError(f"--breakdown is invalid with --dtype {args.dtype}: its components are timed in float32")
    rows = selected_rows(args)
    try:
        import torch
    except ImportError as error:
        raise UsageError("needs torch and transformers (pip install -e '.[test]')") from error
    torch.set_num_threads(os.cpu_count() or 1)
    info = machine()
    device = info["torch_device"]
    if args.breakdown and device != "cpu":
        raise UsageError(f"--breakdown is invalid on {device}: its components are timed with torch on the CPU")
    print(
        f"machine: {info['cpu_count']} CPUs, jax {info['jax']} ({info['jax_backend']}), torch {info['torch']} "
        f"({device}, {info['torch_threads']} threads), transformers {info['transformers']}; load average "
        + " ".join(f"{x:.2f}" for x in info["load_average_at_start"])
    )
    info["matmul_peak_gflops"] = matmul_peak_gflops(args.peak_size, args.dtype)
    print(
        f"matmul peak: {info['matmul_peak_gflops']:.1f} GFLOP/s ({args.dtype} {args.peak_size}^2 jnp.dot, median of 5)"
    )
    settle_s = SETTLE_S if device == "cpu" else 0.0
    results: dict[str, Any] = {"machine": info, "args": dataclasses.asdict(args), "rows": [], "breakdown": []}
    results["sliding_over_full"], results["linear_scaling"] = [], []
    built: tuple = (None, None, None)
    for name, shape, passes in rows:
        if built[0] != shape.model_key():
            built = (None, None, None)  # free the previous pair first
            built = (shape.model_key(), *build_models(shape, args.seed))
        _, reference, model = built
        if args.dispatch not in (None, "auto"):
            moe = dataclasses.replace(model.config.moe, dispatch=args.dispatch)
            model = model.with_config(model.config.replace(moe=moe))
        else:  # what a training run on these shapes would choose, by the same measurement
            resolved = autotune.resolve(model.config.replace(dtype=args.dtype), shape.batch, shape.seq)
            model = model.with_config(resolved.config.replace(dtype=model.config.dtype))
            results.setdefault("auto", {})[name] = [dataclasses.asdict(m) for m in resolved.measurements]
        ids = np.random.default_rng(args.seed).integers(0, shape.vocab, (shape.batch, shape.seq))
        ids_t, batch = torch.from_numpy(ids).long().to(device), _eqmoe_batch(ids)
        tokens = shape.batch * shape.seq
        on_device = copy.deepcopy(reference).to(device) if device != "cpu" else reference

        def hf_logits(reference, ids_t=ids_t):
            with torch.inference_mode():
                return reference(ids_t, use_cache=False).logits

        # the weights are checked in float32, where the two sides agree to rounding: in bfloat16 a token whose
        # experts nearly tie can be routed apart by it. Inference holds its weights in --dtype, training in float32.
        first: dict[str, float] = {}
        diffs = {}
        for dtype in dict.fromkeys(("float32", args.dtype)):
            inference_model = model.cast(dtype).with_config(
                model.config.replace(dtype=dtype, param_dtype=dtype), allow=("param_dtype",)
            )
            inference_reference = (
                copy.deepcopy(on_device).to(getattr(torch, dtype)) if dtype != "float32" else on_device
            )
            started = time.perf_counter()
            ours_logits = np.asarray(jax.block_until_ready(_eqmoe_logits(inference_model, batch)), np.float32)
            first["eqmoe_first_s"] = time.perf_counter() - started
            started = time.perf_counter()
            theirs_logits = hf_logits(inference_reference).float().cpu().numpy()
            first["hf_first_s"] = time.perf_counter() - started
            diffs[dtype] = float(np.abs(ours_logits - theirs_logits).max())
            del ours_logits, theirs_logits
        logit_diff = diffs["float32"]
        train_model = model.with_config(model.config.replace(dtype=args.dtype))
        backends = eqmoe_backends(inference_model, shape)
        in_dtype = f", {diffs[args.dtype]:.2e} in {args.dtype}" if args.dtype != "float32" else ""
        print(f"{name}: {shape}: max |logit diff| eqmoe ({backends}) vs transformers {logit_diff:.2e}{in_dtype}")
        if not logit_diff < args.logit_tolerance:
            raise RuntimeError(f"{name}: logits differ by {logit_diff:.2e} >= {args.logit_tolerance}; not timing")

        for pass_name in passes:
            if pass_name == "forward":
                ours = lambda m=inference_model, b=batch: _eqmoe_logits(m, b)  # noqa: E731
                theirs = lambda r=inference_reference: hf_logits(r)  # noqa: E731
                timing = interleaved(ours, theirs, args.repeats, settle_s)
                timing.update(first)  # the check's calls were the first
            else:
                ours = _eqmoe_train(train_model, batch, args.seed)
                theirs = _hf_train(reference, ids_t, args.hf_adamw, args.dtype)
                timing = interleaved(ours, theirs, args.repeats, settle_s)
                del ours, theirs
            per_token = flops.forward_flops_per_token(model.config, shape.seq)
            model_gflop = tokens * per_token * (1 if pass_name == "forward" else 3) / 1e9
            results["rows"].append(
                {
                    "model_gflop": model_gflop,
                    "eqmoe_gflops": model_gflop / timing["eqmoe_s"],
                    "hf_gflops": model_gflop / timing["hf_s"],
                    "eqmoe_of_peak": model_gflop / timing["eqmoe_s"] / info["matmul_peak_gflops"],
                    "hf_of_peak": model_gflop / timing["hf_s"] / info["matmul_peak_gflops"],
                    "shape": name,
                    "config": dataclasses.asdict(shape),
                    "pass": pass_name,
                    "eqmoe_ms": timing["eqmoe_s"] * 1e3,
                    "hf_ms": timing["hf_s"] * 1e3,
                    "eqmoe_tokens_per_s": tokens / timing["eqmoe_s"],
                    "hf_tokens_per_s": tokens / timing["hf_s"],
                    "ratio": timing["hf_s"] / timing["eqmoe_s"],
                    "eqmoe_compile_s": timing["eqmoe_first_s"],
                    "hf_first_call_s": timing["hf_first_s"],
                    "logit_max_abs_diff": logit_diff,
                    f"logit_max_abs_diff_{args.dtype}": diffs[args.dtype],
                    "eqmoe_backends": backends,
                }
            )
        if args.breakdown:
            rng = np.random.default_rng(args.seed + 2)
            entries = [
                {"shape": name, **entry}
                for component in components(shape, model, reference, rng)
                for entry in time_component(component, args.repeats, rng)
            ]
            results["breakdown"] += entries
            results["sliding_over_full"] += sliding_over_full(name, shape, entries)
            lengths, seed = args.linear_lengths, args.seed + 3
            results["linear_scaling"] += linear_scaling(name, shape, model, lengths, args.repeats, seed)

    info["load_average_at_end"] = os.getloadavg()  # other work on the machine slows torch's threads most
    header = ["shape", "pass", "tokens", "eqmoe ms", "HF ms", "eqmoe tok/s", "HF tok/s", "ratio", "eqmoe compile s"]
    header += ["HF first s", "eqmoe GFLOP/s", "of peak", "HF of peak"]
    print("\n" + _table(header, [_row_cells(r) for r in results["rows"]]))
    print("ratio = eqmoe tokens/s / transformers tokens/s (> 1: eqmoe faster); medians of", args.repeats, "calls")
    print(f"of peak = model FLOPs per second / the {info['matmul_peak_gflops']:.1f} GFLOP/s matmul peak measured above")
    print(f"\neqmoe against the limit and against transformers ({args.dtype}, torch on {device}):")
    print(summary_table(results["rows"]))
    if results["breakdown"]:
        cells = [
            [b["shape"], b["component"], b["pass"], f"{b['eqmoe_ms']:.2f}", f"{b['hf_ms']:.2f}", f"{b['ratio']:.2f}"]
            + [f"{b['max_abs_diff']:.1e}"]
            for b in results["breakdown"]
        ]
        header = ["shape", "component", "pass", "eqmoe ms", "HF ms", "ratio", "max |diff|"]
        print("\n" + _table(header, cells))
        print("ratio = transformers ms / eqmoe ms (> 1: eqmoe faster); max |diff| of the forward outputs")
    for ratio in results["sliding_over_full"]:
        print(_sliding_over_full_line(ratio))
    if results["linear_scaling"]:
        print("\n" + _linear_scaling_table(results["linear_scaling"]))
        print(
            "one linear (gated DeltaNet) layer alone, norm included, forward+backward; vs first = per token over the "
            "row's shortest length (flat: linear in the length); temp = XLA's compiled temporary bytes"
        )
    print("load average at the end:", " ".join(f"{x:.2f}" for x in info["load_average_at_end"]))
    if args.json_out is not None:
        from eqmoe.train.logging import write_json_atomic

        write_json_atomic(args.json_out, results)
    return results


def sliding_over_full(name: str, shape: Shape, entries: list[dict]) -> list[dict]:
    """A sliding layer's attention time over a full layer's, each side and pass, where the breakdown timed both."""
    timed = {(entry["component"], entry["pass"]): entry for entry in entries}
    if ("attention_sliding", "forward") not in timed:
        return []
    ratio = {"shape": name, "window": shape.window, "batch": shape.batch, "seq": shape.seq}
    for side in ("eqmoe", "hf"):
        for pass_name in ("forward", "fwd+bwd"):
            sliding, full = timed["attention_sliding", pass_name], timed["attention_full", pass_name]
            ratio[f"{side}_{pass_name}"] = sliding[f"{side}_ms"] / full[f"{side}_ms"]
    return [ratio]


def _sliding_over_full_line(ratio: dict) -> str:
    return (
        f"{ratio['shape']}: sliding (window {ratio['window']}) / full attention layer time at "
        f"{ratio['batch']}x{ratio['seq']}: eqmoe forward {ratio['eqmoe_forward']:.3f}, fwd+bwd "
        f"{ratio['eqmoe_fwd+bwd']:.3f}; transformers forward {ratio['hf_forward']:.3f}, "
        f"fwd+bwd {ratio['hf_fwd+bwd']:.3f}"
    )


def summary_table(rows: list[dict]) -> str:
    """One line per row: eqmoe's fraction of the matmul peak and its speed over transformers', forward and train
    (``-`` for a pass not run)."""
    by_row: dict[str, dict[str, dict]] = {}
    for row in rows:
        by_row.setdefault(row["shape"], {})[row["pass"]] = row
    cells = [
        [name]
        + [
            cell
            for pass_name in PASSES
            for cell in (
                (f"{100 * passes[pass_name]['eqmoe_of_peak']:.1f}%", f"{passes[pass_name]['ratio']:.2f}x")
                if pass_name in passes
                else ("-", "-")
            )
        ]
        for name, passes in by_row.items()
    ]
    header = ["row", "forward of peak", "forward vs HF", "train of peak", "train vs HF"]
    return _table(header, cells)


def _row_cells(row: dict) -> list[str]:
    config = row["config"]
    return [
        row["shape"],
        row["pass"],
        f"{config['batch']}x{config['seq']}",
        f"{row['eqmoe_ms']:.1f}",
        f"{row['hf_ms']:.1f}",
        f"{row['eqmoe_tokens_per_s']:,.0f}",
        f"{row['hf_tokens_per_s']:,.0f}",
        f"{row['ratio']:.2f}",
        f"{row['eqmoe_compile_s']:.2f}",
        f"{row['hf_first_call_s']:.2f}",
        f"{row['eqmoe_gflops']:.1f}",
        f"{100 * row['eqmoe_of_peak']:.1f}%",
        f"{100 * row['hf_of_peak']:.1f}%",
    ]


def main(args: Args) -> int:
    return 0 if guarded("bench_model", run, args) is not None else 2


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Args)))
