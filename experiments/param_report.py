"""Parameter report for a named preset, from shapes alone (nothing is allocated).

    python -m experiments.param_report --preset qwen3-30b-a3b
    python -m experiments.param_report --preset qwen3-235b-a22b --json

Prints one row per parameter array (stacked layers appear once, with their leading ``repeats`` axis)
and the total and active counts; active counts only ``top_k / num_experts`` of the routed experts.
"""

import json
import sys
from dataclasses import asdict, dataclass

import tyro

from eqmoe import presets
from eqmoe.analysis import ParamRow, count_parameters, parameter_table


@dataclass(frozen=True)
class Args:
    preset: str
    """Name of the model preset, e.g. qwen3-30b-a3b (see eqmoe.presets.names())."""

    json: bool = False
    """Print one JSON object (preset, total, active, parameters) instead of the table."""


def format_table(rows: list[ParamRow], total: int, active: int) -> str:
    """The per-parameter table, then the total and active counts with thousands separators."""
    header = ("path", "shape", "count", "routed")
    cells = [
        (row.path, "x".join(map(str, row.shape)) or "scalar", f"{row.count:,}", "yes" if row.routed else "")
        for row in rows
    ]
    widths = [max(len(line[i]) for line in [header, *cells]) for i in range(len(header))]
    lines = [
        f"{path:<{widths[0]}}  {shape:<{widths[1]}}  {count:>{widths[2]}}  {routed}".rstrip()
        for path, shape, count, routed in [header, *cells]
    ]
    width = len(f"{total:,}")
    lines += ["", f"total  {total:>{width},}", f"active {active:>{width},}"]
    return "\n".join(lines)


def main(args: Args) -> int:
    try:
        config = presets.get(args.preset)
    except ValueError as error:
        print(f"param_report: {error}", file=sys.stderr)
        return 2
    rows = parameter_table(config)
    total, active = count_parameters(config, rows)
    if args.json:
        parameters = [{**asdict(row), "shape": list(row.shape)} for row in rows]
        print(json.dumps({"preset": args.preset, "total": total, "active": active, "parameters": parameters}))
    else:
        print(f"preset {args.preset}\n")
        print(format_table(rows, total, active))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(tyro.cli(Args)))
