"""Who may talk to a pserver (`ops.rpc.auth`): the job token on every RPC, forged and
malformed requests, the loopback default, TLS with a certificate made here, the
handshake, and where tokens come from. Servers listen on 127.0.0.1 only."""

from __future__ import annotations

import os
import threading

import grpc
import numpy as np
import pytest
from rpc_support import running_pserver, self_signed

from ops.rpc import RpcClient, RpcError
from ops.rpc.auth import (
    HANDSHAKE_KEY,
    TOKEN_KEY,
    AuthError,
    ClientAuth,
    Handshake,
    ServerAuth,
    Tls,
    is_loopback,
    load_token,
    plan_fingerprint,
    read_plan_fingerprint,
)
from ops.rpc.errors import BindError, PserverError
from ops.rpc.server import PServer, ServeConfig
from ops.rpc.service import METHODS
from ops.rpc.wire import encode_batch, encode_var, var_parts
from ops.scope import Scope
from ops.tensor import LoDTensor
from proto import rpc_pb2
from transpiler.runtime.launch import job_env

TOKEN = "s3cret-job-token-0123456789abcdef"
WRONG = "not-the-job-token-0123456789abcde"


def raw_call(address: str, method: str, request: bytes, metadata=(), credentials=None) -> grpc.StatusCode:
    """The status of one hand-made call (OK when it went through)."""
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    with channel:
        call = channel.unary_unary(METHODS[method].path)
        try:
            call(request, timeout=10, metadata=tuple(metadata))
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


FORGED_COMPLETE = rpc_pb2.CompleteMessage(trainer_id=0, failed=True, reason="forged").SerializeToString()


def test_forged_and_malformed_requests_are_unauthenticated_and_touch_nothing():
    """The figures of docs/security.md: each attempt below is UNAUTHENTICATED, and the job
    then runs to its normal end."""
    scope = Scope()
    scope.set_var("w", LoDTensor(np.arange(4, dtype=np.float32)))
    with running_pserver(sync_mode=False, scope=scope, auth=ServerAuth(token=TOKEN)) as ps:
        attempts = {
            "GetVariable without a token": ("GetVariable", encode_var("w", trainer_id=0), ()),
            "GetVariable with a wrong token": ("GetVariable", encode_var("w", trainer_id=0), ((TOKEN_KEY, WRONG),)),
            "SendComplete(failed=True) without a token": ("SendComplete", FORGED_COMPLETE, ()),
            "SendComplete(failed=True) with a wrong token": ("SendComplete", FORGED_COMPLETE, ((TOKEN_KEY, WRONG),)),
            "SendVariable of w without a token": (
                "SendVariable", encode_var("w", LoDTensor(np.zeros(4, np.float32)), trainer_id=0), ()),
            "SendVariable with a token's prefix": (
                "SendVariable", encode_var("w", LoDTensor(np.zeros(4, np.float32)), trainer_id=0),
                ((TOKEN_KEY, TOKEN[:-1]),)),
            "garbage bytes without a token": ("SendVariable", b"\xff\x00garbage", ()),
            "an empty token": ("FetchBarrier", rpc_pb2.BarrierMessage(trainer_id=0).SerializeToString(),
                               ((TOKEN_KEY, ""),)),
            "SendFetchBatch of w without a token": (
                "SendFetchBatch", encode_batch([var_parts("w", np.zeros(4, np.float32), trainer_id=0)], trainer_id=0), ()),
        }
        for what, (method, request, metadata) in attempts.items():
            code, details = raw_call(ps.address, method, request, metadata)
            assert code == grpc.StatusCode.UNAUTHENTICATED, what
            assert details == "missing or wrong job token" and TOKEN not in details and WRONG not in details, what
        assert np.array_equal(ps.scope.find_var("w").array, np.arange(4, dtype=np.float32))
        assert ps.server._failure is None and not ps.server.stopped and ps.server.rpc_counts == {}
        client = ps.client(0, auth=ClientAuth(token=TOKEN))
        assert client.get(ps.address, "w").array.tolist() == [0, 1, 2, 3]
        client.complete([ps.address])
        ps.join()
        assert not ps.errors and not ps.server.stopped  # every trainer completed: the normal end


def test_a_trainer_with_a_wrong_or_no_token_gets_one_clear_error():
    with running_pserver(sync_mode=False, auth=ServerAuth(token=TOKEN)) as ps:
        for auth in (ClientAuth(), ClientAuth(token=WRONG)):
            with pytest.raises(RpcError, match=r"get of w on pserver .* failed \(UNAUTHENTICATED\): missing or wrong"):
                ps.client(0, auth=auth).get(ps.address, "w")


def test_without_a_token_nothing_is_checked_on_loopback_and_the_log_says_so():
    lines: list[str] = []
    server = PServer(ServeConfig(endpoint="127.0.0.1:0", fanin=1, sync_mode=False), Scope(), lambda idx: None,
                     log=lines.append)
    server.start()
    try:
        assert lines == ["pserver 127.0.0.1:0: no job token: listening on loopback only"]
        code, _ = raw_call(server.address, "FetchBarrier", rpc_pb2.BarrierMessage(trainer_id=0).SerializeToString())
        assert code == grpc.StatusCode.OK
    finally:
        server.shutdown()


@pytest.mark.parametrize("where", ["0.0.0.0:0", "[::]:0", "10.1.2.3:0", "pserver-host.example:0", ":0"])
def test_without_a_token_a_non_loopback_address_is_refused_before_anything_binds(where, monkeypatch):
    def no_server(*args, **kwargs):
        raise AssertionError("a server was created")

    monkeypatch.setattr("ops.rpc.server.grpc.server", no_server)
    server = PServer(ServeConfig(endpoint="127.0.0.1:0", fanin=1, bind=where), Scope(), lambda idx: None)
    with pytest.raises(BindError, match=rf"refusing to listen on {where.replace('[', '.').replace(']', '.')} without a "
                       r"job token .*PSTRANSPILE_JOB_TOKEN.*--insecure"):
        server.start()
    assert server.port is None


def test_insecure_and_token_lines():
    assert ServerAuth(insecure=True).check_listen("0.0.0.0:6170", "h:6170") == (
        "WARNING: no job token, anyone who reaches 0.0.0.0:6170 controls this job (--insecure)")
    assert ServerAuth(token=TOKEN).check_listen("0.0.0.0:6170", "h:6170") == "job token required on every RPC, no TLS"
    assert TOKEN not in repr(ServerAuth(token=TOKEN)) and TOKEN not in repr(ClientAuth(token=TOKEN))
    assert [is_loopback(h) for h in ("127.0.0.1", "127.3.2.1", "localhost", "[::1]", "::1")] == [True] * 5
    assert [is_loopback(h) for h in ("0.0.0.0", "", "[::]", "10.0.0.1", "localhost.example")] == [False] * 5


# ------------------------------------------------------------------ TLS


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A self-signed certificate for localhost and 127.0.0.1 (its own CA), and a second,
    unrelated one."""
    return self_signed(tmp_path_factory.mktemp("certs"), "job", "other")


def test_tls_with_a_token(certs):
    tls = Tls(certs / "job.pem", certs / "job.key")
    lines: list[str] = []
    config = ServeConfig(endpoint="127.0.0.1:0", fanin=1, sync_mode=False, auth=ServerAuth(token=TOKEN, tls=tls))
    server = PServer(config, Scope(), lambda idx: None, log=lines.append)
    server.start()
    try:
        assert lines == ["pserver 127.0.0.1:0: job token required on every RPC, TLS"]
        trusted = ClientAuth(token=TOKEN, tls=Tls(ca=certs / "job.pem"))
        client = RpcClient(0, timeout=10, auth=trusted)
        client.send(server.address, "w", LoDTensor(np.ones(3, np.float32)))
        assert client.get(server.address, "w").array.tolist() == [1, 1, 1]
        client.close()
        barrier = rpc_pb2.BarrierMessage(trainer_id=0).SerializeToString()
        assert raw_call(server.address, "FetchBarrier", barrier, ((TOKEN_KEY, TOKEN),))[0] == grpc.StatusCode.UNAVAILABLE
        untrusted = grpc.ssl_channel_credentials((certs / "other.pem").read_bytes())
        assert raw_call(server.address, "FetchBarrier", barrier, ((TOKEN_KEY, TOKEN),), untrusted)[0] == (
            grpc.StatusCode.UNAVAILABLE)
        trusting = grpc.ssl_channel_credentials((certs / "job.pem").read_bytes())
        assert raw_call(server.address, "FetchBarrier", barrier, (), trusting)[0] == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.shutdown()


def test_mutual_tls_needs_a_client_certificate(certs):
    tls = Tls(certs / "job.pem", certs / "job.key", certs / "job.pem")
    server = PServer(ServeConfig(endpoint="127.0.0.1:0", fanin=1, sync_mode=False, auth=ServerAuth(tls=tls)), Scope(),
                     lambda idx: None)
    server.start()
    try:
        barrier = rpc_pb2.BarrierMessage(trainer_id=0).SerializeToString()
        no_cert = grpc.ssl_channel_credentials((certs / "job.pem").read_bytes())
        assert raw_call(server.address, "FetchBarrier", barrier, (), no_cert)[0] == grpc.StatusCode.UNAVAILABLE
        client = RpcClient(0, timeout=10, auth=ClientAuth(tls=Tls.from_env({
            "PSTRANSPILE_TLS_CERT": str(certs / "job.pem"), "PSTRANSPILE_TLS_KEY": str(certs / "job.key"),
            "PSTRANSPILE_TLS_CA": str(certs / "job.pem")})))
        client.fetch_barrier([server.address])
        client.close()
    finally:
        server.shutdown()


def test_tls_settings_that_cannot_work_are_errors(tmp_path):
    with pytest.raises(AuthError, match="certificate and its key together"):
        Tls(cert=tmp_path / "c.pem").server_credentials()
    with pytest.raises(AuthError, match="needs a certificate and key"):
        Tls(ca=tmp_path / "ca.pem").server_credentials()
    with pytest.raises(AuthError, match=r"cannot read the TLS key .*k.pem"):
        Tls(tmp_path / "c.pem", tmp_path / "k.pem").server_credentials()


# ------------------------------------------------------------------ the handshake


def handshake_call(address: str, handshake: Handshake, token: str | None = None):
    metadata = [(HANDSHAKE_KEY, handshake.encode())] + ([(TOKEN_KEY, token)] if token else [])
    return raw_call(address, "FetchBarrier", rpc_pb2.BarrierMessage(trainer_id=handshake.trainer_id)
                    .SerializeToString(), metadata)


@pytest.mark.parametrize(
    ("theirs", "says"),
    [
        (Handshake(1, 3, True, "a" * 16), "trainer 1 was started for 3 trainer(s), sync but this pserver serves 2 "
         "trainer(s), sync: the trainer count (PADDLE_TRAINERS_NUM) differs"),
        (Handshake(0, 2, False), "trainer 0 was started for 2 trainer(s), async but this pserver serves 2 trainer(s), "
         "sync: the mode (PSTRANSPILE_SYNC_MODE) differs"),
        (Handshake(1, 2, True, "b" * 16), "plan bbbbbbbbbbbbbbbb but this pserver serves 2 trainer(s), sync, plan "
         "aaaaaaaaaaaaaaaa: the plan (endpoints, slicing or program) differs"),
    ],
)
def test_a_trainer_of_another_job_shape_is_refused_and_fails_the_job(theirs, says):
    with running_pserver(fanin=2, plan_fingerprint="a" * 16, auth=ServerAuth(token=TOKEN)) as ps:
        good = ps.client(0, auth=ClientAuth(token=TOKEN), handshake=Handshake(0, 2, True, "a" * 16))
        waiting: list[BaseException] = []

        def fetch() -> None:  # trainer 0 waits in its barrier for trainer 1's
            try:
                good.fetch_barrier([ps.address])
            except RpcError as exc:
                waiting.append(exc)

        thread = threading.Thread(target=fetch, daemon=True)
        thread.start()
        code, details = handshake_call(ps.address, theirs, TOKEN)
        assert code == grpc.StatusCode.FAILED_PRECONDITION and says in details
        ps.join()
        thread.join(30)
    assert len(ps.errors) == 1 and isinstance(ps.errors[0], PserverError) and says in str(ps.errors[0])
    assert len(waiting) == 1 and says in str(waiting[0]), waiting


def test_a_matching_handshake_and_a_bare_client_are_served():
    with running_pserver(fanin=2, sync_mode=False, plan_fingerprint="a" * 16) as ps:
        assert handshake_call(ps.address, Handshake(1, 2, False, "a" * 16))[0] == grpc.StatusCode.OK
        assert handshake_call(ps.address, Handshake(0, 2, False))[0] == grpc.StatusCode.OK  # no plan: not compared
        assert raw_call(ps.address, "FetchBarrier", b"", ((HANDSHAKE_KEY, "trainers=two"),))[0] == (
            grpc.StatusCode.INVALID_ARGUMENT)
        ps.client(0).fetch_barrier([ps.address])  # no handshake at all
        assert ps.server._failure is None


def test_the_plan_fingerprint_is_the_same_from_the_plan_and_from_plan_json(tmp_path):
    from conftest import PADDLE_PROGRAMS
    from transpiler.api import transpile
    from transpiler.ir import Program

    case = PADDLE_PROGRAMS / "mlp_adam_2ps"
    main, startup = Program.load(case / "main.pb"), Program.load(case / "startup.pb")
    eps = "127.0.0.1:6170,127.0.0.1:6171"
    two = transpile(main, startup, pservers=eps, trainers=2)
    two.save(tmp_path)
    fingerprint = plan_fingerprint(two.plan.to_json())
    assert read_plan_fingerprint(tmp_path / "plan.json") == fingerprint and len(fingerprint) == 16
    assert plan_fingerprint(transpile(main, startup, pservers=eps, trainers=3, trainer_id=2).plan.to_json()) == fingerprint
    other = transpile(main, startup, pservers="127.0.0.1:6170,127.0.0.1:6172", trainers=2).plan.to_json()
    assert plan_fingerprint(other) != fingerprint
    assert Handshake.decode(Handshake(3, 4, False, fingerprint).encode()) == Handshake(3, 4, False, fingerprint)


# ------------------------------------------------------------------ where the token comes from


def test_token_sources_and_their_errors(tmp_path):
    warnings: list[str] = []
    assert load_token({}) is None
    assert load_token({"PSTRANSPILE_JOB_TOKEN": f" {TOKEN}\n"}) == TOKEN
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    os.chmod(path, 0o600)
    assert load_token({"PSTRANSPILE_JOB_TOKEN_FILE": str(path)}, warn=warnings.append) == TOKEN and not warnings
    assert load_token({"PSTRANSPILE_JOB_TOKEN": WRONG}, token_file=path) == TOKEN  # the flag wins
    os.chmod(path, 0o644)
    assert load_token({}, token_file=path, warn=warnings.append) == TOKEN
    assert warnings == [f"the job token file {path} is readable by other users (mode 0644); chmod 600 it"]
    assert load_token({"PSTRANSPILE_JOB_TOKEN": "short"}, warn=warnings.append) == "short"
    assert "has 5 characters; use at least 16" in warnings[-1]
    with pytest.raises(AuthError, match="cannot read the job token file"):
        load_token({"PSTRANSPILE_JOB_TOKEN_FILE": str(tmp_path / "missing")})
    with pytest.raises(AuthError, match=r"the job token from PSTRANSPILE_JOB_TOKEN must be printable ASCII"):
        load_token({"PSTRANSPILE_JOB_TOKEN": "two words here and more"})
    path.write_text("\n")
    with pytest.raises(AuthError, match=r"the job token from --token-file .* is empty"):
        load_token({}, token_file=path)


def test_launch_makes_one_token_per_job_unless_one_is_given():
    made = job_env({"X": "1"}, base={})
    assert made["X"] == "1" and len(made["PSTRANSPILE_JOB_TOKEN"]) >= 40
    assert job_env({}, base={})["PSTRANSPILE_JOB_TOKEN"] != made["PSTRANSPILE_JOB_TOKEN"]
    assert job_env({}, base={"PSTRANSPILE_JOB_TOKEN": TOKEN}) == {}
    assert job_env({"PSTRANSPILE_JOB_TOKEN_FILE": "/t"}, base={}) == {"PSTRANSPILE_JOB_TOKEN_FILE": "/t"}


def test_a_trainer_s_watch_line_carries_the_token():
    """The long-lived Watch call (failure detection) passes the gate like every RPC."""
    import time

    scope = Scope()
    scope.set_var("w", LoDTensor(np.arange(4, dtype=np.float32)))
    with running_pserver(sync_mode=False, scope=scope, auth=ServerAuth(token=TOKEN)) as ps:
        client = ps.client(0, auth=ClientAuth(token=TOKEN))
        assert client.get(ps.address, "w").array.tolist() == [0, 1, 2, 3]  # connects, opens the watch
        deadline = time.monotonic() + 30
        while ps.server._trainers[0].watches == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ps.server._trainers[0].watches == 1
        client.complete([ps.address])
        ps.join()
