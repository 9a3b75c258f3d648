"""Bounded work per request (`ops.rpc.limits`), through a real gRPC server on loopback: a
fetch names each var once, replies are sized before encoding, encoding runs outside the
lock (and the optimize waits for it), small requests are refused from their size, and
no request of one trainer makes another's wait (issue 23's reproducer)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from rpc_support import running_pserver

import ops.rpc.server as server_module
from ops.rpc.limits import REPLY_FLOOR, SLACK_PER_VAR, Limited, Limits
from ops.rpc.server import WATCHES_PER_TRAINER, ServeConfig
from ops.rpc.service import CHANNEL_OPTIONS, METHODS
from ops.rpc.wire import encode_batch, var_parts
from ops.scope import Scope
from ops.tensor import LoDTensor, SelectedRows
from proto import rpc_pb2

F32 = np.dtype(np.float32)


def program_config(**extra):
    """What `listen_and_serv` would say of a pserver holding `w` [4, 3] and `b` [3], and
    receiving their grads from two trainers."""
    templates = {"w": ((4, 3), F32), "b": ((3,), F32), "w@GRAD": ((4, 3), F32), "b@GRAD": ((3,), F32)}
    return dict(known_vars=frozenset(templates), templates=templates, received=("w@GRAD", "b@GRAD"), **extra)


def params_scope() -> Scope:
    scope = Scope()
    scope.set_var("w", LoDTensor(np.arange(12, dtype=np.float32).reshape(4, 3)))
    scope.set_var("b", LoDTensor(np.ones(3, np.float32)))
    return scope


def stub(channel: grpc.Channel, method: str):
    m = METHODS[method]
    return channel.unary_unary(m.path, request_serializer=m.encode_request, response_deserializer=m.decode_response)


def test_the_limits_come_from_the_program():
    config = ServeConfig(endpoint="ps:1", fanin=2, **program_config())
    limits = Limits(config)
    assert limits.reply_limit == REPLY_FLOOR  # a small program: the floor
    big = {"t": ((1 << 20, 8), F32)}  # 32 MB
    config = ServeConfig(endpoint="ps:1", fanin=2, known_vars=frozenset(big), templates=big)
    assert Limits(config).reply_limit == 32 * (1 << 20) + SLACK_PER_VAR
    assert Limits(config).request_limits()["FetchBatch"] < 2048  # one name, once
    with pytest.raises(Limited, match="names 2 vars; the pserver holds 1"):
        Limits(config).fetch_names(["t", "t"], 0, "FetchBatch")
    with pytest.raises(Limited, match="has no var 'u'"):
        Limits(config).fetch_names(["u"], 0, "FetchBatch")


def test_issue_23_a_fetch_naming_one_var_two_million_times_is_refused_at_once_and_stalls_no_one():
    """The issue's reproducer: trainer 0 names `b` 2,097,152 times (21 MB, under the message
    floor). It is refused from its size, unparsed, in well under a second; trainer 1's
    gets meanwhile answer within a second each (bounded at 5 s: the stall took 44-70 s)."""
    with running_pserver(fanin=2, scope=params_scope(), **program_config()) as ps:
        with grpc.insecure_channel(ps.address, options=list(CHANNEL_OPTIONS)) as channel:
            get = stub(channel, "GetVariable")
            slowest, stop = [0.0], threading.Event()

            def other() -> None:
                while not stop.is_set():
                    t0 = time.perf_counter()
                    get(rpc_pb2.VariableMessage(varname="w", trainer_id=1).SerializeToString(), timeout=10)
                    slowest[0] = max(slowest[0], time.perf_counter() - t0)
                    time.sleep(0.01)

            thread = threading.Thread(target=other)
            thread.start()
            big = rpc_pb2.FetchRequest(trainer_id=0, varnames=["b"] * 2_097_152).SerializeToString()
            t0 = time.perf_counter()
            with pytest.raises(grpc.RpcError) as info:
                stub(channel, "FetchBatch")(rpc_pb2.FetchRequest.FromString(big), timeout=30)
            took = time.perf_counter() - t0
            stop.set()
            thread.join(30)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"a FetchBatch request of {len(big)} bytes; the limit is" in info.value.details()
        # before the limits: answered after 70.7 s, trainer 1's slowest get 44 s (docs/request-limits.md);
        # refused here in 0.2-0.7 s. The bound leaves room for a loaded machine (this process builds and
        # sends the 21 MB request while trainer 1's thread waits for the GIL), not for a stall.
        assert took < 5.0 and slowest[0] < 5.0, (took, slowest[0])


def test_a_fetch_naming_a_var_twice_is_refused_and_counts_no_barrier():
    with running_pserver(fanin=1, scope=params_scope(), **program_config()) as ps:
        with grpc.insecure_channel(ps.address, options=list(CHANNEL_OPTIONS)) as channel:
            fetch = stub(channel, "FetchBatch")
            for names in (["w", "w"], ["w", "b", "w"]):
                with pytest.raises(grpc.RpcError) as info:
                    fetch(rpc_pb2.FetchRequest(trainer_id=0, varnames=names, barrier=True), timeout=10)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "names 'w' more than once" in info.value.details()
            assert ps.server._phase is server_module.Phase.GET  # the barriers were not counted
            reply = fetch(rpc_pb2.FetchRequest(trainer_id=0, varnames=["w", "b"], barrier=True), timeout=10)
            assert [v.name for v in reply.vars] == ["w", "b"]
            assert ps.server._phase is server_module.Phase.SEND


def test_a_send_fetch_batch_with_a_refused_fetch_stores_nothing():
    with running_pserver(fanin=1, scope=params_scope(), **program_config()) as ps:
        with grpc.insecure_channel(ps.address, options=list(CHANNEL_OPTIONS)) as channel:
            stub(channel, "FetchBarrier")(rpc_pb2.BarrierMessage(trainer_id=0), timeout=10)  # to the SEND phase
            grad = var_parts("b@GRAD", LoDTensor(np.full(3, 5.0, np.float32)))
            request = encode_batch([grad], trainer_id=0, barrier=True, fetch=["b", "b"], fetch_barrier=True)
            with pytest.raises(grpc.RpcError) as info:
                stub(channel, "SendFetchBatch")(request, timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert ps.scope.find_var("b@GRAD") is None and ps.server._phase is server_module.Phase.SEND


def test_a_sync_send_naming_a_var_twice_is_refused():
    with running_pserver(fanin=1, scope=params_scope(), **program_config()) as ps:
        with grpc.insecure_channel(ps.address, options=list(CHANNEL_OPTIONS)) as channel:
            stub(channel, "FetchBarrier")(rpc_pb2.BarrierMessage(trainer_id=0), timeout=10)
            grad = var_parts("b@GRAD", LoDTensor(np.full(3, 5.0, np.float32)))
            with pytest.raises(grpc.RpcError) as info:
                stub(channel, "SendBatch")(encode_batch([grad, grad], trainer_id=0), timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "more than once" in info.value.details()
            assert ps.scope.find_var("b@GRAD") is None


def test_a_reply_past_the_limit_is_refused_before_it_is_encoded(monkeypatch):
    """A var whose program shape is open (-1) holds more than the floor: refused, and
    nothing was encoded."""
    templates = {"t": ((-1,), F32)}
    scope = Scope()
    scope.set_var("t", LoDTensor(np.zeros(REPLY_FLOOR // 4 + 1, np.float32)))
    encoded = []
    real = server_module._encode_values
    monkeypatch.setattr(server_module, "_encode_values", lambda values: encoded.append(1) or real(values))
    with running_pserver(sync_mode=False, scope=scope, known_vars=frozenset(templates), templates=templates) as ps:
        with grpc.insecure_channel(ps.address, options=list(CHANNEL_OPTIONS)) as channel:
            with pytest.raises(grpc.RpcError) as info:
                stub(channel, "FetchBatch")(rpc_pb2.FetchRequest(trainer_id=0, varnames=["t"]), timeout=10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "byte reply; the limit is" in info.value.details() and not encoded


def test_a_reply_is_encoded_outside_the_lock_and_the_optimize_waits_for_it(monkeypatch):
    """A slow encode of trainer 0's fetch: trainer 1's get answers meanwhile, and the
    round's optimize (which may update params in place) starts only once it is done."""
    real = server_module._encode_values
    encoding = threading.Event()
    log: list[tuple[str, float]] = []

    def slow(values):
        encoding.set()
        time.sleep(1.0)
        log.append(("encoded", time.monotonic()))
        return real(values)

    monkeypatch.setattr(server_module, "_encode_values", slow)
    with running_pserver(fanin=2, scope=params_scope(), run_block=lambda idx: log.append(("optimize", time.monotonic())),
                         optimize_blocks=(1,), **program_config()) as ps:
        with grpc.insecure_channel(ps.address, options=list(CHANNEL_OPTIONS)) as channel:
            fetch, get = stub(channel, "FetchBatch"), stub(channel, "GetVariable")
            slow_fetch = threading.Thread(
                target=lambda: fetch(rpc_pb2.FetchRequest(trainer_id=0, varnames=["w", "b"]), timeout=30))
            slow_fetch.start()
            assert encoding.wait(10)
            t0 = time.perf_counter()
            get(rpc_pb2.VariableMessage(varname="w", trainer_id=1).SerializeToString(), timeout=10)
            assert time.perf_counter() - t0 < 0.5  # not behind the encode
            # both trainers end the GET phase and send their grads: the round is due
            for tid in (0, 1):
                stub(channel, "FetchBarrier")(rpc_pb2.BarrierMessage(trainer_id=tid), timeout=10)
            for tid in (0, 1):
                request = encode_batch([var_parts(n, LoDTensor(np.zeros(s, np.float32)), trainer_id=tid)
                                        for n, s in (("w@GRAD", (4, 3)), ("b@GRAD", (3,)))], trainer_id=tid, barrier=True)
                stub(channel, "SendBatch")(request, timeout=10)
            slow_fetch.join(30)
            deadline = time.monotonic() + 10
            while not any(what == "optimize" for what, _ in log) and time.monotonic() < deadline:
                time.sleep(0.05)
    kinds = [what for what, _ in log]
    assert kinds[:2] == ["encoded", "optimize"], kinds


def test_shared_replies_are_bounded_and_dropped_when_the_get_phase_ends():
    """Trainers asking different sets of names each round: the shared replies held stay
    under the reply limit, and the round's end drops them."""
    templates = {f"p{i}": ((1 << 20,), F32) for i in range(6)}  # 4 MB each; limit: the 16 MB floor
    scope = Scope()
    for name in templates:
        scope.set_var(name, LoDTensor(np.zeros(1 << 20, np.float32)))
    with running_pserver(fanin=1, scope=scope, known_vars=frozenset(templates), templates=templates) as ps:
        with grpc.insecure_channel(ps.address, options=list(CHANNEL_OPTIONS)) as channel:
            fetch = stub(channel, "FetchBatch")
            names = sorted(templates)
            for i in range(len(names)):
                for j in range(i + 1, len(names) + 1):
                    reply = fetch(rpc_pb2.FetchRequest(trainer_id=0, varnames=names[i:j]), timeout=10)
                    assert [v.name for v in reply.vars] == names[i:j]
            held = sum(len(entry._data or b"") for entry in ps.server._replies.values())
            assert 0 < held <= ps.server._limits.reply_limit
            fetch(rpc_pb2.FetchRequest(trainer_id=0, barrier=True), timeout=10)
            assert not ps.server._replies and ps.server._replies_bytes == 0


def test_small_requests_past_their_size_are_refused_unparsed():
    with running_pserver(fanin=1, scope=params_scope(), **program_config()) as ps:
        with grpc.insecure_channel(ps.address, options=list(CHANNEL_OPTIONS)) as channel:
            cases = [
                ("SendComplete", rpc_pb2.CompleteMessage(trainer_id=0, failed=True, reason="x" * (1 << 20))),
                ("CheckpointNotify", rpc_pb2.CheckpointMessage(trainer_id=0, dir="d" * (1 << 20))),
                ("Watch", rpc_pb2.WatchMessage(trainer_id=0, seconds=1, **{})),
            ]
            for method, message in cases[:2]:
                with pytest.raises(grpc.RpcError) as info:
                    stub(channel, method)(message, timeout=10)
                assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, method
                assert f"a {method} request of" in info.value.details()
            get = rpc_pb2.VariableMessage(varname="w", trainer_id=0, has_value=True, data_type=5, dims=[1 << 18],
                                          data=bytes(1 << 20))
            with pytest.raises(grpc.RpcError) as info:
                stub(channel, "GetVariable")(get.SerializeToString(), timeout=10)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert ps.server._failure is None  # the 1 MB failure notice was not read


def test_a_failed_trainer_s_reason_is_cut_to_a_bounded_length():
    with running_pserver(fanin=1, scope=params_scope(), **program_config()) as ps:
        with grpc.insecure_channel(ps.address, options=list(CHANNEL_OPTIONS)) as channel:
            stub(channel, "SendComplete")(rpc_pb2.CompleteMessage(trainer_id=0, failed=True, reason="r" * 50_000),
                                          timeout=10)
        ps.join()
    assert len(ps.server._failure) < 1200 and ps.server._failure.endswith("r ...")


def test_a_trainer_holds_a_bounded_number_of_watch_calls():
    with running_pserver(fanin=2, scope=params_scope(), **program_config()) as ps:
        with grpc.insecure_channel(ps.address, options=list(CHANNEL_OPTIONS)) as channel:
            watch = stub(channel, "Watch")
            held = [watch.future(rpc_pb2.WatchMessage(trainer_id=0, seconds=30)) for _ in range(WATCHES_PER_TRAINER)]
            deadline = time.monotonic() + 10
            while ps.server._trainers[0].watches < WATCHES_PER_TRAINER and time.monotonic() < deadline:
                time.sleep(0.02)
            with pytest.raises(grpc.RpcError) as info:
                watch(rpc_pb2.WatchMessage(trainer_id=0, seconds=30), timeout=10)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            watch.future(rpc_pb2.WatchMessage(trainer_id=1, seconds=0.1)).result(timeout=10)  # the other's still goes
            for call in held:
                call.cancel()


def test_a_prefetch_asking_more_ids_than_the_table_has_rows_is_refused():
    scope = Scope()
    scope.set_var("table", SelectedRows(np.zeros(0, np.int64), np.zeros((4, 2), np.float32), height=10,
                                        initializer=lambda n: np.ones((n, 2), np.float32)))
    with running_pserver(sync_mode=False, scope=scope) as ps:
        client = ps.client(0)
        assert client.prefetch(ps.address, "table", np.arange(10)).array.shape == (10, 2)
        with pytest.raises(Exception, match="asks 11 ids of a table of 10 rows"):
            client.prefetch(ps.address, "table", np.zeros(11, np.int64))


def test_a_lookup_table_checkpoint_path_is_a_table_shard_outside_the_pserver_s_checkpoints(tmp_path):
    """A lookup-table notice runs the checkpoint block at Paddle's `DIR/<table>_<i>`: the
    table must be the program's, the name its shard's, not inside a `ckpt-<step>` of this
    pserver, not a directory; each refusal is the sender's (never INTERNAL)."""
    from ops.rpc.checkpoint import Checkpointer

    saved: list[str] = []
    scope = params_scope()
    (tmp_path / "ckpt-3").mkdir()
    (tmp_path / "d" / "w_0").mkdir(parents=True)
    own = Checkpointer(tmp_path, "ps0", ("ps0",), {}, "{}")

    def block(idx):  # the checkpoint block: save the shard at the path bound to kLookupTablePath
        path = Path(str(scope.find_var("kLookupTablePath")))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"shard")
        saved.append(str(path))

    with running_pserver(fanin=1, scope=scope, checkpointer=own, checkpoint_block=1, run_block=block,
                         **program_config()) as ps:
        with grpc.insecure_channel(ps.address, options=list(CHANNEL_OPTIONS)) as channel:
            call = stub(channel, "CheckpointNotify")
            cases = [("w", "d/w_0", "FAILED_PRECONDITION"), ("nope", "d/nope_0", "INVALID_ARGUMENT"),
                     ("w", "d/b_0", "INVALID_ARGUMENT"), ("w", "ckpt-3/w_0", "INVALID_ARGUMENT"),
                     ("w", "../w_0", "INVALID_ARGUMENT"), ("w", "d/" + "x" * 300 + "/w_0", "INVALID_ARGUMENT")]
            for table, name, code in cases:
                with pytest.raises(grpc.RpcError) as info:
                    call(rpc_pb2.CheckpointMessage(trainer_id=0, dir=name, lookup_table=table), timeout=10)
                assert info.value.code().name == code, (name, info.value.details())
            assert not saved
            def save(name):  # what the checkpoint block would write
                call(rpc_pb2.CheckpointMessage(trainer_id=0, dir=name, lookup_table="w"), timeout=10)

            save("d/e/w_1")
            assert saved == [str(tmp_path.resolve() / "d" / "e" / "w_1")]
            # only the `keep` (3) paths saved last are kept: notices at new paths cannot fill the disk
            for step in range(2, 7):
                save(f"s{step}/w_0")
            save("s4/w_0")  # saved again: the newest
    kept = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("w_*") if p.is_file())
    assert kept == ["s4/w_0", "s5/w_0", "s6/w_0"]
    assert not (tmp_path / "d" / "e").exists() and not (tmp_path / "s2").exists()  # emptied folders go too
    assert (tmp_path / "d" / "w_0").is_dir() and (tmp_path / "ckpt-3").is_dir()  # nothing it did not write
