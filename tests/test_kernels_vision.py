"""The vision kernels (ops/kernels/vision.py) against Paddle 2.6's own CPU kernels.

Each case runs one op with its attrs and the grad op(s) our catalogue's grad maker builds,
on random inputs and a random upstream grad, here and in Paddle 2.6 (tools/paddle_run_ops.py,
one subprocess for every case: Paddle's own op desc, CPU kernel, grad maker and grad kernel),
and compares every forward output, the state an op updates (batch_norm's moving mean and
variance) and every input grad. float64 cases must agree to 1e-10 (rounding only), the
float32 ones to 1e-5. Skipped, with the reason, when the Paddle 2.6.2 venv is absent
(tools/paddle_env.py makes it).

The attr combinations: conv2d strides, dilations, symmetric / asymmetric (4-value)
paddings, `SAME` (which also resets dilations) and `VALID`, groups, NCHW and NHWC, 1x1
(the no-im2col path) and ResNet's 7x7/2 stem; depthwise_conv2d; batch_norm in training,
`is_test`, `use_global_stats`, `is_test` with `trainable_statistics`, NHWC and 2-D input;
pool2d max / avg, `exclusive` on and off, `ceil_mode`, `adaptive` (uneven bins),
`global_pooling`, `SAME` / `VALID`, asymmetric paddings and NHWC;
flatten_contiguous_range over several axis ranges.

What these comparisons found of Paddle 2.6's CPU kernels (the kernels follow Paddle):
- pool2d `max` with `adaptive=True` is not adaptive (Paddle's kernel hands its max functor
  adaptive=false): a ksize window slid by `strides` from the corner, to ksize cells
  (`max-adaptive-3x2-uneven`; Paddle's Python API pools adaptively with another op);
- a non-`exclusive` average counts the cells inside the input and its leading padding,
  which also stands for the trailing one (`avg-ceil-mode-inclusive`: 6, not 9, at the edge);
- the avg-pool grad multiplies by 1/count rounded to float32, even for float64 tensors;
- FLOAT attrs (batch_norm's momentum, epsilon) are float32 values (0.9 is 0.8999999762);
- batch_norm_grad with `is_test` differentiates through the moving stats even when
  `trainable_statistics` made the forward use the batch's;
- with global stats, batch_norm leaves SavedMean / SavedVariance unset (not compared;
  ours writes zeros).
"""

from __future__ import annotations

import json
import os
import subprocess
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from conftest import TESTS
from ops import catalogue
from ops.catalogue import GradContext
from ops.executor import ExecutionError, Executor
from ops.scope import Scope
from ops.testing import run_op
from transpiler.ir import DType, Program

REPO = TESTS.parent
RNG = np.random.default_rng(20261126)


def _paddle_python():
    import sys

    sys.path.insert(0, str(REPO / "tools"))
    try:
        import paddle_env
    finally:
        sys.path.pop(0)
    return paddle_env.installed("2.6.2")


@dataclass
class Case:
    id: str
    op: str
    inputs: dict[str, list[tuple[str, np.ndarray]]]
    outputs: dict[str, list[str]]
    attrs: dict[str, Any]
    grads: list[str]
    targets: list[str]
    state: list[str] = field(default_factory=list)
    compared: list[str] = field(default_factory=list)  # outputs compared besides targets and state

    @property
    def dtype(self) -> np.dtype:
        return next(v for args in self.inputs.values() for _, v in args).dtype

    @property
    def rtol(self) -> float:
        return 1e-10 if self.dtype == np.float64 else 1e-5


def _x(*shape: int, dtype=np.float64) -> np.ndarray:
    return RNG.standard_normal(shape).astype(dtype)


def conv(cid: str, x_shape, w_shape, op: str = "conv2d", dtype=np.float64, **attrs) -> Case:
    return Case(cid, op, {"Input": [("x", _x(*x_shape, dtype=dtype))], "Filter": [("w", _x(*w_shape, dtype=dtype))]},
                {"Output": ["y"]}, attrs, grads=["x", "w"], targets=["y"])


def bn(cid: str, x_shape, channels: int, dtype=np.float64, **attrs) -> Case:
    stats = {"Mean": [("mean", _x(channels, dtype=dtype))],
             "Variance": [("var", RNG.uniform(0.5, 2.0, channels).astype(dtype))]}
    return Case(cid, "batch_norm",
                {"X": [("x", _x(*x_shape, dtype=dtype) * 2 + 0.5)], "Scale": [("scale", _x(channels, dtype=dtype))],
                 "Bias": [("bias", _x(channels, dtype=dtype))], **stats},
                {"Y": ["y"], "MeanOut": ["mean"], "VarianceOut": ["var"], "SavedMean": ["saved_mean"],
                 "SavedVariance": ["saved_var"]},
                {"epsilon": 1e-5, "momentum": 0.9, **attrs}, grads=["x", "scale", "bias"], targets=["y"],
                state=["mean", "var"], compared=["saved_mean", "saved_var"] if not attrs.get("use_global_stats") and not (
                    attrs.get("is_test") and not attrs.get("trainable_statistics")) else [])


def pool(cid: str, x_shape, dtype=np.float64, **attrs) -> Case:
    return Case(cid, "pool2d", {"X": [("x", _x(*x_shape, dtype=dtype))]}, {"Out": ["y"]}, attrs, grads=["x"],
                targets=["y"])


def flatten(cid: str, x_shape, start: int, stop: int) -> Case:
    return Case(cid, "flatten_contiguous_range", {"X": [("x", _x(*x_shape))]}, {"Out": ["y"], "XShape": ["xshape"]},
                {"start_axis": start, "stop_axis": stop}, grads=["x"], targets=["y"])


X = (2, 4, 7, 7)
CASES = [
    conv("conv-3x3-pad1", X, (6, 4, 3, 3), strides=[1, 1], paddings=[1, 1]),
    conv("conv-stride2-dilation2", X, (6, 4, 3, 3), strides=[2, 2], paddings=[1, 1], dilations=[2, 2]),
    conv("conv-asymmetric-paddings", X, (5, 4, 3, 2), strides=[2, 1], paddings=[0, 1, 2, 1]),
    conv("conv-same-resets-dilation", X, (6, 4, 3, 3), strides=[2, 2], dilations=[2, 2], padding_algorithm="SAME"),
    conv("conv-valid", (2, 4, 8, 6), (6, 4, 3, 3), strides=[2, 2], paddings=[5, 5], padding_algorithm="VALID"),
    conv("conv-groups2", X, (6, 2, 3, 3), groups=2, paddings=[1, 1]),
    conv("conv-nhwc-groups2-stride2", (2, 7, 6, 4), (6, 2, 3, 3), groups=2, strides=[2, 2], paddings=[1, 1],
         data_format="NHWC"),
    conv("conv-1x1", X, (8, 4, 1, 1)),
    conv("conv-1x1-stride2", X, (8, 4, 1, 1), strides=[2, 2]),
    conv("conv-stem-7x7-stride2-pad3", (2, 3, 12, 12), (4, 3, 7, 7), strides=[2, 2], paddings=[3, 3]),
    conv("conv-float32", X, (6, 4, 3, 3), dtype=np.float32, strides=[2, 2], paddings=[1, 1]),
    conv("depthwise-multiplier2", X, (8, 1, 3, 3), op="depthwise_conv2d", groups=4, strides=[2, 2], paddings=[1, 1]),
    bn("bn-train", X, 4),
    bn("bn-train-nhwc", (2, 5, 3, 4), 4, data_layout="NHWC"),
    bn("bn-train-2d", (6, 4), 4),
    bn("bn-train-float32", X, 4, dtype=np.float32),
    bn("bn-is-test", X, 4, is_test=True),
    bn("bn-use-global-stats", X, 4, use_global_stats=True),
    bn("bn-is-test-trainable-statistics", X, 4, is_test=True, trainable_statistics=True),
    pool("max-3x3-s2-p1", (2, 3, 8, 8), pooling_type="max", ksize=[3, 3], strides=[2, 2], paddings=[1, 1]),
    pool("avg-exclusive-pad", X, pooling_type="avg", ksize=[3, 3], strides=[2, 2], paddings=[1, 1]),
    pool("avg-inclusive-pad", X, pooling_type="avg", ksize=[3, 3], strides=[2, 2], paddings=[1, 1], exclusive=False),
    pool("max-ceil-mode", (2, 3, 8, 8), pooling_type="max", ksize=[3, 3], strides=[2, 2], ceil_mode=True),
    pool("avg-ceil-mode-inclusive", (2, 3, 8, 8), pooling_type="avg", ksize=[3, 3], strides=[2, 2], ceil_mode=True,
         exclusive=False),
    pool("avg-adaptive-1x1", X, pooling_type="avg", ksize=[1, 1], adaptive=True),
    pool("max-adaptive-3x2-uneven", X, pooling_type="max", ksize=[3, 2], adaptive=True),
    pool("avg-adaptive-3x3-uneven", (2, 3, 8, 7), pooling_type="avg", ksize=[3, 3], adaptive=True),
    pool("avg-global", X, pooling_type="avg", ksize=[2, 2], global_pooling=True),
    pool("max-global", X, pooling_type="max", ksize=[2, 2], global_pooling=True),
    pool("max-same", X, pooling_type="max", ksize=[3, 3], strides=[2, 2], padding_algorithm="SAME"),
    pool("avg-valid", X, pooling_type="avg", ksize=[2, 3], strides=[2, 2], paddings=[1, 1], padding_algorithm="VALID"),
    pool("avg-asymmetric-paddings", X, pooling_type="avg", ksize=[3, 3], strides=[2, 2], paddings=[0, 1, 2, 1]),
    pool("max-nhwc", (2, 7, 6, 3), pooling_type="max", ksize=[3, 3], strides=[2, 2], paddings=[1, 1],
         data_format="NHWC"),
    pool("avg-float32", X, dtype=np.float32, pooling_type="avg", ksize=[3, 3], strides=[2, 2], paddings=[1, 1]),
    flatten("flatten-1-3", (2, 3, 4, 5), 1, 3),
    flatten("flatten-all", (2, 3, 4), 0, -1),
    flatten("flatten-2-2", (2, 3, 4, 5), 2, 2),
]


def upstream(case: Case, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(zlib.crc32(case.id.encode()))
    return {f"{t}@GRAD": rng.standard_normal(shapes[t]).astype(case.dtype) for t in case.targets}


def ours(case: Case) -> dict[str, np.ndarray]:
    """The forward op and the grad op(s) our catalogue builds for it, run by our executor."""
    program = Program.empty()
    block = program.global_block()
    feed = {}
    for args in case.inputs.values():
        for name, value in args:
            block.create_var(name, dtype=DType.from_any(value.dtype), shape=value.shape)
            feed[name] = value
    outs = [n for ns in case.outputs.values() for n in ns]
    for name in outs:
        if not block.has_var(name):
            block.create_var(name)
    forward = block.add_op(case.op, {s: [n for n, _ in a] for s, a in case.inputs.items()}, case.outputs, case.attrs)
    exe = Executor(seed=0)
    values = exe.run(program, feed=dict(feed), fetch_list=outs, scope=Scope())
    result = dict(zip(outs, values, strict=True))
    grads = upstream(case, {t: np.shape(result[t]) for t in case.targets})
    entry = catalogue.require(case.op)
    for grad_op in entry.grad(GradContext(forward)):
        for names in (*grad_op.inputs.values(), *grad_op.outputs.values()):
            for name in names:
                if not block.has_var(name):
                    block.create_var(name)
        block.add_op(grad_op)
    wanted = [f"{n}@GRAD" for n in case.grads]
    values = exe.run(program, feed={**feed, **grads}, fetch_list=wanted, scope=Scope())
    result.update(zip(wanted, values, strict=True))
    return {k: np.asarray(v) for k, v in result.items()}


@pytest.fixture(scope="module")
def paddle_results(tmp_path_factory) -> dict[str, np.ndarray]:
    python = _paddle_python()
    if python is None:
        pytest.skip("the Paddle 2.6.2 venv is absent (python3 tools/paddle_env.py 2.6.2 makes it)")
    tmp = tmp_path_factory.mktemp("paddle_vision")
    arrays, specs = {}, []
    for case in CASES:
        for args in case.inputs.values():
            for name, value in args:
                arrays[f"{case.id}/{name}"] = value
        shapes = {t: np.shape(ours(case)[t]) for t in case.targets}
        for name, value in upstream(case, shapes).items():
            arrays[f"{case.id}/{name}"] = value
        # Paddle's batch_norm kernel needs its ReserveSpace output (cuDNN's workspace; ours writes none)
        outputs = {**case.outputs, "ReserveSpace": ["reserve"]} if case.op == "batch_norm" else case.outputs
        specs.append({"id": case.id, "op": case.op, "inputs": {s: [n for n, _ in a] for s, a in case.inputs.items()},
                      "outputs": outputs, "fetch": [*case.targets, *case.compared], "attrs": case.attrs, "state": case.state, "grads": case.grads,
                      "targets": case.targets})
    (tmp / "cases.json").write_text(json.dumps(specs))
    np.savez(tmp / "inputs.npz", **arrays)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOG_minloglevel": "2"}
    done = subprocess.run([str(python), str(REPO / "tools" / "paddle_run_ops.py"), str(tmp / "cases.json"),
                           str(tmp / "inputs.npz"), str(tmp / "out.npz")], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(np.load(tmp / "out.npz"))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_forward_and_grads_match_paddle(case: Case, paddle_results) -> None:
    got = ours(case)
    names = [*case.targets, *case.state, *case.compared, *(f"{n}@GRAD" for n in case.grads)]
    for name in names:
        want = paddle_results[f"{case.id}/{name}"]
        assert got[name].shape == want.shape, f"{case.id}: {name}: shape {got[name].shape}, Paddle's {want.shape}"
        assert got[name].dtype == want.dtype, f"{case.id}: {name}: dtype {got[name].dtype}, Paddle's {want.dtype}"
        np.testing.assert_allclose(got[name], want, rtol=case.rtol, atol=case.rtol, err_msg=f"{case.id}: {name}")


def test_xshape_is_paddles():
    got = ours(flatten("flatten", (2, 3, 4, 5), 1, 3))
    assert got["xshape"].shape == (0, 2, 3, 4, 5) and got["y"].shape == (2, 60)


def test_batch_norm_momentum_tensor_overrides_the_attr():
    x, c = _x(4, 3, 2, 2), 3
    inputs = {"X": x, "Scale": np.ones(c), "Bias": np.zeros(c), "Mean": np.zeros(c), "Variance": np.ones(c)}
    outs = ("Y", "MeanOut", "VarianceOut", "SavedMean", "SavedVariance")
    by_attr = run_op("batch_norm", inputs, outs, {"momentum": 0.5})
    by_tensor = run_op("batch_norm", {**inputs, "MomentumTensor": np.array([0.5])}, outs, {"momentum": 0.9})
    np.testing.assert_array_equal(by_attr["MeanOut"], by_tensor["MeanOut"])
    np.testing.assert_allclose(by_attr["MeanOut"], 0.5 * x.mean(axis=(0, 2, 3)))
    np.testing.assert_allclose(by_attr["SavedVariance"], 1 / np.sqrt(x.var(axis=(0, 2, 3)) + 1e-5))


@pytest.mark.parametrize("op, inputs, attrs, message", [
    ("conv2d", {"Input": np.zeros((1, 3, 5, 5)), "Filter": np.zeros((4, 2, 3, 3))}, {}, "groups=1"),
    ("conv2d", {"Input": np.zeros((1, 3, 5, 5)), "Filter": np.zeros((4, 3, 3, 3))}, {"data_format": "NCDHW"},
     "NCDHW"),
    ("conv2d", {"Input": np.zeros((1, 3, 5, 5)), "Filter": np.zeros((4, 3, 3, 3))}, {"padding_algorithm": "FULL"},
     "FULL"),
    ("pool2d", {"X": np.zeros((1, 3, 5, 5))}, {"pooling_type": "lp", "ksize": [2, 2]}, "lp"),
    ("batch_norm", {"X": np.zeros(3), "Scale": np.ones(3), "Bias": np.ones(3), "Mean": np.ones(3),
                    "Variance": np.ones(3)}, {}, "at least 2 dims"),
])
def test_bad_attrs_and_shapes_are_clear_errors(op, inputs, attrs, message):
    outs = {"conv2d": ("Output",), "pool2d": ("Out",)}.get(op, ("Y", "MeanOut", "VarianceOut"))
    with pytest.raises(ExecutionError, match=message):
        run_op(op, inputs, outs, attrs)


@pytest.mark.parametrize("case", ["resnet50_momentum_4ps_sync", "resnet_small_momentum_3ps_sync"])
def test_shape_rules_give_the_shapes_paddle_declared(case):
    """The catalogue's shape rules (ops/catalogue/vision_ops.py) on every vision op of the
    Paddle-built ResNets give the output shapes Paddle declared (batch -1 included)."""
    from conftest import PADDLE_PROGRAMS
    from ops.catalogue import ShapeContext, TensorInfo

    block = Program.load(PADDLE_PROGRAMS / case / "main.pb").global_block()
    checked = 0
    for op in block.ops:
        entry = catalogue.get(op.type)
        if entry is None or entry.family != "vision":
            continue
        infos = {slot: tuple(TensorInfo(block.var(n).dtype, block.var(n).shape) for n in args)
                 for slot, args in op.inputs.items()}
        result = entry.infer_shape(ShapeContext(op.type, infos, op.attr_values()))
        for slot, got in result.items():
            for name, info in zip(op.output(slot), got, strict=False):
                assert tuple(info.shape) == tuple(block.var(name).shape), (op.type, slot, name)
                checked += 1
    assert checked > 70
