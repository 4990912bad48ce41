"""Parameter report for a named preset, from shapes alone (nothing is allocated).

    python -m experiments.param_report --preset qwen3-30b-a3b
    python -m experiments.param_report --preset qwen3-235b-a22b --json

Prints one row per parameter array (stacked layers appear once, with their leading ``repeats`` axis)
and the total and active counts; active counts only ``top_k / num_experts`` of the routed experts. The
multi-token-prediction layers DeepSeek-V3 keeps after its decoder are counted on a line of their own (``mtp``).
A family may add columns: for the Envy presets each row also names the same parameter in AXLearn and in
MaxText, with its shape there (the parameter-equivalence report).
"""

import json
import sys
from dataclasses import asdict, dataclass

import tyro

from eqmoe import models
from eqmoe.analysis import ParamRow, count_mtp, count_parameters, parameter_table
from eqmoe.config import ModelConfig
from experiments.options import JsonOptions, PresetOptions


@dataclass(frozen=True)
class Args(PresetOptions, JsonOptions):
    """A preset's parameters with their roles, shapes and counts."""


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) or "scalar"


def _reference_columns(config: ModelConfig, row: ParamRow) -> dict[str, str]:
    """The family's names of the parameter in its reference codebases (Envy: AXLearn and MaxText)."""
    columns = models.get(config.family).reference_columns
    return {} if columns is None else columns(row.path, row.shape)


def _repeated(config: ModelConfig) -> int:
    """The parameters a checkpoint repeats for its multi-token-prediction layers (DeepSeek-V3's files repeat the
    embedding and output head per layer; Qwen3-Next's share them): its name map's ``duplicate`` tensors."""
    if not config.mtp_layers:
        return 0
    repeated = [name for name in models.get(config.family).checkpoint_names(config) if name.duplicate]
    return len(repeated) * config.vocab_size * config.embed_dim


def format_table(config: ModelConfig, rows: list[ParamRow], total: int, active: int) -> str:
    """The per-parameter table, then the total and active counts with thousands separators (and the
    multi-token-prediction layers' count on a line of its own)."""
    records = [
        {
            "path": row.path,
            "shape": _shape(row.shape),
            **_reference_columns(config, row),
            "count": f"{row.count:,}",
            "routed": "yes" if row.routed else ("mtp" if row.mtp else ""),
        }
        for row in rows
    ]
    header = list(records[0])
    widths = {key: max(len(key), *(len(record[key]) for record in records)) for key in header}
    lines = [
        "  ".join(
            f"{record[key]:>{widths[key]}}" if key == "count" else f"{record[key]:<{widths[key]}}" for key in header
        ).rstrip()
        for record in [dict(zip(header, header, strict=True)), *records]
    ]
    width = len(f"{total:,}")
    lines += ["", f"total  {total:>{width},}", f"active {active:>{width},}"]
    if mtp := count_mtp(rows):
        with_copies = mtp + _repeated(config)
        lines.append(
            f"mtp    {mtp:>{width},}  (multi-token-prediction layers, not in total or active; {with_copies:,} in "
            "the files" + (", which repeat the embedding and head they share)" if with_copies > mtp else ")")
        )
    return "\n".join(lines)


def main(args: Args) -> int:
    try:
        config = args.preset_config()
    except ValueError as error:
        print(f"param_report: {error}", file=sys.stderr)
        return 2
    rows = parameter_table(config)
    total, active = count_parameters(config, rows)
    if args.json:
        parameters = [{**asdict(row), "shape": list(row.shape), **_reference_columns(config, row)} for row in rows]
        mtp = count_mtp(rows)
        counts = {"total": total, "active": active, "mtp": mtp, "mtp_in_files": mtp + _repeated(config) if mtp else 0}
        print(json.dumps({"preset": args.preset, **counts, "parameters": parameters}))
    else:
        print(f"preset {args.preset}\n")
        print(format_table(config, rows, total, active))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(tyro.cli(Args)))
