"""Resuming a run: the newest readable checkpoint restored (a damaged one set aside in one line), the backends
it recorded, the base model it was trained on checked."""

import sys
from pathlib import Path

import equinox as eqx

from eqmoe import parallel
from eqmoe.checkpoints.base import BaseModel
from eqmoe.checkpoints.model_checkpoint import restore
from eqmoe.checkpoints.orbax import Checkpointer, UnreadableCheckpoint
from eqmoe.checkpoints.run_metadata import RunMetadata
from eqmoe.config_io import architecture_differences, format_differences
from eqmoe.train import run_folder
from eqmoe.train.state import abstract_state, hold_frozen


def _check_same_base(stored: BaseModel | None, now: BaseModel | None, out_dir: Path) -> None:
    """A resumed run must start from the base model its checkpoints were trained on."""
    if stored is None or (now is not None and now.sha256 == stored.sha256):
        return
    if now is None:
        raise ValueError(
            f"--resume: the checkpoint in {out_dir} was trained on the base model {stored.path}; start from it"
        )
    raise ValueError(
        f"--resume: the checkpoint in {out_dir} was trained on the base model {stored.path} "
        f"(content sha256 {stored.sha256[:16]}), not on {now.path} ({now.sha256[:16]})"
    )


def _resume_steps(checkpointer: Checkpointer, resume_from: int | None) -> list[int]:
    """The steps to try, newest first: every finished step, or ``--resume-from`` and older ones (newer steps are
    set aside, since a run continued from an older step saves those step numbers again)."""
    steps = checkpointer.all_steps()
    if resume_from is None:
        return steps[::-1]
    if resume_from not in steps:
        raise FileNotFoundError(f"--resume-from {resume_from}: no such step in {checkpointer.directory}")
    for step in steps:
        if step > resume_from:
            moved = run_folder.set_aside(checkpointer.directory, step)
            print(f"--resume-from {resume_from}: step {step} moved to {moved}", file=sys.stderr)
    return [step for step in steps[::-1] if step <= resume_from]


def resumed_state(checkpointer, options, model, optimizer, key, metadata, parallelism, trained):
    """``(state, step)`` restored from the newest readable checkpoint with ``--resume``; ``(None, None)`` to start.

    A step that cannot be read whole (a file truncated by a full disk or a cut copy) is reported in one line, set
    aside and the next older step is tried. Only the architecture must match: the execution and objective fields
    of the new config apply from here on (the restore target is built from the new model, so the restored model
    carries its config, and the next checkpoints store it)."""
    out_dir, config = options.out_dir, model.config
    steps = _resume_steps(checkpointer, options.resume_from) if options.resume else []
    if options.resume and not steps:
        print(f"--resume: no checkpoint in {checkpointer.directory}; starting from step 0", file=sys.stderr)
    for step in steps:
        try:
            stored = RunMetadata.from_json(checkpointer.metadata(step), str(checkpointer.directory))
        except UnreadableCheckpoint as error:
            _set_aside_damaged(checkpointer, step, error)
            continue
        differences = architecture_differences(stored.config, config)
        if differences:
            raise ValueError(
                f"--resume: the checkpoint in {out_dir} has a different architecture: "
                + format_differences(differences, "checkpoint", "now")
            )
        _check_same_base(stored.base, metadata.base, out_dir)
        target = abstract_state(lambda: model, optimizer, key=key)
        if parallelism is not None:
            target = parallel.abstract_sharded(target, parallelism)
        # Leaves a checkpoint of a run with a base folder leaves out (frozen weights) come from the base.
        fill = eqx.tree_at(lambda s: s.model, target, parallel.shard(model, parallelism))
        try:
            state = restore(checkpointer, step, target, fill=fill)
        except UnreadableCheckpoint as error:
            _set_aside_damaged(checkpointer, step, error)
            continue
        state = eqx.tree_at(lambda s: s.model, state, hold_frozen(state.model, trained))
        assert state.model.config == config, "the restored model must carry the new config"
        print(f"resumed from step {step}", file=sys.stderr)
        return state, step
    if steps:
        raise ValueError(f"--resume: no checkpoint in {checkpointer.directory} can be read (all set aside)")
    return None, None


def recorded_backends(checkpointer: Checkpointer) -> dict[str, str] | None:
    """The backends the run's newest readable checkpoint recorded (every checkpoint of a run records the same)."""
    for step in sorted(checkpointer.all_steps(), reverse=True):
        try:
            return RunMetadata.from_json(checkpointer.metadata(step), str(checkpointer.directory)).backends
        except (UnreadableCheckpoint, ValueError):
            continue
    return None


def _set_aside_damaged(checkpointer: Checkpointer, step: int, error: UnreadableCheckpoint) -> None:
    moved = run_folder.set_aside(checkpointer.directory, step)
    array = f" (array {error.array} cannot be read whole)" if error.array else ""
    message = f"--resume: checkpoint step {step} is damaged{array}; moved to {moved}; trying the step before"
    print(message, file=sys.stderr)
