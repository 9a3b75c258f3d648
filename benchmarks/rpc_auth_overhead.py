"""What the job token and the handshake cost per RPC (`ops.rpc.auth`).

    python3 benchmarks/rpc_auth_overhead.py [--calls 3000] [--repeats 5]
    PYTHONPATH=<a checkout without ops/rpc/auth.py> python3 benchmarks/rpc_auth_overhead.py   # "before"

1. **The gate alone**: `Gate.intercept_service` on a call's metadata (token +
   handshake, the case every trainer RPC takes), in µs per call (the fastest of
   `--repeats` runs), beside a gate with nothing to check and no gate at all.
2. **Round trips**: sequential small RPCs from one `RpcClient` to a pserver in a thread
   of this process on 127.0.0.1 (async mode: a `FetchBarrier` is acknowledged at once, a
   `GetVariable` returns 4 floats), in µs per call: without a token, and with a token
   and a handshake on every call. Run against a checkout without `ops/rpc/auth.py`
   (no gate at all) for the "before" figure. The cases alternate; the fastest and the median
   of `--repeats` runs are shown (on a shared machine the fastest is the least disturbed).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import timeit
from collections import namedtuple
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ops.rpc.client import RpcClient  # noqa: E402
from ops.rpc.server import PServer, ServeConfig  # noqa: E402
from ops.scope import Scope  # noqa: E402
from ops.tensor import LoDTensor  # noqa: E402

try:
    from ops.rpc import auth
except ImportError:  # a checkout before the gate
    auth = None

TOKEN = "benchmark-job-token-0123456789abcdefghijklmn"
Details = namedtuple("Details", "method invocation_metadata")


def gate_alone(calls: int, repeats: int) -> dict[str, float]:
    """µs per call, the fastest of `repeats` runs (the least disturbed by other load)."""
    gate = auth.Gate(TOKEN, endpoint="127.0.0.1:0", fanin=2, sync_mode=True, plan="a" * 16, refuse=print)
    open_gate = auth.Gate(None, endpoint="127.0.0.1:0", fanin=2, sync_mode=True, plan=None, refuse=print)
    metadata = auth.ClientAuth(token=TOKEN).metadata(auth.Handshake(1, 2, True, "a" * 16))
    full = Details("/pstranspiler.rpc.PServer/GetVariable", metadata + (("user-agent", "grpc-python/1.x"),))
    bare = Details("/pstranspiler.rpc.PServer/GetVariable", (("user-agent", "grpc-python/1.x"),))

    def continuation(details):
        return None

    cases = {
        "no gate (the continuation alone)": lambda: continuation(bare),
        "gate, no token, no handshake": lambda: open_gate.intercept_service(continuation, bare),
        "gate, token + handshake": lambda: gate.intercept_service(continuation, full),
    }
    gate.intercept_service(continuation, full)  # the first sight of a handshake parses it
    return {name: min(timeit.repeat(call, number=calls, repeat=repeats)) / calls * 1e6 for name, call in cases.items()}


def round_trips(calls: int, secured: bool) -> dict[str, float]:
    scope = Scope()
    scope.set_var("w", LoDTensor(np.arange(4, dtype=np.float32)))
    config = ServeConfig(endpoint="127.0.0.1:0", fanin=1, sync_mode=False)
    options = {}
    if secured:
        config = ServeConfig(endpoint="127.0.0.1:0", fanin=1, sync_mode=False, auth=auth.ServerAuth(token=TOKEN))
        options = {"auth": auth.ClientAuth(token=TOKEN), "handshake": auth.Handshake(0, 1, False)}
    elif auth is not None:
        options = {"auth": auth.ClientAuth()}
    server = PServer(config, scope, lambda idx: None)
    server.start()
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    client = RpcClient(0, timeout=60, **options)
    try:
        out = {}
        for name, call in (("FetchBarrier", lambda: client.fetch_barrier([server.address])),
                           ("GetVariable", lambda: client.get(server.address, "w"))):
            for _ in range(50):
                call()
            start = time.perf_counter()
            for _ in range(calls):
                call()
            out[name] = (time.perf_counter() - start) / calls * 1e6
        return out
    finally:
        client.close()
        server.stop()
        thread.join(30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if auth is not None:
        for name, micros in gate_alone(args.calls * 30, args.repeats).items():
            print(f"gate alone, {name}: {micros:.2f} µs per call")
    cases = [("no token", False)] + ([("token + handshake", True)] if auth is not None else [])
    if auth is None:
        cases = [("before the gate (no interceptor)", False)]
    runs: dict[str, list[dict[str, float]]] = {label: [] for label, _ in cases}
    for _ in range(args.repeats):  # the cases alternate, so a change in the machine's load hits both
        for label, secured in cases:
            runs[label].append(round_trips(args.calls, secured))
    for label, _ in cases:
        for method in runs[label][0]:
            values = sorted(r[method] for r in runs[label])
            print(f"round trip, {label}, {method}: fastest run {values[0]:.1f} µs per call, "
                  f"median {statistics.median(values):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
