"""What an ablation is asked for beside the options it shares with the other commands (``experiments.options``): its
variants, seeds and budget (:class:`AblationOptions`), and which options make the settings an output folder holds
results of (:func:`settings`)."""

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from eqmoe.train.tracking import TrackerOptions
from experiments.options import EvalOptions, MeshOptions, StartOptions


@dataclass(frozen=True)
class AblationOptions:
    """The ablation's own options (its ``Args`` sets ``--out-dir``'s and ``--wandb-project``'s defaults)."""

    variants: tuple[str, ...] = ()
    """Variants to run, by name (default: all of VARIANTS; with --variants-file, baseline and the file's)."""
    variants_file: Path | None = None
    """More variants: a JSON object {"name": {"field.path": value}}, e.g. {"top1": {"moe.router.top_k": 1}}."""
    steps: int = 300
    """Optimizer steps per variant."""
    learning_rate: float = 3e-3
    """Peak learning rate (50 warmup steps, cosine to a tenth at the last step)."""
    eval_every: int = 50
    """Evaluate every N steps (the eval-loss curve's resolution)."""
    checkpoint_every: int = 50
    """Checkpoint every N steps: at most this many steps are redone after an interruption."""
    seed: int = 0
    """First seed: the runs of every variant use seeds --seed, --seed + 1, ..., --seed + --seeds - 1."""
    seeds: int = 3
    """Seeds per variant; each sets the initial parameters, the data order and the built-in corpus' text together."""
    match: Literal["tokens", "active-flops"] = "tokens"
    """tokens: every variant trains on steps x batch x seq tokens. active-flops: also sets each variant's
    moe.expert_dim (a multiple of 8) to bring its FLOPs per token closest to the baseline's."""
    data: tuple[Path, ...] = ()
    """Text files (one document each) or JSONL files of {"text", "domain"} (default: the built-in corpus)."""
    chars_per_domain: int = 400_000
    """Built-in corpus: training characters of each domain."""
    eval_chars_per_domain: int = 10_000
    """Built-in corpus: held-out characters of each domain."""
    dry_run: bool = False
    """Check every variant and print the runs the grid holds (finished, to resume, to train) and, with --match
    active-flops, the widths and FLOP gaps; train and write nothing."""


# Inputs of a run that may be left unset; unset, they are left out of the settings, so an output folder written
# before they existed keeps its settings.
_OPTIONAL_INPUTS = {
    "data": (),
    "tokenizer": None,
    "init_from_hf": None,
    "init_from_checkpoint": None,
    "override": (),
    "dtype": "float32",
    "remat": "none",
    "scan_unroll": StartOptions.scan_unroll,  # how the layers' scan runs: the same numbers
    "match": "tokens",
}


def settings(args: AblationOptions) -> dict:
    """What every variant shares of ``args`` (the ablation's whole ``Args``); an output folder holds results of one
    setting only. The number of seeds is not one: more seeds are more runs of the same setting."""
    fields = dataclasses.asdict(args)
    views = {f.name for f in dataclasses.fields(MeshOptions) + dataclasses.fields(TrackerOptions)}
    views |= {"variants", "out_dir", "variants_file", "import_modules", "seeds", "dry_run"}
    if not fields.get("eval_tasks"):  # no lm-eval task: its options change nothing the runs write
        views |= {f.name for f in dataclasses.fields(EvalOptions)}
    kept = {
        name: value
        for name, value in fields.items()
        if name not in views and not (name in _OPTIONAL_INPUTS and value == _OPTIONAL_INPUTS[name])
    }
    return json.loads(json.dumps(kept, default=str))  # as ablation.json reads back: paths as text, lists
