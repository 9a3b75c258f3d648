"""The bulk channel (`ops.rpc.bulk`, issue 30): the tensors of `SendBatch`,
`SendFetchBatch` and `FetchBatch` on a TCP stream beside gRPC. Round trips equal to
gRPC's, sync receive buffers reused, forged and malformed frames refused from their
header before any payload is read (nothing applied, the pserver keeps serving), TLS on
the channel, and the `PSTRANSPILE_BULK` choice."""

from __future__ import annotations

import json
import select
import socket
import ssl
import time

import grpc
import numpy as np
import pytest
from rpc_support import running_pserver, sgd_block, self_signed

from ops.rpc import RpcClient, RpcError, bulk
from ops.rpc.auth import ClientAuth, ServerAuth, Tls
from ops.rpc.env_choice import check_env_choices
from ops.rpc.server import PServer, ServeConfig
from ops.scope import Scope
from ops.tensor import LoDTensor, SelectedRows

F32, F64 = np.float32, np.float64
TOKEN = "bulk-test-token-0123456789"


@pytest.fixture(autouse=True)
def _bulk_on(monkeypatch):
    monkeypatch.setenv(bulk.BULK_ENV, "on")


def _config(fanin: int = 1, dtype=F32, **extra):
    """w [300, 200] dense, emb [10, 4] sparse: per trainer when `fanin` > 1."""
    shapes = {"w@GRAD": (300, 200), "emb@GRAD": (10, 4)}
    received = tuple(g if fanin == 1 else f"{g}.trainer_{t}" for g in shapes for t in range(fanin))
    templates = {n: (shapes[n.split(".trainer_")[0]], dtype) for n in received}
    sparse = frozenset(n for n in received if n.startswith("emb@GRAD"))
    return dict(fanin=fanin, received=received, templates=templates, sparse_vars=sparse, optimize_blocks=(1,),
                known_vars=frozenset(received) | {"w", "emb"}, **extra)


def _scope(dtype=F32) -> Scope:
    scope = Scope()
    scope.set_var("w", LoDTensor(np.ones((300, 200), dtype)))
    scope.set_var("emb", LoDTensor(np.ones((10, 4), dtype)))
    return scope


def _sgd(scope: Scope, fanin: int):
    return sgd_block(scope, fanin, ("w", "emb"))


def _one_round(client, address: str, grad: float):
    """A trainer's first round on a fresh pserver (`_sgd`, lr 1, w all 1): the startup
    fetch, a dense grad of `grad` and a SelectedRows one, the deferred send barrier and the
    fetch of w; w's value after the round."""
    client.fetch_barrier([address])
    client.send_async(address, "w@GRAD", LoDTensor(np.full((300, 200), grad, F32)))
    client.send_async(address, "emb@GRAD", SelectedRows([2], np.full((1, 4), 0.5, F32), height=10))
    client.send_barrier([address], defer=True)
    (got,) = client.fetch_barrier([address], [(address, "w")])
    return got


def _train(monkeypatch, choice: str, dtype, steps: int = 3) -> tuple[np.ndarray, np.ndarray, dict]:
    """Two trainers (threads) run `steps` sync steps; the params they fetched last and the stats."""
    monkeypatch.setenv(bulk.BULK_ENV, choice)
    scope = _scope(dtype)
    with running_pserver(scope=scope, run_block=_sgd(scope, 2), **_config(2, dtype)) as ps:
        assert (ps.server._bulk is not None) == (choice == "on")
        clients = [ps.client(t) for t in range(2)]
        import threading

        got: dict[int, list] = {}

        def trainer(t: int) -> None:
            c = clients[t]
            c.fetch_barrier([ps.address], [(ps.address, "w")])
            for step in range(steps):
                rng = np.random.default_rng(10 * step + t)
                c.send_async(ps.address, f"w@GRAD.trainer_{t}", LoDTensor(rng.standard_normal((300, 200)).astype(dtype)))
                c.send_async(ps.address, f"emb@GRAD.trainer_{t}",
                             SelectedRows([t, 3, 3], rng.standard_normal((3, 4)).astype(dtype), height=10))
                c.send_barrier([ps.address], defer=True)
                got[t] = c.fetch_barrier([ps.address], [(ps.address, "w"), (ps.address, "emb")])
            c.complete([ps.address])

        threads = [threading.Thread(target=trainer, args=(t,)) for t in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        ps.join()
        assert not ps.errors
        stats = clients[0].stats.snapshot()
    w0, emb0 = (v.array for v in got[0])
    w1, emb1 = (v.array for v in got[1])
    assert np.array_equal(w0, w1) and np.array_equal(emb0, emb1)
    return w0, emb0, stats


@pytest.mark.parametrize("dtype", [F32, F64])
def test_sync_training_over_the_channel_equals_grpc_bit_for_bit(monkeypatch, dtype):
    w_bulk, emb_bulk, stats = _train(monkeypatch, "on", dtype)
    w_grpc, emb_grpc, _ = _train(monkeypatch, "off", dtype)
    assert w_bulk.dtype == dtype and np.array_equal(w_bulk, w_grpc) and np.array_equal(emb_bulk, emb_grpc)
    assert not w_bulk.flags.writeable  # as gRPC's: kernels never write their inputs
    calls, sent, received = stats["SendFetchBatch"]
    assert calls == 3 and min(sent, received) > 3 * 300 * 200 * np.dtype(dtype).itemsize


def test_sync_receive_buffers_are_kept_and_reused_every_step():
    scope = _scope()
    with running_pserver(scope=scope, run_block=_sgd(scope, 1), **_config()) as ps:
        client = ps.client(0)
        client.fetch_barrier([ps.address])
        seen = []
        for step in range(3):
            client.send_async(ps.address, "w@GRAD", LoDTensor(np.full((300, 200), step, F32)))
            client.send_async(ps.address, "emb@GRAD", SelectedRows([1], np.ones((1, 4), F32), height=10))
            client.send_barrier([ps.address], defer=True)
            (w,) = client.fetch_barrier([ps.address], [(ps.address, "w")])
            seen.append(ps.server._bulk_buffers[(0, "w@GRAD")])
            assert np.all(ps.scope.find_var("w@GRAD").array == step)
        assert seen[0] is seen[1] is seen[2]
        assert np.allclose(w.array, 1 - (0 + 1 + 2))
        # a second send of the var in one round gets a new buffer: the first stays as stored
        client.send(ps.address, "w@GRAD", LoDTensor(np.full((300, 200), 7, F32)))
        first = ps.scope.find_var("w@GRAD").array
        client.send(ps.address, "w@GRAD", LoDTensor(np.full((300, 200), 8, F32)))
        assert np.all(first == 7) and np.all(ps.scope.find_var("w@GRAD").array == 8)
        client.complete([ps.address])
        ps.join()
    assert not ps.errors


def test_a_buffer_a_persistable_views_is_not_received_into_again():
    """A block that keeps a view of the received grad in a persistable var (`kept`): the
    next round receives into a new buffer, and the kept value stays what it was."""
    scope = _scope()
    sgd = _sgd(scope, 1)

    def run_block(idx: int) -> None:
        sgd(idx)
        scope.set_var("kept", LoDTensor(scope.find_var("w@GRAD").array[10:20]))

    with running_pserver(scope=scope, run_block=run_block, **_config(persistables=("w", "kept"))) as ps:
        client = ps.client(0)
        client.fetch_barrier([ps.address])
        seen = []
        for step in range(2):
            client.send_async(ps.address, "w@GRAD", LoDTensor(np.full((300, 200), step + 1, F32)))
            client.send_async(ps.address, "emb@GRAD", SelectedRows([1], np.ones((1, 4), F32), height=10))
            client.send_barrier([ps.address], defer=True)
            client.fetch_barrier([ps.address], [(ps.address, "w")])
            seen.append(ps.server._bulk_buffers[(0, "w@GRAD")])
            kept = ps.scope.find_var("kept").array
        assert seen[0] is not seen[1]
        assert np.all(kept == 2) and np.all(seen[0] == 1)  # round 1's buffer, still what `kept` first saw
        client.complete([ps.address])
        ps.join()
    assert not ps.errors


def test_async_mode_receives_into_new_arrays_and_lod_and_rows_travel():
    with running_pserver(sync_mode=False) as ps:
        client = ps.client(0)
        arrays = []
        for step in range(2):
            client.send(ps.address, "w@GRAD", LoDTensor(np.full((300, 200), step, F32)))
            arrays.append(ps.scope.find_var("w@GRAD").array)
        assert np.all(arrays[0] == 0) and np.all(arrays[1] == 1)  # the first one was not overwritten
        lod = LoDTensor(np.arange(6, dtype=F64).reshape(3, 2), [[0, 1, 3]])
        rows = SelectedRows([4, 1], np.arange(8, dtype=F32).reshape(2, 4), height=10)
        client.send(ps.address, "seq", lod)
        client.send(ps.address, "rows", rows)
        seq, back = client.get_many([(ps.address, "seq"), (ps.address, "rows")])
        assert [list(level) for level in seq.lod] == [[0, 1, 3]] and np.array_equal(seq.array, lod.array) and seq.array.dtype == F64
        assert back.rows.tolist() == [4, 1] and np.array_equal(back.value[:2], rows.value[:2])
        assert client.stats.snapshot()["FetchBatch"][2] > 48  # counted on the channel
        client.complete([ps.address])
        ps.join()
    assert not ps.errors


# ------------------------------------------------------------------ forged frames


def _frame(method: int, head: dict, raw: bytes | None = None) -> bytes:
    body = raw if raw is not None else json.dumps(head).encode()
    return bulk.PREFIX.pack(bulk.REQUEST_MAGIC, method, len(body)) + body


def _read_reply(sock: socket.socket) -> tuple[int, str]:
    prefix = b""
    while len(prefix) < bulk.PREFIX.size:
        try:
            chunk = sock.recv(bulk.PREFIX.size - len(prefix))
        except ConnectionResetError:
            return -1, "reset"
        if not chunk:
            return -1, "closed"
        prefix += chunk
    magic, status, length = bulk.PREFIX.unpack(prefix)
    if magic != bulk.REPLY_MAGIC:
        return -2, "not a reply"
    body = b""
    while len(body) < length:
        body += sock.recv(length - len(body))
    return status, json.loads(body)["e"] if length else ""


GOES: list[bool] = []  # per `_raw` call: whether the pserver said GO (asked for the payload)


def _raw(port: int, data: bytes, payload: bytes = b"", wrap=None) -> tuple[int, str]:
    """(status, reason) the pserver answers `data` (then `payload` after a GO); -1: it closed."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    if wrap is not None:
        sock = wrap(sock)
    try:
        sock.sendall(data)
        status, reason = _read_reply(sock)
        GOES.append(status == bulk.STATUS_GO)
        if status == bulk.STATUS_GO:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)  # a short payload is truncated here
            status, reason = _read_reply(sock)
        return status, reason
    finally:
        sock.close()


def _dense(name: str, shape, dtype=F32, nbytes=None, **extra) -> dict:
    head = bulk.VarHead(name, int(np.prod(shape)) * np.dtype(dtype).itemsize, np.dtype(dtype), tuple(shape)).encode()
    if nbytes is not None:
        head["b"] = nbytes
    head.update(extra)
    return head


CODE = {c.value[0]: c for c in grpc.StatusCode}


def test_forged_and_malformed_frames_are_refused_before_the_payload_and_nothing_is_applied():
    scope = _scope()
    config = _config(auth=ServerAuth(token=TOKEN))
    with running_pserver(scope=scope, run_block=_sgd(scope, 1), **config) as ps:
        port, secret = ps.server._bulk.port, ps.server._bulk.secret
        good = {"x": secret, "k": TOKEN, "t": 0, "a": True}

        def refused(head=None, *, method=1, raw=None, payload=b""):
            status, reason = _raw(port, _frame(method, {**good, **(head or {})}, raw), payload)
            assert GOES[-1] == bool(payload), "refused from its header: the payload is never asked for"
            return CODE.get(status, status), reason

        unauth = grpc.StatusCode.UNAUTHENTICATED
        bad = grpc.StatusCode.INVALID_ARGUMENT
        w = _dense("w@GRAD", (300, 200))
        assert refused({"k": "wrong-token-wrong-token", "v": [w]}) == (unauth, "missing or wrong job token")
        assert refused({"x": "0" * 64, "v": [w]})[0] is unauth
        assert refused({"k": None, "v": [w]})[0] is unauth
        code, reason = refused({"v": [_dense("w@GRAD", (1,))]})
        assert code is bad and "shape [1] does not match the expected [300, 200]" in reason
        code, reason = refused({"v": [_dense("w@GRAD", (300, 200), F64)]})
        assert code is bad and "dtype float64 does not match the expected float32" in reason
        code, reason = refused({"v": [_dense("nope@GRAD", (3,))]})
        assert code is bad and "does not receive that var" in reason
        code, reason = refused({"v": [_dense("w@GRAD", (300, 200), nbytes=12)]})
        assert code is bad and "12 bytes for float32[300, 200]" in reason
        code, reason = refused({"v": [{"n": "emb@GRAD", "b": 1 << 40}]})  # a message var past the size limit
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "the limit is" in reason
        code, reason = refused({"t": 5, "v": [w]})
        assert code is bad and "out of range for Fanin 1" in reason
        code, reason = refused({"v": [w, w]})
        assert code is bad and "more than once" in reason
        assert refused(raw=b"\xff" * 40)[0] is bad  # not JSON
        assert refused(method=9)[0] is bad
        assert refused({"v": [{"n": "w@GRAD", "b": -1}]})[0] is bad
        assert refused({"v": "many"})[0] is bad
        oversize = bulk.PREFIX.pack(bulk.REQUEST_MAGIC, 1, bulk.MAX_HEADER + 1)
        assert CODE[_raw(port, oversize)[0]] is bad
        assert CODE[_raw(port, b"GET / HTTP/1.1\r\n\r\n" + b"x" * 64)[0]] is bad
        # a truncated payload: the header passes, the connection ends early; nothing is stored
        status, _ = _raw(port, _frame(1, {**good, "v": [w]}), b"\0" * 1000)
        assert status == -1 or CODE[status] is bad
        code, reason = refused({"v": [{"n": "emb@GRAD", "b": 5}]}, payload=b"\xff" * 5)  # a garbage message
        assert code is bad and "malformed" in reason
        assert ps.scope.find_var("w@GRAD") is None and ps.scope.find_var("emb@GRAD") is None
        assert np.all(ps.scope.find_var("w").array == 1)
        # the pserver still serves a correct trainer over the channel
        client = ps.client(0, auth=ClientAuth(token=TOKEN))
        got = _one_round(client, ps.address, 0.5)
        assert client._endpoints[ps.address].bulk is not None
        assert np.all(got.array == 0.5)
        client.complete([ps.address])
        ps.join()
    assert not ps.errors


def test_a_refusal_reaches_the_trainer_as_an_rpc_error_naming_the_var():
    scope = _scope()
    with running_pserver(scope=scope, run_block=_sgd(scope, 1), **_config()) as ps:
        client = ps.client(0)
        client.fetch_barrier([ps.address])
        client.send_async(ps.address, "w@GRAD", LoDTensor(np.ones(7, F32)))
        with pytest.raises(RpcError, match=r"\(INVALID_ARGUMENT\): pserver .*: trainer 0's send of 'w@GRAD': shape \[7\]"):
            client.send_barrier([ps.address])
        assert ps.scope.find_var("w@GRAD") is None


def test_a_connection_flood_is_bounded():
    with running_pserver(**_config()) as ps:
        port = ps.server._bulk.port
        socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(30)]
        try:
            time.sleep(0.5)
            readable, _, _ = select.select(socks, [], [], 0)
            closed = sum(s.recv(1) == b"" for s in readable)
            assert closed >= 30 - (2 * 4 + 8)  # past fanin × (send + fetch caps) + 8, closed at once
        finally:
            for s in socks:
                s.close()


# ------------------------------------------------------------------ TLS


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return self_signed(tmp_path_factory.mktemp("bulk-certs"), "job", "other")


def test_tls_on_the_channel(certs):
    tls = Tls(certs / "job.pem", certs / "job.key")
    config = ServeConfig(endpoint="127.0.0.1:0", fanin=1, sync_mode=False, auth=ServerAuth(token=TOKEN, tls=tls))
    server = PServer(config, Scope(), lambda idx: None)
    server.start()
    try:
        client = RpcClient(0, timeout=10, auth=ClientAuth(token=TOKEN, tls=Tls(ca=certs / "job.pem")))
        big = np.arange(300_000, dtype=F64)
        client.send(server.address, "w", LoDTensor(big))
        assert np.array_equal(client.get(server.address, "w").array, big)
        channel = client._endpoints[server.address].bulk
        assert channel is not None and isinstance(channel._idle[0][0], ssl.SSLSocket)
        client.close()
        port = server._bulk.port
        # plain bytes to a TLS channel: the handshake fails, the connection closes, nothing is read
        assert _raw(port, _frame(1, {"x": server._bulk.secret, "k": TOKEN, "t": 0}))[0] < 0
        untrusting = ssl.create_default_context(cafile=str(certs / "other.pem"))
        with pytest.raises(ssl.SSLError):
            _raw(port, b"", wrap=lambda s: untrusting.wrap_socket(s, server_hostname="127.0.0.1"))
        trusting = ssl.create_default_context(cafile=str(certs / "job.pem"))
        head = {"x": server._bulk.secret, "k": "wrong-token-wrong-token", "t": 0, "v": []}
        status, reason = _raw(port, _frame(1, head), wrap=lambda s: trusting.wrap_socket(s, server_hostname="127.0.0.1"))
        assert CODE[status] is grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.shutdown()


# ------------------------------------------------------------------ the choice


def test_the_choice_follows_the_program_and_the_setting(monkeypatch):
    def offered(choice: str, shape) -> bool:
        monkeypatch.setenv(bulk.BULK_ENV, choice)
        config = ServeConfig(endpoint="127.0.0.1:0", fanin=1, received=("g",), templates={"g": (shape, F32)})
        scope = Scope()
        scope.set_var("p", LoDTensor(np.zeros(3, F32)))
        server = PServer(config, scope, lambda idx: None)
        server.start()
        try:
            client = RpcClient(0, timeout=10)
            client.get(server.address, "p")  # connects
            used = client._endpoints[server.address].bulk is not None
            client.close()
            return server._bulk is not None and used
        finally:
            server.shutdown()

    big = (bulk.BULK_MIN // 4,)
    assert offered("auto", big) and not offered("auto", (bulk.BULK_MIN // 4 - 1,))
    assert offered("on", (3,)) and not offered("off", big)
    monkeypatch.setenv(bulk.BULK_ENV, "sometimes")
    with pytest.raises(bulk.BulkChoiceError, match="PSTRANSPILE_BULK='sometimes': expected one of auto, on, off"):
        check_env_choices()


def test_the_channel_port_can_be_fixed_for_a_firewall(monkeypatch):
    """`PSTRANSPILE_BULK_PORT`: a port, or +N past the gRPC port; one that is taken is one
    BindError naming it; a bad value is refused before anything starts."""
    from ops.rpc.errors import BindError

    assert bulk.bulk_port(6170, {}) == 0
    assert bulk.bulk_port(6170, {bulk.PORT_ENV: "7000"}) == 7000
    assert bulk.bulk_port(6170, {bulk.PORT_ENV: " +1000 "}) == 7170
    for bad in ("x", "-1", "0", "70000", "+"):
        with pytest.raises(bulk.BulkChoiceError, match="PSTRANSPILE_BULK_PORT"):
            bulk.bulk_port(6170, {bulk.PORT_ENV: bad})
    with pytest.raises(bulk.BulkChoiceError, match="past 65535"):
        bulk.bulk_port(65000, {bulk.PORT_ENV: "+1000"})
    monkeypatch.setenv(bulk.BULK_ENV, "on")

    def start() -> PServer:
        config = ServeConfig(endpoint="127.0.0.1:0", fanin=1, received=("g",), templates={"g": ((3,), F32)})
        server = PServer(config, Scope(), lambda idx: None)
        server.start()
        return server

    with socket.socket() as probe:  # a free port, then given back for the pserver to take
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    monkeypatch.setenv(bulk.PORT_ENV, str(free))
    server = start()
    try:
        assert server._bulk.port == free
        with pytest.raises(BindError, match=f"cannot open the bulk channel on 127.0.0.1:{free}"):
            start()  # the same port again: taken
    finally:
        server.shutdown()
    monkeypatch.setenv(bulk.PORT_ENV, "+1")
    try:
        server = start()
    except BindError:  # gRPC's port + 1 happened to be taken: nothing more to check
        return
    try:
        assert server._bulk.port == server.port + 1
    finally:
        server.shutdown()
    monkeypatch.setenv(bulk.PORT_ENV, "nine")
    with pytest.raises(bulk.BulkChoiceError, match="PSTRANSPILE_BULK_PORT='nine'"):
        check_env_choices()


def test_a_var_header_round_trips_and_bad_headers_are_frame_errors():
    head = bulk.VarHead("x", 24, np.dtype("<f8"), (3,), ((0, 1, 3),), True)
    raw = json.dumps({"x": "s", "t": 1, "v": [head.encode()]}).encode()
    assert bulk.decode_request_head(1, raw).vars == (head,)
    for broken in ({"x": "s", "t": -1}, {"x": 1, "t": 0}, {"x": "s", "t": 0, "a": "yes"},
                   {"x": "s", "t": 0, "v": [{"n": "x", "b": 8, "d": 999, "s": [1]}]},
                   {"x": "s", "t": 0, "v": [{"n": "x", "b": 8, "d": 5, "s": [True]}]}):
        with pytest.raises(bulk.FrameError):
            bulk.decode_request_head(1, json.dumps(broken).encode())


def test_mutual_tls_on_the_channel_needs_a_client_certificate(certs):
    tls = Tls(certs / "job.pem", certs / "job.key", certs / "job.pem")
    server = PServer(ServeConfig(endpoint="127.0.0.1:0", fanin=1, sync_mode=False, auth=ServerAuth(tls=tls)), Scope(),
                     lambda idx: None)
    server.start()
    try:
        client = RpcClient(0, timeout=10, auth=ClientAuth(tls=tls))
        client.send(server.address, "w", LoDTensor(np.ones(5, F32)))
        assert client._endpoints[server.address].bulk is not None
        assert client.get(server.address, "w").array.tolist() == [1] * 5
        client.close()
        no_cert = ssl.create_default_context(cafile=str(certs / "job.pem"))
        head = {"x": server._bulk.secret, "t": 0, "v": []}
        try:
            status, _ = _raw(server._bulk.port, _frame(3, head),
                             wrap=lambda s: no_cert.wrap_socket(s, server_hostname="127.0.0.1"))
        except (ssl.SSLError, OSError):
            status = -1
        assert status < 0  # the pserver ends the handshake: nothing is read
    finally:
        server.shutdown()


def test_a_channel_the_trainer_cannot_reach_means_grpc(capfd):
    scope = Scope()
    scope.set_var("p", LoDTensor(np.arange(4, dtype=F32)))
    server = PServer(ServeConfig(endpoint="127.0.0.1:0", fanin=1, sync_mode=False), scope, lambda idx: None)
    server.start()
    try:
        with socket.socket() as closed:  # a port nothing listens on: as behind a firewall that lets only gRPC's through
            closed.bind(("127.0.0.1", 0))
            server._bulk.port = closed.getsockname()[1]
        client = RpcClient(0, timeout=10)
        assert client.get(server.address, "p").array.tolist() == [0, 1, 2, 3]
        assert client._endpoints[server.address].bulk is None
        assert "bulk channel (port" in capfd.readouterr().err
        client.close()
    finally:
        server.shutdown()


def test_auto_looks_at_dense_vars_only(monkeypatch):
    monkeypatch.setenv(bulk.BULK_ENV, "auto")
    height = bulk.BULK_MIN  # a sparse grad of a big table carries a batch's rows, not the table
    config = ServeConfig(endpoint="127.0.0.1:0", fanin=1, received=("emb@GRAD",),
                         templates={"emb@GRAD": ((height, 4), F32)}, sparse_vars=frozenset({"emb@GRAD"}))
    server = PServer(config, Scope(), lambda idx: None)
    server.start()
    try:
        assert server._bulk is None
    finally:
        server.shutdown()


def test_auto_counts_received_vars_not_params(monkeypatch):
    monkeypatch.setenv(bulk.BULK_ENV, "auto")
    big, small = (bulk.BULK_MIN // 4,), (bulk.BULK_MIN // 4 - 1,)
    for received_shape, offered in ((small, False), (big, True)):
        config = ServeConfig(endpoint="127.0.0.1:0", fanin=1, received=("g",),
                             templates={"g": (received_shape, F32), "table": ((1 << 20, 64), F32)})
        server = PServer(config, Scope(), lambda idx: None)
        server.start()
        try:
            assert (server._bulk is not None) == offered
        finally:
            server.shutdown()


def test_a_pserver_without_a_program_still_bounds_a_request():
    with running_pserver(sync_mode=False) as ps:
        head = {"x": ps.server._bulk.secret, "t": 0, "v": [{"n": "x", "b": 1 << 40}]}
        status, reason = _raw(ps.server._bulk.port, _frame(1, head))
        assert not GOES[-1] and CODE[status] is grpc.StatusCode.RESOURCE_EXHAUSTED and str(bulk.OPEN_LIMIT) in reason


def test_a_connection_idle_too_long_or_closed_by_the_pserver_is_replaced():
    with running_pserver(sync_mode=False) as ps:
        client = ps.client(0)
        client.send(ps.address, "w", LoDTensor(np.ones(4, F32)))
        channel = client._endpoints[ps.address].bulk
        (old, ring, since), = channel._idle
        channel._idle = [(old, ring, since - channel.offer.idle)]  # past half the pserver's idle limit: not reused
        client.send(ps.address, "w", LoDTensor(np.full(4, 2, F32)))
        (second, _, _), = channel._idle
        assert second is not old and old.fileno() == -1
        second.shutdown(socket.SHUT_RDWR)  # as the pserver's end closing it: seen, dropped, a new one opened
        assert client.get(ps.address, "w").array.tolist() == [2] * 4
        client.complete([ps.address])
        ps.join()
    assert not ps.errors


def test_a_call_waiting_on_a_pserver_gRPC_finds_gone_fails_within_a_second():
    """A frozen pserver's TCP still takes bytes; gRPC's keepalive (the Watch line) tells.
    Here the call waits for its phase (round 0 expects the fetch barrier first) and the
    Watch's end is simulated: the call fails UNAVAILABLE naming why, within ~1 s."""
    import threading

    with running_pserver(**_config()) as ps:
        client = ps.client(0)
        client.send_async(ps.address, "w@GRAD", LoDTensor(np.ones((300, 200), F32)))
        ep = client._endpoint(ps.address)
        timer = threading.Timer(0.5, lambda: setattr(ep, "lost", "keepalive watchdog timeout"))
        timer.start()
        start = time.monotonic()
        with pytest.raises(RpcError, match=r"unavailable \(the pserver stopped answering \(keepalive watchdog timeout\)\)"):
            client.wait_pending()
        assert time.monotonic() - start < 5
        ep.lost = None


class _FakeClient:
    """Stands for the RPC client under a trainer's `fetch_barrier`: receives each block into
    the destination it is given (as the bulk channel does), else into a new array."""

    def __init__(self, blocks: dict[str, np.ndarray], fail: bool = False):
        self.blocks, self.fail, self.into = blocks, fail, None

    def receives_early(self) -> bool:  # no early receives (tests/test_early_recv.py)
        return False

    def fetch_barrier(self, endpoints, requests, into=None):
        self.into = dict(into or {})
        values = []
        for ep, name in requests:
            dest = self.into.get((ep, name))
            if dest is None:
                dest = np.empty_like(self.blocks[name])
            dest[...] = self.blocks[name]
            if self.fail:
                raise RpcError("the pserver went away mid-reply")
            view = dest.view()
            view.flags.writeable = False
            values.append(LoDTensor(view))
        return values


def _trainer_tail(dtype=F32):
    """recv w.block0 / w.block1 (deferred), fetch_barrier, concat -> w: a sync trainer's end."""
    from transpiler.ir import DType, Program

    program = Program.empty()
    block = program.global_block()
    for name, shape in (("w.block0", [3, 4]), ("w.block1", [5, 4]), ("w", [8, 4])):
        block.create_var(name, dtype=DType.FP64 if dtype == F64 else DType.FP32, shape=shape, persistable=name == "w")
    eps = ["127.0.0.1:1", "127.0.0.1:2"]
    block.add_op("recv", {}, {"Out": ["w.block0"]}, {"epmap": [eps[0]], "varnames": ["w.block0"]})
    block.add_op("recv", {}, {"Out": ["w.block1"]}, {"epmap": [eps[1]], "varnames": ["w.block1"]})
    block.add_op("fetch_barrier", {}, {}, {"endpoints": eps})
    block.add_op("concat", {"X": ["w.block0", "w.block1"]}, {"Out": ["w"]}, {"axis": 0})
    return program


@pytest.mark.parametrize("dtype", [F32, F64])
def test_a_trainer_receives_param_blocks_into_the_param_only_when_nothing_else_holds_it(monkeypatch, dtype):
    from ops.executor import Executor
    from ops.rpc import kernels

    rng = np.random.default_rng(3)
    blocks = {"w.block0": rng.standard_normal((3, 4)).astype(dtype),
              "w.block1": rng.standard_normal((5, 4)).astype(dtype)}
    want = np.concatenate([blocks["w.block0"], blocks["w.block1"]])
    fake = _FakeClient(blocks)
    monkeypatch.setattr(kernels, "get_client", lambda trainer_id: fake)
    program = _trainer_tail(dtype)
    scope = Scope()
    scope.set_var("w", LoDTensor(np.zeros((8, 4), dtype)))
    address = scope.find_var("w").array.__array_interface__["data"][0]
    Executor(free_dead=True).run(program, scope=scope)
    got = scope.find_var("w").array
    assert len(fake.into) == 2 and got.__array_interface__["data"][0] == address  # received in place, no copy
    assert got.dtype == dtype and np.array_equal(got, want)
    # A reader keeps the param's array (a fetched value): it must not change under them.
    kept = scope.find_var("w").array
    before = kept.copy()
    blocks["w.block0"] += 1
    Executor(free_dead=True).run(program, scope=scope)
    assert fake.into == {} and np.array_equal(kept, before)
    assert np.array_equal(scope.find_var("w").array, np.concatenate([blocks["w.block0"], blocks["w.block1"]]))
    del kept
    # A receive that fails half way: the param, maybe half written, leaves the scope.
    fake.fail = True
    with pytest.raises(Exception, match="went away mid-reply"):
        Executor(free_dead=True).run(program, scope=scope)
    assert fake.into and scope.find_var("w") is None


def test_memory_extents_answer_what_may_share_memory_answers_pair_by_pair():
    """`MemoryExtents.overlaps` (one sorted pass for a pserver's persistables) against
    `np.may_share_memory` on every array: views, strided views, slices inside and beside
    the buffer, empty arrays, separate arrays."""
    rng = np.random.default_rng(0)
    base = np.zeros(10_000, np.float32)
    others = [np.zeros(int(n), np.float64) for n in rng.integers(1, 500, size=20)]
    strided = np.zeros(1_000, np.float32)
    held = [base[100:200], strided[100:500:7], base[9_000:], base[5:5], *others[::2]]
    extents = bulk.MemoryExtents(held)
    probes = [base, base[0:100], base[200:300], base[150:160], base[9_999:], base[1:2], np.empty(0, np.float32),
              *others, base.reshape(100, 100)[:, 3], strided[:50], strided[450:], strided[::300]]
    answers = [any(np.may_share_memory(probe, array) for array in held) for probe in probes]
    assert True in answers and False in answers
    for probe, answer in zip(probes, answers, strict=True):
        assert extents.overlaps(probe) == answer, probe.shape
    assert not bulk.MemoryExtents([]).overlaps(base)


def test_a_sent_grad_is_let_go_before_a_destination_is_asked_for():
    """The bulk channel drops a call's vars once sent, and a fetch's destination is asked
    for only when every call of the step has sent: a trainer's grad is freed before a
    released param's new array is made (`ops.executor.Liveness.released`)."""
    import gc
    import weakref
    from collections.abc import Mapping

    scope = _scope()
    with running_pserver(scope=scope, run_block=_sgd(scope, 1), **_config()) as ps:
        client = ps.client(0)
        client.fetch_barrier([ps.address])
        grad = np.full((300, 200), 2, F32)
        alive = weakref.ref(grad)
        asked: list[bool] = []

        class Later(Mapping):  # as ops.rpc.kernels' destinations: made when asked for
            def __getitem__(self, key):
                gc.collect()
                asked.append(alive() is None)
                return np.empty((300, 200), F32)

            def __contains__(self, key):
                return key == (ps.address, "w")

            def __iter__(self):
                return iter([(ps.address, "w")])

            def __len__(self):
                return 1

        client.send_async(ps.address, "w@GRAD", LoDTensor(grad))
        client.send_async(ps.address, "emb@GRAD", SelectedRows([1], np.ones((1, 4), F32), height=10))
        del grad
        client.send_barrier([ps.address], defer=True)
        (w,) = client.fetch_barrier([ps.address], [(ps.address, "w")], Later())
        assert asked == [True]  # asked for once, the grad gone by then
        np.testing.assert_array_equal(w.array, np.full((300, 200), 1 - 2, F32))
        client.complete([ps.address])
        ps.join()
    assert not ps.errors
