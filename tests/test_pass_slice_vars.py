"""slice_vars: params cut into row blocks, each block (and its grad block) placed on a pserver."""

from __future__ import annotations

from pass_support import run_until, tiny

from transpiler.plan import format_plan


def test_params_are_cut_into_whole_rows_and_dispatched_round_robin():
    main, startup = tiny()
    plan = run_until("slice_vars", main, startup, min_block_size=4).plan
    assert format_plan(plan).split("var / block")[1] == """\
                              endpoint                           rows shape
b [2] fp32 (sgd, grad b@GRAD)
  b                                      127.0.0.1:6174                      0:2 [2]
w [4, 2] fp32 (sgd, grad w@GRAD)
  w.block0                               127.0.0.1:6175                      0:2 [2, 2]
  w.block1                               127.0.0.1:6174                      2:4 [2, 2]
"""
    w = plan.param("w")
    assert [w.grad_block_name(i) for i in range(2)] == ["w@GRAD.block0", "w@GRAD.block1"]


def test_a_var_smaller_than_min_block_size_stays_whole():
    main, startup = tiny()
    plan = run_until("slice_vars", main, startup).plan  # min_block_size 8192
    assert [[b.name for b in p.blocks] for p in plan.params] == [["b"], ["w"]]
