"""Config validation: each check raises ``ValueError`` naming the owner, the field, the value given and what is
allowed (``RouterConfig.top_k=5 is invalid; allowed: 1..num_experts=4``); and the kinds a config field declares."""

import dataclasses
from dataclasses import field

# The kind of a config field, declared where the field is defined (see ModelConfig). A field without
# a kind is architecture: it changes the parameters or the function they compute, so the checkpoint.
EXECUTION = "execution"  # how the same function is computed: every value gives the same numbers
OBJECTIVE = "objective"  # what training minimises: not part of the model's function or parameters


def execution(default: object) -> dataclasses.Field:
    """A config field with this default that only says how the model is executed."""
    return field(default=default, metadata={"kind": EXECUTION})


def objective(*, default_factory) -> dataclasses.Field:
    """A config field (with this default factory) that is part of the training objective."""
    return field(default_factory=default_factory, metadata={"kind": OBJECTIVE})


def _check(condition: bool, owner: str, name: str, value: object, allowed: str) -> None:
    if not condition:
        raise ValueError(f"{owner}.{name}={value!r} is invalid; allowed: {allowed}")


def _positive(owner: str, **values: int | float) -> None:
    for name, value in values.items():
        _check(value > 0, owner, name, value, "a positive number")


def _whole(owner: str, name: str, value: object, least: int, note: str = "") -> None:
    """``value`` an integer (not a bool) of at least ``least``; ``note`` follows the allowed range in the message."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= least
    _check(ok, owner, name, value, f"an integer >= {least}{note}")


def _one_of(owner: str, name: str, value: object, allowed: tuple) -> None:
    _check(value in allowed, owner, name, value, " | ".join(map(str, allowed)))


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
