"""Keep freed memory in the process: glibc's malloc tuned for a step's MB-sized buffers.

A pserver and a trainer allocate and free the same few MB every step: the received
message, the decoded grads' sum, the reply with the param blocks, gRPC's slices. glibc
gives memory back to the kernel when a thread's heap has more than its trim threshold free
at the top (2× the mmap threshold, which starts at 128 kB and only grows to the largest
chunk freed so far), so each step's buffers came back as fresh pages: a page fault and a
zeroed page per 4 kB (on the MLP's pserver, about 15% of its CPU in the kernel's fault and
unmap paths, by `perf`). With the mmap threshold at 64 MB and the trim threshold at
128 MB the pages stay mapped and are reused: `benchmarks/vs_paddle18.py`, the MLP at batch
64, 2 × 2 sync, went from 47–57 to 65–74 steps/s and from 30–35 to 24–27 CPU ms/step (the
pservers' share 12–15 → 8–9 ms); the embedding from 114–164 to 165–208 steps/s.

Big params (issue 30) needed more: a 256 MB weight's blocks (128 MB per pserver) were over
that 64 MB mmap threshold, and a thread's own malloc arena cannot hold a chunk bigger than
its 64 MB heaps at all, so every such buffer was mapped fresh and zeroed every step (45–50%
of all CPU in page faults). So the mmap threshold is 2047 MB (`ops.heap.MMAP_THRESHOLD`), the
trim threshold 2 GB, and a process of a program with a param of `BIG_PARAM` bytes or more
uses ONE arena (`bound_arenas`, `arenas_for`; `Session` applies it before the process starts
a thread), the main one, whose heap grows with `brk` to any size: x[8, 8192] -> fc 8192 ->
fc 10, 2 × 2 sync, went from 3.8 to 1.3–1.5 CPU s/step (Fluid 1.8.5: 1.0)
(`benchmarks/vs_paddle18.py`, `wide256`).

The threshold compares a malloc chunk, the size asked for plus a 16-byte header, so it
must sit clearly above the biggest buffer to reuse: at 1 GB exactly, a 1 GB weight's grad
(16384 × 16384 float32, exactly 1 << 30 bytes) was still mapped fresh each step (the
trainer's resident memory fell by 1 GB and came back, 512 huge-page faults a step, each
zeroing 2 MB), 0.57–1.36 CPU s a trainer per step. With 2047 MB, `wide1g` went from 1.40
to 0.71 core-ms per MB moved (medians on a loaded machine, run R in `benchmarks/RESULTS.md`).
2047 MB is the largest whole MB mallopt's int takes; glibc 2.36 accepts it (checked with a C program: `mallopt` returned 1
and a 1 GB malloc/free loop faulted only its first time), but older glibc (2.26's source,
for one) refuses any mmap threshold above 32 MB; there the runtime sets that
(`CAPPED_MMAP_THRESHOLD`) instead of leaving malloc untuned. A single buffer of 2 GB or more
is still mapped fresh every step, as is a heap top of 2 GB or more freed at once (trimmed).

The cost: a process's resident memory stays near its peak instead of shrinking between
steps (at most the trim threshold above what it uses; the peak itself is unchanged). So
`keep_freed_memory` first gives back what the heap holds free when it is called
(`malloc_trim`): a pserver calls it once its startup program ran, after the imports, the
transpile and the params' initialisation freed their temporaries, which would otherwise
stay mapped in the peak (1.6 MB of the 64 MB pserver's, docs/runtime.md "Where a peak goes"). `mallopt` applies it from
inside the process at any time, so it holds wherever the runtime runs (`launch`, Ray
actors, `serve`, a script started by hand): `RpcClient` and `PServer` call `keep_freed_memory`.
It does nothing where the user tuned malloc themselves (`MALLOC_MMAP_THRESHOLD_`,
`MALLOC_TRIM_THRESHOLD_`, `MALLOC_TOP_PAD_`, or `glibc.malloc.*` in `GLIBC_TUNABLES`), with
`PSTRANSPILE_MALLOC=default` (glibc's own behaviour), or off glibc.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from ops.heap import CAPPED_MMAP_THRESHOLD, MMAP_THRESHOLD, TRIM_THRESHOLD
from ops.rpc.env_choice import EnvChoiceError, env_choice

MALLOC_ENV = "PSTRANSPILE_MALLOC"
CHOICES = ("keep", "default")
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # mallopt's parameter numbers (malloc.h)
PSERVER_ARENAS = 2  # malloc arenas a pserver process uses (`bound_arenas`)
BIG_ARENAS = 1  # ... in a process of a program with a big param: the main one, whose heap has no size cap
BIG_PARAM = 32 << 20  # bytes: a param this big makes its program's processes use `BIG_ARENAS`
USER_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX")

_lock = threading.Lock()
_applied: bool | None = None  # None: not asked yet in this process
_arenas: bool | None = None
mmap_threshold: int | None = None  # the mmap threshold `keep_freed_memory` set, if any


class MallocChoiceError(EnvChoiceError):
    """`PSTRANSPILE_MALLOC` names no choice."""


def malloc_choice(environ: Mapping[str, str] | None = None) -> str:
    """`keep` (the default) or `default`; `MallocChoiceError` for anything else."""
    return env_choice(environ, MALLOC_ENV, CHOICES, MallocChoiceError)


def user_tuned(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment already tunes glibc's malloc (theirs wins)."""
    environ = os.environ if environ is None else environ
    return any(k in environ for k in USER_MALLOC_ENV) or "glibc.malloc." in environ.get("GLIBC_TUNABLES", "")


def keep_freed_memory(environ: Mapping[str, str] | None = None) -> bool:
    """Tune this process's malloc (see the module docstring), once; whether it is tuned.
    Raises `MallocChoiceError` for a bad `PSTRANSPILE_MALLOC`."""
    global _applied
    choice = malloc_choice(environ)
    with _lock:
        if _applied is None:
            _applied = choice == "keep" and not user_tuned(environ) and _mallopt()
            if _applied:
                _trim()
        return _applied


def arenas_for(largest_param: int) -> int | None:
    """The arenas a process of a program whose largest param is `largest_param` bytes should
    use: `BIG_ARENAS` from `BIG_PARAM` up, else None (the process's own default: a
    pserver's `PSERVER_ARENAS`, a trainer's glibc default). One arena costs small messages
    some steps/s where gRPC's threads allocate at once (measured on the MLP and the
    embedding of `benchmarks/vs_paddle18.py`), so only big params pay it."""
    return BIG_ARENAS if largest_param >= BIG_PARAM else None


def bound_arenas(environ: Mapping[str, str] | None = None, count: int = PSERVER_ARENAS) -> bool:
    """At most `count` malloc arenas in this process, once; whether it is bound. Called
    before the process starts its RPC threads (an arena, once a thread's, stays its). A
    pserver answers on ~50 gRPC threads, and glibc gives threads arenas of their own (up to
    8 per core), each keeping the pages it freed: under a stream of requests of every size
    (the RPC fuzz, tests/test_rpc_fuzz.py) the pserver's resident memory crept on, 279 → 346
    MB over 4 × 1500 messages, where with 2 arenas it stays at 155–162 MB. And a thread's
    own arena lives in heaps of at most 64 MB: a bigger chunk is always mapped fresh (and
    zeroed) and unmapped when freed, every step for a big param's grad or reply; the one
    main arena takes any size from its heap. Same opt-outs as `keep_freed_memory`
    (`MALLOC_ARENA_MAX` set by the user included)."""
    global _arenas
    choice = malloc_choice(environ)
    with _lock:
        if _arenas is None:
            _arenas = choice == "keep" and not user_tuned(environ) and _mallopt_one(_M_ARENA_MAX, count)
        return _arenas


@contextmanager
def fresh_pages_from(nbytes: int) -> Iterator[bool]:
    """Within: a buffer of `nbytes` or more is mapped fresh and unmapped when freed, as one
    over the kept threshold is (`pstranspile calibrate` prices those pages on a table that
    fits in memory; over 2047 MB it would not). Yields whether that holds: only where
    `keep_freed_memory` tuned this process; the kept threshold is back after."""
    with _lock:
        kept = mmap_threshold if _applied else None
        lowered = kept is not None and nbytes < kept and _mallopt_one(_M_MMAP_THRESHOLD, nbytes)
        if lowered:  # the heap's free top would serve such a buffer before any mmap: give it back
            ctypes.CDLL(None).malloc_trim(0)
    try:
        yield lowered
    finally:
        if lowered:
            with _lock:
                _mallopt_one(_M_MMAP_THRESHOLD, kept)


def _trim() -> None:
    """Give the kernel the pages the heap holds free now, at the top and between chunks in
    use: what loading modules, transpiling and a pserver's startup program freed before
    the process was tuned. Kept mapped from here on, they would only count in its peak
    (the steps reuse what the steps free). Once per process: a walk of the free chunks."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _mallopt_one(param: int, value: int) -> bool:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(param, value) == 1


def _mallopt() -> bool:
    # the mmap threshold first, as setting either one stops glibc's own adjustment of both
    # (a trim threshold alone left the mmap threshold at 128 kB: every MB buffer mapped and
    # unmapped, measured 1.5x the CPU). An older glibc that refuses the big one still takes
    # `CAPPED_MMAP_THRESHOLD` (its largest), rather than nothing tuned at all.
    global mmap_threshold
    for threshold in (MMAP_THRESHOLD, CAPPED_MMAP_THRESHOLD):
        if _mallopt_one(_M_MMAP_THRESHOLD, threshold):
            mmap_threshold = threshold
            return _mallopt_one(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    return False


__all__ = ["BIG_ARENAS", "BIG_PARAM", "CHOICES", "MALLOC_ENV", "PSERVER_ARENAS", "arenas_for", "MallocChoiceError", "bound_arenas", "fresh_pages_from", "keep_freed_memory", "malloc_choice", "user_tuned"]
