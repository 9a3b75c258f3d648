"""The compiled one-pass Adam and sgd (`ops/kernels/_fused.c`) against the numpy paths they replace:
the same bits on every kind of value, in place and out of place, and the numpy path
wherever the compiled one cannot take the arrays."""

from __future__ import annotations

import numpy as np
import pytest

from ops.kernels import optimizers

# Edge values overflow and make NaNs on purpose, in both paths alike.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

_fused = pytest.importorskip("ops.kernels._fused", reason="the optional C extension is not built here")

EDGE = [0.0, -0.0, 1e-45, -1e-45, 1e-38, 3e38, -3e38, np.inf, -np.inf, np.nan, 1.0, -1.0, 0.1]


def _state(dtype, size: int, seed: int):
    rng = np.random.default_rng(seed)
    p, g, m1 = (rng.standard_normal(size).astype(dtype) for _ in range(3))
    m2 = np.abs(rng.standard_normal(size)).astype(dtype)
    # Edge values in every array, at positions that straddle the C loop's 512-element blocks.
    for array in (p, g, m1, m2):
        picks = rng.choice(size, min(size, 3 * len(EDGE)), replace=False)
        array[picks] = np.resize(np.array(EDGE, dtype), picks.size)
    m2[m2 < 0] = np.abs(m2[m2 < 0])
    return p, g, m1, m2


def _scalars(dtype):
    t = dtype.type
    b2p = t(0.999) ** 7
    return t(0.9), t(0.999), t(0.001) * np.sqrt(t(1) - b2p) / (t(1) - t(0.9) ** 7), t(1e-8) * np.sqrt(t(1) - b2p)


def _numpy_path(monkeypatch, *args, **kwargs):
    monkeypatch.setattr(optimizers, "FUSED", False)
    try:
        return optimizers._adam_dense(*args, **kwargs)
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float64)], ids=str)
@pytest.mark.parametrize("size", [1, 511, 512, 513, 4099, 401408])
def test_same_bits_as_numpy_into_new_and_recycled_arrays(monkeypatch, dtype, size):
    p, g, m1, m2 = _state(dtype, size, seed=size)
    scalars = _scalars(dtype)
    expected = _numpy_path(monkeypatch, p, g, m1, m2, *scalars)
    assert optimizers.FUSED
    got_new = optimizers._adam_dense(p, g, m1, m2, *scalars)
    recycled = tuple(np.full_like(p, 7) for _ in range(3))
    got_recycled = optimizers._adam_dense(p, g, m1, m2, *scalars, into=recycled)
    assert all(a is b for a, b in zip(got_recycled, recycled, strict=True))
    for want, new, old in zip(expected, got_new, got_recycled, strict=True):
        assert want.dtype == new.dtype == dtype
        assert want.tobytes() == new.tobytes() == old.tobytes()


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float64)], ids=str)
def test_in_place_as_a_sync_pserver_updates_gives_the_same_bits(monkeypatch, dtype):
    p, g, m1, m2 = _state(dtype, 1500, seed=3)
    scalars = _scalars(dtype)
    expected = _numpy_path(monkeypatch, p.copy(), g, m1.copy(), m2.copy(), *scalars)
    out = optimizers._adam_dense(p, g, m1, m2, *scalars, into=(p, m1, m2))
    assert out[0] is p and out[1] is m1 and out[2] is m2
    for want, got in zip(expected, (p, m1, m2), strict=True):
        assert want.tobytes() == got.tobytes()


@pytest.mark.parametrize("case", ["strided grad", "float64 grad", "float64 scalar", "float16 param", "2-D, one moment transposed"])
def test_arrays_it_cannot_take_go_the_numpy_way(monkeypatch, case):
    dtype = np.dtype(np.float32)
    p, g, m1, m2 = _state(dtype, 64, seed=5)
    scalars = list(_scalars(dtype))
    if case == "strided grad":
        g = np.repeat(g, 2)[::2]
    elif case == "float64 grad":
        g = g.astype(np.float64)
    elif case == "float64 scalar":
        scalars[2] = np.float64(scalars[2])
    elif case == "float16 param":
        p = p.astype(np.float16)
    else:
        p, g, m1, m2 = (a.reshape(8, 8) for a in (p, g, m1, m2))
        m2 = np.ascontiguousarray(m2.T).T
    others = (g, m1, m2)
    assert not optimizers._fusable(p, others, tuple(scalars))
    calls = []
    monkeypatch.setattr(optimizers, "_fused", type("Spy", (), {"adam": staticmethod(lambda *a: calls.append(a))}))
    optimizers._adam_dense(p, g, m1, m2, *scalars)
    assert calls == []


def test_bad_buffers_are_errors_not_memory_writes():
    f32 = np.zeros(8, np.float32)
    args = (0.9, 0.999, 0.001, 1e-8)
    with pytest.raises(TypeError, match="float32 or float64"):
        _fused.adam(np.zeros(8, np.int32), f32, f32, f32, f32.copy(), f32.copy(), f32.copy(), *args)
    with pytest.raises(ValueError, match="grad differs"):
        _fused.adam(f32, np.zeros(9, np.float32), f32, f32, f32.copy(), f32.copy(), f32.copy(), *args)
    with pytest.raises(ValueError, match="moment2_out differs"):
        _fused.adam(f32, f32, f32, f32, f32.copy(), f32.copy(), np.zeros(8, np.float64), *args)
    frozen = np.zeros(8, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(TypeError, match="param_out must be a C-contiguous writable"):
        _fused.adam(f32, f32, f32, f32, frozen, f32.copy(), f32.copy(), *args)
    with pytest.raises(TypeError, match="grad must be a C-contiguous"):
        _fused.adam(f32, np.zeros(16, np.float32)[::2], f32, f32, f32.copy(), f32.copy(), f32.copy(), *args)
    little = np.zeros(8, "<f4")  # an explicit byte order is still native here
    _fused.adam(little, little, little, little, little.copy(), little.copy(), little.copy(), *args)


# ------------------------------------------------------------------------------ sgd


def _sgd_numpy(monkeypatch, param, grad, lr):
    """The sgd kernel's numpy path on a sync pserver (in place), FUSED off."""
    monkeypatch.setattr(optimizers, "FUSED", False)
    try:
        return np.subtract(param, np.multiply(grad, lr, dtype=param.dtype), out=param)
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float64)], ids=str)
@pytest.mark.parametrize("size", [1, 511, 513, 401408])
def test_sgd_in_place_gives_numpys_bits(monkeypatch, dtype, size):
    p, g, _, _ = _state(dtype, size, seed=size)
    lr = dtype.type(0.0137)
    expected = _sgd_numpy(monkeypatch, p.copy(), g, lr)
    _fused.sgd(p, g, lr)
    assert p.tobytes() == expected.tobytes()


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float64)], ids=str)
def test_the_sgd_kernel_updates_a_sync_pservers_param_through_the_compiled_loop(monkeypatch, dtype):
    """Where the run allows it (a sync pserver), `sgd` updates the param in its own array in
    one compiled pass: numpy's bits, and no param-sized or chunk-sized temporary."""
    from ops.executor import Executor  # noqa: PLC0415
    from ops.kernels import register, unregister  # noqa: PLC0415
    from ops.scope import Scope  # noqa: PLC0415
    from ops.tensor import LoDTensor  # noqa: PLC0415
    from transpiler.ir import Program  # noqa: PLC0415

    @register("test_allow_in_place_sgd")
    def allow(ctx) -> None:
        ctx.run.update_in_place = True

    p, g, _, _ = _state(dtype, 4099, seed=11)
    lr = np.array([0.05], dtype)
    program = Program.empty()
    block = program.global_block()
    block.add_op("test_allow_in_place_sgd", {}, {}, {})
    block.add_op("sgd", {"Param": ["w"], "Grad": ["g"], "LearningRate": ["lr"]}, {"ParamOut": ["w"]}, {})
    calls, real = [], _fused.sgd
    monkeypatch.setattr(optimizers, "_fused", type("Spy", (), {"sgd": staticmethod(
        lambda *a: (calls.append(a[2]), real(*a)))}))
    param = p.copy()
    scope = Scope()
    scope.set_var("w", LoDTensor(param))
    try:
        Executor().run(program, feed={"g": g, "lr": lr}, scope=scope)
    finally:
        unregister("test_allow_in_place_sgd")
    monkeypatch.undo()
    want = _sgd_numpy(monkeypatch, p.copy(), g, dtype.type(lr[0]))
    got = scope.find_var("w").array
    assert got is param and got.tobytes() == want.tobytes()
    assert calls == [dtype.type(lr[0])] and type(calls[0]) is dtype.type


def test_sgd_bad_buffers_are_errors():
    f32 = np.zeros(8, np.float32)
    with pytest.raises(TypeError, match="sgd: param must be float32 or float64"):
        _fused.sgd(np.zeros(8, np.int32), f32, 0.1)
    with pytest.raises(ValueError, match="sgd: grad differs"):
        _fused.sgd(f32, np.zeros(8, np.float64), 0.1)
    frozen = np.zeros(8, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(TypeError, match="sgd: param must be a C-contiguous writable"):
        _fused.sgd(frozen, f32, 0.1)
