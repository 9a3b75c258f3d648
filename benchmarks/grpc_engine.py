"""gRPC's EventEngine against the poller (`ops.rpc.engine`), for the calls a step makes.

A sync gRPC server (the pserver's kind: a thread pool, this project's server options) in
one process answers unary calls of `--kb` kB with as many bytes; a client in another
process makes `--calls` blocking calls one after another. Each pair of runs starts both
processes afresh with `PSTRANSPILE_GRPC_ENGINE=event_engine`, then `poller`, `--pairs`
times (alternated: the machine is shared). Prints calls/s, the client's and the server's
CPU µs per call, and the server's context switches per call, for every run, then the
medians and their ratio.

    python benchmarks/grpc_engine.py [--pairs 4] [--calls 4000] [--kb 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHOD = "/bench.Echo/Call"
ENGINES = ("event_engine", "poller")


def serve(port_file: Path) -> None:
    sys.path.insert(0, str(ROOT))
    import ops.rpc  # noqa: F401  (asks for the engine before gRPC starts)
    from concurrent import futures

    import grpc

    from ops.rpc.service import server_options

    size = int(os.environ["BENCH_BYTES"])
    reply = b"x" * size
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=server_options())
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: reply)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Echo", {"Call": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    port_file.write_text(str(port))
    server.wait_for_termination(timeout=600)  # bounded: the parent kills it long before


def proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def context_switches(pid: int) -> int:
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/status") as f:
            total += sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)
    return total


def client(port: int, calls: int, size: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of `calls` blocking calls, after a warm-up."""
    sys.path.insert(0, str(ROOT))
    import ops.rpc  # noqa: F401
    import grpc

    from ops.rpc.service import CHANNEL_OPTIONS

    request = b"y" * size
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=list(CHANNEL_OPTIONS)) as channel:
        call = channel.unary_unary(METHOD)
        for _ in range(50):
            call(request, timeout=30)
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(calls):
            call(request, timeout=30)
        return time.perf_counter() - wall, time.process_time() - cpu


def one_run(engine: str, calls: int, size: int, folder: Path) -> dict[str, float]:
    env = {**os.environ, "PSTRANSPILE_GRPC_ENGINE": engine, "BENCH_BYTES": str(size)}
    env.pop("GRPC_EXPERIMENTS", None)
    port_file = folder / f"port.{engine}"
    port_file.unlink(missing_ok=True)
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port_file)], env=env)
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text():
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"grpc_engine: the {engine} server did not start")
            time.sleep(0.05)
        port = int(port_file.read_text())
        out = subprocess.run([sys.executable, __file__, "--client", str(port), str(calls), str(server.pid)], env=env,
                             capture_output=True, text=True, timeout=600, check=True).stdout
        wall, client_cpu, server_cpu, switches = map(float, out.split())
    finally:
        server.kill()
        server.wait()
    return {"calls/s": calls / wall, "client µs": client_cpu / calls * 1e6, "server µs": server_cpu / calls * 1e6,
            "server switches": switches / calls}


def client_main(port: int, calls: int, server_pid: int) -> None:
    size = int(os.environ["BENCH_BYTES"])
    cpu0, switches0 = proc_cpu(server_pid), context_switches(server_pid)
    wall, cpu = client(port, calls, size)
    print(wall, cpu, proc_cpu(server_pid) - cpu0, context_switches(server_pid) - switches0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=4, help="event_engine/poller run pairs (default 4)")
    parser.add_argument("--calls", type=int, default=4000, help="timed calls per run (default 4000)")
    parser.add_argument("--kb", type=float, default=16, help="request and reply size, kB (default 16)")
    parser.add_argument("--serve", metavar="PORT_FILE", help=argparse.SUPPRESS)
    parser.add_argument("--client", nargs=3, type=int, metavar=("PORT", "CALLS", "SERVER_PID"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(Path(args.serve))
        return 0
    if args.client:
        client_main(*args.client)
        return 0
    if min(args.pairs, args.calls) < 1 or args.kb < 0:
        parser.error("--pairs and --calls must be >= 1, --kb >= 0")
    size = int(args.kb * 1024)

    runs: dict[str, list[dict[str, float]]] = {engine: [] for engine in ENGINES}
    with tempfile.TemporaryDirectory(prefix="grpc_engine_") as tmp:
        for pair in range(args.pairs):
            for engine in ENGINES:
                got = one_run(engine, args.calls, size, Path(tmp))
                runs[engine].append(got)
                print(f"pair {pair + 1} {engine:12s} " + ", ".join(f"{k} {v:.1f}" for k, v in got.items()), flush=True)
    print(f"\nmedians of {args.pairs} runs of {args.calls} calls, {args.kb:g} kB each way, loopback:")
    keys = list(runs[ENGINES[0]][0])
    print("| engine | " + " | ".join(keys) + " |")
    print("|---|" + "---:|" * len(keys))
    medians = {e: {k: statistics.median(r[k] for r in runs[e]) for k in keys} for e in ENGINES}
    for engine in ENGINES:
        print(f"| {engine} | " + " | ".join(f"{medians[engine][k]:.1f}" for k in keys) + " |")
    print("| poller / event_engine | " + " | ".join(
        f"{medians['poller'][k] / medians['event_engine'][k]:.2f}" for k in keys) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
