"""Runtime throughput: dense gradients through a pserver on loopback, beside the raw
gRPC ceiling measured in the same run; and the MLP's step time, 2 x 2 vs local.

    python3 benchmarks/pserver_throughput.py [--sizes 1,4,16,64,256] [--seconds 3] [--mlp-steps 100]

1. **Raw ceiling.** A bare gRPC server process (bytes in, bytes out, no protobuf, no
   numpy); two client threads each send N bytes and fetch N bytes, repeatedly.
2. **Pserver.** One param of N bytes (`fc_w`, fp32 `[N/4096, 1024]`, SGD), transpiled
   for 1 pserver x 2 trainers, served by `pstranspile serve` in its own process (its
   optimize block: `sum` of the two trainers' grads → `scale` 1/2 → `sgd`); two
   trainer threads, each with its own `RpcClient`, do what a sync step's kernels do:
   send the grad, send barrier, get the param, fetch barrier.

   Both report MB moved per second (4N per step: each trainer sends N and receives N),
   so the ratio says how much of the transport's ceiling the runtime keeps.
3. **MLP step time.** `examples/mlp.py` (784-256-128-10, Adam), global batch 64:
   local training in this process vs `pstranspile launch` 2 pservers x 2 trainers
   (`examples/train_program.py`, each trainer on 32 rows), from the trainers' steps/s;
   and the RPCs per step per trainer each pserver counted (its exit line).

Every process runs with one BLAS thread (as `launch` gives 4 processes on 2 cores).
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import io  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from concurrent import futures  # noqa: E402
from pathlib import Path  # noqa: E402

import grpc  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

MB = 1024 * 1024
RAW_SERVICE = "bench.Raw"
RAW_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1), ("grpc.so_reuseport", 0)]


# ------------------------------------------------------------------ raw gRPC


def raw_server(port: int) -> None:
    """Put: take N bytes, answer nothing. Take: 8-byte size in, that many bytes out."""
    cache: dict[int, bytes] = {}

    def take(request: bytes, context) -> bytes:
        size = int.from_bytes(request, "little")
        if size not in cache:
            cache.clear()
            cache[size] = bytes(size)
        return cache[size]

    server = grpc.server(futures.ThreadPoolExecutor(8), options=RAW_OPTIONS)
    handlers = {
        "Put": grpc.unary_unary_rpc_method_handler(lambda request, context: b""),
        "Take": grpc.unary_unary_rpc_method_handler(take),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(RAW_SERVICE, handlers),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


def measure_raw(endpoint: str, size: int, seconds: float) -> float:
    """MB/s moved by two threads each putting and taking `size` bytes."""
    payload = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8).tobytes()
    channels = [grpc.insecure_channel(endpoint, options=RAW_OPTIONS[:2]) for _ in range(2)]
    for channel in channels:
        grpc.channel_ready_future(channel).result(timeout=30)
    calls = [(c.unary_unary(f"/{RAW_SERVICE}/Put"), c.unary_unary(f"/{RAW_SERVICE}/Take")) for c in channels]

    def one(k: int) -> None:
        put, take = calls[k]
        put(payload, timeout=120)
        got = take(size.to_bytes(8, "little"), timeout=120)
        assert len(got) == size

    def rounds(n: int) -> None:
        with futures.ThreadPoolExecutor(2) as pool:
            for _ in range(n):
                list(pool.map(one, range(2)))

    rounds(1)  # warm up
    steps, elapsed = _timed(rounds, seconds)
    for channel in channels:
        channel.close()
    return 4 * size * steps / elapsed / MB


def _timed(run, seconds: float, min_steps: int = 3) -> tuple[int, float]:
    """Run `run(1)` until `seconds` passed and at least `min_steps` ran."""
    steps, start = 0, time.perf_counter()
    while steps < min_steps or time.perf_counter() - start < seconds:
        run(1)
        steps += 1
    return steps, time.perf_counter() - start


# ------------------------------------------------------------------ the pserver


def param_program(size: int):
    """One fp32 param `fc_w` of `size` bytes ([size/4096, 1024]) trained by SGD."""
    from transpiler.frontend import ParamAttr, layers, optimizer
    from transpiler.frontend.fluid18_networks import build

    rows = size // 4096

    def body() -> None:
        x = layers.data(name="x", shape=[rows], dtype="float32")
        y = layers.fc(input=x, size=1024, param_attr=ParamAttr(name="fc_w"), bias_attr=False)
        optimizer.SGD(learning_rate=0.01).minimize(layers.mean(y))

    return build(body)


def measure_pserver(size: int, seconds: float, workdir: Path) -> float:
    """MB/s moved by two trainer threads through a `pstranspile serve` process."""
    import ops.rpc  # noqa: F401
    from ops.rpc.client import RpcClient
    from transpiler.api import transpile
    from transpiler.runtime.launch import free_endpoints
    from transpiler.output import pserver_file_stem

    main, startup = param_program(size)
    (endpoint,) = free_endpoints(1)
    results = [transpile(main, startup, pservers=endpoint, trainers=2, trainer_id=t, slice_var_up=False) for t in range(2)]
    out = workdir / f"pserver_{size}"
    results[0].save(out)
    grads = [next(op.input("X")[0] for op in r.trainer.global_block().ops if op.type == "send") for r in results]
    stem = out / pserver_file_stem(endpoint)
    server = subprocess.Popen(
        [sys.executable, "-m", "transpiler", "serve", "--program", f"{stem}.pb",
         "--startup", f"{stem}_startup.pb", "--timeout", "600"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    clients = [RpcClient(t, timeout=600, connect_timeout=60) for t in range(2)]
    values = [np.random.default_rng(t).standard_normal(size // 4).astype(np.float32).reshape(-1, 1024) * 1e-3 for t in range(2)]
    barrier = threading.Barrier(2)

    def trainer(t: int, steps: int) -> None:
        client = clients[t]
        for _ in range(steps):
            client.send_async(endpoint, grads[t], values[t])
            client.send_barrier([endpoint])
            param = client.get(endpoint, "fc_w")
            client.fetch_barrier([endpoint])
            assert param.array.nbytes == size

    def rounds(n: int) -> None:
        barrier.reset()
        with futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda t: trainer(t, n), range(2)))

    try:
        with futures.ThreadPoolExecutor(2) as pool:  # the startup fetch (round 0)
            list(pool.map(lambda t: (clients[t].get(endpoint, "fc_w"), clients[t].fetch_barrier([endpoint])), range(2)))
        rounds(1)  # warm up
        steps, elapsed = _timed(rounds, seconds)
        for client in clients:
            client.complete([endpoint])
        server.wait(60)
    finally:
        for client in clients:
            client.close()
        if server.poll() is None:
            server.kill()
            server.wait()
    if server.returncode != 0:
        raise RuntimeError(f"the pserver failed: {server.stderr.read().decode()[-2000:]}")
    return 4 * size * steps / elapsed / MB


# ------------------------------------------------------------------ the MLP


def mlp_step_times(steps: int, workdir: Path) -> tuple[float, list[float], list[str]]:
    """(local ms/step, each trainer's ms/step under launch 2 x 2, each pserver's RPC count line)."""
    import mlp
    from train_program import synthetic_batch

    from ops.executor import Executor
    from ops.scope import Scope
    from transpiler.runtime.launch import LaunchConfig, launch

    main, startup = mlp.build()
    batch = 64
    exe, scope = Executor(), Scope()
    exe.run(startup, scope=scope)
    feeds = [synthetic_batch(main, batch, 0, s) for s in range(steps)]
    exe.run(main, feed=feeds[0], scope=scope)
    start = time.perf_counter()
    for feed in feeds:
        exe.run(main, feed=feed, scope=scope)
    local = (time.perf_counter() - start) / steps * 1000

    folder = workdir / "mlp"
    folder.mkdir()
    main.save(folder / "main.pb")
    startup.save(folder / "startup.pb")
    command = (sys.executable, str(ROOT / "examples" / "train_program.py"), "--main", str(folder / "main.pb"),
               "--startup", str(folder / "startup.pb"), "--loss", "mean_0.tmp_0", "--steps", str(steps),
               "--batch", str(batch))
    result = launch(LaunchConfig(command=command, pservers=2, trainers=2, log_dir=folder / "logs",
                                 status_every=3600), out=io.StringIO())
    if not result.ok:
        raise RuntimeError(result.summary())
    logs = sorted((folder / "logs").glob("pserver.*.log"))
    rpc_lines = [line for log in logs for line in log.read_text().splitlines() if "rpc/step/trainer" in line]
    return local, [1000 / t.progress.steps_per_s for t in result.trainers()], rpc_lines


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,4,16,64,256", help="param sizes in MB")
    parser.add_argument("--seconds", type=float, default=3.0, help="measure each size at least this long")
    parser.add_argument("--mlp-steps", type=int, default=100)
    parser.add_argument("--raw-server", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.raw_server:
        raw_server(args.raw_server)
        return 0

    from transpiler.runtime.launch import free_endpoints

    sizes = [int(float(s) * MB) for s in args.sizes.split(",")]
    (raw_endpoint,) = free_endpoints(1)
    raw = subprocess.Popen([sys.executable, __file__, "--raw-server", raw_endpoint.rpartition(":")[2]])
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for size in sizes:
                ceiling = measure_raw(raw_endpoint, size, args.seconds)
                ours = measure_pserver(size, args.seconds, Path(tmp))
                rows.append((size, ceiling, ours))
                print(f"  {size // MB:>4} MB: raw {ceiling:8.1f} MB/s, pserver {ours:8.1f} MB/s", file=sys.stderr, flush=True)
            raw.kill()
            local, dist, rpc_lines = mlp_step_times(args.mlp_steps, Path(tmp))
    finally:
        if raw.poll() is None:
            raw.kill()
        raw.wait()

    print(f"Dense gradients through a pserver on loopback ({os.cpu_count()} cores; MB moved per second, both directions, 2 trainers)")
    print()
    print("| param | raw gRPC (ceiling) | send → sum → sgd → recv | share of ceiling |")
    print("|---:|---:|---:|---:|")
    for size, ceiling, ours in rows:
        print(f"| {size // MB} MB | {ceiling:.0f} MB/s | {ours:.0f} MB/s | {ours / ceiling:.0%} |")
    print()
    print(f"MLP (784-256-128-10, Adam), global batch 64, {args.mlp_steps} steps")
    print()
    print("| run | ms / step |")
    print("|---|---:|")
    print(f"| local | {local:.1f} |")
    for i, ms in enumerate(dist):
        print(f"| 2 pservers x 2 trainers: trainer {i} | {ms:.1f} |")
    print()
    print("Messages each pserver handled (its exit line):")
    for line in rpc_lines:
        print(f"    {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
