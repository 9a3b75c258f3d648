"""Early sends (`ops.rpc.client`, issue 30): in a sync step a big dense grad starts on its
pserver's bulk channel as soon as its `send` op runs, on an ordered stream per pserver,
while the executor goes on. Training equals training without them bit for bit (two
trainers, float32 and float64); small vars stay in the step's one message; a failed early
send surfaces at the barrier as the send's error; no kernel writes into an array in
flight (the stream holds it, and the executor's reference counts see that); the stream's
thread stops with the client; the setting is checked."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
from rpc_support import running_pserver, sgd_block

from ops.executor import Executor
from ops.kernels import context as kernel_context
from ops.rpc import RpcError, bulk
from ops.rpc import client as client_module
from ops.rpc.env_choice import check_env_choices
from ops.scope import Scope
from ops.tensor import LoDTensor, SelectedRows
from transpiler.ir import DType, Program

F32, F64 = np.float32, np.float64


@pytest.fixture(autouse=True)
def _bulk_on(monkeypatch):
    monkeypatch.setenv(bulk.BULK_ENV, "on")


def _config(fanin: int, dtype=F32):
    """w [300, 200] and b [4] dense, emb [10, 4] sparse: per trainer when `fanin` > 1."""
    shapes = {"w@GRAD": (300, 200), "b@GRAD": (4,), "emb@GRAD": (10, 4)}
    received = tuple(g if fanin == 1 else f"{g}.trainer_{t}" for g in shapes for t in range(fanin))
    templates = {n: (shapes[n.split(".trainer_")[0]], dtype) for n in received}
    sparse = frozenset(n for n in received if n.startswith("emb@GRAD"))
    return dict(fanin=fanin, received=received, templates=templates, sparse_vars=sparse, optimize_blocks=(1,),
                known_vars=frozenset(received) | {"w", "b", "emb"})


def _scope(dtype=F32) -> Scope:
    scope = Scope()
    for name, shape in (("w", (300, 200)), ("b", (4,)), ("emb", (10, 4))):
        scope.set_var(name, LoDTensor(np.ones(shape, dtype)))
    return scope


def _train(early: str, dtype, steps: int = 3) -> tuple[list[np.ndarray], dict]:
    """Two trainers (threads) run `steps` sync steps, sending as the `send` kernel does in
    a sync program (`early=True`); the params trainer 0 fetched last and its stats."""
    scope = _scope(dtype)
    with running_pserver(scope=scope, run_block=sgd_block(scope, 2, ("w", "b", "emb")), **_config(2, dtype)) as ps:
        clients = [ps.client(t, early=early) for t in range(2)]
        got: dict[int, list] = {}
        errors: list[BaseException] = []
        before: dict[int, dict] = {}

        def trainer(t: int) -> None:
            try:
                c = clients[t]
                c.fetch_barrier([ps.address], [(ps.address, "w")])
                before[t] = c.stats.snapshot()
                for step in range(steps):
                    rng = np.random.default_rng(10 * step + t)
                    c.send_async(ps.address, f"emb@GRAD.trainer_{t}",
                                 SelectedRows([t, 3, 3], rng.standard_normal((3, 4)).astype(dtype), height=10), early=True)
                    c.send_async(ps.address, f"w@GRAD.trainer_{t}",
                                 LoDTensor(rng.standard_normal((300, 200)).astype(dtype)), early=True)
                    c.send_async(ps.address, f"b@GRAD.trainer_{t}", LoDTensor(rng.standard_normal(4).astype(dtype)),
                                 early=True)
                    c.send_barrier([ps.address], defer=True)
                    got[t] = c.fetch_barrier([ps.address], [(ps.address, n) for n in ("w", "b", "emb")])
                c.complete([ps.address])
            except BaseException as exc:  # noqa: BLE001 - raised below
                errors.append(exc)

        threads = [threading.Thread(target=trainer, args=(t,)) for t in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not errors, errors
        stats = client_module.RpcStats.delta(clients[0].stats.snapshot(), before[0])
    values = [v.array for v in got[0]]
    assert all(np.array_equal(a, v.array) for a, v in zip(values, got[1], strict=True))
    return values, stats


@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
def test_sync_training_with_early_sends_equals_training_without_bit_for_bit(dtype):
    early, stats_on = _train("on", dtype)
    late, stats_off = _train("off", dtype)
    auto, stats_auto = _train("auto", dtype)
    assert early[0].dtype == dtype
    assert all(np.array_equal(a, b) for a, b in zip(early, late, strict=True))
    assert all(np.array_equal(a, b) for a, b in zip(auto, late, strict=True))
    assert not np.array_equal(late[0], np.ones((300, 200), dtype))  # the steps did train
    # `on`: each dense grad went early (one SendBatch each), the rest in the step's one message.
    assert stats_on["SendBatch"][0] == 2 * 3 and stats_on["SendFetchBatch"][0] == 3
    assert stats_on["SendBatch"][1] > 3 * 300 * 200 * np.dtype(dtype).itemsize
    # `off`, and `auto` with nothing of EARLY_MIN bytes: one message per step.
    for stats in (stats_off, stats_auto):
        assert "SendBatch" not in stats and stats["SendFetchBatch"][0] == 3


def test_auto_sends_early_only_what_is_big_enough(monkeypatch):
    monkeypatch.setattr(client_module, "EARLY_MIN", 300 * 200 * 4)
    _, stats = _train("auto", F32, steps=2)
    assert stats["SendBatch"][0] == 2 and stats["SendFetchBatch"][0] == 2  # w alone went early


def _single(dtype=F32):
    scope = _scope(dtype)
    return scope, dict(scope=scope, run_block=sgd_block(scope, 1, ("w", "b", "emb")), **_config(1, dtype))


def test_a_refused_early_send_fails_at_the_barrier_naming_the_var():
    scope, config = _single()
    with running_pserver(**config) as ps:
        client = ps.client(0, early="on")
        client.fetch_barrier([ps.address])
        client.send_async(ps.address, "w@GRAD", LoDTensor(np.ones(7, F32)), early=True)  # queued: no error yet
        client.send_barrier([ps.address], defer=True)
        with pytest.raises(RpcError, match=r"trainer 0: send of w@GRAD on pserver 127\.0\.0\.1:\d+ failed "
                                           r"\(INVALID_ARGUMENT\): pserver .*'w@GRAD': shape \[7\]"):
            client.fetch_barrier([ps.address], [(ps.address, "w")])
        assert ps.scope.find_var("w@GRAD") is None


def test_an_early_send_that_breaks_fails_at_the_barrier_and_the_rest_is_not_sent(monkeypatch):
    real = bulk.BulkClient.call

    def broken(self, method, items, **kwargs):
        if method == "SendBatch":
            raise bulk.BulkCallError(grpc.StatusCode.UNAVAILABLE, "the bulk channel broke ([Errno 104] reset)")
        return real(self, method, items, **kwargs)

    scope, config = _single()
    with running_pserver(**config) as ps:
        client = ps.client(0, early="on")
        client.fetch_barrier([ps.address])
        monkeypatch.setattr(bulk.BulkClient, "call", broken)
        client.send_async(ps.address, "w@GRAD", LoDTensor(np.ones((300, 200), F32)), early=True)
        client.send_async(ps.address, "b@GRAD", LoDTensor(np.ones(4, F32)), early=False)
        client.send_barrier([ps.address], defer=True)
        with pytest.raises(RpcError, match=r"trainer 0: send of w@GRAD on pserver \S+ failed: the pserver is "
                                           r"unavailable \(the bulk channel broke"):
            client.fetch_barrier([ps.address], [(ps.address, "w")])
        assert ps.server.rounds == 0 and ps.scope.find_var("b@GRAD") is None  # no barrier without the grad


def _send_then_sum(address: str) -> Program:
    """g = 2x; send g (early); s = g + x (g dies here: `sum` may compute into its array);
    send_barrier."""
    program = Program.empty()
    block = program.global_block()
    for name in ("x", "g", "s"):
        block.create_var(name, dtype=DType.FP32, shape=[-1])
    block.add_op("scale", {"X": ["x"]}, {"Out": ["g"]}, {"scale": 2.0})
    block.add_op("send", {"X": ["g"]}, {}, {"epmap": [address]})
    block.add_op("sum", {"X": ["g", "x"]}, {"Out": ["s"]}, {})
    block.add_op("send_barrier", {}, {}, {"endpoints": [address]})
    return program


def _in_flight_run(monkeypatch, defeat_refcounts: bool) -> tuple[np.ndarray, np.ndarray, bool]:
    """Run `_send_then_sum` with g's early send held in flight until the barrier waits for
    it (the gate opens only then, after `sum` ran): (what the pserver received as g, s,
    whether the early send was on the wire)."""
    gate, entered = threading.Event(), threading.Event()
    real_call, real_wait = bulk.BulkClient.call, client_module.RpcClient._wait_early

    def held_call(self, method, items, **kwargs):
        if method == "SendBatch":
            entered.set()
            assert gate.wait(10), "the barrier never waited for the early send"
        return real_call(self, method, items, **kwargs)

    def wait_early(self, endpoint=None):
        gate.set()  # the send stays in flight until the step waits for it
        return real_wait(self, endpoint)

    monkeypatch.setattr(bulk.BulkClient, "call", held_call)
    monkeypatch.setattr(client_module.RpcClient, "_wait_early", wait_early)
    if defeat_refcounts:  # what a kernel would do if the stream's reference did not count
        monkeypatch.setattr(kernel_context, "_references", lambda array: kernel_context.SOLE_LOCAL_REFERENCES + 1)
    x = np.arange(1, 4097, dtype=F32)
    shapes = {"g": ((4096,), F32)}
    with running_pserver(received=("g",), templates=shapes, known_vars=frozenset({"g"}), optimize_blocks=(1,)) as ps:
        client = ps.client(0, early="on")
        client.fetch_barrier([ps.address])
        scope = Scope()
        Executor(free_dead=True, env={"rpc": client}).run(_send_then_sum(ps.address), feed={"x": x}, scope=scope)
        deadline = time.monotonic() + 10
        while ps.server.rounds < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        received = ps.scope.find_var("g").array.copy()
    return received, scope.find_var("s").array, entered.is_set()


def test_no_kernel_writes_into_an_array_while_its_early_send_is_in_flight(monkeypatch):
    x = np.arange(1, 4097, dtype=F32)
    received, s, held = _in_flight_run(monkeypatch, defeat_refcounts=False)
    assert held
    np.testing.assert_array_equal(received, 2 * x)  # the bits of g when its send op ran
    np.testing.assert_array_equal(s, 2 * x + x)


def test_the_in_flight_proof_can_fail(monkeypatch):
    """The control: with the reference counts defeated, `sum` computes into g's array while
    it is in flight and the pserver receives s instead of g (so the test above can fail)."""
    x = np.arange(1, 4097, dtype=F32)
    received, s, _ = _in_flight_run(monkeypatch, defeat_refcounts=True)
    np.testing.assert_array_equal(received, 2 * x + x)
    np.testing.assert_array_equal(s, 2 * x + x)


def test_the_stream_thread_stops_with_the_client():
    scope, config = _single()
    with running_pserver(**config) as ps:
        client = ps.client(0, early="on")
        client.fetch_barrier([ps.address])
        client.send_async(ps.address, "w@GRAD", LoDTensor(np.ones((300, 200), F32)), early=True)
        client.send_async(ps.address, "b@GRAD", LoDTensor(np.ones(4, F32)), early=True)
        client.send_async(ps.address, "emb@GRAD", SelectedRows([1], np.ones((1, 4), F32), height=10), early=True)
        client.send_barrier([ps.address], defer=True)
        client.fetch_barrier([ps.address], [(ps.address, "w")])
        name = f"rpc-trainer{client.trainer_id}-early"
        assert any(t.name.startswith(name) for t in threading.enumerate())
        client.close()
        deadline = time.monotonic() + 5
        while any(t.name.startswith(name) for t in threading.enumerate()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not any(t.name.startswith(name) for t in threading.enumerate())
        with pytest.raises(RpcError, match="closed"):
            client.send_async(ps.address, "w@GRAD", LoDTensor(np.ones((300, 200), F32)), early=True)


def test_the_setting_is_checked(monkeypatch):
    assert client_module.early_choice({}) == "off"  # the default (measured: docs/runtime.md)
    assert client_module.early_choice({client_module.EARLY_ENV: " ON "}) == "on"
    with pytest.raises(client_module.EarlyChoiceError, match=r"PSTRANSPILE_EARLY_SEND='soon': expected one of off, auto, on"):
        client_module.early_choice({client_module.EARLY_ENV: "soon"})
    with pytest.raises(client_module.EarlyChoiceError):
        check_env_choices({client_module.EARLY_ENV: "soon"})
    monkeypatch.setenv(client_module.EARLY_ENV, "auto")
    assert client_module.RpcClient(0).early == "auto"
