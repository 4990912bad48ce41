"""Sparse upcycling: a dense Hugging Face checkpoint rewritten as a MoE checkpoint whose experts start as copies of
each layer's dense FFN (Komatsuzaki et al. 2022, "Sparse Upcycling", arXiv 2212.05055; Qwen1.5-MoE was built so),
optionally with part of each expert re-initialised (Nakamura et al. 2025, "Drop-Upcycling", arXiv 2502.19261).

The MoE family written is the one that holds the dense model's attention exactly (:data:`TARGETS`):

- Qwen3 -> Qwen3-MoE (QK-norm attention; softmax router, top-k renormalised by ``norm_topk_prob``).
- Llama -> Mixtral: Llama's attention without QK-norm is Mixtral's, and Mixtral's router always renormalises its
  top-k. Qwen3-MoE cannot hold it: transformers' ``Qwen3MoeAttention`` always applies ``q_norm``/``k_norm``, and an
  RMSNorm with unit scale still normalises, so no weight makes it the identity.
- Llama with ``shared_experts=1`` -> Qwen2-MoE (Llama's attention, and one shared expert gated by
  ``sigmoid(x @ w)``), the layout Qwen1.5-MoE was upcycled into. Qwen3-MoE has no shared expert, so Qwen3 refuses
  them; Qwen2-MoE holds exactly one, so more are refused.

Why the upcycled model computes the dense model's function at step 0 (no re-initialisation): the router's top-k
softmax weights are divided by their sum, so they add to 1 whatever the router's logits, and every expert is the same
function ``D`` (the dense FFN), so ``sum_k w_k D(x) = D(x)`` for any router (up to float rounding in the sum). The
router is therefore drawn as the papers draw it, at random (``N(0, router_std^2)``, seeded): its logits decide which
copies run, not what they compute. Without renormalisation the top-k weights add to a per-token amount below 1, which
no fixed scaling of the copies undoes for a random router: :func:`upcycled_config` refuses it. With a shared expert
the gate's weight starts at zero, so ``sigmoid(0) = 1/2`` exactly; the shared expert is ``D`` and every routed copy
has its down projection halved (exact in floating point): ``D/2 + D/2 = D``.

Drop-Upcycling (``drop_ratio = r > 0``): in every layer each routed expert draws its own ``round(r * width)`` of the
FFN's intermediate units (seeded, independent per expert and layer) and re-initialises their rows of ``gate_proj``
and ``up_proj`` and their columns of ``down_proj`` from ``N(mean, std^2)`` of the original matrix, keeping the rest;
the function then differs from the dense model's by design. The shared expert is kept whole.

The output is streamed tensor by tensor (:func:`eqmoe.checkpoints.hf_write.write_folder`): host memory holds one
output tensor at a time and the dense tensors it is copied from are memory-mapped, never the whole model.
"""

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eqmoe.checkpoints import hf, quantized
from eqmoe.checkpoints.hf_write import write_folder
from eqmoe.checkpoints.safetensors_io import DTYPES
from eqmoe.config import LayerKind, LossConfig, ModelConfig, MoEConfig, RouterConfig
from eqmoe.models import family as families
from eqmoe.models.family import TensorName

# dense family -> (MoE family without shared experts, MoE family with one; None: not expressible)
TARGETS: dict[str, tuple[str, str | None]] = {"qwen3": ("qwen3_moe", None), "llama": ("mixtral", "qwen2_moe")}
# config.json keys that change nothing computed and travel from the dense file as they are
_CARRIED_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


@dataclass(frozen=True)
class Upcycling:
    """How to upcycle: ``experts`` routed experts, ``top_k`` of them per token, ``shared_experts`` (0 or 1) beside
    them, ``drop_ratio`` of each expert's intermediate units re-initialised (Drop-Upcycling; 0: exact copies), the
    router drawn from ``N(0, router_std^2)``, everything random from ``seed``; ``renormalize``: the top-k weights
    divided by their sum (only ``True`` keeps the dense function), ``aux_loss_coef``: ``router_aux_loss_coef``."""

    experts: int
    top_k: int
    shared_experts: int = 0
    drop_ratio: float = 0.0
    seed: int = 0
    router_std: float = 0.02
    renormalize: bool = True
    aux_loss_coef: float = 0.001

    def __post_init__(self):
        def check(ok: bool, field: str, allowed: str) -> None:
            if not ok:
                raise ValueError(f"{field}={getattr(self, field)!r} is invalid; allowed: {allowed}")

        check(_is_int(self.experts) and self.experts >= 1, "experts", "an integer >= 1")
        check(_is_int(self.top_k) and 1 <= self.top_k <= self.experts, "top_k", f"1..experts={self.experts}")
        check(_is_int(self.shared_experts) and self.shared_experts >= 0, "shared_experts", "an integer >= 0")
        check(0.0 <= self.drop_ratio <= 1.0, "drop_ratio", "a number in [0, 1]")
        check(self.router_std >= 0, "router_std", "a number >= 0")
        check(self.aux_loss_coef >= 0, "aux_loss_coef", "a number >= 0")
        check(
            self.renormalize,
            "renormalize",
            "True (without it the top-k weights add to less than 1, a different amount per token, and the copies no "
            "longer compute the dense FFN)",
        )


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def upcycled_config(dense: ModelConfig, plan: Upcycling) -> ModelConfig:
    """The MoE :class:`ModelConfig` ``dense`` upcycles into: every layer's FFN becomes ``plan.experts`` experts of
    the dense width, in the family :data:`TARGETS` names. A ``ValueError`` in one line says why a model cannot be
    upcycled (not a dense family, a shared expert the target cannot hold, attention the target cannot express)."""
    if dense.family not in TARGETS:
        kind = "a MoE model" if dense.moe is not None else "a model"
        allowed = " | ".join(TARGETS)
        raise ValueError(f"{kind} of family {dense.family!r} cannot be upcycled; allowed: dense {allowed}")
    plain, with_shared = TARGETS[dense.family]
    target = with_shared if plan.shared_experts else plain
    if target is None or plan.shared_experts > 1:
        allowed = "0" if with_shared is None else f"0 (into {plain}) | 1 (into {with_shared})"
        raise ValueError(f"shared_experts={plan.shared_experts} for a {dense.family} model; allowed: {allowed}")
    shared = plan.shared_experts
    moe = MoEConfig(
        router=RouterConfig(num_experts=plan.experts, top_k=plan.top_k, renormalize=plan.renormalize),
        expert_dim=dense.mlp_dim,
        shared_experts=shared,
        shared_expert_dim=dense.mlp_dim if shared else None,
        shared_expert_gate=bool(shared),
    )
    template = families.get(target).field_map.template
    config = dense.replace(
        family=target,
        layers=tuple(LayerKind(layer.attention, "moe", layer.window) for layer in dense.layers),
        moe=moe,
        # kept where the target's config.json has intermediate_size beside the experts' width (Qwen3-MoE, Qwen2-MoE)
        mlp_dim=dense.mlp_dim if template.mlp_dim is not None else None,
        loss=LossConfig(load_balance="hf_pooled", load_balance_weight=plan.aux_loss_coef),
    )
    try:
        families.get(target).config_to_hf(config)
    except ValueError as error:
        raise ValueError(f"a {dense.family} model upcycles into {target}, and {error}") from None
    return config


def _layer(key: str) -> int:
    return int(re.match(r"model\.layers\.(\d+)\.", key).group(1))


def _ffn_part(name: TensorName) -> tuple[str, str | None]:
    """What a MoE checkpoint tensor is: ``("experts", leaf)``, ``("router", None)``, ``("shared_expert", leaf)``,
    ``("shared_gate", None)`` or ``("copy", None)`` (attention, norms, embedding, head: the dense file's own)."""
    path = name.path
    for part in ("experts", "shared_expert"):
        if part in path:
            return part, path[path.index(part) + 1]
    for part in ("router", "shared_gate"):
        if part in path:
            return part, None
    return "copy", None


def _dense_ffn_keys(dense: ModelConfig) -> dict[tuple[int, str], str]:
    """``(layer, "gate" | "up" | "down") -> the dense checkpoint's key`` of every layer's FFN matrices."""
    keys = {}
    for name in families.get(dense.family).checkpoint_names(dense):
        if "ffn" in name.path:
            keys[(_layer(name.key), name.path[name.path.index("ffn") + 1])] = name.key
    return keys


def _redrawn_units(plan: Upcycling, layer: int, expert: int, width: int) -> np.ndarray:
    """The intermediate units expert ``expert`` of ``layer`` re-initialises: its own ``round(drop_ratio * width)``."""
    count = round(plan.drop_ratio * width)
    return np.random.default_rng([plan.seed, 0, layer, expert]).choice(width, size=count, replace=False)


_LEAVES = ("gate", "up", "down")


def _expert(dense: np.ndarray, leaf: str, plan: Upcycling, layer: int, expert: int, halve: bool) -> np.ndarray:
    """One routed expert's ``leaf`` matrix (torch layout: gate/up ``[width, embed]``, down ``[embed, width]``)."""
    units_axis = 1 if leaf == "down" else 0
    units = _redrawn_units(plan, layer, expert, dense.shape[units_axis])
    if not len(units) and not (halve and leaf == "down"):
        return dense  # an exact copy: the memory-mapped tensor itself
    weight = np.array(dense)
    if len(units):
        original = dense.astype(np.float64)
        rng = np.random.default_rng([plan.seed, 1, layer, expert, _LEAVES.index(leaf)])
        shape = list(weight.shape)
        shape[units_axis] = len(units)
        drawn = rng.normal(original.mean(), original.std(), shape).astype(weight.dtype)
        if units_axis == 0:
            weight[units] = drawn
        else:
            weight[:, units] = drawn
    if halve and leaf == "down":
        weight = (weight.astype(np.float32) * 0.5).astype(weight.dtype)  # a power of two: exact
    return weight


def upcycled_tensors(
    dense_folder: Path, dense: ModelConfig, moe: ModelConfig, plan: Upcycling
) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor of the MoE checkpoint of ``moe``, in its family's order, made from the dense folder's: one at a
    time, the dense ones memory-mapped (:mod:`eqmoe.checkpoints.safetensors_io`)."""
    files = hf.weight_files(dense_folder)
    ffn_keys = _dense_ffn_keys(dense)
    halve = moe.moe.shared_experts > 0
    seen = set()
    for name in families.get(moe.family).checkpoint_names(moe):
        if name.duplicate or name.key in seen:
            continue
        seen.add(name.key)
        part, leaf = _ffn_part(name)
        if part == "copy":
            yield name.key, files[name.key].read(name.key)
            continue
        layer = _layer(name.key)
        gate = ffn_keys[(layer, "gate")]
        embed, dtype = files[gate].shape(gate)[1], DTYPES[files[gate].dtype(gate)]  # the dense FFN's
        if part == "router":
            rng = np.random.default_rng([plan.seed, 2, layer])
            yield name.key, rng.normal(0.0, plan.router_std, (plan.experts, embed)).astype(dtype)
        elif part == "shared_gate":
            yield name.key, np.zeros((1, embed), dtype)
        else:
            key = ffn_keys[(layer, leaf)]
            source = files[key].read(key)
            if part == "shared_expert":
                yield name.key, source
            else:
                yield name.key, _expert(source, leaf, plan, layer, name.index[-1], halve)


def upcycle(
    dense_folder: str | Path,
    out: str | Path,
    plan: Upcycling,
    *,
    overwrite: bool = False,
    max_shard_size: int | str = "5GB",
) -> ModelConfig:
    """Write the upcycled MoE checkpoint of the dense Hugging Face folder ``dense_folder`` to ``out`` (tokenizer and
    generation files copied beside it) and return its config. Everything is checked before anything is written; the
    folder is staged under a temporary name and renamed into place."""
    dense_folder = Path(dense_folder)
    dense = hf.read_config(dense_folder)
    moe = upcycled_config(dense, plan)
    scheme = quantized.read_scheme(dense_folder)
    if scheme is not None:  # the experts are byte copies of the dense tensors: their scales would not follow
        raise ValueError(
            f"{dense_folder}: holds {scheme.describe()} weights; upcycling reads unquantized folders (hf.load then "
            "hf.save writes one)"
        )
    hf_config = families.get(moe.family).config_to_hf(moe)
    source = json.loads((dense_folder / "config.json").read_text())
    hf_config.update({key: source[key] for key in _CARRIED_KEYS if key in source})
    if moe.attention.rope_scaling is None and isinstance(source.get("max_position_embeddings"), int):
        hf_config["max_position_embeddings"] = source["max_position_embeddings"]  # the context, not the math
    # the dense folder's tensors checked before anything is written: a missing or mis-shaped one is one message
    dense_names = families.get(dense.family).checkpoint_names(dense)
    hf.check_tensors(dense, dense_names, hf.abstract_leaves(dense), hf.weight_files(dense_folder), dense_folder)
    hf_config["dtype"] = hf.stored_dtype(dense_folder)
    count = len({name.key for name in families.get(moe.family).checkpoint_names(moe) if not name.duplicate})
    tensors = upcycled_tensors(dense_folder, dense, moe, plan)
    extra = hf.side_files(dense_folder)
    write_folder(out, hf_config, tensors, count, max_shard_size=max_shard_size, overwrite=overwrite, extra_files=extra)
    return moe
