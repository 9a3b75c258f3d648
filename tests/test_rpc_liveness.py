"""Issue 14, failure detection in process: a trainer keeps a `Watch` call open on each
pserver, so a trainer whose connection closes (killed) is named within `lost_grace`, not
after the RPC timeout; one that completes, or comes back, is not; and a trainer that is
connected but silent is not blamed as if it were gone."""

from __future__ import annotations

import time

from rpc_support import running_pserver

from ops.rpc.errors import PserverError

BOUND = 60.0  # a bound for the test, not a speed assertion (the timeout is 120 s)


def _wait_for_failure(ps) -> float:
    start = time.monotonic()
    ps.join(BOUND)
    return time.monotonic() - start


def test_a_trainer_whose_connection_closes_is_named_within_the_grace():
    with running_pserver(fanin=2, timeout=120.0, lost_grace=0.5) as ps:
        alive, doomed = ps.client(0), ps.client(1)
        alive.fetch_barrier([ps.address])
        doomed.fetch_barrier([ps.address])  # round 0 done; both watch the pserver
        time.sleep(0.5)
        doomed.close()  # its connection closes, as a killed process's does
        seconds = _wait_for_failure(ps)
    assert seconds < BOUND
    (error,) = ps.errors
    assert isinstance(error, PserverError)
    assert "trainer 1's connection closed at step 1 and it did not come back within 0.5 s" in str(error)
    assert "(its last request: fetch barrier at step 0)" in str(error) and "step 1 waits for its send barrier" in str(error)


def test_a_trainer_that_completes_or_reconnects_is_not_lost():
    with running_pserver(fanin=2, timeout=120.0, lost_grace=0.5) as ps:
        first, second = ps.client(0), ps.client(1)
        for client in (first, second):
            client.fetch_barrier([ps.address])
        first.close()
        again = ps.client(0)  # the same trainer id, a new connection, within the grace
        again.send_barrier([ps.address])
        second.complete([ps.address])
        second.close()
        time.sleep(1.5)  # past the grace: nobody is lost
        assert ps.thread.is_alive() and not ps.errors
        again.complete([ps.address])
        ps.join()
    assert not ps.errors


def test_a_connected_but_silent_trainer_is_not_called_gone():
    """It is alive (its Watch is open): the pserver says it may be blocked elsewhere."""
    with running_pserver(fanin=2, timeout=1.0) as ps:
        ps.client(0).fetch_barrier([ps.address])
        ps.client(1).fetch_barrier([ps.address])
        ps.client(0).send_barrier([ps.address])  # trainer 1 never sends: it waits on "another pserver"
        _wait_for_failure(ps)
    (error,) = ps.errors
    assert "trainer 1 sent nothing for 1 s" in str(error)
    assert "its connection is open, so it is alive but blocked (it may be waiting on another pserver)" in str(error)


def test_watch_calls_are_not_counted_as_rpcs():
    with running_pserver(fanin=1) as ps:
        client = ps.client(0)
        client.fetch_barrier([ps.address])
        client.complete([ps.address])
        ps.join()
        assert ps.server.rpc_counts == {"FetchBatch": 1, "SendComplete": 1}
        assert set(client.stats.snapshot()) == {"FetchBatch", "SendComplete"}
