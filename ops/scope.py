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

Pending values (a trainer's params still arriving while the next step starts,
`ops.rpc.kernels`, `PSTRANSPILE_EARLY_RECV`): `expect(name, pending)` marks a name whose
value a background task is still writing. Every read of it (`find_var`, `local_var`)
and every write (`set_var`, `exchange`, `var`, `erase`) first waits, outside the lock,
for `pending.wait(name, read)` (bounded: it raises when the wait is too long, naming the
var), so nothing reads a half-written array or overwrites what is being received.
`settle` binds the value and ends the wait; `fail` drops the half-written value and
keeps the name pending with its error, which every later read raises (a write replaces
it). A scope without pending names pays one dict test per lookup.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, Protocol

_MISSING: Any = object()


class Pending(Protocol):
    """What a scope waits on for a pending name (`ops.rpc.kernels`' `_Arrival`)."""

    def wait(self, name: str, read: bool) -> None:
        """Return once the task let go of `name` (bounded). A read raises the task's
        failure for `name` (naming it); a write returns then too."""


class Scope:
    """Names → values, with a parent scope for lookups."""

    __slots__ = ("parent", "_vars", "_lock", "_pending", "__weakref__")

    def __init__(self, parent: Scope | None = None) -> None:
        self.parent = parent
        self._vars: dict[str, Any] = {}
        self._lock = threading.RLock()
        self._pending: dict[str, Pending] = {}  # name -> the task still writing it (module docstring)

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
                pending = scope._pending.get(name) if scope._pending else None
            if pending is not None:
                scope._await(name, pending, read=True)
                continue  # this scope again, now settled
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
        if self._pending:
            self._await_name(name, read=True)
        with self._lock:
            return self._vars.get(name, default)

    # -- writes
    def set_var(self, name: str, value: Any) -> None:
        """Bind `name` to `value` in this scope (shadowing any ancestor's)."""
        if self._pending:
            self._await_name(name, read=False)
        with self._lock:
            self._vars[name] = value

    def exchange(self, name: str, value: Any) -> Any:
        """`set_var`, returning the value `name` had in this scope (None if absent): the
        executor recycles the array a new output displaced once nothing else holds it."""
        if self._pending:
            self._await_name(name, read=False)
        with self._lock:
            previous = self._vars.get(name)
            self._vars[name] = value
        return previous

    def var(self, name: str, factory: Any = None) -> Any:
        """Paddle's `Scope::Var`: the value of `name` in this scope, created with
        `factory()` (or None) if absent. Atomic, so two threads get the same object."""
        if self._pending:
            self._await_name(name, read=True)
        with self._lock:
            if name not in self._vars:
                self._vars[name] = factory() if factory is not None else None
            return self._vars[name]

    def erase(self, *names: str) -> None:
        """Drop names from this scope (absent names are ignored)."""
        if self._pending:
            for name in names:
                self._await_name(name, read=False)
        with self._lock:
            for name in names:
                self._vars.pop(name, None)

    # -- pending values (module docstring)
    def expect(self, name: str, pending: Pending) -> None:
        """Mark `name` as being written by `pending`'s task (after any earlier one)."""
        self._await_name(name, read=False)
        with self._lock:
            self._pending[name] = pending

    def settle(self, name: str, pending: Pending, value: Any = _MISSING) -> bool:
        """End `pending`'s hold on `name`, binding `value` when given; False (nothing
        done) when `name` is no longer `pending`'s. The caller then wakes the waiters."""
        with self._lock:
            if self._pending.get(name) is not pending:
                return False
            if value is not _MISSING:
                self._vars[name] = value
            del self._pending[name]
        return True

    def fail(self, name: str, pending: Pending) -> None:
        """`pending` could not finish `name`: drop its (maybe half-written) value; the name
        stays pending, so reads raise `pending`'s error until a write replaces it."""
        with self._lock:
            if self._pending.get(name) is pending:
                self._vars.pop(name, None)

    def pending_names(self) -> list[str]:
        """The names still pending here (failed ones included)."""
        with self._lock:
            return list(self._pending)

    def _await_name(self, name: str, *, read: bool) -> None:
        with self._lock:
            pending = self._pending.get(name)
        if pending is not None:
            self._await(name, pending, read=read)

    def _await(self, name: str, pending: Pending, *, read: bool) -> None:
        """Wait (no lock held) until `pending` lets go of `name`; a read raises its failure,
        a write drops the failed entry and goes on."""
        pending.wait(name, read)
        with self._lock:
            if self._pending.get(name) is pending:
                if read:  # settled without `settle` (cannot happen for a well-behaved task)
                    raise RuntimeError(f"var {name!r}: its pending value ended without a value")
                del self._pending[name]

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
