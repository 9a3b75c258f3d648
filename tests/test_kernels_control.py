"""Control-flow kernels (ops/kernels/control.py) on their edge cases: a branch that does
not run gets zero grads, `select_input` / `select_output`, a loop that never runs, a loop
that never ends. The full programs are tests/test_control_flow.py's."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from conftest import PADDLE_PROGRAMS, TESTS
from ops.executor import ExecutionError, Executor
from ops.kernels import control
from ops.scope import Scope
from ops.tensor import LoDTensor
from ops.testing import run_op
from transpiler.api import as_float64
from transpiler.ir import Program

sys.path.insert(0, str(TESTS.parent / "examples"))
from train_program import synthetic_batch  # noqa: E402


def prepared(case: str) -> tuple[Program, Scope, Executor]:
    main = as_float64(Program.load(PADDLE_PROGRAMS / case / "main.pb"))
    startup = as_float64(Program.load(PADDLE_PROGRAMS / case / "startup.pb"))
    exe, scope = Executor(seed=0), Scope()
    exe.run(startup, scope=scope)
    return main, scope, exe


def test_select_input_and_select_output():
    a, b = np.ones(3), np.zeros(3)
    assert np.array_equal(run_op("select_input", {"X": [a, b], "Mask": np.array([1], np.int32)})["Out"], b)
    out = run_op("select_output", {"X": a, "Mask": np.array(0, np.int32)}, {"Out": 2}, raw=True)["Out"]
    assert np.array_equal(out[0].array, a)
    with pytest.raises(ExecutionError, match="Mask 2 is not an index of its 2 inputs"):
        run_op("select_input", {"X": [a, b], "Mask": np.array([2], np.int32)})


@pytest.mark.parametrize("negative", [False, True])
def test_the_branch_that_does_not_run_gets_zero_grads(negative):
    """cond_sgd_2ps: mean(fc_0.b_0) >= 0 picks tanh(h @ gate_w), else 2 sigmoid(h @ gate_v)."""
    main, scope, exe = prepared("cond_sgd_2ps")
    if negative:
        scope.set_var("fc_0.b_0", LoDTensor(np.full(8, -0.5)))
    w, v = exe.run(main, feed=synthetic_batch(main, 8, 0, 0), fetch_list=["gate_w@GRAD", "gate_v@GRAD"],
                   scope=scope)
    taken, idle = (v, w) if negative else (w, v)
    assert np.abs(taken).max() > 0 and not np.any(idle)


def test_a_loop_that_never_runs_passes_its_grads_through():
    """while_loop_sgd_3ps with n = 0: h goes straight to the head; loop_w's grad is zero and
    the loop var's grad is the output grad (while_grad over no step scopes)."""
    main, scope, exe = prepared("while_loop_sgd_3ps")
    (n_fill,) = [op for op in main.global_block().ops
                 if op.type == "fill_constant" and op.output_names == ["fill_constant_3.tmp_0"]]
    n_fill.set_attr("value", 0.0)
    n_fill.set_attr("str_value", "0")
    (while_grad,) = [op for op in main.global_block().ops if op.type == "while_grad"]
    (og,) = while_grad.input("Out@GRAD")
    loop_w, steps = exe.run(main, feed=synthetic_batch(main, 8, 0, 0), fetch_list=["loop_w@GRAD", og], scope=scope,
                            return_numpy=False)
    assert not np.any(loop_w.array)
    assert np.abs(steps.array).max() > 0


def test_a_loop_that_does_not_end_is_stopped(monkeypatch):
    monkeypatch.setattr(control, "MAX_WHILE_STEPS", 2)
    main, scope, exe = prepared("while_loop_sgd_3ps")  # 3 steps
    with pytest.raises(ExecutionError, match="the condition still holds after 2 steps"):
        exe.run(main, feed=synthetic_batch(main, 8, 0, 0), scope=scope)


def test_an_output_grad_nothing_after_the_loop_computes_is_zero_on_every_run():
    """while_loop_sgd_3ps with the head's grad of the loop output sent elsewhere: no op
    before while_grad writes `fc_0.tmp_2@GRAD`, so the last step's output grad is zero (not
    missing, not what the scope holds from the last run) and loop_w gets none."""
    main, scope, exe = prepared("while_loop_sgd_3ps")
    block = main.global_block()
    (while_grad,) = [op for op in block.ops if op.type == "while_grad"]
    (og,) = while_grad.input("Out@GRAD")
    (head,) = [op for op in block.ops[: block.index_of(while_grad)] if og in op.output_names]
    block.add_var(block.var(og).copy("elsewhere@GRAD"))
    head.set_output("X@GRAD", ["elsewhere@GRAD"])
    for step in range(2):
        (grad,) = exe.run(main, feed=synthetic_batch(main, 8, 0, step), fetch_list=["loop_w@GRAD"], scope=scope)
        assert not np.any(grad), step
        assert scope.find_var(og) is not None  # what the next run must not take as its output grad
