"""Dispatchers: RoundRobin as Paddle, a HashName that is stable across processes, Balanced."""

from __future__ import annotations

import subprocess
import sys
import zlib

import pytest

from transpiler.dispatch import Balanced, HashName, PSDispatcher, RoundRobin, resolve_dispatcher
from transpiler.errors import TranspileError
from transpiler.plan import make_blocks

EPS = ["127.0.0.1:6170", "127.0.0.1:6171", "127.0.0.1:6172"]


def blocks():
    return make_blocks("a", (10, 10), [50, 50]) + make_blocks("b", (4,), [4]) + make_blocks("c", (90, 1), [30, 30, 30])


def test_round_robin_cycles_and_resets():
    dispatcher = RoundRobin(EPS)
    assert dispatcher.dispatch(blocks()) == [EPS[0], EPS[1], EPS[2], EPS[0], EPS[1], EPS[2]]
    dispatcher.reset()
    assert dispatcher.dispatch(blocks()[:2]) == EPS[:2]


def test_hash_name_is_crc32_of_the_block_name():
    names = [b.name for b in blocks()]
    assert HashName(EPS).dispatch(blocks()) == [EPS[zlib.crc32(n.encode()) % 3] for n in names]


def test_hash_name_is_the_same_under_any_hash_seed():
    code = (
        "from transpiler.dispatch import HashName; from transpiler.plan import make_blocks;"
        "print(HashName(['a:1','b:2','c:3']).dispatch(make_blocks('fc_w', (100, 10), [100]*10)))"
    )
    outputs = {
        subprocess.run([sys.executable, "-c", code], env={"PYTHONHASHSEED": seed, "PATH": ""}, capture_output=True,
                       text=True, check=True, cwd=str(__import__("pathlib").Path(__file__).parents[1])).stdout
        for seed in ("0", "1", "12345")
    }
    assert len(outputs) == 1


def test_balanced_puts_big_blocks_apart():
    varlist = make_blocks("big", (100,), [50, 50]) + make_blocks("s1", (10,), [10]) + make_blocks("s2", (10,), [10])
    assert Balanced(EPS[:2]).dispatch(varlist) == [EPS[0], EPS[1], EPS[0], EPS[1]]


@pytest.mark.parametrize(("name", "cls"), [("round_robin", RoundRobin), ("RoundRobin", RoundRobin),
                                           ("hash_name", HashName), ("HashName", HashName), ("balanced", Balanced),
                                           (None, RoundRobin), (HashName, HashName)])
def test_resolve_dispatcher(name, cls):
    assert resolve_dispatcher(name) is cls


def test_resolve_rejects_unknown():
    with pytest.raises(TranspileError, match="unknown split method 'zigzag'"):
        resolve_dispatcher("zigzag")
    with pytest.raises(TranspileError, match="PSDispatcher subclass"):
        resolve_dispatcher(42)


def test_user_dispatcher_interface():
    class AllOnLast(PSDispatcher):
        def dispatch(self, varlist):
            return [self.eps[-1] for _ in varlist]

    assert resolve_dispatcher(AllOnLast) is AllOnLast
    assert AllOnLast(EPS).dispatch(blocks()) == [EPS[-1]] * 6
