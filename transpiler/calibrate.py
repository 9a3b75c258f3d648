"""`pstranspile calibrate`: measure this machine's rates for the cost model (`transpiler/cost.py`).

Every figure is a pserver's CPU (for the real pservers, in child processes, read by the
pserver itself: `time.process_time` through a probe thread, `_CPU_PROBE`, where /proc
counts 10 ms ticks): a pserver's load is its CPU, and `benchmarks/cost_accuracy.py`
checks the model against real pservers' CPU per step. The noisy figures are medians over
blocks and repeats, each repeat's kept in `Rates.noise`.

- `op_us`: µs per element of each optimizer op (and `sum`, `scale`) run by the executor on
  float32 params of 2^20 and 2^16 elements: the slope between the two sizes, so the
  fixed cost of running an op is not counted per element (the best of `repeat` runs);
  the same in float64 for `FP64_OPS` (`op@fp64`);
- `row_us`, `merge_us`, `update_row_us`: a sync pserver's sparse optimize block run by the
  executor as the pserver runs it, the rows updated in place (`measure_sparse_block`: two
  trainers' grads summed, scaled, Adagrad; ids repeating): per merged grad row (a lookup)
  and per element of it, and per distinct row updated beside `scale` and Adagrad's rates;
- `copy_us`, `fault_us`: the same block on the async path, where the kernels copy param
  and moment whole: its excess per element copied (or `measure_copy`, every core copying
  at once, if larger), and the extra per element over the mmap threshold;
- against a real async pserver (`measure_pserver`: the CTR example's `local-table`
  program, `[16384, 64]` fp32 + Adagrad, 1 trainer, served by `serve_program`): `var_us`
  = a `SendBatch` of 8 small grads less one send, per extra var, less the block's run;
  the CPU per row of a sparse grad as a trainer sends it (a row per lookup, ids
  repeating; the slope between 512 and 8192 rows) on tables 64 and 16 floats wide: the
  slope per float, less `merge_us` and Adagrad's rate on the rows it updates, sets
  `sparse_bandwidth`; the part per row at width 0, less an id's 8 bytes, `row_us` and
  `update_row_us` on the rows updated, sets `id_us`;
- against a real sync pserver with the same program (`measure_sync_sparse`: driven a
  round at a time, the rows merged and updated in place): the CPU per grad row at widths
  64 and 16, less `merge_us` and `scale` + Adagrad's rates on the distinct rows: the
  slope per float sets `sync_sparse_bandwidth` (what a sync job's sparse bytes cost);
- against the same sync pserver, two trainers prefetching 8 and 4,096 distinct rows a
  round (`measure_prefetch`): the CPU per row prefetched sets `prefetch_bandwidth`;
- (`measure_sync_ids`, for `benchmarks/sparse_ids.py`: a real sync pserver fed given id
  sets by two prefetching trainers, CPU per round);
- against real sync pservers (`measure_dense`: `measure_interleaved_rounds` serves each
  net of fc layers, Momentum, from a pserver of its own to 2 trainer threads that replay
  their traffic with `transpiler.replay` and wait `THINK` between rounds as real trainers
  compute; the nets run a block of rounds each in turn, `DENSE_CYCLES` times, the wide
  ones on `DENSE_COPIES` pservers each): `rpc_us` per call, a trainer's
  `SendFetchBatch` (a 1-layer tiny net's round), `block_us` per partition (16 layers
  against 1), `bandwidth` (8 layers 1024 wide against 8 layers 512 wide: the bytes in and
  out they add over the CPU they add, their ops taken off; every weight 1 MB or more, so
  it travels the bulk channel, through the shared-memory rings on loopback, and is summed
  on arrival, as a real model's big grads), `big_var_us` (32 layers 256 wide against 8
  of 512: the same bytes in 4x the vars), `bulk_rpc_us` (a 1-layer net of one 256 kB
  weight: its batches on the bulk channel); `bandwidth` and `big_var_us` the median of
  the cycles' paired figures;
- `sum_on_arrival` (an op rate, `measure_arrival_add`): per element of a trainer's copy
  of a big grad added into its accumulator in 2 MB chunks, as the pserver does.

30-50 s on the shared 2-core VM (30-48 s at load average 2-6). The figures go to a JSON file
(`Rates.to_json`) that `plan --rates` and `PlanPartitioner(rates=load_rates(path))` read.
"""

from __future__ import annotations

import math
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from transpiler.cost import BIG_VAR_BYTES, DEFAULT_OP_US, ID_BYTES, SUM_ON_ARRIVAL, Job, Rates, batch_rpcs

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


# Prepended to a calibration pserver's script: a thread that answers each line on stdin with
# the process's CPU seconds (`time.process_time`: every thread's, ns resolution). /proc's
# figure is in clock ticks (10 ms): a tiny round of 1.3 ms read over 100 rounds moved by a
# tick, ±8%, and a wide net's 6 rounds of 15 ms by 11% (`bandwidth` 3.5 against 5.0 GB/s
# in two calibrations a minute apart).
_CPU_PROBE = r"""
import sys as _sys, threading as _threading, time as _time
def _answer():
    while _sys.stdin.readline():
        _sys.stdout.write(f"cpu {_time.process_time()!r}\n")
        _sys.stdout.flush()
_threading.Thread(target=_answer, daemon=True, name="cpu-probe").start()
"""


def _start_pserver(script: str, *args: Any) -> subprocess.Popen:
    """A calibration pserver running `script` with `args` in a child process, with the CPU
    probe (`_CPU_PROBE`: read by `_probe_cpu`) and one BLAS thread."""
    return subprocess.Popen([sys.executable, "-c", _CPU_PROBE + script, *map(str, args)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})


def _probe_cpu(child: subprocess.Popen) -> float:
    """CPU seconds of a calibration pserver started with `_CPU_PROBE` (stdin and stdout pipes,
    text mode): asked on its stdin, read from its stdout."""
    child.stdin.write("\n")
    child.stdin.flush()
    line = child.stdout.readline()
    if not line.startswith("cpu "):
        raise RuntimeError(f"the calibration pserver answered {line.strip()!r} for its CPU")
    return float(line.split()[1])


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


def _optimizer_inputs(op_type: str, n: int, dtype: str = "float32"):
    import numpy as np

    from ops.catalogue.optimizer_ops import optimizer_slots

    slots = optimizer_slots(op_type)
    rng = np.random.default_rng(0)
    inputs = {slots.param: rng.standard_normal(n).astype(dtype),
              slots.grad: rng.standard_normal(n).astype(dtype) * 1e-2,
              slots.learning_rate: np.array([0.01], dtype=dtype)}
    for slot in slots.sliced:
        inputs[slot] = np.full(n, 0.5, dtype=dtype)
    for slot in slots.unsliced:
        inputs[slot] = np.array([0.9], dtype=dtype)
    return inputs, list(slots.outputs.values())


# Attrs Paddle gives no default for (the figures do not depend on them).
OP_ATTRS = {"momentum": {"mu": 0.9}, "lars_momentum": {"mu": 0.9, "lars_coeff": 0.001, "lars_weight_decay": 0.0005},
            "lamb": {"weight_decay": 0.01, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-6}}


def _time_op(op_type: str, inputs, outputs, attrs, repeat: int) -> float:
    """The least CPU seconds (this process's: a pserver's load is its CPU) of `repeat` runs.
    Not the wall time: on a loaded machine a run descheduled midway measured an op at 10x
    its rate (`adam` 0.019 against 0.0016 µs per element at load average 13-18)."""
    from ops.testing import run_op

    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        run_op(op_type, inputs, outputs, attrs)
        best = min(best, time.process_time() - start)
    return best


FP64_OPS = ("sum", "scale", "sgd", "momentum", "adam", "adagrad")  # float64 rates measured too (`op@fp64`)


def measure_ops(op_types=None, big: int = 1 << 20, small: int = 1 << 16, repeat: int = 5,
                dtype: str = "float32") -> dict[str, float]:
    """µs per element of each op (the slope between `small` and `big` elements) on
    `dtype` arrays."""
    import numpy as np

    from ops.rpc.malloc import keep_freed_memory

    keep_freed_memory()  # as a pserver does: a step's buffers reuse their pages
    out: dict[str, float] = {}
    for op_type in op_types or sorted(DEFAULT_OP_US):
        try:
            if op_type == "sum":
                make = lambda n: ({"X": [np.ones(n, dtype), np.ones(n, dtype)]}, ["Out"], {})  # noqa: E731
            elif op_type == "scale":
                make = lambda n: ({"X": np.ones(n, dtype)}, ["Out"], {"scale": 0.5})  # noqa: E731
            else:
                make = lambda n, t=op_type: (*_optimizer_inputs(t, n, dtype), OP_ATTRS.get(t, {}))  # noqa: E731
            timings = []
            for n in (small, big):
                inputs, outputs, attrs = make(n)
                _time_op(op_type, inputs, outputs, attrs, 2)  # warm
                timings.append(_time_op(op_type, inputs, outputs, attrs, repeat))
            out[op_type] = max(timings[1] - timings[0], 0.0) / (big - small) * 1e6
        except Exception:  # noqa: BLE001 - an op the generic inputs do not suit keeps its default rate
            continue
    return out


def measure_arrival_add(elements: int = 1 << 22, repeat: int = 5, dtype: str = "float32") -> float:
    """µs per element a sync pserver spends adding a trainer's copy of a grad summed on
    arrival into its accumulator (`ops.rpc.server._receive_summed`): each chunk of
    `arrival_sum.CHUNK_BYTES` received into one scratch buffer, then added in place into
    its slice of an `elements`-long accumulator (16 MB in float32: beyond the caches, as a
    pserver's grads are). The best of `repeat` passes over the accumulator; the receive
    itself is the dense `bandwidth`'s."""
    import numpy as np

    from ops.rpc.arrival_sum import CHUNK_BYTES

    acc = np.ones(elements, dtype)
    chunk = max(CHUNK_BYTES // acc.itemsize, 1)
    part = np.full(chunk, 1e-3, dtype)
    best = float("inf")
    for _ in range(repeat + 1):  # the first pass warms
        start = time.process_time()
        for done in range(0, elements, chunk):
            end = min(elements, done + chunk)
            np.add(acc[done:end], part[:end - done], out=acc[done:end])
        best = min(best, time.process_time() - start)
    return best / elements * 1e6


BLOCK_WIDTH = 64  # the wider of `measure_sparse_block`'s tables: its per-row figures


def measure_sparse_block(rows: int = 250_000, counts: tuple[int, int] = (500, 4000), repeat: int = 5,
                         widths: tuple[int, int] = (16, BLOCK_WIDTH), big_rows: int | None = 300_000) -> dict[str, float]:
    """A pserver's sparse optimize block (`sum` of 2 trainers' SelectedRows grads, a row per
    lookup; `scale`; `adagrad`) on a `[rows, width]` fp32 param, run by the executor as a
    pserver runs it, CPU per step (the median of `repeat`):

    - the sync path (`update_in_place`: the rows are written into param and moment, checked
      by their buffers), 2 trainers' grads of `N` rows in all drawn from `M` distinct ids
      (every step repeats ids, as a CTR job's do: the merge scatter-adds), at `(N, M)` =
      `(2·low, low)`, `(2·high, low)`, `(2·high, high)`: per lookup (`lookup_us`: the
      merge, `row_us` + width·`merge_us` from the two widths) and per distinct row
      updated (`distinct_us`: `scale` and `adagrad` on the merged rows, `update_row_us`
      per row beside `update_elem_us` per element);
    - the async path (the kernels copy param and moment whole, checked): its excess over
      the sync path at `counts[0]`, over the `2·rows·width` elements copied, is `copy_us`;
      with the table `big_rows` rows, its arrays given fresh pages every step as arrays over
      the mmap threshold of `ops.rpc.malloc` get them (`fresh_pages_from`: the threshold
      itself, 2047 MB, is too big to measure here), the excess per element beyond it, `fault_us`."""
    import numpy as np

    from ops.executor import Executor
    from ops.rpc.malloc import fresh_pages_from, keep_freed_memory
    from ops.scope import Scope
    from ops.tensor import SelectedRows
    from transpiler.api import transpile

    examples = str(ROOT / "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    import train_ctr

    keep_freed_memory()

    def block_step(table_rows: int, width: int, sync: bool):
        main, startup = train_ctr.build_ctr("local-table", table_rows, width)
        pserver, pserver_startup = transpile(main, startup, pservers=["127.0.0.1:1"], trainers=2).pservers["127.0.0.1:1"]
        block, update = next((b.idx, o) for b in pserver.blocks for o in b.ops
                             if o.type == "adagrad" and o.inputs.get("Param") == ("emb",))
        arrays = (update.inputs["Param"][0], update.inputs["Moment"][0])
        scope, exe = Scope(), Executor(seed=0)
        exe.run(pserver_startup, scope=scope)
        rng = np.random.default_rng(0)

        def buffers() -> list[int]:
            return [scope.find_var(name).array.__array_interface__["data"][0] for name in arrays]

        def step(k: int, distinct: int) -> float:  # k lookups per trainer, `distinct` ids in all
            chosen = rng.choice(table_rows, distinct, replace=False)
            ids = np.resize(chosen, 2 * k).astype(np.int64)  # each of the `distinct` ids, in turn
            for t in range(2):
                scope.set_var(f"emb@GRAD.trainer_{t}",
                              SelectedRows(ids[t::2].copy(), np.full((k, width), 1e-4, np.float32), table_rows))
            before = buffers()
            start = time.process_time()
            exe.run(pserver, scope=scope, block_id=block, update_in_place=sync, concurrent_readers=True)
            spent = time.process_time() - start
            if (buffers() == before) != sync:
                raise RuntimeError(f"calibrate: the sparse adagrad block {'copied' if sync else 'did not copy'} "
                                   f"its param on the {'sync' if sync else 'async'} path")
            return spent

        def median(k: int, distinct: int) -> float:
            step(k, distinct)
            return statistics.median(step(k, distinct) for _ in range(repeat)) * 1e6

        return median

    lookup, update, base = [], [], 0.0
    low, high = counts
    for width in widths:
        median = block_step(rows, width, True)
        few, many, wide = median(low, low), median(high, low), median(high, high)
        lookup.append((many - few) / (2 * (high - low)))
        update.append((wide - many) / (high - low))
        base = few
    merge_elem = (lookup[1] - lookup[0]) / (widths[1] - widths[0])
    update_elem = (update[1] - update[0]) / (widths[1] - widths[0])
    copies = 2 * rows * widths[1]
    copy_us = max(block_step(rows, widths[1], False)(low, low) - base, 0.0) / copies
    fault_us = 0.0
    if big_rows:  # arrays over the mmap threshold: each step's copies are fresh pages
        with fresh_pages_from(big_rows * widths[1] * 4) as fresh:
            if fresh:  # else every copy reuses kept pages here, and the excess is not measurable
                extra = (block_step(big_rows, widths[1], False)(low, low)
                         - block_step(big_rows, widths[1], True)(low, low))
                fault_us = max(extra / (2 * big_rows * widths[1]) - copy_us, 0.0)
    return {"row_us": max(lookup[1] - widths[1] * merge_elem, 0.0), "merge_elem_us": max(merge_elem, 0.0),
            "update_elem_us": max(update_elem, 0.0), "update_row_us": max(update[1] - widths[1] * update_elem, 0.0),
            "lookup_us": lookup[1], "distinct_us": update[1], "copy_us": copy_us, "fault_us": fault_us}


_PSERVER = r"""
import sys
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/examples")
import train_ctr
from ops.rpc.serve import serve_program
from transpiler.api import transpile
from transpiler.runtime.launch import free_endpoints
main, startup = train_ctr.build_ctr("local-table", int(sys.argv[2]), int(sys.argv[3]))
endpoint = free_endpoints(1)[0]
sync = len(sys.argv) > 4 and sys.argv[4] == "sync"
trainers = int(sys.argv[5]) if len(sys.argv) > 5 else 1
pserver, pserver_startup = transpile(main, startup, pservers=[endpoint], trainers=trainers, sync_mode=sync).pservers[endpoint]
serve_program(pserver, pserver_startup, ready=lambda server: print(endpoint, flush=True), log=None, timeout=600.0)
"""

# rows: 2x the most ids a grad draws from; small, so the async pserver's whole-table copies
# (a fixed cost per send) stay a small part of the CPU whose slope per row is measured
PSERVER_ROWS, PSERVER_WIDTH = 16_384, 64
SYNC_TRAINERS = 2  # the trainers of the sync measurements


def measure_pserver(rpc_us: float, bandwidth: float, adagrad_us: float, row_us: float, calls: int = 400,
                    id_counts: tuple[int, int] = (512, 8192), repeat: int = 30, width: int = PSERVER_WIDTH
                    ) -> dict[str, float]:
    """`rpc_us`, `var_us`, `block_us`, `id_us` from a real pserver's CPU per call (module
    docstring), its table `width` floats wide; `row_cpu_us` the measured CPU per grad row."""
    import numpy as np

    from ops.rpc.client import RpcClient
    from ops.tensor import SelectedRows

    child = _start_pserver(_PSERVER, ROOT, PSERVER_ROWS, width)
    client = None
    try:
        endpoint = child.stdout.readline().strip()
        if not endpoint:
            raise RuntimeError("the calibration pserver did not start")
        client = RpcClient(0, timeout=120.0)

        def cpu_per_call(call, count: int) -> float:
            for _ in range(max(3, count // 10)):
                call()
            cpu0 = _probe_cpu(child)
            for _ in range(count):
                call()
            return (_probe_cpu(child) - cpu0) / count * 1e6

        get_us = cpu_per_call(lambda: client.get(endpoint, "learning_rate_0"), calls)
        small = np.full(2, 1e-3, np.float32)
        send_us = cpu_per_call(lambda: client.send(endpoint, "ctr_out.b@GRAD", small), calls)

        def send_batch() -> None:  # 8 small grads in one SendBatch
            for _ in range(8):
                client.send_async(endpoint, "ctr_out.b@GRAD", small)
            client.flush()
            client.wait_pending()

        batch_us = cpu_per_call(send_batch, calls // 4)
        rng = np.random.default_rng(0)
        figures = []
        for k in id_counts:  # a lookup's grad as a trainer sends it: a row per lookup, ids repeating
            ids = rng.integers(0, 2 * k, size=k).astype(np.int64) * (PSERVER_ROWS // (2 * k))
            grad = SelectedRows(ids, np.full((k, width), 1e-4, np.float32), PSERVER_ROWS)
            figures.append(cpu_per_call(lambda grad=grad: client.send(endpoint, "emb@GRAD", grad), repeat))
        slope = (figures[1] - figures[0]) / (id_counts[1] - id_counts[0])
        wire = (ID_BYTES + width * 4) / bandwidth * 1e6
        work = width * adagrad_us + row_us
        # the update's fixed part beyond a small dense send: adagrad copying param and moment
        client.complete([endpoint])
        child.wait(timeout=60)
        if os.environ.get("PSTRANSPILE_CALIBRATE_DEBUG"):
            print(f"pserver cpu us per call: get {get_us:.0f}, small send {send_us:.0f}, 8 in a batch {batch_us:.0f}, "
                  f"sparse grads "
                  f"{figures} (slope {slope:.3f}/row, wire {wire:.3f}, op {work:.3f})", file=sys.stderr)
        block_us = max(send_us - get_us, 0.0)
        var_us = max((batch_us - send_us) / 7 - block_us, 0.0)
        return {"rpc_us": max(get_us - var_us, 0.0), "var_us": var_us, "block_us": block_us,
                "id_us": max(slope - wire - work, 0.0), "row_cpu_us": slope}
    finally:
        _stop(child, [client] if client is not None else [])


def _sync_table_rounds(width: int, table_rows: int, trainers: int, sets, rounds: int, blocks: int,
                       think: float = 0.0) -> list[float]:
    """A real **sync** pserver of the CTR example's `local-table` program (`[table_rows,
    width]` fp32 + Adagrad, `trainers` trainers) in a child process, driven a round at a
    time as trainers drive it: a thread per trainer, each round (a prefetch of its rows
    when given,) its 4 small dense grads and `emb@GRAD` under its own per-trainer names,
    the send barrier, a param fetched behind the fetch barrier, then `think` seconds. For
    each entry of `sets` (per trainer a list of `(rows to prefetch or None, emb@GRAD)`
    that the rounds take in turn) the pserver's CPU µs per round (/proc, the median of
    `blocks` blocks of `rounds`)."""
    import numpy as np

    from ops.rpc.client import RpcClient

    dense = {"ctr_fc.b@GRAD": (32,), "ctr_fc.w@GRAD": (3 * width, 32), "ctr_out.b@GRAD": (2,),
             "ctr_out.w@GRAD": (32, 2)}  # the CTR net: 3 lookups concatenated, fc 32, fc 2
    child = _start_pserver(_PSERVER, ROOT, table_rows, width, "sync", trainers)
    clients: list[Any] = []
    try:
        endpoint = child.stdout.readline().strip()
        if not endpoint:
            raise RuntimeError("the calibration sync pserver did not start")
        clients = [RpcClient(t, timeout=60.0) for t in range(trainers)]
        grads = {name: np.full(shape, 1e-4, np.float32) for name, shape in dense.items()}
        suffix = [f".trainer_{t}" if trainers > 1 else "" for t in range(trainers)]  # a sync pserver's per-trainer grads
        figures = []
        for n, per_trainer in enumerate(sets):

            def trainer(t: int, count: int) -> None:
                if count < 0:  # the startup's fetch barrier
                    clients[t].fetch_barrier([endpoint], [(endpoint, "ctr_out.b")])
                mine = per_trainer[t]
                for r in range(count):
                    wanted, sparse = mine[r % len(mine)]
                    if wanted is not None:
                        clients[t].prefetch(endpoint, "emb", wanted)
                    for name, value in grads.items():
                        clients[t].send_async(endpoint, name + suffix[t], value)
                    clients[t].send_async(endpoint, "emb@GRAD" + suffix[t], sparse)
                    clients[t].send_barrier([endpoint], defer=True)
                    clients[t].fetch_barrier([endpoint], [(endpoint, "ctr_out.b")])
                    if think:
                        time.sleep(think)

            def run(count: int) -> None:
                _each_trainer(trainers, lambda t: trainer(t, count))

            if n == 0:
                run(-1)
            run(5)
            spent = []
            for _ in range(blocks):
                cpu0 = _probe_cpu(child)
                run(rounds)
                spent.append((_probe_cpu(child) - cpu0) / rounds * 1e6)
            figures.append(statistics.median(spent))
        for client in clients:
            client.complete([endpoint])
        child.wait(timeout=60)
        return figures
    finally:
        _stop(child, clients)


def measure_sync_sparse(merge_us: float, update_us: float, id_counts: tuple[int, int] = (512, 8192),
                        widths: tuple[int, int] = (PSERVER_WIDTH // 4, PSERVER_WIDTH), rounds: int = 36,
                        trainers: int = 1, blocks: int = 5) -> dict[str, float]:
    """A real **sync** pserver (the CTR example's `local-table` program, `[16384, w]` fp32 +
    Adagrad, `trainers` trainers: the rows merged and updated in place) in a child process,
    driven a round at a time as trainers drive it (a thread per trainer: its 4 small dense
    grads and `emb@GRAD`, a row per lookup from `2k` ids, in one batch; the send barrier; a
    param fetched behind the fetch barrier): its CPU per round (the median of `blocks`
    blocks of `rounds`: 5 of 36, where 3 of 60 read 365-807 MB/s in six calibrations) at
    `k` rows per trainer (`id_counts`) on tables `widths` floats wide, less the merge
    (`merge_us` per element of every grad row) and the update (`update_us` per element of
    every distinct row, counted). The slope of the rest per
    grad row, per float between the widths, is the pserver's CPU per float of a sparse
    row's bytes (`wire_us`); `row_cpu_us` the measured CPU per grad row on the wider table."""
    import numpy as np

    from ops.tensor import SelectedRows

    rest, raw = [], []
    for width in widths:
        rng = np.random.default_rng(0)
        sets, distinct = [], []
        for k in id_counts:
            ids = [rng.integers(0, 2 * k, size=k).astype(np.int64) * (PSERVER_ROWS // (2 * k))
                   for _ in range(trainers)]
            sets.append([[(None, SelectedRows(i, np.full((k, width), 1e-4, np.float32), PSERVER_ROWS))] for i in ids])
            distinct.append(len(np.unique(np.concatenate(ids))))
        figures = _sync_table_rounds(width, PSERVER_ROWS, trainers, sets, rounds, blocks=blocks)
        adjusted = [f - trainers * k * width * merge_us - d * width * update_us
                    for f, k, d in zip(figures, id_counts, distinct, strict=True)]
        rows = trainers * (id_counts[1] - id_counts[0])
        raw.append((figures[1] - figures[0]) / rows)
        rest.append((adjusted[1] - adjusted[0]) / rows)
    per_float = (rest[1] - rest[0]) / (widths[1] - widths[0])
    if os.environ.get("PSTRANSPILE_CALIBRATE_DEBUG"):
        print(f"sync pserver cpu us per grad row {raw} at widths {widths}, beyond merge and update {rest}: "
              f"{per_float:.5f} per float", file=sys.stderr)
    return {"wire_us": max(per_float, 0.0), "row_cpu_us": raw[1]}


PREFETCH_COUNTS = (8, 4096)  # `measure_prefetch`: rows a trainer prefetches a round, few and many


def measure_prefetch(width: int = PSERVER_WIDTH, counts: tuple[int, int] = PREFETCH_COUNTS, rounds: int = 24,
                     repeats: int = 9, trainers: int = SYNC_TRAINERS, think: float = 0.0) -> dict[str, Any]:
    """A real **sync** pserver (the CTR `local-table` program, `[16384, width]` fp32 +
    Adagrad) driven as `trainers` prefetching trainers drive it (`_sync_table_rounds`: each
    round a prefetch, the small dense grads and an 8-row `emb@GRAD`, the barriers), each
    trainer prefetching `counts[0]` distinct rows a round, then `counts[1]`, then none,
    `repeats` times over (interleaved: a drift of the machine's load falls on all three):
    its CPU per prefetched row beyond the few (`row_us`: the ids in, the gather and the rows
    out; the median of the repeats, `row_us_each` each one's) and per prefetch call
    (`call_us`: the few against none, the model's `prefetch_rpc_us`; `call_us_each` each
    repeat's: 9 repeats of 24 rounds, where 5 of 30 read 200-806 µs a call within one
    calibration and medians of 355-713 in six). `prefetch_bandwidth` = the
    bytes of a row (`ID_BYTES` + `width` floats) over `row_us`, None when the median is
    not above 0 (the machine's noise swamped the rows: the caller keeps another rate)."""
    import numpy as np

    from ops.tensor import SelectedRows

    rng = np.random.default_rng(0)

    def distinct(k: int):
        return np.sort(rng.choice(PSERVER_ROWS, k, replace=False)).astype(np.int64)

    sets = []
    for _ in range(repeats):
        for count in (counts[0], counts[1], None):
            per_trainer = []
            for _ in range(trainers):
                grad = distinct(8)
                per_trainer.append([(distinct(count) if count else None,
                                     SelectedRows(grad, np.full((len(grad), width), 1e-4, np.float32), PSERVER_ROWS))])
            sets.append(per_trainer)
    figures = _sync_table_rounds(width, PSERVER_ROWS, trainers, sets, rounds, 1, think)
    rows = [(figures[i + 1] - figures[i]) / (trainers * (counts[1] - counts[0])) for i in range(0, len(figures), 3)]
    calls = [(figures[i] - figures[i + 2]) / trainers for i in range(0, len(figures), 3)]
    row_us = statistics.median(rows)
    return {"row_us": row_us, "call_us": statistics.median(calls), "row_us_each": rows, "call_us_each": calls,
            "prefetch_bandwidth": (ID_BYTES + width * 4) / row_us * 1e6 if row_us > 0 else None}


def measure_sync_ids(id_sets, width: int = PSERVER_WIDTH, table_rows: int = PSERVER_ROWS, rounds: int = 40,
                     blocks: int = 3, think: float = 0.0) -> list[float]:
    """A real **sync** pserver (the CTR `local-table` program, `[table_rows, width]` fp32 +
    Adagrad) in a child process, served to `len(id_sets[0])` trainer threads that each
    round, as a prefetching trainer does: prefetch the rows of their ids' distinct values,
    send the 4 small dense grads and `emb@GRAD` (a grad row per id as given: pass the ids
    merged, `np.unique`, for a trainer that merges its grad), the send barrier, a param
    fetched behind the fetch barrier. For each entry of `id_sets` (per trainer an int64 id
    array, or a list of them that the rounds take in turn) the pserver's CPU µs per round
    (/proc, the median of `blocks` blocks of `rounds`). Not part of `calibrate`:
    `benchmarks/sparse_ids.py` fits per grad row and per distinct row with it, Zipf and
    uniform ids alike."""
    import numpy as np

    from ops.tensor import SelectedRows

    sets = []
    for draws in id_sets:
        # per trainer a list of draws (a round takes the next), or one array for every round
        draws = [[d] if np.ndim(d[0]) == 0 else list(d) for d in draws]
        sets.append([[(np.unique(i), SelectedRows(np.asarray(i, np.int64),
                                                  np.full((len(i), width), 1e-4, np.float32), table_rows))
                      for i in mine] for mine in draws])
    return _sync_table_rounds(width, table_rows, len(id_sets[0]), sets, rounds, blocks, think)


_COPIER = r"""
import sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
from ops.rpc.malloc import keep_freed_memory
keep_freed_memory()
n, rounds = int(sys.argv[2]), int(sys.argv[3])
param, moment = np.ones(n, np.float32), np.ones(n, np.float32)
for _ in range(2):
    a, b = param.copy(), moment.copy()
sys.stdout.write("ready\n"); sys.stdout.flush()
sys.stdin.readline()
start = time.process_time()
for _ in range(rounds):
    a, b = param.copy(), moment.copy()
print((time.process_time() - start) / (rounds * 2 * n) * 1e6, flush=True)
"""


def measure_copy(processes: int | None = None, elements: int = 1 << 22, rounds: int = 10) -> float:
    """µs of CPU per float32 element a sparse Adagrad copies (param and moment: two arrays of
    `elements` float32, under the mmap threshold, beyond the caches), with `processes`
    (default: every core) copying at once, the median: a job's pservers share the memory
    bus, and a copy alone was up to 30% cheaper than with the other core copying too
    (0.00035 against 0.00046-0.00050 in one measurement on the shared 2-core VM, alike in
    others)."""
    count = processes or os.cpu_count() or 1
    children = [subprocess.Popen([sys.executable, "-c", _COPIER, str(ROOT), str(elements), str(rounds)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(count)]
    try:
        for child in children:
            if child.stdout.readline().strip() != "ready":
                raise RuntimeError("a calibration copier did not start")
        for child in children:  # start together
            child.stdin.write("go\n")
            child.stdin.flush()
        figures = [float(child.stdout.readline()) for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
            child.wait()
    return statistics.median(figures)


_SYNC_PSERVER = r"""
import sys
sys.path.insert(0, sys.argv[1])
from ops.rpc.serve import serve_program
from transpiler.ir import Program
lines = []  # its log, printed once it has served (stdout answers the CPU probe meanwhile)
serve_program(Program.load(sys.argv[2]), Program.load(sys.argv[3]), endpoint=sys.argv[4],
              ready=lambda server: print("ready", flush=True), log=lines.append, timeout=600.0)
print("".join(f"log {line}\n" for line in lines), end="", flush=True)
"""

# what a calibration pserver logs when its trainers complete: the payloads its shared-memory
# rings carried (`ops.rpc.server`; none: no ring, every payload over TCP or gRPC)
_RING_LOG = re.compile(r"shared-memory ring, (\d+) slot\(s\) handed over")


def ring_slots(log: Sequence[str]) -> int:
    """The ring slots a pserver handed over, from its log (`_RING_LOG`); 0 without a ring."""
    return sum(int(m.group(1)) for line in log for m in [_RING_LOG.search(line)] if m)



def dense_programs(layers_count: int, width: int, in_width: int):
    """A stack of `layers_count` fc layers (`in_width` -> `width` -> ... -> `width`, each a
    weight and a bias), Momentum: `2 · layers_count` dense params."""
    from transpiler.frontend import ParamAttr, Program, layers, optimizer, program_guard, unique_name

    main, startup = Program(), Program()
    with unique_name.guard(), program_guard(main, startup):
        hidden = layers.data(name="x", shape=[in_width], dtype="float32")
        for i in range(layers_count):
            hidden = layers.fc(input=hidden, size=width, param_attr=ParamAttr(name=f"cal{i}.w"),
                               bias_attr=ParamAttr(name=f"cal{i}.b"))
        optimizer.Momentum(learning_rate=0.01, momentum=0.9).minimize(layers.mean(hidden))
    return main, startup


def measure_sync_round(main, startup, steps: int, warm: int = 3, trainers: int = SYNC_TRAINERS,
                       think: float = 0.0, blocks: int = 1) -> float:
    """A real sync pserver's CPU µs per step (one round) serving `main`'s params to
    `trainers` trainers replaying their traffic: the median of `measure_sync_rounds`'
    `blocks` blocks."""
    return statistics.median(measure_sync_rounds(main, startup, steps, warm, trainers, think, blocks))


def measure_sync_rounds(main, startup, steps: int, warm: int = 3, trainers: int = SYNC_TRAINERS,
                        think: float = 0.0, blocks: int = 1) -> list[float]:
    """A real sync pserver's CPU µs per step (one round) serving `main`'s params to
    `trainers` trainers replaying their traffic (`transpiler.replay`, a thread each), the
    pserver in a child process, its CPU (`_CPU_PROBE`) read after `warm` steps and every
    `steps // blocks` steps after: a figure per block of `steps // blocks` rounds."""
    import tempfile

    from ops.rpc.client import RpcClient
    from transpiler.api import transpile
    from transpiler.replay import replay
    from transpiler.runtime.launch import free_endpoints

    per_block = max(steps // max(blocks, 1), 1)
    marked = {warm + k * per_block for k in range(max(blocks, 1) + 1)}
    endpoint = free_endpoints(1)[0]
    programs = [transpile(main, startup, pservers=[endpoint], trainers=trainers, trainer_id=t, sync_mode=True)
                for t in range(trainers)]
    pserver, pserver_startup = programs[0].pservers[endpoint]
    with tempfile.TemporaryDirectory() as tmp:
        Path(f"{tmp}/main.pb").write_bytes(pserver.to_bytes())
        Path(f"{tmp}/startup.pb").write_bytes(pserver_startup.to_bytes())
        child = _start_pserver(_SYNC_PSERVER, ROOT, f"{tmp}/main.pb", f"{tmp}/startup.pb", endpoint)
        clients = []
        try:
            if child.stdout.readline().strip() != "ready":
                raise RuntimeError("the calibration pserver did not start")
            marks: dict[int, float] = {}

            def mark(step: int) -> None:
                if step in marked:
                    marks[step] = _probe_cpu(child)
                if think:
                    time.sleep(think)

            def pause(step: int) -> None:
                time.sleep(think)

            def run(t: int) -> None:
                replay(clients[t], programs[t].trainer, programs[t].trainer_startup, max(marked),
                       mark if t == 0 else (pause if think else None))

            clients = [RpcClient(t, timeout=120.0) for t in range(trainers)]
            _each_trainer(trainers, run)
            child.wait(timeout=60)
        finally:
            _stop(child, clients)
    at = sorted(marked)
    return [(marks[b] - marks[a]) / per_block * 1e6 for a, b in zip(at, at[1:])]


def measure_interleaved_rounds(nets: Sequence[tuple[Any, Any, int]], cycles: int, warm: int = 3,
                               trainers: int = SYNC_TRAINERS, think: float = 0.0, settle: int = 1,
                               timeout: float = 180.0, logs: list[list[str]] | None = None) -> list[list[float]]:
    """Real sync pservers, one per net of `nets` (`(main, startup, rounds)`: its programs and
    the rounds of a block), all started at once and served to `trainers` trainer threads
    each that replay their traffic (`transpiler.replay`), run a block at a time in turn:
    net 0's block, net 1's, ..., `cycles` times over. Each block is `settle` rounds (a
    pserver woken after the others' blocks; not counted) and then `rounds` rounds whose
    CPU (`_CPU_PROBE`) is read. Returns per net its CPU µs per round of each cycle's block;
    `logs`, when given, gets each pserver's log (what channel its payloads took: `ring_slots`).

    Interleaved so that a drift of the machine's load falls on every net alike: the
    figures `measure_dense` takes differences of come from blocks run seconds apart, not
    from pservers run one after another (a pair of nets measured back to back read 3.5
    and 6.9 GB/s in one calibration, `big_var_us` 72 and 112)."""
    import tempfile

    from ops.rpc.client import RpcClient
    from transpiler.api import transpile
    from transpiler.replay import replay
    from transpiler.runtime.launch import free_endpoints

    if cycles < 1 or not nets:
        raise ValueError("measure_interleaved_rounds: at least one net and one cycle")
    endpoints = free_endpoints(len(nets))
    children: list[subprocess.Popen] = []
    clients: list[list[Any]] = []
    gates = [(threading.Barrier(trainers + 1, timeout=timeout), threading.Barrier(trainers + 1, timeout=timeout))
             for _ in nets]
    marks: list[dict[int, float]] = [{} for _ in nets]

    def schedule(rounds: int) -> tuple[set[int], set[int], int]:
        """(the steps after which a net's trainers wait for its turn, those after which its
        pserver's CPU is read, its steps in all)."""
        gates_at = {warm + k * (settle + rounds) for k in range(cycles + 1)}
        reads = {g + settle for g in gates_at if g < max(gates_at)} | (gates_at - {warm})
        return gates_at, reads, max(gates_at)

    with tempfile.TemporaryDirectory() as tmp:
        programs = []
        try:
            for i, ((main, startup, _), endpoint) in enumerate(zip(nets, endpoints, strict=True)):
                mine = [transpile(main, startup, pservers=[endpoint], trainers=trainers, trainer_id=t, sync_mode=True)
                        for t in range(trainers)]
                programs.append(mine)
                pserver, pserver_startup = mine[0].pservers[endpoint]
                Path(f"{tmp}/main{i}.pb").write_bytes(pserver.to_bytes())
                Path(f"{tmp}/startup{i}.pb").write_bytes(pserver_startup.to_bytes())
                children.append(_start_pserver(_SYNC_PSERVER, ROOT, f"{tmp}/main{i}.pb", f"{tmp}/startup{i}.pb",
                                               endpoint))
            for child in children:
                if child.stdout.readline().strip() != "ready":
                    raise RuntimeError("a calibration pserver did not start")

            def trainer(n: int, t: int) -> None:
                main, startup, rounds = nets[n]
                gates_at, reads, steps = schedule(rounds)
                arrive, go = gates[n]

                def on_step(step: int) -> None:
                    if t == 0 and step in reads:
                        marks[n][step] = _probe_cpu(children[n])
                    if think:
                        time.sleep(think)
                    if step in gates_at:
                        arrive.wait()
                        go.wait()

                replay(clients[n][t], programs[n][t].trainer, programs[n][t].trainer_startup, steps, on_step)

            clients = [[RpcClient(t, timeout=120.0) for t in range(trainers)] for _ in nets]
            errors: list[BaseException] = []

            def guarded(n: int, t: int) -> None:
                try:
                    trainer(n, t)
                except BaseException as exc:  # noqa: BLE001 - raised below, in the caller's thread
                    errors.append(exc)
                    for barrier in gates[n]:
                        barrier.abort()

            threads = [threading.Thread(target=guarded, args=(n, t), daemon=True)
                       for n in range(len(nets)) for t in range(trainers)]
            for thread in threads:
                thread.start()
            try:
                for arrive, _ in gates:  # every net warmed, waiting at its first gate
                    arrive.wait()
                for _ in range(cycles):
                    for arrive, go in gates:  # one block of each net in turn
                        go.wait()
                        arrive.wait()
                for _, go in gates:  # the trainers complete
                    go.wait()
            except threading.BrokenBarrierError:
                for pair in gates:
                    for barrier in pair:
                        barrier.abort()
                for thread in threads:
                    thread.join(timeout=30)
                raise errors[0] if errors else RuntimeError("calibrate: an interleaved net's trainers timed out")
            for thread in threads:
                thread.join()
            if errors:
                raise errors[0]
            for child in children:
                child.wait(timeout=60)
                told = [line[4:].rstrip("\n") for line in child.stdout.read().splitlines() if line.startswith("log ")]
                if logs is not None:
                    logs.append(told)
        finally:
            for n, child in enumerate(children):
                _stop(child, clients[n] if n < len(clients) else [])
    out = []
    for n, (_, _, rounds) in enumerate(nets):
        gates_at, _, _ = schedule(rounds)
        starts = sorted(g + settle for g in gates_at if g < max(gates_at))
        out.append([(marks[n][s + rounds] - marks[n][s]) / rounds * 1e6 for s in starts])
    return out


def _each_trainer(trainers: int, work: Callable[[int], None]) -> None:
    """`work(t)` for every trainer t at once, one thread each; the first error raised."""
    errors: list[BaseException] = []

    def guarded(t: int) -> None:
        try:
            work(t)
        except BaseException as exc:  # noqa: BLE001 - raised below, in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(t,)) for t in range(trainers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def _stop(child: subprocess.Popen, clients: Sequence[Any]) -> None:
    """Close a measurement's clients and kill its pserver child if it is still running."""
    for client in clients:
        client.close()
    if child.stdin is not None:
        child.stdin.close()
    if child.poll() is None:
        child.kill()
        child.wait()


THINK = 0.01  # seconds a replaying trainer waits between rounds, as a trainer computing its passes


DENSE_LAYERS = 8  # `measure_dense`'s two wide nets: this many fc layers each
DENSE_WIDTHS = (512, 1024)  # their widths: every weight (1 MB, 4 MB) summed on arrival, on the bulk channel
BULK_WIDTH = 256  # `measure_dense`'s bulk net: one 256 x 256 layer, a 256 kB weight (`BULK_MIN`)
DENSE_CYCLES = 8  # `measure_dense`'s nets run a block each in turn this many times (and once more to warm)
# the rounds of a block, per net: the tiny one, the many-layer tiny one, the bulk one, the
# narrow and the wide net, the many-vars net (the last three: 0.1-0.2 s of the pserver's CPU a block; the
# bulk net's `bulk_rpc_us` read 290-789 µs across one calibration's 8 blocks of 12)
DENSE_ROUNDS = (16, 6, 20, 4, 2, 4)  # (a wide net's: per copy)
DENSE_COPIES = 2  # pservers of each wide net


def measure_dense(ops: dict[str, float], var_us: float, trainers: int = SYNC_TRAINERS, cycles: int = DENSE_CYCLES,
                  rounds: Sequence[int] = DENSE_ROUNDS, many: int = 16, think: float = THINK,
                  layers: int = DENSE_LAYERS, widths: tuple[int, int] = DENSE_WIDTHS,
                  copies: int = DENSE_COPIES) -> dict[str, Any]:
    """A real sync pserver per net (`copies` of each wide one), `trainers` trainers each,
    the six nets run a block at a time in turn, `cycles` times over after a warm one
    (`measure_interleaved_rounds`; blocks of `rounds` rounds, net by net): `rpc_us` = a
    trainer's share of one round of a 1-layer tiny net (its 2 partitions' blocks and vars
    taken off: each trainer sends one `SendFetchBatch`, `cost.batch_rpcs`), `block_us` =
    the extra CPU per partition of a `many`-layer tiny net (its `2·trainers` vars taken
    off), both from the nets' median block; `bandwidth` = the
    slope between two nets of `layers` fc layers `widths[0]` and `widths[1]` wide (the
    same partitions, so their blocks and RPCs cancel): the bytes the wider one adds (in and
    out, every trainer) over the CPU it adds, less its ops at the `ops` rates (`scale`,
    `momentum`, and the sums: a weight summed on arrival at `sum_on_arrival`, a bias by the
    `sum` op); `big_var_us` = per big var a trainer sends or fetches on the bulk channel,
    from a third net, `4·layers` layers `widths[0] / 2` wide (the narrow net's weight bytes
    in 4x the vars, each still summed on arrival), less its extra partitions at
    `per_partition` (ResNet-50's 29 big vars a pserver cost it 5.5 ms a step that neither
    the bytes nor the blocks priced); `bulk_rpc_us` from a 1-layer net of one 256 kB
    weight, whose batches travel the bulk channel. `bandwidth` and `big_var_us` are the
    median over the cycles of each cycle's figure (its nets' blocks seconds apart, under
    the same load; `bandwidths`, `big_var_us_each` each cycle's): a pair of nets run one
    after the other read 3.5 and 6.9 GB/s, `big_var_us` 72 and 112, in one calibration.

    Every weight of the three wide nets is a grad of 256 kB or more, taken as a real
    model's big grads are: on the bulk channel (through the shared-memory ring on
    loopback, `PSTRANSPILE_BULK_SHM=auto`, as the job's), summed on arrival (one wide
    layer instead, whose ops run out of cache at 2-5x their measured rate, priced the bytes
    at half their speed). The trainers wait `think` seconds between rounds, as real ones
    compute theirs: a pserver woken from idle each round spends ~1.5x the CPU per round of
    one kept busy; each block starts with a round not counted (the pserver woken after the
    other nets' blocks)."""
    from transpiler.cost import ARRIVAL_SUM_BYTES

    if (min(widths) // 2) ** 2 * 4 < ARRIVAL_SUM_BYTES:
        raise ValueError(f"measure_dense: widths {widths} give weights below the {ARRIVAL_SUM_BYTES} bytes summed on arrival")
    # the nets: a tiny one, `many` tiny layers, one 256 kB weight (the bulk channel), then
    # `layers` fc layers at each width and 4x as many half as wide (the narrow net's weight
    # bytes in 4x the vars)
    shapes = [(1, 4), (many, 4), (1, BULK_WIDTH), *((layers, width) for width in widths), (4 * layers, widths[0] // 2)]
    if len(rounds) != len(shapes):
        raise ValueError(f"measure_dense: {len(rounds)} block lengths for {len(shapes)} nets")
    # run in this order: the narrow net's block next to both nets it is compared with; the
    # three wide nets `copies` times, each copy its own pserver (two pservers of one wide
    # net, run in turn, read 46 and 59 ms a round: a process's own luck), a cycle's figure
    # their mean
    order = (0, 1, 2, *(4, 3, 5) * copies)
    logs: list[list[str]] = []
    runs = measure_interleaved_rounds([(*dense_programs(shapes[i][0], shapes[i][1], shapes[i][1]), rounds[i])
                                       for i in order],
                                      cycles + 1, trainers=trainers, think=think, logs=logs)
    # the payloads each net's shared-memory rings carried, in `shapes` order (a job's big
    # vars take the rings on loopback, `PSTRANSPILE_BULK_SHM=auto`: so must these)
    slots = [sum(ring_slots(log) for log, i in zip(logs, order, strict=True) if i == n) if logs else 0
             for n in range(len(shapes))]
    # (the first cycle warms: a wide net's first block read 74 ms a round, the next 35-44)
    per_net = [[statistics.fmean(f) for f in zip(*(figures[1:] for figures, i in zip(runs, order, strict=True)
                                                   if i == n), strict=True)] for n in range(len(shapes))]
    tiny_runs, wide_runs, bulk_runs, narrow, broad, manys = per_net
    # the fixed costs from each net's median block (a pserver woken at the wrong moment
    # read one tiny round 2,200 µs and the next 3,800)
    tiny = statistics.median(tiny_runs)
    wide = statistics.median(wide_runs)
    per_partition = max((wide - tiny) / (2 * (many - 1)), 0.0)
    block_us = max(per_partition - 2 * trainers * var_us, 0.0)
    # each trainer's one SendFetchBatch a round (`cost.batch_rpcs`), beside the 2 partitions' blocks
    calls = batch_rpcs(Job(trainers, True))
    rpc_us = max((tiny - 2 * per_partition) / calls, 0.0)
    tiny_each = [max((f - 2 * per_partition) / calls, 0.0) for f in tiny_runs]
    nets = shapes[3:]
    work, moved = [], []
    for count, width in nets:
        weights, biases = count * width * width, count * width
        work.append((weights + biases) * (ops["scale"] + ops["momentum"])
                    + (trainers - 1) * (weights * ops[SUM_ON_ARRIVAL] + biases * ops["sum"]))
        moved.append(2 * trainers * (weights + biases) * 4)
    slopes = [dense_slope(moved[1] - moved[0], b - n, work[1] - work[0]) for n, b in zip(narrow, broad, strict=True)]
    bandwidth = statistics.median(slopes)
    # the many-vars net against the narrow one in the same cycle: its extra partitions (a
    # weight and a bias each) at `per_partition`, its few extra bytes (the biases) and ops
    # at their rates; the rest per big var a trainer sends (its grad) or fetches (its
    # param) on the bulk channel
    extra_parts = 2 * (nets[2][0] - nets[0][0])
    transfers = (nets[2][0] - nets[0][0]) * 2 * trainers
    known = extra_parts * per_partition + (work[2] - work[0]) + (moved[2] - moved[0]) / bandwidth * 1e6
    bulk_each = [max((m - n - known) / transfers, 0.0) for m, n in zip(manys, narrow, strict=True)]
    big_var_us = statistics.median(bulk_each)
    # the bulk net's round: its 2 partitions' blocks, its weight's bytes, big-var cost and
    # ops (and the bias's) at the rates just measured; the rest per trainer's call
    weights, biases = BULK_WIDTH * BULK_WIDTH, BULK_WIDTH
    bulk_known = (2 * per_partition + (weights + biases) * (ops["scale"] + ops["momentum"])
                  + (trainers - 1) * (weights * ops[SUM_ON_ARRIVAL] + biases * ops["sum"])
                  + 2 * trainers * (weights + biases) * 4 / bandwidth * 1e6
                  + 2 * trainers * (min(1.0, weights * 4 / BIG_VAR_BYTES) + min(1.0, biases * 4 / BIG_VAR_BYTES))
                  * big_var_us)
    bulk_rpc_each = [max((f - bulk_known) / calls, 0.0) for f in bulk_runs]
    bulk_rpc_us = max((statistics.median(bulk_runs) - bulk_known) / calls, 0.0)
    return {"rpc_us": rpc_us, "block_us": block_us, "bandwidth": bandwidth, "round_us": tiny,
            "per_partition_us": per_partition, "narrow_round_us": statistics.median(narrow),
            "big_round_us": statistics.median(broad), "many_round_us": statistics.median(manys),
            "bandwidths": slopes, "rpc_us_each": tiny_each, "big_var_us": big_var_us,
            "big_var_us_each": bulk_each, "bulk_rpc_us": bulk_rpc_us, "bulk_rpc_us_each": bulk_rpc_each,
            "ring_slots": slots}


def dense_slope(added_bytes: float, added_us: float, added_work_us: float) -> float:
    """Bytes/s of a pair of nets: the bytes the bigger one adds over the CPU µs it adds
    beyond its ops (`added_work_us`), that rest floored at a tenth of the CPU added (and
    1 µs), so that noise cannot make it infinite."""
    return added_bytes / max(added_us - added_work_us, 0.1 * added_us, 1.0) * 1e6


def split_partition(per_partition_us: float, var_us: float, trainers: int) -> tuple[float, float]:
    """(`var_us`, `block_us`) of a partition whose fixed CPU a round is `per_partition_us`:
    its block run and its vars, a grad in and a param out per trainer (`2·trainers·var_us`).
    A noisy `var_us` (measured apart, on an async pserver) above that share would zero
    `block_us` and price the partition above its measured CPU: it is capped, and the two
    keep their measured sum."""
    var_us = min(max(var_us, 0.0), per_partition_us / (2 * trainers))
    return var_us, max(per_partition_us - 2 * trainers * var_us, 0.0)


def calibrate(progress=None) -> Rates:
    started = time.perf_counter()
    say = progress or (lambda text: None)
    say("ops: us per element")
    ops = dict(DEFAULT_OP_US)
    ops.update(measure_ops())
    ops.update({f"{k}@fp64": v for k, v in measure_ops(FP64_OPS, dtype="float64").items()})
    ops[SUM_ON_ARRIVAL] = measure_arrival_add()
    ops[f"{SUM_ON_ARRIVAL}@fp64"] = measure_arrival_add(dtype="float64")
    say(f"  {', '.join(f'{k} {v:.4f}' for k, v in sorted(ops.items()))}")
    say("a pserver's sparse block (executor, sync: in place; async: copying): us per lookup, per row updated, "
        "per element copied")
    block = measure_sparse_block()
    row_us, merge_us = block["row_us"], block["merge_elem_us"]
    # the model prices a distinct row updated at `cols·(scale + optimizer)` + `update_row_us`
    update_row_us = max(block["distinct_us"] - BLOCK_WIDTH * (ops["scale"] + ops["adagrad"]), 0.0)
    say(f"  per lookup {block['lookup_us']:.3f} (row {row_us:.3f}, merge {merge_us:.4f}/element), per row updated "
        f"{block['distinct_us']:.3f} (update_row {update_row_us:.3f}); copy {block['copy_us']:.5f}, "
        f"fresh pages +{block['fault_us']:.5f}")
    copy_us = max(measure_copy(), block["copy_us"])
    say(f"  copy with every core copying at once: {copy_us:.5f} us per element")
    say("a real pserver, sparse grads: us per var, per id, bytes/s of sparse rows")
    echo_rpc_us, echo_bandwidth = measure_transport(calls=200, big_calls=4)
    real = measure_pserver(echo_rpc_us, echo_bandwidth, ops["adagrad"], row_us)
    # the per-row cost apart from the bytes: a second table 4x narrower; the rows' CPU at the
    # two widths, extrapolated to width 0, less an id's bytes and the block's work (a grad
    # of k rows from 2k ids updates 2k·(1 - e^-1/2) distinct rows)
    narrow = measure_pserver(echo_rpc_us, echo_bandwidth, ops["adagrad"], row_us, calls=100,
                             width=PSERVER_WIDTH // 4)
    share = 1 - math.exp(-0.5)
    per_float = max((real["row_cpu_us"] - narrow["row_cpu_us"]) / (PSERVER_WIDTH - PSERVER_WIDTH // 4), 0.0)
    # a float of a sparse row beyond its merge and update (priced by merge_us and the optimizer's rate)
    wire = max(per_float - merge_us - share * ops["adagrad"], per_float / 4)
    sparse_bandwidth = 4 / wire * 1e6 if wire > 0 else echo_bandwidth
    fixed = real["row_cpu_us"] - PSERVER_WIDTH * per_float
    id_us = max(fixed - ID_BYTES / sparse_bandwidth * 1e6 - row_us - share * update_row_us, 0.0)
    say(f"  var {real['var_us']:.1f}, id {id_us:.3f}, sparse rows {sparse_bandwidth / 1e6:,.0f} MB/s")
    say("a real sync pserver, sparse grads (rows updated in place): bytes/s of sparse rows")
    synced = measure_sync_sparse(merge_us, ops["scale"] + ops["adagrad"])
    sync_sparse_bandwidth = 4 / synced["wire_us"] * 1e6 if synced["wire_us"] > 0 else echo_bandwidth
    say(f"  sparse rows {sync_sparse_bandwidth / 1e6:,.0f} MB/s ({synced['row_cpu_us']:.2f} us per 64-float grad row)")
    say(f"a real sync pserver, {SYNC_TRAINERS} trainers prefetching: bytes/s of prefetched rows")
    fetched = measure_prefetch()
    prefetch_bandwidth = fetched["prefetch_bandwidth"]
    if prefetch_bandwidth is None:  # noise swamped the rows: no faster than a grad's rows
        prefetch_bandwidth = sync_sparse_bandwidth
        say(f"  prefetched rows not measurable ({fetched['row_us']:.3f} us per row): priced as grad rows")
    say(f"  prefetched rows {prefetch_bandwidth / 1e6:,.0f} MB/s ({fetched['row_us']:.3f} us per "
        f"{PSERVER_WIDTH}-float row, each repeat {', '.join(f'{v:.3f}' for v in fetched['row_us_each'])}; "
        f"a prefetch call {fetched['call_us']:.0f} us)")
    say(f"a real sync pserver, {SYNC_TRAINERS} trainers replaying dense traffic: us per round, per block, dense bytes/s")
    dense = measure_dense(ops, real["var_us"])
    var_us, block_us = split_partition(dense["per_partition_us"], real["var_us"], SYNC_TRAINERS)
    say(f"  rpc {dense['rpc_us']:.0f}, block {block_us:.1f} (var {var_us:.1f}), {dense['bandwidth'] / 1e6:,.0f} MB/s "
        f"(rounds: tiny {dense['round_us']:.0f} us, +{dense['per_partition_us']:.0f} us per partition, "
        f"{DENSE_LAYERS} layers {DENSE_WIDTHS[0]} / {DENSE_WIDTHS[1]} wide {dense['narrow_round_us'] / 1e3:.1f} / "
        f"{dense['big_round_us'] / 1e3:.1f} ms, {4 * DENSE_LAYERS} layers {DENSE_WIDTHS[0] // 2} wide "
        f"{dense['many_round_us'] / 1e3:.1f} ms; each of {DENSE_CYCLES} cycles: rpc "
        f"{', '.join(f'{v:.0f}' for v in dense['rpc_us_each'])}, MB/s "
        f"{', '.join(f'{v / 1e6:,.0f}' for v in dense['bandwidths'])}); per big var on the bulk channel "
        f"{dense['big_var_us']:.0f} us (each cycle {', '.join(f'{v:.0f}' for v in dense['big_var_us_each'])}); "
        f"a batch on the bulk channel {dense['bulk_rpc_us']:.0f} us a call (each cycle "
        f"{', '.join(f'{v:.0f}' for v in dense['bulk_rpc_us_each'])}); shared-memory ring slots handed over per net "
        f"(the bulk net, the wide ones): {', '.join(str(v) for v in dense['ring_slots'][2:])}")
    host = os.uname().nodename if hasattr(os, "uname") else "this machine"
    source = f"calibrate on {host}, {time.strftime('%Y-%m-%d')}, {time.perf_counter() - started:.0f}s"
    return Rates(bandwidth=dense["bandwidth"], rpc_us=dense["rpc_us"], op_us=ops, row_us=row_us,
                 var_us=var_us, block_us=block_us, id_us=id_us, copy_us=copy_us,
                 merge_us=merge_us, fault_us=block["fault_us"], source=source, sparse_bandwidth=sparse_bandwidth,
                 update_row_us=update_row_us, sync_sparse_bandwidth=sync_sparse_bandwidth,
                 prefetch_bandwidth=prefetch_bandwidth, big_var_us=dense["big_var_us"], bulk_rpc_us=dense["bulk_rpc_us"],
                 prefetch_rpc_us=max(fetched["call_us"], 0.0),
                 noise={"rpc_us": dense["rpc_us_each"], "bandwidth": dense["bandwidths"],
                        "big_var_us": dense["big_var_us_each"], "prefetch_row_us": fetched["row_us_each"],
                        "prefetch_rpc_us": fetched["call_us_each"],
                        "bulk_rpc_us": dense["bulk_rpc_us_each"]})
