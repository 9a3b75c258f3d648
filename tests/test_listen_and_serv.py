"""The pserver's protocols, with clients on loopback and a stand-in for the optimize
blocks: the sync state machine (phases, barriers, what waits for what), async mode,
timeouts that name the trainer and the step, failure notices, and clean shutdown."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from rpc_support import running_pserver

from ops.rpc import PserverError, RpcError
from ops.scope import Scope
from ops.tensor import LoDTensor

GRADS = ("g.trainer_0", "g.trainer_1")


def sgd_pserver(scope: Scope, calls: list[int]):
    """Block 1: w -= mean of the trainers' grads (what a transpiled sync block computes)."""
    scope.set_var("w", LoDTensor(np.zeros(3, np.float32)))

    def run_block(idx: int) -> None:
        calls.append(idx)
        grads = [scope.find_var(name).array for name in GRADS]
        scope.set_var("w", LoDTensor(scope.find_var("w").array - (grads[0] + grads[1]) / 2))

    return run_block


def step(client, address: str, grad: float) -> np.ndarray:
    """One trainer step: send the grad, send barrier, get w, fetch barrier."""
    client.send(address, f"g.trainer_{client.trainer_id}", np.full(3, grad, np.float32))
    client.send_barrier([address])
    w = client.get(address, "w").array
    client.fetch_barrier([address])
    return w


def test_sync_rounds_give_both_trainers_the_averaged_update():
    scope, calls = Scope(), []
    with running_pserver(fanin=2, scope=scope, run_block=sgd_pserver(scope, calls), received=GRADS,
                         optimize_blocks=(1,)) as ps:
        clients = [ps.client(0), ps.client(1)]
        with ThreadPoolExecutor(2) as pool:
            # round 0: the trainers' startup fetches the initial params
            initial = list(pool.map(lambda c: (c.get(ps.address, "w").array, c.fetch_barrier([ps.address]))[0], clients))
            assert all(w.tolist() == [0, 0, 0] for w in initial)
            for k in range(1, 4):
                got = list(pool.map(lambda c: step(c, ps.address, 2.0 * k + c.trainer_id), clients))
                expected = -sum(2.0 * j + 0.5 for j in range(1, k + 1))
                assert all(np.allclose(w, expected) for w in got), (k, got)
        for client in clients:
            client.complete([ps.address])
        ps.join()
    assert not ps.errors and calls == [1, 1, 1] and ps.server.rounds == 3
    # The one-var client calls each travel as a batch: per trainer per round a send and a
    # send barrier (SendBatch), a get and a fetch barrier (FetchBatch); round 0 fetches only.
    assert ps.server.rpc_counts == {"SendBatch": 2 * 2 * 3, "FetchBatch": 2 * 2 * 4, "SendComplete": 2}


@pytest.mark.parametrize(
    ("defer", "counts", "summary"),
    [
        # send_barrier sends the grads with the barrier, fetch_barrier gets the params with its own
        (False, {"FetchBatch": 8, "SendBatch": 6, "SendComplete": 2},
         "2.67 rpc/step/trainer over 3 steps (FetchBatch 8, SendBatch 6, SendComplete 2)"),
        # the fetch_barrier follows the send_barrier with only recvs between (every sync
        # trainer program): the grads, both barriers and the params travel in one call
        (True, {"FetchBatch": 2, "SendFetchBatch": 6, "SendComplete": 2},
         "1.67 rpc/step/trainer over 3 steps (SendFetchBatch 6, FetchBatch 2, SendComplete 2)"),
    ],
)
def test_the_rpcs_of_a_sync_step_as_the_trainer_kernels_make_them(defer, counts, summary):
    """What the trainer's kernels do: `send` queues, `send_barrier` sends (or defers),
    `fetch_barrier` fetches; the pserver counts the calls."""
    scope, calls, lines = Scope(), [], []
    with running_pserver(fanin=2, scope=scope, run_block=sgd_pserver(scope, calls), received=GRADS,
                         optimize_blocks=(1,)) as ps:
        ps.server._log = lines.append
        clients = [ps.client(0), ps.client(1)]

        def kernels_step(client, grad: float) -> np.ndarray:
            client.send_async(ps.address, f"g.trainer_{client.trainer_id}", np.full(3, grad, np.float32))
            client.send_barrier([ps.address], defer=defer)
            (w,) = client.fetch_barrier([ps.address], [(ps.address, "w")])
            return w.array

        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda c: c.fetch_barrier([ps.address]), clients))
            for k in range(1, 4):
                got = list(pool.map(lambda c: kernels_step(c, 1.0), clients))
                assert all(w.tolist() == [-k] * 3 for w in got)
        for client in clients:
            client.complete([ps.address])
        ps.join()
    assert ps.server.rpc_counts == counts
    assert lines[-1] == f"pserver 127.0.0.1:0: {summary}"


def test_a_deferred_send_barrier_goes_out_before_any_other_call():
    """A get between a deferred send barrier and the fetch barrier (a program that reads
    something there) sends the barrier first, as an undeferred one would have been."""
    scope, calls = Scope(), []
    scope.set_var("w", LoDTensor(np.zeros(3, np.float32)))

    def run_block(idx: int) -> None:  # one trainer: w -= its grad
        calls.append(idx)
        scope.set_var("w", LoDTensor(scope.find_var("w").array - scope.find_var("g.trainer_0").array))

    with running_pserver(fanin=1, scope=scope, run_block=run_block, received=GRADS[:1], optimize_blocks=(1,)) as ps:
        client = ps.client(0)
        client.fetch_barrier([ps.address])
        client.send_async(ps.address, "g.trainer_0", np.full(3, 1.0, np.float32))
        client.send_barrier([ps.address], defer=True)
        assert ps.server.rpc_counts == {"FetchBatch": 1}  # nothing sent yet
        assert client.get(ps.address, "w").array.tolist() == [-1.0] * 3  # after the round's optimize
        assert ps.server.rpc_counts == {"FetchBatch": 2, "SendBatch": 1}
        client.fetch_barrier([ps.address])
        client.complete([ps.address])
        ps.join()
    assert not ps.errors and calls == [1] and ps.server.rounds == 1


def test_a_get_waits_for_the_round_s_optimize_and_a_send_for_the_next_round():
    scope, calls = Scope(), []
    with running_pserver(fanin=2, scope=scope, run_block=sgd_pserver(scope, calls), received=GRADS,
                         optimize_blocks=(1,)) as ps:
        a, b = ps.client(0), ps.client(1)
        with ThreadPoolExecutor(4) as pool:
            a.fetch_barrier([ps.address])
            # a's next-round send must wait: b has not finished round 0
            early_send = pool.submit(a.send, ps.address, "g.trainer_0", np.ones(3, np.float32))
            time.sleep(0.3)
            assert not early_send.done()
            b.fetch_barrier([ps.address])
            early_send.result(timeout=10)
            a.send_barrier([ps.address])
            # a's get must wait for b's send barrier and the optimize block
            get = pool.submit(a.get, ps.address, "w")
            time.sleep(0.3)
            assert not get.done() and calls == []
            b.send(ps.address, "g.trainer_1", np.full(3, 3.0, np.float32))
            b.send_barrier([ps.address])
            assert get.result(timeout=10).array.tolist() == [-2.0, -2.0, -2.0] and calls == [1]


def test_every_grad_must_arrive_before_the_optimize_blocks_run():
    scope, calls = Scope(), []
    with running_pserver(fanin=2, scope=scope, run_block=sgd_pserver(scope, calls), received=GRADS,
                         optimize_blocks=(1,)) as ps:
        a, b = ps.client(0), ps.client(1)
        for c in (a, b):
            c.fetch_barrier([ps.address])
        a.send(ps.address, "g.trainer_0", np.ones(3, np.float32))
        a.send_barrier([ps.address])
        with ThreadPoolExecutor(1) as pool:
            get = pool.submit(a.get, ps.address, "w")  # waits for the round's optimize
            time.sleep(0.3)
            b.send_barrier([ps.address])  # without its grad
            with pytest.raises(RpcError, match=r"ABORTED.*step 1: every trainer sent its send barrier but 1 grad\(s\) never arrived: g.trainer_1"):
                get.result(timeout=30)
        ps.join()
    assert isinstance(ps.errors[0], PserverError) and calls == []


def test_a_trainer_that_never_comes_times_out_naming_it():
    with running_pserver(fanin=2, timeout=1.0, received=GRADS) as ps:
        a = ps.client(0)
        a.fetch_barrier([ps.address])
        with pytest.raises(RpcError, match="trainer 1 never contacted the pserver in 1 s; step 0 waits for its fetch barrier"):
            a.send(ps.address, "g.trainer_0", np.ones(3, np.float32))
        ps.join()
    (error,) = ps.errors
    assert isinstance(error, PserverError) and str(error).startswith(f"pserver 127.0.0.1:0: trainer 1 never contacted")


def test_a_trainer_that_goes_silent_times_out_naming_its_last_request_and_the_step():
    scope, calls = Scope(), []
    with running_pserver(fanin=2, timeout=1.0, scope=scope, run_block=sgd_pserver(scope, calls), received=GRADS,
                         optimize_blocks=(1,)) as ps:
        a, b = ps.client(0), ps.client(1)
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda c: c.fetch_barrier([ps.address]), (a, b)))
            list(pool.map(lambda c: step(c, ps.address, 1.0), (a, b)))
        # b stops here; a goes on and waits in round 2
        with pytest.raises(RpcError, match=r"trainer 1 sent nothing for 1 s \(its last request: fetch barrier at step 1\); its connection is open, "
                                             r"so it is alive but blocked .*; step 2 waits for its send barrier"):
            step(a, ps.address, 1.0)
        ps.join()
    assert "trainer 1 sent nothing" in str(ps.errors[0])


def test_a_killed_client_with_a_blocked_rpc_stops_counting_as_alive():
    """A trainer that dies while its get waits on the pserver must not keep it waiting
    forever: the cancelled call ends, and the silence timeout applies."""
    with running_pserver(fanin=2, timeout=1.0, received=GRADS) as ps:
        a, b = ps.client(0), ps.client(1)
        a.fetch_barrier([ps.address])
        blocked = threading.Thread(target=lambda: pytest.raises(RpcError, b.get, ps.address, "w"))
        b.fetch_barrier([ps.address])
        a.send(ps.address, "g.trainer_0", np.ones(3, np.float32))
        a.send_barrier([ps.address])
        blocked.start()  # b's get waits for round 1's optimize, which waits for b
        time.sleep(0.3)
        b.close()  # b dies: its channel closes under the waiting call
        blocked.join(10)
        ps.join()
    assert "trainer 1 sent nothing for 1 s" in str(ps.errors[0])


def test_a_failure_notice_stops_the_pserver_at_once():
    with running_pserver(fanin=2, timeout=60.0, received=GRADS) as ps:
        a, b = ps.client(0), ps.client(1)
        a.fetch_barrier([ps.address])
        b.complete([ps.address], failed=True, reason="ValueError: bad batch")
        with pytest.raises(RpcError, match="trainer 1 failed: ValueError: bad batch"):
            a.send(ps.address, "g.trainer_0", np.ones(3, np.float32))
        ps.join()
    assert "trainer 1 failed: ValueError: bad batch" in str(ps.errors[0])


def test_a_trainer_that_completes_early_counts_as_zero_grads():
    scope, calls = Scope(), []
    with running_pserver(fanin=2, scope=scope, run_block=sgd_pserver(scope, calls), received=GRADS,
                         optimize_blocks=(1,)) as ps:
        a, b = ps.client(0), ps.client(1)
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda c: c.fetch_barrier([ps.address]), (a, b)))
            list(pool.map(lambda c: step(c, ps.address, 2.0), (a, b)))
        b.complete([ps.address])
        w = step(a, ps.address, 2.0)  # b's grad is zeros now: w -= (2 + 0) / 2
        assert w.tolist() == [-3.0, -3.0, -3.0]
        a.complete([ps.address])
        ps.join()
    assert not ps.errors and calls == [1, 1]


def test_an_optimize_block_that_fails_stops_the_pserver():
    def broken(idx: int) -> None:
        raise ValueError("shapes do not match")

    with running_pserver(fanin=1, run_block=broken, received=("g",), optimize_blocks=(3,)) as ps:
        a = ps.client(0)
        a.fetch_barrier([ps.address])
        a.send(ps.address, "g", np.ones(2, np.float32))
        a.send_barrier([ps.address])
        with pytest.raises(RpcError, match="step 1: optimize block 3 failed: shapes do not match"):
            a.get(ps.address, "w")
        ps.join()
    assert "optimize block 3 failed" in str(ps.errors[0])


def test_an_optimize_block_that_fails_in_the_last_send_fetch_batch_stops_the_pserver():
    """The call whose send barrier completes the round runs its optimize blocks itself:
    a failure there fails that call and the pserver, with the same reason."""
    def broken(idx: int) -> None:
        raise ValueError("shapes do not match")

    with running_pserver(fanin=1, run_block=broken, received=("g",), optimize_blocks=(3,)) as ps:
        a = ps.client(0)
        a.fetch_barrier([ps.address])
        a.send_async(ps.address, "g", np.ones(2, np.float32))
        a.send_barrier([ps.address], defer=True)
        with pytest.raises(RpcError, match="step 1: optimize block 3 failed: shapes do not match"):
            a.fetch_barrier([ps.address])
        ps.join()
    assert "optimize block 3 failed" in str(ps.errors[0])
    assert ps.server.rpc_counts == {"FetchBatch": 1, "SendFetchBatch": 1}


def test_the_lr_block_runs_first_every_round():
    calls: list[int] = []
    scope = Scope()
    scope.set_var("w", LoDTensor(np.zeros(1, np.float32)))
    with running_pserver(fanin=1, scope=scope, run_block=calls.append, received=("g",), optimize_blocks=(1, 2, 3),
                         lr_decay_block=1) as ps:
        a = ps.client(0)
        a.fetch_barrier([ps.address])
        for _ in range(2):
            step_grad = np.ones(1, np.float32)
            a.send(ps.address, "g", step_grad)
            a.send_barrier([ps.address])
            a.get(ps.address, "w")
            a.fetch_barrier([ps.address])
        a.complete([ps.address])
        ps.join()
    assert calls == [1, 2, 3, 1, 2, 3]


def test_async_runs_a_grad_s_block_on_arrival_one_at_a_time():
    scope = Scope()
    scope.set_var("w", LoDTensor(np.zeros(4, np.float32)))
    active, overlaps, calls = [0], [], []
    lock = threading.Lock()

    def run_block(idx: int) -> None:
        with lock:
            active[0] += 1
            overlaps.append(active[0])
        time.sleep(0.002)
        calls.append(idx)
        scope.set_var("w", LoDTensor(scope.find_var("w").array - scope.find_var("g").array))
        with lock:
            active[0] -= 1

    with running_pserver(fanin=2, sync_mode=False, scope=scope, run_block=run_block, received=("g",),
                         grad_to_block={"g": 1}) as ps:
        clients = [ps.client(0), ps.client(1)]

        def train(client) -> None:
            client.fetch_barrier([ps.address])
            for _ in range(20):
                client.send(ps.address, "g", np.ones(4, np.float32))
                client.get(ps.address, "w")

        with ThreadPoolExecutor(2) as pool:
            list(pool.map(train, clients))
        for client in clients:
            client.complete([ps.address])
        ps.join()
    assert not ps.errors
    assert calls == [1] * 40 and max(overlaps) == 1
    assert scope.find_var("w").array.tolist() == [-40.0] * 4


def test_async_counters_are_added_and_rerun_the_lr_block():
    scope = Scope()
    for name in ("c.trainer_0", "c.trainer_1"):
        scope.set_var(name, LoDTensor(np.array([1], np.int64)))
    lr_runs: list[int] = []

    def run_block(idx: int) -> None:
        assert idx == 1
        total = scope.find_var("c.trainer_0").array + scope.find_var("c.trainer_1").array
        lr_runs.append(int(total[0]))

    with running_pserver(fanin=2, sync_mode=False, scope=scope, run_block=run_block, lr_decay_block=1,
                         optimize_blocks=(1,)) as ps:
        assert lr_runs == [2]  # once at start: the rate exists before the first grad
        a, b = ps.client(0), ps.client(1)
        for _ in range(3):
            a.send(ps.address, "c.trainer_0", np.array([1], np.int64), merge_add=True)
        b.send(ps.address, "c.trainer_1", np.array([1], np.int64), merge_add=True)
        a.complete([ps.address])
        b.complete([ps.address])
        ps.join()
    assert lr_runs == [2, 3, 4, 5, 6]
    assert scope.find_var("c.trainer_0").array.tolist() == [4]


def test_async_silence_times_out_too():
    with running_pserver(fanin=2, sync_mode=False, timeout=1.0) as ps:
        a = ps.client(0)
        with pytest.raises(RpcError, match="trainer 1 never contacted the pserver in 1 s; after 0 grad"):
            for _ in range(200):  # trainer 0 keeps talking; trainer 1 never comes
                a.send(ps.address, "x", np.ones(1, np.float32))
                time.sleep(0.1)
        ps.join()
    assert "trainer 1 never contacted the pserver in 1 s" in str(ps.errors[0])


def test_stop_ends_serving_and_waiting_rpcs_learn_why():
    with running_pserver(fanin=2, received=GRADS) as ps:
        a = ps.client(0)
        with ThreadPoolExecutor(1) as pool:
            a.fetch_barrier([ps.address])
            waiting = pool.submit(a.send, ps.address, "g.trainer_0", np.ones(3, np.float32))
            time.sleep(0.3)
            ps.server.stop()
            with pytest.raises(RpcError, match="UNAVAILABLE|shutting down"):
                waiting.result(timeout=10)
        ps.join()
    assert not ps.errors and ps.server.stopped
