"""`ops.rpc.malloc`: the runtime keeps a step's freed MB buffers mapped (no page fault per
4 kB on the next step), unless the user tuned malloc or chose glibc's default; a bad choice
is a specific error (`launch` and `serve` refuse it: test_rpc_env_choice.py)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from conftest import TESTS
from ops.heap import CAPPED_MMAP_THRESHOLD, MMAP_THRESHOLD, TRIM_THRESHOLD
from ops.rpc.malloc import MALLOC_ENV, MallocChoiceError, malloc_choice, user_tuned

REPO = TESTS.parent
GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def fresh_python(code: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items()
            if k not in (MALLOC_ENV, "GLIBC_TUNABLES") and not k.startswith("MALLOC_")}
    return subprocess.run([sys.executable, "-c", code], env={**base, "PYTHONPATH": str(REPO), **env},
                          capture_output=True, text=True, timeout=60, check=True).stdout.strip()


def test_keep_is_the_default_and_default_is_glibc_s_own():
    assert malloc_choice({}) == "keep" and malloc_choice({MALLOC_ENV: ""}) == "keep"
    assert malloc_choice({MALLOC_ENV: " Default "}) == "default"


def test_a_bad_choice_is_a_specific_error_naming_the_variable():
    with pytest.raises(MallocChoiceError, match=r"PSTRANSPILE_MALLOC='off'.*keep, default"):
        malloc_choice({MALLOC_ENV: "off"})


def test_the_user_s_own_tuning_wins():
    assert not user_tuned({}) and not user_tuned({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"})
    assert user_tuned({"MALLOC_TRIM_THRESHOLD_": "1"}) and user_tuned({"MALLOC_MMAP_THRESHOLD_": "1"})
    assert user_tuned({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})


# Allocates and frees 8 MB in 1 MB buffers, 50 times, in a thread (as gRPC's are) and in the
# main thread; prints the minor page faults of each.
FAULTS = """
import resource, threading
{setup}
def rounds(n):
    for _ in range(n):
        held = [bytearray(1 << 20) for _ in range(8)]
        del held
def measure(out):
    rounds(3)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    rounds(50)
    out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
out = []
thread = threading.Thread(target=measure, args=(out,))
thread.start(); thread.join()
measure(out)
print(*out)
"""


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_kept_memory_is_reused_without_page_faults():
    glibc = list(map(int, fresh_python(FAULTS.format(setup="")).split()))
    kept = list(map(int, fresh_python(FAULTS.format(
        setup="from ops.rpc.malloc import keep_freed_memory; assert keep_freed_memory()")).split()))
    print(f"minor page faults over 50 rounds of 8 x 1 MB (thread, main): glibc's default {glibc}, kept {kept}")
    # glibc's default gives the 8 MB back and faults it in again every round (~2,048 a round)
    assert min(glibc) > 50 * 1000
    assert max(kept) < 1000


APPLIED = "import ops.rpc.malloc as m; from ops.rpc.client import RpcClient; RpcClient(0); print(m._applied)"
SERVER_APPLIES = ("import ops.rpc.malloc as m; from ops.rpc.server import PServer, ServeConfig; from ops.scope import Scope; "
                  "PServer(ServeConfig(endpoint='127.0.0.1:0', fanin=1, sync_mode=False), Scope(), lambda idx: None); "
                  "print(m._applied)")


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_the_rpc_client_and_the_pserver_apply_it_unless_told_not_to():
    assert fresh_python(APPLIED) == "True"
    assert fresh_python(APPLIED, PSTRANSPILE_MALLOC="default") == "False"
    assert fresh_python(APPLIED, MALLOC_TRIM_THRESHOLD_="1048576") == "False"
    assert fresh_python(APPLIED, GLIBC_TUNABLES="glibc.malloc.trim_threshold=1048576") == "False"
    assert fresh_python(SERVER_APPLIES) == "True"
    assert fresh_python(SERVER_APPLIES, PSTRANSPILE_MALLOC="default") == "False"
    assert fresh_python("import ops.rpc.malloc as m; import ops.rpc; print(m._applied)") == "None"  # not on import


# Issue 30's big params: 2 x 96 MB buffers (a 256 MB weight's grad and reply blocks are
# 128 MB), allocated and freed 5 times in a thread (gRPC's) and in the main thread.
BIG_FAULTS = FAULTS.replace("bytearray(1 << 20) for _ in range(8)", "bytearray(96 << 20) for _ in range(2)").replace(
    "rounds(3)", "rounds(2)").replace("rounds(50)", "rounds(5)")


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_buffers_bigger_than_a_thread_arena_s_heap_are_reused_too():
    """A thread's own arena cannot hold a chunk over its 64 MB heaps: glibc maps it fresh
    (zeroed) and unmaps it every time. One arena and the 1 GB mmap threshold reuse it."""
    glibc = list(map(int, fresh_python(BIG_FAULTS.format(setup="")).split()))
    kept = list(map(int, fresh_python(BIG_FAULTS.format(
        setup="from ops.rpc.malloc import BIG_ARENAS, keep_freed_memory, bound_arenas\n"
              "assert keep_freed_memory() and bound_arenas(count=BIG_ARENAS)")
    ).split()))
    print(f"minor page faults over 5 rounds of 2 x 96 MB (thread, main): glibc's default {glibc}, kept {kept}")
    assert min(glibc) > 5 * 2 * 20000  # 24,576 pages per buffer and round
    assert max(kept) < 2000


def test_only_a_program_with_a_big_param_takes_one_arena():
    """One arena costs small messages some steps/s, so only big params pay it; the largest
    param is read from the program's persistable vars of known shape."""
    from ops.rpc.malloc import BIG_ARENAS, BIG_PARAM, arenas_for
    from transpiler.ir import Program
    from transpiler.runtime.session import largest_param

    assert arenas_for(BIG_PARAM) == BIG_ARENAS == 1 and arenas_for(BIG_PARAM - 1) is None and arenas_for(0) is None
    program = Program.empty()
    block = program.global_block()
    block.create_var("w", dtype="float32", shape=[4096, 4096], persistable=True)  # 64 MB
    block.create_var("h", dtype="float64", shape=[-1, 8192])  # unknown batch, not persistable
    block.create_var("b", dtype="float64", shape=[8192], persistable=True)
    assert largest_param(program) == 64 << 20
    assert arenas_for(largest_param(program)) == BIG_ARENAS
    small = Program.empty()
    small.global_block().create_var("w", dtype="float32", shape=[512, 512], persistable=True)
    assert largest_param(small) == 1 << 20 and arenas_for(largest_param(small)) is None
    assert largest_param(Program.empty()) == 0


BIG_SESSION = ("import os, ops.rpc.malloc as m; from transpiler.ir import Program; from transpiler.runtime.session import Session\n"
               "p = Program.empty(); p.global_block().create_var('w', dtype='float32', shape=[{rows}, 4096], persistable=True)\n"
               "os.environ.update(TRAINING_ROLE='PSERVER', PADDLE_PSERVER_ENDPOINTS='127.0.0.1:1', PADDLE_CURRENT_ENDPOINT='127.0.0.1:1',"
               " PADDLE_TRAINERS_NUM='1')\n"
               "try:\n    Session(p, Program.empty())\nexcept Exception:\n    pass\n"
               "print(m._applied, m._arenas)")


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_a_distributed_session_bounds_the_arenas_before_its_threads_for_a_big_param():
    """`Session` bounds the arenas first thing, for a program with a 64 MB param; with a
    1 MB one, they stay the process's default (the pserver's 2 come later). The thresholds
    wait for the `PServer` or `RpcClient` (which trims what the heap holds free then: the
    transpile's and the startup program's temporaries stay out of the peak)."""
    assert fresh_python(BIG_SESSION.format(rows=4096)) == "None True"
    assert fresh_python(BIG_SESSION.format(rows=64)) == "None None"


def test_a_pserver_bounds_its_malloc_arenas_unless_told_not_to():
    """A pserver's ~50 gRPC threads share `PSERVER_ARENAS` arenas (the RSS under the RPC
    fuzz, tests/test_rpc_fuzz.py, no longer creeps); the same opt-outs as keeping freed memory."""
    code = SERVER_APPLIES.replace("print(m._applied)", "print(m._arenas)")
    assert fresh_python(code) == str(GLIBC)
    assert fresh_python(code, **{MALLOC_ENV: "default"}) == "False"
    assert fresh_python(code, MALLOC_ARENA_MAX="4") == "False"
    assert user_tuned({"MALLOC_ARENA_MAX": "4"})


# Issue 30's 1 GB weight: its grad is exactly 1 << 30 bytes, a malloc chunk of 1 GB + 16
# bytes. Written through (numpy, as a kernel's output), freed, 4 times; prints the minor page
# faults of rounds 2-4 and the mmap threshold set.
GB_FAULTS = """
import resource
import numpy as np
import ops.rpc.malloc as m
assert m.keep_freed_memory()
def rounds(n):
    for _ in range(n):
        grad = np.empty(1 << 28, np.float32)
        grad.fill(1.0)
        del grad
rounds(1)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
rounds(3)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, m.mmap_threshold)
"""


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_a_1_gb_buffer_is_reused_not_mapped_fresh_each_step():
    """The mmap threshold compares the chunk, header included: at exactly 1 GB, a 1 GB
    weight's grad was mapped fresh and zeroed every step (512 huge-page or 262,144 small-page
    faults a round); under 2047 MB its pages are reused. (An older glibc that refuses the big
    threshold gets the capped one, which cannot keep 1 GB: skipped there.)"""
    faults, threshold = fresh_python(GB_FAULTS).split()
    if int(threshold) != MMAP_THRESHOLD:
        pytest.skip(f"this glibc refused the {MMAP_THRESHOLD}-byte mmap threshold")
    print(f"minor page faults over 3 rounds of a 1 GB array: {faults}")
    assert int(faults) < 100


def test_a_glibc_that_refuses_the_big_threshold_gets_the_capped_one(monkeypatch):
    """Older glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2 (32 MB): the runtime
    then sets that one and its trim threshold, rather than leaving malloc untuned."""
    import ops.rpc.malloc as m

    calls: list[tuple[int, int]] = []

    def old_glibc(param: int, value: int) -> bool:
        calls.append((param, value))
        return not (param == m._M_MMAP_THRESHOLD and value > CAPPED_MMAP_THRESHOLD)

    monkeypatch.setattr(m, "_mallopt_one", old_glibc)
    monkeypatch.setattr(m, "mmap_threshold", None)
    assert m._mallopt() and m.mmap_threshold == CAPPED_MMAP_THRESHOLD
    assert calls == [(m._M_MMAP_THRESHOLD, MMAP_THRESHOLD), (m._M_MMAP_THRESHOLD, CAPPED_MMAP_THRESHOLD),
                     (m._M_TRIM_THRESHOLD, TRIM_THRESHOLD)]
    calls.clear()
    monkeypatch.setattr(m, "_mallopt_one", lambda param, value: calls.append((param, value)) or False)
    assert not m._mallopt() and len(calls) == 2  # no mallopt at all: nothing tuned, no trim set


def test_the_mmap_threshold_keeps_a_1_gb_buffer_and_fits_mallopt_s_int():
    """The threshold is a whole number of MB above a 1 GB buffer's chunk and below 2**31."""
    assert (1 << 30) + 16 < MMAP_THRESHOLD < 2**31 and MMAP_THRESHOLD % (1 << 20) == 0
    assert CAPPED_MMAP_THRESHOLD < MMAP_THRESHOLD <= TRIM_THRESHOLD < 2**31


# `fresh_pages_from`: calibrate's way of pricing the fresh pages an array over the 2047 MB
# threshold gets, on a 32 MB one. Prints the minor faults of 3 rounds inside it, after it
# (the heap grown back once, then kept), and whether it lowered the threshold.
FRESH_FAULTS = """
import resource
import numpy as np
import ops.rpc.malloc as m
assert m.keep_freed_memory()
def faults(n):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(n):
        a = np.empty(1 << 23, np.float32)
        a.fill(1.0)
        del a
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults(1)
with m.fresh_pages_from(1 << 25) as lowered:
    inside = faults(3)
faults(1)
print(inside, faults(3), lowered, m.mmap_threshold)
"""


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_fresh_pages_from_maps_such_buffers_fresh_then_keeps_them_again():
    inside, after, lowered, threshold = fresh_python(FRESH_FAULTS).split()
    assert lowered == "True" and int(threshold) in (MMAP_THRESHOLD, CAPPED_MMAP_THRESHOLD)
    # 32 MB a round: 16 huge pages or 8192 small ones each time inside; none once kept again
    assert int(inside) >= 3 * 16 and int(after) < 10, (inside, after)


def test_fresh_pages_from_does_nothing_where_malloc_is_not_tuned():
    out = fresh_python("import ops.rpc.malloc as m\n"
                       "with m.fresh_pages_from(1 << 20) as lowered: print(lowered, m.mmap_threshold)",
                       **{MALLOC_ENV: "default"})
    assert out == "False None"
