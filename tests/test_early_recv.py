"""Early receives (`ops.rpc.early_recv`, issue 30): a sync trainer's `fetch_barrier`
returns before the params are in; each var is pending in the scope until it is, and every
read or write of it waits there. Training equals training without them bit for bit (two
trainers, float32 and float64, the bulk channel on and by default); a fetch or a read of a
param right after the run sees its final value; a receive that breaks surfaces at the next
read of a var it did not bring, naming the var; waits are bounded; the `recv` thread stops
with the client; the setting is checked."""

from __future__ import annotations

import io
import threading
import time

import grpc
import numpy as np
import pytest
from test_listen_and_serv_programs import STEPS, batch, net, train_in_threads

from ops.executor import ExecutionError
from ops.rpc import RpcError, bulk, early_recv
from ops.rpc import client as client_module
from ops.rpc.env_choice import EnvChoiceError, check_env_choices
from ops.scope import Scope
from ops.tensor import LoDTensor
from transpiler.ir.precision import as_float64
from transpiler.runtime.launch import free_endpoints
from transpiler.runtime.role import PSERVER, TRAINER, Role
from transpiler.runtime.session import Session

F32, F64 = np.float32, np.float64


@pytest.fixture
def started(monkeypatch):
    """Records each fetch_barrier that received early: how many params it may receive into."""
    seen: list[int] = []
    real = early_recv.receive_early

    def recording(ctx, client, endpoints, deferred, into, params):
        done = real(ctx, client, endpoints, deferred, into, params)
        if done:
            seen.append(len(params))
        return done

    monkeypatch.setattr(early_recv, "receive_early", recording)
    return seen


@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
def test_training_with_early_receives_equals_training_without_bit_for_bit(monkeypatch, started, dtype):
    """2 pservers x 2 trainers, Adam with lr decay, `fc1.w` cut in two blocks: `on` with the
    bulk channel on (blocks received into the param) and by default (this net's vars are
    under its threshold: gRPC, blocks joined), `auto` with the channel on, against `off`."""
    main, startup = net("exponential", "adam")
    if dtype is F64:
        main, startup = as_float64(main), as_float64(startup)
    finals = {}
    for recv, channel in (("off", "auto"), ("on", "on"), ("on", "auto"), ("auto", "on")):
        monkeypatch.setenv(client_module.RECV_ENV, recv)
        monkeypatch.setenv(bulk.BULK_ENV, channel)
        started.clear()
        results, _ = train_in_threads(main, startup, pservers=2, trainers=2)
        finals[recv, channel] = results
        if recv == "off":
            assert not started
            continue
        assert len(started) == 2 * STEPS, (recv, channel)  # every step of both trainers
        assert set(started) == {1}, (recv, channel, started)  # fc1.w's blocks tile it
    want = finals["off", "auto"]
    for key, results in finals.items():
        for tid in range(2):
            for which in range(2):  # initial, final
                got, ref = results[tid][which], want[tid][which]
                assert got.keys() == ref.keys()
                for name, value in ref.items():
                    assert value.dtype == dtype and np.array_equal(got[name], value), (key, tid, which, name)
    assert not np.array_equal(want[0][0]["fc1.w"], want[0][1]["fc1.w"])  # it did train


def _one_trainer(monkeypatch, recv: str, step_hook, *, channel: str = "on"):
    """1 pserver, 1 trainer (threads) training `net()`; `step_hook(session, step)` runs each
    step in place of `session.run(batch)`. Returns what the hooks returned and the pserver
    thread's error, if any."""
    monkeypatch.setenv(client_module.RECV_ENV, recv)
    monkeypatch.setenv(bulk.BULK_ENV, channel)
    main, startup = net("none", "sgd")
    endpoints = tuple(free_endpoints(1))
    out: list = []
    errors: dict[str, BaseException] = {}

    def pserver() -> None:
        try:
            Session(main, startup, role=Role(PSERVER, 0, 1, endpoints, endpoints[0], True, 20.0)).serve()
        except BaseException as exc:  # noqa: BLE001 - returned
            errors["pserver"] = exc

    thread = threading.Thread(target=pserver)
    thread.start()
    try:
        with Session(main, startup, role=Role(TRAINER, 0, 1, endpoints, None, True, 20.0), out=io.StringIO()) as session:
            session.start()
            for step in range(4):
                out.append(step_hook(session, step))
    except BaseException as exc:  # noqa: BLE001 - returned
        errors["trainer"] = exc
    thread.join(60)
    assert not thread.is_alive(), "the pserver hung"
    return out, errors


def test_a_param_read_right_after_the_run_is_its_final_value(monkeypatch):
    """The replies are held back 0.2 s: the run returns first (the receive is still in
    flight), and a read from the scope, a fetch of the param and the params of
    `Session.params` wait for the values the run without early receives has."""

    def step(session, i):
        session.run(batch(i))
        return {name: np.array(v) for name, v in session.params().items()}

    want, errors = _one_trainer(monkeypatch, "off", step)
    assert not errors, errors
    real = client_module.RpcClient._finish_send_fetch

    def slow(self, *args):
        time.sleep(0.2)
        return real(self, *args)

    monkeypatch.setattr(client_module.RpcClient, "_finish_send_fetch", slow)
    in_flight: list[bool] = []

    def early_step(session, i):
        if i % 2:
            fetched = session.run(batch(i), fetch_list=["fc1.w", "fc2.b"])
            return {"fc1.w": fetched[0], "fc2.b": fetched[1]}
        session.run(batch(i))
        in_flight.append(session.client._recv is not None and not session.client._recv.done())
        got = {"fc1.w": np.array(session.scope.find_var("fc1.w").array)}
        return got | {name: np.array(v) for name, v in session.params().items()}

    got, errors = _one_trainer(monkeypatch, "on", early_step)
    assert not errors, errors
    assert in_flight == [True, True]
    for i, values in enumerate(got):
        for name, value in values.items():
            assert np.array_equal(value, want[i][name]), (i, name)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("rpc-trainer0-recv")]


def test_a_receive_that_breaks_surfaces_at_the_next_read_naming_the_var(monkeypatch):
    """Step 2's reply breaks after `fc1.w`'s blocks are in: `fc1.w` reads fine, `fc2.w` (in
    the scope, half written) raises the call's failure naming it, and the next step's
    first op reading a var the reply did not bring (`fc1.b`) fails naming that one."""
    real = bulk.BulkClient.call
    calls = []

    def call(self, method, items, **kwargs):
        arrived = kwargs.get("arrived")
        if arrived is not None:
            calls.append(method)
        if arrived is not None and len(calls) == 3:  # step 2's (steps 0 and 1 made the first two)
            def breaking(name, value):
                if not name.startswith("fc1.w"):
                    raise bulk.BulkCallError(grpc.StatusCode.UNAVAILABLE, "the bulk channel broke ([Errno 104] reset)")
                arrived(name, value)
            kwargs["arrived"] = breaking
        return real(self, method, items, **kwargs)

    monkeypatch.setattr(bulk.BulkClient, "call", call)
    seen: list = []

    def step(session, i):
        session.run(batch(i))
        if i < 2:
            return None
        session.client._recv.exception(10)  # the receive has failed
        seen.append(np.array(session.scope.find_var("fc1.w").array))
        with pytest.raises(RpcError, match=r"trainer 0: var 'fc2\.w' was not received: trainer 0: send barrier and "
                                           r"fetch barrier on pserver \S+ failed: the pserver is unavailable "
                                           r"\(the bulk channel broke"):
            session.scope.find_var("fc2.w")
        session.run(batch(i + 1))  # raises: its ops read fc2.w
        return None

    _, errors = _one_trainer(monkeypatch, "on", step)
    assert seen and seen[0].shape == (64, 256), errors
    error = errors["trainer"]
    assert isinstance(error, ExecutionError) and "var 'fc1.b' was not received" in str(error), error
    assert not [t.name for t in threading.enumerate() if t.name.startswith("rpc-trainer0-recv")]


def test_a_pending_var_is_waited_for_boundedly_and_a_failed_one_raises_until_rewritten():
    scope = Scope()
    child = scope.new_scope()
    scope.set_var("w", LoDTensor(np.zeros(3, F32)))
    arrival = early_recv._Arrival(0.05, "trainer 0")
    scope.expect("w", arrival)
    with pytest.raises(RpcError, match=r"trainer 0: var 'w' was still not received after 0\.05 s"):
        child.find_var("w")
    assert child.find_var("b") is None  # other names do not wait
    threading.Timer(0.05, lambda: (scope.settle("w", arrival, LoDTensor(np.ones(3, F32))), arrival.event.set())).start()
    arrival.limit = 5.0
    assert np.array_equal(child.find_var("w").array, np.ones(3, F32))  # waited for it
    failing = early_recv._Arrival(5.0, "trainer 0")
    scope.expect("w", failing)
    failing.error = RpcError("trainer 0: var 'w' was not received: broke")
    scope.fail("w", failing)
    failing.event.set()
    for _ in range(2):
        with pytest.raises(RpcError, match="var 'w' was not received: broke"):
            scope.find_var("w")
    assert not scope.has_var("w", local=True)  # the half-written value is gone
    scope.set_var("w", LoDTensor(np.full(3, 2, F32)))  # a write replaces the failure
    assert scope.find_var("w").array[0] == 2 and not scope.pending_names()


def test_the_setting_is_checked():
    assert client_module.recv_choice({}) == "auto"
    assert client_module.recv_choice({client_module.RECV_ENV: " Off "}) == "off"
    with pytest.raises(EnvChoiceError, match=r"PSTRANSPILE_EARLY_RECV='soon': expected one of auto, off, on"):
        check_env_choices({client_module.RECV_ENV: "soon"})
