"""A fuzz test of the pserver's RPC surface by an insider: a trainer holding the job token
(a buggy or compromised trainer 0) sends mutated valid messages of every method to a real
`pstranspile serve` process serving the Paddle-built `ctr_v1_dist_sgd_2ps` program (dense
params, the distributed table, its prefetch block, sparse grads), while an honest
trainer 1 keeps calling. Checked (issue 23):

* the pserver stays up: every honest call succeeds, and the job ends normally (exit 0)
  once both trainers complete;
* params stay unchanged unless a message is a valid update: no round can run during the
  fuzz (trainer 1 withholds its send barrier), so the dense params are bit-identical
  afterwards and the table's rows that existed keep their values; then one honest round
  gives exactly the SGD update of the honest grads (the fuzzer's stored grads leave no
  trace);
* no call of trainer 1 waits more than a second;
* the pserver's resident memory after the fuzz is within 10% of its level before.

The fuzz runs in two phases, the GET phase of round 0 and the SEND phase of round 1, so
both halves of the protocol meet it. Messages are generated from a seed, in advance:
`PSTRANSPILE_FUZZ_SEED` (default 23) and `PSTRANSPILE_FUZZ_MESSAGES` (per phase, default
1500: 3000 a run) choose a longer run. The fuzzer never uses trainer 1's id (the token
authenticates the job, not the trainer: an insider can always act as another trainer) and
never sends trainer 0's or 1's complete notice (an insider may end the job; that is not a
stall).
"""

from __future__ import annotations

import json
import math
import os
import random
import secrets
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from ops.rpc.auth import TOKEN_KEY
from ops.rpc.service import CHANNEL_OPTIONS, METHODS
from ops.rpc.wire import decode_batch, decode_var
from proto import rpc_pb2
from tools.local_procs import free_ports, rss_mb

REPO = Path(__file__).resolve().parents[1]
CASE = REPO / "tests" / "fixtures" / "paddle_programs" / "ctr_v1_dist_sgd_2ps"
SEED = int(os.environ.get("PSTRANSPILE_FUZZ_SEED", "23"))
PER_PHASE = int(os.environ.get("PSTRANSPILE_FUZZ_MESSAGES", "1500"))
PENDING = 300  # fuzz messages while the pserver waits for its agreed restore
WARM_UP = 1500  # fuzz messages (another seed) before the memory baseline: see `test_...` below
FUZZ_DEADLINE = 0.15  # seconds a fuzz call may take (a valid one in the wrong phase waits for it)
FUZZ_THREADS = 4
FP32, INT64 = 5, 3  # Paddle's data_type codes

PARAMS = ("ctr_fc.b", "ctr_out.b", "learning_rate_0")
DENSE_GRADS = {"ctr_fc.b@GRAD": 32, "ctr_out.b@GRAD": 2}
TABLE, TABLE_GRAD, IDS_VAR = "emb", "emb@GRAD.trainer_{}.pserver_0", "prefetch_compress_in_tmp_0"
ALL_NAMES = (*PARAMS, TABLE, *(f"{g}.trainer_{t}" for g in DENSE_GRADS for t in (0, 1)), "ctr_fc.b@GRAD",
             "emb@GRAD", TABLE_GRAD.format(0), TABLE_GRAD.format(1), IDS_VAR, "prefetch_compress_out_tmp_0",
             "kLookupTablePath")


# ------------------------------------------------------------------ messages


def var_message(name: str, array: np.ndarray, *, trainer_id: int = 0, rows: np.ndarray | None = None,
                height: int = 0) -> rpc_pb2.VariableMessage:
    message = rpc_pb2.VariableMessage(varname=name, trainer_id=trainer_id, has_value=True,
                                      data_type=FP32 if array.dtype == np.float32 else INT64,
                                      dims=list(array.shape), data=array.astype(array.dtype.newbyteorder("<")).tobytes())
    if rows is not None:
        message.kind = rpc_pb2.SELECTED_ROWS
        message.rows = rows.astype("<i8").tobytes()
        message.height = height
    return message


def honest_grads(trainer_id: int, rng: np.random.Generator) -> list[rpc_pb2.VariableMessage]:
    """One step's grads of a trainer for pserver 0: the dense grads and its table shard's rows."""
    grads = [var_message(f"{g}.trainer_{trainer_id}", rng.standard_normal(n).astype(np.float32), trainer_id=trainer_id)
             for g, n in DENSE_GRADS.items()]
    rows = np.sort(rng.choice(50000, size=5, replace=False)).astype(np.int64) * 2  # pserver 0's ids
    grads.append(var_message(TABLE_GRAD.format(trainer_id), rng.standard_normal((5, 16)).astype(np.float32),
                             trainer_id=trainer_id, rows=rows, height=100000))
    return grads


class Mutator:
    """Mutated valid messages of every method, as (method, request bytes), from a seed."""

    METHOD_WEIGHTS = {
        "SendVariable": 12, "GetVariable": 10, "PrefetchVariable": 10, "SendBarrier": 4, "FetchBarrier": 4,
        "SendBatch": 14, "FetchBatch": 14, "SendFetchBatch": 14, "SendComplete": 4, "CheckpointNotify": 3,
        "Watch": 5, "CheckpointPart": 3, "CheckpointList": 2, "CheckpointCommit": 3, "CheckpointRestore": 3,
    }
    # while the pserver waits for its agreed restore (every var call refused): mostly the methods it answers then
    PENDING_WEIGHTS = {**dict.fromkeys(METHOD_WEIGHTS, 1), "CheckpointPart": 6, "CheckpointList": 4, "CheckpointRestore": 8,
                       "CheckpointCommit": 3, "Watch": 3}

    def __init__(self, seed: int, manifest: str = "{}", *, pending: bool = False) -> None:
        self.rng = random.Random(seed)
        self.np = np.random.default_rng(seed)
        self.manifest = manifest  # a job manifest of this pserver's part (ckpt-1), to mutate
        self.pending = pending

    # values -------------------------------------------------------------
    def trainer_id(self) -> int:
        return self.rng.choice([0, 0, 0, 0, -1, 2, 3, 1 << 20, 2**31 - 1, -(2**31)])

    def name(self) -> str:
        r = self.rng.random()
        if r < 0.7:
            return self.rng.choice(ALL_NAMES)
        return self.rng.choice(["", "nope", "x" * self.rng.choice([1, 200, 5000, 60000]), "\x00", "../etc/passwd",
                                "ctr_fc.b\x00", "ctr_fc.b" * 3, "ctr_fc.b@GRAD.trainer_7", "é" * 100])

    def grad(self, small: bool = False) -> rpc_pb2.VariableMessage:
        which = self.rng.random()
        if which < 0.4:
            g = self.rng.choice(list(DENSE_GRADS))
            return var_message(f"{g}.trainer_0", self.np.standard_normal(DENSE_GRADS[g]).astype(np.float32))
        k = self.rng.choice([0, 1, 5] if small else [0, 1, 5, 300, 5000])
        rows = self.np.integers(0, 100000, size=k).astype(np.int64)
        return var_message(TABLE_GRAD.format(0), self.np.standard_normal((k, 16)).astype(np.float32), rows=rows,
                           height=100000)

    def mutate_var(self, m: rpc_pb2.VariableMessage) -> None:
        for _ in range(self.rng.choice([0, 1, 1, 2, 3])):
            op = self.rng.randrange(13)
            if op == 0:
                m.varname = self.name()
            elif op == 1:
                m.trainer_id = self.trainer_id()
            elif op == 2:
                m.data_type = self.rng.choice([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 20, 21, 22, 99, -1])
            elif op == 3 and len(m.dims):
                i = self.rng.randrange(len(m.dims))
                m.dims[i] = self.rng.choice([0, -1, 1, 2, m.dims[i] * 2, 1 << 40, -(1 << 62), 2**31])
            elif op == 4:
                m.dims.append(self.rng.choice([1, 2, 0, 1 << 30]))
            elif op == 5:
                cut = self.rng.randrange(len(m.data) + 1) if m.data else 0
                m.data = m.data[:cut] if self.rng.random() < 0.5 else m.data + bytes(self.rng.choice([1, 4, 64, 4096]))
            elif op == 6:
                m.kind = 1 - m.kind if m.kind in (0, 1) else 0
            elif op == 7:
                m.rows = self.np.integers(-(1 << 40), 1 << 40, size=self.rng.choice([0, 1, 7])).astype("<i8").tobytes() + \
                    bytes(self.rng.choice([0, 0, 3]))
            elif op == 8:
                m.height = self.rng.choice([0, -1, 1, 50000, 100000, 1 << 62])
            elif op == 9:
                level = m.lod.add()
                level.offsets.extend(self.rng.choice([[0, 1], [5, 2], [0, 1 << 40], [-1], []]))
            elif op == 10:
                m.has_value = not m.has_value
            elif op == 11:
                m.merge_add = not m.merge_add
            elif op == 12:
                m.table_name = self.rng.choice(["", TABLE, "nope", "ctr_fc.b", IDS_VAR])

    def fetch_names(self) -> list[str]:
        r = self.rng.random()
        if r < 0.4:
            return self.rng.sample(list(PARAMS) + [TABLE], self.rng.randint(0, 4))
        if r < 0.6:
            return [self.rng.choice(PARAMS)] * self.rng.choice([2, 3, 100, 20000, 300000])
        return [self.name() for _ in range(self.rng.randint(0, 8))]

    # messages -----------------------------------------------------------
    def message(self, method: str) -> bytes:
        rng = self.rng
        if method in ("SendVariable", "GetVariable", "PrefetchVariable"):
            if method == "SendVariable":
                m = self.grad()
            elif method == "GetVariable":
                m = rpc_pb2.VariableMessage(varname=rng.choice([*PARAMS, TABLE]))
            else:
                ids = self.np.integers(0, 50000, size=rng.choice([1, 10, 1000, 60000])).astype(np.int64) * 2
                m = var_message(IDS_VAR, ids.reshape(-1, 1))
                if rng.random() < 0.3:
                    m.table_name = TABLE
            self.mutate_var(m)
            return m.SerializeToString()
        if method in ("SendBarrier", "FetchBarrier"):
            return rpc_pb2.BarrierMessage(trainer_id=self.trainer_id()).SerializeToString()
        if method in ("SendBatch", "SendFetchBatch"):
            batch = rpc_pb2.VarBatch(trainer_id=self.trainer_id(), barrier=rng.random() < 0.3)
            count = rng.choice([0, 1, 3, 3, 10, 200])
            for _ in range(count):
                var = self.grad(small=count > 3)
                self.mutate_var(var)
                batch.vars.append(var)
            if method == "SendFetchBatch":
                batch.fetch.extend(self.fetch_names())
                batch.fetch_barrier = rng.random() < 0.5
            return batch.SerializeToString()
        if method == "FetchBatch":
            return rpc_pb2.FetchRequest(trainer_id=self.trainer_id(), varnames=self.fetch_names(),
                                        barrier=rng.random() < 0.3).SerializeToString()
        if method == "SendComplete":
            tid = rng.choice([-1, 2, 3, 1 << 20, -(2**31)])  # never trainer 0's or 1's: that would end the job
            return rpc_pb2.CompleteMessage(trainer_id=tid, failed=rng.random() < 0.5,
                                           reason="r" * rng.choice([0, 10, 50000])).SerializeToString()
        if method == "CheckpointNotify":
            directory = rng.choice(["ckpt-1", "ckpt-2", "../ckpt-1", "/tmp/ckpt-1", "", "ckpt-x", "a/b", "ckpt-1\x00",
                                    "x" * 3000, "..", ".", f"ckpt-{rng.randrange(1 << 40)}", "ckpt-1/emb_0",
                                    f"lt{rng.randrange(1 << 20)}/emb_0", "lt/emb_0", "lt/emb_0/emb_0"])
            return rpc_pb2.CheckpointMessage(trainer_id=self.trainer_id(), dir=directory,
                                             lookup_table=rng.choice(["", "", TABLE, "nope"])).SerializeToString()
        if method in ("CheckpointPart", "CheckpointList", "CheckpointCommit", "CheckpointRestore"):
            return self.checkpoint_set(method).SerializeToString()
        if method == "Watch":
            return rpc_pb2.WatchMessage(trainer_id=self.trainer_id(),
                                        seconds=rng.choice([0.0, 0.05, -1.0, math.nan, math.inf, 1e308])).SerializeToString()
        raise AssertionError(method)

    def checkpoint_name(self) -> str:
        return self.rng.choice(["ckpt-1", "ckpt-1", "ckpt-2", f"ckpt-{self.rng.randrange(1 << 40)}", "ckpt-" + "9" * 30,
                                "ckpt-" + "9" * 5000, "", "../ckpt-1", "/tmp/ckpt-1", "ckpt-1/ps0", "latest", "x" * 3000,
                                "ckpt-1\x00", ".."])

    def mutated_manifest(self) -> str:
        rng = self.rng
        try:
            manifest = json.loads(self.manifest)
        except ValueError:
            manifest = {}
        op = rng.randrange(9)
        if op == 0:
            return self.manifest
        if op == 1:
            return self.manifest[: rng.randrange(len(self.manifest) + 1)]
        if op == 2:  # past the bound (4 MB + 32 bytes a byte of the plan): refused unparsed
            return " " * rng.choice([1 << 20, 5 << 20])
        if op == 3:
            return rng.choice(["", "[]", "null", "{" * 50000, '{"format": 1}', "1e999999"])
        parts = manifest.get("parts") if isinstance(manifest, dict) else None
        entries = [e for vars_ in (parts or {}).values() if isinstance(vars_, dict) for e in vars_.values()]
        if op == 4 and entries:
            entry = rng.choice(entries)
            entry[rng.choice(["whole_shape", "shape", "rows", "cols", "files", "origin", "dtype"])] = rng.choice(
                [None, [], [10**30], [2] * 5000, [-1, 3], [5, 1], "x", {"a": "b"}, 7, [1.5]])
        elif op == 5 and isinstance(manifest, dict):
            manifest["step"] = rng.choice([0, 2, -1, 10**40, "1", None])
        elif op == 6 and parts:
            part = rng.choice(list(parts))
            parts[rng.choice([part, "ps7", "x" * 300])] = rng.choice([[], 3, {}, {f"v{i}": {} for i in range(2000)}])
        elif op == 7 and isinstance(manifest, dict):
            manifest["parts"] = rng.choice([None, [], {}, "ps0"])
        else:
            manifest = [manifest] * rng.choice([1, 50])
        return json.dumps(manifest)

    def checkpoint_set(self, method: str) -> rpc_pb2.CheckpointMessage:
        rng = self.rng
        message = rpc_pb2.CheckpointMessage(trainer_id=self.trainer_id(), dir=self.checkpoint_name())
        if method == "CheckpointPart":
            message.manifest = rng.random() < 0.5
        if method in ("CheckpointCommit", "CheckpointRestore"):
            message.json = self.mutated_manifest()
        if rng.random() < 0.2:
            message.lookup_table = rng.choice([TABLE, "x" * 100])
        return message

    def bytes_mutation(self, data: bytes) -> bytes:
        """Damage the bytes themselves (1 in 4 messages)."""
        rng = self.rng
        op = rng.randrange(5)
        if op == 0 and data:
            buf = bytearray(data)
            for _ in range(rng.randint(1, 8)):
                buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
            return bytes(buf)
        if op == 1 and data:
            return data[: rng.randrange(len(data))]
        if op == 2:
            at = rng.randrange(len(data) + 1)
            return data[:at] + rng.randbytes(rng.choice([1, 5, 100])) + data[at:]
        if op == 3 and data:
            at = rng.randrange(len(data))
            return data + data[at : at + 1000]
        return rng.randbytes(rng.choice([0, 1, 10, 1000]))

    def next(self) -> tuple[str, bytes]:
        weights = self.PENDING_WEIGHTS if self.pending else self.METHOD_WEIGHTS
        methods = list(weights)
        while True:
            method = self.rng.choices(methods, weights=[weights[m] for m in methods])[0]
            data = self.message(method)
            if self.rng.random() < 0.25:
                data = self.bytes_mutation(data)
            if not impersonates(method, data) and not (self.pending and agrees_restore(method, data)):
                return method, data


def impersonates(method: str, data: bytes) -> bool:
    """Whether the pserver would read `data` as trainer 1's, or as a complete notice of
    trainer 0 or 1 (the fuzzer does neither; see the module docstring)."""
    try:
        if method in ("SendBatch", "SendFetchBatch"):
            return decode_batch(data).trainer_id == 1
        if method in ("SendVariable", "GetVariable", "PrefetchVariable"):
            return decode_var(data).trainer_id == 1
        message = getattr(rpc_pb2, METHODS[method].decode_request.__self__.__name__).FromString(data) \
            if hasattr(METHODS[method].decode_request, "__self__") else None
    except Exception:  # noqa: BLE001 - what the pserver cannot decode, it refuses
        return False
    if message is None:
        return False
    if method == "SendComplete":
        return message.trainer_id in (0, 1)
    return getattr(message, "trainer_id", None) == 1


def agrees_restore(method: str, data: bytes) -> bool:
    """Whether `data` is trainer 0's `CheckpointRestore` of a checkpoint or from scratch
    (the fuzz of the pending pserver never sends one: the honest trainer 0 agrees the
    restore after it; one that fails would fail trainer 1's wait, as it should)."""
    if method != "CheckpointRestore":
        return False
    try:
        message = rpc_pb2.CheckpointMessage.FromString(data)
    except Exception:  # noqa: BLE001
        return False
    return message.trainer_id == 0 and not message.dir


# ------------------------------------------------------------------ the pserver


class Job:
    """`pstranspile serve` of pserver 0 of the ctr case (with a token), and raw callers."""

    def __init__(self, tmp: Path) -> None:
        self.token = secrets.token_hex(16)
        env = {**os.environ, "PYTHONPATH": str(REPO), "PSTRANSPILE_JOB_TOKEN": self.token}
        env.pop("PSTRANSPILE_JOB_TOKEN_FILE", None)
        ports = free_ports(2)
        endpoints = ",".join(f"127.0.0.1:{p}" for p in ports)
        subprocess.run([sys.executable, "-m", "transpiler", "transpile", str(CASE / "main.pb"), "--startup",
                        str(CASE / "startup.pb"), "--pservers", endpoints, "--trainers", "2", "-o", str(tmp / "out")],
                       check=True, env=env, capture_output=True, timeout=120)
        self.endpoint = f"127.0.0.1:{ports[0]}"
        self.own_dir = tmp / "ckpt0"  # pserver 0's own checkpoint dir (a {pserver} template)
        stem = tmp / "out" / f"pserver_127.0.0.1_{ports[0]}"
        self.log = tmp / "pserver.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "transpiler", "serve", "--program", f"{stem}.pb", "--startup",
                 f"{stem}_startup.pb", "--timeout", "600", "--plan", str(tmp / "out" / "plan.json"),
                 "--checkpoint-dir", str(tmp / "ckpt{pserver}"), "--restore", str(tmp / "ckpt{pserver}")],
                env=env, stdout=log, stderr=subprocess.STDOUT)
        self.channel = grpc.insecure_channel(self.endpoint, options=list(CHANNEL_OPTIONS))
        self.stubs = {name: self.channel.unary_unary(m.path) for name, m in METHODS.items()}  # bytes both ways
        self.metadata = ((TOKEN_KEY, self.token),)

    def call(self, method: str, data: bytes, timeout: float = 10.0) -> bytes:
        return self.stubs[method](data, metadata=self.metadata, timeout=timeout)

    def wait_serving(self) -> None:
        deadline = time.monotonic() + 90
        while True:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                self.call("CheckpointList", rpc_pb2.CheckpointMessage(trainer_id=1).SerializeToString(), 2)
                return
            except grpc.RpcError:
                assert time.monotonic() < deadline, "the pserver did not start"
                time.sleep(0.2)

    def fetch(self, names, trainer_id: int = 1, barrier: bool = False) -> dict:
        reply = decode_batch(self.call("FetchBatch", rpc_pb2.FetchRequest(
            trainer_id=trainer_id, varnames=list(names), barrier=barrier).SerializeToString()))
        return {var.name: var.value for var in reply.vars}

    def close(self) -> None:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


class Honest:
    """Trainer 1 calling while the fuzz runs: each call timed, each must succeed."""

    def __init__(self, job: Job, calls: list[tuple[str, bytes]]) -> None:
        self.job, self.calls = job, calls
        self.slowest, self.count, self.failures = 0.0, 0, []
        self.slowest_call = ""
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name="trainer-1")

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            method, data = self.calls[i % len(self.calls)]
            t0 = time.perf_counter()
            try:
                self.job.call(method, data, timeout=10)
            except grpc.RpcError as exc:
                self.failures.append(f"{method}: {exc.code().name} {exc.details()}")
            took = time.perf_counter() - t0
            if took > self.slowest:
                self.slowest, self.slowest_call = took, method
            self.count += 1
            i += 1
            time.sleep(0.01)

    def __enter__(self) -> Honest:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(30)


def fuzz(job: Job, messages: list[tuple[str, bytes]]) -> dict[str, int]:
    """Send every message (4 at a time, each with a short deadline); status counts."""
    counts: dict[str, int] = {}
    lock = threading.Lock()

    def one(item: tuple[str, bytes]) -> None:
        method, data = item
        try:
            job.call(method, data, timeout=FUZZ_DEADLINE)
            code = "OK"
        except grpc.RpcError as exc:
            code = exc.code().name
            if code in ("INTERNAL", "UNKNOWN"):
                print(f"{method}: {code} {exc.details()[:300]}")
        with lock:
            counts[code] = counts.get(code, 0) + 1

    with ThreadPoolExecutor(FUZZ_THREADS) as pool:
        list(pool.map(one, messages))
    return counts


def table_rows(value) -> dict[int, np.ndarray]:
    return {int(r): np.array(v) for r, v in zip(value.rows, value.active_value(), strict=True)}


def test_a_trainer_with_the_token_cannot_stall_or_corrupt_a_pserver(tmp_path):
    from ops.rpc.checkpoint import DEFAULT_KEEP, FORMAT, INCOMPLETE_KEEP, plan_fingerprint

    pending = Mutator(SEED + 2, pending=True)
    phase_pending = [pending.next() for _ in range(PENDING)]
    rng = np.random.default_rng(SEED)
    job = Job(tmp_path)
    watches = []
    try:
        job.wait_serving()
        # both trainers hold their Watch, as real ones do (trainer 0's keeps the fuzzer "connected")
        watch = rpc_pb2.WatchMessage(seconds=600)
        for tid in (0, 1):
            watch.trainer_id = tid
            watches.append(job.stubs["Watch"].future(watch.SerializeToString(), metadata=job.metadata))
        # The pserver was started to restore from its own dir ({pserver} template): every
        # var call is refused until trainer 0 agrees the step. The fuzz meets that state
        # first (never trainer 0's restore from scratch, which would agree it), while
        # trainer 1 lists the checkpoints; then trainer 1 waits and trainer 0 agrees.
        listing = [("CheckpointList", rpc_pb2.CheckpointMessage(trainer_id=1).SerializeToString())]
        with Honest(job, listing) as honest_pending:
            counts_pending = fuzz(job, phase_pending)
        assert job.proc.poll() is None, job.log.read_text()[-2000:]
        assert not honest_pending.failures, honest_pending.failures[:5]
        assert honest_pending.slowest < 1.0, f"trainer 1's CheckpointList took {honest_pending.slowest:.3f} s"
        waiting = job.stubs["CheckpointRestore"].future(rpc_pb2.CheckpointMessage(trainer_id=1).SerializeToString(),
                                                        metadata=job.metadata, timeout=60)
        time.sleep(0.2)
        agreed = rpc_pb2.CheckpointMessage.FromString(job.call("CheckpointRestore", rpc_pb2.CheckpointMessage(
            trainer_id=0).SerializeToString()))
        assert json.loads(agreed.json) == {"step": 0}
        assert json.loads(rpc_pb2.CheckpointMessage.FromString(waiting.result(60)).json) == {"step": 0}
        # a manifest to mutate: pserver 0's part of ckpt-1 (an honest save), as trainer 0 builds it
        job.call("CheckpointNotify", rpc_pb2.CheckpointMessage(trainer_id=0, dir="ckpt-1").SerializeToString(), 60)
        part = json.loads(rpc_pb2.CheckpointMessage.FromString(job.call("CheckpointPart", rpc_pb2.CheckpointMessage(
            trainer_id=0, dir="ckpt-1").SerializeToString())).json)
        plan_text = (tmp_path / "out" / "plan.json").read_text()
        manifest = json.dumps({"format": FORMAT, "step": 1, "plan": json.loads(plan_text),
                               "plan_sha256": plan_fingerprint(plan_text), "parts": {"ps0": part["vars"], "ps1": {}}})
        mutator = Mutator(SEED, manifest)
        warm_up = Mutator(SEED + 1, manifest)
        warm_up = [warm_up.next() for _ in range(WARM_UP)]
        phase_get = [mutator.next() for _ in range(PER_PHASE)]
        phase_send = [mutator.next() for _ in range(PER_PHASE)]
        ids = rpc_pb2.VariableMessage()
        ids.CopyFrom(var_message(IDS_VAR, (np.arange(10, dtype=np.int64) * 2).reshape(-1, 1), trainer_id=1))
        get_calls = [
            ("GetVariable", rpc_pb2.VariableMessage(varname="ctr_fc.b", trainer_id=1).SerializeToString()),
            ("FetchBatch", rpc_pb2.FetchRequest(trainer_id=1, varnames=list(PARAMS)).SerializeToString()),
            ("PrefetchVariable", ids.SerializeToString()),
        ]
        for method, data in get_calls:  # warm up: every kind of call trainer 1 makes
            job.call(method, data)
        # The memory baseline is taken after a short fuzz of another seed: the first
        # requests of every size give the pserver's threads their malloc arenas and
        # gRPC its buffers (65 -> ~160 MB, once); what the test checks is that the fuzz
        # after that leaves nothing behind (no growth with the number of messages).
        fuzz(job, warm_up)
        time.sleep(1.0)
        before = job.fetch([*PARAMS, TABLE])
        rows_before = table_rows(before[TABLE])
        rss_before = rss_mb(job.proc.pid)

        started = time.perf_counter()
        with Honest(job, get_calls) as honest_get:
            counts_get = fuzz(job, phase_get)
        # end round 0's GET phase: trainer 0's fetch barrier, then trainer 1's
        for tid in (0, 1):
            job.call("FetchBarrier", rpc_pb2.BarrierMessage(trainer_id=tid).SerializeToString())
        own_grad = honest_grads(1, rng)[0].SerializeToString()
        send_calls = [("SendVariable", own_grad), ("PrefetchVariable", ids.SerializeToString())]
        with Honest(job, send_calls) as honest_send:
            counts_send = fuzz(job, phase_send)
        took = time.perf_counter() - started
        time.sleep(1.0)
        rss_after = rss_mb(job.proc.pid)
        print(f"seed {SEED}: pending restore {PENDING} messages {counts_pending}, trainer 1's slowest list "
              f"{honest_pending.slowest:.3f} s")
        sent = Counter(method for method, _ in (*phase_pending, *phase_get, *phase_send) if method.startswith("Checkpoint"))
        print(f"seed {SEED}: checkpoint messages {dict(sorted(sent.items()))}")
        print(f"seed {SEED}: {2 * PER_PHASE} messages in {took:.1f} s; GET phase {counts_get}, SEND phase {counts_send}; "
              f"trainer 1: {honest_get.count + honest_send.count} calls, slowest "
              f"{honest_get.slowest:.3f} s ({honest_get.slowest_call}) / {honest_send.slowest:.3f} s ({honest_send.slowest_call}); RSS {rss_before:.0f} -> {rss_after:.0f} MB")

        assert job.proc.poll() is None, job.log.read_text()[-2000:]
        assert not honest_get.failures and not honest_send.failures, (honest_get.failures + honest_send.failures)[:5]
        assert honest_get.slowest < 1.0, f"trainer 1's {honest_get.slowest_call} took {honest_get.slowest:.3f} s"
        assert honest_send.slowest < 1.0, f"trainer 1's {honest_send.slowest_call} took {honest_send.slowest:.3f} s"
        assert rss_after <= rss_before * 1.10, f"RSS {rss_before:.0f} MB before, {rss_after:.0f} MB after"
        held = sorted(p.name for p in job.own_dir.iterdir() if p.name.startswith("ckpt-"))
        assert len(held) <= DEFAULT_KEEP + INCOMPLETE_KEEP, held  # the notices' parts are capped
        shards = [p for p in job.own_dir.rglob("emb_0")
                  if p.is_file() and not p.relative_to(job.own_dir).parts[0].startswith("ckpt-")]
        assert len(shards) <= DEFAULT_KEEP, shards  # so are the lookup-table notices' shards

        # one honest round: trainer 0's grads and barrier first (the fuzzer may have sent its barrier), then trainer 1's
        grads = {tid: honest_grads(tid, rng) for tid in (0, 1)}
        for tid in (0, 1):
            job.call("SendBatch", rpc_pb2.VarBatch(trainer_id=tid, barrier=True, vars=grads[tid]).SerializeToString())
        after = job.fetch([*PARAMS, TABLE], trainer_id=0, barrier=True)
        job.fetch([], trainer_id=1, barrier=True)
        lr = np.float32(before["learning_rate_0"].array.reshape(()))
        for k, param in enumerate(("ctr_fc.b", "ctr_out.b")):
            g0 = np.frombuffer(grads[0][k].data, "<f4")
            g1 = np.frombuffer(grads[1][k].data, "<f4")
            mean = (g0 + g1) * np.float32(0.5)
            want = before[param].array - lr * mean
            np.testing.assert_allclose(after[param].array, want, rtol=1e-6, atol=1e-7, err_msg=param)
        np.testing.assert_array_equal(after["learning_rate_0"].array, before["learning_rate_0"].array)
        touched = {int(r) for tid in (0, 1) for r in np.frombuffer(grads[tid][2].rows, "<i8")}
        rows_after = table_rows(after[TABLE])
        for row, value in rows_before.items():  # rows that existed: unchanged but where an honest grad landed
            if row not in touched:
                np.testing.assert_array_equal(rows_after[row], value, err_msg=f"emb row {row}")

        for tid in (0, 1):
            job.call("SendComplete", rpc_pb2.CompleteMessage(trainer_id=tid).SerializeToString())
        assert job.proc.wait(60) == 0, job.log.read_text()[-2000:]
    finally:
        for w in watches:
            w.cancel()
        job.close()
