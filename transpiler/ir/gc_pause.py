"""`gc_paused()`: the cyclic garbage collector off while a burst of long-lived objects is built.

Loading a program and transpiling one allocate hundreds of thousands of small IR objects
that all stay alive at the end, so every collection in between rescans them for nothing
(about a third of the time of a large transpile).

`gc_paused(promote=True)` also spares them the scan after the burst: the first collection
after it would go through all of them (3 ms of a 25 ms ResNet-50 transpile) only to find
them alive, then again when they move on to the middle generation. They go straight to the
oldest generation instead, as `gc.freeze()` + `gc.unfreeze()` do in O(1), to be seen by
the next full collection only. That is sound because the IR holds no reference cycle
(`transpiler/ir/program.py`): a program dropped later is freed by its reference counts, so
no garbage waits in the oldest generation for a full collection. The cost to the rest of
the process: its own young objects are promoted too, so a garbage cycle it made just before
is found by the next full collection rather than the next young one.

Left as they are: a process that froze objects itself (unfreezing would thaw them, and a
process that froze them before a fork wants them frozen), a free-threaded build (there,
freezing walks the whole heap), and a burst that raised (its objects are mostly garbage).
"""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Iterator

# A free-threaded build's ABI flags hold "t" (PEP 703), as its `Py_GIL_DISABLED` config var
# says; read here rather than through `sysconfig`, whose build-data module every process
# would then keep resident (0.6 MB: docs/runtime.md "Where a peak goes").
_PROMOTION_IS_CHEAP = "t" not in getattr(sys, "abiflags", "")


@contextlib.contextmanager
def gc_paused(*, promote: bool = False) -> Iterator[None]:
    """The collector off inside; with `promote`, what is alive at a normal exit goes to
    the oldest generation unscanned (see the module docstring)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
        if was_enabled and promote and _PROMOTION_IS_CHEAP and gc.get_freeze_count() == 0:
            gc.freeze()
            gc.unfreeze()
    finally:
        if was_enabled:
            gc.enable()
