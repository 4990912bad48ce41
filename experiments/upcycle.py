"""Upcycle a dense Hugging Face checkpoint into a MoE one: every layer's FFN copied into routed experts.

    python -m experiments.upcycle --hf DENSE_DIR --experts 8 --top-k 2 --out MOE_DIR                   # exact copies
    python -m experiments.upcycle --hf DENSE_DIR --experts 8 --top-k 2 --drop-ratio 0.5 --out MOE_DIR  # Drop-Upcycling
    python -m experiments.upcycle --hf LLAMA_DIR --experts 8 --top-k 2 --shared-experts 1 --out MOE_DIR

Sparse upcycling (Komatsuzaki et al. 2022) with Drop-Upcycling's partial re-initialisation (Nakamura et al. 2025):
a Qwen3 folder becomes Qwen3-MoE, a Llama folder Mixtral (or Qwen2-MoE with one shared expert); see
:mod:`eqmoe.surgery.upcycle` for why the result computes the dense model's function at step 0 without
re-initialisation, and what each family can hold. The folder written is an ordinary checkpoint of that family:
``sft --init-from-hf``, ``pretrain --init-from-hf``, ``ablate --init-from-hf``, ``convert`` and transformers load it.
Tensors stream one at a time (host memory: one tensor of the output); the folder is written under a
temporary name and renamed. A request that cannot be met (top-k above the experts, a MoE or unsupported model, a drop
ratio outside [0, 1], an existing output) is one line on stderr and exit code 2, with nothing written.
"""

import time
from dataclasses import dataclass
from pathlib import Path

import tyro

from eqmoe.data.hub import resolve_folder
from eqmoe.surgery.upcycle import Upcycling, upcycle
from experiments._cli import UsageError, guarded


@dataclass(frozen=True)
class Args:
    experts: int
    """Routed experts per layer, each a copy of the layer's dense FFN."""
    top_k: int
    """Experts each token is sent to (1..experts)."""
    out: Path
    """The MoE Hugging Face folder to write."""
    # the dense model to upcycle (Qwen3 or Llama): the option every command reads a Hugging Face model with
    hf: Path | None = None
    """Hugging Face model: a folder (config.json + safetensors, any registered family) or a Hub id
    ORG/NAME[@REVISION]."""
    shared_experts: int = 0
    """Shared experts beside the routed ones: 0, or 1 for Llama (written as Qwen2-MoE, with a sigmoid-gated shared
    expert; the routed copies' outputs halved and the gate at sigmoid(0) = 1/2, so the function is kept)."""
    drop_ratio: float = 0.0
    """Drop-Upcycling: the fraction of each expert's intermediate units re-initialised from N(mean, std^2) of the
    original matrix, a different random set per expert (0: exact copies, the dense function at step 0)."""
    seed: int = 0
    """Seed of the router's initialisation and of Drop-Upcycling's units and values."""
    router_std: float = 0.02
    """Standard deviation of the router's random initial weights (transformers' initializer_range)."""
    aux_loss_coef: float = 0.001
    """router_aux_loss_coef of the MoE config (the load-balancing loss's weight in training)."""
    max_shard_size: str = "5GB"
    """The largest safetensors shard written (an index json is written when there are several)."""
    overwrite: bool = False
    """Replace an existing output folder instead of refusing."""


def run(args: Args) -> str:
    plan = Upcycling(
        experts=args.experts,
        top_k=args.top_k,
        shared_experts=args.shared_experts,
        drop_ratio=args.drop_ratio,
        seed=args.seed,
        router_std=args.router_std,
        aux_loss_coef=args.aux_loss_coef,
    )
    if args.hf is None:
        raise UsageError("give --hf DENSE_DIR: the dense Hugging Face model to upcycle")
    source = resolve_folder(args.hf)
    if not (source / "config.json").is_file():
        raise UsageError(f"{source}: no config.json (not a Hugging Face model folder)")
    if args.out.exists() and not args.overwrite:
        raise UsageError(f"{args.out}: already exists (pass --overwrite to replace it)")
    moe = upcycle(source, args.out, plan, overwrite=args.overwrite, max_shard_size=args.max_shard_size)
    router = moe.moe.router
    shared = f" + {moe.moe.shared_experts} shared" if moe.moe.shared_experts else ""
    return (
        f"{source} -> {args.out} ({moe.family}: {moe.num_layers} layers of {router.num_experts} experts{shared}, "
        f"top-{router.top_k}, width {moe.moe.expert_dim}, drop ratio {args.drop_ratio}, seed {args.seed})"
    )


def main(args: Args) -> int:
    start = time.perf_counter()
    done = guarded("upcycle", run, args)
    if done is None:
        return 2
    print(f"upcycle: {done} in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(tyro.cli(Args)))
