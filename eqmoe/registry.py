"""Named registries of variants: router strategies, dispatch backends, load-balance forms, attention
backends, norm placements.

Each variant family is one :class:`Registry`, defined next to the code that implements its members. The
config's allowed values, its validation and the code that runs (and, for dispatch backends, the
planner's estimate) all come from it, so a name is either registered everywhere or refused everywhere:
an unregistered name is a ``ValueError`` naming the allowed ones, never a silent fallback.

```python
STRATEGIES: Registry[Strategy] = Registry("router strategy")
STRATEGIES.register("mine", Strategy(my_route))      # or, on a definition: @STRATEGIES.register("mine")
STRATEGIES.get("mine")
```
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar, overload

T = TypeVar("T")


class Registry(Generic[T]):
    """A mapping from names to items of one kind, in registration order.

    **Arguments:**

    - `kind`: what the items are, for error messages (``"router strategy"``).
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    @overload
    def register(self, name: str) -> Callable[[T], T]: ...

    @overload
    def register(self, name: str, item: T) -> T: ...

    def register(self, name: str, item=None):
        """Register ``item`` under ``name`` and return it; without ``item``, a decorator that does so.

        **Arguments:**

        - `name`: the name configs use; registering a name twice is a ``ValueError``.
        - `item`: what the name stands for.

        **Returns:**

        ``item`` (so that the decorator leaves the decorated definition unchanged).
        """
        if item is None:
            return lambda item: self.register(name, item)
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} needs a non-empty string name, got {name!r}")
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._items[name] = item
        return item

    def unregister(self, name: str) -> T:
        """Remove ``name`` and return its item (a ``ValueError`` naming the allowed names if absent)."""
        item = self.get(name)
        del self._items[name]
        return item

    @contextlib.contextmanager
    def registered(self, name: str, item: T) -> Iterator[T]:
        """``with registry.registered(name, item):`` registers ``item`` for the block only (tests)."""
        self.register(name, item)
        try:
            yield item
        finally:
            self._items.pop(name, None)

    def get(self, name: str) -> T:
        """The item registered as ``name``.

        **Raises:**

        ``ValueError`` naming the registry's kind and the allowed names when ``name`` is not registered.
        """
        try:
            return self._items[name]
        except (KeyError, TypeError):
            raise ValueError(f"unknown {self.kind} {name!r}; allowed: {' | '.join(self._items)}") from None

    def names(self) -> tuple[str, ...]:
        """Every registered name, in registration order."""
        return tuple(self._items)

    def items(self) -> tuple[tuple[str, T], ...]:
        """Every ``(name, item)`` pair, in registration order."""
        return tuple(self._items.items())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {' | '.join(self._items)})"

    def check(self, owner: str, field: str, value: object, *, extra: tuple[str, ...] = ()) -> None:
        """Validate a config field whose value must be a registered name.

        **Arguments:**

        - `owner`, `field`: where the value sits, for the message (``"RouterConfig"``, ``"strategy"``).
        - `value`: the configured value.
        - `extra`: names accepted besides the registered ones (resolution rules such as ``"auto"``),
          listed after them.

        **Raises:**

        ``ValueError``: ``"RouterConfig.strategy='foo' is invalid; allowed: a | b | c"`` (the format of
        every config validation error).
        """
        allowed = (*self._items, *extra)
        if not (isinstance(value, str) and value in allowed):
            raise ValueError(f"{owner}.{field}={value!r} is invalid; allowed: {' | '.join(allowed)}")
