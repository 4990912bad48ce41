"""LoRA adapters as a PEFT adapter folder (``adapter_model.safetensors`` + ``adapter_config.json``) that
``peft.PeftModel.from_pretrained`` puts on the transformers model of the base folder.

The matrices of every attention kind (q/k/v/o; the linear attention's ``in_proj_qkvz``, ``in_proj_ba`` or
``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` and ``out_proj``) are PEFT ``target_modules``, named by
their attention module and their own (``self_attn.q_proj``, ``linear_attn.in_proj_qkvz``), with the usual
``<module>.lora_A.weight [r, in]`` / ``lora_B.weight [out, r]``. Everything else is a ``target_parameters`` entry
(PEFT's adapters on ``nn.Parameter``s; same two tensors for a matrix): PEFT rewrites
``gate_proj``/``up_proj``/``down_proj`` module targets of MoE models into fused-expert targets, which would drop a
dense layer's FFN adapters, and the router is not an ``nn.Linear`` in transformers. transformers holds a layer's
experts fused as ``experts.gate_up_proj [experts, 2 * expert_dim, embed]`` and ``experts.down_proj [experts, embed,
expert_dim]``, and PEFT keeps one adapter per expert inside one pair of matrices (``lora_A [experts * r, in]``, row
``e * r + k``; ``lora_B [out, r * experts]``, column ``k * experts + e``). eqmoe's separate gate and up
adapters become one adapter of rank ``2r`` on the fused matrix (the two stacked, block-diagonal in ``B``), the
same update exactly; ``rank_pattern``/``alpha_pattern`` keep its scale ``alpha / r``. A family whose files hold the
experts fused already (gpt-oss: ``gate_up_proj [experts, embed, 2 * expert_dim]``, gate and up interleaved, whose
:class:`~eqmoe.tensor_names.TensorName` carries ``columns``) puts each side's ``B`` on the columns its name says.
PEFT nests the wrappers of two parameters of one module: the first parameter (``gate_up_proj``) sits under
``base_layer``.

The names are the modules of the model ``AutoModelForCausalLM`` builds from the base folder: a multimodal folder's
language model (files ``model.language_model.*``, Qwen3.5's) is what its causal-LM class holds as ``model.*``.
"""

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from eqmoe.checkpoints._staging import staged_folder
from eqmoe.checkpoints.hf_layout import checkpoint_names, leaf_at
from eqmoe.model import Transformer
from eqmoe.nn.kinds import AttentionKind
from eqmoe.nn.linear import ExpertLinear, Linear

ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
_PREFIX = "base_model.model."
# (file prefix, module prefix): how a causal-LM class holds what a multimodal folder's files name (transformers'
# PrefixChange on loading Qwen3.5's folders into Qwen3_5MoeForCausalLM)
_CAUSAL_LM_PREFIXES = (("model.language_model.", "model."),)


def _module(key: str) -> str:
    """The module name in the causal-LM model of the checkpoint tensor ``key`` (its ``.weight`` removed)."""
    key = key.removesuffix(".weight")
    for stored, held in _CAUSAL_LM_PREFIXES:
        if key.startswith(stored):
            return held + key[len(stored) :]
    return key


def _factors(a: np.ndarray, b: np.ndarray, in_dims: int) -> tuple[np.ndarray, np.ndarray]:
    """``(lora_A [r, in], lora_B [out, r])`` of one matrix from eqmoe's ``a [*in, r]``, ``b [r, *out]``."""
    rank = a.shape[-1]
    assert a.ndim == in_dims + 1
    return a.reshape(-1, rank).T, b.reshape(rank, -1).T


def _expert_factors(pieces: list[tuple[np.ndarray, np.ndarray, slice]], out: int) -> tuple[np.ndarray, np.ndarray]:
    """PEFT's per-expert factors of one fused parameter from eqmoe's ``(a [E, in, r], b [E, r, rows], the output
    rows they fill)`` pieces: ranks stacked, each piece's ``B`` on its own output rows."""
    experts = pieces[0][0].shape[0]
    rank = sum(a.shape[-1] for a, _, _ in pieces)
    lora_a = np.concatenate([np.swapaxes(a, 1, 2) for a, _, _ in pieces], axis=1)  # [E, R, in]
    lora_b = np.zeros((experts, rank, out), pieces[0][1].dtype)  # [E, R, out]
    k = 0
    for a, b, rows in pieces:
        lora_b[:, k : k + a.shape[-1], rows] = b
        k += a.shape[-1]
    return lora_a.reshape(experts * rank, -1), np.transpose(lora_b, (2, 1, 0)).reshape(out, rank * experts)


def _rows(columns: tuple[int, int] | None, side: int, width: int) -> slice:
    """The fused parameter's output rows of gate (``side`` 0) or up (1): interleaved where the family's name says
    ``columns``, else transformers' concatenation, gate first."""
    if columns is not None:
        return slice(columns[0], None, columns[1])
    return slice(side * width, (side + 1) * width)


def adapter_state(model: Transformer) -> tuple[dict[str, np.ndarray], dict]:
    """``(tensors, adapter_config fields)`` of every adapter of ``model`` in PEFT's names."""
    tensors: dict[str, np.ndarray] = {}
    modules, parameters, patterns = set(), set(), {}
    scale = rank = None
    dropout = 0.0
    experts: dict[tuple, dict] = {}
    for name in checkpoint_names(model.config):
        if name.path[-1] != "weight":
            continue
        linear = leaf_at(model, name.path[:-1])
        if not isinstance(linear, Linear) or linear.adapter is None:
            continue
        adapter = linear.adapter
        a, b = adapter.a, adapter.b
        rank, scale, dropout = adapter.rank, adapter.scale, max(dropout, adapter.dropout)
        part = leaf_at(model, name.path[:-2])
        if not isinstance(linear, ExpertLinear):  # one matrix per layer
            module = _module(name.key)
            lora_a, lora_b = _factors(np.asarray(a[name.index]), np.asarray(b[name.index]), name.linear_in_dims)
            tensors[f"{_PREFIX}{module}.lora_A.weight"] = lora_a
            tensors[f"{_PREFIX}{module}.lora_B.weight"] = lora_b
            owner = ".".join(module.split(".")[-2:])  # self_attn.q_proj, linear_attn.out_proj, mlp.gate_proj
            if isinstance(part, AttentionKind):  # transformers' nn.Linear of the attention module
                modules.add(owner)
            else:  # PEFT renames listed gate/up/down_proj modules of MoE models to fused-expert targets
                parameters.add(owner + ".weight")
        elif len(name.index) == 1 or name.index[1] == 0:  # routed experts: the stack at its first (or only) name
            module = _module(name.key.split(".experts.")[0]) + ".experts"
            slot = experts.setdefault((module, name.path[:-2], name.index[0]), {})
            slot[name.path[-2] + "_"] = (np.asarray(a[name.index[0]]), np.asarray(b[name.index[0]]), name.columns)
    for (module, _, _), members in experts.items():
        fused = [(m, i) for i, m in enumerate(("gate_", "up_")) if m in members]
        wrapped = []
        if fused:
            expert_dim = members[fused[0][0]][1].shape[-1]
            pieces = []
            for member, side in fused:
                a, b, columns = members[member]
                pieces.append((a, b, _rows(columns, side, expert_dim)))
            wrapped.append(("gate_up_proj", _expert_factors(pieces, 2 * expert_dim)))
        if "down_" in members:
            a, b, _ = members["down_"]
            wrapped.append(("down_proj", _expert_factors([(a, b, slice(None))], b.shape[-1])))
        for depth, (parameter, (lora_a, lora_b)) in enumerate(wrapped):
            nesting = ".base_layer" * (len(wrapped) - 1 - depth)
            tensors[f"{_PREFIX}{module}{nesting}.lora_A.weight"] = lora_a
            tensors[f"{_PREFIX}{module}{nesting}.lora_B.weight"] = lora_b
            parameters.add(f"experts.{parameter}")
            fused_rank = lora_a.shape[0] // next(iter(members.values()))[0].shape[0]
            if fused_rank != rank:
                patterns[rf".*\.{parameter}"] = fused_rank
    if rank is None:
        raise ValueError("the model has no LoRA adapters to write")
    fields = {
        "r": rank,
        "lora_alpha": scale * rank,
        "rank_pattern": patterns,
        "alpha_pattern": {key: scale * value for key, value in patterns.items()},
        "target_modules": sorted(modules) or None,
        "target_parameters": sorted(parameters) or None,
        # PEFT refuses lora_dropout with parameter targets (experts, router, dense FFNs here); it only matters
        # for training on, so such a folder records none.
        "lora_dropout": 0.0 if parameters else dropout,
    }
    return tensors, fields


def save_adapters(
    model: Transformer,
    folder: str | os.PathLike,
    *,
    base_model: str | None = None,
    overwrite: bool = False,
    extra_files: Sequence[Path] = (),
) -> Path:
    """Write ``model``'s adapters as a PEFT adapter folder (float32); ``base_model`` is recorded as
    ``base_model_name_or_path``. ``extra_files`` (the tokenizer and generation files PEFT users load from the
    adapter folder) are copied in beside the adapters. Assembled under a temporary name and renamed into place."""
    tensors, fields = adapter_state(model)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        **fields,
    }
    folder = Path(folder)
    with staged_folder(folder, overwrite=overwrite) as staging:
        for extra in extra_files:
            shutil.copyfile(extra, staging / Path(extra).name)
        arrays = {key: np.ascontiguousarray(value, np.float32) for key, value in tensors.items()}
        save_file(arrays, staging / ADAPTER_FILE, metadata={"format": "pt"})
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return folder
