"""Issue 23's "one fetch stalls every RPC", measured: a `pstranspile serve` pserver of the
Paddle-built `ctr_v1_dist_sgd_2ps` fixture (with a job token), one `FetchBatch` from trainer
0 naming `ctr_fc.b` N times (default 2,097,152), while trainer 1 keeps calling
`GetVariable` and holds a `Watch`. Prints how the big fetch ended and how long it took, the
slowest of trainer 1's calls meanwhile, and the pserver's resident memory before, at its
peak, and after.

    PYTHONPATH=. .venv/bin/python benchmarks/rpc_request_limits.py [--names N]

Every process it starts is stopped by its pid; only 127.0.0.1.
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ops.rpc.auth import TOKEN_KEY  # noqa: E402
from ops.rpc.service import CHANNEL_OPTIONS, METHODS  # noqa: E402
from proto import rpc_pb2  # noqa: E402
from tools.local_procs import free_ports, rss_mb  # noqa: E402

CASE = REPO / "tests" / "fixtures" / "paddle_programs" / "ctr_v1_dist_sgd_2ps"


def call(channel: grpc.Channel, method: str, request, token: str, timeout: float):
    m = METHODS[method]
    stub = channel.unary_unary(m.path, request_serializer=m.encode_request, response_deserializer=m.decode_response)
    return stub(request, metadata=((TOKEN_KEY, token),), timeout=timeout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--names", type=int, default=2_097_152)
    parser.add_argument("--wait", type=float, default=30.0, help="seconds the big fetch may take")
    args = parser.parse_args()
    token = secrets.token_hex(16)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PSTRANSPILE_JOB_TOKEN": token}
    with tempfile.TemporaryDirectory() as tmp:
        ports = free_ports(2)
        eps = ",".join(f"127.0.0.1:{p}" for p in ports)
        subprocess.run([sys.executable, "-m", "transpiler", "transpile", str(CASE / "main.pb"), "--startup",
                        str(CASE / "startup.pb"), "--pservers", eps, "--trainers", "2", "-o", tmp],
                       check=True, env=env, capture_output=True, timeout=120)
        ep = f"127.0.0.1:{ports[0]}"
        stem = f"{tmp}/pserver_127.0.0.1_{ports[0]}"
        proc = subprocess.Popen([sys.executable, "-m", "transpiler", "serve", "--program", f"{stem}.pb",
                                 "--startup", f"{stem}_startup.pb", "--timeout", "600"],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            channel = grpc.insecure_channel(ep, options=list(CHANNEL_OPTIONS))
            grpc.channel_ready_future(channel).result(timeout=60)
            get = rpc_pb2.VariableMessage(varname="ctr_fc.b", trainer_id=1).SerializeToString()
            for _ in range(100):  # serving once the startup ran
                try:
                    call(channel, "GetVariable", get, token, 5)
                    break
                except grpc.RpcError:
                    time.sleep(0.1)
            before = rss_mb(proc.pid)
            stop = threading.Event()
            worst = [0.0, 0]  # slowest GetVariable of trainer 1, calls made
            peak = [before]

            def other_trainer() -> None:
                while not stop.is_set():
                    t0 = time.perf_counter()
                    try:
                        call(channel, "GetVariable", get, token, 60)
                    except grpc.RpcError as exc:
                        print(f"trainer 1's get failed: {exc.code()}", file=sys.stderr)
                    worst[0] = max(worst[0], time.perf_counter() - t0)
                    worst[1] += 1
                    time.sleep(0.05)

            def sample() -> None:
                while not stop.is_set():
                    peak[0] = max(peak[0], rss_mb(proc.pid))
                    time.sleep(0.05)

            watch = call_future = None
            m = METHODS["Watch"]
            watch_stub = channel.unary_unary(m.path, request_serializer=m.encode_request,
                                             response_deserializer=m.decode_response)
            watch = watch_stub.future(rpc_pb2.WatchMessage(trainer_id=1, seconds=600), metadata=((TOKEN_KEY, token),))
            threads = [threading.Thread(target=other_trainer), threading.Thread(target=sample)]
            for t in threads:
                t.start()
            big = rpc_pb2.FetchRequest(trainer_id=0, varnames=["ctr_fc.b"] * args.names)
            print(f"request: {big.ByteSize() / 1e6:.1f} MB, {args.names} names")
            t0 = time.perf_counter()
            try:
                call_future = call(channel, "FetchBatch", big, token, args.wait)
                outcome = f"answered, {len(call_future.vars)} vars"
            except grpc.RpcError as exc:
                outcome = f"{exc.code().name}: {(exc.details() or '')[:160]}"
            took = time.perf_counter() - t0
            time.sleep(2.0)
            stop.set()
            for t in threads:
                t.join(120)
            after = rss_mb(proc.pid)
            watch.cancel()
            print(f"big fetch: {outcome} after {took:.2f} s")
            print(f"trainer 1: {worst[1]} GetVariable calls, slowest {worst[0]:.3f} s")
            print(f"pserver RSS: {before:.0f} MB before, {peak[0]:.0f} MB peak, {after:.0f} MB 2 s after")
            channel.close()
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
