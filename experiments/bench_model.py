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
(:func:`experiments._bench_device.interleaved`); on the CPU torch uses ``os.cpu_count()`` threads, as XLA:CPU
does. The first call of each side (eqmoe: compilation + one run) is reported apart from the medians of
``--repeats`` timed calls. ``ratio`` = eqmoe tokens/s / transformers tokens/s (> 1: eqmoe is faster).
``--breakdown`` times single
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
from experiments._bench_components import (
    components,
    eqmoe_backends,
    linear_scaling,
    linear_scaling_table,
    markdown_table,
    time_component,
)
from experiments._bench_device import SETTLE_S, interleaved, matmul_peak_gflops, matmul_rates_gflops, torch_device
from experiments._bench_rows import DEFAULT_ROWS, PASSES, SHAPES, Shape, build_models, positions
from experiments._cli import UsageError, guarded
from experiments.options import DispatchOption, DtypeOption, JsonFileOptions


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
        positions=jnp.asarray(positions(*ids.shape)),
        target_mask=jnp.asarray(np.ones(ids.shape, bool)),
    )


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


# --- the benchmark -----------------------------------------------------------------------------------


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
    square = (args.peak_size,) * 3
    info["square_matmul"] = matmul_rates_gflops(*square, args.dtype, device, settle_s=settle_s)
    print(f"the same square by each framework's kernel: {_kernel_rates(info['square_matmul'])}")
    expert_rates = {}  # timed before any model is built, as the peak is: the same state of the machine
    for name, shape, _ in rows:
        expert_matmul = expert_matmul_shape(shape)
        rates = matmul_rates_gflops(*expert_matmul, args.dtype, device, settle_s=settle_s)
        expert_rates[name] = {"shape": expert_matmul, **rates}
        print(
            f"{name}: an expert's first matmul [{expert_matmul[0]} x {expert_matmul[1]}] @ [{expert_matmul[1]} x "
            f"{expert_matmul[2]}] (its mean routed rows; gate and up together) by each framework's kernel: "
            f"{_kernel_rates(rates)}"
        )
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
                    "expert_matmul": expert_rates[name],
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
    print("\n" + markdown_table(header, [_row_cells(r) for r in results["rows"]]))
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
        print("\n" + markdown_table(header, cells))
        print("ratio = transformers ms / eqmoe ms (> 1: eqmoe faster); max |diff| of the forward outputs")
    for ratio in results["sliding_over_full"]:
        print(_sliding_over_full_line(ratio))
    if results["linear_scaling"]:
        print("\n" + linear_scaling_table(results["linear_scaling"]))
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


def expert_matmul_shape(shape: Shape) -> tuple[int, int, int]:
    """``(rows, inner, cols)`` of a routed expert's first product on the row's batch: the mean rows an expert is
    routed, the model's width, its gate and up projections together (both frameworks multiply them as one)."""
    rows = max(1, shape.batch * shape.seq * shape.top_k // shape.experts)
    return rows, shape.embed, 2 * shape.expert_dim


def _kernel_rates(rates: dict) -> str:
    ours, theirs = rates["jnp_dot_gflops"], rates["torch_mm_gflops"]
    return f"jnp.dot {ours:.1f} GFLOP/s, torch.mm {theirs:.1f} GFLOP/s ({theirs / ours:.2f}x jnp.dot's)"


def summary_table(rows: list[dict]) -> str:
    """One line per row: eqmoe's fraction of the matmul peak and its speed over transformers', forward and train
    (``-`` for a pass not run), and how much faster torch's matmul kernel multiplies the row's expert product than
    XLA's: a step that is matmuls alone on both sides can be at most its inverse as fast as transformers'."""
    by_row: dict[str, dict[str, dict]] = {}
    for row in rows:
        by_row.setdefault(row["shape"], {})[row["pass"]] = row
    cells = []
    for name, passes in by_row.items():
        cells.append([name])
        for pass_name in PASSES:
            row = passes.get(pass_name)
            cells[-1] += [f"{100 * row['eqmoe_of_peak']:.1f}%", f"{row['ratio']:.2f}x"] if row else ["-", "-"]
        rates = next(iter(passes.values()))["expert_matmul"]
        cells[-1].append(f"{rates['torch_mm_gflops'] / rates['jnp_dot_gflops']:.2f}x")
    header = ["row", "forward of peak", "forward vs HF", "train of peak", "train vs HF", "expert matmul torch/XLA"]
    return markdown_table(header, cells)


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
