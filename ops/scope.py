"""`Scope`: where the executor keeps values by var name.

A scope maps names to values (`LoDTensor`, `SelectedRows`, or any object a kernel
keeps: a list of step scopes, an RPC handle) and has an optional parent; lookups
(`find_var`) walk up the parents, writes (`set_var`) go to the scope they are made on.
Sub-blocks run in a child scope made by `new_scope()`.

Thread-safety, for a pserver that answers RPCs from threads while a block runs:
every method is atomic with respect to the others on the same scope (one lock per
scope), so a reader gets either the old or the new value of a name, never a torn
state. Values are replaced, not mutated (see `ops.tensor`), so a value once read stays
consistent while the reader holds it. Nothing orders a reader against a writer: which
of two concurrent steps a reader sees is the caller's business (the pserver's barriers).
A parent does not keep its children, so a child scope dies with its last reference.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

_MISSING: Any = object()


class Scope:
    """Names → values, with a parent scope for lookups."""

    __slots__ = ("parent", "_vars", "_lock", "__weakref__")

    def __init__(self, parent: Scope | None = None) -> None:
        self.parent = parent
        self._vars: dict[str, Any] = {}
        self._lock = threading.RLock()

    def new_scope(self) -> Scope:
        """A child whose lookups fall back to this scope."""
        return Scope(self)

    # -- reads
    def find_var(self, name: str, default: Any = None) -> Any:
        """The value of `name` here or in the nearest ancestor that has it."""
        scope: Scope | None = self
        while scope is not None:
            with scope._lock:
                value = scope._vars.get(name, _MISSING)
            if value is not _MISSING:
                return value
            scope = scope.parent
        return default

    def find_scope(self, name: str) -> Scope | None:
        """The nearest scope (this one or an ancestor) that holds `name`."""
        scope: Scope | None = self
        while scope is not None:
            with scope._lock:
                if name in scope._vars:
                    return scope
            scope = scope.parent
        return None

    def has_var(self, name: str, *, local: bool = False) -> bool:
        if local:
            with self._lock:
                return name in self._vars
        return self.find_scope(name) is not None

    def local_var(self, name: str, default: Any = None) -> Any:
        """The value of `name` in this scope only."""
        with self._lock:
            return self._vars.get(name, default)

    # -- writes
    def set_var(self, name: str, value: Any) -> None:
        """Bind `name` to `value` in this scope (shadowing any ancestor's)."""
        with self._lock:
            self._vars[name] = value

    def exchange(self, name: str, value: Any) -> Any:
        """`set_var`, returning the value `name` had in this scope (None if absent): the
        executor recycles the array a new output displaced once nothing else holds it."""
        with self._lock:
            previous = self._vars.get(name)
            self._vars[name] = value
        return previous

    def var(self, name: str, factory: Any = None) -> Any:
        """Paddle's `Scope::Var`: the value of `name` in this scope, created with
        `factory()` (or None) if absent. Atomic, so two threads get the same object."""
        with self._lock:
            if name not in self._vars:
                self._vars[name] = factory() if factory is not None else None
            return self._vars[name]

    def erase(self, *names: str) -> None:
        """Drop names from this scope (absent names are ignored)."""
        with self._lock:
            for name in names:
                self._vars.pop(name, None)

    # -- listing
    def local_names(self) -> list[str]:
        with self._lock:
            return list(self._vars)

    def __contains__(self, name: str) -> bool:
        return self.has_var(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.local_names())

    def __repr__(self) -> str:
        depth, scope = 0, self.parent
        while scope is not None:
            depth, scope = depth + 1, scope.parent
        return f"Scope(vars={len(self._vars)}, depth={depth})"
