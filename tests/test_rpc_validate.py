"""Issue 14: every received var is checked against what the pserver program expects from
that trainer, over a real gRPC server on loopback. Each bad input is refused with
INVALID_ARGUMENT (or RESOURCE_EXHAUSTED for its size) naming the problem; nothing of
it is applied, the pserver keeps running and the next correct step trains."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
from rpc_support import running_pserver, sgd_block

from conftest import PADDLE_PROGRAMS
from ops.rpc import RpcClient, RpcError
from ops.rpc.serve import serve_program
from ops.rpc.service import METHODS
from ops.rpc.validate import MESSAGE_FLOOR
from ops.rpc.wire import encode_batch, var_parts
from ops.scope import Scope
from ops.tensor import LoDTensor, SelectedRows
from transpiler.api import transpile
from transpiler.ir import Program
from transpiler.runtime.launch import free_endpoints

F32 = np.float32


def _scope() -> Scope:
    scope = Scope()
    scope.set_var("w", LoDTensor(np.ones((1000, 1000), F32)))
    scope.set_var("b", LoDTensor(np.ones(256, F32)))
    scope.set_var("emb", LoDTensor(np.ones((10, 4), F32)))
    return scope


def _program_config(fanin: int = 1, **extra):
    """What `listen_and_serv` would build for w [1000, 1000], b [256] and a sparse emb
    [10, 4] (SGD, lr 1), per trainer when `fanin` > 1."""
    grads = ("w@GRAD", "b@GRAD", "emb@GRAD")
    shapes = {"w@GRAD": (1000, 1000), "b@GRAD": (256,), "emb@GRAD": (10, 4)}
    names = grads if fanin == 1 else tuple(f"{g}.trainer_{t}" for g in grads for t in range(fanin))
    received = tuple(names)
    templates = {n: (shapes[n.split(".trainer_")[0]], F32) for n in received}
    sparse = frozenset(n for n in received if n.startswith("emb@GRAD"))
    return dict(fanin=fanin, received=received, templates=templates, sparse_vars=sparse, optimize_blocks=(1,),
                known_vars=frozenset(received) | {"w", "b", "emb"}, **extra)


def _sgd(scope: Scope, fanin: int):
    return sgd_block(scope, fanin, ("w", "b", "emb"))


def _correct_step(client, address: str, trainer: int = 0, fanin: int = 1) -> None:
    suffix = "" if fanin == 1 else f".trainer_{trainer}"
    client.send_async(address, f"w@GRAD{suffix}", LoDTensor(np.full((1000, 1000), 0.5, F32)))
    client.send_async(address, f"b@GRAD{suffix}", LoDTensor(np.full(256, 0.5, F32)))
    client.send_async(address, f"emb@GRAD{suffix}", SelectedRows([2], np.full((1, 4), 0.5, F32), height=10))
    client.send_barrier([address])


BAD = [
    # (what the issue says, name, value, the reason the pserver gives)
    ("[1] grad for a [1000, 1000] param", "w@GRAD", LoDTensor(np.full(1, 50, F32)),
     r"shape \[1\] does not match the expected \[1000, 1000\]"),
    ("[7] grad for a [256] param", "b@GRAD", LoDTensor(np.ones(7, F32)), r"shape \[7\] does not match the expected \[256\]"),
    ("float64 grad", "b@GRAD", LoDTensor(np.ones(256, np.float64)), "dtype float64 does not match the expected float32"),
    ("int64 grad", "b@GRAD", LoDTensor(np.ones(256, np.int64)), "dtype int64 does not match the expected float32"),
    ("unknown var", "nope@GRAD", LoDTensor(np.ones(4, F32)), "the pserver does not receive that var"),
    ("row id = height", "emb@GRAD", SelectedRows([3, 10], np.ones((2, 4), F32), height=10),
     r"row id 10 is outside \[0, 10\)"),
    ("negative row", "emb@GRAD", SelectedRows([-1], np.ones((1, 4), F32), height=10), r"row id -1 is outside \[0, 10\)"),
    ("wrong row width", "emb@GRAD", SelectedRows([1], np.ones((1, 5), F32), height=10),
     r"rows of shape \[5\] do not match the expected \[4\]"),
    ("wrong height", "emb@GRAD", SelectedRows([1], np.ones((1, 4), F32), height=1000), "height 1000 does not match the expected 10"),
    ("dense for SelectedRows", "emb@GRAD", LoDTensor(np.ones((10, 4), F32)), "a dense tensor for a SelectedRows var"),
    ("SelectedRows for dense", "b@GRAD", SelectedRows([1], np.ones((1, 256), F32), height=256), "a SelectedRows for a dense var"),
]


def test_each_bad_grad_is_refused_naming_it_and_nothing_is_applied():
    scope = _scope()
    with running_pserver(scope=scope, run_block=_sgd(scope, 1), **_program_config()) as ps:
        client = ps.client(0)
        client.fetch_barrier([ps.address])  # round 0
        for what, name, value, reason in BAD:
            client.send_async(ps.address, "w@GRAD", LoDTensor(np.full((1000, 1000), 9.0, F32)))  # fine, but refused with the batch
            client.send_async(ps.address, name, value)
            with pytest.raises(RpcError, match=rf"\(INVALID_ARGUMENT\): pserver .*: trainer 0's send of {name!r}: {reason}"):
                client.send_barrier([ps.address])
            assert scope.find_var("w@GRAD") is None, what  # the whole batch refused: nothing stored
            # the same batch deferred to the fetch barrier (one SendFetchBatch) is refused alike
            client.send_async(ps.address, name, value)
            client.send_barrier([ps.address], defer=True)
            with pytest.raises(RpcError, match=rf"\(INVALID_ARGUMENT\): pserver .*: trainer 0's send of {name!r}: {reason}"):
                client.fetch_barrier([ps.address])
            assert scope.find_var(name) is None, what
        assert np.all(scope.find_var("w").array == 1) and np.all(scope.find_var("b").array == 1)
        _correct_step(client, ps.address)
        (w, b, emb) = client.fetch_barrier([ps.address], [(ps.address, n) for n in ("w", "b", "emb")])
        assert np.all(w.array == 0.5) and np.all(b.array == 0.5)
        assert emb.array[2].tolist() == [0.5] * 4 and np.all(np.delete(emb.array, 2, axis=0) == 1)
        client.complete([ps.address])
        ps.join()
    assert not ps.errors and ps.server.rounds == 1


def test_a_trainer_may_not_send_another_trainers_grad():
    scope = _scope()
    with running_pserver(scope=scope, run_block=_sgd(scope, 2), **_program_config(fanin=2)) as ps:
        one = ps.client(1)
        one.send_async(ps.address, "b@GRAD.trainer_0", LoDTensor(np.ones(256, F32)))
        with pytest.raises(RpcError, match=r"INVALID_ARGUMENT.*trainer 1's send of 'b@GRAD.trainer_0': that var is trainer 0's"):
            one.send_barrier([ps.address])
        # A var inside a batch claiming another trainer than the batch's.
        forged = encode_batch([var_parts("b@GRAD.trainer_1", np.ones(256, F32), trainer_id=0)], trainer_id=1)
        with grpc.insecure_channel(ps.address) as channel:
            call = channel.unary_unary(METHODS["SendBatch"].path)
            with pytest.raises(grpc.RpcError) as refused:
                call(forged, timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "the var says it is trainer 0's" in refused.value.details()
        # The same forgery through the one-call sync step (grads, barriers and fetch together).
        with grpc.insecure_channel(ps.address) as channel:
            call = channel.unary_unary(METHODS["SendFetchBatch"].path)
            with pytest.raises(grpc.RpcError) as refused:
                call(forged, timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "the var says it is trainer 0's" in refused.value.details()
        with pytest.raises(RpcError, match="trainer id 5 is out of range for Fanin 2"):
            ps.client(5).send_barrier([ps.address])
        clients = [ps.client(0), one]
        for client in clients:
            client.fetch_barrier([ps.address])
        for t, client in enumerate(clients):
            _correct_step(client, ps.address, t, 2)
        w = [client.fetch_barrier([ps.address], [(ps.address, "w")])[0] for client in clients][0]
        assert np.all(w.array == 0)  # 1 - 0.5 - 0.5: each trainer's grad applied once
        for client in clients:
            client.complete([ps.address])
        ps.join()
    assert not ps.errors and ps.server.rounds == 1


@pytest.mark.parametrize("refuse", [False, True])
def test_nonfinite_grads_are_refused_only_when_asked(refuse):
    scope = _scope()
    with running_pserver(scope=scope, run_block=_sgd(scope, 1), **_program_config(refuse_nonfinite=refuse)) as ps:
        client = ps.client(0)
        client.fetch_barrier([ps.address])
        bad = np.ones(256, F32)
        bad[[3, 7]] = [np.nan, np.inf]
        client.send_async(ps.address, "b@GRAD", LoDTensor(bad))
        if refuse:
            with pytest.raises(RpcError, match=r"INVALID_ARGUMENT.*send of 'b@GRAD': 2 NaN or Inf value\(s\)"):
                client.send_barrier([ps.address])
            assert scope.find_var("b@GRAD") is None
        else:
            client.send_barrier([ps.address])  # Paddle's default: accepted
            assert np.isnan(scope.find_var("b@GRAD").array[3])


def test_a_message_over_the_programs_bound_is_refused_before_it_is_read():
    """256 MiB for an unknown var: gRPC refuses it from its length (the pserver's limit is
    the largest batch a trainer may send plus slack, at least 64 MiB)."""
    scope = _scope()
    with running_pserver(scope=scope, run_block=_sgd(scope, 1), **_program_config()) as ps:
        client = ps.client(0)
        client.fetch_barrier([ps.address])
        client.send_async(ps.address, "huge", LoDTensor(np.zeros(64 * 1024 * 1024, F32)))
        with pytest.raises(RpcError, match="RESOURCE_EXHAUSTED"):
            client.send_barrier([ps.address])
        _correct_step(client, ps.address)
        (b,) = client.fetch_barrier([ps.address], [(ps.address, "b")])
        assert np.all(b.array == 0.5)


def test_the_message_bound_follows_the_program():
    from ops.rpc.server import ServeConfig
    from ops.rpc.validate import max_message

    assert max_message(ServeConfig(endpoint="e:1", fanin=1)) == -1  # no program: no bound
    small = ServeConfig(endpoint="e:1", **_program_config())
    assert max_message(small) == MESSAGE_FLOOR
    big = dict(_program_config(), templates={"w@GRAD": ((100_000, 1000), F32)}, received=("w@GRAD",))
    assert max_message(ServeConfig(endpoint="e:1", **big)) > 400_000_000


def test_a_flood_of_parked_sends_cannot_starve_the_gets_and_barriers():
    """60 sends from one (forged) trainer id while the round still fetches: two park (its
    quota), the rest are refused at once, and both trainers' step completes."""
    scope = _scope()
    with running_pserver(scope=scope, run_block=_sgd(scope, 2), **_program_config(fanin=2)) as ps:
        empty = encode_batch([], trainer_id=1)  # valid, and harmless once the round takes sends
        with grpc.insecure_channel(ps.address) as channel:
            call = channel.unary_unary(METHODS["SendBatch"].path)
            flood = [call.future(empty, timeout=120) for _ in range(60)]
            deadline = time.monotonic() + 60  # a bound for the test, not a speed assertion
            while sum(f.done() for f in flood) < 58 and time.monotonic() < deadline:
                time.sleep(0.05)
            refused = [f.exception() for f in flood if f.done()]
            assert len(refused) == 58 and {exc.code() for exc in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
            assert "trainer 1 already has 2 send(s) in flight here (at most 2)" in refused[0].details()
            clients = [ps.client(0), ps.client(1)]
            for client in clients:  # round 0's gets and fetch barriers go through
                client.fetch_barrier([ps.address], [(ps.address, "b")])
            for t, client in enumerate(clients):
                _correct_step(client, ps.address, t, 2)
            for client in clients:
                (b,) = client.fetch_barrier([ps.address], [(ps.address, "b")])
                assert np.all(b.array == 0)
            for future in flood:
                future.cancel()
        for client in clients:
            client.complete([ps.address])
        ps.join()
    assert not ps.errors and ps.server.rounds == 1


def test_the_nonfinite_option_comes_from_the_env_or_the_cli():
    from ops.rpc.service import refuse_nonfinite_default
    from transpiler.cli import build_parser

    assert [refuse_nonfinite_default(env) for env in ({}, {"PSTRANSPILE_REFUSE_NONFINITE": "1"},
                                                       {"PSTRANSPILE_REFUSE_NONFINITE": "0"})] == [False, True, False]
    with pytest.raises(ValueError, match="PSTRANSPILE_REFUSE_NONFINITE='maybe' is not 1 or 0"):
        refuse_nonfinite_default({"PSTRANSPILE_REFUSE_NONFINITE": "maybe"})
    args = build_parser().parse_args(["serve", "--program", "p", "--startup", "s", "--refuse-nonfinite"])
    assert args.refuse_nonfinite is True


def test_a_transpiled_pserver_program_says_what_it_expects():
    """The expectations come from `listen_and_serv` of a real pserver program: each
    trainer's grad of each param block, at its block's shape, from that trainer only."""
    case = PADDLE_PROGRAMS / "seed_fc3_sgd_3ps"
    (endpoint,) = free_endpoints(1)
    result = transpile(Program.load(case / "main.pb"), Program.load(case / "startup.pb"), pservers=endpoint, trainers=2)
    main, startup = result.pservers[endpoint]
    ready, servers, errors = threading.Event(), [], []

    def serve() -> None:
        try:
            serve_program(main, startup, log=None, ready=lambda s: (servers.append(s), ready.set()))
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            errors.append(exc)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(60)
    (server,) = servers
    try:
        grads = {name: spec for name, spec in server._expected.received.items() if spec.trainer == 1}
        assert grads and all(spec.shape and spec.dtype == np.float32 for spec in grads.values())
        name, spec = sorted(grads.items())[0]
        client = RpcClient(1, timeout=30)
        client.send_async(endpoint, name, LoDTensor(np.ones(1, F32)))
        with pytest.raises(RpcError, match=rf"INVALID_ARGUMENT.*trainer 1's send of {name!r}: shape \[1\] does not match "
                                           rf"the expected \[{', '.join(map(str, spec.shape))}\]"):
            client.send_barrier([endpoint])
        client.send_async(endpoint, name.replace(".trainer_1", ".trainer_0"), LoDTensor(np.ones(spec.shape, F32)))
        with pytest.raises(RpcError, match="that var is trainer 0's"):
            client.send_barrier([endpoint])
        client.close()
        assert thread.is_alive() and not server.stopped
    finally:
        server.stop()
        thread.join(30)
    assert not errors
