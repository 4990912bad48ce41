"""The two frameworks' passes on one ``bench_model`` row: eqmoe's jitted forward pass and its own train step, and
transformers' loss, backward, clipping and AdamW with the same optimizer values."""

import copy
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from experiments._bench_rows import positions


def copy_arrays(tree):
    """``tree`` with fresh buffers (the train step donates its state; the forward pass keeps the original)."""
    return jax.tree.map(lambda leaf: jnp.asarray(np.array(leaf)) if eqx.is_array(leaf) else leaf, tree)


def eqmoe_batch(ids: np.ndarray):
    """The train step's ``Batch``: one segment per row (id 1; 0 is padding), positions 0.., every target."""
    from eqmoe.train.step import Batch

    return Batch(
        tokens=jnp.asarray(ids.astype(np.int32)),
        segment_ids=jnp.asarray(np.ones(ids.shape, np.int32)),
        positions=jnp.asarray(positions(*ids.shape)),
        target_mask=jnp.asarray(np.ones(ids.shape, bool)),
    )


@eqx.filter_jit
def eqmoe_logits(model, batch):
    """The logits as ``eqmoe.train.step.batch_loss`` computes them."""
    mask = batch.segment_ids != 0
    return model(batch.tokens, segment_ids=batch.segment_ids, positions=batch.positions, token_mask=mask).logits


def eqmoe_train(model, batch, seed: int) -> Callable[[], Any]:
    """One call of the project's jitted train step per call; the donated state is carried between calls."""
    from eqmoe.train.optimizer import OptimizerConfig, make_optimizer
    from eqmoe.train.state import init_state
    from eqmoe.train.step import make_train_step

    model = copy_arrays(model)
    optimizer, schedule = make_optimizer(
        OptimizerConfig(warmup_steps=0), eqx.filter(model, eqx.is_array), embed_dim=model.config.embed_dim
    )
    holder = [init_state(model, optimizer, key=jax.random.key(seed + 1))]
    step = make_train_step(optimizer, schedule)

    def call():
        holder[0], metrics = step(batch, holder[0])
        return holder[0], metrics

    return call


def hf_train(reference, ids, adamw: str, dtype: str) -> Callable[[], Any]:
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
