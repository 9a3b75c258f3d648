"""The IR holds no reference cycle (transpiler/ir/program.py), so a program nobody holds is
freed by reference counts at once; and `gc_paused(promote=True)` (transpiler/ir/gc_pause.py),
which relies on that, hands a burst's survivors to the oldest generation unscanned."""

from __future__ import annotations

import contextlib
import gc
import json
import weakref
from pathlib import Path

import pytest

from transpiler.api import transpile
from transpiler.errors import IRError
from transpiler.ir import Program
from transpiler.ir.gc_pause import gc_paused
from transpiler.ir.program import Op
from transpiler.ir.serde import program_from_bytes

FIXTURES = Path(__file__).parent / "fixtures" / "paddle_programs"
CASES = sorted(p.name for p in FIXTURES.iterdir() if (p / "case.json").exists())


@contextlib.contextmanager
def collector_off():
    """The collector off and nothing pending, so that `gc.collect()` afterwards counts only
    the cyclic garbage made inside."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _load(case: str) -> tuple[Program, Program, dict]:
    folder = FIXTURES / case
    return (program_from_bytes((folder / "main.pb").read_bytes()),
            program_from_bytes((folder / "startup.pb").read_bytes()),
            json.loads((folder / "case.json").read_text()))


def _transpile(main: Program, startup: Program, case: dict):
    return transpile(main, startup, pservers=case["pservers"], trainers=case["trainers"],
                     trainer_id=case["trainer_id"], sync_mode=case["sync_mode"], slice_var_up=case["slice_var_up"],
                     split_method=case["split_method"], min_block_size=case["min_block_size"])


@pytest.mark.parametrize("case", CASES)
def test_loading_and_transpiling_a_paddle_program_leave_no_cyclic_garbage(case):
    main, startup, spec = _load(case)
    _transpile(main, startup, spec)  # what a first run imports (datetime, ...) leaves module-level cycles
    with collector_off():
        result = _transpile(main, startup, spec)
        trainer = weakref.ref(result.trainer)
        del result
        assert trainer() is None  # freed by its reference counts, not by a collection
        assert gc.collect() == 0
        loaded = program_from_bytes((FIXTURES / case / "main.pb").read_bytes())
        blocks = [weakref.ref(block) for block in loaded.blocks]
        del loaded
        assert all(block() is None for block in blocks)
        assert gc.collect() == 0


class _WatchedOp(Op):
    """An op a test can hold a weak reference to (`Op` has no slot for one)."""

    __slots__ = ("__weakref__",)


def _watched(op: Op) -> _WatchedOp:
    return _WatchedOp(op.type, op.inputs, op.outputs)


def test_an_edited_clone_is_freed_by_reference_counts_and_its_graph_by_the_collector():
    main, _startup, _case = _load("mlp_adam_2ps")
    with collector_off():
        copy = main.clone()
        block = copy.global_block()
        moved = block.add_op(_watched(block.ops[0]), index=0)
        block.remove_op(moved)
        block.insert_before(block.ops[1], moved)
        block.insert_after(block.ops[-1], _watched(block.ops[0]))
        watched = [weakref.ref(copy), weakref.ref(block), weakref.ref(moved), weakref.ref(block.ops[-1])]
        del copy, block, moved
        assert [ref() for ref in watched] == [None] * 4
        assert gc.collect() == 0

        copy = main.clone()
        copy.global_block().add_op(_watched(copy.global_block().ops[0]))
        last = weakref.ref(copy.global_block().ops[-1])
        copy.global_block().graph()  # networkx's cached views are cycles: they hold the ops, not the block
        del copy
        gc.collect()
        assert last() is None


def test_a_dropped_programs_block_op_and_var_are_detached_not_dangling():
    program = Program.empty()
    block = program.global_block()
    var = block.create_var("x")
    op = block.add_op("relu", {"X": ["x"]}, {"Out": ["x"]})
    assert (block.program, var.block, op.block) == (program, block, block)
    del program
    assert block.program is None and block.parent is None
    del block
    assert var.block is None and op.block is None
    with pytest.raises(IRError, match="not in a block"):
        op.index  # noqa: B018
    # Detached: they can join another program.
    other = Program.empty().global_block()
    other.add_var(var)
    other.add_op(op)
    assert other.ops == (op,) and var.block is other


def test_a_200k_op_block_is_freed_without_deep_recursion():
    program = Program.empty()
    block = program.global_block()
    block.create_var("x")
    block.add_ops([_WatchedOp("relu", {"X": ["x"]}, {"Out": ["x"]}) for _ in range(200_000)])
    last = weakref.ref(block.ops[-1])
    del program, block  # each op holds the next: a 200k-long chain, freed by the trashcan
    assert last() is None


class _Marker:
    pass


def test_promote_hands_the_survivors_to_the_oldest_generation_unscanned():
    with collector_off():
        gc.enable()
        with gc_paused(promote=True):
            assert not gc.isenabled()
            kept = _Marker()
        assert gc.isenabled()
        assert gc.get_count()[0] < 50
        assert any(o is kept for o in gc.get_objects(generation=2))
        assert not any(o is kept for o in gc.get_objects(generation=0))


def test_promote_leaves_the_generations_alone_after_an_error_or_a_users_freeze():
    with collector_off():
        gc.enable()
        with pytest.raises(ValueError), gc_paused(promote=True):
            raised = _Marker()
            raise ValueError
        assert gc.isenabled()
        assert any(o is raised for o in gc.get_objects(generation=0))
        frozen_before = _Marker()
        gc.freeze()
        try:
            with gc_paused(promote=True):
                kept = _Marker()
            assert gc.get_freeze_count() > 0  # the user's freeze stands: nothing thawed
            assert any(o is kept for o in gc.get_objects(generation=0))
        finally:
            gc.unfreeze()
        del frozen_before


def test_a_paused_collector_stays_off_when_it_was_off():
    with collector_off():
        with gc_paused(promote=True):
            pass
        assert not gc.isenabled()
