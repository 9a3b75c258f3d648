"""The cost model: what each pserver holds, sends, receives and computes per training step.

Two halves, one vocabulary (`MEMORY_KINDS`):

- `declared_memory(plan, endpoint, program)` reads a pserver's main program: every var of
  its global block, classified by role from the plan and the optimize blocks (params,
  optimizer state = accumulator inputs of the optimizer ops, per-trainer grad buffers,
  merged grads, table rows, other), bytes = elements × itemsize of the declared shape. A
  dimension of -1 (a batch-sized temporary) counts 0 bytes; `runtime_sized` names them.
- `block_cost(...)` predicts the same memory figures for one partition from the param
  alone (shape, dtype, optimizer slots, trainers), and its traffic and compute per step;
  `plan_costs(plan, ...)` sums them per pserver. The planner (`transpiler/planner.py`)
  searches with `block_cost`; tests check it equals `declared_memory` on the fixtures.

Units, everywhere: bytes; microseconds (µs); a step is one step of every trainer (in sync
mode the pservers' round; in async mode each trainer's grads are applied one by one).

Per partition of `n = rows × cols` elements, itemsize `s`, T trainers (sync, T > 1: a
buffer per trainer; otherwise the grad arrives in the merged var itself):
- memory: param `n·s`; optimizer state `(sliced accumulators)·n·s + (unsliced)·s` (the
  unsliced ones are `[1]` scalars, a copy per partition); merged grad `n·s`; grad
  buffers `T·n·s` (sync, T > 1);
- traffic (dense): in `T·n·s` (grads), out `T·n·s` (params trainers receive); a sparse
  grad carries a row per lookup, `l` per trainer (ids repeat; `l` from `IdStats`): in
  `T·l·(cols·s + 8)`, or a row per distinct id of the trainer's step, `r`, when the
  trainer merged it (`merged`: it sums several lookups' grads, Paddle's MergeAdd, as the
  CTR net's three slots do; `ParamPlan.merged_grad`); a prefetched table sends the `r`
  distinct rows asked for: out `T·r·cols·s`, ids in `T·r·8`;
- RPCs (`batch_rpcs`): per trainer one `SendFetchBatch` to each pserver holding a
  partition in sync mode (grads, send barrier, params fetched, fetch barrier: one call), a
  `SendBatch` and a `FetchBatch` in async mode, and a prefetch call per prefetched
  partition, each `rpc_us` (`bulk_rpc_us` for the batches to a pserver with a dense var of
  `BIG_VAR_BYTES` or more: they travel its bulk channel); each var a batch carries costs `var_us`, and a dense partition
  `big_var_us` per trainer each way (its grad in, param out), a share by its bytes below
  `BIG_VAR_BYTES`;
- compute: `(T-1)·n·sum + n·scale + n·<optimizer>` µs-per-element rates (`Rates`: float32
  rates, float64 its own `op@fp64` ones, copies by their bytes), where a dense grad of
  `arrival_sum.MIN_BYTES` or more with per-trainer copies (`sums_on_arrival`) has no `sum`
  op: the pserver adds each copy into its accumulator as it arrives, `(T-1)·n` elements at
  the `sum_on_arrival` rate (the receive itself is the bytes' `bandwidth`); sparse
  grads touch `r` rows instead of `n / cols` (unless the optimizer updates every row), each
  such row costing `update_row_us` beside its elements' rates, their
  `T·l` grad rows (`T·r` when merged) are merged at `row_us + cols·merge_us` each (no `sum` rate), and
  each grad row costs `id_us` on every partition its id reaches; an optimizer in `SPARSE_COPIES` copies its whole param and state per run
  on an async pserver (`(1 + sliced)·n·copy_us`; a sync one updates the rows in place); each run of the partition's optimize block costs `block_us`
  (once a step in sync mode, once per trainer's grad in async mode).
Estimated pserver time per step = compute + dense bytes (in + out) / bandwidth + sparse
grad bytes (grad rows and their ids) / sync_sparse_bandwidth (a sync job) or
sparse_bandwidth (async) + prefetch bytes (ids in, rows out: `Cost.prefetch_bytes`) /
prefetch_bandwidth + RPCs × rpc_us + vars × var_us + big vars × big_var_us: the pserver's
CPU µs per step, which
`benchmarks/cost_accuracy.py` compares with real pservers' CPU from /proc. The fixed rates
(`rpc_us`, `block_us`: a real sync pserver's round replayed by `transpiler.replay`;
`var_us`, `id_us`) and the bandwidths are measured against real pservers by `pstranspile
calibrate`; a column cut multiplies the per-id and per-block work by the number of
ranges, a row cut does not.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ops.catalogue.optimizer_ops import OPTIMIZER_SLOTS, optimizer_slots
from ops.heap import ARRIVAL_SUM_MIN_BYTES as ARRIVAL_SUM_BYTES
from ops.heap import MMAP_THRESHOLD
from transpiler.errors import TranspileError
from transpiler.ir.program import var_bytes  # here since the runtime reads it: a pserver need not import this module
from transpiler.ir.types import DType

MEMORY_KINDS = ("params", "optimizer_state", "grad_buffers", "merged_grads", "table", "other")
ID_BYTES = 8  # an int64 row id on the wire
# a sync pserver's CPU per byte of sparse rows (`calibrate.measure_sync_sparse`, the rows
# updated in place): the median of 11 runs on the shared 2-core VM, 2026-11-27, load average
# 0.2-0.7 (424-895 MB/s): near the async figure (440), not the dense `bandwidth` (1,570)
SYNC_SPARSE_BANDWIDTH = 5.6e8
# a prefetch's ids in and rows out on a sync pserver (`calibrate.measure_prefetch`, 4,096
# rows against 8 a trainer's round, 64 floats wide): 1.03 and 1.12e9 in two runs at load
# average 5-6, 2026-11-27, 0.89-1.37e9 in 7 calibrations at 3.5-10; twice a grad row's rate
PREFETCH_BANDWIDTH = 1.1e9
# per dense var of `BIG_VAR_BYTES` or more a trainer sends (its grad) or fetches (its param),
# beside its bytes and its partition's `block_us` (`calibrate.measure_dense`: 32 fc layers
# 256 wide against 8 of 512, the same bytes in 4x the vars, on the bulk channel): 47-51 us
# in 3 measurements at load average 3-7, 70-81 in 3 at 7-10, 2026-11-27. A smaller var
# costs its share by bytes (measured 15-21 us at 64 kB over gRPC, 8-25 at 16 kB; a 255 kB
# var over gRPC no less than a 256 kB one on the bulk channel): on either path, and no cut
# of a param makes it cheaper (two halves cost what the whole does, or more).
BIG_VAR_US = 50.0
BIG_VAR_BYTES = 256 << 10  # also the bulk channel's threshold (`ops.rpc.bulk.BULK_MIN`, a higher layer)
# a trainer's batch on the bulk channel: a 1-layer net of a 256 kB weight against the tiny
# net's gRPC round, its bytes, big var and ops taken off: 100-320 us less than a gRPC call
# in two measurements at load average 4, 2026-11-27 (the MLP's pservers, on the bulk channel,
# measured 1.8-2.5 ms a step where two gRPC-priced calls alone were 1.37)
BULK_RPC_US = 475.0
# a trainer's prefetch call on a sync pserver (`calibrate.measure_prefetch`'s `call_us`: its
# CPU per call of 8 rows against no prefetch, the rest of the round alike): 384, 422 and 361
# us in three calibrations on a quiet machine, 2026-11-27 (rpc_us 691, 668 and 714 in the
# same ones). Priced at `rpc_us` before, the Zipf table's 4 pservers were estimated at
# 1.20-1.34x their measured CPU (run AA), the cold ones' step being mostly their 4 calls.
PREFETCH_RPC_US = 384.0
RATES_SCHEMA = "pstranspile.rates/2"
# The first schema counted a sync step's one `SendFetchBatch` per trainer as two RPCs (a send
# batch and a fetch batch, as trainers sent them before the deferred send barrier): its
# `rpc_us` is half a call. `load_rates` reads such a file with `rpc_us` doubled.
RATES_SCHEMA_V1 = "pstranspile.rates/1"
# Optimizers whose kernel, on a SelectedRows grad of rows it updates alone, copies the whole
# param and every sliced state before writing the rows (ops/kernels/optimizers.py): such an
# update costs `(1 + sliced) · n · copy_us` per run however few rows it touches. (`sgd`
# updates in place on a pserver; `adam` copies in `lazy_mode` only, else it updates every row.)
SPARSE_COPIES = frozenset({"adagrad", "adam", "ftrl"})


# The op-rate key of a grad summed on arrival: µs per element a sync pserver adds into the
# grad's kept accumulator as a trainer's copy arrives (`ops.rpc.arrival_sum`: the receive
# writes the first copy in place, each later one is added chunk by chunk, no `sum` op runs).
SUM_ON_ARRIVAL = "sum_on_arrival"


def sums_on_arrival(nbytes: int, job: Job) -> bool:
    """Does a real sync pserver sum this dense grad on arrival rather than run its `sum` op?
    Yes for a grad of `arrival_sum.MIN_BYTES` (256 kB) or more with per-trainer copies (sync,
    2+ trainers): such a pserver offers the bulk channel (`PSTRANSPILE_BULK=auto`, its
    threshold is the same) and skips the optimize block's leading `sum`; a smaller grad keeps
    the op (docs/runtime.md "Summed on arrival")."""
    return job.per_trainer_grads and nbytes >= ARRIVAL_SUM_BYTES


def sparse_step_copies(optimizer: str, sync_mode: bool) -> bool:
    """Does a sparse update by `optimizer` copy its whole param and state each run? Only on
    an async pserver: a sync one orders every read before the updates, so Adagrad, FTRL and
    lazy Adam write the grad's rows into the arrays themselves (`OpContext.may_update_in_place`);
    an async one serves fetches meanwhile, and the kernels copy."""
    return not sync_mode and optimizer in SPARSE_COPIES

# Defaults measured on the project's shared 2-core VM with `pstranspile calibrate`
# (2026-11-27, the median of 10 runs under load, each the best of 5 repeats): µs per float32
# element, the executor's kernels.
DEFAULT_OP_US = {
    # per element of a trainer's copy added into a grad summed on arrival (`SUM_ON_ARRIVAL`,
    # `calibrate.measure_arrival_add`: in-place adds of 2 MB chunks into a 16 MB accumulator;
    # 3 calibrations, 2026-11-27, load average 10-13: 0.00020-0.00021, float64 0.00040-0.00058)
    SUM_ON_ARRIVAL: 0.00020, "sum_on_arrival@fp64": 0.00050,
    "sum": 0.00017, "scale": 0.00016, "sgd": 0.00032, "momentum": 0.00137, "adam": 0.00142, "adamw": 0.00144,
    "adagrad": 0.00148, "rmsprop": 0.0027, "adamax": 0.00227, "ftrl": 0.0068, "decayed_adagrad": 0.00192,
    "lars_momentum": 0.00242, "lamb": 0.0050,
    # float64 (`op@fp64`): the executor's fused kernels are float32 only, numpy's float64
    # path is 2-8x slower per element for the optimizers (the least of 5 calibrations: these
    # figures move by 3x between runs); an op without one is priced at twice its float32 rate
    "sum@fp64": 0.0010, "scale@fp64": 0.00045, "sgd@fp64": 0.0008, "momentum@fp64": 0.006, "adam@fp64": 0.0034,
    "adagrad@fp64": 0.012,
}
FP64_SUFFIX = "@fp64"


@dataclass(frozen=True)
class Rates:
    """The machine's rates: `bandwidth` bytes/s of dense payload a real pserver takes and
    sends (its CPU: `sparse_bandwidth` for sparse rows), `rpc_us` µs
    of fixed cost per RPC (request + response handling on the pserver), `op_us` µs per
    element per op type (`sum`, `scale` and the optimizers), `row_us` µs per sparse grad row
    the block merges (a lookup: the bookkeeping beside `merge_us` per element),
    `update_row_us` µs per distinct row a sparse update writes."""

    # the defaults: `pstranspile calibrate` on the shared 2-core VM, 2026-11-27, under load
    # (load average 2-5: other helpers' jobs and a benchmark of ours): the median of 10 runs,
    # the range in brackets (the small fixed figures move by 2x between runs)
    # a real sync pserver taking dense grads (big ones summed on arrival, on the bulk channel)
    # and sending params: `calibrate.measure_dense`'s slope between two nets of big grads
    # (the same vars: each var's own cost, `big_var_us`, cancels), the median of 11
    # calibrations at load average 3.5-10, 2026-11-27 (2.4-5.1e9). Before `big_var_us` the
    # built-in figure was 2.8e9, what ResNet-50's pservers pay per byte with their 29 big
    # vars' costs in it (run P: ~3e9); the one wide layer before that gave 1.33-1.96e9
    bandwidth: float = 4.2e9
    # a real sync pserver's CPU per RPC (a trainer's SendFetchBatch, a prefetch): the median
    # of 4 calibrations at load average 3.5-5.5, 2026-11-27 (674-727; per half call before,
    # 385 = 770 per call, the median of 10 runs read in /proc's 10 ms ticks)
    rpc_us: float = 685.0
    op_us: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_OP_US))
    # the sparse block's rates, the median of the same 4 calibrations: the merge became a
    # flat-index scatter-add (run L), 3-4x cheaper than the 10 runs before measured
    # (row_us 0.053, merge_us 0.0086, update_row_us 0.39)
    row_us: float = 0.029  # per sparse grad row the pserver's block merges (a lookup; 0.016-0.042)
    var_us: float = 0.0  # one more var in a request (8 grads in one SendBatch: 0 in 10 runs)
    block_us: float = 70.0  # one optimize block run with its vars (a sync round's CPU per partition: 53-123)
    id_us: float = 0.0  # per sparse grad row received, beyond its bytes and the block's work (0 in 3 runs)
    copy_us: float = 0.00041  # per element an async sparse update copies, every core copying (0.00033-0.00047)
    merge_us: float = 0.0024  # per element of a sparse grad row the block merges (sum's scatter-add; 0.0016-0.0038)
    fault_us: float = 0.000007  # more per element copied into an array over the mmap threshold (0-0.00008)
    source: str = "defaults"
    # a real pserver taking a sparse grad's rows (and sending prefetched rows): its CPU per
    # byte beyond the per-element merge and update (`merge_us`, the optimizer's rate); the
    # median of 3 runs on a 16k-row table (360-553 MB/s; 164-1,769 on the 100k-row table
    # before, whose whole-table copies per send swamped the slope)
    sparse_bandwidth: float = 4.4e8
    # per distinct row a sparse update writes (a sync pserver: in place), beside its
    # per-element `scale` and optimizer rates: the merged rows' sort, gathers and scatters
    update_row_us: float = 0.32  # (0.27-0.37)
    # the same on a sync pserver (the rows merged and updated in place, no copies): its CPU
    # per byte of sparse rows beyond the merge and the update, measured on a sync pserver
    # driven a round at a time (`calibrate.measure_sync_sparse`)
    sync_sparse_bandwidth: float = SYNC_SPARSE_BANDWIDTH
    # a prefetch's ids in and rows out, beside its call (`rpc_us`): the pserver's CPU per
    # byte (`calibrate.measure_prefetch`: a real sync pserver prefetched from 4,096 rows
    # against 8 a round, 64 floats wide); a gather and one reply, cheaper per byte than a
    # grad's rows, which are decoded, merged and written
    prefetch_bandwidth: float = PREFETCH_BANDWIDTH
    # per transfer of a dense var of `BIG_VAR_BYTES` or more (a trainer's grad in, its param
    # out; a smaller var its share by bytes), beside its bytes and its partition's `block_us`
    # (see `BIG_VAR_US`)
    big_var_us: float = BIG_VAR_US
    # per call of a trainer's batch on the bulk channel (a pserver with a dense var of
    # `BIG_VAR_BYTES` or more offers it: `ops.rpc.bulk.BULK_MIN`, `PSTRANSPILE_BULK=auto`),
    # where a gRPC call is `rpc_us` (see `BULK_RPC_US`)
    bulk_rpc_us: float = BULK_RPC_US
    # what calibrate measured of its own noise (`pstranspile calibrate`: each repeat's figure
    # of the rates it takes a median of), for the report; not used by the model
    noise: Mapping[str, Sequence[float]] = field(default_factory=dict)
    # per prefetch call (a trainer asking a table block for its rows, `prefetch` op), beside
    # its bytes (`prefetch_bandwidth`): a gather and one reply, about half a trainer's
    # SendFetchBatch (`rpc_us`), which carries grads, barriers and params (see PREFETCH_RPC_US)
    prefetch_rpc_us: float = PREFETCH_RPC_US

    def op(self, op_type: str, dtype: DType | None = None) -> float:
        """µs per element of `op_type` on `dtype` (float32 when None; float64 has its own
        rate `op@fp64`, or twice the float32 one; other dtypes are priced by their bytes)."""
        if dtype is not None and dtype.itemsize != 4:
            if dtype.itemsize == 8 and f"{op_type}{FP64_SUFFIX}" in self.op_us:
                return float(self.op_us[f"{op_type}{FP64_SUFFIX}"])
            return self.op(op_type) * dtype.itemsize / 4
        if op_type in self.op_us:
            return float(self.op_us[op_type])
        if op_type == SUM_ON_ARRIVAL:  # a table without it (built in Python): the `sum` op's rate
            return self.op("sum")
        if op_type in OPTIMIZER_SLOTS:  # an optimizer without its own rate: priced by its state
            slots = optimizer_slots(op_type)
            return float(self.op_us["sgd"]) + len(slots.sliced) * float(self.op_us["momentum"] - self.op_us["sgd"])
        raise TranspileError(f"no rate for op {op_type!r} in the rate table (known: {', '.join(sorted(self.op_us))})")

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": RATES_SCHEMA,
            "source": self.source,
            "units": {"bandwidth": "bytes/s", "rpc_us": "us per RPC", "op_us": "us per element",
                      "row_us": "us per sparse row", "var_us": "us per var in a batch",
                      "block_us": "us per optimize block run", "id_us": "us per id on a pserver",
                      "copy_us": "us per element copied by a sparse update",
                      "merge_us": "us per element of a merged sparse grad row",
                      "fault_us": "us more per element copied over the mmap threshold",
                      "sparse_bandwidth": "bytes/s of sparse rows (grads in, prefetched rows out), async pserver",
                      "sync_sparse_bandwidth": "bytes/s of sparse rows on a sync pserver",
                      "prefetch_bandwidth": "bytes/s of a prefetch's ids in and rows out",
                      "big_var_us": "us per dense var of 256 kB or more sent or fetched, per trainer (a smaller one: its share by bytes)",
                      "bulk_rpc_us": "us per batch call on the bulk channel",
                      "prefetch_rpc_us": "us per prefetch call",
                      "update_row_us": "us per distinct row a sparse update writes"},
            "bandwidth": self.bandwidth,
            "rpc_us": self.rpc_us,
            "row_us": self.row_us,
            "var_us": self.var_us,
            "block_us": self.block_us,
            "id_us": self.id_us,
            "copy_us": self.copy_us,
            "merge_us": self.merge_us,
            "fault_us": self.fault_us,
            "sparse_bandwidth": self.sparse_bandwidth,
            "sync_sparse_bandwidth": self.sync_sparse_bandwidth,
            "prefetch_bandwidth": self.prefetch_bandwidth,
            "big_var_us": self.big_var_us,
            "bulk_rpc_us": self.bulk_rpc_us,
            "prefetch_rpc_us": self.prefetch_rpc_us,
            "update_row_us": self.update_row_us,
            "op_us": dict(sorted(self.op_us.items())),
            "noise": {k: [float(v) for v in values] for k, values in sorted(self.noise.items())},
        }


def load_rates(path: str | Path | None) -> Rates:
    """Rates from `pstranspile calibrate`'s JSON (missing op rates keep their defaults), or
    the defaults for None."""
    if path is None:
        return Rates()
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise TranspileError(f"rates {path}: cannot read ({getattr(exc, 'strerror', None) or exc})") from None
    if not isinstance(data, dict) or data.get("schema") not in (RATES_SCHEMA, RATES_SCHEMA_V1):
        raise TranspileError(f"rates {path}: not a `pstranspile calibrate` file (schema {RATES_SCHEMA})")
    per_call = 2.0 if data.get("schema") == RATES_SCHEMA_V1 else 1.0  # a /1 file's rpc_us is half a call
    try:
        ops = dict(DEFAULT_OP_US)
        ops.update({str(k): float(v) for k, v in data.get("op_us", {}).items()})
        rates = Rates(float(data["bandwidth"]), per_call * float(data["rpc_us"]), ops, float(data.get("row_us", Rates.row_us)),
                      float(data.get("var_us", Rates.var_us)), float(data.get("block_us", Rates.block_us)),
                      float(data.get("id_us", Rates.id_us)), float(data.get("copy_us", Rates.copy_us)),
                      float(data.get("merge_us", Rates.merge_us)), float(data.get("fault_us", Rates.fault_us)),
                      str(path), float(data.get("sparse_bandwidth", Rates.sparse_bandwidth)),
                      float(data.get("update_row_us", Rates.update_row_us)),
                      float(data.get("sync_sparse_bandwidth", Rates.sync_sparse_bandwidth)),
                      float(data.get("prefetch_bandwidth", Rates.prefetch_bandwidth)),
                      float(data.get("big_var_us", Rates.big_var_us)),
                      float(data.get("bulk_rpc_us", Rates.bulk_rpc_us)),
                      {str(k): tuple(float(x) for x in v) for k, v in data.get("noise", {}).items()},
                      float(data.get("prefetch_rpc_us", Rates.prefetch_rpc_us)))
    except (KeyError, TypeError, ValueError) as exc:
        raise TranspileError(f"rates {path}: bad field ({exc})") from None
    if rates.bandwidth <= 0 or min(rates.sparse_bandwidth, rates.sync_sparse_bandwidth, rates.prefetch_bandwidth) <= 0 or min(rates.rpc_us, rates.row_us, rates.var_us, rates.block_us, rates.id_us,
                                   rates.copy_us, rates.merge_us, rates.fault_us, rates.update_row_us, rates.big_var_us,
                                   rates.bulk_rpc_us, rates.prefetch_rpc_us) < 0 or any(v < 0 for v in ops.values()):
        raise TranspileError(f"rates {path}: rates must be positive")
    return rates


# -- id statistics ---------------------------------------------------------------------------

class IdStats:
    """Access frequencies of a table's rows and the ids a trainer looks up per step.

    From a sample of ids (`from_sample`) or uniform over the rows (`uniform`). Per step each
    trainer draws `ids_per_step` ids independently with the sample's frequencies; the rows
    it sends (or prefetches) are the distinct ones: `E[distinct in S] = Σ_{i∈S} 1-(1-p_i)^n`.
    Range and residue-class queries are O(log n) / O(n) over the distinct sampled ids."""

    def __init__(self, ids, probs, height: int, ids_per_step: int, uniform: bool = False) -> None:
        import numpy as np

        self.height = int(height)
        self.ids_per_step = int(ids_per_step)
        self.uniform = uniform
        self.ids = np.asarray(ids, dtype=np.int64)
        self.probs = np.asarray(probs, dtype=np.float64)
        self._cum_p = np.concatenate([[0.0], np.cumsum(self.probs)])
        self._cum_u: dict[int, Any] = {}

    @classmethod
    def uniform_rows(cls, height: int, ids_per_step: int) -> IdStats:
        return cls([], [], height, ids_per_step, uniform=True)

    @classmethod
    def from_sample(cls, sample, height: int, ids_per_step: int) -> IdStats:
        import numpy as np

        flat = np.asarray(sample).reshape(-1).astype(np.int64)
        if flat.size == 0:
            raise TranspileError("the id sample is empty")
        if flat.min() < 0 or flat.max() >= height:
            bad = int(flat.min()) if flat.min() < 0 else int(flat.max())
            raise TranspileError(f"the id sample holds id {bad}, outside the table's {height} rows")
        ids, counts = np.unique(flat, return_counts=True)
        return cls(ids, counts / counts.sum(), height, ids_per_step)

    def _distinct_cum(self, draws: int):
        import numpy as np

        if draws not in self._cum_u:
            self._cum_u[draws] = np.concatenate([[0.0], np.cumsum(-np.expm1(draws * np.log1p(-np.minimum(self.probs, 1 - 1e-16))))])
        return self._cum_u[draws]

    def rows(self, start: int, end: int, trainers: int = 1) -> tuple[float, float]:
        """(lookups, distinct rows) per step among rows `[start, end)`, for `trainers`
        trainers' draws together."""
        draws = self.ids_per_step * trainers
        if self.uniform:
            count = max(0, min(end, self.height) - max(start, 0))
            p = 1.0 / self.height
            return draws * count * p, count * -math.expm1(draws * math.log1p(-p)) if p < 1 else float(count > 0)
        import numpy as np

        lo, hi = np.searchsorted(self.ids, [start, end])
        mass = float(self._cum_p[hi] - self._cum_p[lo])
        cum = self._distinct_cum(draws)
        return draws * mass, float(cum[hi] - cum[lo])

    def residue_rows(self, shard: int, shards: int, trainers: int = 1) -> tuple[float, float]:
        """(lookups, distinct rows) per step among ids with `id % shards == shard`."""
        draws = self.ids_per_step * trainers
        if self.uniform:
            count = len(range(shard, self.height, shards))
            p = 1.0 / self.height
            return draws * count * p, count * -math.expm1(draws * math.log1p(-p))
        mask = self.ids % shards == shard
        probs = self.probs[mask]
        import numpy as np

        return draws * float(probs.sum()), float(np.sum(-np.expm1(draws * np.log1p(-np.minimum(probs, 1 - 1e-16)))))


def read_id_sample(path: str | Path):
    """Ids from a `.npy` file (any integer shape; a 2-D `[samples, k]` array means k ids per
    sample) or a text file (whitespace- or comma-separated integers, a line per sample)."""
    import numpy as np

    path = Path(path)
    try:
        if path.suffix == ".npy":
            data = np.load(path, allow_pickle=False)
        else:
            lines = [line.replace(",", " ").split() for line in path.read_text().splitlines() if line.strip()]
            widths = {len(line) for line in lines}
            data = np.array(lines, dtype=np.int64) if len(widths) == 1 else np.array([v for line in lines for v in line], dtype=np.int64)
    except (OSError, ValueError) as exc:
        raise TranspileError(f"--id-sample {path}: cannot read ids ({getattr(exc, 'strerror', None) or exc})") from None
    if not np.issubdtype(data.dtype, np.integer):
        raise TranspileError(f"--id-sample {path}: ids must be integers, not {data.dtype}")
    if data.size == 0:
        raise TranspileError(f"--id-sample {path}: no ids")
    return data


def ids_per_sample(sample) -> int:
    return int(sample.shape[1]) if getattr(sample, "ndim", 1) == 2 else 1


# -- per-partition estimate ------------------------------------------------------------------

@dataclass
class Cost:
    """One partition's (or one pserver's) figures per step. Memory in bytes by kind."""

    memory: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MEMORY_KINDS, 0))
    bytes_in: float = 0.0
    bytes_out: float = 0.0
    rpcs: float = 0.0
    vars: float = 0.0  # vars carried in the send and fetch batches
    compute_us: float = 0.0
    lookups: float = 0.0  # ids looked up (or sent as grad rows) per step
    rows: float = 0.0  # distinct rows touched per step
    sparse_bytes: float = 0.0  # of bytes_in + bytes_out: sparse grad rows, ids and prefetched rows
    async_sparse_bytes: float = 0.0  # of sparse_bytes: an async job's grad rows (priced at `sparse_bandwidth`)
    prefetch_bytes: float = 0.0  # of sparse_bytes: prefetches' ids in and rows out (`prefetch_bandwidth`)
    big_vars: float = 0.0  # dense vars sent or fetched, in `BIG_VAR_BYTES` units up to one a var (`big_var_us` each)
    bulk_rpcs: float = 0.0  # of rpcs: the batches on the bulk channel (`bulk_rpc_us` each, not `rpc_us`)
    prefetch_rpcs: float = 0.0  # of rpcs: the prefetch calls (`prefetch_rpc_us` each, not `rpc_us`)

    def add(self, other: Cost) -> None:
        for kind, value in other.memory.items():
            self.memory[kind] += value
        self.bytes_in += other.bytes_in
        self.bytes_out += other.bytes_out
        self.rpcs += other.rpcs
        self.vars += other.vars
        self.compute_us += other.compute_us
        self.lookups += other.lookups
        self.rows += other.rows
        self.sparse_bytes += other.sparse_bytes
        self.async_sparse_bytes += other.async_sparse_bytes
        self.prefetch_bytes += other.prefetch_bytes
        self.big_vars += other.big_vars
        self.bulk_rpcs += other.bulk_rpcs
        self.prefetch_rpcs += other.prefetch_rpcs

    @property
    def memory_bytes(self) -> int:
        return sum(self.memory.values())

    def time_us(self, rates: Rates) -> float:
        dense = self.bytes_in + self.bytes_out - self.sparse_bytes
        synced = self.sparse_bytes - self.async_sparse_bytes - self.prefetch_bytes
        return (self.compute_us + dense / rates.bandwidth * 1e6 + synced / rates.sync_sparse_bandwidth * 1e6
                + self.async_sparse_bytes / rates.sparse_bandwidth * 1e6
                + self.prefetch_bytes / rates.prefetch_bandwidth * 1e6
                + (self.rpcs - self.bulk_rpcs - self.prefetch_rpcs) * rates.rpc_us + self.bulk_rpcs * rates.bulk_rpc_us
                + self.prefetch_rpcs * rates.prefetch_rpc_us
                + self.vars * rates.var_us + self.big_vars * rates.big_var_us)


@dataclass(frozen=True)
class Job:
    """What the estimate needs of the job besides the param."""

    trainers: int
    sync_mode: bool = True

    @property
    def per_trainer_grads(self) -> bool:
        return self.sync_mode and self.trainers > 1


def batch_rpcs(job: Job) -> int:
    """The RPCs a pserver holding a partition takes per step for the trainers' grads and
    params, beside any prefetch: in sync mode one `SendFetchBatch` per trainer (its grads,
    the send barrier, the params it fetches and the fetch barrier: `RpcClient.send_barrier(
    defer=True)`, what the kernels and `transpiler.replay` do), in async mode a `SendBatch`
    and a `FetchBatch` per trainer."""
    return job.trainers if job.sync_mode else 2 * job.trainers


def block_cost(optimizer: str, dtype: DType, start_row: int, rows: int, cols: int, job: Job, rates: Rates, *,
               sparse: bool = False, prefetch: bool = False, ids: IdStats | None = None,
               optimizer_attrs: Mapping[str, Any] | None = None, merged: bool = False) -> Cost:
    """One partition's cost (see the module docstring). Each partition has its own copy of
    the optimizer's `[1]` scalars (beta powers). `merged`: the trainer sends a sparse grad
    with its duplicate rows merged (it sums several lookups' grads: `ParamPlan.merged_grad`),
    a row per distinct id of its step, not a row per lookup."""
    slots = optimizer_slots(optimizer)
    size = dtype.itemsize
    n = rows * cols
    t = job.trainers
    cost = Cost()
    cost.memory["params"] = n * size
    cost.memory["merged_grads"] = n * size
    cost.memory["grad_buffers"] = t * n * size if job.per_trainer_grads else 0
    cost.memory["optimizer_state"] = (len(slots.sliced) * n + len(slots.unsliced)) * size
    cost.vars = 2 * t  # its grad in and its param (or rows) out, per trainer
    runs = 1 if job.sync_mode else t  # its optimize block: once a round, or once per grad
    if sparse:
        stats = ids or IdStats.uniform_rows(start_row + rows, 1)
        lookups, touched_one = stats.rows(start_row, start_row + rows, 1)
        _, touched_all = stats.rows(start_row, start_row + rows, t)
        cost.lookups, cost.rows = lookups * t, touched_one * t
        # the grad rows a pserver receives and merges: a row per lookup (ids repeating), or
        # per distinct id of each trainer's step when the trainer merged them
        grad_rows = (touched_one if merged else lookups) * t
        cost.bytes_in = grad_rows * (cols * size + ID_BYTES)
        if prefetch:  # rows asked for and sent, the param itself never received whole
            cost.bytes_in += t * touched_one * ID_BYTES
            cost.bytes_out = t * touched_one * cols * size
            cost.rpcs = cost.prefetch_rpcs = t  # a prefetch call per trainer per step (its own RPC, not in the batches)
        else:
            cost.bytes_out = t * n * size
        cost.sparse_bytes = cost.bytes_in + (cost.bytes_out if prefetch else 0.0)
        cost.prefetch_bytes = t * touched_one * (ID_BYTES + cols * size) if prefetch else 0.0
        cost.async_sparse_bytes = 0.0 if job.sync_mode else cost.sparse_bytes - cost.prefetch_bytes
        every = slots.updates_every_row((optimizer_attrs or {}).get) if optimizer_attrs is not None else slots.every_row
        updated = rows if every else (touched_all if job.sync_mode else touched_one * t)
        merge_rows = grad_rows
        cost.compute_us = (merge_rows * (rates.row_us + cols * rates.merge_us) + updated * cols * rates.op("scale", dtype)
                           + updated * cols * rates.op(optimizer, dtype) + (0.0 if every else updated * rates.update_row_us))
        if not job.sync_mode:
            cost.compute_us += (t - 1) * updated * cols * rates.op(optimizer, dtype) if every else 0.0
        # per grad row taken: the request work beside its bytes, on every partition the id
        # reaches (a column cut: on all of them)
        cost.compute_us += grad_rows * rates.id_us
        if not every and sparse_step_copies(optimizer, job.sync_mode):
            fresh = rates.fault_us if n * size >= MMAP_THRESHOLD else 0.0  # fresh pages each step
            cost.compute_us += runs * (1 + len(slots.sliced)) * n * (rates.copy_us + fresh) * size / 4  # per fp32
    else:
        cost.bytes_in = t * n * size
        cost.bytes_out = t * n * size
        if job.sync_mode:  # a big grad is summed as it arrives, a small one by the block's `sum`
            summed = SUM_ON_ARRIVAL if sums_on_arrival(n * size, job) else "sum"
            cost.compute_us = ((t - 1) * n * rates.op(summed, dtype) + n * rates.op("scale", dtype)
                               + n * rates.op(optimizer, dtype))
        else:
            cost.compute_us = t * n * rates.op(optimizer, dtype)
        # its grad in and its param out, each trainer: a var's own cost beside its bytes, whole
        # from `BIG_VAR_BYTES` on, a smaller var's share by its bytes
        cost.big_vars = 2 * t * min(1.0, n * size / BIG_VAR_BYTES)
    cost.compute_us += runs * rates.block_us
    return cost


def table_shard_cost(table, shard: int, job: Job, rates: Rates, ids: IdStats | None) -> Cost:
    """The distributed table's shard `shard` (`id % M`): its rows, its lookups and grad rows
    per step, its `sgd` on the rows touched."""
    shards = len(table.endpoints)
    size = table.dtype.itemsize
    width = math.prod(table.shape[1:])
    cost = Cost()
    cost.memory["table"] = math.prod(table.shard_shape) * size
    # The table's grads are SelectedRows declared at the table's full height (as Paddle
    # declares them): counted so, though at run time they hold one step's rows.
    cost.memory["merged_grads"] = math.prod(table.shape) * size
    cost.memory["grad_buffers"] = job.trainers * math.prod(table.shape) * size if job.per_trainer_grads else 0
    stats = ids or IdStats.uniform_rows(table.shape[0], 1)
    lookups, one = stats.residue_rows(shard, shards, 1)
    _, merged = stats.residue_rows(shard, shards, job.trainers)
    t = job.trainers
    cost.lookups, cost.rows = lookups * t, one * t
    sent = one if table.merged_grad else lookups  # grad rows per trainer (see block_cost's `merged`)
    cost.bytes_in = t * one * ID_BYTES + t * sent * (width * size + ID_BYTES)
    cost.bytes_out = t * one * width * size
    cost.sparse_bytes = cost.bytes_in + cost.bytes_out
    cost.prefetch_bytes = t * one * (ID_BYTES + width * size)  # the ids asked for, the rows sent
    cost.async_sparse_bytes = 0.0 if job.sync_mode else cost.sparse_bytes - cost.prefetch_bytes
    cost.rpcs = cost.prefetch_rpcs = t  # the prefetch (the grads travel in the batches)
    cost.vars = 2 * t
    cost.compute_us = (sent * t * (rates.row_us + width * rates.merge_us)
                       + merged * (width * rates.op("sgd", table.dtype) + rates.update_row_us)
                       + sent * t * rates.id_us
                       + (1 if job.sync_mode else t) * rates.block_us)
    return cost


def mod_shard_cost(optimizer: str, dtype: DType, shape: Sequence[int], shard: int, shards: int, job: Job,
                   rates: Rates, ids: IdStats | None, merged: bool = False) -> Cost:
    """The distributed table kept as Paddle shards it, `id % shards`, its shard `shard` under
    `optimizer` (the planner's `mod` candidate): `table_shard_cost`, plus the optimizer's
    sliced state as shards of the table's (the shard's shape), its scalar state, and its rate
    on the rows updated in place of `sgd`'s (an optimizer that updates every row: every row
    the shard may create)."""
    from transpiler.plan import TablePlan

    table = TablePlan("", "", tuple(shape), dtype, tuple(str(i) for i in range(shards)), merged_grad=merged)
    cost = table_shard_cost(table, shard, job, rates, ids)
    slots = optimizer_slots(optimizer)
    cost.memory["optimizer_state"] = (len(slots.sliced) * math.prod(table.shard_shape)
                                      + len(slots.unsliced)) * dtype.itemsize
    if optimizer != "sgd":
        width = math.prod(shape[1:])
        stats = ids or IdStats.uniform_rows(shape[0], 1)
        _, merged = stats.residue_rows(shard, shards, job.trainers)
        updated = table.shard_rows if slots.every_row else merged
        cost.compute_us += updated * width * rates.op(optimizer) - merged * width * rates.op("sgd")
    return cost


# -- per pserver -----------------------------------------------------------------------------

@dataclass
class PserverCost:
    endpoint: str
    cost: Cost
    partitions: list[str]
    time_us: float = 0.0


def plan_costs(plan, rates: Rates | None = None, ids: Mapping[str, IdStats] | None = None) -> list[PserverCost]:
    """Every pserver's predicted cost per step under `plan` (in endpoint order). `ids` maps
    a sparse param's (or the distributed table's) name to its id statistics; others are
    uniform with `ids_per_step` 1."""
    rates = rates or Rates()
    ids = ids or {}
    job = Job(plan.trainers, plan.sync_mode)
    out = {ep: PserverCost(ep, Cost(), []) for ep in plan.endpoints}
    bulk: set[str] = set()  # pservers with a dense var of BIG_VAR_BYTES or more: they offer the bulk channel
    for param in plan.params:
        width = math.prod(param.shape[1:]) if len(param.shape) >= 2 else 1
        for block, endpoint in zip(param.blocks, param.endpoints, strict=True):
            cols = block.cols if block.cols is not None else width
            rows = block.rows if param.shape else 1
            cost = block_cost(param.optimizer, param.dtype, block.row_offset, rows, cols, job, rates,
                              sparse=param.sparse, prefetch=param.remote_prefetch, ids=ids.get(param.param),
                              merged=param.merged_grad)
            out[endpoint].cost.add(cost)
            out[endpoint].partitions.append(block.name)
            if not param.sparse and rows * cols * param.dtype.itemsize >= BIG_VAR_BYTES:
                bulk.add(endpoint)
    if plan.table is not None:
        for shard, endpoint in enumerate(plan.table.endpoints):
            out[endpoint].cost.add(table_shard_cost(plan.table, shard, job, rates, ids.get(plan.table.table)))
            out[endpoint].partitions.append(f"{plan.table.table} shard {shard}")
    for row in out.values():
        if row.partitions:  # each trainer's batches (sync: one SendFetchBatch with the barriers)
            row.cost.rpcs += batch_rpcs(job)
            if row.endpoint in bulk:  # ... on the bulk channel, cheaper per call than gRPC's
                row.cost.bulk_rpcs += batch_rpcs(job)
    for row in out.values():
        row.time_us = row.cost.time_us(rates)
    return list(out.values())


# -- what the pserver programs declare -------------------------------------------------------

@dataclass
class DeclaredMemory:
    endpoint: str
    memory: dict[str, int]
    kinds: dict[str, str]  # var name -> kind
    runtime_sized: list[str]  # vars with a -1 dimension (batch-sized: 0 bytes here)

    @property
    def total(self) -> int:
        return sum(self.memory.values())


def declared_memory(plan, endpoint: str, program) -> DeclaredMemory:
    """The pserver program's global-block vars by kind (`MEMORY_KINDS`), bytes of their
    declared shapes. The kinds come from the plan (param blocks, merged grads, per-trainer
    grads, the table and its grads) and from the optimize blocks (an optimizer op's
    accumulator inputs are optimizer state); the rest is `other` (learning rate, ...)."""
    kinds: dict[str, str] = {}
    for param in plan.params:
        for block in param.blocks_on(endpoint):
            kinds[block.name] = "params"
            kinds[param.grad_block_name(block.index)] = "merged_grads"
            if plan.per_trainer_grads:
                for name in plan.trainer_grad_names(param, block.index):
                    kinds[name] = "grad_buffers"
    table = plan.table
    if table is not None and endpoint in table.endpoints:
        shard = table.endpoints.index(endpoint)
        kinds[table.table] = "table"
        kinds[table.grad] = "merged_grads"
        for trainer in range(plan.trainers):
            kinds[table.shard_grad_name(shard, trainer)] = "grad_buffers"
        kinds[table.shard_grad_name(shard, None)] = "merged_grads"  # what arrives without per-trainer copies
        kinds[table.prefetch_in(shard)] = "grad_buffers"
        kinds[table.prefetch_out(shard)] = "grad_buffers"
    for block in program.blocks:
        for op in block.ops:
            if op.type not in OPTIMIZER_SLOTS:
                continue
            for slot in optimizer_slots(op.type).accumulators:
                for name in op.inputs.get(slot, ()):
                    kinds.setdefault(name, "optimizer_state")
    memory = dict.fromkeys(MEMORY_KINDS, 0)
    found: dict[str, str] = {}
    runtime = []
    for name, var in program.global_block().vars.items():
        kind = kinds.get(name, "other")
        found[name] = kind
        memory[kind] += var_bytes(var)
        if var.shape is not None and any(int(d) < 0 for d in var.shape):
            runtime.append(name)
    return DeclaredMemory(endpoint, memory, found, runtime)


def format_bytes(value: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{int(value)} B"


def parse_bytes(text: str) -> int:
    """`8GiB`, `512MiB`, `1.5G`, `100000` -> bytes (K/M/G/T are powers of 1024 too, KB/MB/GB of 1000)."""
    import re

    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B?)\s*", text, re.IGNORECASE)
    if not match:
        raise TranspileError(f"{text!r} is not a size (e.g. 8GiB, 512MiB, 1000000)")
    number, prefix, suffix = float(match.group(1)), match.group(2).upper(), match.group(3).lower()
    power = "KMGT".index(prefix) + 1 if prefix else 0
    base = 1000 if suffix == "b" and prefix else 1024
    return int(number * base ** power)


def imbalance(values: Iterable[float]) -> float:
    values = list(values)
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean else 1.0


def summarize(plan, costs: Sequence[PserverCost], rates: Rates, declared: Mapping[str, DeclaredMemory] | None = None
              ) -> dict[str, Any]:
    """Every figure of the report as JSON-able data."""
    rows = []
    for row in costs:
        entry = {
            "endpoint": row.endpoint,
            "memory": dict(row.cost.memory),
            "memory_bytes": row.cost.memory_bytes,
            "bytes_in": round(row.cost.bytes_in),
            "bytes_out": round(row.cost.bytes_out),
            "rpcs": round(row.cost.rpcs, 3),
            "compute_ms": round(row.cost.compute_us / 1e3, 6),
            "est_ms": round(row.time_us / 1e3, 6),
            "lookups": round(row.cost.lookups, 3),
            "rows": round(row.cost.rows, 3),
            "partitions": list(row.partitions),
        }
        if declared is not None and row.endpoint in declared:
            found = declared[row.endpoint]
            entry["declared"] = dict(found.memory)
            entry["declared_bytes"] = found.total
            entry["runtime_sized"] = list(found.runtime_sized)
        rows.append(entry)
    columns = ["memory_bytes", "bytes_in", "bytes_out", "rpcs", "compute_ms", "est_ms", "lookups"]
    return {
        "units": {"memory": "bytes", "bytes_in": "bytes per step", "bytes_out": "bytes per step",
                  "rpcs": "per step", "compute_ms": "ms per step", "est_ms": "ms per step",
                  "lookups": "ids per step", "rows": "distinct rows per step (summed over trainers)"},
        "rates": rates.to_json(),
        "pservers": rows,
        "imbalance": {c: round(imbalance(r[c] for r in rows), 6) for c in columns},
        "est_step_ms": round(max((r["est_ms"] for r in rows), default=0.0), 6),
    }


# -- resident memory at run time ---------------------------------------------------------------

def resident_bytes(plan, endpoint: str, ids: Mapping[str, IdStats] | None = None) -> dict[str, int]:
    """What a pserver holds once warmed up, by kind (beside the process's own baseline):
    params and optimizer state as declared; a dense grad's merged var and per-trainer
    buffers; a sparse grad only its rows (`T·l` rows per buffer and merged, not the declared
    height); and, for an optimizer in `SPARSE_COPIES` on an async pserver, the copies of its param and state a
    step makes, whose freed pages the pserver keeps (`ops.rpc.malloc`: arrays under its
    mmap threshold are reused, larger ones go back to the kernel)."""
    ids = ids or {}
    out = dict.fromkeys(("params", "optimizer_state", "grads", "step_copies"), 0)
    t = plan.trainers
    for param in plan.params:
        slots = optimizer_slots(param.optimizer)
        width = math.prod(param.shape[1:]) if len(param.shape) >= 2 else 1
        size = param.dtype.itemsize
        for block in param.blocks_on(endpoint):
            cols = block.cols if block.cols is not None else width
            n = (block.rows if param.shape else 1) * cols
            out["params"] += n * size
            out["optimizer_state"] += (len(slots.sliced) * n + len(slots.unsliced)) * size
            if param.sparse:
                stats = ids.get(param.param) or IdStats.uniform_rows(param.shape[0], 1)
                lookups, distinct = stats.rows(block.row_offset, block.row_offset + block.rows, 1)
                copies = 2 if plan.per_trainer_grads else 1
                sent = distinct if param.merged_grad else lookups
                out["grads"] += round(copies * t * sent * (cols * size + ID_BYTES))
                if sparse_step_copies(param.optimizer, plan.sync_mode) and not slots.every_row:
                    for array in range(1 + len(slots.sliced)):
                        out["step_copies"] += n * size if n * size < MMAP_THRESHOLD else 0
            else:
                out["grads"] += n * size * (1 + (t if plan.per_trainer_grads else 0))
    return out
