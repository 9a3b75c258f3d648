"""Fluid's `unique_name`: per-key counters that make `fc_0`, `fc_0.tmp_1`, `learning_rate_0`.

The counters are process-global, as in Fluid, so two programs built one after the
other get different names unless each is built under its own `guard()`; building the
same script in a fresh process always gives the same names.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class UniqueNameGenerator:
    """`gen("fc")` → `fc_0`, `fc_1`, ... (one counter per key)."""

    def __init__(self, prefix: str = "") -> None:
        self.ids: dict[str, int] = {}
        self.prefix = prefix

    def __call__(self, key: str) -> str:
        count = self.ids.get(key, 0)
        self.ids[key] = count + 1
        return f"{self.prefix}{key}_{count}"


generator = UniqueNameGenerator()


def generate(key: str) -> str:
    return generator(key)


def generate_with_ignorable_key(key: str) -> str:
    """Fluid 1.8 names temporaries with this; in static graphs it is `generate`."""
    return generator(key)


def switch(new_generator: UniqueNameGenerator | None = None) -> UniqueNameGenerator:
    """Install `new_generator` (a fresh one by default) and return the old one."""
    global generator
    old = generator
    generator = new_generator if new_generator is not None else UniqueNameGenerator()
    return old


@contextmanager
def guard(new_generator: UniqueNameGenerator | str | None = None) -> Iterator[None]:
    """Build under fresh counters (or a prefix), restoring the old ones afterwards."""
    if isinstance(new_generator, str):
        new_generator = UniqueNameGenerator(new_generator)
    old = switch(new_generator)
    try:
        yield
    finally:
        switch(old)
