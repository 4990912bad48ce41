"""What every experiment's command line does around its run: an expected failure is one line on stderr and exit
code 2 (anything else, a bug, keeps its traceback); ``--resume`` replays the arguments the run stored; a tokenizer
that does not fit the model is refused."""

import dataclasses
import errno
import json
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

Args = TypeVar("Args")
Result = TypeVar("Result")


class UsageError(Exception):
    """A failure the user can fix (a bad flag combination, a missing input): reported as one line."""


# FloatingPointError: training stopped on a non-finite loss, with the step and term named.
EXPECTED = (UsageError, ValueError, FileNotFoundError, FileExistsError, PermissionError, FloatingPointError)
DISK_ERRNOS = (errno.ENOSPC, errno.EROFS)  # a full or read-only disk under the output folder


def is_expected_failure(error: BaseException) -> bool:
    """Bad input or an unusable output location, as opposed to a bug (which keeps its traceback)."""
    return isinstance(error, EXPECTED) or (isinstance(error, OSError) and error.errno in DISK_ERRNOS)


def guarded(name: str, run: Callable[[Args], Result], args: Args) -> Result | None:
    """``run(args)``; on an expected failure print ``name: message`` (on one line) and return ``None``."""
    try:
        return run(args)
    except Exception as error:
        if not is_expected_failure(error):
            raise
        print(f"{name}: {' '.join(str(error).split())}", file=sys.stderr)
        return None


def _as_json(value):
    return json.loads(json.dumps(value, default=str))


def _flat(tree: dict, prefix: str = "") -> dict[str, object]:
    flat = {}
    for name, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = value
    return flat


def _changeable(cls, dotted: str) -> bool:
    """Whether the option at ``dotted`` (e.g. ``model.dtype``) may change on ``--resume``: its group lists it in
    ``changeable_on_resume``."""
    *groups, name = dotted.split(".")
    for group in groups:
        cls = typing.get_type_hints(cls)[group]
    return name in getattr(cls, "changeable_on_resume", ())


def _from_json(hint, value):
    """``value`` (as JSON holds it) as the type ``hint`` names: dataclasses, paths and tuples rebuilt."""
    if value is None:
        return None
    if dataclasses.is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        known = {f.name for f in dataclasses.fields(hint) if f.init}
        return hint(**{name: _from_json(hints[name], v) for name, v in value.items() if name in known})
    origin, members = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        kinds = [m for m in members if m is not type(None)]
        return _from_json(kinds[0], value) if len(kinds) == 1 or Path in kinds else value
    if origin is tuple:
        return tuple(_from_json(members[0], v) for v in value)
    return Path(value) if hint is Path else value


def replay_stored_arguments(args: Args, defaults: Args) -> Args:
    """With ``--resume``, the arguments the run in ``--out-dir`` recorded, changed by the flags given again
    (a flag at its default value keeps the stored one). A flag whose group does not list it in
    ``changeable_on_resume`` and that differs from the stored run is a ``UsageError`` naming every such flag."""
    from eqmoe.train import run_folder

    if not args.run.resume:
        return args
    stored = run_folder.read_arguments(args.run.out_dir)
    if stored is None:  # a run from before arguments were recorded: the flags as given
        return args
    given = _flat(_as_json(dataclasses.asdict(args)))
    default = _flat(_as_json(dataclasses.asdict(defaults)))
    before = _flat(stored)
    always_given = {"run.out_dir", "run.resume", "run.resume_from", "run.overwrite"}
    merged, refused = dict(before), []
    for key, value in given.items():
        if key in always_given or key not in before:
            merged[key] = value
        elif value != default.get(key) and value != before[key]:
            if _changeable(type(args), key):
                merged[key] = value
            else:
                flag = "--" + key.rsplit(".", 1)[-1].replace("_", "-")
                refused.append(f"{flag} {value} (the run's: {before[key]})")
    if refused:
        raise UsageError(
            f"--resume: {args.run.out_dir} was started with other settings that may not change: {'; '.join(refused)}"
            " (start a new run in another --out-dir)"
        )
    nested: dict = {}
    for key, value in merged.items():
        *groups, name = key.split(".")
        node = nested
        for group in groups:
            node = node.setdefault(group, {})
        node[name] = value
    return _from_json(type(args), nested)


def check_vocabulary(tokenizer_ids: int, model_ids: int, *, from_checkpoint: bool) -> None:
    """Refuse a tokenizer that does not fit the model: more ids than the model's vocabulary, or, for a trained
    model, so many fewer that it cannot be the one it learnt (vocabularies are padded by at most ~1%: Qwen3
    151,669 ids in 151,936 rows, DeepSeek-V3 128,815 in 129,280)."""
    unused = model_ids - tokenizer_ids
    if unused < 0:
        raise UsageError(f"the tokenizer has {tokenizer_ids:,} ids but the model's vocabulary is {model_ids:,}")
    if from_checkpoint and unused > max(128, model_ids // 100):
        raise UsageError(
            f"the tokenizer has {tokenizer_ids:,} ids but the model's vocabulary is {model_ids:,}: not the "
            "tokenizer the model was trained with (pass its own with --tokenizer, or leave it out when the model's "
            "folder holds it)"
        )
