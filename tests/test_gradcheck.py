"""Finite-difference gradient check of every differentiable kernel.

Each case builds a tiny program with the IR — the forward op, then its grad op(s)
wired the way Paddle's grad makers wire them (e.g. `mul_grad` reads X, Y, Out@GRAD and
writes X@GRAD, Y@GRAD; `sum`'s grad is one `scale` per input) — feeds a random
upstream grad for the checked outputs, and compares the analytic grads with central
differences of `sum(upstream * forward(inputs))`.

Everything runs in float64 (the kernels keep their inputs' dtype), with h = 1e-6 and
`rtol=1e-6, atol=1e-8` unless a case says otherwise (the fp64→fp32 `cast` uses h =
1e-2 and 1e-4). Inputs stay clear of kinks (relu at 0, max ties, clip bounds).

`test_every_differentiable_kernel_is_checked` fails when a kernel registered with a
`grad` has no case here, or when a grad kernel exists that no case exercises.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from ops.executor import Executor
from ops.kernels import differentiable_ops, register, registered_ops, unregister
from ops.scope import Scope
from ops.tensor import LoDTensor, SelectedRows
from transpiler.ir import DType, Program, VarKind

RNG = np.random.default_rng(20240611)
F64 = int(DType.FP64)


def rand(*shape: int, low: float = -1.0, high: float = 1.0) -> np.ndarray:
    return RNG.uniform(low, high, size=shape)


def away_from_zero(*shape: int, margin: float = 0.1) -> np.ndarray:
    """Random values with |v| >= margin (no kink at 0)."""
    v = rand(*shape)
    return np.where(v >= 0, v + margin, v - margin)


def probs(rows: int, cols: int) -> np.ndarray:
    p = rand(rows, cols, low=0.2, high=1.0)
    return p / p.sum(axis=1, keepdims=True)


GradOp = tuple[str, dict[str, list[str]], dict[str, list[str]], dict[str, Any]]


@dataclass
class Case:
    """One forward op, its inputs (slot → [(name, value)]), outputs, attrs, the grad
    ops as Paddle wires them, the var names to differentiate and the outputs that make
    up the objective."""

    id: str
    op: str
    inputs: dict[str, list[tuple[str, Any]]]
    outputs: dict[str, list[str]]
    grad_ops: list[GradOp]
    wrt: list[str]
    checked: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    h: float = 1e-6
    rtol: float = 1e-6
    atol: float = 1e-8


def unary(op: str, x: np.ndarray, dep: str, attrs: dict | None = None, case_id: str | None = None) -> Case:
    """An activation-style op: Out = f(X); its grad reads `dep` (X or Out) and Out@GRAD."""
    return Case(
        id=case_id or op,
        op=op,
        inputs={"X": [("X", x)]},
        outputs={"Out": ["Out"]},
        attrs=dict(attrs or {}),
        grad_ops=[(f"{op}_grad", {dep: [dep], "Out@GRAD": ["Out@GRAD"]}, {"X@GRAD": ["X@GRAD"]}, dict(attrs or {}))],
        wrt=["X"],
        checked=["Out"],
    )


def binary(op: str, x: np.ndarray, y: np.ndarray, axis: int = -1, grad_in: tuple[str, ...] = ("X", "Y"), case_id: str = "") -> Case:
    """An elementwise op; its grad reads `grad_in` and Out@GRAD and writes X@GRAD, Y@GRAD."""
    attrs = {"axis": axis}
    return Case(
        id=case_id or op,
        op=op,
        inputs={"X": [("X", x)], "Y": [("Y", y)]},
        outputs={"Out": ["Out"]},
        attrs=attrs,
        grad_ops=[
            (
                f"{op}_grad",
                {**{s: [s] for s in grad_in}, "Out@GRAD": ["Out@GRAD"]},
                {"X@GRAD": ["X@GRAD"], "Y@GRAD": ["Y@GRAD"]},
                attrs,
            )
        ],
        wrt=["X", "Y"],
        checked=["Out"],
    )


def lookup(op: str, sparse: bool, padding_idx: int = -1) -> Case:
    ids = np.array([[1], [3], [1], [0], [4]], dtype=np.int64)
    if op == "lookup_table_v2":
        ids = ids.reshape(-1)
    attrs = {"is_sparse": sparse, "padding_idx": padding_idx}
    return Case(
        id=f"{op}-{'sparse' if sparse else 'dense'}-pad{padding_idx}",
        op=op,
        inputs={"W": [("W", rand(6, 3))], "Ids": [("Ids", ids)]},
        outputs={"Out": ["Out"]},
        attrs=attrs,
        grad_ops=[(f"{op}_grad", {"W": ["W"], "Ids": ["Ids"], "Out@GRAD": ["Out@GRAD"]}, {"W@GRAD": ["W@GRAD"]}, attrs)],
        wrt=["W"],
        checked=["Out"],
    )


def rnn(mode: str, gates: int) -> Case:
    """The fused RNN op, one layer: time-major Input [3, 2, 4], hidden 3; the grad of
    Out (the states' grads are zero: rnn_grad reads no State@GRAD)."""
    attrs = {"mode": mode, "num_layers": 1, "hidden_size": 3, "input_size": 4, "is_bidirec": False,
             "dropout_prob": 0.0, "is_test": False, "seed": 0}
    states = ["H0", "C0"] if mode == "LSTM" else ["H0"]
    weights = [("W_ih", rand(3 * gates, 4)), ("W_hh", rand(3 * gates, 3)), ("B_ih", rand(3 * gates)),
               ("B_hh", rand(3 * gates))]
    inputs = {"Input": [("Input", rand(3, 2, 4))], "PreState": [(s, rand(1, 2, 3)) for s in states],
              "WeightList": weights}
    names = [n for n, _ in weights]
    return Case(
        id=f"rnn-{mode}",
        op="rnn",
        inputs=inputs,
        outputs={"Out": ["Out"], "State": [f"{s}_out" for s in states], "Reserve": ["Reserve"],
                 "DropoutState": ["DropoutState"]},
        attrs=attrs,
        grad_ops=[("rnn_grad",
                   {"Input": ["Input"], "PreState": states, "WeightList": names, "Out": ["Out"],
                    "Out@GRAD": ["Out@GRAD"]},
                   {"Input@GRAD": ["Input@GRAD"], "PreState@GRAD": [f"{s}@GRAD" for s in states],
                    "WeightList@GRAD": [f"{n}@GRAD" for n in names]},
                   attrs)],
        wrt=["Input", *states, *names],
        checked=["Out"],
    )


# Grad kernels that run sub-blocks: no one-op case can hold them. Their finite-difference
# checks run on whole Paddle-built programs (tests/test_control_flow.py,
# test_grads_match_finite_differences: cond, switch_case, while_loop, cond in while_loop).
CHECKED_IN_PROGRAMS = {"conditional_block_grad", "while_grad"}


SEQ_X = LoDTensor(away_from_zero(7, 3), [[0, 2, 2, 5, 7]])  # second sequence empty


def sequence_pool(pooltype: str) -> Case:
    attrs = {"pooltype": pooltype, "pad_value": 0.0}
    grad_in = {"X": ["X"], "Out@GRAD": ["Out@GRAD"]}
    outputs = {"Out": ["Out"]}
    if pooltype == "MAX":
        outputs["MaxIndex"] = ["MaxIndex"]
        grad_in["MaxIndex"] = ["MaxIndex"]
    return Case(
        id=f"sequence_pool-{pooltype}",
        op="sequence_pool",
        inputs={"X": [("X", SEQ_X)]},
        outputs=outputs,
        attrs=attrs,
        grad_ops=[("sequence_pool_grad", grad_in, {"X@GRAD": ["X@GRAD"]}, attrs)],
        wrt=["X"],
        checked=["Out"],
    )


def swce(case_id: str, logits: np.ndarray, label: np.ndarray, **attrs: Any) -> Case:
    return Case(
        id=case_id,
        op="softmax_with_cross_entropy",
        inputs={"Logits": [("Logits", logits)], "Label": [("Label", label)]},
        outputs={"Softmax": ["Softmax"], "Loss": ["Loss"]},
        attrs=attrs,
        grad_ops=[
            (
                "softmax_with_cross_entropy_grad",
                {"Label": ["Label"], "Softmax": ["Softmax"], "Loss@GRAD": ["Loss@GRAD"]},
                {"Logits@GRAD": ["Logits@GRAD"]},
                attrs,
            )
        ],
        wrt=["Logits"],
        checked=["Loss"],
    )


def reduce(op: str, x: np.ndarray, **attrs: Any) -> Case:
    return Case(
        id=f"{op}-{attrs}",
        op=op,
        inputs={"X": [("X", x)]},
        outputs={"Out": ["Out"]},
        attrs=attrs,
        grad_ops=[(f"{op}_grad", {"X": ["X"], "Out@GRAD": ["Out@GRAD"]}, {"X@GRAD": ["X@GRAD"]}, attrs)],
        wrt=["X"],
        checked=["Out"],
    )


# -- vision ops (ops/kernels/vision.py); grad ops wired as the catalogue's makers wire them


def conv(case_id: str, op: str, x: np.ndarray, w: np.ndarray, **attrs: Any) -> Case:
    return Case(
        id=case_id,
        op=op,
        inputs={"Input": [("Input", x)], "Filter": [("Filter", w)]},
        outputs={"Output": ["Output"]},
        attrs=attrs,
        grad_ops=[(f"{op}_grad", {"Input": ["Input"], "Filter": ["Filter"], "Output@GRAD": ["Output@GRAD"]},
                   {"Input@GRAD": ["Input@GRAD"], "Filter@GRAD": ["Filter@GRAD"]}, attrs)],
        wrt=["Input", "Filter"],
        checked=["Output"],
    )


def batch_norm(case_id: str, x: np.ndarray, channels: int, **attrs: Any) -> Case:
    stats = ("MeanOut", "VarianceOut", "SavedMean", "SavedVariance")
    return Case(
        id=case_id,
        op="batch_norm",
        inputs={"X": [("X", x)], "Scale": [("Scale", rand(channels))], "Bias": [("Bias", rand(channels))],
                "Mean": [("Mean", rand(channels))], "Variance": [("Variance", rand(channels, low=0.5, high=1.5))]},
        outputs={"Y": ["Y"], **{s: [s] for s in stats}},
        attrs=attrs,
        grad_ops=[("batch_norm_grad", {"X": ["X"], "Scale": ["Scale"], "Bias": ["Bias"], **{s: [s] for s in stats},
                                       "Y@GRAD": ["Y@GRAD"]},
                   {"X@GRAD": ["X@GRAD"], "Scale@GRAD": ["Scale@GRAD"], "Bias@GRAD": ["Bias@GRAD"]}, attrs)],
        wrt=["X", "Scale", "Bias"],
        checked=["Y"],
    )


def pool2d(case_id: str, x: np.ndarray, **attrs: Any) -> Case:
    return Case(
        id=case_id,
        op="pool2d",
        inputs={"X": [("X", x)]},
        outputs={"Out": ["Out"]},
        attrs=attrs,
        grad_ops=[("pool2d_grad", {"X": ["X"], "Out": ["Out"], "Out@GRAD": ["Out@GRAD"]}, {"X@GRAD": ["X@GRAD"]},
                   attrs)],
        wrt=["X"],
        checked=["Out"],
    )


VISION_CASES = [
    conv("conv2d-stride2-asymmetric-pad", "conv2d", rand(2, 3, 6, 5), rand(4, 3, 3, 3), strides=[2, 2],
         paddings=[1, 0, 2, 1]),
    conv("conv2d-nhwc-groups2-dilation2", "conv2d", rand(2, 7, 6, 4), rand(4, 2, 2, 3), groups=2, dilations=[2, 2],
         paddings=[1, 1], data_format="NHWC"),
    conv("conv2d-1x1", "conv2d", rand(2, 3, 3, 3), rand(2, 3, 1, 1)),
    conv("depthwise_conv2d-same", "depthwise_conv2d", rand(1, 4, 5, 5), rand(4, 1, 3, 3), groups=4, strides=[2, 2],
         padding_algorithm="SAME"),
    batch_norm("batch_norm-train", rand(3, 2, 3, 2), 2),
    batch_norm("batch_norm-train-nhwc", rand(2, 3, 2, 3), 3, data_layout="NHWC"),
    batch_norm("batch_norm-global-stats", rand(3, 2, 2, 2), 2, use_global_stats=True),
    pool2d("pool2d-max-3x3-s2-p1", rand(2, 2, 5, 5), pooling_type="max", ksize=[3, 3], strides=[2, 2],
           paddings=[1, 1]),
    pool2d("pool2d-avg-exclusive-pad", rand(1, 2, 5, 4), pooling_type="avg", ksize=[3, 2], strides=[2, 2],
           paddings=[1, 1]),
    pool2d("pool2d-avg-inclusive-ceil", rand(1, 2, 5, 5), pooling_type="avg", ksize=[2, 2], strides=[2, 2],
           ceil_mode=True, exclusive=False),
    pool2d("pool2d-avg-adaptive", rand(1, 2, 5, 7), pooling_type="avg", ksize=[2, 3], adaptive=True),
    Case(
        id="flatten_contiguous_range",
        op="flatten_contiguous_range",
        inputs={"X": [("X", rand(2, 3, 2, 2))]},
        outputs={"Out": ["Out"], "XShape": ["XShape"]},
        attrs={"start_axis": 1, "stop_axis": -1},
        grad_ops=[("flatten_contiguous_range_grad", {"XShape": ["XShape"], "Out@GRAD": ["Out@GRAD"]},
                   {"X@GRAD": ["X@GRAD"]}, {"start_axis": 1, "stop_axis": -1})],
        wrt=["X"],
        checked=["Out"],
    ),
]


LABELS = np.array([[2], [0], [3], [1]], dtype=np.int64)

CASES: list[Case] = [
    # -- recurrent
    rnn("LSTM", 4),
    rnn("GRU", 3),
    rnn("RNN_TANH", 1),
    # -- mul and elementwise
    Case(
        id="mul",
        op="mul",
        inputs={"X": [("X", rand(3, 4))], "Y": [("Y", rand(4, 2))]},
        outputs={"Out": ["Out"]},
        grad_ops=[("mul_grad", {"X": ["X"], "Y": ["Y"], "Out@GRAD": ["Out@GRAD"]}, {"X@GRAD": ["X@GRAD"], "Y@GRAD": ["Y@GRAD"]}, {})],
        wrt=["X", "Y"],
        checked=["Out"],
    ),
    Case(
        id="mul-num_col_dims",
        op="mul",
        inputs={"X": [("X", rand(2, 3, 2))], "Y": [("Y", rand(2, 2, 2))]},
        outputs={"Out": ["Out"]},
        attrs={"x_num_col_dims": 2, "y_num_col_dims": 1},
        grad_ops=[
            (
                "mul_grad",
                {"X": ["X"], "Y": ["Y"], "Out@GRAD": ["Out@GRAD"]},
                {"X@GRAD": ["X@GRAD"], "Y@GRAD": ["Y@GRAD"]},
                {"x_num_col_dims": 2, "y_num_col_dims": 1},
            )
        ],
        wrt=["X", "Y"],
        checked=["Out"],
    ),
    binary("elementwise_add", rand(2, 3, 4), rand(3), axis=1, case_id="elementwise_add-axis1"),
    binary("elementwise_add", rand(2, 3, 4), rand(3, 1), axis=1, case_id="elementwise_add-trim-trailing-1"),
    binary("elementwise_add", rand(2, 3), rand(3), axis=-1),
    binary("elementwise_add", rand(3), rand(2, 3), axis=-1, case_id="elementwise_add-x-smaller"),
    binary("elementwise_sub", rand(4, 3), rand(4, 1), axis=-1, case_id="elementwise_sub-same-rank"),
    binary("elementwise_sub", rand(2, 3, 4), rand(3, 4), axis=1, case_id="elementwise_sub-axis1"),
    binary("elementwise_mul", rand(2, 3), rand(2, 3)),
    binary("elementwise_mul", rand(2, 3, 2), rand(3), axis=1, case_id="elementwise_mul-axis1"),
    binary("elementwise_div", rand(2, 3), away_from_zero(3, margin=0.5), grad_in=("Y", "Out"), case_id="elementwise_div-paddle18"),
    binary("elementwise_div", rand(2, 3), away_from_zero(2, 3, margin=0.5), grad_in=("X", "Y"), case_id="elementwise_div-x"),
    binary("elementwise_max", np.array([[0.5, -1.0, 2.0]]), np.array([[0.1, -0.5, 3.0]])),
    binary("elementwise_min", np.array([[0.5, -1.0], [2.0, 0.3]]), np.array([0.1, 0.2])),
    binary("elementwise_pow", rand(2, 3, low=0.5, high=2.0), rand(2, 3, low=-1.5, high=1.5)),
    # -- activations
    unary("relu", away_from_zero(3, 4), "Out"),
    unary("tanh", rand(3, 4), "Out"),
    unary("sigmoid", rand(3, 4), "Out"),
    unary("exp", rand(3, 4), "Out"),
    unary("sqrt", rand(3, 4, low=0.3, high=2.0), "Out"),
    unary("square", rand(3, 4), "X"),
    unary("log", rand(3, 4, low=0.3, high=2.0), "X"),
    unary("abs", away_from_zero(3, 4), "X"),
    Case(
        id="floor",
        op="floor",
        inputs={"X": [("X", RNG.integers(-3, 3, size=(2, 3)) + rand(2, 3, low=0.2, high=0.8))]},
        outputs={"Out": ["Out"]},
        grad_ops=[("floor_grad", {"Out@GRAD": ["Out@GRAD"]}, {"X@GRAD": ["X@GRAD"]}, {})],
        wrt=["X"],
        checked=["Out"],
    ),
    unary("softmax", rand(3, 5), "Out", {"axis": -1}),
    unary("softmax", rand(2, 3, 4), "Out", {"axis": 1}, case_id="softmax-axis1"),
    unary("clip", np.array([[-0.9, -0.2, 0.1, 0.45, 0.8]]), "X", {"min": -0.5, "max": 0.5}),
    # -- reductions
    reduce("mean", rand(3, 4)),
    reduce("reduce_mean", rand(3, 4), reduce_all=True, dim=[0]),
    reduce("reduce_mean", rand(2, 3, 4), dim=[1], keep_dim=False),
    reduce("reduce_mean", rand(2, 3, 4), dim=[-1, 0], keep_dim=True),
    reduce("reduce_sum", rand(2, 3, 4), dim=[1], keep_dim=False),
    reduce("reduce_sum", rand(3, 4), reduce_all=True, dim=[0]),
    # -- scale, sum, assign, cast
    Case(
        id="scale",
        op="scale",
        inputs={"X": [("X", rand(3, 2))]},
        outputs={"Out": ["Out"]},
        attrs={"scale": 2.5, "bias": 0.7},
        grad_ops=[("scale", {"X": ["Out@GRAD"]}, {"Out": ["X@GRAD"]}, {"scale": 2.5, "bias": 0.0})],
        wrt=["X"],
        checked=["Out"],
    ),
    Case(
        id="scale-bias-before",
        op="scale",
        inputs={"X": [("X", rand(3, 2))]},
        outputs={"Out": ["Out"]},
        attrs={"scale": -1.5, "bias": 0.3, "bias_after_scale": False},
        grad_ops=[("scale", {"X": ["Out@GRAD"]}, {"Out": ["X@GRAD"]}, {"scale": -1.5, "bias": 0.0})],
        wrt=["X"],
        checked=["Out"],
    ),
    Case(
        id="sum",
        op="sum",
        inputs={"X": [("A", rand(2, 3)), ("B", rand(2, 3)), ("C", rand(2, 3))]},
        outputs={"Out": ["Out"]},
        grad_ops=[("scale", {"X": ["Out@GRAD"]}, {"Out": [f"{n}@GRAD"]}, {"scale": 1.0}) for n in "ABC"],
        wrt=["A", "B", "C"],
        checked=["Out"],
    ),
    Case(
        id="assign",
        op="assign",
        inputs={"X": [("X", rand(2, 3))]},
        outputs={"Out": ["Out"]},
        grad_ops=[("assign", {"X": ["Out@GRAD"]}, {"Out": ["X@GRAD"]}, {})],
        wrt=["X"],
        checked=["Out"],
    ),
    Case(
        id="cast-fp64-fp32",
        op="cast",
        inputs={"X": [("X", rand(2, 3))]},
        outputs={"Out": ["Out"]},
        attrs={"in_dtype": F64, "out_dtype": int(DType.FP32)},
        grad_ops=[("cast", {"X": ["Out@GRAD"]}, {"Out": ["X@GRAD"]}, {"in_dtype": int(DType.FP32), "out_dtype": F64})],
        wrt=["X"],
        checked=["Out"],
        h=1e-2,
        rtol=1e-4,
        atol=1e-4,
    ),
    # -- shape ops
    Case(
        id="concat",
        op="concat",
        inputs={"X": [("A", rand(2, 1)), ("B", rand(2, 3)), ("C", rand(2, 2))]},
        outputs={"Out": ["Out"]},
        attrs={"axis": 1},
        grad_ops=[
            (
                "concat_grad",
                {"X": ["A", "B", "C"], "Out@GRAD": ["Out@GRAD"]},
                {"X@GRAD": ["A@GRAD", "@EMPTY@", "C@GRAD"]},
                {"axis": 1},
            )
        ],
        wrt=["A", "C"],
        checked=["Out"],
    ),
    Case(
        id="reshape2",
        op="reshape2",
        inputs={"X": [("X", rand(4, 3, 2))]},
        outputs={"Out": ["Out"], "XShape": ["XShape"]},
        attrs={"shape": [2, 0, -1]},
        grad_ops=[("reshape2_grad", {"XShape": ["XShape"], "Out@GRAD": ["Out@GRAD"]}, {"X@GRAD": ["X@GRAD"]}, {})],
        wrt=["X"],
        checked=["Out"],
    ),
    Case(
        id="transpose2",
        op="transpose2",
        inputs={"X": [("X", rand(2, 3, 4))]},
        outputs={"Out": ["Out"], "XShape": ["XShape"]},
        attrs={"axis": [2, 0, 1]},
        grad_ops=[
            ("transpose2_grad", {"XShape": ["XShape"], "Out@GRAD": ["Out@GRAD"]}, {"X@GRAD": ["X@GRAD"]}, {"axis": [2, 0, 1]})
        ],
        wrt=["X"],
        checked=["Out"],
    ),
    # -- losses
    Case(
        id="cross_entropy-hard",
        op="cross_entropy",
        inputs={"X": [("X", probs(4, 5))], "Label": [("Label", np.array([[2], [0], [-100], [4]], dtype=np.int64))]},
        outputs={"Y": ["Y"]},
        grad_ops=[("cross_entropy_grad", {"X": ["X"], "Label": ["Label"], "Y@GRAD": ["Y@GRAD"]}, {"X@GRAD": ["X@GRAD"]}, {})],
        wrt=["X"],
        checked=["Y"],
    ),
    Case(
        id="cross_entropy-soft",
        op="cross_entropy",
        inputs={"X": [("X", probs(3, 4))], "Label": [("Label", probs(3, 4))]},
        outputs={"Y": ["Y"]},
        attrs={"soft_label": True},
        grad_ops=[
            ("cross_entropy_grad", {"X": ["X"], "Label": ["Label"], "Y@GRAD": ["Y@GRAD"]}, {"X@GRAD": ["X@GRAD"]}, {"soft_label": True})
        ],
        wrt=["X"],
        checked=["Y"],
    ),
    Case(
        id="cross_entropy2",
        op="cross_entropy2",
        inputs={"X": [("X", probs(4, 5))], "Label": [("Label", np.array([[2], [0], [-100], [4]], dtype=np.int64))]},
        outputs={"Y": ["Y"], "MatchX": ["MatchX"], "XShape": ["XShape"]},
        grad_ops=[
            (
                "cross_entropy_grad2",
                {"Label": ["Label"], "MatchX": ["MatchX"], "XShape": ["XShape"], "Y@GRAD": ["Y@GRAD"]},
                {"X@GRAD": ["X@GRAD"]},
                {},
            )
        ],
        wrt=["X"],
        checked=["Y"],
    ),
    swce("softmax_with_cross_entropy-hard", rand(4, 5, low=-2, high=2), LABELS),
    swce("softmax_with_cross_entropy-ignore", rand(4, 5), np.array([[1], [-100], [4], [0]], dtype=np.int64)),
    swce("softmax_with_cross_entropy-soft", rand(3, 4), probs(3, 4), soft_label=True),
    swce("softmax_with_cross_entropy-axis1", rand(2, 4, 3), RNG.integers(0, 4, size=(2, 1, 3)), axis=1),
    swce("softmax_with_cross_entropy-no-softmax", probs(4, 5), LABELS, use_softmax=False),
    # -- embeddings and sequences
    lookup("lookup_table", sparse=False),
    lookup("lookup_table", sparse=True),
    lookup("lookup_table", sparse=False, padding_idx=1),
    lookup("lookup_table_v2", sparse=False),
    lookup("lookup_table_v2", sparse=True, padding_idx=3),
    *(sequence_pool(p) for p in ("SUM", "AVERAGE", "SQRT", "MAX", "FIRST", "LAST")),
    *VISION_CASES,
]


# -- transformer ops (matmul_v2, ...): issue 25


def matmul_v2(x_shape: tuple[int, ...], y_shape: tuple[int, ...], trans_x: bool = False, trans_y: bool = False) -> Case:
    attrs = {"trans_x": trans_x, "trans_y": trans_y}
    return Case(
        id=f"matmul_v2-{list(x_shape)}{'T' if trans_x else ''}x{list(y_shape)}{'T' if trans_y else ''}",
        op="matmul_v2",
        inputs={"X": [("X", rand(*x_shape))], "Y": [("Y", rand(*y_shape))]},
        outputs={"Out": ["Out"]},
        attrs=attrs,
        grad_ops=[("matmul_v2_grad", {"X": ["X"], "Y": ["Y"], "Out@GRAD": ["Out@GRAD"]}, {"X@GRAD": ["X@GRAD"], "Y@GRAD": ["Y@GRAD"]}, attrs)],
        wrt=["X", "Y"],
        checked=["Out"],
    )


CASES += [
    matmul_v2((3, 4), (4, 2)),
    matmul_v2((4, 3), (4, 2), trans_x=True),
    matmul_v2((3, 4), (2, 4), trans_y=True),
    matmul_v2((2, 3, 4), (4, 5)),  # BERT's linear layers: batch of rows x weight
    matmul_v2((2, 2, 3, 4), (2, 2, 5, 4), trans_y=True),  # attention scores q k^T
    matmul_v2((2, 1, 3, 4), (3, 4, 2)),  # batch dims broadcast both ways
    matmul_v2((3, 4, 2), (3, 4), trans_x=True, trans_y=True),
    matmul_v2((4,), (4,)),  # dot product: a 0-d Out
    matmul_v2((4,), (2, 4, 3), trans_x=True),  # a 1-D X ignores trans_x
    matmul_v2((2, 3, 4), (4,), trans_y=True),
]


def layer_norm(shape: tuple[int, ...], axis: int, affine: bool = True) -> Case:
    attrs = {"begin_norm_axis": axis, "epsilon": 1e-5}
    right = int(np.prod(shape[axis:]))
    inputs = {"X": [("X", rand(*shape))]}
    grad_in: dict[str, list[str]] = {"X": ["X"], "Mean": ["Mean"], "Variance": ["Variance"], "Y@GRAD": ["Y@GRAD"]}
    grad_out = {"X@GRAD": ["X@GRAD"]}
    if affine:
        inputs.update({"Scale": [("Scale", rand(right, low=0.5, high=1.5))], "Bias": [("Bias", rand(right))]})
        grad_in.update({"Scale": ["Scale"], "Bias": ["Bias"]})
        grad_out.update({"Scale@GRAD": ["Scale@GRAD"], "Bias@GRAD": ["Bias@GRAD"]})
    return Case(
        id=f"layer_norm-{list(shape)}-axis{axis}{'' if affine else '-no-affine'}",
        op="layer_norm",
        inputs=inputs,
        outputs={"Y": ["Y"], "Mean": ["Mean"], "Variance": ["Variance"]},
        attrs=attrs,
        grad_ops=[("layer_norm_grad", grad_in, grad_out, attrs)],
        wrt=list(inputs),
        checked=["Y"],
    )


def dropout(impl: str, is_test: bool = False, seed_input: bool = False) -> Case:
    """Seeded (fix_seed / a Seed input), so every forward run of the check drops the same elements."""
    attrs = {"dropout_prob": 0.35, "dropout_implementation": impl, "is_test": is_test, "fix_seed": not seed_input, "seed": 7}
    inputs = {"X": [("X", rand(4, 5, 3))]}
    if seed_input:
        inputs["Seed"] = [("Seed", np.array([11], dtype=np.int32))]
    return Case(
        id=f"dropout-{impl}{'-test' if is_test else ''}{'-seed-input' if seed_input else ''}",
        op="dropout",
        inputs=inputs,
        outputs={"Out": ["Out"], "Mask": ["Mask"]},
        attrs=attrs,
        grad_ops=[("dropout_grad", {"Mask": ["Mask"], "Out@GRAD": ["Out@GRAD"]}, {"X@GRAD": ["X@GRAD"]}, attrs)],
        wrt=["X"],
        checked=["Out"],
    )


def slice_case(case_id: str, shape: tuple[int, ...], tensors: dict[str, list[np.ndarray]] | None = None, **attrs: Any) -> Case:
    inputs = {"Input": [("Input", rand(*shape))]}
    inputs.update({slot: [(f"{slot}{i}", v) for i, v in enumerate(vs)] for slot, vs in (tensors or {}).items()})
    return Case(
        id=f"slice-{case_id}",
        op="slice",
        inputs=inputs,
        outputs={"Out": ["Out"]},
        attrs=attrs,
        grad_ops=[("slice_grad", {**{s: [n for n, _ in args] for s, args in inputs.items()}, "Out@GRAD": ["Out@GRAD"]}, {"Input@GRAD": ["Input@GRAD"]}, attrs)],
        wrt=["Input"],
        checked=["Out"],
    )


CASES += [
    layer_norm((2, 3, 4), 2),  # BERT's: one row per token
    layer_norm((2, 3, 4), 1),
    layer_norm((5, 6), 1, affine=False),
    dropout("upscale_in_train"),
    dropout("downgrade_in_infer"),
    dropout("upscale_in_train", seed_input=True),
    dropout("upscale_in_train", is_test=True),
    dropout("downgrade_in_infer", is_test=True),
    unary("gelu", rand(3, 4, low=-3, high=3), "X", {"approximate": False}, case_id="gelu-erf"),
    unary("gelu", rand(3, 4, low=-3, high=3), "X", {"approximate": True}, case_id="gelu-tanh"),
    slice_case("bert-cls", (2, 5, 3), axes=[1], starts=[0], ends=[1], decrease_axis=[1], infer_flags=[1]),
    slice_case("negative-bounds", (4, 6), axes=[0, 1], starts=[-3, 1], ends=[100, -1]),
    slice_case(
        "tensors", (4, 6, 2), {"StartsTensor": [np.array([1, 2], dtype=np.int64)], "EndsTensorList": [np.array([3]), np.array([-1])]},
        axes=[0, 1], starts=[-1, -1], ends=[3, 5], infer_flags=[-1, -1],
    ),
    Case(
        id="tril_triu-lower",
        op="tril_triu",
        inputs={"X": [("X", rand(2, 4, 4))]},
        outputs={"Out": ["Out"]},
        attrs={"lower": True, "diagonal": -1},
        grad_ops=[("tril_triu_grad", {"Out@GRAD": ["Out@GRAD"]}, {"X@GRAD": ["X@GRAD"]}, {"lower": True, "diagonal": -1})],
        wrt=["X"],
        checked=["Out"],
    ),
    Case(
        id="tril_triu-upper",
        op="tril_triu",
        inputs={"X": [("X", rand(3, 5))]},
        outputs={"Out": ["Out"]},
        attrs={"lower": False, "diagonal": 1},
        grad_ops=[("tril_triu_grad", {"Out@GRAD": ["Out@GRAD"]}, {"X@GRAD": ["X@GRAD"]}, {"lower": False, "diagonal": 1})],
        wrt=["X"],
        checked=["Out"],
    ),
    Case(
        id="unsqueeze2",
        op="unsqueeze2",
        inputs={"X": [("X", rand(2, 3))]},
        outputs={"Out": ["Out"], "XShape": ["XShape"]},
        attrs={"axes": [-1, 0, -2]},
        grad_ops=[("unsqueeze2_grad", {"XShape": ["XShape"], "Out@GRAD": ["Out@GRAD"]}, {"X@GRAD": ["X@GRAD"]}, {"axes": [-1, 0, -2]})],
        wrt=["X"],
        checked=["Out"],
    ),
    Case(
        id="squared_l2_norm",
        op="squared_l2_norm",
        inputs={"X": [("X", rand(3, 4))]},
        outputs={"Out": ["Out"]},
        grad_ops=[("squared_l2_norm_grad", {"X": ["X"], "Out@GRAD": ["Out@GRAD"]}, {"X@GRAD": ["X@GRAD"]}, {})],
        wrt=["X"],
        checked=["Out"],
    ),
]


# ------------------------------------------------------------------ the harness


def _declare(block, name: str, value: Any = None) -> None:
    if block.has_var(name):
        return
    if value is None:
        block.create_var(name)
    else:
        array = value.array if isinstance(value, LoDTensor) else np.asarray(value)
        block.create_var(name, VarKind.LOD_TENSOR, DType.from_any(array.dtype), array.shape)


def build(case: Case, *, with_grads: bool) -> Program:
    program = Program.empty()
    block = program.global_block()
    for args in case.inputs.values():
        for name, value in args:
            _declare(block, name, value)
    for names in case.outputs.values():
        for name in names:
            _declare(block, name)
    block.add_op(
        case.op,
        {slot: [n for n, _ in args] for slot, args in case.inputs.items()},
        case.outputs,
        case.attrs,
    )
    if with_grads:
        for op_type, ins, outs, attrs in case.grad_ops:
            for names in (*ins.values(), *outs.values()):
                for name in names:
                    if name != "@EMPTY@":
                        _declare(block, name)
            block.add_op(op_type, ins, outs, attrs)
    return program


def feed_of(case: Case, overrides: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    feed = {}
    for args in case.inputs.values():
        for name, value in args:
            array = (overrides or {}).get(name)
            if array is None:
                feed[name] = value
            elif isinstance(value, LoDTensor):
                feed[name] = LoDTensor(array, value.lod)
            else:
                feed[name] = array
    return feed


def base_array(case: Case, name: str) -> np.ndarray:
    for args in case.inputs.values():
        for n, value in args:
            if n == name:
                return np.array(value.array if isinstance(value, LoDTensor) else value, dtype=np.float64)
    raise KeyError(name)


def dense(value: Any) -> np.ndarray:
    if isinstance(value, SelectedRows):
        return value.to_dense()
    return np.asarray(value)


def check_case(case: Case) -> None:
    """Raise AssertionError when an analytic grad differs from the central difference."""
    exe = Executor(seed=0)
    forward = build(case, with_grads=False)
    outs = exe.run(forward, feed=feed_of(case), fetch_list=case.checked, scope=Scope())
    upstream = {name: RNG.standard_normal(np.shape(out)) for name, out in zip(case.checked, outs, strict=True)}

    def objective(overrides: dict[str, np.ndarray]) -> float:
        values = exe.run(forward, feed=feed_of(case, overrides), fetch_list=case.checked, scope=Scope())
        return float(sum(np.sum(upstream[n] * np.asarray(v, dtype=np.float64)) for n, v in zip(case.checked, values, strict=True)))

    full = build(case, with_grads=True)
    grad_feed = {f"{n}@GRAD": upstream[n] for n in case.checked}
    analytic = exe.run(full, feed={**feed_of(case), **grad_feed}, fetch_list=[f"{n}@GRAD" for n in case.wrt], scope=Scope(), return_numpy=False)
    for name, got in zip(case.wrt, analytic, strict=True):
        base = base_array(case, name)
        got = dense(got.array if isinstance(got, LoDTensor) else got)
        assert got.shape == base.shape, f"{case.id}: {name}@GRAD has shape {got.shape}, expected {base.shape}"
        numeric = np.zeros_like(base)
        flat = numeric.reshape(-1)
        for i in range(base.size):
            plus, minus = base.copy(), base.copy()
            plus.reshape(-1)[i] += case.h
            minus.reshape(-1)[i] -= case.h
            dtype = np.asarray(base_value(case, name)).dtype
            flat[i] = (objective({name: plus.astype(dtype)}) - objective({name: minus.astype(dtype)})) / (2 * case.h)
        np.testing.assert_allclose(got, numeric, rtol=case.rtol, atol=case.atol, err_msg=f"{case.id}: d/d{name}")


def base_value(case: Case, name: str) -> Any:
    for args in case.inputs.values():
        for n, value in args:
            if n == name:
                return value.array if isinstance(value, LoDTensor) else value
    raise KeyError(name)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_gradient(case: Case) -> None:
    check_case(case)


def test_every_differentiable_kernel_is_checked() -> None:
    """A kernel registered with a grad needs a case here, the grad op it names must be
    exercised by one of its cases, and no grad kernel may exist that no case runs."""
    registry = differentiable_ops()
    missing = sorted(op for op in registry if not any(c.op == op for c in CASES))
    assert not missing, f"differentiable kernels without a gradient check: {missing}"
    unwired = sorted(
        op for op, grad in registry.items() if not any(c.op == op and any(g[0] == grad for g in c.grad_ops) for c in CASES)
    )
    assert not unwired, f"cases never run the grad op these kernels name: {unwired}"
    checked_grads = {g[0] for c in CASES for g in c.grad_ops}
    orphans = sorted(op for op in registered_ops() if op.endswith(("_grad", "_grad2")) and op not in checked_grads
                     and op not in CHECKED_IN_PROGRAMS)
    assert not orphans, f"grad kernels no gradient check runs: {orphans}"


def test_checker_catches_a_wrong_gradient() -> None:
    """The harness must fail on a kernel whose grad is off (here by a factor of 2)."""

    def forward(ctx) -> None:
        x = ctx.input("X")
        ctx.set_output("Out", x * x)

    def wrong_grad(ctx) -> None:
        ctx.set_output("X@GRAD", ctx.input("Out@GRAD") * ctx.input("X"))  # should be 2 * x

    register("test_bad_square", grad="test_bad_square_grad")(forward)
    register("test_bad_square_grad")(wrong_grad)
    try:
        with pytest.raises(AssertionError):
            check_case(unary("test_bad_square", rand(2, 2), "X"))
    finally:
        unregister("test_bad_square")
        unregister("test_bad_square_grad")


def test_completeness_check_catches_an_unchecked_kernel() -> None:
    register("test_unchecked_op", grad="test_unchecked_op_grad")(lambda ctx: None)
    try:
        with pytest.raises(AssertionError, match="test_unchecked_op"):
            test_every_differentiable_kernel_is_checked()
    finally:
        unregister("test_unchecked_op")
