"""ops/rpc/reduce.py: the cross-pserver sum every pserver computes alike, and its failures
(a silent peer, an unreachable one, malformed partials), bounded by the timeout. The whole
path through gRPC and the job token runs in tests/test_e2e_norms.py."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from ops.kernels.context import KernelError
from ops.rpc.reduce import PeerReduce, partial_name
from ops.rpc.wire import WireVar
from ops.tensor import LoDTensor

EPS = ["127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7003"]


def wired(timeout: float = 5.0) -> dict[str, PeerReduce]:
    """Three reducers whose sends go straight to each other's `receive`."""
    reducers: dict[str, PeerReduce] = {}

    def send(peer, name, value, _timeout):
        reducers[peer].receive(WireVar(name, LoDTensor(np.array(value))))

    for ep in EPS:
        reducers[ep] = PeerReduce(ep, EPS, timeout, send=send)
    return reducers


def run_all(reducers, values, step, var="g@PARTIAL"):
    out, errors = {}, []

    def one(ep):
        try:
            out[ep] = reducers[ep].allreduce(var, values[ep], step, EPS)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(ep,)) for ep in reducers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return out


def test_every_pserver_gets_the_same_bits_summed_in_pserver_order():
    reducers = wired()
    rng = np.random.default_rng(3)
    for step in (1, 2, 3):
        values = {ep: np.array([rng.standard_normal() * 10.0 ** rng.integers(-8, 8)]) for ep in EPS}
        out = run_all(reducers, values, step)
        expected = (values[EPS[0]] + values[EPS[1]]) + values[EPS[2]]
        for ep in EPS:
            assert out[ep].tobytes() == expected.tobytes(), ep
    assert all(r.calls == 3 for r in reducers.values())


def test_a_peer_ahead_by_a_step_does_not_mix_steps():
    reducers = wired()
    a, b, c = (reducers[ep] for ep in EPS)
    # c is already at step 2 and sends its partial before a and b finished step 1
    for peer in EPS[:2]:
        reducers[peer].receive(WireVar(partial_name(2, EPS[2], "v"), LoDTensor(np.array([100.0]))))
    out = run_all(reducers, {EPS[0]: np.array([1.0]), EPS[1]: np.array([2.0]), EPS[2]: np.array([4.0])}, 1, "v")
    assert {ep: float(v[0]) for ep, v in out.items()} == dict.fromkeys(EPS, 7.0)
    assert (2, "v") in a._mail and (2, "v") in b._mail  # kept for step 2


def test_a_silent_peer_fails_the_step_naming_it_within_the_timeout():
    reducers = wired(timeout=0.5)
    start = time.monotonic()
    out, errors = {}, []  # the third pserver never takes part

    def one(ep):
        try:
            out[ep] = reducers[ep].allreduce("v", np.array([1.0]), 1, EPS)
        except KernelError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=one, args=(ep,)) for ep in EPS[:2]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert time.monotonic() - start < 5
    assert len(errors) == 2 and not out
    assert all(f"no partial sum 'v' from peer pserver(s) {EPS[2]} within 0.5 s" in e for e in errors), errors


def test_an_unreachable_peer_fails_the_send_naming_it():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    eps = ["127.0.0.1:7001", f"127.0.0.1:{port}"]
    reducer = PeerReduce(eps[0], eps, 1.0)
    start = time.monotonic()
    with pytest.raises(KernelError, match=f"sending the partial sum 'v' to peer pserver 127.0.0.1:{port} failed"):
        reducer.allreduce("v", np.array([1.0]), 1, eps)
    assert time.monotonic() - start < 10
    reducer.close()


def test_malformed_partials_are_refused():
    reducer = wired()[EPS[0]]
    with pytest.raises(ValueError, match="is not a peer pserver"):
        reducer.receive(WireVar(partial_name(1, EPS[0], "v"), LoDTensor(np.array([1.0]))))  # itself
    with pytest.raises(ValueError, match="is not a peer pserver"):
        reducer.receive(WireVar(partial_name(1, "127.0.0.1:9", "v"), LoDTensor(np.array([1.0]))))
    reducer.receive(WireVar(partial_name(1, EPS[1], "v"), LoDTensor(np.array([1.0]))))
    with pytest.raises(ValueError, match="arrived twice"):
        reducer.receive(WireVar(partial_name(1, EPS[1], "v"), LoDTensor(np.array([1.0]))))
    with pytest.raises(ValueError, match="is not a peer partial"):
        reducer.receive(WireVar("fc_0.w_0@GRAD", LoDTensor(np.array([1.0]))))
    with pytest.raises(KernelError, match="is not among its endpoints"):
        reducer.allreduce("v", np.array([1.0]), 1, EPS[1:])


def test_a_sum_over_some_pservers_only():
    """LARS's norms: the pservers holding blocks of one param sum among themselves."""
    reducers = wired()
    some = [EPS[2], EPS[0]]  # the op's order is the summing order
    out, errors = {}, []

    def one(ep):
        out[ep] = reducers[ep].allreduce("n", np.array([1e16 if ep == EPS[2] else 1.0]), 1, some)

    threads = [threading.Thread(target=one, args=(ep,)) for ep in some]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert out[EPS[0]].tobytes() == out[EPS[2]].tobytes() == (np.array([1e16]) + np.array([1.0])).tobytes()
