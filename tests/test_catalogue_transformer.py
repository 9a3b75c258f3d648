"""The transformer family of the op catalogue (ops/catalogue/transformer_ops.py): its shape
rules give, for every such op in Paddle 2.6's own BERT and GPT programs, the shapes Paddle's
InferMeta declared for the outputs; its grad makers wire the grad ops as Paddle's did."""

from __future__ import annotations

import pytest

from conftest import PADDLE_PROGRAMS
from ops import catalogue
from ops.catalogue import ShapeContext, ShapeError, TensorInfo
from ops.catalogue.registry import transformer_ops
from ops.catalogue.transformer_ops import unsqueeze_dims
from transpiler.ir import DType, Program

CASES = ["bert_adam_clip_2ps_sync", "bert_small_adam_3ps_sync", "gpt_adam_3ps_sync"]
FAMILY = {d.type for d in transformer_ops.OPS}


def _info(block, name):
    var = block.find_var(name)
    return None if var is None or var.dtype is None else TensorInfo(var.dtype, tuple(var.shape))


@pytest.mark.parametrize("case", CASES)
def test_shape_rules_give_paddles_declared_shapes(case):
    program = Program.load(PADDLE_PROGRAMS / case / "main.pb")
    block = program.global_block()
    checked = set()
    for op in block.ops:
        entry = catalogue.get(op.type)
        if op.type not in FAMILY or entry.infer_shape is None:
            continue
        inputs = {slot: tuple(_info(block, n) for n in names) for slot, names in op.inputs.items()}
        attrs = {**entry.attr_defaults(), **{name: op.attr(name) for name in op.attrs}}
        result = entry.infer_shape(ShapeContext(op.type, inputs, attrs))
        for slot, infos in result.items():
            for name, info in zip(op.output(slot), infos, strict=True):
                declared = block.find_var(name)
                if info is None or slot == "XShape":
                    continue
                assert info.shape == tuple(declared.shape), f"{case}: {op.type} {slot} {name}"
                assert info.dtype == declared.dtype, f"{case}: {op.type} {slot} {name}"
        checked.add(op.type)
    assert checked >= {"matmul_v2", "layer_norm", "dropout", "gelu"}
    assert checked >= ({"slice", "squared_l2_norm"} if "clip" in case else {"tril_triu", "unsqueeze2"} if "gpt" in case
                       else {"slice"})


@pytest.mark.parametrize("case", CASES)
def test_grad_makers_wire_the_grad_ops_as_paddle_did(case):
    """Each forward op's grad maker builds, slot by slot, the grad op Paddle's maker put in
    the program (the grad op that writes the grad of the forward op's X / Input)."""
    program = Program.load(PADDLE_PROGRAMS / case / "main.pb")
    ops = program.global_block().ops
    compared = set()
    for op in ops:
        if op.type not in FAMILY or not catalogue.require(op.type).grad_supported:
            continue
        first = (op.input("X") or op.input("Input"))[0]
        theirs = next((g for g in ops if g.type == op.type + "_grad" and first + "@GRAD" in g.output_names), None)
        if theirs is None:  # no grad flows into this input (a slice of a constant, ...)
            continue
        (ours,) = catalogue.require(op.type).grad(catalogue.GradContext(op))
        assert ours.type == theirs.type
        assert {k: v for k, v in ours.inputs.items() if v} == {k: v for k, v in theirs.inputs.items() if v}, op.type
        # (a grad written twice - GPT's tied embedding - Paddle's backward renames: not the maker's doing)
        renamed = {k: tuple(n.split("@RENAME@")[0] for n in v) for k, v in theirs.outputs.items() if v}
        assert {k: v for k, v in ours.outputs.items() if v} == renamed, op.type
        compared.add(op.type)
    assert compared >= {"matmul_v2", "layer_norm", "dropout", "gelu"}


def test_unsqueeze_dims_is_paddles_rule():
    assert unsqueeze_dims([2, 3], [-1, 0, -2]) == [1, 2, 3, 1, 1]
    assert unsqueeze_dims([2, 3], [2, 0, 3]) == [1, 2, 3, 1, 1]
    assert unsqueeze_dims([16, 16], [0, 1]) == [1, 1, 16, 16]
    with pytest.raises(ShapeError, match="axis 4 is out of range"):
        unsqueeze_dims([2, 3], [4])


def test_shape_rules_name_the_shapes_when_they_do_not_fit():
    f32 = DType.FP32
    matmul = catalogue.require("matmul_v2").infer_shape
    with pytest.raises(ShapeError, match=r"X \[-1, 8\] and Y \[4, 2\] cannot multiply \(8 vs 4\)"):
        matmul(ShapeContext("matmul_v2", {"X": (TensorInfo(f32, (-1, 8)),), "Y": (TensorInfo(f32, (4, 2)),)},
                            {"trans_x": False, "trans_y": False}))
    with pytest.raises(ShapeError, match="do not broadcast"):
        matmul(ShapeContext("matmul_v2", {"X": (TensorInfo(f32, (2, 3, 4)),), "Y": (TensorInfo(f32, (3, 4, 5)),)},
                            {"trans_x": False, "trans_y": False}))
    out = matmul(ShapeContext("matmul_v2", {"X": (TensorInfo(f32, (4,)),), "Y": (TensorInfo(f32, (-1, 4, 3)),)},
                              {"trans_x": True, "trans_y": False}))
    assert out["Out"][0].shape == (-1, 3)
