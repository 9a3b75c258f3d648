"""The cross-program checks (passes/checks.py): a whole bundle passes them, and each check
fires on a bundle tampered with after the pipeline, naming the program it found it in."""

from __future__ import annotations

import pytest
from pass_support import run_until, tiny

from transpiler.errors import VerifyError
from transpiler.passes.checks import cross_program_problems, verify_bundle

EP0, EP1 = "127.0.0.1:6174", "127.0.0.1:6175"


def _bundle():
    main, startup = tiny()
    return run_until("pserver_startup", main, startup, min_block_size=4)


def _problems(bundle) -> list[str]:
    return [f"{p.program}: {p.reason}" for p in cross_program_problems(bundle)]


def _optimizer_block(bundle, endpoint: str):
    """The optimize block of `endpoint` that holds an sgd op, and that op."""
    for block in bundle.pservers[endpoint].main.blocks:
        for op in block.ops:
            if op.type == "sgd":
                return block, op
    raise AssertionError(f"no sgd on {endpoint}")


def test_a_transpiled_bundle_passes_every_check():
    bundle = _bundle()
    assert _problems(bundle) == []
    verify_bundle(bundle)


def test_a_param_block_updated_twice_or_never_is_named():
    bundle = _bundle()
    block, sgd = _optimizer_block(bundle, EP0)
    (param,) = sgd.input("Param")
    block.add_op(sgd.clone())
    assert _problems(bundle) == [f"pserver_{EP0}: param block {param!r} is updated 2 times on {EP0}, not once"]
    block.remove_op(block.ops[-1])
    block.remove_op(sgd)
    problems = _problems(bundle)
    assert f"pserver_{EP0}: param block {param!r} is updated 0 times on {EP0}, not once" in problems
    with pytest.raises(VerifyError, match="is updated 0 times"):
        verify_bundle(bundle)


def test_a_param_updated_where_the_plan_puts_none_of_it_is_named():
    bundle = _bundle()
    _, sgd = _optimizer_block(bundle, EP0)
    (param,) = sgd.input("Param")
    bundle.pservers[EP1].main.block(1).add_op(sgd.clone())
    assert f"pserver_{EP1}: {param!r} is updated on {EP1} but the plan puts no block of it there" in _problems(bundle)


def test_a_send_no_pserver_receives_is_named():
    bundle = _bundle()
    block = bundle.trainer.global_block()
    send = next(op for op in block.ops if op.type == "send")
    send.set_input("X", ["nowhere"] * len(send.input("X")))
    assert any("send of 'nowhere'" in p and "does not receive it" in p for p in _problems(bundle))
