"""`gc_paused()`: the cyclic garbage collector off while a burst of long-lived objects is built.

Loading a program and transpiling one allocate hundreds of thousands of small IR objects
that all stay alive at the end, so every collection in between rescans them for nothing
(about a third of the time of a large transpile). Paused, they are scanned once, by the
first collection after the burst.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
