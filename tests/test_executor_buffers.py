"""Kernels computing into recycled output arrays (`OpContext.output_buffer`): the bytes
are those of new arrays, an array comes back only once nothing can see it (not in the
scope, not fetched, not viewed, not held by another reader), and no two live vars share
one."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from conftest import PADDLE_PROGRAMS

from ops.executor import Executor
from ops.kernels import context
from ops.kernels.optimizers import RECYCLE_FROM_ELEMENTS
from ops.scope import Scope
from ops.tensor import LoDTensor, SelectedRows
from transpiler.ir import Program

STEPS = 4
BATCH = 8


def program_with(*ops: tuple) -> Program:
    program = Program.empty()
    for op_type, inputs, outputs, attrs in ops:
        program.global_block().add_op(op_type, inputs, outputs, attrs)
    return program


def mlp_feed(step: int) -> dict[str, np.ndarray]:
    """A batch for the `mlp_adam_2ps` fixture: 784 floats and a class id per example."""
    rng = np.random.default_rng(step)
    return {"img": (rng.standard_normal((BATCH, 784)) * 0.1).astype(np.float32),
            "label": rng.integers(0, 10, (BATCH, 1))}


def address(array: np.ndarray) -> int:
    """Where an array's data starts (an int: keeps no reference to the array)."""
    return array.__array_interface__["data"][0]


def train(recycle: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, bytes], list[dict[str, int]]]:
    """STEPS steps of the Paddle-built MLP with Adam: every var's final bytes, and where
    each large param's array was after each step (small ones are new arrays every step)."""
    if not recycle:  # no reference count ever matches: every output is a new array
        monkeypatch.setattr(context, "SOLE_LOCAL_REFERENCES", -1)
    folder = PADDLE_PROGRAMS / "mlp_adam_2ps"
    startup, main = Program.load(folder / "startup.pb"), Program.load(folder / "main.pb")
    scope, exe = Scope(), Executor(seed=3)
    exe.run(startup, scope=scope)
    params = [name for name, var in main.global_block().vars.items()
              if var.is_parameter and np.prod(var.shape) >= RECYCLE_FROM_ELEMENTS]
    assert len(params) == 2  # h1.w and h2.w
    places = []
    for step in range(STEPS):
        exe.run(main, feed=mlp_feed(step), scope=scope)
        places.append({name: address(scope.find_var(name).array) for name in params})
    final = {name: scope.find_var(name).array.tobytes() for name in scope.local_names()
             if isinstance(scope.find_var(name), LoDTensor)}
    return final, places


def test_reused_arrays_hold_the_bytes_new_arrays_would(monkeypatch):
    reused, places = train(True, monkeypatch)
    with monkeypatch.context() as patch:
        fresh, fresh_places = train(False, patch)
    assert reused.keys() == fresh.keys()
    assert [name for name in fresh if reused[name] != fresh[name]] == []
    # and reuse did happen: nothing but the scope holds the params, so Adam updates them
    # where they are (`OpContext.may_update_in_place`), where without it every step makes new ones
    assert all(step == places[0] for step in places)
    assert all(fresh_places[1][name] != fresh_places[0][name] for name in fresh_places[0])


def matmul_program() -> Program:
    return program_with(("mul", {"X": ["x"], "Y": ["w"]}, {"Out": ["y"]}, {}))


MATMUL = matmul_program()


def run_matmul(exe: Executor, scope: Scope, k: int) -> list:
    """y = k * ones(2, 3) @ ones(3, 4): every element 3k."""
    x = np.full((2, 3), float(k), np.float32)
    return exe.run(MATMUL, feed={"x": x, "w": np.ones((3, 4), np.float32)}, fetch_list=["y"], scope=scope)


def test_an_output_array_comes_back_once_nothing_holds_it():
    exe, scope = Executor(), Scope()
    run_matmul(exe, scope, 1)
    first = address(scope.find_var("y").array)
    run_matmul(exe, scope, 2)  # displaces the first array, which nothing holds any more
    run_matmul(exe, scope, 3)
    assert address(scope.find_var("y").array) == first
    assert scope.find_var("y").array.tolist() == [[9.0] * 4] * 2


@pytest.mark.parametrize("holder", ["fetched view", "LoDTensor", "slice"])
def test_an_array_someone_holds_is_never_written_again(holder):
    exe, scope = Executor(), Scope()
    (fetched,) = run_matmul(exe, scope, 1)
    kept = {"fetched view": fetched, "LoDTensor": scope.find_var("y"), "slice": scope.find_var("y").array[1:]}[holder]
    del fetched
    for k in range(2, 6):
        run_matmul(exe, scope, k)
    array = kept.array if isinstance(kept, LoDTensor) else kept
    assert np.all(array == 3.0)
    assert address(scope.find_var("y").array) != address(array)


ADAM = program_with(("adam", {
    "Param": ["w"], "Grad": ["g"], "Moment1": ["m1"], "Moment2": ["m2"], "LearningRate": ["lr"],
    "Beta1Pow": ["b1p"], "Beta2Pow": ["b2p"]}, {
    "ParamOut": ["w"], "Moment1Out": ["m1"], "Moment2Out": ["m2"], "Beta1PowOut": ["b1p"], "Beta2PowOut": ["b2p"]}, {}))


def adam_scope() -> Scope:
    scope = Scope()
    rng = np.random.default_rng(0)
    for name in ("w", "m1"):
        scope.set_var(name, LoDTensor(rng.standard_normal(5000).astype(np.float32)))
    scope.set_var("m2", LoDTensor(np.abs(rng.standard_normal(5000)).astype(np.float32)))
    for name, value in (("lr", 0.01), ("b1p", 0.9), ("b2p", 0.999)):
        scope.set_var(name, LoDTensor(np.array([value], np.float32)))
    return scope


def run_adam(exe: Executor, scope: Scope, step: int, *, fetch: bool = False) -> list:
    grad = np.random.default_rng(step).standard_normal(5000).astype(np.float32)
    return exe.run(ADAM, feed={"g": grad}, fetch_list=["w"] if fetch else [], scope=scope)


def test_adam_updates_a_param_only_the_scope_holds_where_it_is():
    exe, scope = Executor(), adam_scope()
    where = {name: address(scope.find_var(name).array) for name in ("w", "m1", "m2")}
    for step in range(3):
        run_adam(exe, scope, step)
    assert {name: address(scope.find_var(name).array) for name in where} == where


@pytest.mark.parametrize("holder", ["fetched view", "LoDTensor", "array", "alias"])
def test_adam_never_writes_a_param_someone_else_holds(holder):
    exe, scope = Executor(), adam_scope()
    run_adam(exe, scope, 0)
    if holder == "fetched view":
        (kept,) = run_adam(exe, scope, 1, fetch=True)
    elif holder == "LoDTensor":
        kept = scope.find_var("w")
    elif holder == "array":
        kept = scope.find_var("w").array
    else:  # another var holding the same array
        scope.set_var("w_alias", LoDTensor(scope.find_var("w").array))
        kept = scope.find_var("w_alias")
    snapshot = np.array(kept.array if isinstance(kept, LoDTensor) else kept)
    for step in range(2, 5):
        run_adam(exe, scope, step)
    now = kept.array if isinstance(kept, LoDTensor) else kept
    assert now.tobytes() == snapshot.tobytes()
    assert not np.shares_memory(scope.find_var("w").array, now)


def test_adam_in_a_run_other_threads_read_makes_new_values():
    """A pserver serving fetches: a param nothing holds now may be taken mid-update."""
    exe, scope = Executor(), adam_scope()
    before = address(scope.find_var("w").array)
    grad = np.random.default_rng(0).standard_normal(5000).astype(np.float32)
    exe.run(ADAM, feed={"g": grad}, scope=scope, concurrent_readers=True)
    assert address(scope.find_var("w").array) != before


SGD = program_with(("sgd", {"Param": ["w"], "Grad": ["g"], "LearningRate": ["lr"]}, {"ParamOut": ["w"]}, {}))


def sgd_steps(grad_kind: str, *, hold: bool) -> tuple[list[int], bytes, np.ndarray | None]:
    """Three sgd steps on a 1000 x 8 param: where its array was after each, its final
    bytes, and (with `hold`) a view of the first value fetched before the steps."""
    scope, exe = Scope(), Executor()
    scope.set_var("w", LoDTensor(np.random.default_rng(0).standard_normal((1000, 8)).astype(np.float32)))
    scope.set_var("lr", LoDTensor(np.array([0.1], np.float32)))
    held = exe.run(SGD, feed={"g": np.zeros((1000, 8), np.float32)}, fetch_list=["w"], scope=scope)[0] if hold else None
    places = []
    for step in range(3):
        rng = np.random.default_rng(step)
        value = rng.standard_normal((3, 8)).astype(np.float32)
        grad = (SelectedRows(np.array([5, 999, step]), value, 1000) if grad_kind == "sparse"
                else LoDTensor(rng.standard_normal((1000, 8)).astype(np.float32)))
        exe.run(SGD, feed={"g": grad}, scope=scope)
        places.append(address(scope.find_var("w").array))
    return places, scope.find_var("w").array.tobytes(), held


@pytest.mark.parametrize("grad_kind", ["sparse", "dense"])
def test_sgd_updates_a_param_only_the_scope_holds_where_it_is(monkeypatch, grad_kind):
    places, final, _ = sgd_steps(grad_kind, hold=False)
    assert len(set(places)) == 1
    with monkeypatch.context() as patch:
        patch.setattr(context, "SOLE_LOCAL_REFERENCES", -1)
        fresh_places, fresh_final, _ = sgd_steps(grad_kind, hold=False)
    assert fresh_final == final
    assert len(set(fresh_places)) > 1
    places, held_final, held = sgd_steps(grad_kind, hold=True)  # a fetched view: never written
    assert held_final == final
    assert held.tobytes() != final and not np.shares_memory(held, np.frombuffer(final, np.float32))
    assert np.array_equal(held, np.random.default_rng(0).standard_normal((1000, 8)).astype(np.float32))


def test_two_live_vars_never_share_a_recycled_array():
    """Every var the MLP step writes through an output buffer has memory of its own (the
    grads elementwise_add_grad passes through as X@GRAD are the same value by design)."""
    folder = PADDLE_PROGRAMS / "mlp_adam_2ps"
    startup, main = Program.load(folder / "startup.pb"), Program.load(folder / "main.pb")
    scope, exe = Scope(), Executor()
    exe.run(startup, scope=scope)
    for step in range(STEPS):
        exe.run(main, feed=mlp_feed(step), scope=scope)
    recycling = {"mul": ["Out"], "mul_grad": ["X@GRAD", "Y@GRAD"], "adam": ["ParamOut", "Moment1Out", "Moment2Out"]}
    names = sorted({name for op in main.global_block().ops for slot in recycling.get(op.type, ())
                    for name in op.output(slot) if name})
    assert len(names) > 10
    arrays = [scope.find_var(name).array for name in names]
    shared = [(names[i], names[j]) for i in range(len(arrays)) for j in range(i + 1, len(arrays))
              if np.shares_memory(arrays[i], arrays[j])]
    assert shared == []


def test_mixed_dtypes_keep_numpy_promotion():
    program = matmul_program()
    x, w = np.ones((2, 3), np.float32), np.ones((3, 4), np.float64)
    (y,) = Executor().run(program, feed={"x": x, "w": w}, fetch_list=["y"], scope=Scope())
    assert y.dtype == np.float64 and y.tolist() == [[3.0] * 4] * 2


def test_threads_running_one_prepared_block_never_share_a_buffer():
    """One executor (one memo of spares) runs the block from four threads at once, each
    in its own scope: every result is its own thread's."""
    exe = Executor()
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            scope = Scope()
            for _ in range(200):
                (y,) = run_matmul(exe, scope, k)
                assert np.all(y == 3.0 * k), y
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(1, 5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("m, k, n", [(64, 784, 512), (7, 5, 3), (1, 9, 1), (33, 1, 17)])
def test_matmul_into_a_buffer_gives_the_bytes_of_a_new_product(m, k, n, dtype):
    """mul and mul_grad's three products (X @ W, dOut @ W.T, X.T @ dOut) against numpy's
    `@` without `out=`, as the kernels computed them before."""
    rng = np.random.default_rng([m, k, n])
    x, w, dout = (rng.standard_normal(shape).astype(dtype) for shape in ((m, k), (k, n), (m, n)))
    program = program_with(("mul_grad", {"X": ["x"], "Y": ["w"], "Out@GRAD": ["d"]},
                            {"X@GRAD": ["dx"], "Y@GRAD": ["dw"]}, {}),
                           ("mul", {"X": ["x"], "Y": ["w"]}, {"Out": ["y"]}, {}))
    exe, scope = Executor(), Scope()
    for _ in range(3):  # the third run computes into recycled arrays
        y, dx, dw = exe.run(program, feed={"x": x, "w": w, "d": dout}, fetch_list=["y", "dx", "dw"], scope=scope)
    assert y.tobytes() == (x @ w).tobytes()
    assert dx.tobytes() == (dout @ w.T).tobytes()
    assert dw.tobytes() == (x.T @ dout).tobytes()


def test_adam_into_buffers_gives_the_bytes_of_new_arrays():
    from ops.kernels.optimizers import _adam_dense

    rng = np.random.default_rng(7)
    p, g, m1 = (rng.standard_normal((300, 40)).astype(np.float32) for _ in range(3))
    m2 = np.abs(rng.standard_normal((300, 40))).astype(np.float32)
    scalars = (np.float32(0.9), np.float32(0.999), np.float32(0.003), np.float32(1e-8))
    fresh = _adam_dense(p, g, m1, m2, *scalars)
    into = tuple(np.full_like(p, np.nan) for _ in range(3))
    recycled = _adam_dense(p, g, m1, m2, *scalars, into)
    assert all(a is b for a, b in zip(recycled, into))
    assert [a.tobytes() for a in recycled] == [a.tobytes() for a in fresh]
