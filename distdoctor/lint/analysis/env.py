"""The environment of a trace step: an immutable-by-convention map from names to `Value`s whose
update costs little however many names it holds.

Every step keeps the environment before it, and every binding makes a new one. A plain dict copied
on each binding costs the size of the environment each time: on a module with thousands of globals
(torch/_inductor/lowering.py) that was 29 million copied entries and most of a gigabyte. Here an
environment is a large shared `base`, never changed once shared, and a small `local` dict of the
bindings made since; a binding copies only `local`, and when `local` grows past `FLATTEN` entries
the two are merged into a new base. Lookups read `local` then `base`. Iteration order is that of
the dict the old code built (`{**env, key: value}`), so every reader sees the same thing.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

FLATTEN = 128

_MISSING = object()


class Env(Mapping):
    __slots__ = ("base", "local")

    def __init__(self, base: dict[Any, Any] | None = None, local: dict[Any, Any] | None = None) -> None:
        self.base = {} if base is None else base
        self.local = {} if local is None else local

    # reading ---------------------------------------------------------------------------------
    def get(self, key: Any, default: Any = None) -> Any:
        value = self.local.get(key, _MISSING)
        if value is _MISSING:
            return self.base.get(key, default)
        return value

    def __getitem__(self, key: Any) -> Any:
        value = self.local.get(key, _MISSING)
        if value is _MISSING:
            return self.base[key]
        return value

    def __contains__(self, key: object) -> bool:
        return key in self.local or key in self.base

    # Whole-map reads build the merged dict in C: far faster than a loop here, and not kept, so
    # the memory stays shared.
    def _flat(self) -> dict[Any, Any]:
        return {**self.base, **self.local} if self.local else self.base

    def __iter__(self) -> Iterator[Any]:
        return iter(self._flat())

    def __len__(self) -> int:
        return len(self._flat())

    def keys(self):  # type: ignore[override]
        return self._flat().keys()

    def values(self):  # type: ignore[override]
        return self._flat().values()

    def items(self):  # type: ignore[override]
        return self._flat().items()

    # changing --------------------------------------------------------------------------------
    def bind(self, key: Any, value: Any) -> Env:
        """A new environment with `key` bound to `value`; this one is unchanged."""
        local = {**self.local, key: value}
        if len(local) > FLATTEN:
            return Env({**self.base, **local}, {})
        return Env(self.base, local)

    def __setitem__(self, key: Any, value: Any) -> None:
        # In place, as the trace builder does for a nested `def`: seen by every step that holds
        # this very environment, as with the dict it replaces.
        self.local[key] = value

    def copy(self) -> Env:
        return Env(self.base, dict(self.local))


def merge(first: Mapping[Any, Any], second: Mapping[Any, Any], choose, one_sided=lambda value: True) -> Env:
    """The environment after an if/else, `choose(first_value, second_value)` where both branches
    bound a key to different values; a key only one branch bound, and unbound before, keeps its
    value where `one_sided(value)` allows it and is left unbound otherwise. Only the keys either
    branch bound since their common base can differ, so when the branches share one only those
    are looked at."""
    if isinstance(first, Env) and isinstance(second, Env) and first.base is second.base:
        merged = dict(second.local)
        for key, value in first.local.items():
            other = second.get(key)
            if other is None and not one_sided(value):
                merged.pop(key, None)
                continue
            merged[key] = value if other is None or other is value else choose(value, other)
        for key, other in second.local.items():
            if key in first.local:
                continue
            value = first.base.get(key)
            if value is None and not one_sided(other):
                del merged[key]
            elif value is not None and value is not other:
                merged[key] = choose(value, other)
        return Env(first.base, merged)
    merged_all = dict(second.items())
    for key, value in first.items():
        other = second.get(key)
        merged_all[key] = value if other is None or other is value else choose(value, other)
    return Env(merged_all, {})
