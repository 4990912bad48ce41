"""What an ablation's variants are beside its built-in table: the overrides every variant starts from
(:data:`BASE_OVERRIDES`), the variants of a ``--variants-file``, and the expert widths ``--match active-flops`` gives
them."""

import functools
import json
import math
import re
from collections.abc import Collection
from pathlib import Path

from eqmoe.config import ModelConfig
from eqmoe.config_io import apply_overrides
from eqmoe.flops import model_flops_per_token
from experiments._ablation_report import WIDTH_STEP
from experiments._cli import UsageError

# Every variant starts from these; a stronger load-balance loss than HF's 0.001 default so that turning
# it off is a visible change within a short run.
BASE_OVERRIDES: dict[str, object] = {"loss.load_balance_weight": 0.01}

_VARIANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # it names the variant's folder


def read_variants_file(path: Path, built_in: Collection[str]) -> dict[str, dict[str, object]]:
    """``--variants-file``: variant name -> {field path: value}, none named as one of ``built_in``; its shape is
    checked here, its fields and values by ``experiments.ablate.check_variants``."""
    where = f"--variants-file {path}"
    try:
        table = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"{where}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UsageError(f"{where}: not valid JSON ({error})") from None
    example = '{"top1": {"moe.router.top_k": 1}}'
    if not isinstance(table, dict) or not table:
        raise UsageError(f"{where}: expected a non-empty JSON object of variant name -> overrides, e.g. {example}")
    for name, overrides in table.items():
        if not _VARIANT_NAME.fullmatch(name):
            raise UsageError(f"{where}: variant name {name!r} is invalid; allowed: letters, digits, '.', '_', '-'")
        if name in built_in:
            raise UsageError(f"{where}: variant {name!r} is built in (experiments/ablate.py); give yours another name")
        if not isinstance(overrides, dict):
            raise UsageError(
                f"{where}: variant {name!r}: expected an object of field path -> value, got {json.dumps(overrides)}"
            )
    return table


# --- --match active-flops ---------------------------------------------------------------------------------------


def _flops(config: ModelConfig, seq_len: int, expert_dim: int | None = None) -> float:
    if expert_dim is not None:
        config = apply_overrides(config, {"moe.expert_dim": expert_dim})
    return model_flops_per_token(config, seq_len)


def matched_expert_dim(config: ModelConfig, target_flops: float, seq_len: int) -> int:
    """The ``moe.expert_dim``, a multiple of :data:`WIDTH_STEP` or ``config``'s own, whose model FLOPs per token at
    ``seq_len`` come closest to ``target_flops``. FLOPs grow linearly with the width, so two widths locate the
    answer and the multiples on either side of it are compared exactly."""
    own = config.moe.expert_dim
    flops = functools.cache(functools.partial(_flops, config, seq_len))
    slope = (flops(own + WIDTH_STEP) - flops(own)) / WIDTH_STEP
    if slope <= 0:  # no layer runs the routed experts: the width costs nothing
        return own
    estimate = own + (target_flops - flops(own)) / slope
    below = max(WIDTH_STEP, math.floor(estimate / WIDTH_STEP) * WIDTH_STEP)
    candidates = sorted({own, below, below + WIDTH_STEP})
    return min(candidates, key=lambda width: (abs(flops(width) - target_flops), width != own))


def matched_widths(
    table: dict[str, dict[str, object]], names: list[str], configs: dict[str, ModelConfig], seq_len: int
) -> dict[str, int]:
    """``--match active-flops``: the matched ``moe.expert_dim`` of each variant of ``names`` whose width changes
    (not the baseline's, not one a variant sets itself, not a model without MoE layers)."""
    target = model_flops_per_token(configs["baseline"], seq_len)
    widths = {}
    for name in names:
        config = configs[name]
        if name == "baseline" or config.moe is None or "moe.expert_dim" in table[name]:
            continue
        width = matched_expert_dim(config, target, seq_len)
        if width != config.moe.expert_dim:
            widths[name] = width
    return widths
