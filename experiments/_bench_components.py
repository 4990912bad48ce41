"""``bench_model --breakdown``: single components of a row (attention, sliding or linear and full apart where layers
differ, MoE, an equal-FLOP dense SwiGLU, RMSNorm, embedding + head + loss) on both sides, forward and forward+backward,
and one linear (gated DeltaNet) layer alone at growing lengths."""

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from eqmoe.nn import dispatch
from experiments._bench_device import interleaved
from experiments._bench_rows import Shape, positions

LINEAR = "gated_deltanet"  # the linear-attention kind: Qwen3-Next's gated DeltaNet layers


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

    const = context(np.ones((batch, seq), np.int32), positions(batch, seq), np.ones((batch, seq), bool))

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
