"""The bulk channel's shared-memory rings (`ops.rpc.bulk.Ring`, issue 30): a trainer and a
pserver on one host hand big payloads over in slots of a /dev/shm segment instead of TCP.
Training through rings equals training over TCP bit for bit (Paddle-built programs: an
Adam MLP whose big blocks cross in the rings, and a distributed table whose small vars
stay in the TCP stream; float32 and float64, launched as processes); the
segment is the pserver's, mode 0600, named only to an authenticated peer and unlinked as
soon as the trainer opened it, when a connection ends and at exit (no /dev/shm leak, even
with a trainer or a pserver killed); forged slot notes and ring requests are refused; a
trainer that cannot open the segment, or a setting of `off`, means TCP."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from e2e_support import EXAMPLES, REPO, launch_ok
from rpc_support import running_pserver
from test_rpc_bulk import CODE, TOKEN, _config, _dense, _frame, _one_round, _read_reply, _scope, _sgd

from conftest import PADDLE_PROGRAMS
from ops.rpc import RpcError, bulk
from ops.rpc.auth import ClientAuth, ServerAuth
from ops.rpc.env_choice import EnvChoiceError, check_env_choices
from ops.tensor import LoDTensor, SelectedRows

F32, F64 = np.float32, np.float64
SHM = Path(bulk.SHM_DIR)
pytestmark = pytest.mark.skipif(not SHM.is_dir() or not hasattr(os, "posix_fallocate"), reason="needs /dev/shm")


@pytest.fixture(autouse=True)
def _bulk_on(monkeypatch):
    monkeypatch.setenv(bulk.BULK_ENV, "on")
    monkeypatch.setenv(bulk.SHM_ENV, "auto")


def _segments() -> set[str]:
    return {p.name for p in SHM.glob("psb-*")}


def _no_new_segments(before: set[str], within: float = 5.0) -> set[str]:
    deadline = time.monotonic() + within
    while (left := _segments() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


# ------------------------------------------------------------------ training, bit for bit


def _ring_slots(tmp: Path, pservers: int = 2) -> int:
    """The slots the pservers' rings handed over, from their logs (0: no ring)."""
    total = 0
    for i in range(pservers):
        for line in (tmp / "logs" / f"pserver.{i}.log").read_text().splitlines():
            if "shared-memory ring, " in line:
                total += int(line.split("shared-memory ring, ")[1].split(" slot")[0])
    return total


def _train_ctr(tmp: Path, shm: str, float64: bool) -> dict[str, np.ndarray]:
    """The Fluid 1.8.5 CTR program (a distributed lookup table, dense fc layers, SGD), 2
    pservers x 2 trainers as processes, every tensor on the bulk channel (its vars are
    small: they cross in the TCP stream of connections that have a ring); trainer 0's
    saved final params and rows."""
    folder = PADDLE_PROGRAMS / "fluid18_ctr_dist_sgd_2ps"
    command = (sys.executable, str(EXAMPLES / "train_ctr.py"), "--main", str(folder / "main.pb"), "--steps", "6",
               "--batch", "16", "--rows", "1000", "--quiet", "--save", str(tmp / "params"),
               *(("--float64",) if float64 else ()))
    launch_ok(tmp, command, pservers=2, trainers=2, sync_mode=True, timeout=60,
              env={bulk.BULK_ENV: "on", bulk.SHM_ENV: shm})
    logs = "".join((tmp / "logs" / f"pserver.{i}.log").read_text() for i in range(2))
    assert ("with a shared-memory ring" in logs) == (shm == "on"), logs
    saved = dict(np.load(tmp / "params" / "trainer_0.npz"))
    return {k: v for k, v in saved.items() if k.startswith(("final/", "final_rows/"))}


def _train_mlp(tmp: Path, shm: str, float64: bool) -> dict[str, np.ndarray]:
    """Paddle 2.6's MLP with Adam (`mlp_adam_2ps`: `h1.w`'s 400 kB blocks cross in the
    rings), 2 pservers x 2 trainers as processes; trainer 0's final params."""
    from e2e_support import launch_training, save, trained_params

    from transpiler.ir import Program
    from transpiler.ir.precision import as_float64

    folder = PADDLE_PROGRAMS / "mlp_adam_2ps"
    main, startup = Program.load(folder / "main.pb"), Program.load(folder / "startup.pb")
    if float64:
        main, startup = as_float64(main), as_float64(startup)
    main_pb, startup_pb = save(tmp, main, startup)
    launch_training(tmp, main_pb, startup_pb, pservers=2, env={bulk.BULK_ENV: "on", bulk.SHM_ENV: shm})
    slots = _ring_slots(tmp)
    assert (slots > 0) == (shm == "on"), slots
    return trained_params(tmp, 0)[1]


@pytest.mark.parametrize("float64", [False, True], ids=["float32", "float64"])
@pytest.mark.parametrize("train", [_train_mlp, _train_ctr], ids=["mlp_adam_2ps", "fluid18_ctr_dist_sgd_2ps"])
def test_training_through_rings_equals_tcp_bit_for_bit(tmp_path, train, float64):
    before = _segments()
    rings = train(tmp_path / "shm", "on", float64)
    tcp = train(tmp_path / "tcp", "off", float64)
    assert rings.keys() == tcp.keys() and len(rings) > 2
    for key in rings:
        assert rings[key].dtype == (F64 if float64 else F32), key
        assert rings[key].tobytes() == tcp[key].tobytes(), key
    if train is _train_ctr:
        assert any(k.startswith("final_rows/") for k in rings)
    assert not _no_new_segments(before), "a shared-memory segment outlived the job"


def test_in_threads_rings_carry_dense_rows_and_messages_and_give_tcp_s_bits(monkeypatch):
    """Dense grads summed on arrival and SelectedRows through a ring of small slots (many
    slot turns a var), against TCP; the trainer's ring exists and its name is gone."""
    monkeypatch.setattr(bulk, "SLOT_BYTES", 8192)
    monkeypatch.setattr(bulk, "RING_VAR_MIN", 1)  # the SelectedRows too
    from test_rpc_bulk import _train

    slots = []
    real = bulk.RingReader.chunks

    def counted(self, nbytes, what):
        for chunk in real(self, nbytes, what):
            slots.append(len(chunk))
            yield chunk

    monkeypatch.setattr(bulk.RingReader, "chunks", counted)
    before = _segments()
    w_ring, emb_ring, _ = _train(monkeypatch, "on", F64)
    assert len(slots) > 4 * 3 * 300 * 200 * 8 // 8192 and max(slots) == 8192  # both ways, every step, slot by slot
    assert min(slots) < 200  # a SelectedRows' message
    del slots[:]
    monkeypatch.setenv(bulk.SHM_ENV, "off")
    w_tcp, emb_tcp, _ = _train(monkeypatch, "on", F64)
    assert not slots
    assert w_ring.tobytes() == w_tcp.tobytes() and emb_ring.tobytes() == emb_tcp.tobytes()
    assert not _no_new_segments(before)


# ------------------------------------------------------------------ the segment's life


def test_a_ring_is_the_pserver_s_mode_0600_and_its_name_goes_once_opened():
    ring = bulk.Ring.create(2, 8192)
    try:
        info = os.stat(ring.path)
        assert info.st_mode & 0o777 == 0o600 and info.st_size == 2 * 8192 and bulk._RING_NAME.match(ring.name)
        other = bulk.Ring.attach(ring.name, 2, 8192)
        assert not os.path.exists(ring.path)  # unlinked by the one that opened it
        ring.slot[1][:3] = [7, 8, 9]
        assert other.slot[1][:3].tolist() == [7, 8, 9]
        other.close()
    finally:
        ring.close()
    for name, slots, size in ((ring.name, 2, 8192), ("../etc/passwd", 2, 8192), ("psb-" + "0" * 32, 2, 8192)):
        with pytest.raises(bulk.RingError):
            bulk.Ring.attach(name, slots, size)
    ring = bulk.Ring.create(2, 8192)
    try:
        with pytest.raises((bulk.RingError, bulk.FrameError)):
            bulk.Ring.attach(ring.name, 4, 8192)  # not the size made
        with pytest.raises((bulk.RingError, bulk.FrameError)):
            bulk.Ring.attach(ring.name, 2, 1000)  # not whole pages
        os.chmod(ring.path, 0o644)
        with pytest.raises(bulk.RingError, match="owner, mode or size"):
            bulk.Ring.attach(ring.name, 2, 8192)
    finally:
        ring.close()
    assert not os.path.exists(ring.path)


def test_a_segment_made_and_never_opened_is_unlinked_at_exit():
    code = "from ops.rpc import bulk; print(bulk.Ring.create().path, flush=True)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    assert not os.path.exists(done.stdout.strip())


def _ring_request(port: int, secret: str, token: str | None = TOKEN, **extra) -> tuple[socket.socket, dict]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    head = {"x": secret, "t": 0, **({"k": token} if token else {}), **extra}
    sock.sendall(_frame(bulk.METHOD_CODE["Ring"], head))
    magic_status_len = b""
    while len(magic_status_len) < bulk.PREFIX.size:
        magic_status_len += sock.recv(bulk.PREFIX.size - len(magic_status_len))
    magic, status, length = bulk.PREFIX.unpack(magic_status_len)
    body = b""
    while len(body) < length:
        body += sock.recv(length - len(body))
    return sock, {"status": status, **json.loads(body)}


def test_a_trainer_gone_before_opening_its_ring_leaves_no_segment():
    """The pserver's name for a ring lives until the trainer's next frame: a connection that
    ends first (a killed trainer: the kernel closes it) takes the name with it."""
    scope = _scope()
    with running_pserver(scope=scope, run_block=_sgd(scope, 1), **_config(auth=ServerAuth(token=TOKEN))) as ps:
        sock, offer = _ring_request(ps.server._bulk.port, ps.server._bulk.secret)
        path = SHM / offer["r"]
        assert offer["status"] == bulk.STATUS_OK and path.exists() and path.stat().st_mode & 0o777 == 0o600
        assert (offer["n"], offer["b"]) == (bulk.RING_SLOTS, bulk.SLOT_BYTES)
        sock.close()
        deadline = time.monotonic() + 5
        while path.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not path.exists()
        # and one answered by a frame: unlinked at that frame, whatever it is
        sock, offer = _ring_request(ps.server._bulk.port, ps.server._bulk.secret)
        sock.sendall(_frame(1, {"x": ps.server._bulk.secret, "k": TOKEN, "t": 0, "a": True}))  # a send barrier, waiting
        deadline = time.monotonic() + 5
        while (SHM / offer["r"]).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not (SHM / offer["r"]).exists()
        sock.close()


TRAINER = textwrap.dedent("""
    import sys, time
    import numpy as np
    from ops.rpc import RpcClient
    from ops.tensor import LoDTensor
    client = RpcClient(0, timeout=10.0)
    address = sys.argv[1]
    client.send(address, "w@GRAD", LoDTensor(np.ones((300, 200), np.float32)))
    print("ready", flush=True)
    while True:
        client.send(address, "w@GRAD", LoDTensor(np.ones((300, 200), np.float32)))
""")


def test_a_killed_trainer_leaves_no_segment():
    before = _segments()
    with running_pserver(sync_mode=False) as ps:
        proc = subprocess.Popen([sys.executable, "-c", TRAINER, ps.address], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        try:
            assert proc.stdout.readline().strip() == "ready"
            time.sleep(0.3)
            assert ps.server._bulk.rings >= 1
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        ps.server.stop()
    assert not _no_new_segments(before)


PSERVER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[1])
    from rpc_support import running_pserver
    with running_pserver(sync_mode=False) as ps:
        print(ps.address, flush=True)
        time.sleep(120)
""")


def test_a_killed_pserver_leaves_no_segment():
    before = _segments()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    proc = subprocess.Popen([sys.executable, "-c", PSERVER, str(REPO / "tests")], stdout=subprocess.PIPE, text=True, env=env)
    try:
        address = proc.stdout.readline().strip()
        from ops.rpc import RpcClient

        client = RpcClient(0, timeout=10.0)
        try:
            client.send(address, "w@GRAD", LoDTensor(np.ones((300, 200), F32)))
            (_, ring, _), = client._endpoints[address].bulk._idle
            assert ring is not None
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        finally:
            client.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not _no_new_segments(before)


# ------------------------------------------------------------------ forged notes and requests


def _attached(port: int, secret: str) -> tuple[socket.socket, bulk.Ring]:
    sock, offer = _ring_request(port, secret)
    return sock, bulk.Ring.attach(offer["r"], offer["n"], offer["b"])


def test_forged_slot_notes_and_ring_requests_are_refused_and_nothing_is_applied(monkeypatch):
    monkeypatch.setattr(bulk, "RING_VAR_MIN", 1)
    scope = _scope()
    with running_pserver(scope=scope, run_block=_sgd(scope, 1), **_config(auth=ServerAuth(token=TOKEN))) as ps:
        port, secret = ps.server._bulk.port, ps.server._bulk.secret
        good = {"x": secret, "k": TOKEN, "t": 0, "a": True, "s": True}
        w = _dense("w@GRAD", (300, 200))
        nbytes = 300 * 200 * 4
        bad = grpc.StatusCode.INVALID_ARGUMENT

        def forged(note: bytes, *, fill: bool = True) -> tuple[grpc.StatusCode, str]:
            sock, ring = _attached(port, secret)
            try:
                sock.sendall(_frame(1, {**good, "v": [w]}))
                status, _ = _read_reply(sock)
                assert status == bulk.STATUS_GO
                if fill:
                    ring.slot[0][:] = 1
                sock.sendall(note)
                sock.shutdown(socket.SHUT_WR)
                status, reason = _read_reply(sock)
                return CODE.get(status, status), reason
            finally:
                sock.close()
                ring.close()

        first = min(bulk.SLOT_BYTES, nbytes)
        code, reason = forged(bulk.NOTE.pack(bulk.NOTE_MAGIC, 1, first))  # a slot out of turn
        assert code is bad and "slot note of slot 1" in reason and "slot 0" in reason
        code, reason = forged(bulk.NOTE.pack(bulk.NOTE_MAGIC, 99, first))  # past the ring
        assert code is bad and "slot 99" in reason
        code, reason = forged(bulk.NOTE.pack(bulk.NOTE_MAGIC, 0, first + 1))  # longer than the var's slot share
        assert code is bad and f"{first + 1} bytes" in reason
        code, reason = forged(bulk.NOTE.pack(bulk.NOTE_MAGIC, 0, 1 << 62))
        assert code is bad and "bytes" in reason
        code, reason = forged(bulk.NOTE.pack(b"XXXX", 0, first))
        assert code is bad and "not a slot note" in reason
        code, reason = forged(b"\0" * 5)  # a note cut short: the connection ends
        assert code == -1 or code is bad
        rng = np.random.default_rng(30)
        for _ in range(4):  # random bytes where a note belongs
            code, reason = forged(rng.integers(0, 256, bulk.NOTE.size, dtype=np.uint8).tobytes())
            assert code is bad and "slot note" in reason
        # a request through a ring the connection has not; Ring requests out of place
        status, reason = _raw_request(port, _frame(1, {**good, "v": [w]}))
        assert CODE[status] is bad and "ring this connection has not" in reason
        sock, offer = _ring_request(port, secret, v=[w])
        assert CODE[offer["status"]] is bad and "fields it has not" in offer["e"]
        sock.close()
        sock, offer = _ring_request(port, secret, token="wrong-token-wrong-token")
        assert CODE[offer["status"]] is grpc.StatusCode.UNAUTHENTICATED and "r" not in offer
        sock.close()
        sock, ring = _attached(port, secret)
        sock.sendall(_frame(bulk.METHOD_CODE["Ring"], {"x": secret, "k": TOKEN, "t": 0}))
        status, reason = _read_reply(sock)
        assert CODE[status] is bad and "second Ring" in reason
        sock.close()
        ring.close()
        assert ps.scope.find_var("w@GRAD") is None and np.all(ps.scope.find_var("w").array == 1)
        # the pserver still serves a correct trainer, through a ring
        client = ps.client(0, auth=ClientAuth(token=TOKEN))
        got = _one_round(client, ps.address, 0.5)
        assert np.all(got.array == 0.5)
        assert all(ring is not None for _, ring, _ in client._endpoints[ps.address].bulk._idle)
        client.complete([ps.address])
        ps.join()
    assert not ps.errors


def _raw_request(port: int, data: bytes) -> tuple[int, str]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        sock.sendall(data)
        return _read_reply(sock)
    finally:
        sock.close()


def test_a_pserver_refusal_mid_payload_reaches_the_trainer_through_the_ring(monkeypatch):
    """The pserver refuses while the trainer waits for a slot back: the trainer reads the
    refusal where the slot's release would be, and raises it."""
    scope = _scope()
    monkeypatch.setattr(bulk, "SLOT_BYTES", 8192)
    monkeypatch.setattr(bulk, "RING_VAR_MIN", 1)
    with running_pserver(scope=scope, run_block=_sgd(scope, 1), **_config(sync_mode=False)) as ps:
        client = ps.client(0)
        real = bulk.RingReader.chunks

        def broken(self, nbytes, what):
            for i, chunk in enumerate(real(self, nbytes, what)):
                if i == 3:
                    raise bulk.FrameError("a test's refusal after three slots")
                yield chunk

        monkeypatch.setattr(bulk.RingReader, "chunks", broken)
        with pytest.raises(RpcError, match="a test's refusal after three slots"):
            client.send(ps.address, "w@GRAD", LoDTensor(np.ones((300, 200), F32)))
        monkeypatch.setattr(bulk.RingReader, "chunks", real)
        client.send(ps.address, "w@GRAD", LoDTensor(np.full((300, 200), 2, F32)))
        assert np.all(ps.scope.find_var("w@GRAD").array == 2)
        client.complete([ps.address])
        ps.join()
    assert not ps.errors


# ------------------------------------------------------------------ choosing, falling back


def test_a_trainer_that_cannot_open_the_ring_sends_over_tcp(monkeypatch, capfd):
    def cannot(*args, **kwargs):
        raise bulk.RingError("a test's /dev/shm that cannot be opened")

    monkeypatch.setattr(bulk.Ring, "attach", cannot)
    before = _segments()
    scope = _scope()
    with running_pserver(scope=scope, run_block=_sgd(scope, 1), **_config()) as ps:
        client = ps.client(0)
        got = _one_round(client, ps.address, 0.25)
        assert np.all(got.array == 0.75)
        channel = client._endpoints[ps.address].bulk
        assert channel is not None and all(ring is None for _, ring, _ in channel._idle)
        assert ps.server._bulk.rings == 0
        client.complete([ps.address])
        ps.join()
    assert not ps.errors
    assert "shared-memory ring is not used here (a test's /dev/shm that cannot be opened)" in capfd.readouterr().err
    assert not _no_new_segments(before)


@pytest.mark.parametrize("pserver, trainer, host, rings", [
    ("auto", "auto", "127.0.0.1", True),
    ("off", "auto", "127.0.0.1", False),
    ("auto", "off", "127.0.0.1", False),
    ("on", "on", "127.0.0.1", True),
])
def test_the_choice_on_either_side(monkeypatch, pserver, trainer, host, rings):
    monkeypatch.setenv(bulk.SHM_ENV, pserver)
    scope = _scope()
    with running_pserver(scope=scope, run_block=_sgd(scope, 1), **_config(sync_mode=False)) as ps:
        monkeypatch.setenv(bulk.SHM_ENV, trainer)
        client = ps.client(0)
        client.send(ps.address, "w@GRAD", LoDTensor(np.ones((300, 200), F32)))
        channel = client._endpoints[ps.address].bulk
        (_, ring, _), = channel._idle
        assert (ring is not None) == rings and (ps.server._bulk.rings == 1) == rings
        assert channel._want_ring == rings  # one offer of none is enough: not asked again
        client.complete([ps.address])
        ps.join()
    assert not ps.errors


def test_loopback_and_the_setting_are_read_one_way(monkeypatch):
    assert bulk.loopback("127.0.0.1") and bulk.loopback("127.3.0.1") and bulk.loopback("[::1]")
    assert bulk.loopback("localhost") and bulk.loopback("::ffff:127.0.0.1")
    assert not bulk.loopback("10.0.0.1") and not bulk.loopback("example.com") and not bulk.loopback("::")
    assert bulk.shm_choice({}) == "auto" and bulk.shm_choice({bulk.SHM_ENV: " OFF "}) == "off"
    with pytest.raises(EnvChoiceError, match="PSTRANSPILE_BULK_SHM='yes'"):
        check_env_choices({bulk.SHM_ENV: "yes"})


def test_a_pserver_that_cannot_make_a_ring_says_so_once_and_tcp_carries_all(monkeypatch, tmp_path):
    monkeypatch.setattr(bulk, "SHM_DIR", str(tmp_path / "missing"))
    logged: list[str] = []
    scope = _scope()
    with running_pserver(scope=scope, run_block=_sgd(scope, 1), **_config()) as ps:
        ps.server._bulk._log = logged.append
        client = ps.client(0)
        got = _one_round(client, ps.address, 0.25)
        assert np.all(got.array == 0.75)
        assert all(ring is None for _, ring, _ in client._endpoints[ps.address].bulk._idle)
        assert ps.server._bulk.rings == 0
        client.complete([ps.address])
        ps.join()
    assert not ps.errors
    said = [line for line in logged if "no shared-memory ring" in line]
    assert len(said) == 1 and "cannot create" in said[0] and "payloads go by TCP" in said[0]


def test_a_trainer_asks_for_a_ring_by_its_pserver_s_address_and_never_with_tls(tmp_path):
    offer = bulk.Offer(1234, "0" * 64)

    def wants(host: str, shm: str, tls=None) -> bool:
        return bulk.BulkClient(host, offer, token=None, tls=tls, trainer_id=0, connect_timeout=1.0, shm=shm)._want_ring

    assert wants("127.0.0.1", "auto") and wants("[::1]", "auto") and wants("localhost", "auto")
    assert not wants("10.1.2.3", "auto") and wants("10.1.2.3", "on")  # on: a peer on the host's own address
    assert not wants("127.0.0.1", "off")
    from ops.rpc.auth import Tls

    assert not wants("127.0.0.1", "on", Tls())


def test_a_pserver_that_refuses_ring_requests_leaves_the_channel_to_tcp(monkeypatch, capfd):
    """A pserver of a version without rings refuses the `Ring` method as unknown: the
    trainer asks no more and carries everything over TCP on the channel."""
    monkeypatch.delitem(bulk.METHODS, bulk.METHOD_CODE["Ring"])  # the pserver's decoder no longer knows it
    scope = _scope()
    with running_pserver(scope=scope, run_block=_sgd(scope, 1), **_config()) as ps:
        client = ps.client(0)
        got = _one_round(client, ps.address, 0.25)
        assert np.all(got.array == 0.75)
        channel = client._endpoints[ps.address].bulk
        assert channel is not None and not channel._want_ring and all(ring is None for _, ring, _ in channel._idle)
        client.complete([ps.address])
        ps.join()
    assert not ps.errors
    assert "the pserver refused a ring (a malformed bulk frame: unknown method 4)" in capfd.readouterr().err
