"""`pstranspile calibrate`: measure this machine's rates for the cost model (`transpiler/cost.py`).

- `rpc_us`: the median wall time of a small unary gRPC call over loopback, to a gRPC
  server in another process built with the pserver's server options (a thread pool), or
  the server's CPU time per call if that is larger (from /proc: a pserver's load is its
  CPU);
- `bandwidth`: bytes per second of 8 MiB requests to that server (wall or server CPU,
  the larger), the fixed per-call time taken off;
- `op_us`: µs per element of each optimizer op (and `sum`, `scale`) run by the executor on
  float32 params of 2^20 and 2^16 elements: the slope between the two sizes, so the
  fixed cost of running an op is not counted per element (the best of `repeat` runs);
- `row_us`: µs per row of an `sgd` with a SelectedRows grad (rows of width 1).

Well under a minute on a 2-core VM. The figures go to a JSON file (`Rates.to_json`) that
`plan --rates` and `PlanPartitioner(rates=load_rates(path))` read.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from transpiler.cost import DEFAULT_OP_US, Rates

_SERVER = r"""
import sys
from concurrent import futures
import grpc
sys.path.insert(0, sys.argv[1])
from ops.rpc.service import server_options
server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=server_options())
handler = grpc.unary_unary_rpc_method_handler(lambda request, context: b"ok")
server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("calibrate.Echo", {"Call": handler}),))
port = server.add_insecure_port("127.0.0.1:0")
server.start()
print(port, flush=True)
sys.stdin.read()  # until the parent closes our stdin
server.stop(0)
"""

ROOT = Path(__file__).resolve().parents[1]


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` (Linux /proc; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def measure_transport(calls: int = 400, big_calls: int = 12, big_bytes: int = 8 << 20) -> tuple[float, float]:
    """(rpc_us, bandwidth bytes/s) over loopback to a gRPC server in a child process: per
    call the larger of the median wall time and the server's CPU time (a pserver's load is
    its CPU), per byte likewise."""
    import grpc

    child = subprocess.Popen([sys.executable, "-c", _SERVER, str(ROOT)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", -1),
                                                                  ("grpc.max_receive_message_length", -1)]) as channel:
            call = channel.unary_unary("/calibrate.Echo/Call")
            small = b"x" * 64
            for _ in range(50):
                call(small)
            times = []
            cpu0 = _cpu_seconds(child.pid)
            for _ in range(calls):
                start = time.perf_counter()
                call(small)
                times.append(time.perf_counter() - start)
            rpc = max(statistics.median(times), (_cpu_seconds(child.pid) - cpu0) / calls)
            payload = b"x" * big_bytes
            call(payload)
            cpu0 = _cpu_seconds(child.pid)
            start = time.perf_counter()
            for _ in range(big_calls):
                call(payload)
            seconds = max(time.perf_counter() - start, _cpu_seconds(child.pid) - cpu0) - big_calls * rpc
        return rpc * 1e6, big_calls * big_bytes / max(seconds, 1e-9)
    finally:
        child.stdin.close()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _optimizer_inputs(op_type: str, n: int):
    import numpy as np

    from ops.catalogue.optimizer_ops import optimizer_slots

    slots = optimizer_slots(op_type)
    rng = np.random.default_rng(0)
    inputs = {slots.param: rng.standard_normal(n).astype(np.float32),
              slots.grad: rng.standard_normal(n).astype(np.float32) * 1e-2,
              slots.learning_rate: np.array([0.01], dtype=np.float32)}
    for slot in slots.sliced:
        inputs[slot] = np.full(n, 0.5, dtype=np.float32)
    for slot in slots.unsliced:
        inputs[slot] = np.array([0.9], dtype=np.float32)
    return inputs, list(slots.outputs.values())


# Attrs Paddle gives no default for (the figures do not depend on them).
OP_ATTRS = {"momentum": {"mu": 0.9}, "lars_momentum": {"mu": 0.9, "lars_coeff": 0.001, "lars_weight_decay": 0.0005},
            "lamb": {"weight_decay": 0.01, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-6}}


def _time_op(op_type: str, inputs, outputs, attrs, repeat: int) -> float:
    from ops.testing import run_op

    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        run_op(op_type, inputs, outputs, attrs)
        best = min(best, time.perf_counter() - start)
    return best


def measure_ops(op_types=None, big: int = 1 << 20, small: int = 1 << 16, repeat: int = 3) -> dict[str, float]:
    """µs per element of each op (the slope between `small` and `big` elements)."""
    import numpy as np

    from ops.rpc.malloc import keep_freed_memory

    keep_freed_memory()  # as a pserver does: a step's buffers reuse their pages
    out: dict[str, float] = {}
    for op_type in op_types or sorted(DEFAULT_OP_US):
        try:
            if op_type == "sum":
                make = lambda n: ({"X": [np.ones(n, np.float32), np.ones(n, np.float32)]}, ["Out"], {})  # noqa: E731
            elif op_type == "scale":
                make = lambda n: ({"X": np.ones(n, np.float32)}, ["Out"], {"scale": 0.5})  # noqa: E731
            else:
                make = lambda n, t=op_type: (*_optimizer_inputs(t, n), OP_ATTRS.get(t, {}))  # noqa: E731
            timings = []
            for n in (small, big):
                inputs, outputs, attrs = make(n)
                _time_op(op_type, inputs, outputs, attrs, 2)  # warm
                timings.append(_time_op(op_type, inputs, outputs, attrs, repeat))
            out[op_type] = max(timings[1] - timings[0], 0.0) / (big - small) * 1e6
        except Exception:  # noqa: BLE001 - an op the generic inputs do not suit keeps its default rate
            continue
    return out


def measure_rows(rows: int = 1 << 15, height: int = 1 << 17, repeat: int = 3) -> float:
    """µs per row of an `sgd` whose grad is a SelectedRows of `rows` rows of width 1."""
    import numpy as np

    from ops.tensor import SelectedRows

    def once(count: int) -> float:
        ids = np.arange(count, dtype=np.int64) * (height // count)
        grad = SelectedRows(ids, np.ones((count, 1), np.float32), height)
        inputs = {"Param": np.zeros((height, 1), np.float32), "Grad": grad,
                  "LearningRate": np.array([0.1], np.float32)}
        return _time_op("sgd", inputs, ["ParamOut"], {}, repeat)

    small, big = once(rows // 16), once(rows)
    return max(big - small, 0.0) / (rows - rows // 16) * 1e6


def calibrate(progress=None) -> Rates:
    started = time.perf_counter()
    say = progress or (lambda text: None)
    say("transport: loopback gRPC")
    rpc_us, bandwidth = measure_transport()
    say(f"  {rpc_us:.0f} us per call, {bandwidth / 1e6:,.0f} MB/s")
    say("ops: us per element")
    ops = dict(DEFAULT_OP_US)
    ops.update(measure_ops())
    try:
        row_us = measure_rows()
    except Exception:  # noqa: BLE001 - keep the default
        row_us = Rates().row_us
    say(f"  {', '.join(f'{k} {v:.4f}' for k, v in sorted(ops.items()))}; row {row_us:.3f}")
    host = os.uname().nodename if hasattr(os, "uname") else "this machine"
    source = f"calibrate on {host}, {time.strftime('%Y-%m-%d')}, {time.perf_counter() - started:.0f}s"
    return Rates(bandwidth=bandwidth, rpc_us=rpc_us, op_us=ops, row_us=row_us, source=source)
