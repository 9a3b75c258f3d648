"""Dispatchers: which pserver each var block lives on.

A dispatcher is built with the endpoint list and maps a list of `VarBlock`s (each with
`.name`, `.origin`, `.index`, `.shape`, `.numel`) to one endpoint per block. The
transpiler calls `reset()` and then `dispatch()` once with every parameter's blocks in
parameter order; a param block and its grad block always share the endpoint.

Write your own by subclassing `PSDispatcher` and passing the class as `split_method`
(as in Paddle, `config.split_method = MyDispatcher`). The result must depend only on
the blocks and endpoints — never on the process (no `hash()` of strings, no unseeded
randomness) — because every trainer computes it independently.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

from transpiler.errors import TranspileError
from transpiler.plan import VarBlock


class PSDispatcher:
    """Base class: `dispatch(blocks) -> [endpoint, ...]`, one endpoint per block."""

    name = "custom"

    def __init__(self, pserver_endpoints: Sequence[str]) -> None:
        if not pserver_endpoints:
            raise TranspileError("a dispatcher needs at least one pserver endpoint")
        self._eps = list(pserver_endpoints)
        self._step = 0

    @property
    def eps(self) -> list[str]:
        return list(self._eps)

    def reset(self) -> None:
        self._step = 0

    def dispatch(self, varlist: Sequence[VarBlock]) -> list[str]:
        raise NotImplementedError


class RoundRobin(PSDispatcher):
    """Blocks go to the endpoints in turn, in order (Paddle's default)."""

    name = "round_robin"

    def dispatch(self, varlist: Sequence[VarBlock]) -> list[str]:
        eplist = []
        for _ in varlist:
            eplist.append(self._eps[self._step])
            self._step = (self._step + 1) % len(self._eps)
        return eplist


class HashName(PSDispatcher):
    """A block goes to `crc32(block name) % #pservers`.

    Paddle's `HashName` (ps_dispatcher.py) calls `var.name()` on a str, a TypeError, and, were
    that fixed, would use Python's `hash()`, which differs per process under hash
    randomisation, so trainers would disagree on placement. CRC-32 of the UTF-8 name is
    stable everywhere.
    """

    name = "hash_name"

    def dispatch(self, varlist: Sequence[VarBlock]) -> list[str]:
        return [self._eps[zlib.crc32(var.name.encode("utf-8")) % len(self._eps)] for var in varlist]


class Balanced(PSDispatcher):
    """Greedy balance by size: the largest blocks first, each to the least-loaded endpoint
    (ties to the earlier endpoint; equal blocks keep their order). Better than RoundRobin
    when a few large vars dominate."""

    name = "balanced"

    def dispatch(self, varlist: Sequence[VarBlock]) -> list[str]:
        load = [0] * len(self._eps)
        chosen: list[str | None] = [None] * len(varlist)
        order = sorted(range(len(varlist)), key=lambda i: -varlist[i].numel)
        for i in order:
            target = min(range(len(self._eps)), key=lambda e: (load[e], e))
            load[target] += varlist[i].numel
            chosen[i] = self._eps[target]
        return [ep for ep in chosen if ep is not None]


DISPATCHERS: dict[str, type[PSDispatcher]] = {
    "round_robin": RoundRobin,
    "hash_name": HashName,
    "balanced": Balanced,
}
_ALIASES = {"roundrobin": "round_robin", "hashname": "hash_name", "hash": "hash_name"}


def resolve_dispatcher(split_method: str | type[PSDispatcher] | None) -> type[PSDispatcher]:
    """A dispatcher class from a class, a name (`round_robin`, `RoundRobin`, `hash_name`,
    `balanced`) or None (RoundRobin)."""
    if split_method is None:
        return RoundRobin
    if isinstance(split_method, type) and issubclass(split_method, PSDispatcher):
        return split_method
    if isinstance(split_method, str):
        key = split_method.strip().lower().replace("-", "_")
        key = _ALIASES.get(key, key)
        if key in DISPATCHERS:
            return DISPATCHERS[key]
        raise TranspileError(f"unknown split method {split_method!r} (known: {', '.join(DISPATCHERS)})")
    raise TranspileError(f"split_method must be a PSDispatcher subclass or a name, got {split_method!r}")


def dispatcher_name(cls: type[PSDispatcher]) -> str:
    return cls.name if cls.name != "custom" else f"{cls.__module__}.{cls.__qualname__}"
