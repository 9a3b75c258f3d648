"""keep_clip_on_trainer: gradient-clip ops (`@CLIP` or `gradient_clip` name scopes) become
Backward ops of the bundle's original, so the trainer keeps them and sends the clipped grads."""

from __future__ import annotations

import pytest
from pass_support import ops, run_until

from transpiler.frontend import ParamAttr, Program, data, layers, optimizer, program_guard, unique_name
from transpiler.frontend.clip import GradientClipByGlobalNorm, GradientClipByNorm, GradientClipByValue, set_gradient_clip
from transpiler.ir import OpRole
from transpiler.ir import Program as IRProgram
from transpiler.passes.keep_clip_on_trainer import is_clip_op


def clipped(clip, *, via: str = "grad_clip", l2: bool = False) -> tuple[Program, Program]:
    """`x [-1, 4]` → fc 2 (`w`, `b`) → mean → SGD with `clip` (given to the optimizer, or
    by `set_gradient_clip`), and L2 decay when `l2`."""
    from transpiler.frontend import regularizer

    main, startup = Program(), Program()
    with unique_name.guard(), program_guard(main, startup):
        x = data(name="x", shape=[None, 4], dtype="float32")
        out = layers.fc(input=x, size=2, param_attr=ParamAttr(name="w"), bias_attr=ParamAttr(name="b"))
        reg = regularizer.L2Decay(0.01) if l2 else None
        if via == "grad_clip":
            optimizer.SGD(0.1, grad_clip=clip, regularization=reg).minimize(layers.mean(out))
        else:
            set_gradient_clip(clip)
            optimizer.SGD(0.1, regularization=reg).minimize(layers.mean(out))
    return main, startup


def roles(program: IRProgram, first: int) -> str:
    """`index type role namescope` of block 0's ops from `first` on."""
    return "".join(f"{op.index} {op.type} {op.role.describe()} {op.attr('op_namescope', '')}\n"
                   for op in program.global_block().ops[first:])


def test_global_norm_clip_ops_become_backward_ops():
    main, startup = clipped(GradientClipByGlobalNorm(1.0))
    before = roles(main, 7)
    assert before == """\
7 square optimize /gradient_clip/
8 reduce_sum optimize /gradient_clip/
9 square optimize /gradient_clip/
10 reduce_sum optimize /gradient_clip/
11 sum optimize /gradient_clip/
12 sqrt optimize /gradient_clip/
13 fill_constant optimize /gradient_clip/
14 elementwise_max optimize /gradient_clip/
15 elementwise_div optimize /gradient_clip/
16 elementwise_mul optimize /gradient_clip/
17 elementwise_mul optimize /gradient_clip/
18 sgd optimize 
19 sgd optimize 
"""
    bundle = run_until("keep_clip_on_trainer", main, startup, clip_mode="trainer")
    assert roles(bundle.origin, 7) == before.replace("optimize /", "backward /")
    assert roles(main, 7) == before  # the user's program keeps its roles
    assert ops(bundle.origin) == ops(main)  # only roles change


def test_the_trainer_sends_the_clipped_grads_and_the_pservers_have_no_clip():
    main, startup = clipped(GradientClipByGlobalNorm(1.0))
    bundle = run_until("pserver_optimize_blocks", main, startup, clip_mode="trainer")
    assert ops(bundle.trainer).splitlines()[15:20] == [
        "op 15 elementwise_div X=[fill_constant_0.tmp_0] Y=[elementwise_max_0.tmp_0] -> Out=[elementwise_div_0.tmp_0]",
        "op 16 elementwise_mul X=[b@GRAD] Y=[elementwise_div_0.tmp_0] -> Out=[elementwise_mul_0.tmp_0.trainer_0]",
        "op 17 send X=[elementwise_mul_0.tmp_0.trainer_0] -> Out=[__control_var@0]",
        "op 18 elementwise_mul X=[w@GRAD] Y=[elementwise_div_0.tmp_0] -> Out=[elementwise_mul_1.tmp_0.trainer_0]",
        "op 19 send X=[elementwise_mul_1.tmp_0.trainer_0] -> Out=[__control_var@1]",
    ]
    assert ops(bundle.pservers["127.0.0.1:6174"].main, 1) == """\
op 0 sum X=[elementwise_mul_0.tmp_0.trainer_0, elementwise_mul_0.tmp_0.trainer_1] -> Out=[elementwise_mul_0.tmp_0]
op 1 scale ScaleTensor=[] X=[elementwise_mul_0.tmp_0] -> Out=[elementwise_mul_0.tmp_0]
op 2 sgd Grad=[elementwise_mul_0.tmp_0] LearningRate=[learning_rate_0] Param=[b] -> ParamOut=[b]
"""
    assert [c.grad for c in bundle.analysis.chains] == ["elementwise_mul_0.tmp_0", "elementwise_mul_1.tmp_0"]


@pytest.mark.parametrize("via", ["grad_clip", "set_gradient_clip"])
@pytest.mark.parametrize("clip", [GradientClipByValue(0.1), GradientClipByNorm(1.0), GradientClipByGlobalNorm(1.0)],
                         ids=["value", "norm", "global_norm"])
def test_every_clip_kind_either_way_stays_on_the_trainer(clip, via):
    main, startup = clipped(clip, via=via)
    clip_ops = [op for op in main.global_block().ops if is_clip_op(op)]
    assert clip_ops and all(op.role == OpRole.Optimize for op in clip_ops)
    scopes = {op.attr("op_namescope").strip("/").rstrip("_0123456789") for op in clip_ops}
    assert scopes == ({"gradient_clip"} if via == "grad_clip" else
                      {"gradient_clip_@CLIP", "graident_clip_@CLIP"} if clip.__class__ is GradientClipByGlobalNorm
                      else {"graident_clip_@CLIP"})  # Fluid 1.8's scope names, its spelling
    bundle = run_until("pserver_startup", main, startup, clip_mode="trainer")
    trainer_types = [op.type for op in bundle.trainer.global_block().ops]
    assert [op.type for op in clip_ops] == [t for t in trainer_types if t in {op.type for op in clip_ops}][-len(clip_ops):]
    for progs in bundle.pservers.values():
        assert all([op.type for op in b.ops] == ["sum", "scale", "sgd"] for b in progs.main.blocks[1:])


def test_l2_decay_stays_on_the_pservers_after_a_clip_on_the_trainer():
    main, startup = clipped(GradientClipByNorm(1.0), l2=True)
    bundle = run_until("pserver_optimize_blocks", main, startup, clip_mode="trainer")
    assert [op.type for op in bundle.trainer.global_block().ops].count("clip_by_norm") == 2
    for progs in bundle.pservers.values():
        assert [op.type for op in progs.main.block(1).ops] == ["sum", "scale", "scale", "sum", "sgd"]


def test_programs_without_clip_are_left_alone():
    main, startup = clipped(GradientClipByValue(1.0, need_clip=lambda p: False))  # it clips nothing
    bundle = run_until("keep_clip_on_trainer", main, startup, clip_mode="trainer")
    assert roles(bundle.origin, 0) == roles(main, 0)


def test_two_global_norm_groups_become_two_norm_groups():
    """Fluid's set_gradient_clip with two GradientClipByGlobalNorm groups (`w` in "a" at 1.0,
    `b` in "b" at 2.0; our builder clips each param with its own clip, where Fluid 1.8
    applied the last one to all): clip_mode="exact" takes both out, one NormGroup each, in
    the order of their first scaled grad, and the optimizer reads the grads themselves."""
    main, startup = Program(), Program()
    with unique_name.guard(), program_guard(main, startup):
        x = data(name="x", shape=[None, 4], dtype="float32")
        out = layers.fc(input=x, size=2, param_attr=ParamAttr(name="w"), bias_attr=ParamAttr(name="b"))
        set_gradient_clip(GradientClipByGlobalNorm(1.0, group_name="a"), param_list=["w"])
        set_gradient_clip(GradientClipByGlobalNorm(2.0, group_name="b"), param_list=["b"])
        optimizer.SGD(0.1).minimize(layers.mean(out))
    bundle = run_until("keep_clip_on_trainer", main, startup, clip_mode="exact")
    groups = {(group.clip_norm, group.grads) for group in bundle.norm_groups}
    assert groups == {(1.0, (("w", "w@GRAD"),)), (2.0, (("b", "b@GRAD"),))}
    assert not [op for op in bundle.origin.global_block().ops if is_clip_op(op)]
    sgd_grads = {op.input("Grad")[0] for op in bundle.origin.global_block().ops if op.type == "sgd"}
    assert sgd_grads == {"w@GRAD", "b@GRAD"}
