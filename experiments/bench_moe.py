"""MoE layer speed and memory: each dispatch backend next to a dense SwiGLU of equal active FLOPs and
Hugging Face transformers' Qwen3MoeSparseMoeBlock with the same weights.

    python -m experiments.bench_moe                                     # T=4096, d=512, f=1024, E=32, k=4
    python -m experiments.bench_moe --backends sorted ragged_dot --tokens 1024 --json-out moe.json
    python -m experiments.bench_moe --dtype bfloat16                    # weights, inputs and peak in bfloat16
    python -m experiments.bench_moe --memory-tokens 4096 16384          # compiled temp bytes vs T

Forward is ``y = moe(x)``; forward+backward is the gradient of ``sum(y * g)`` (fixed random ``g``) with
respect to the input, the router and every expert weight. The equal-FLOP dense SwiGLU has width
``top_k * expert_dim`` on the same tokens. Every layer holds its weights and takes its input in ``--dtype``. Torch
runs with as many threads as JAX has cores, on the GPU where JAX runs on one. Medians of ``--repeats`` timed calls
after one warm-up (compilation excluded). ``ratio_vs_dense`` is backend / dense (lower is better);
``speedup_vs_hf`` is transformers / backend (higher is better); ``of_peak`` is the layer's FLOPs (the router and the
top-k experts' SwiGLU, three times that for forward+backward) per second over the ``--peak-size`` matmul's rate in
``--dtype``.
"""

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import tyro

from eqmoe.config import MoEConfig, RouterConfig
from eqmoe.nn._init import Init
from eqmoe.nn.mlp import SwiGLU
from eqmoe.nn.moe import MoE
from experiments._bench_device import finish, matmul_peak_gflops, torch_device
from experiments.options import DtypeOption, JsonFileOptions


@dataclass(frozen=True)
class Args(DtypeOption, JsonFileOptions):
    tokens: int = 4096
    """Tokens in the batch (batch 1, sequence --tokens)."""
    embed: int = 512
    """Model width."""
    expert_dim: int = 1024
    """Width of each expert's SwiGLU."""
    experts: int = 32
    """Number of experts."""
    top_k: int = 4
    """Experts per token."""
    backends: tuple[str, ...] = ("auto", "sorted", "capacity", "dense")
    """Dispatch backends to time (capacity uses --capacity-factor; auto is sorted on CPU)."""
    capacity_factor: float = 1.25
    """Capacity factor of the capacity backend."""
    block_size: int = 64
    """Rows per block of the sorted backend."""
    repeats: int = 5
    """Timed calls per measurement (the median is reported)."""
    transformers: bool = True
    """Also time transformers' Qwen3MoeSparseMoeBlock (needs torch and transformers)."""
    memory_tokens: tuple[int, ...] = ()
    """Token counts at which to report XLA's compiled temp bytes of forward+backward per backend."""
    peak_size: int = 4096
    """The square matmul in --dtype (median of 5) whose rate is this machine's peak for of_peak."""


def _median_seconds(fn, repeats: int) -> float:
    finish(fn())  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        finish(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _moe(args: Args, backend: str, key) -> MoE:
    capacity = args.capacity_factor if backend == "capacity" else None
    router = RouterConfig(num_experts=args.experts, top_k=args.top_k, capacity_factor=capacity)
    config = MoEConfig(router=router, expert_dim=args.expert_dim, dispatch=backend, block_size=args.block_size)
    return MoE(args.embed, config, init=Init("normal", 0.02, jnp.dtype(args.dtype)), key=key)


def forward_gflop(args: Args) -> float:
    """The MoE layer's forward FLOPs on the batch: the router's logits and each token's ``top_k`` SwiGLU experts
    (the equal-FLOP dense SwiGLU's, plus the router)."""
    per_token = 2 * args.embed * args.experts + 3 * 2 * args.embed * args.expert_dim * args.top_k
    return args.tokens * per_token / 1e9


def _passes(layer, x, cotangent):
    """Jitted forward and forward+backward (gradients w.r.t. ``x`` and every array of ``layer``)."""

    def output(layer, x):
        y = layer(x)
        return y[0] if isinstance(y, tuple) else y

    forward = eqx.filter_jit(output)
    backward = eqx.filter_jit(eqx.filter_grad(lambda lx: jnp.sum(output(*lx) * cotangent)))
    return (lambda: forward(layer, x)), (lambda: backward((layer, x)))


def _temp_bytes(args: Args, backend: str, tokens: int) -> int:
    layer = eqx.filter_eval_shape(_moe, args, backend, jax.random.key(0))
    x = jax.ShapeDtypeStruct((1, tokens, args.embed), jnp.dtype(args.dtype))
    params, static = eqx.partition(layer, lambda leaf: isinstance(leaf, jax.ShapeDtypeStruct))
    loss = jax.grad(lambda p, x: jnp.sum(eqx.combine(p, static)(x)[0]), argnums=(0, 1))
    compiled = jax.jit(loss).lower(params, x).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def _hf_block(args: Args, moe: MoE):
    """transformers' block holding ``moe``'s weights (in ``--dtype``, on :func:`torch_device`), and torch."""
    import torch
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.set_num_threads(os.cpu_count() or 1)
    config = transformers.Qwen3MoeConfig(
        hidden_size=args.embed,
        moe_intermediate_size=args.expert_dim,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
    )
    block = Qwen3MoeSparseMoeBlock(config)
    experts = moe.experts
    as_numpy = lambda array: np.asarray(array, np.float32)  # noqa: E731  (torch reads no NumPy bfloat16)
    with torch.no_grad():
        block.gate.weight.copy_(torch.from_numpy(as_numpy(moe.router.gate.weight).T.copy()))
        gate_up = np.concatenate([as_numpy(experts.gate.weight), as_numpy(experts.up.weight)], axis=2)
        block.experts.gate_up_proj.copy_(torch.from_numpy(gate_up.transpose(0, 2, 1).copy()))
        block.experts.down_proj.copy_(torch.from_numpy(as_numpy(experts.down.weight).transpose(0, 2, 1).copy()))
    return block.to(torch_device(), getattr(torch, args.dtype)), torch


def _to_torch(torch, array, like):
    """``array`` (any float dtype) as a torch tensor of ``like``'s dtype on its device, through float32 (torch reads
    no NumPy bfloat16)."""
    return torch.from_numpy(np.array(array, np.float32)).to(like.device, like.dtype)


def main(args: Args) -> dict:
    key_x, key_g, key_layer = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(key_x, (1, args.tokens, args.embed), jnp.dtype(args.dtype))
    cotangent = jax.random.normal(key_g, x.shape, jnp.dtype(args.dtype))
    rows: dict[str, dict] = {}
    peak = matmul_peak_gflops(args.peak_size, args.dtype)
    print(f"matmul peak: {peak:.1f} GFLOP/s ({args.dtype} {args.peak_size}^2 jnp.dot, median of 5)")

    dense = SwiGLU(
        args.embed, args.top_k * args.expert_dim, init=Init("normal", 0.02, jnp.dtype(args.dtype)), key=key_layer
    )
    forward, backward = _passes(dense, x, cotangent)
    rows["dense_swiglu"] = {"forward": _median_seconds(forward, args.repeats)}
    rows["dense_swiglu"]["forward_backward"] = _median_seconds(backward, args.repeats)

    reference = None
    for backend in args.backends:
        moe = _moe(args, backend, key_layer)
        forward, backward = _passes(moe, x, cotangent)
        reference = moe if reference is None else reference
        rows[backend] = {
            "forward": _median_seconds(forward, args.repeats),
            "forward_backward": _median_seconds(backward, args.repeats),
        }

    if args.transformers and reference is not None:
        try:
            block, torch = _hf_block(args, reference)
        except ImportError:
            print("(transformers or torch not installed: no Hugging Face column)")
        else:
            weight = block.experts.down_proj
            x_torch = _to_torch(torch, x, weight).requires_grad_(True)
            g_torch = _to_torch(torch, cotangent, weight)
            with torch.no_grad():
                got = block(x_torch).float().cpu().numpy()
            ours = np.asarray(reference(x)[0], np.float32)
            print(f"transformers vs eqmoe ({args.backends[0]}): max |diff| {np.abs(got - ours).max():.2e}")

            def hf_forward():
                with torch.no_grad():
                    return block(x_torch)

            def hf_backward():
                block.zero_grad(set_to_none=True)
                x_torch.grad = None
                block(x_torch).backward(g_torch)

            rows["transformers"] = {
                "forward": _median_seconds(hf_forward, args.repeats),
                "forward_backward": _median_seconds(hf_backward, args.repeats),
            }

    results = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(args).items()}, "rows": {}}
    results["device"] = f"{jax.devices()[0].platform} x{os.cpu_count()} cores"
    results["matmul_peak_gflops"] = peak
    print(
        f"{'':<14}{'forward ms':>12}{'x dense':>9}{'x faster than HF':>18}{'of peak':>9}"
        f"{'fwd+bwd ms':>13}{'x dense':>9}{'x faster than HF':>18}{'of peak':>9}"
    )
    for name, row in rows.items():
        entry = {}
        cells = []
        for pass_name, passes in (("forward", 1), ("forward_backward", 3)):
            seconds = row[pass_name]
            ratio = seconds / rows["dense_swiglu"][pass_name]
            speedup = rows["transformers"][pass_name] / seconds if "transformers" in rows else None
            of_peak = passes * forward_gflop(args) / seconds / peak
            entry[pass_name] = {"ms": seconds * 1e3, "ratio_vs_dense": ratio, "speedup_vs_hf": speedup}
            entry[pass_name]["of_peak"] = of_peak
            cells.append(
                f"{seconds * 1e3:>12.1f}{ratio:>9.2f}{'' if speedup is None else f'{speedup:.2f}':>18}"
                f"{f'{100 * of_peak:.1f}%':>9}"
            )
        results["rows"][name] = entry
        print(f"{name:<14}{cells[0]} {cells[1]}")

    if args.memory_tokens:
        results["temp_bytes"] = {}
        print("\ncompiled temp bytes of forward+backward (XLA memory analysis), MiB")
        print(f"{'tokens':>8}" + "".join(f"{b:>12}" for b in args.backends))
        for tokens in args.memory_tokens:
            sizes = {b: _temp_bytes(args, b, tokens) for b in args.backends}
            results["temp_bytes"][tokens] = sizes
            print(f"{tokens:>8}" + "".join(f"{v / 2**20:>12.1f}" for v in sizes.values()))

    if args.json_out is not None:
        args.json_out.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main(tyro.cli(Args))
