"""A first end-to-end run: build a tiny Qwen3-MoE, train it briefly, export it to Hugging Face and back.

    python -m experiments.demo
    python -m experiments.demo --steps 100 --out-dir runs/demo

It trains next-token prediction on built-in counting data (each row counts from a random start in
a random stride of 1..5, modulo the vocabulary, so after two tokens every token is predictable from
the previous two), prints the loss falling and
the per-layer expert load, writes the model as a Hugging Face folder (config.json + safetensors),
reads it back and checks the logits are identical, and prints the parameter report.
"""

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import tyro

from eqmoe import Transformer
from eqmoe.analysis import count_parameters
from eqmoe.checkpoints import hf
from eqmoe.losses import objective
from eqmoe.train.loop import OutputOptions
from experiments.options import PresetOptions, ShapeOptions


@dataclass(frozen=True)
class Args(PresetOptions, ShapeOptions, OutputOptions):
    preset: str = "qwen3-moe-tiny"
    seq_len: int = 64

    steps: int = 100
    """Optimizer steps on the counting data."""

    learning_rate: float = 1e-2
    """AdamW peak learning rate."""

    out_dir: Path = Path("runs/demo")
    seed: int = 0
    """Seed for the parameters and the data."""


def counting_rows(key: jax.Array, batch: int, seq: int, vocab: int, max_stride: int = 5) -> jax.Array:
    """Rows ``start, start + stride, start + 2 * stride, ...`` modulo ``vocab``."""
    key_start, key_stride = jax.random.split(key)
    start = jax.random.randint(key_start, (batch, 1), 0, vocab)
    stride = jax.random.randint(key_stride, (batch, 1), 1, max_stride + 1)
    return (start + stride * jnp.arange(seq)) % vocab


def main(args: Args) -> int:
    try:
        config = args.preset_config()
    except ValueError as error:
        print(f"demo: {error}", file=sys.stderr)
        return 2
    total, active = count_parameters(config)
    print(f"{args.preset}: {total:,} parameters, {active:,} active per token, layers {config.ffn_kinds()}")

    model_key, data_key = jax.random.split(jax.random.key(args.seed))
    model = Transformer(config, key=model_key)
    optimizer = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, args.learning_rate, 10, args.steps))
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit(donate="all-except-first")
    def train_step(key, model, opt_state):
        tokens = counting_rows(key, args.batch_size, args.seq_len, config.vocab_size)

        def loss_fn(model):
            output = model(tokens)
            return objective(output, tokens, jnp.ones(tokens.shape, bool), config)

        (_, terms), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, terms

    start = time.perf_counter()
    for step in range(args.steps):
        model, opt_state, terms = train_step(jax.random.fold_in(data_key, step), model, opt_state)
        if step % 10 == 0 or step == args.steps - 1:
            print(
                f"step {step:4d}  loss {float(terms['loss']):.4f}  cross-entropy {float(terms['cross_entropy']):.4f}"
                f"  load-balance {float(terms['load_balance']):.3f}  {time.perf_counter() - start:6.1f}s"
            )

    tokens = counting_rows(jax.random.key(args.seed + 1), args.batch_size, args.seq_len, config.vocab_size)
    output = eqx.filter_jit(model)(tokens)
    print(
        f"\nexpert load per MoE layer (fraction of routed slots; uniform is {1 / config.moe.router.num_experts:.3f}):"
    )
    for layer, load in enumerate(output.aux.load):
        print(f"  layer {layer}: " + " ".join(f"{x:.3f}" for x in load.tolist()))

    folder = hf.save(model, args.out_dir / "hf", overwrite=True)
    reloaded = hf.load(folder)
    difference = float(jnp.max(jnp.abs(eqx.filter_jit(reloaded)(tokens).logits - output.logits)))
    print(f"\nwrote {folder} (config.json + model.safetensors); reloaded max |logit difference| = {difference}")
    return 0 if difference == 0.0 else 1


if __name__ == "__main__":
    raise SystemExit(main(tyro.cli(Args)))
