"""Config validation: each check raises ``ValueError`` naming the owner, the field, the value given and what is
allowed (``RouterConfig.top_k=5 is invalid; allowed: 1..num_experts=4``)."""


def _check(condition: bool, owner: str, name: str, value: object, allowed: str) -> None:
    if not condition:
        raise ValueError(f"{owner}.{name}={value!r} is invalid; allowed: {allowed}")


def _positive(owner: str, **values: int | float) -> None:
    for name, value in values.items():
        _check(value > 0, owner, name, value, "a positive number")


def _one_of(owner: str, name: str, value: object, allowed: tuple) -> None:
    _check(value in allowed, owner, name, value, " | ".join(map(str, allowed)))


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
