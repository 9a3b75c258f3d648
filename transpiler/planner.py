"""The `plan` partitioner: cut and place every param to minimise the slowest pserver's
estimated time per step (the cost model, `transpiler/cost.py`), under a memory cap.

TorchRec's planner in small: an estimator (`block_cost`: memory by kind, bytes in and out,
RPCs and optimizer compute of one partition, with a table's id statistics), a proposer
(per param the candidate cuts: whole; `k` row bands of equal rows, and for a sparse
param also `k` row bands of equal estimated time (sized by the ids' frequencies: a
hot-first table gets a short hot band); `k` column ranges; `r x c` grids,
`k, r·c <= pservers`; a param whose pserver op needs whole rows gets no column cut; the
distributed table also `mod`: kept as Paddle shards it, `id % k` on k distinct pservers,
priced with `mod_shard_cost`, the ids' residue classes; `k < pservers` parts put a param on
a subset of the pservers) and a placer, greedy and deterministic:

1. the params go largest estimated time first (ties by name); `--colocate a,b` makes one
   unit of its params (cut the same way, partition i of each on the same pserver);
2. for each unit, every candidate cut is placed part by part (largest first) on the
   pserver with the least estimated time that has memory left (ties: the lower index,
   preferring a pserver not yet holding a part of this unit), and scored by its step bound
   (the larger of the slowest pserver's time and the mean time once the params still to
   place are added whole, or with `cores` (pservers sharing fewer cores than there are
   pservers, `--pserver-cores`) their total time over the cores); among the cuts within
   `tolerance` (TOLERANCE, 2%) of the least bound, the least bound on the slowest pserver,
   then the unit's added time, then its part count;
3. the best candidate is kept; if no candidate fits the cap, one `TranspileError` names
   the cap, the param and by how much the best placement is over;
4. a local search then moves a part off the slowest pserver, or swaps it with a smaller
   one, while that lowers the slowest time (`improve`; a shard of `id % k` stays put);
5. whole plans are compared (`choose`): the search's (at the tolerance and at 0; without
   the cores' bound too when `cores` is given) and Paddle's and `balanced`'s placements as
   seeds (`paddle_seed`, `balanced_seed`, each improved by step 4). The objective is
   lexicographic: the step bound (`max(slowest, total / cores)`), plans within the
   tolerance of the least counting as equal; then the lightest slowest pserver; then the
   fewest RPCs and bytes. Pareto first: when some plans are not worse than both baselines
   on both the bound and the slowest pserver, only those are compared, so the plan kept
   is never worse than Paddle's or `balanced`'s estimate on either measure when one
   exists.

The result depends only on the params, the pserver and trainer counts and the options (the
rates, the id sample, the cap): every trainer computes the same plan.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from transpiler.cost import Cost, IdStats, Job, Rates, batch_rpcs, block_cost, format_bytes, mod_shard_cost
from transpiler.errors import TranspileError
from transpiler.partition import Partition, Partitioner, ParamInfo

KINDS = ("whole", "row", "column", "2-D", "mod")

# Plans whose step bound is within TOLERANCE (relative) of the best one are equal on it: the
# next criterion (the slowest pserver) decides between them. Measured on the Zipf table on 2
# shared cores (RESULTS.md, run Q): at 10% the plan takes a third band, its slowest pserver
# 1.14x lighter than at 2% but the real job's steps/s x0.79; 2% keeps a cut that adds a
# pserver's fixed per-RPC work from passing as free.
TOLERANCE = 0.02


@dataclass(frozen=True)
class Candidate:
    kind: str
    grid: tuple[int, int]  # row bands x column ranges
    weighted: bool = False  # row bands of equal estimated time (a skewed table), not of equal rows
    # kind "mod": the distributed table kept as Paddle shards it, `id % k` on k distinct pservers


@dataclass
class _Part:
    index: int
    partitions: list[tuple[ParamInfo, Partition]]  # one per member of the unit
    time_us: float
    memory: int
    pinned: bool = False  # a shard of `id % k`: its pserver is fixed once placed (no two shards on one)
    rpcs: float = 0.0  # per step, as the cost model counts them
    nbytes: float = 0.0  # in and out per step


def even_cuts(total: int, count: int) -> list[tuple[int, int]]:
    """`count` near-equal ranges of `[0, total)` (the first `total % count` one longer)."""
    base, extra = divmod(total, count)
    out, start = [], 0
    for i in range(count):
        size = base + (1 if i < extra else 0)
        out.append((start, start + size))
        start += size
    return out


def grid_partitions(param: ParamInfo, grid: tuple[int, int]) -> list[Partition]:
    rows, cols = grid
    return [Partition(r0, r1, c0, c1) for r0, r1 in even_cuts(param.rows, rows) for c0, c1 in even_cuts(param.cols, cols)]


def candidates(params: Sequence[ParamInfo], servers: int, allowed: Iterable[str] = KINDS) -> list[Candidate]:
    """The cuts every param of a unit can take, in a fixed order."""
    allowed = set(allowed)
    rows = min(p.rows for p in params)
    cols = min(p.cols for p in params)
    column_ok = all(len(p.shape) <= 2 and not p.row_cuts_only for p in params)
    out = [Candidate("whole", (1, 1))] if "whole" in allowed else []
    if "row" in allowed:
        out += [Candidate("row", (k, 1)) for k in range(2, min(servers, rows) + 1)]
        if all(p.sparse for p in params):  # bands sized by the ids' frequencies
            out += [Candidate("row", (k, 1), weighted=True) for k in range(2, min(servers, rows) + 1)]
    if column_ok and "column" in allowed:
        out += [Candidate("column", (1, k)) for k in range(2, min(servers, cols) + 1)]
    if column_ok and "2-D" in allowed:
        out += [Candidate("2-D", (r, c)) for r in range(2, min(servers, rows) + 1)
                for c in range(2, min(servers // r, cols) + 1)]
    if "mod" in allowed and len(params) == 1 and params[0].distributed:
        out += [Candidate("mod", (k, 1)) for k in range(2, min(servers, rows) + 1)]
    return out


class PlanPartitioner(Partitioner):
    """`partitioner="plan"`: see the module docstring. `memory_cap` bytes per pserver (None:
    no cap), `colocate` groups of param names, `kinds` per param the cuts allowed (`KINDS`),
    `rates` (`transpiler.cost.Rates`), `ids` a table's `IdStats` by param name, `batch_size`
    the ids per trainer step of a sparse param without a sample (uniform ids), `cores` the
    CPU cores the pservers share when they share fewer than one each (None: a core or more
    each): their step then takes at least their total time over the cores, which the
    score's bound uses in place of the mean."""

    name = "plan"

    def __init__(self, *, memory_cap: int | None = None, colocate: Sequence[Sequence[str]] = (),
                 kinds: Mapping[str, Iterable[str]] | None = None, rates: Rates | None = None,
                 ids: Mapping[str, IdStats] | None = None, id_samples: Mapping[str | None, object] | None = None,
                 batch_size: int = 128, cores: int | None = None, baselines: bool = True,
                 tolerance: float = TOLERANCE) -> None:
        super().__init__()
        self.baselines = baselines
        if not 0 <= tolerance < 1:
            raise TranspileError(f"plan: the tolerance must be in [0, 1), got {tolerance}")
        self.tolerance = tolerance
        if cores is not None and cores < 1:
            raise TranspileError(f"plan: the pservers' cores must be >= 1, got {cores}")
        self.cores = cores
        if memory_cap is not None and memory_cap <= 0:
            raise TranspileError(f"plan: the pserver memory cap must be positive, got {memory_cap}")
        if batch_size < 1:
            raise TranspileError(f"plan: batch_size must be >= 1, got {batch_size}")
        self.memory_cap = memory_cap
        self.colocate = [tuple(group) for group in colocate]
        self.kinds = {name: tuple(k) for name, k in (kinds or {}).items()}
        for name, allowed in self.kinds.items():
            bad = [k for k in allowed if k not in KINDS]
            if bad or not allowed:
                raise TranspileError(f"plan: param {name!r}: unknown partition kind {bad[0] if bad else '(none)'!r} "
                                     f"(known: {', '.join(KINDS)})")
        self.rates = rates or Rates()
        self.ids = dict(ids or {})
        self.id_samples = dict(id_samples or {})
        self.batch_size = batch_size
        self._result: dict[str, tuple[list[Partition], list[int]]] = {}
        self._mod: dict[str, list[int]] = {}  # the distributed table kept `id % k`: its shards' pservers
        self.loads: list[float] = []  # estimated µs per step per pserver, after `prepare`
        self.memory: list[int] = []
        self.chosen_from = ""  # which whole plan was kept (`choose`), after `prepare`
        self.considered: list[dict] = []  # every whole plan's estimated measures, after `prepare`

    # -- the Partitioner protocol
    def prepare(self, params: Sequence[ParamInfo]) -> None:
        self._mod = {}
        self._result = self.search(params)

    def partitions(self, param: ParamInfo) -> list[Partition]:
        if param.name not in self._result:  # called without prepare (one param at a time)
            self._result.update(self.search([param]))
        return list(self._result[param.name][0])

    def assign(self, partitions: Sequence[Partition]) -> list[int]:
        return list(self._result[partitions[0].param.name][1])

    def table_shards(self, param: ParamInfo) -> list[int] | None:
        """For the distributed table, the pservers of its `id % k` shards (shard i on the
        i-th) when the plan keeps it sharded as Paddle does (the `mod` candidate); else
        None (cut as `partitions` says). The transpiler asks after `partitions`."""
        shards = self._mod.get(param.name)
        return None if shards is None else list(shards)

    # -- the search
    def _stats(self, params: Sequence[ParamInfo]) -> dict[str, IdStats]:
        from transpiler.cost import ids_per_sample

        stats = dict(self.ids)
        sparse = [p for p in params if p.sparse]
        for name, sample in self.id_samples.items():
            if name is None:
                if len(sparse) != 1:
                    raise TranspileError(f"plan: an id sample without a param name needs exactly one sparse param, "
                                         f"the program has {len(sparse)} ({', '.join(p.name for p in sparse) or 'none'})")
                name = sparse[0].name
            param = next((p for p in params if p.name == name and p.sparse), None)
            if param is None:
                raise TranspileError(f"plan: id sample for {name!r}, which is not a sparse param of the program")
            stats[name] = IdStats.from_sample(sample, param.rows, self.batch_size * ids_per_sample(sample))
        for param in sparse:
            stats.setdefault(param.name, IdStats.uniform_rows(param.rows, self.batch_size))
        return stats

    def _units(self, params: Sequence[ParamInfo]) -> list[list[ParamInfo]]:
        by_name = {p.name: p for p in params}
        taken: dict[str, int] = {}
        units: list[list[ParamInfo]] = []
        for group in self.colocate:
            missing = [n for n in group if n not in by_name]
            if missing:
                raise TranspileError(f"plan: --colocate names {missing[0]!r}, not a param of the program "
                                     f"(params: {', '.join(sorted(by_name)[:8])}{', ...' if len(by_name) > 8 else ''})")
            again = [n for n in group if n in taken]
            if again:
                raise TranspileError(f"plan: param {again[0]!r} is in two --colocate groups")
            for n in group:
                taken[n] = len(units)
            units.append([by_name[n] for n in dict.fromkeys(group)])
        units += [[p] for p in params if p.name not in taken]
        return units

    def part_cost(self, param: ParamInfo, part: Partition, job: Job, stats: Mapping[str, IdStats]) -> Cost:
        return block_cost(param.optimizer, param.dtype, part.start_row, part.rows, part.cols, job, self.rates,
                          sparse=param.sparse, prefetch=param.table, ids=stats.get(param.name),
                          merged=param.merged_grad)

    def _part(self, index: int, pieces: list[tuple[ParamInfo, Partition]], costs: Sequence[Cost],
              pinned: bool = False) -> _Part:
        """Part `index` of a unit (a partition per member) with its members' costs summed."""
        return _Part(index, pieces, sum(c.time_us(self.rates) for c in costs), sum(c.memory_bytes for c in costs),
                     pinned, sum(c.rpcs for c in costs), sum(c.bytes_in + c.bytes_out for c in costs))

    def _priced(self, index: int, pieces: list[tuple[ParamInfo, Partition]], job: Job,
                stats: Mapping[str, IdStats]) -> _Part:
        return self._part(index, pieces, [self.part_cost(p, piece, job, stats) for p, piece in pieces])

    def weighted_bands(self, unit: Sequence[ParamInfo], count: int, job: Job, stats: Mapping[str, IdStats]
                       ) -> list[tuple[int, int]]:
        """`count` row bands of the unit's params whose estimated times are near equal: band
        by band, the first cut where the band's time reaches its share of what is left (the
        rest's time plus a band's fixed cost per further band, over the bands left; a
        bisection per cut). A hot-first table gets a short first band."""
        rows = min(p.rows for p in unit)

        def time_of(start: int, end: int) -> float:
            return sum(self.part_cost(p, Partition(start, end, 0, p.cols), job, stats).time_us(self.rates) for p in unit)

        cuts = [0]
        for i in range(1, count):
            start, left = cuts[-1], count - i + 1
            fixed = min(time_of(start, start + 1), time_of(rows - 1, rows))  # a band's cost without ids
            target = (time_of(start, rows) + (left - 1) * fixed) / left
            lo, hi = start + 1, rows - (count - i)
            while lo < hi:
                mid = (lo + hi) // 2
                if time_of(start, mid) < target:
                    lo = mid + 1
                else:
                    hi = mid
            cuts.append(lo)
        cuts.append(rows)
        return list(zip(cuts[:-1], cuts[1:], strict=True))

    def search(self, params: Sequence[ParamInfo]) -> dict[str, tuple[list[Partition], list[int]]]:
        servers = max(1, self.servers)
        shared = servers if self.cores is None else min(servers, self.cores)
        job = Job(self.trainers, self.sync_mode)
        stats = self._stats(params)
        units = self._units(params)
        # each trainer's batches to every pserver (all are expected to hold a part): `batch_rpcs`
        base = batch_rpcs(job) * self.rates.rpc_us
        cap = self.memory_cap
        cache: dict[tuple[str, Candidate], list[_Part]] = {}

        def parts_of(unit: list[ParamInfo], cand: Candidate) -> list[_Part]:
            key = ("\0".join(p.name for p in unit), cand)
            if key not in cache:
                if cand.kind == "mod":
                    (param,) = unit
                    whole = Partition(0, param.rows, 0, param.cols)
                    cache[key] = [self._part(i, [(param, whole)], [mod_shard_cost(
                        param.optimizer, param.dtype, param.shape, i, cand.grid[0], job, self.rates,
                        stats.get(param.name), param.merged_grad)], pinned=True) for i in range(cand.grid[0])]
                    return cache[key]
                if cand.weighted:
                    bands = self.weighted_bands(unit, cand.grid[0], job, stats)
                    cut = [[Partition(r0, r1, 0, p.cols) for r0, r1 in bands] for p in unit]
                else:
                    cut = [grid_partitions(p, cand.grid) for p in unit]
                cache[key] = [self._priced(i, list(zip(unit, pieces, strict=True)), job, stats)
                              for i, pieces in enumerate(zip(*cut, strict=True))]
            return cache[key]

        if cap is not None:
            need = sum(p.memory for unit in units for p in parts_of(unit, Candidate("whole", (1, 1))))
            if need > servers * cap:
                raise TranspileError(f"no plan fits --pserver-memory {format_bytes(cap)}: the params with their "
                                     f"optimizer state and grad buffers need {format_bytes(need)}, {servers} pserver(s) "
                                     f"hold {format_bytes(servers * cap)} ({format_bytes(need - servers * cap)} over)")
        allowed = {}
        for unit in units:
            kinds = set(KINDS)
            for p in unit:
                kinds &= set(self.kinds.get(p.name, KINDS))
            allowed[unit[0].name] = kinds

        # the whole plans compared: the greedy search's (with the cores' bound, and without it
        # when the cores are fewer than the pservers), and Paddle's and `balanced`'s placements
        # as seeds, each improved by the local search; the baselines as they are
        plans = [_Plan("search", *self._greedy(units, servers, shared, base, cap, parts_of, allowed, self.tolerance))]
        if self.tolerance > 0:  # the least bound the search finds: what the tolerance is taken from, once
            plans.append(_Plan("search, least bound", *self._greedy(units, servers, shared, base, cap, parts_of,
                                                                    allowed, 0.0)))
        if shared < servers:
            try:
                plans.append(_Plan("search without --pserver-cores",
                                   *self._greedy(units, servers, servers, base, cap, parts_of, allowed,
                                                 self.tolerance)))
            except TranspileError:
                pass
        baselines = []
        seeds = (("paddle", paddle_seed), ("balanced", balanced_seed)) if self.baselines else ()
        for name, make in seeds:
            seed = make(params, servers)
            chosen = self._seeded(seed, units, allowed, job, stats, parts_of)
            if chosen is None:
                continue
            loads, memory = _tally(chosen, servers, base)
            if cap is not None and max(memory) > cap:
                continue
            baselines.append(_Plan(name, chosen, loads, memory))
            copy = [(u, parts, list(where)) for u, parts, where in chosen]
            loads, memory = list(loads), list(memory)
            improve(copy, loads, memory, cap)
            plans.append(_Plan(f"{name} improved", copy, loads, memory))
        for plan in plans:
            improve(plan.chosen, plan.loads, plan.memory, cap)
        pick, self.considered = choose(plans, baselines, shared, self.tolerance)
        self.chosen_from = pick.source
        result: dict[str, tuple[list[Partition], list[int]]] = {}
        for unit, parts, where in pick.chosen:
            if parts[0].pinned:  # `id % k`: the transpiler keeps the table whole, sharded by id
                (param,) = unit
                result[param.name] = ([Partition(0, param.rows, 0, param.cols)], [where[0]])
                self._mod[param.name] = list(where)
                continue
            for member_index, param in enumerate(unit):
                result[param.name] = ([part.partitions[member_index][1] for part in parts], list(where))
        self.loads, self.memory = list(pick.loads), list(pick.memory)
        return result

    def _greedy(self, units, servers: int, shared: int, base: float, cap: int | None, parts_of, allowed,
                tolerance: float):
        """The greedy placement (module docstring, steps 1-3) with the step bound over
        `shared` cores, each unit's cut chosen within `tolerance` of its least bound;
        (chosen, loads, memory)."""
        loads = [base] * servers
        memory = [0] * servers

        def place(parts: list[_Part]) -> tuple[list[int], float] | None | float:
            """Greedy placement of one candidate's parts; the servers per part, or the least
            overflow (bytes over the cap) when a part fits nowhere."""
            trial_loads, trial_mem = list(loads), list(memory)
            used: set[int] = set()
            where = [0] * len(parts)
            for part in sorted(parts, key=lambda p: (-p.time_us, -p.memory, p.index)):
                fits = [s for s in range(servers) if cap is None or trial_mem[s] + part.memory <= cap]
                if not fits:
                    return min(trial_mem[s] + part.memory - cap for s in range(servers)) + 0.0
                fresh = [s for s in fits if s not in used]
                if not fresh and part.pinned:  # two shards of `id % k` never share a pserver
                    return min(trial_mem[s] + part.memory - cap for s in range(servers)) + 0.0 if cap else math.inf
                fresh = fresh or fits
                best = min(fresh, key=lambda s: (trial_loads[s] + part.time_us, trial_mem[s], s))
                where[part.index] = best
                used.add(best)
                trial_loads[best] += part.time_us
                trial_mem[best] += part.memory
            return where, max(trial_loads), sum(trial_loads)

        whole = Candidate("whole", (1, 1))
        order = sorted(units, key=lambda u: (-sum(p.time_us for p in parts_of(u, whole)), u[0].name))
        remaining = sum(p.time_us for u in order for p in parts_of(u, whole))
        chosen: list[tuple[list[ParamInfo], list[_Part], list[int]]] = []
        for unit in order:
            remaining -= sum(p.time_us for p in parts_of(unit, whole))
            options = candidates(unit, servers, allowed[unit[0].name])
            if not options:
                raise TranspileError(f"plan: no partition kind is allowed for {' and '.join(p.name for p in unit)!r}")
            scored = []
            overflow = math.inf
            for index, cand in enumerate(options):
                parts = parts_of(unit, cand)
                placed = place(parts)
                if isinstance(placed, float):
                    overflow = min(overflow, placed)
                    continue
                where, slowest, total = placed
                # the step bound: the slowest pserver, or the mean load once the rest is placed
                # whole if that is higher (a cut's extra RPCs then count against it even while
                # pservers are idle); pservers sharing `cores` < servers cores: their total over
                # the cores. Then, among the cuts within TOLERANCE of the best bound, the least
                # bound on the slowest pserver once the rest is placed (the larger of the slowest
                # and the mean over every pserver; with a core or more each, the bound itself),
                # the unit's added time, its part count.
                bound = max(slowest, (total + remaining) / shared)
                light = max(slowest, (total + remaining) / servers)
                scored.append(((bound, light, sum(p.time_us for p in parts), len(parts), index), parts, where))
            if not scored:
                names = " and ".join(f"{p.name!r} {list(p.shape)}" for p in unit)
                raise TranspileError(f"no plan fits --pserver-memory {format_bytes(cap)}: param {names} fits on no "
                                     f"pserver in any cut, the best is {format_bytes(overflow)} over the cap")
            limit = within(min(s[0][0] for s in scored), tolerance)
            _, parts, where = min((s for s in scored if s[0][0] <= limit),
                                  key=lambda s: (_key(s[0][1]), _key(s[0][2]), s[0][3], s[0][4]))
            for part in parts:
                loads[where[part.index]] += part.time_us
                memory[where[part.index]] += part.memory
            chosen.append((unit, parts, where))
        return chosen, loads, memory

    def _seeded(self, seed: Mapping[str, tuple[list[Partition], list[int]]], units, allowed, job: Job,
                stats: Mapping[str, IdStats], parts_of):
        """A baseline's placement (`paddle_seed`, `balanced_seed`) as the search's units and
        parts; None if it breaks a constraint (a colocated group cut or placed apart, a
        partition kind not allowed)."""
        chosen = []
        for unit in units:
            first = unit[0]
            cut, where = seed[first.name]
            if any(p.distributed for p in unit[1:]) or (first.distributed and len(unit) > 1):
                return None  # Paddle's `id % k` table shares its cut with nothing
            if first.distributed and cut == "mod":
                mod = Candidate("mod", (len(where), 1))
                if mod not in candidates(unit, len(where), allowed[first.name]):
                    return None
                chosen.append((unit, parts_of(unit, mod), list(where)))
                continue
            kind = "whole" if len(cut) == 1 else "row"
            if kind not in allowed[first.name]:
                return None
            rows = [(p.start_row, p.end_row) for p in cut]
            members = []
            for param in unit:
                mine, theirs = seed[param.name]
                if [(p.start_row, p.end_row) for p in mine] != rows or list(theirs) != list(where):
                    return None
                members.append(mine)
            parts = [self._priced(i, list(zip(unit, pieces, strict=True)), job, stats)
                     for i, pieces in enumerate(zip(*members, strict=True))]
            chosen.append((unit, parts, list(where)))
        return chosen




def within(best: float, tolerance: float = TOLERANCE) -> float:
    return best * (1 + tolerance) + 1e-6


def _key(value: float) -> float:
    return round(value, 6)


@dataclass
class _Plan:
    source: str
    chosen: list
    loads: list[float]
    memory: list[int]

    def measures(self, shared: int) -> dict[str, float]:
        parts = [part for _, parts, _ in self.chosen for part in parts]
        return {"bound_us": max(max(self.loads), sum(self.loads) / shared), "slowest_us": max(self.loads),
                "total_us": sum(self.loads), "rpcs": sum(p.rpcs for p in parts), "bytes": sum(p.nbytes for p in parts)}


def choose(plans: Sequence[_Plan], baselines: Sequence[_Plan], shared: int, tolerance: float = TOLERANCE
           ) -> tuple[_Plan, list[dict]]:
    """The plan kept, and every plan's measures (`PlanPartitioner.considered`): among the
    plans not worse than every baseline on both the step bound and the slowest pserver
    (all of them when none is), those within TOLERANCE of the least bound, then the
    lightest slowest pserver, the fewest RPCs, the fewest bytes, the first in order."""
    found = [p.measures(shared) for p in plans]
    base = [b.measures(shared) for b in baselines]
    pareto = [i for i, m in enumerate(found)
              if all(m["bound_us"] <= b["bound_us"] + 1e-6 and m["slowest_us"] <= b["slowest_us"] + 1e-6 for b in base)]
    pool = pareto or list(range(len(plans)))
    limit = within(min(found[i]["bound_us"] for i in pool), tolerance)
    pick = min((i for i in pool if found[i]["bound_us"] <= limit),
               key=lambda i: (_key(found[i]["slowest_us"]), _key(found[i]["rpcs"]), _key(found[i]["bytes"]), i))
    considered = [{"source": p.source, **{k: round(v, 3) for k, v in m.items()}, "dominates_baselines": i in pareto,
                   "chosen": i == pick} for i, (p, m) in enumerate(zip(plans, found, strict=True))]
    considered += [{"source": f"{b.source} (baseline)", **{k: round(v, 3) for k, v in m.items()}}
                   for b, m in zip(baselines, base, strict=True)]
    return plans[pick], considered


def _tally(chosen, servers: int, base: float) -> tuple[list[float], list[int]]:
    loads, memory = [base] * servers, [0] * servers
    for _, parts, where in chosen:
        for part in parts:
            loads[where[part.index]] += part.time_us
            memory[where[part.index]] += part.memory
    return loads, memory


def paddle_seed(params: Sequence[ParamInfo], servers: int, min_block_size: int = 8192
                ) -> dict[str, tuple[list[Partition] | str, list[int]]]:
    """Paddle's placement with its defaults (the `paddle` partitioner): each param cut by
    `slice_variable` (whole-row blocks of at least `min_block_size` elements, at most one per
    pserver), the blocks dealt round robin in program order, continuing from param to
    param; the distributed table `id % servers`, shard i on pserver i ("mod")."""
    out: dict[str, tuple[list[Partition] | str, list[int]]] = {}
    cursor = 0
    for param in params:
        if param.distributed:
            out[param.name] = ("mod", list(range(servers)))
            continue
        cut = _paddle_blocks(param, servers, min_block_size)
        out[param.name] = (cut, [(cursor + i) % servers for i in range(len(cut))])
        cursor = (cursor + len(cut)) % servers
    return out


def balanced_seed(params: Sequence[ParamInfo], servers: int, min_block_size: int = 8192
                  ) -> dict[str, tuple[list[Partition] | str, list[int]]]:
    """The `balanced` split method's placement: Paddle's blocks, the largest first, each on
    the pserver with the fewest elements (ties: the lower index; equal blocks in program
    order); the distributed table as Paddle shards it."""
    blocks = [(param.name, part) for param in params if not param.distributed
              for part in _paddle_blocks(param, servers, min_block_size)]
    load = [0] * servers
    where: dict[int, int] = {}
    for index in sorted(range(len(blocks)), key=lambda i: -blocks[i][1].numel):
        server = min(range(servers), key=lambda s: (load[s], s))
        load[server] += blocks[index][1].numel
        where[index] = server
    out: dict[str, tuple[list[Partition] | str, list[int]]] = {}
    for index, (name, part) in enumerate(blocks):
        cut, servers_of = out.setdefault(name, ([], []))
        cut.append(part)
        servers_of.append(where[index])
    for param in params:
        if param.distributed:
            out[param.name] = ("mod", list(range(servers)))
    return out


def _paddle_blocks(param: ParamInfo, servers: int, min_block_size: int) -> list[Partition]:
    from transpiler.plan import slice_sizes

    cut, row = [], 0
    for size in slice_sizes(param.shape, servers, min_block_size):
        rows = size // param.cols if param.cols else param.rows
        cut.append(Partition(row, row + rows, 0, param.cols))
        row += rows
    return cut


def improve(chosen, loads: list[float], memory: list[int], cap: int | None, rounds: int = 1000) -> None:
    """Local search after the greedy placement: move a part off the slowest pserver, or swap
    it with a smaller part of another pserver, whenever that lowers the larger of the two
    pservers' times below the slowest's (first such move in a fixed order; at most `rounds`).
    Fixes greedy's classic misses (sizes 3,3,2,2,2 on two pservers: 7|5 -> 6|6)."""
    placed = [(u, i) for u, (_, parts, _) in enumerate(chosen) for i in range(len(parts)) if not parts[i].pinned]

    def fits(server: int, delta: int) -> bool:
        return cap is None or memory[server] + delta <= cap

    for _ in range(rounds):
        slowest = max(range(len(loads)), key=lambda s: (loads[s], -s))
        top = loads[slowest]
        moved = False
        mine = [(u, i) for u, i in placed if chosen[u][2][i] == slowest]
        for u, i in sorted(mine, key=lambda k: (-chosen[k[0]][1][k[1]].time_us, k)):
            part = chosen[u][1][i]
            for other in range(len(loads)):
                if other == slowest:
                    continue
                if loads[other] + part.time_us < top - 1e-9 and fits(other, part.memory):
                    _move(chosen, loads, memory, u, i, other)
                    moved = True
                    break
                for v, j in placed:
                    if chosen[v][2][j] != other:
                        continue
                    twin = chosen[v][1][j]
                    gain = part.time_us - twin.time_us
                    if gain <= 1e-9 or loads[other] + gain >= top - 1e-9:
                        continue
                    if fits(other, part.memory - twin.memory) and fits(slowest, twin.memory - part.memory):
                        _move(chosen, loads, memory, u, i, other)
                        _move(chosen, loads, memory, v, j, slowest)
                        moved = True
                        break
                if moved:
                    break
            if moved:
                break
        if not moved:
            return


def _move(chosen, loads, memory, u: int, i: int, to: int) -> None:
    _, parts, where = chosen[u]
    part, frm = parts[i], where[i]
    loads[frm] -= part.time_us
    memory[frm] -= part.memory
    loads[to] += part.time_us
    memory[to] += part.memory
    where[i] = to
