"""A sync trainer releases a param its step will replace (`ops.executor.Liveness.released`,
issue 30): the param leaves the scope after its last read and the step's `recv` / `concat`
writes a new array, so the param and its grad are not alive together. Where it happens on
Paddle-built trainer programs, where it never happens, the same bits with and without it
(2 pservers x 2 trainers, float32 and float64, the bulk channel on and by default), the
error a failed step leaves behind, and the peak it saves."""

from __future__ import annotations

import io
import tracemalloc

import numpy as np
import pytest
from conftest import PADDLE_PROGRAMS, run_job_threads

from ops import executor as executor_module
from ops.executor import ExecutionError, Executor, FetchError, Liveness
from ops.rpc import bulk, kernels
from ops.scope import Scope
from ops.tensor import LoDTensor
from transpiler.api import as_float64, transpile
from transpiler.frontend import ParamAttr, layers, optimizer
from transpiler.frontend.fluid18_networks import build
from transpiler.ir import DType, Program
from transpiler.ir.types import VarKind
from transpiler.runtime.launch import free_endpoints
from transpiler.runtime.role import PSERVER, TRAINER, Role
from transpiler.runtime.session import Session

EPS = "127.0.0.1:6174,127.0.0.1:6175"
F32, F64 = np.float32, np.float64


def wide(size: int = 64):
    """The benchmark's wide model, small: x[8, size] -> fc size (relu) -> fc 10, SGD."""

    def body() -> None:
        x = layers.data(name="x", shape=[size], dtype="float32")
        y = layers.data(name="y", shape=[1], dtype="int64")
        h = layers.fc(input=x, size=size, act="relu", param_attr=ParamAttr(name="w1"), bias_attr=ParamAttr(name="b1"))
        p = layers.fc(input=h, size=10, param_attr=ParamAttr(name="w2"), bias_attr=ParamAttr(name="b2"))
        loss = layers.mean(layers.softmax_with_cross_entropy(logits=p, label=y))
        optimizer.SGD(learning_rate=0.1).minimize(loss)

    return build(body)


def fixture(name: str) -> tuple[Program, Program]:
    folder = PADDLE_PROGRAMS / name
    return Program.load(folder / "main.pb"), Program.load(folder / "startup.pb")


def released(program: Program) -> list[tuple[str, int, str]]:
    """(param, index of the op after which it is released, that op's type)."""
    block = program.global_block()
    liveness = Liveness(block, block.ops, ())
    found = [(name, i, block.ops[i].type) for i, dying in enumerate(liveness.dying) for name in dying
             if name in liveness.released]
    assert all(block.find_var(n).persistable for n, _, _ in found)
    return sorted(found)


# ------------------------------------------------------------ where


def test_the_params_a_sync_trainer_releases_and_where():
    main, startup = wide()
    trainer = transpile(main, startup, pservers=EPS, trainers=2).trainer
    ops = trainer.global_block().ops
    # w1's last read is the forward mul (its mul_grad computes no X@GRAD: x is data)
    assert released(trainer) == [("b1", *_at(ops, "elementwise_add_grad", "b1")), ("b2", *_at(ops, "elementwise_add_grad", "b2")),
                                 ("w1", 0, "mul"), ("w2", *_at(ops, "mul_grad", "w2"))]
    # w1's array becomes its grad's buffer at its mul_grad; w2 is released after its own
    # mul_grad (which reads it for X@GRAD): no later op to take its array
    block = trainer.global_block()
    heirs = Liveness(block, block.ops, ()).heirs
    assert heirs == {"w1": (_at(ops, "mul_grad", "w1")[0], "Y@GRAD", 0)}
    main, startup = fixture("mlp_adam_2ps")  # built by Paddle 2.6
    result = transpile(main, startup, pservers=EPS, trainers=2)
    assert released(result.trainer) == [("h1.b", 24, "elementwise_add_grad"), ("h1.w", 0, "mul"),
                                        ("h2.b", 18, "elementwise_add_grad"), ("h2.w", 20, "mul_grad"),
                                        ("out.b", 13, "elementwise_add_grad"), ("out.w", 15, "mul_grad")]
    main, startup = fixture("fluid18_basic_sgd_2ps")  # built by Fluid 1.8.5
    result = transpile(main, startup, pservers=EPS, trainers=2)
    assert [n for n, _, _ in released(result.trainer)] == ["fc_b", "fc_w"]
    assert released(result.trainer)[1][1:] == (0, "mul")


def _at(ops, op_type: str, name: str) -> tuple[int, str]:
    return next(i for i, op in enumerate(ops) if op.type == op_type and name in op.input_names), op_type


def test_never_in_a_startup_program_an_async_trainer_a_pserver_or_a_local_program():
    main, startup = fixture("mlp_adam_2ps")
    sync = transpile(main, startup, pservers=EPS, trainers=2)
    assert released(sync.trainer_startup) == []
    for pserver, pserver_startup in sync.pservers.values():
        for block in pserver.blocks:
            assert Liveness(block, block.ops, ()).released == frozenset()
        assert released(pserver_startup) == []
    assert released(transpile(main, startup, pservers=EPS, trainers=2, sync_mode=False).trainer) == []
    assert released(main) == []


def tail(*before: tuple, kind: VarKind = VarKind.LOD_TENSOR, shape=None, do_not_run: int = 0,
         dtype=F32, rows=(3, 5), cols: int = 4) -> Program:
    """[ops `before`] recv w.block0 / w.block1, fetch_barrier, concat -> w (a sync trainer's
    end): w [sum(rows), cols] (declared `shape` if given), x [2, sum(rows)], out [2, cols]."""
    program = Program.empty()
    block = program.global_block()
    fp = DType.FP64 if dtype == F64 else DType.FP32
    for name, var_shape in (("w.block0", [rows[0], cols]), ("w.block1", [rows[1], cols]), ("x", [2, sum(rows)]),
                            ("out", [2, cols]), ("w@GRAD", [sum(rows), cols]), ("g", [sum(rows), cols])):
        block.create_var(name, dtype=fp, shape=var_shape)
    block.create_var("w", kind, dtype=fp, shape=list(shape or (sum(rows), cols)), persistable=True)
    for op_type, inputs, outputs, attrs in before:
        block.add_op(op_type, inputs, outputs, attrs)
    eps = ["127.0.0.1:1", "127.0.0.1:2"]
    block.add_op("recv", {}, {"Out": ["w.block0"]}, {"epmap": [eps[0]], "varnames": ["w.block0"], "do_not_run": do_not_run})
    block.add_op("recv", {}, {"Out": ["w.block1"]}, {"epmap": [eps[1]], "varnames": ["w.block1"], "do_not_run": do_not_run})
    block.add_op("fetch_barrier", {}, {}, {"endpoints": eps})
    block.add_op("concat", {"X": ["w.block0", "w.block1"]}, {"Out": ["w"]}, {"axis": 0})
    return program


MUL = ("mul", {"X": ["x"], "Y": ["w"]}, {"Out": ["out"]}, {"x_num_col_dims": 1, "y_num_col_dims": 1})


def test_never_when_something_could_still_want_the_value():
    assert released(tail(MUL)) == [("w", 0, "mul")]
    assert released(tail()) == []  # never read before the write: nothing to release
    assert released(tail(MUL, kind=VarKind.SELECTED_ROWS)) == []  # a writer may fill some rows only
    assert released(tail(MUL, shape=(-1, 4))) == []  # no known shape to make the new array with
    # a recv of w itself: released when it runs, never when it does not (`do_not_run`)
    for do_not_run, want in ((0, [("w", 0, "mul")]), (1, [])):
        program = direct(MUL)
        program.global_block().ops[1].set_attr("do_not_run", do_not_run)
        assert released(program) == want
    # read again by an op that writes it (an optimizer): released after that op
    sgd = ("sgd", {"Param": ["w"], "Grad": ["w"], "LearningRate": ["x"]}, {"ParamOut": ["w"]}, {})
    assert released(tail(MUL, sgd)) == [("w", 1, "sgd")]
    # written without a read after its last read: the value the receive replaces is never read
    fill = ("fill_constant", {}, {"Out": ["w"]}, {"shape": [8, 4], "value": 1.0, "dtype": 5})
    assert released(tail(MUL, fill)) == []
    # read by the writer itself
    program = tail(MUL)
    program.global_block().add_op("concat", {"X": ["w", "w.block0"]}, {"Out": ["w"]}, {"axis": 0})
    assert released(program) == [("w", 0, "mul")]  # the first receive's, not the second
    # another block names it
    program = tail(MUL)
    sub = program.create_block(parent_idx=0)
    sub.add_op("scale", {"X": ["w"]}, {"Out": ["out"]}, {"scale": 1.0})
    assert released(program) == []
    # control flow in the block
    program = tail(MUL)
    sub = program.create_block(parent_idx=0)
    program.global_block().add_op("conditional_block", {"Cond": ["x"], "Input": []}, {"Out": [], "Scope": ["s"]},
                                  {"sub_block": sub, "is_scalar_condition": True})
    assert released(program) == []
    # no fetch_barrier: not a sync trainer's step
    assert released(direct(MUL, barrier=False)) == []


def direct(*before: tuple, barrier: bool = True) -> Program:
    """[ops `before`] recv w (whole), fetch_barrier."""
    program = Program.empty()
    block = program.global_block()
    for name in ("x", "out", "w"):
        block.create_var(name, dtype=DType.FP32, shape=[8, 4], persistable=name == "w")
    for op_type, inputs, outputs, attrs in before:
        block.add_op(op_type, inputs, outputs, attrs)
    block.add_op("recv", {}, {"Out": ["w"]}, {"epmap": ["127.0.0.1:1"], "varnames": ["w"]})
    if barrier:
        block.add_op("fetch_barrier", {}, {}, {"endpoints": ["127.0.0.1:1"]})
    return program


# ------------------------------------------------------------ the executor


class FakeClient:
    """The RPC client under a trainer's `fetch_barrier`: each block into the destination
    it is given (as the bulk channel does), else into a new array."""

    early_recv, deadline, trainer_id = "on", 5.0, 0  # what an early receive reads of its client

    def __init__(self, blocks: dict[str, np.ndarray]):
        self.blocks, self.fail, self.into = blocks, False, None
        self.early = False  # answer as a client with early receives (`ops.rpc.early_recv`)

    def fetch_barrier(self, endpoints, requests, into=None):
        return [value for _, value in self._received(requests, into)]

    def _received(self, requests, into):
        self.into = {request: into[request] for request in requests if request in (into or {})}
        if self.fail:
            raise RuntimeError("the pserver went away")
        for request in requests:
            dest = self.into.get(request)
            dest = np.empty_like(self.blocks[request[1]]) if dest is None else dest
            dest[...] = self.blocks[request[1]]
            yield request, LoDTensor(dest)

    def receives_early(self) -> bool:
        return self.early

    def has_bulk(self, endpoint) -> bool:
        return True

    def fetch_barrier_early(self, endpoints, requests, into, arrived, failed):
        for (ep, name), value in self._received(requests, into):  # each block as it comes in
            arrived(ep, name, value)


def _running(monkeypatch, dtype=F32):
    rng = np.random.default_rng(5)
    blocks = {"w.block0": rng.standard_normal((3, 4)).astype(dtype), "w.block1": rng.standard_normal((5, 4)).astype(dtype)}
    fake = FakeClient(blocks)
    monkeypatch.setattr(kernels, "get_client", lambda trainer_id: fake)
    scope = Scope()
    scope.set_var("w", LoDTensor(np.ones((8, 4), dtype)))
    return fake, scope, {"x": np.ones((2, 8), dtype)}


@pytest.mark.parametrize("early", [False, True], ids=["waiting", "early receive"])
@pytest.mark.parametrize("dtype", [F32, F64])
def test_a_released_param_is_received_into_a_new_array(monkeypatch, dtype, early):
    """... and bound, also by an early receive, whose `concat` is skipped."""
    fake, scope, feed = _running(monkeypatch, dtype)
    fake.early = early
    old = scope.find_var("w").array
    exe = Executor(free_dead=True)
    exe.run(tail(MUL, dtype=dtype), feed=feed, scope=scope)
    got = scope.find_var("w").array
    assert got is not old and len(fake.into) == 2 and all(np.shares_memory(v, got) for v in fake.into.values())
    assert got.dtype == dtype and np.array_equal(got, np.concatenate([fake.blocks["w.block0"], fake.blocks["w.block1"]]))
    np.testing.assert_array_equal(scope.find_var("out").array, np.ones((2, 8), dtype) @ old)


def test_fetched_or_fed_or_without_free_dead_the_param_stays(monkeypatch):
    """The param stays in the scope; held here, it is not received into either (a fresh
    array for each block, then joined): with a release, both blocks would go into a new
    array (`into`)."""
    for how in ("fetch", "feed", "keep all", "release"):
        fake, scope, feed = _running(monkeypatch)
        old = scope.find_var("w").array
        if how == "feed":
            feed["w"] = old
        exe = Executor(free_dead=how != "keep all")
        exe.run(tail(MUL), feed=feed, fetch_list=["w"] if how == "fetch" else [], scope=scope)
        assert len(fake.into) == (2 if how == "release" else 0), how
        np.testing.assert_array_equal(scope.find_var("out").array, feed["x"] @ old)


def test_a_step_failing_after_the_release_names_the_var_on_the_next_touch(monkeypatch):
    fake, scope, feed = _running(monkeypatch)
    exe = Executor(free_dead=True)
    exe.stream = 7
    fake.fail = True
    with pytest.raises(ExecutionError, match="the pserver went away"):
        exe.run(tail(MUL), feed=feed, scope=scope)
    assert scope.find_var("w") is None
    fake.fail = False
    exe.stream = 8
    with pytest.raises(ExecutionError, match=r"var 'w' has no value: it was released after op 0 \(mul\) of block 0 of step 7"
                                             r".*failed at op 3 \(fetch_barrier\)"):
        exe.run(tail(MUL), feed=feed, scope=scope)
    with pytest.raises(FetchError, match="var 'w' has no value: it was released"):
        exe.run(Program.empty(), fetch_list=["w"], scope=scope)
    # bound again (a restore): the note no longer applies, training goes on
    scope.set_var("w", LoDTensor(np.ones((8, 4), np.float32)))
    exe.run(tail(MUL), feed=feed, scope=scope)
    assert exe.lost == {}


def test_the_param_and_its_grad_are_no_longer_alive_together(monkeypatch):
    """tracemalloc over one trainer step of x -> mul(w) -> mul_grad -> w@GRAD, then the
    receive of w: w's array is freed before its grad's is made (peak: one of them)."""
    n = 512  # w: 1 MB
    program = tail(("mul", {"X": ["x"], "Y": ["w"]}, {"Out": ["out"]}, {"x_num_col_dims": 1, "y_num_col_dims": 1}),
                   ("mul_grad", {"X": ["x"], "Y": ["w"], "Out@GRAD": ["out"]}, {"X@GRAD": [], "Y@GRAD": ["w@GRAD"]},
                    {"x_num_col_dims": 1, "y_num_col_dims": 1}),
                   ("scale", {"X": ["w@GRAD"]}, {"Out": ["g"]}, {"scale": 1.0}), rows=(n // 2, n // 2), cols=n)
    blocks = {"w.block0": np.ones((n // 2, n), F32), "w.block1": np.ones((n // 2, n), F32)}
    monkeypatch.setattr(kernels, "get_client", lambda trainer_id: FakeClient(blocks))
    peaks = {}
    for free in (False, True):
        scope = Scope()
        scope.set_var("w", LoDTensor(np.ones((n, n), F32)))
        feed = {"x": np.ones((2, n), F32)}
        exe = Executor(free_dead=free)
        exe.run(program, feed=feed, scope=scope)  # warm: kernels' buffers made once
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            exe.run(program, feed=feed, fetch_list=["g"], scope=scope)
            peaks[free] = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
    w = n * n * 4
    assert peaks[False] >= 2 * w  # w, w@GRAD (and g) alive at once
    assert peaks[True] < peaks[False] - w // 2, peaks


def test_the_grad_is_computed_into_the_released_param_s_array(monkeypatch):
    grad_ops = (MUL, ("mul_grad", {"X": ["x"], "Y": ["w"], "Out@GRAD": ["out"]}, {"X@GRAD": [], "Y@GRAD": ["w@GRAD"]},
                      {"x_num_col_dims": 1, "y_num_col_dims": 1}))
    program = tail(*grad_ops)
    block = program.global_block()
    assert Liveness(block, block.ops, ()).heirs == {"w": (1, "Y@GRAD", 0)}
    fake, scope, feed = _running(monkeypatch)
    exe = Executor(free_dead=True)
    exe.run(program, feed=feed, scope=scope)  # the op's spare slot exists from its first run
    for _ in range(2):
        fake.into = None  # the fake's views of the received param would keep its array held
        w = scope.find_var("w").array
        address, want = w.__array_interface__["data"][0], feed["x"].T @ (feed["x"] @ w)
        del w
        (grad,) = exe.run(program, feed=feed, fetch_list=["w@GRAD"], scope=scope)
        assert grad.__array_interface__["data"][0] == address
        np.testing.assert_array_equal(grad, want)
        assert scope.find_var("w").array.__array_interface__["data"][0] != address  # received into a new one


@pytest.mark.parametrize("dtype", [F32, F64])
def test_the_first_step_s_grad_takes_the_param_s_array_even_while_a_view_lingers(monkeypatch, dtype):
    """From the first run on (the heir never ran before), and while something else still
    holds a view of the released array when it is released (an early receive's thread, a
    moment after it filled it): the grad is computed into it once the view is gone, so the
    param's memory never depends on where malloc puts a new array (issue 30: the 64 MB
    trainer peaked at 192 MB instead of 129 in some runs)."""
    grad_ops = (MUL, ("mul_grad", {"X": ["x"], "Y": ["w"], "Out@GRAD": ["out"]}, {"X@GRAD": [], "Y@GRAD": ["w@GRAD"]},
                      {"x_num_col_dims": 1, "y_num_col_dims": 1}))
    program = tail(*grad_ops, dtype=dtype)
    fake, scope, feed = _running(monkeypatch, dtype)
    exe = Executor(free_dead=True)
    for step in range(3):
        fake.into = None
        w = scope.find_var("w").array
        address, want = w.__array_interface__["data"][0], feed["x"].T @ (feed["x"] @ w)
        lingering = [w[:1]]  # released at `mul` with this view alive; gone before `mul_grad`
        del w
        mul_grad = executor_module.Executor._free

        def free(prepared, liveness, index, op, scope, dying, real=mul_grad):
            real(prepared, liveness, index, op, scope, dying)
            lingering.clear()  # what held the view lets go after the release, before the heir

        monkeypatch.setattr(executor_module.Executor, "_free", staticmethod(free))
        (grad,) = exe.run(program, feed=feed, fetch_list=["w@GRAD"], scope=scope)
        monkeypatch.setattr(executor_module.Executor, "_free", staticmethod(mul_grad))
        assert grad.__array_interface__["data"][0] == address, f"step {step}: the grad is a new array"
        np.testing.assert_array_equal(grad, want)


def test_a_released_array_the_heir_cannot_take_is_not_kept_past_it(monkeypatch):
    """A view that outlives the heir: the grad is a new array, the released one is not
    kept as the heir's spare (it would hold a whole param until the next step), and its
    values are untouched."""
    grad_ops = (MUL, ("mul_grad", {"X": ["x"], "Y": ["w"], "Out@GRAD": ["out"]}, {"X@GRAD": [], "Y@GRAD": ["w@GRAD"]},
                      {"x_num_col_dims": 1, "y_num_col_dims": 1}))
    program = tail(*grad_ops)
    fake, scope, feed = _running(monkeypatch)
    exe = Executor(free_dead=True)
    old = scope.find_var("w").array
    kept = old.copy()
    view = old[:1]
    del old
    (grad,) = exe.run(program, feed=feed, fetch_list=["w@GRAD"], scope=scope)
    assert not np.shares_memory(grad, view)
    np.testing.assert_array_equal(view, kept[:1])
    block = program.global_block()
    memo = exe._prepare(block).steps[1][2]
    assert all(spare is None or not np.shares_memory(spare, view) for spare in memo.get("spares", {}).values())


# ------------------------------------------------------------ the same bits


def train(main, startup, feeds, *, release: bool, monkeypatch) -> dict[int, dict[str, bytes]]:
    """2 pservers x 2 trainers sync, in threads: each trainer's params after the steps."""
    found: list[dict[str, int]] = []
    real = executor_module._replaced_params
    monkeypatch.setattr(executor_module, "_replaced_params",
                        lambda *args: found.append(real(*args)) or found[-1] if release else {})
    endpoints = tuple(free_endpoints(2))
    results: dict[int, dict[str, bytes]] = {}
    errors: list[BaseException] = []

    def pserver(endpoint: str) -> None:
        try:
            Session(main, startup, role=Role(PSERVER, 0, 2, endpoints, endpoint, True, 20.0)).serve()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def trainer(tid: int) -> None:
        try:
            role = Role(TRAINER, tid, 2, endpoints, None, True, 20.0)
            with Session(main, startup, role=role, out=io.StringIO()) as session:
                for feed in feeds:
                    session.run(role.shard(feed))
                results[tid] = {name: value.tobytes() for name, value in session.params().items()}
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    run_job_threads(pserver, endpoints, trainer, 2, errors)
    monkeypatch.undo()
    assert any("w1" in each for each in found) == release  # the trainers' main programs released w1
    return results


def wide_feeds(dtype, steps: int = 3, size: int = 64):
    rng = np.random.default_rng(11)
    return [{"x": rng.standard_normal((8, size)).astype(dtype), "y": rng.integers(0, 10, (8, 1)).astype(np.int64)}
            for _ in range(steps)]


@pytest.mark.parametrize("channel", ["on", "default"])
@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
def test_training_gives_the_same_bits_with_and_without_the_release(monkeypatch, channel, dtype):
    main, startup = wide(128)  # w1: 128 x 128, cut in two blocks between the pservers
    if dtype == F64:
        main, startup = as_float64(main), as_float64(startup)
    feeds = wide_feeds(dtype, size=128)
    runs = {}
    for release in (False, True):
        if channel == "on":
            monkeypatch.setenv(bulk.BULK_ENV, "on")
        runs[release] = train(main, startup, feeds, release=release, monkeypatch=monkeypatch)
    assert runs[True][0] == runs[True][1] == runs[False][0] == runs[False][1]
    assert set(runs[True][0]) == {"w1", "b1", "w2", "b2"}


def test_session_params_names_a_param_a_failed_step_left_unbound():
    main, startup = wide()
    session = Session(main, startup, out=io.StringIO())
    session.start()
    assert set(session.params()) == {"w1", "b1", "w2", "b2"}
    session.scope.erase("w1")
    session.executor.lost["w1"] = "var 'w1' has no value: it was released after op 0 (mul) of block 0 of step 3, ..."
    with pytest.raises(Exception, match=r"var 'w1' has no value: it was released after op 0 \(mul\)"):
        session.params()
