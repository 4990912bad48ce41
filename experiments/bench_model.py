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
Where JAX runs on a GPU, torch runs on it too. Passes (:mod:`experiments._bench_passes`):

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
from dataclasses import dataclass
from typing import Any, Literal

import jax
import numpy as np
import tyro

from eqmoe import autotune, flops
from experiments._bench_components import components, eqmoe_backends, linear_scaling, sliding_over_full, time_component
from experiments._bench_device import SETTLE_S, interleaved, matmul_peak_gflops, matmul_rates_gflops, torch_device
from experiments._bench_passes import eqmoe_batch, eqmoe_logits, eqmoe_train, hf_train
from experiments._bench_rows import (
    DEFAULT_ROWS,
    PASSES,
    SHAPES,
    Shape,
    build_models,
    check_latent_and_groups,
    expert_matmul_shape,
    row_and_pass,
)
from experiments._bench_tables import kernel_rates, print_tables
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
        name, pass_name = row_and_pass(entry)
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
        check_latent_and_groups(name, shape)
    return selected


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
    print(f"the same square by each framework's kernel: {kernel_rates(info['square_matmul'])}")
    expert_rates = {}  # timed before any model is built, as the peak is: the same state of the machine
    for name, shape, _ in rows:
        expert_matmul = expert_matmul_shape(shape)
        rates = matmul_rates_gflops(*expert_matmul, args.dtype, device, settle_s=settle_s)
        expert_rates[name] = {"shape": expert_matmul, **rates}
        print(
            f"{name}: an expert's first matmul [{expert_matmul[0]} x {expert_matmul[1]}] @ [{expert_matmul[1]} x "
            f"{expert_matmul[2]}] (its mean routed rows; gate and up together) by each framework's kernel: "
            f"{kernel_rates(rates)}"
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
        ids_t, batch = torch.from_numpy(ids).long().to(device), eqmoe_batch(ids)
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
            ours_logits = np.asarray(jax.block_until_ready(eqmoe_logits(inference_model, batch)), np.float32)
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
                ours = lambda m=inference_model, b=batch: eqmoe_logits(m, b)  # noqa: E731
                theirs = lambda r=inference_reference: hf_logits(r)  # noqa: E731
                timing = interleaved(ours, theirs, args.repeats, settle_s)
                timing.update(first)  # the check's calls were the first
            else:
                ours = eqmoe_train(train_model, batch, args.seed)
                theirs = hf_train(reference, ids_t, args.hf_adamw, args.dtype)
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
    print_tables(results, args.repeats, args.dtype, device)
    print("load average at the end:", " ".join(f"{x:.2f}" for x in info["load_average_at_end"]))
    if args.json_out is not None:
        from eqmoe.train.logging import write_json_atomic

        write_json_atomic(args.json_out, results)
    return results


def main(args: Args) -> int:
    return 0 if guarded("bench_model", run, args) is not None else 2


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Args)))
