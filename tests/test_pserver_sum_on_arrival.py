"""A sync pserver sums its trainers' grads as they arrive (`ops.rpc.arrival_sum`, issue 30):
bit-identical to the `sum` kernel's ((x0 + x1) + x2) + ... for every arrival order, chunked
on the bulk channel, whole on gRPC, mixed; completed trainers' grads added as zeros; a
torn arrival fails the round naming trainer and var; no grad-sized array per step."""

from __future__ import annotations

import itertools
import math
import socket
import threading
import tracemalloc
from contextlib import contextmanager

import numpy as np
import pytest
from rpc_support import running_pserver
from test_listen_and_serv_programs import net, train_in_threads
from test_rpc_bulk import _dense, _frame, _read_reply

from ops.rpc import arrival_sum, bulk
from ops.rpc import server as server_module
from ops.rpc.arrival_sum import Arrivals, SumPlan, find_plans
from ops.scope import Scope
from ops.testing import run_op
from ops.tensor import LoDTensor
from transpiler.ir.precision import as_float64

F32, F64 = np.float32, np.float64
SHAPE = (300, 200)


def _plan(fanin: int, dtype) -> SumPlan:
    return SumPlan("w@GRAD", tuple(f"w@GRAD.trainer_{t}" for t in range(fanin)), SHAPE, np.dtype(dtype), 1, 0)


def _config(fanin: int, dtype, **extra) -> dict:
    received = tuple(f"w@GRAD.trainer_{t}" for t in range(fanin))
    templates = {n: (SHAPE, dtype) for n in (*received, "w@GRAD")}
    return dict(fanin=fanin, received=received, templates=templates, optimize_blocks=(1,),
                known_vars=frozenset(received) | {"w", "w@GRAD"}, persistables=("w", "w@GRAD"),
                arrival_sums=(_plan(fanin, dtype),), **extra)


def _grads(fanin: int, dtype, seed: int) -> list[np.ndarray]:
    """Grads whose sum depends on the order of the additions: big values that cancel, small
    ones, -0.0 and a NaN."""
    rng = np.random.default_rng(seed)
    out = []
    for t in range(fanin):
        g = (rng.standard_normal(SHAPE) * 10.0 ** rng.integers(-6, 9, SHAPE)).astype(dtype)
        g[0, :8] = [-0.0, -0.0, 1e8, -1e8, 1.0, -0.0, 3.0, -3.0]
        out.append(g)
    out[-1][0, 8] = np.nan
    return out


def _kernel_sum(grads: list[np.ndarray]) -> np.ndarray:
    """What the `sum` op the pserver skips computes: the kernel itself (ops/kernels/math_ops.py)."""
    out = run_op("sum", {"X": [LoDTensor(np.array(g)) for g in grads]}, raw=True)["Out"]
    return np.array(out.array if isinstance(out, LoDTensor) else out)


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32 if a.dtype == F32 else np.uint64)


def _recorder(scope: Scope, seen: list):
    def run_block(idx: int) -> None:
        seen.append(np.array(scope.find_var("w@GRAD").array))  # a copy: the accumulator is reused

    return run_block


@contextmanager
def _serving(fanin: int, dtype, seen: list, recorder=_recorder):
    """A pserver summing `w@GRAD` of `fanin` trainers (its blocks record the sum, or what
    `recorder` records, into `seen`), and its trainers' clients, past their startup fetch
    barrier."""
    scope = Scope()
    scope.set_var("w", LoDTensor(np.ones(SHAPE, dtype)))
    with running_pserver(scope=scope, run_block=recorder(scope, seen), **_config(fanin, dtype)) as ps:
        clients = [ps.client(t) for t in range(fanin)]
        for c in clients:
            c.fetch_barrier([ps.address])
        yield ps, clients


@pytest.fixture(autouse=True)
def small_grads_summed(monkeypatch):
    monkeypatch.setattr(arrival_sum, "MIN_BYTES", 0)  # these tests' grads are small (240 kB)


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(arrival_sum, "CHUNK_BYTES", 4096)  # many chunks per grad (60 for float32)


def _complete(ps, clients) -> None:
    """Every trainer says it is done, and the pserver's loop ends."""
    for c in clients:
        c.complete([ps.address])
    ps.join()


def _round(ps, clients, grads, order, *, together=False, skip=()):
    """One round: each trainer in `order` sends its grad (one after another, or all at once
    with `together`), then every trainer's barriers."""
    def send(t):
        clients[t].send(ps.address, f"w@GRAD.trainer_{t}", LoDTensor(grads[t]))

    if together:
        threads = [threading.Thread(target=send, args=(t,)) for t in order]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
    else:
        for t in order:
            send(t)

    def barrier(t):
        clients[t].send_barrier([ps.address])
        clients[t].fetch_barrier([ps.address])

    threads = [threading.Thread(target=barrier, args=(t,)) for t in range(len(clients)) if t not in skip]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("fanin", [2, 3])
def test_every_arrival_order_gives_the_sum_kernel_s_bits(monkeypatch, small_chunks, fanin, dtype):
    monkeypatch.setenv(bulk.BULK_ENV, "on")
    seen = []
    orders = list(itertools.permutations(range(fanin)))
    expected = []
    with _serving(fanin, dtype, seen) as (ps, clients):
        for i, order in enumerate([*orders, *orders]):  # one after another, then all at once
            grads = _grads(fanin, dtype, i)
            _round(ps, clients, grads, order, together=i >= len(orders))
            expected.append(_kernel_sum(grads))
        arrivals = ps.server._sums["w@GRAD.trainer_0"]
        assert arrivals.streamed == fanin * len(expected)  # all of them off the bulk channel, in chunks
        assert ps.server.skip_ops == {(1, 0)}
        assert not any(name.startswith("w@GRAD") for _, name in ps.server._bulk_buffers)
        _complete(ps, clients)
    assert not ps.errors
    assert len(seen) == len(expected)
    for got, want in zip(seen, expected, strict=True):
        assert got.dtype == dtype and np.array_equal(_bits(got), _bits(want))


def test_grpc_and_bulk_arrivals_mix_exactly(monkeypatch, small_chunks):
    """Trainer 1 on gRPC (its channel off), 0 and 2 on the bulk channel, in every order."""
    monkeypatch.setenv(bulk.BULK_ENV, "on")
    seen, expected = [], []
    with _serving(3, F32, seen) as (ps, clients):
        clients[1]._endpoints[ps.address].bulk = None  # as PSTRANSPILE_BULK=off on that trainer
        for i, order in enumerate(itertools.permutations(range(3))):
            grads = _grads(3, F32, 100 + i)
            _round(ps, clients, grads, order)
            expected.append(_kernel_sum(grads))
        assert ps.server._sums["w@GRAD.trainer_0"].streamed == 2 * len(expected)
        _complete(ps, clients)
    assert not ps.errors
    for got, want in zip(seen, expected, strict=True):
        assert np.array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize("gone", [0, 1, 2])
def test_a_completed_trainer_s_grad_is_added_as_zeros_in_its_turn(monkeypatch, gone):
    monkeypatch.setenv(bulk.BULK_ENV, "on")
    seen, expected = [], []
    with _serving(3, F64, seen) as (ps, clients):
        clients[gone].complete([ps.address])
        left = [t for t in range(3) if t != gone]
        for i, order in enumerate([left, left[::-1]]):
            grads = _grads(3, F64, 200 + i)
            for t in range(3):
                grads[t][0, :2] = -0.0  # -0.0 + 0.0 is +0.0: the zeros must be added, not skipped
            _round(ps, clients, grads, order, skip=(gone,))
            grads[gone] = np.zeros(SHAPE, F64)
            expected.append(_kernel_sum(grads))
        for t in left:
            clients[t].complete([ps.address])
        ps.join()
    assert not ps.errors
    for got, want in zip(seen, expected, strict=True):
        assert np.array_equal(_bits(got), _bits(want))
        assert np.signbit(got[0, 0]) == np.signbit(want[0, 0])


def test_a_torn_arrival_fails_the_round_naming_trainer_and_var(monkeypatch, small_chunks):
    """Trainer 0's grad is in; trainer 1's call breaks mid-payload (a truncated frame)
    after some of its chunks were added: the pserver fails, and never runs the round."""
    monkeypatch.setenv(bulk.BULK_ENV, "on")
    seen = []
    with _serving(2, F32, seen) as (ps, clients):
        clients[0].send(ps.address, "w@GRAD.trainer_0", LoDTensor(np.ones(SHAPE, F32)))
        head = {"x": ps.server._bulk.secret, "k": None, "t": 1, "a": False,
                "v": [_dense("w@GRAD.trainer_1", SHAPE)]}
        sock = socket.create_connection(("127.0.0.1", ps.server._bulk.port), timeout=10)
        try:
            sock.sendall(_frame(1, head))
            assert _read_reply(sock)[0] == bulk.STATUS_GO
            sock.sendall(b"\0" * (SHAPE[0] * SHAPE[1] * 2))  # half of it
            sock.shutdown(socket.SHUT_WR)
            _read_reply(sock)
        finally:
            sock.close()
        ps.join()
    assert seen == []  # the round never ran
    (error,) = ps.errors
    message = str(error)
    assert ("trainer 1's send of w@GRAD.trainer_1 broke off with 118784 of its 240000 bytes in the sum of w@GRAD "
            "(summed on arrival); the round cannot run on a partial sum") in message, message


@pytest.mark.parametrize("shm", ["off", "on"])
@pytest.mark.parametrize("dtype", [F32, F64])
def test_the_trainers_adds_share_one_chunk_buffer(monkeypatch, small_chunks, dtype, shm):
    """Each trainer adds in its turn (the other arrived first), one add at a time: the
    pserver keeps one chunk buffer, not one per connection; through shared-memory rings,
    none (a copy is added from its slots), and the same bits."""
    monkeypatch.setenv(bulk.BULK_ENV, "on")
    monkeypatch.setenv(bulk.SHM_ENV, shm)
    monkeypatch.setattr(bulk, "RING_VAR_MIN", 1)  # these 240 kB grads through the rings too
    seen, expected = [], []
    with _serving(2, dtype, seen) as (ps, clients):
        for i, order in enumerate([(0, 1), (1, 0), (0, 1)]):
            grads = _grads(2, dtype, i)
            _round(ps, clients, grads, order)
            expected.append(_kernel_sum(grads))
        buffers = ps.server._chunk_buffers
        if shm == "off":
            assert len(buffers) == 1 and buffers[0].nbytes == arrival_sum.CHUNK_BYTES and ps.server.chunk_buffers_made == 1
        else:
            assert buffers == [] and all(ring is not None for client in clients
                                         for _, ring, _ in client._endpoints[ps.address].bulk._idle)
        _complete(ps, clients)
    assert not ps.errors
    for got, want in zip(seen, expected, strict=True):
        assert got.dtype == dtype and np.array_equal(_bits(got), _bits(want))


def test_no_grad_sized_array_is_made_per_step_once_warm(monkeypatch):
    monkeypatch.setenv(bulk.BULK_ENV, "on")
    scope = Scope()
    scope.set_var("w", LoDTensor(np.ones(SHAPE, F32)))

    def sgd(idx: int) -> None:
        w = scope.find_var("w").array
        np.subtract(w, scope.find_var("w@GRAD").array, out=w)

    grads = _grads(3, F32, 7)
    for g in grads:
        g[np.isnan(g)] = 0
    initial = np.zeros(SHAPE, F32)  # what the pserver's startup program gives the summed grad
    scope.set_var("w@GRAD", LoDTensor(initial))
    with running_pserver(scope=scope, run_block=sgd, **_config(3, F32)) as ps:
        clients = [ps.client(t) for t in range(3)]
        for c in clients:
            c.fetch_barrier([ps.address])
        arrivals = ps.server._sums["w@GRAD.trainer_0"]
        for order in [(0, 1, 2), (2, 1, 0)]:  # warm: the accumulator, and trainer 2's kept buffer
            _round(ps, clients, grads, order)
        made, acc = arrivals.allocations, arrivals.acc
        pooled = len(ps.server._chunk_buffers)
        tracemalloc.start()
        try:
            for order in [(2, 1, 0), (1, 0, 2), (0, 2, 1)]:
                _round(ps, clients, grads, order, together=True)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        # the chunk buffers' pool grows once, to the adds that ran at once: at most 2 of 3 inputs
        grown = len(ps.server._chunk_buffers) - pooled
        assert 0 <= grown and len(ps.server._chunk_buffers) <= 2
        peak -= grown * arrival_sum.CHUNK_BYTES
        # summed into the startup's array: one grad-sized array made, trainer 2's kept buffer
        assert arrivals.allocations == made == 1 and arrivals.acc is acc and np.shares_memory(acc, initial)
        assert ps.scope.find_var("w@GRAD").array is acc  # its own memory: a `scale` after it may work in place
        assert peak < grads[0].nbytes // 2, f"{peak} bytes traced in 3 rounds against a grad of {grads[0].nbytes}"
        _complete(ps, clients)
    assert not ps.errors


def test_the_plan_needs_a_first_sum_of_received_dense_copies_read_nowhere_else():
    main, startup = net("exponential", "adam")
    from transpiler.api import transpile

    result = transpile(main, startup, trainer_id=0, pservers="127.0.0.1:6170,127.0.0.1:6171", trainers=3)
    for program, _ in result.pservers.values():
        op = next(op for op in program.global_block().ops if op.type == "listen_and_serv")
        received = op.input("X")
        block0 = program.global_block()
        templates = {n: (tuple(v.shape), v.dtype.to_numpy()) for n, v in block0.vars.items() if v.shape is not None}
        blocks = [int(b) for b in op.attr("optimize_blocks")]
        plans = find_plans(program, blocks, received, templates, (), ())
        assert plans and all(len(p.inputs) == 3 and p.op_index == 0 for p in plans)
        assert find_plans(program, blocks, received, templates, {plans[0].inputs[1]}, ()) == plans[1:]  # a sparse X
        assert find_plans(program, blocks, received, templates, (), {plans[0].inputs[0]}) == plans[1:]  # a kept X
        assert find_plans(program, blocks, received[1:], templates, (), ()) == plans[1:]  # an X not received


def test_arrivals_hold_an_early_input_and_add_it_in_its_turn():
    a = Arrivals(SumPlan("g", ("x0", "x1", "x2"), (4,), np.dtype(F32), 1, 0), chunk_bytes=8)
    with a.cond:
        assert a.claim(2, may_wait=True) == arrival_sum.HOLD  # x0 and x1 not started
        a.buffer(2)[:] = [1e8, 1, 2, 3]
        a.finish(2, arrival_sum.HOLD)
        assert a.claim(1, may_wait=True) == arrival_sum.BASE
        a.acc[:] = [1, 1, 1, -0.0]
        a.finish(1, arrival_sum.BASE)
        assert a.claim(0, may_wait=False) == arrival_sum.ADD
        np.add(a.acc, np.array([-1e8, 0, 0, -0.0], F32), out=a.acc)
        a.finish(0, arrival_sum.ADD, None)
        got, _ = a.complete()
    want = _kernel_sum([np.array([-1e8, 0, 0, -0.0], F32), np.array([1, 1, 1, -0.0], F32),
                        np.array([1e8, 1, 2, 3], F32)])
    assert np.array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("trainers", [2, 3])
def test_transpiled_programs_train_bit_identically_to_bulk_off(monkeypatch, small_chunks, trainers, dtype):
    """A transpiled Adam net, 2 pservers, Sessions in threads: the channel on (its grads
    summed on arrival, the `sum` ops skipped) gives the params of the channel off."""
    main, startup = net("exponential", "adam")
    if dtype is F64:
        main, startup = as_float64(main), as_float64(startup)
    started: list = []
    start = server_module.PServer.start

    def recording(self):
        start(self)
        started.append(self)

    monkeypatch.setattr(server_module.PServer, "start", recording)
    finals = {}
    for choice in ("on", "off"):
        monkeypatch.setenv(bulk.BULK_ENV, choice)
        started.clear()
        results, _ = train_in_threads(main, startup, pservers=2, trainers=trainers)
        finals[choice] = results[0][1]
        sums = [a for ps in started for a in ps._sum_list]
        if choice == "on":
            assert len(sums) == 5 and all(a.streamed for a in sums)
        else:
            assert not sums
    assert finals["on"].keys() == finals["off"].keys()
    for name, value in finals["off"].items():
        assert value.dtype == dtype and np.array_equal(finals["on"][name], value), name


@pytest.mark.parametrize("channel", ["bulk", "grpc"])
def test_a_second_copy_in_one_round_is_refused_and_the_first_stays(monkeypatch, channel):
    """The old path kept the last copy sent; a sum cannot take a copy back out: the second
    is refused, nothing of it is added, and the round runs on the first."""
    from ops.rpc import RpcError

    monkeypatch.setenv(bulk.BULK_ENV, "on")
    seen = []
    grads = _grads(2, F32, 300)
    with _serving(2, F32, seen) as (ps, clients):
        if channel == "grpc":
            clients[0]._endpoints[ps.address].bulk = None
        clients[0].send(ps.address, "w@GRAD.trainer_0", LoDTensor(grads[0]))
        with pytest.raises(RpcError, match="sent twice in step 1; the pserver sums w@GRAD as its parts arrive"):
            clients[0].send(ps.address, "w@GRAD.trainer_0", LoDTensor(np.full(SHAPE, 5, F32)))
        _round(ps, clients, grads, [1])
        _complete(ps, clients)
    assert not ps.errors
    (got,) = seen
    assert np.array_equal(_bits(got), _bits(_kernel_sum(grads)))


def test_an_accumulator_a_persistable_views_is_not_summed_into_again(monkeypatch):
    """A block that keeps a view of the summed grad in a persistable var (`kept`): the next
    round sums into a new array, and the kept value stays what it was."""
    monkeypatch.setenv(bulk.BULK_ENV, "on")
    scope, seen = Scope(), []
    scope.set_var("w", LoDTensor(np.ones(SHAPE, F32)))
    record = _recorder(scope, seen)

    def run_block(idx: int) -> None:
        record(idx)
        scope.set_var("kept", LoDTensor(scope.find_var("w@GRAD").array[10:20]))

    config = _config(2, F32)
    config["persistables"] = ("w", "w@GRAD", "kept")
    with running_pserver(scope=scope, run_block=run_block, **config) as ps:
        clients = [ps.client(t) for t in range(2)]
        for c in clients:
            c.fetch_barrier([ps.address])
        accs = []
        for i in range(2):
            grads = _grads(2, F32, 400 + i)
            _round(ps, clients, grads, [1, 0])
            accs.append(ps.scope.find_var("w@GRAD").array)
            if i == 0:
                first = _kernel_sum(grads)[10:20]
        assert not np.shares_memory(accs[0], accs[1])
        assert np.array_equal(_bits(ps.scope.find_var("kept").array), _bits(_kernel_sum(grads)[10:20]))
        assert np.array_equal(_bits(accs[0][10:20]), _bits(first))  # round 1's sum, as `kept` first saw it
        _complete(ps, clients)
    assert not ps.errors


def test_a_grad_under_the_threshold_keeps_its_sum_op_and_the_last_copy_counts(monkeypatch):
    """Only a grad of `MIN_BYTES` or more is summed on arrival: a smaller one keeps the
    `sum` op, so a second copy in a round replaces the first, as before."""
    monkeypatch.setenv(bulk.BULK_ENV, "on")
    monkeypatch.setattr(arrival_sum, "MIN_BYTES", math.prod(SHAPE) * 4 + 1)
    seen = []
    grads = _grads(2, F32, 301)

    def copies(scope: Scope, seen: list):  # what the block's `sum` would read
        return lambda idx: seen.append([np.array(scope.find_var(f"w@GRAD.trainer_{t}").array) for t in range(2)])

    with _serving(2, F32, seen, copies) as (ps, clients):
        clients[0].send(ps.address, "w@GRAD.trainer_0", LoDTensor(np.full(SHAPE, 5, F32)))
        clients[0].send(ps.address, "w@GRAD.trainer_0", LoDTensor(grads[0]))
        _round(ps, clients, grads, [1])
        _complete(ps, clients)
    assert not ps.errors
    (got,) = seen
    assert all(np.array_equal(_bits(got[t]), _bits(grads[t])) for t in range(2))


def test_the_optimize_blocks_borrow_the_idle_chunk_buffer_for_sgd_s_piece(monkeypatch, small_chunks):
    """sgd's `lr * Grad` piece is computed in the pserver's idle chunk buffer while a sync
    round's optimize blocks run (issue 30: no memory of its own), and to the same bits;
    outside those blocks, or from another thread, nothing is lent."""
    from test_executor_liveness import program_with

    from ops.executor import Executor
    from ops.kernels import optimizers

    monkeypatch.setenv(bulk.BULK_ENV, "on")
    monkeypatch.setattr(optimizers, "SGD_CHUNK_BYTES", 4096)  # pieces of the chunk buffer's size
    monkeypatch.setattr(optimizers, "FUSED", False)  # sgd's numpy path: the compiled one takes no piece
    lent: list = []
    scope = Scope()
    w0 = np.random.default_rng(3).standard_normal(SHAPE).astype(F32)
    scope.set_var("w", LoDTensor(w0.copy()))
    scope.set_var("lr", LoDTensor(np.array([0.5], F32)))
    program = program_with(("sgd", {"Param": ["w"], "Grad": ["w@GRAD"], "LearningRate": ["lr"]}, {"ParamOut": ["w"]}, {}),
                           persistable=("w", "w@GRAD", "lr"))
    holder: dict = {}

    def run_sgd(idx: int) -> None:  # the optimize block, through an executor whose run lends the server's buffers
        server = holder["server"]

        def lend(nbytes):
            found = server.lend_chunk_buffer(nbytes)
            lent.append(found is not None and any(found is b for b in server._chunk_buffers))
            return found

        exe = Executor(free_dead=True)
        original = exe._run_block

        def run_block(run, *args, **kwargs):
            run.lend_scratch = lend
            return original(run, *args, **kwargs)

        exe._run_block = run_block
        exe.run(program, scope=scope, update_in_place=True)

    grads = _grads(2, F32, 5)
    for g in grads:
        g[np.isnan(g)] = 0
    with running_pserver(scope=scope, run_block=run_sgd, **_config(2, F32)) as ps:
        holder["server"] = ps.server
        clients = [ps.client(t) for t in range(2)]
        for c in clients:
            c.fetch_barrier([ps.address])
        _round(ps, clients, grads, (0, 1))
        assert ps.server.lend_chunk_buffer(16) is None  # between rounds
        _complete(ps, clients)
    assert not ps.errors
    assert lent and all(lent)  # every piece in the pool's buffer
    summed = _kernel_sum(grads)
    want = np.subtract(w0, np.multiply(summed, np.float32(0.5), dtype=F32))
    assert np.array_equal(_bits(scope.find_var("w").array), _bits(want))
