"""Each verifier check fires, and says where: program, block, op index, op type, dump context."""

from __future__ import annotations

import pytest

from conftest import PADDLE_PB_FILES, PADDLE_PROGRAMS
from transpiler.errors import PsTranspilerError, VerifyError
from transpiler.ir import Attr, AttrType, Program
from transpiler.ir.program import Block
from transpiler.ir.verifier import check, op_problem, verify


def _program(num_ops: int = 7) -> Program:
    """Block 0 with vars x0..xN and a chain of `num_ops` relu ops, plus an empty block 1."""
    program = Program.empty()
    block = program.global_block()
    for i in range(num_ops + 1):
        block.create_var(f"x{i}", dtype="float32", shape=[-1, 4])
    for i in range(num_ops):
        block.add_op("relu", {"X": f"x{i}"}, {"Out": f"x{i + 1}"}, {"op_role": 0})
    program.create_block(0)
    return program


def _only_problem(program: Program, name: str = "main.pb") -> VerifyError:
    with pytest.raises(VerifyError) as info:
        verify(program, name=name)
    problems = check(program, name=name)
    assert len(problems) == 1, [str(p) for p in problems]
    assert isinstance(info.value, PsTranspilerError)
    return info.value


def _assert_op_located(err: VerifyError, *, block: int, index: int, op_type: str, program: str = "main.pb") -> None:
    assert (err.program, err.block, err.op_index, err.op_type) == (program, block, index, op_type)
    assert err.headline.startswith(f"{program}, block {block}, op {index} ({op_type}): ")
    lines = str(err).splitlines()
    assert lines[0] == err.headline
    marked = [line for line in lines[1:] if line.lstrip().startswith(">>")]
    assert len(marked) == 1 and f"op {index} {op_type}" in marked[0], str(err)


@pytest.mark.parametrize("path", PADDLE_PB_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_fixture_verifies(path):
    program = Program.load(path)
    verify(program, name=path.name)
    assert check(program) == []


def test_a_sound_program_verifies():
    verify(_program())


def test_undeclared_input():
    program = _program()
    op = program.global_block().ops[3]
    op.set_input("X", ["x3", "ghost"])
    err = _only_problem(program)
    _assert_op_located(err, block=0, index=3, op_type="relu")
    assert "input X='ghost'" in err.reason and "do not declare" in err.reason


def test_undeclared_output_in_a_sub_block():
    program = _program()
    program.block(1).add_op("assign", {"X": "x0"}, {"Out": "nowhere"})
    err = _only_problem(program)
    _assert_op_located(err, block=1, index=0, op_type="assign")
    assert "output Out='nowhere'" in err.reason


def test_context_shows_three_ops_either_side():
    program = _program(num_ops=9)
    program.global_block().ops[5].set_input("X", "ghost")
    err = _only_problem(program)
    context = err.context.splitlines()
    assert len(context) == 7
    assert context[0].strip().startswith("op 2 relu") and context[-1].strip().startswith("op 8 relu")
    assert context[3].strip().startswith(">> op 5 relu X=[ghost]")


def test_context_is_clipped_at_the_block_ends():
    program = _program(num_ops=5)
    program.global_block().ops[0].set_input("X", "ghost")
    err = _only_problem(program)
    context = err.context.splitlines()
    assert len(context) == 4  # ops 0..3: nothing before op 0
    assert context[0].strip().startswith(">> op 0 relu")


def test_ancestor_vars_resolve_but_sibling_vars_do_not():
    program = _program()
    b1, b2 = program.block(1), program.create_block(0)
    b1.create_var("only_in_1", dtype="int64", shape=[1])
    b1.add_op("use_global", {"X": "x0"}, {"Out": "only_in_1"})
    verify(program)
    b2.add_op("use_sibling", {"X": "only_in_1"})
    err = _only_problem(program)
    _assert_op_located(err, block=2, index=0, op_type="use_sibling")


def test_empty_var_placeholder_is_allowed():
    program = _program()
    program.global_block().add_op("mul_grad", {"X": "x0"}, {"X@GRAD": "@EMPTY@"})
    verify(program)


def test_block_attr_out_of_range():
    program = _program()
    program.global_block().ops[2].set_attr("sub_block", 5, AttrType.BLOCK)
    err = _only_problem(program)
    _assert_op_located(err, block=0, index=2, op_type="relu")
    assert "sub_block=block[5] points past the last block (1)" in err.reason


def test_blocks_attr_out_of_range():
    program = _program()
    program.global_block().ops[0].set_attr("optimize_blocks", [1, 2], AttrType.BLOCKS)
    err = _only_problem(program)
    _assert_op_located(err, block=0, index=0, op_type="relu")
    assert "optimize_blocks=block[2]" in err.reason


def test_block_attr_pointing_at_its_own_block():
    program = _program()
    program.block(1).add_op("while", attrs={"sub_block": Attr.of(1, AttrType.BLOCK)})
    err = _only_problem(program)
    _assert_op_located(err, block=1, index=0, op_type="while")
    assert "own block" in err.reason


def test_var_attrs_must_name_declared_vars():
    program = _program()
    program.global_block().ops[1].set_attr("v", "x0", AttrType.VAR)
    program.global_block().ops[1].set_attr("vs", ["x1", "ghost"], AttrType.VARS)
    err = _only_problem(program)
    _assert_op_located(err, block=0, index=1, op_type="relu")
    assert "vs=var(ghost)" in err.reason


def test_block_index_mismatch():
    program = _program()
    program.block(1).idx = 4
    err = _only_problem(program)
    assert (err.program, err.block, err.op_index, err.op_type) == ("main.pb", 1, None, None)
    assert err.headline == "main.pb, block 1: is at position 1 but says idx=4"


def test_global_block_with_a_parent():
    program = _program()
    program.global_block().parent_idx = 1
    err = _only_problem(program)
    assert err.block == 0 and "global block has parent 1" in err.reason


@pytest.mark.parametrize("parent", [1, 7, -1])
def test_bad_parent(parent):
    program = _program()
    program.block(1).parent_idx = parent
    problems = check(program, name="p")
    assert problems and problems[0].block == 1
    assert f"has parent {parent}" in problems[0].reason


def test_parent_cycle():
    program = _program()
    b2 = program.create_block(1)
    program.block(1).parent_idx = b2.idx
    problems = check(program, name="p")
    assert [p.block for p in problems] == [1]  # the cycle is reported once, at its first block
    assert "never reaches block 0 (a cycle)" in problems[0].reason


def test_forward_block_out_of_range():
    program = _program()
    program.block(1).forward_block_idx = 9
    err = _only_problem(program)
    assert err.block == 1 and "forward_block_idx 9" in err.reason


def test_a_program_without_blocks():
    problems = check(Program(), name="empty")
    assert [str(p) for p in problems] == ["empty: has no blocks"]


def test_op_checks_wait_for_a_sound_block_tree():
    """A broken tree is reported alone: resolving vars through broken parents would mislead."""
    program = _program()
    program.block(1).parent_idx = 9
    program.block(1).add_op("assign", {"X": "ghost"})
    problems = check(program, name="p")
    assert problems and "has parent 9" in problems[0].reason
    assert all(p.op_index is None for p in problems)


def test_verify_counts_the_other_problems():
    program = _program()
    block = program.global_block()
    block.ops[1].set_input("X", "ghost1")
    block.ops[4].set_output("Out", "ghost2")
    block.ops[6].set_input("X", "ghost3")
    with pytest.raises(VerifyError) as info:
        verify(program, name="main.pb")
    assert info.value.op_index == 1
    assert info.value.headline.endswith("(and 2 more problems)")
    assert [p.op_index for p in check(program)] == [1, 4, 6]


def test_extra_checks_run_and_use_the_same_location_format():
    program = _program()

    def no_relu_at_2(prog: Program, name: str):
        block = prog.global_block()
        for index, op in enumerate(block.ops):
            if index == 2 and op.type == "relu":
                yield op_problem(name, block, op, index, "relu is not allowed here")

    with pytest.raises(VerifyError) as info:
        verify(program, name="trainer", extra_checks=[no_relu_at_2])
    _assert_op_located(info.value, block=0, index=2, op_type="relu", program="trainer")


def test_a_block_appended_by_hand_with_a_wrong_index_is_caught():
    program = _program()
    program.append_block(Block(program, 1, 0))  # a second "block 1" at position 2
    err = _only_problem(program)
    assert err.block == 2 and "says idx=1" in err.reason


def test_an_op_found_sound_is_checked_again_once_edited_or_moved():
    """The verifier does not look again at the attrs of an op it found sound on their own
    (no block or var reference) while they stay unchanged, clones included: every way of
    making them wrong afterwards must still be caught."""
    program = _program()
    verify(program)  # every relu found sound
    bad_role = Attr.of("forward", AttrType.STRING)

    edited = program.clone()  # the clones share the sound attrs
    edited.global_block().ops[3].set_attr("op_role", bad_role)
    err = _only_problem(edited)
    _assert_op_located(err, block=0, index=3, op_type="relu")
    assert "attr op_role is STRING, not INT" in err.reason
    verify(program)  # the original's op is untouched

    program.global_block().ops[4].set_attr("sub_block", 7, AttrType.BLOCK)
    err = _only_problem(program)
    _assert_op_located(err, block=0, index=4, op_type="relu")
    assert "sub_block=block[7]" in err.reason

    # A block reference is never taken as sound once and for all: it can go stale.
    program = _program()
    program.global_block().ops[0].set_attr("sub_block", 1, AttrType.BLOCK)
    verify(program)
    moved = Program.empty()
    moved.global_block().create_var("x0", dtype="float32", shape=[-1, 4])
    moved.global_block().create_var("x1", dtype="float32", shape=[-1, 4])
    moved.global_block().add_op(program.global_block().ops[0].clone())
    err = _only_problem(moved)
    assert "sub_block=block[1] points past the last block (0)" in err.reason


def test_ops_built_or_edited_as_sound_are_still_checked_where_they_are_not():
    """make_op, set_attr and clone(attrs=) hand the verifier ops whose attrs are known sound
    on their own; an attr that is not (a wrong common type, a block or var reference) must
    still be checked."""
    from ops.catalogue import make_op

    program = _program()
    block = program.global_block()
    built = make_op("relu", {"X": ["x0"]}, {"Out": ["x1"]}, role=0)
    assert built._verified_attrs is built._attrs  # the shortcut is taken
    block.add_op(built)
    block.add_op(make_op("relu", {"X": ["x0"]}, {"Out": ["x1"]}, {"v": Attr.of("ghost", AttrType.VAR)}))
    err = _only_problem(program)
    assert "v=var(ghost)" in err.reason and err.op_index == 8

    program = _program()
    block = program.global_block()
    verify(program)
    block.add_op(block.ops[0].clone(attrs={"op_role_var": Attr.of("w", AttrType.STRING)}))
    err = _only_problem(program)
    assert err.op_index == 7 and "attr op_role_var is STRING, not STRINGS" in err.reason

    program = _program()
    verify(program)
    program.global_block().ops[2].set_attr("sub_block", 1, AttrType.BLOCK)  # in range now
    program.global_block().ops[2].set_attr("op_role", 1)  # sound, but the block reference still is not
    verify(program)
    program.block(1).add_op(program.global_block().ops[2].clone())
    err = _only_problem(program)
    assert (err.block, err.op_index) == (1, 0) and "own block" in err.reason


def test_many_child_blocks_checked_at_once_still_name_the_block_and_op():
    """Children of block 0 that declare nothing are checked together while they are all
    sound (`_quiet_children`); a problem in any of them must still be found and located."""
    for bad_child in (1, 5):
        program = _program(2)
        for i in range(1, 7):
            child = program.create_block(0)
            child.add_op("relu", {"X": "x0"}, {"Out": "x1"}, {"op_role": 0})
            child.add_op("scale", {"X": "x1"}, {"Out": "x2" if i != bad_child else "nowhere"}, {"op_role": 0})
        assert program.block(bad_child + 1).ops[1].output("Out") == ("nowhere",)
        err = _only_problem(program)
        _assert_op_located(err, block=bad_child + 1, index=1, op_type="scale")
        assert "nowhere" in err.reason
    program = _program(2)
    for _ in range(4):
        program.create_block(0).add_op("relu", {"X": "x0"}, {"Out": "x1"}, {"op_role": 0})
    program.block(3).ops[0].set_attr("sub_block", Attr(AttrType.BLOCK, 3))  # its own block: an attr problem
    _assert_op_located(_only_problem(program), block=3, index=0, op_type="relu")
    program.block(3).ops[0].set_attr("sub_block", Attr(AttrType.BLOCK, 1))
    verify(program)
    from transpiler.ir.verifier import _quiet_children

    program = _program(2)
    for _ in range(3):
        program.create_block(0).add_op("relu", {"X": "x0"}, {"Out": "x1"}, {"op_role": 0})
    verify(program)  # finds the ops' attrs sound, so the next check takes the children at once
    assert _quiet_children(program) == {1, 2, 3, 4}
    program.block(2).add_op("relu", {"X": "x0"}, {"Out": "nowhere"}, {"op_role": 0})
    _assert_op_located(_only_problem(program), block=2, index=1, op_type="relu")


# ---------------------------------------------------------------- control-flow grad blocks
# Paddle-built cond / while_loop programs: a grad sub-block (forward_block_idx set) runs in
# its forward block's scope and may read what that block declares (docs/control-flow.md).


def _fixture(case: str) -> Program:
    return Program.load(PADDLE_PROGRAMS / case / "main.pb")




def grad_block(program: Program, forward: int):
    (block,) = [b for b in program.blocks if b.forward_block_idx == forward]
    return block


def test_a_grad_block_reads_its_forward_blocks_vars():
    """cond's grad block 4 (forward block 1) reads the branch's `tanh` output, declared in
    block 1 only: declared for the grad block, not for a sibling that is not its forward."""
    main = _fixture("cond_sgd_2ps")
    block = grad_block(main, 1)
    (tanh_grad,) = [op for op in block.ops if op.type == "tanh_grad"]
    (out,) = tanh_grad.input("Out")
    assert main.block(1).has_var(out) and not block.has_var(out) and not main.global_block().has_var(out)
    assert block.find_var(out) is main.block(1).var(out)
    assert [b.idx for b in block.visible_blocks()] == [block.idx, 1, 0]
    assert check(main) == []
    # The other branch's grad block (forward block 2) does not see block 1's vars.
    assert grad_block(main, 2).find_var(out) is None


def test_nested_grad_blocks_see_forward_and_parent_chains():
    """cond inside while_loop: the cond's grad blocks (parent: the while's grad block 4)
    see their forward branch, the branch's parent (the loop body), the while's grad block
    and block 0, nearest scope first."""
    main = _fixture("cond_in_while_sgd_2ps")
    inner = grad_block(main, 2)
    assert inner.parent_idx == 4 and main.block(4).forward_block_idx == 1
    assert [b.idx for b in inner.visible_blocks()] == [inner.idx, 2, 4, 1, 0]
    assert check(main) == []


def test_a_genuinely_undeclared_var_in_a_grad_block_is_still_refused_precisely():
    main = _fixture("cond_sgd_2ps")
    block = grad_block(main, 1)
    index = next(i for i, op in enumerate(block.ops) if op.type == "tanh_grad")
    block.ops[index].set_input("Out", ["no_such_var"])
    (problem,) = check(main, name="main.pb")
    assert (problem.block, problem.op_index, problem.op_type) == (block.idx, index, "tanh_grad")
    assert problem.reason == (f"input Out='no_such_var' names a var that block {block.idx} and the blocks whose "
                              "scopes it runs in (1, 0: ancestors and forward blocks) do not declare")
    with pytest.raises(VerifyError, match=f"main.pb, block {block.idx}, op {index} \\(tanh_grad\\)"):
        verify(main, name="main.pb")


def test_a_var_of_a_block_that_is_not_the_forward_is_refused():
    """Grad block of branch 2 reading the other branch's (block 1) temporary: Paddle's scopes
    would not hold it, so the verifier refuses it."""
    main = _fixture("cond_sgd_2ps")
    other = grad_block(main, 2)
    name = sorted(main.block(1).vars)[0]
    assert all(not main.block(i).has_var(name) for i in (0, 2, other.idx))
    other.ops[-1].set_input("Out", [name])
    (problem,) = check(main)
    assert problem.block == other.idx and f"Out={name!r} names a var that block {other.idx}" in problem.reason


def test_without_forward_blocks_the_message_is_unchanged():
    main = _fixture("cond_sgd_2ps")
    main.block(1).ops[0].set_input("X", ["ghost"])
    (problem,) = check(main)
    assert problem.reason.endswith("names a var that block 1 and its ancestors do not declare")
