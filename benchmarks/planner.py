"""The cost model and the planner against real sync jobs (docs/planner.md).

    python3 benchmarks/planner.py [--steps 60] [--batch 512] [--rounds 3] [--rates RATES.json]
                                  [--only P ...] [--modes job replay] [--json] [--json-out FILE]

Workload: `examples/train_ctr.py --variant local-table --rows 1000000 --width 64 --zipf 1.1
--hot-first` (a `[1M, 64]` fp32 table prefetched from its blocks, ids Zipf(1.1) with the hot
ids the first rows; 3 slots of 1-4 ids per example), 2 trainers x 4 pservers, sync, under
four partitioners, interleaved (`--rounds` times, each round starting with the next one):

- `paddle`: Paddle's slicing and round robin (the default);
- `balanced`: Paddle's slicing, blocks placed largest first on the least-loaded pserver
  (the `balanced` split method, as a partitioner: `Balanced` below);
- `plan`: `--partitioner plan` with an id sample drawn as the job draws its ids
  (`ZipfPlan` below reads it from `PLANNER_BENCH_IDS`);
- `plan-cores`: the same told that the pservers share this machine's cores
  (`--pserver-cores`, `ZipfPlanShared`): the planner's lexicographic objective (the step
  bound within 2%, then the slowest pserver), never worse than `paddle`'s and `balanced`'s
  estimates on either when it can be (docs/planner.md);
- `plan-cores-10pct` (only with `--only`): `plan-cores` at a 10% tolerance (run Q).

and in two modes, alternating per round: `job` (the real training) and `replay` (the
trainers run `train_ctr.py --replay`: the batch's ids prefetched, SelectedRows grads of
those rows and the dense grads sent, the barriers; no forward or backward: the pservers
see the job's traffic, the trainers' CPU drops by their compute).

Per job: steady steps/s of trainer 0 (after the warm-up steps), each pserver's CPU
seconds per step (the difference of two of its usage records, divided by the steps
trainer 0 made between them), each trainer's CPU per step (`train_ctr.py`'s last line),
all of them summed (a step takes at least that over the machine's cores when they are
fewer than the processes) and the load average; beside them the model's estimate per
pserver (`plan_costs` with the same id statistics) and whether its ranking of the
pservers matches the measured one; last, the four ratios of each plan (steps/s and the
slowest pserver's CPU against `paddle` and against `balanced`). The model is per pserver: its estimated step is the
slowest pserver's time, which the measured step (1 / steps/s, trainers' own compute
included) bounds from above.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from transpiler.partition import Partitioner  # noqa: E402
from transpiler.planner import PlanPartitioner, balanced_seed  # noqa: E402
from transpiler.runtime.metrics import read_metrics  # noqa: E402


ROWS, WIDTH, ZIPF, TRAINERS, PSERVERS, SLOTS = 1_000_000, 64, 1.1, 2, 4, 3
CORES = os.cpu_count() or 1
PARTITIONERS = ("paddle", "balanced", "plan", "plan-cores")
EXTRA = ("plan-cores-10pct",)  # only with --only: the plan-cores objective at a 10% tolerance (run Q's comparison)
MODES = {"job": "the real job", "replay": "trainers replay the pserver traffic: real prefetch and grad rows, no compute"}
IDS_ENV, BATCH_ENV, RATES_ENV = "PLANNER_BENCH_IDS", "PLANNER_BENCH_IDS_PER_STEP", "PLANNER_BENCH_RATES"


class Balanced(Partitioner):
    """Paddle's slicing (min_block_size 8192), every block of every param placed largest
    first on the pserver with the fewest elements (the `balanced` split method)."""

    name = "balanced"

    def prepare(self, params) -> None:
        self._placed = balanced_seed(params, self.servers)  # the planner's own seed: one copy of the rule

    def partitions(self, param):
        return self._placed[param.name][0]

    def assign(self, partitions):
        return self._placed[partitions[0].param.name][1]


class ZipfPlan(PlanPartitioner):
    """`PlanPartitioner` with the id sample of `PLANNER_BENCH_IDS` (a .npy) for the table."""

    def __init__(self) -> None:
        from transpiler.cost import load_rates

        sample = np.load(os.environ[IDS_ENV])
        super().__init__(id_samples={"emb": sample}, batch_size=int(os.environ[BATCH_ENV]),
                         rates=load_rates(os.environ.get(RATES_ENV) or None))


class ZipfPlanShared(ZipfPlan):
    """`ZipfPlan` told that the pservers share this machine's cores (`--pserver-cores`)."""

    def __init__(self) -> None:
        super().__init__()
        self.cores = CORES


class ZipfPlanSharedLoose(ZipfPlanShared):
    """`ZipfPlanShared` with a 10% tolerance on the step bound (`PlanPartitioner(tolerance=)`)."""

    def __init__(self) -> None:
        super().__init__()
        self.tolerance = 0.1


def id_sample(count: int, seed: int = 7) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return ((rng.zipf(ZIPF, count) - 1) % ROWS).astype(np.int64)


def ids_per_trainer_step(batch: int) -> int:
    return round(batch / TRAINERS * SLOTS * 2.5)  # 3 slots of 1-4 ids (2.5 on average) per example


def programs():
    sys.path.insert(0, str(REPO / "examples"))
    from train_ctr import build_ctr

    return build_ctr("local-table", ROWS, WIDTH)


def partitioner_spec(name: str):
    return {"paddle": None, "balanced": "benchmarks.planner:Balanced", "plan": "benchmarks.planner:ZipfPlan",
            "plan-cores": "benchmarks.planner:ZipfPlanShared",
            "plan-cores-10pct": "benchmarks.planner:ZipfPlanSharedLoose"}[name]


def model(name: str, sample: np.ndarray, per_step: int, rates_path: str | None) -> dict:
    from transpiler.api import transpile
    from transpiler.cost import IdStats, load_rates, plan_costs

    main, startup = programs()
    eps = ",".join(f"127.0.0.1:{7100 + i}" for i in range(PSERVERS))
    spec = partitioner_spec(name)
    partitioner = None if spec is None else {"plan": ZipfPlan, "plan-cores": ZipfPlanShared, "balanced": Balanced,
                                             "plan-cores-10pct": ZipfPlanSharedLoose}[name]()
    result = transpile(main, startup, pservers=eps, trainers=TRAINERS, partitioner=partitioner)
    rates = load_rates(rates_path)
    stats = {"emb": IdStats.from_sample(sample, ROWS, per_step)}
    costs = plan_costs(result.plan, rates, stats)
    emb = result.plan.param("emb")
    return {"chosen_from": getattr(partitioner, "chosen_from", None), "est_ms": [round(c.time_us / 1e3, 3) for c in costs], "memory": [c.cost.memory_bytes for c in costs],
            "lookups": [round(c.cost.lookups, 1) for c in costs],
            "emb_grid": [len(band) for band in emb.bands()],
            "emb_blocks": [(b.row_offset, b.rows, ep) for b, ep in zip(emb.blocks, emb.endpoints, strict=True)]}


def run_job(name: str, steps: int, batch: int, env: dict, mode: str = "job") -> dict:
    """One job of `mode` (`job`: the real training; `replay`: the trainers replay the
    step's pserver traffic, `train_ctr.py --replay`) under partitioner `name`."""
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "transpiler", "launch", "--pservers", str(PSERVERS), "--trainers",
                   str(TRAINERS), "--log-dir", f"{tmp}/logs", "-q", "--timeout", "600"]
        spec = partitioner_spec(name)
        if spec is not None:
            command += ["--partitioner", spec]
        command += ["--", sys.executable, str(REPO / "examples" / "train_ctr.py"), "--variant", "local-table",
                    "--rows", str(ROWS), "--width", str(WIDTH), "--zipf", str(ZIPF), "--hot-first",
                    "--steps", str(steps), "--batch", str(batch)] + (["--replay"] if mode == "replay" else [])
        for attempt in range(3):
            shutil.rmtree(f"{tmp}/logs", ignore_errors=True)
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600, check=False)
            # a free port the launcher picked, taken by another job on the machine before its pserver bound it
            if done.returncode == 0 or "is in use" not in done.stdout + done.stderr:
                break
            print(f"{name}: a pserver's port was taken meanwhile; again ({attempt + 1})", file=sys.stderr, flush=True)
        if done.returncode != 0:
            raise SystemExit(f"{name}: the job failed\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        records = read_metrics(f"{tmp}/logs")
        trainer_cpu = [trainer_cpu_ms(Path(f"{tmp}/logs/trainer.{t}.log")) for t in range(TRAINERS)]
    from partition import steady_rate  # benchmarks/partition.py, this script's folder: only the driver runs it

    warm = min(5, steps // 4)
    steps_per_s, mine = steady_rate(name, records, warm)

    def step_at(t: float) -> float:
        times = [r["time"] for r in mine]
        return float(np.interp(t, times, [r["step"] for r in mine]))

    cpu = []
    for p in range(PSERVERS):
        usage = sorted((r for r in records if r.get("role") == "pserver" and r.get("pserver") == p),
                       key=lambda r: r["time"])
        usable = [r for r in usage if step_at(r["time"]) >= warm]
        if len(usable) < 2:
            cpu.append(None)
            continue
        a, b = usable[0], usable[-1]
        made = step_at(b["time"]) - step_at(a["time"])
        cpu.append(round((b["cpu_seconds"] - a["cpu_seconds"]) / made * 1e3, 3) if made > 0 else None)
    known = [c for c in cpu if c is not None]
    return {"steps_per_s": round(steps_per_s, 3), "step_ms": round(1e3 / steps_per_s, 3), "pserver_cpu_ms": cpu,
            "trainer_cpu_ms": trainer_cpu, "pservers_cpu_ms": round(sum(known), 3),
            "total_cpu_ms": round(sum(known) + sum(trainer_cpu), 3), "load": round(load, 2)}


def trainer_cpu_ms(log: Path) -> float:
    """A trainer's CPU ms per step, from `train_ctr.py`'s last line (`CPU x ms/step`)."""
    for line in reversed(log.read_text().splitlines()):
        if "ms/step" in line and "CPU " in line:
            return float(line.rsplit("CPU ", 1)[1].split()[0])
    raise SystemExit(f"{log}: no `CPU x ms/step` line (train_ctr.py's summary)")


def ranking(values) -> list[int]:
    return sorted(range(len(values)), key=lambda i: -values[i])


def slowest(run: dict) -> float:
    return max(c for c in run["pserver_cpu_ms"] if c is not None)


def summarise(runs: list[dict], model_row: dict, name: str) -> dict:
    """Medians of a partitioner's runs in one mode, beside the model's estimate."""
    steps_per_s = statistics.median(r["steps_per_s"] for r in runs)
    cpu = [statistics.median(r["pserver_cpu_ms"][p] for r in runs if r["pserver_cpu_ms"][p] is not None)
           for p in range(PSERVERS)]
    est = model_row["est_ms"]
    return {"partitioner": name, "chosen_from": model_row["chosen_from"], "emb_grid": model_row["emb_grid"], "emb_blocks": model_row["emb_blocks"],
            "steps_per_s": steps_per_s,
            "step_ms": round(1e3 / steps_per_s, 3), "pserver_cpu_ms": cpu, "slowest_cpu_ms": max(cpu),
            "pservers_cpu_ms": statistics.median(r["pservers_cpu_ms"] for r in runs),
            "trainer_cpu_ms": statistics.median(statistics.mean(r["trainer_cpu_ms"]) for r in runs),
            "total_cpu_ms": statistics.median(r["total_cpu_ms"] for r in runs),
            # 2 cores: a step can take no less than all the processes' CPU of a step over the cores
            "cpu_bound_ms": round(statistics.median(r["total_cpu_ms"] for r in runs) / CORES, 3),
            "est_ms": est, "est_step_ms": max(est), "est_total_ms": round(sum(est), 3),
            "est_lookups": model_row["lookups"],
            "ranking_matches": ranking(cpu) == ranking(est), "slowest_matches": ranking(cpu)[0] == ranking(est)[0],
            "est_vs_slowest_cpu": round(max(est) / max(cpu), 3)}


def against(ref: str, rows: list[dict], runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Partitioner `ref`'s ratios against each other one: of the medians, and per round
    (the jobs of a round ran back to back, under the same load) with their median."""
    base = {r["partitioner"]: r for r in rows}
    if ref not in base:
        return {}
    out = {}
    for r in rows:
        if r["partitioner"] == ref:
            continue
        mine, theirs = runs[ref], runs[r["partitioner"]]
        found = {"speedup": round(base[ref]["steps_per_s"] / r["steps_per_s"], 3),
                 "slowest_cpu_ratio": round(r["slowest_cpu_ms"] / base[ref]["slowest_cpu_ms"], 3),
                 "total_cpu_ratio": round(r["total_cpu_ms"] / base[ref]["total_cpu_ms"], 3),
                 "speedup_per_round": [round(a["steps_per_s"] / b["steps_per_s"], 3)
                                       for a, b in zip(mine, theirs, strict=True)],
                 "slowest_cpu_ratio_per_round": [round(slowest(b) / slowest(a), 3)
                                                 for a, b in zip(mine, theirs, strict=True)],
                 "total_cpu_ratio_per_round": [round(b["total_cpu_ms"] / a["total_cpu_ms"], 3)
                                               for a, b in zip(mine, theirs, strict=True)]}
        for key in ("speedup", "slowest_cpu_ratio", "total_cpu_ratio"):
            found[f"{key}_median_of_rounds"] = statistics.median(found[f"{key}_per_round"])
        found["wins_both_rounds"] = sum(a > 1 and b > 1 for a, b in zip(
            found["speedup_per_round"], found["slowest_cpu_ratio_per_round"], strict=True))
        out[r["partitioner"]] = found
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=512, help="the global batch (default 512)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rates", help="rates from `pstranspile calibrate` (default: the built-in ones)")
    parser.add_argument("--only", nargs="*", choices=PARTITIONERS + EXTRA, default=list(PARTITIONERS))
    parser.add_argument("--modes", nargs="*", choices=MODES, default=list(MODES),
                        help="job: the real training; replay: the trainers replay the pserver traffic only "
                             "(default: both, interleaved)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--json-out", metavar="FILE", help="also write the --json output to FILE")
    args = parser.parse_args()
    per_step = ids_per_trainer_step(args.batch)
    runs: dict[str, dict[str, list[dict]]] = {mode: {name: [] for name in args.only} for mode in args.modes}
    with tempfile.TemporaryDirectory() as tmp:
        sample = id_sample(200_000)
        np.save(f"{tmp}/ids.npy", sample)
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1", IDS_ENV: f"{tmp}/ids.npy", BATCH_ENV: str(per_step)}
        if args.rates:
            env[RATES_ENV] = str(Path(args.rates).resolve())
        os.environ.update({IDS_ENV: env[IDS_ENV], BATCH_ENV: env[BATCH_ENV], RATES_ENV: env.get(RATES_ENV, "")})
        models = {name: model(name, sample, per_step, args.rates) for name in args.only}
        for round_index in range(args.rounds):
            shift = round_index % len(args.only)  # each partitioner first in turn: no place in the round favoured
            for mode in args.modes[round_index % len(args.modes):] + args.modes[:round_index % len(args.modes)]:
                for name in args.only[shift:] + args.only[:shift]:
                    run = run_job(name, args.steps, args.batch, env, mode)
                    runs[mode][name].append(run)
                    print(f"round {round_index} {mode} {name}: {run}", file=sys.stderr, flush=True)
    tables, ratios = {}, {}
    for mode in args.modes:
        rows = [summarise(runs[mode][name], models[name], name) for name in args.only]
        tables[mode] = rows
        ratios[mode] = {ref: against(ref, rows, runs[mode]) for ref in ("plan", "plan-cores", "plan-cores-10pct")
                        if ref in args.only}
    found = json.dumps({"batch": args.batch, "steps": args.steps, "ids_per_trainer_step": per_step, "cores": CORES,
                        "modes": tables, "ratios": ratios, "runs": runs}, indent=1)
    if args.json_out:
        Path(args.json_out).write_text(found + "\n")
    if args.json:
        print(found)
        return 0
    print(f"[1M, 64] table, Zipf({ZIPF}) hot-first, {TRAINERS} trainers x {PSERVERS} pservers on {CORES} cores, "
          f"batch {args.batch}, {args.steps} steps, {args.rounds} round(s), load average "
          f"{min(r['load'] for m in runs.values() for rs in m.values() for r in rs):.1f}-"
          f"{max(r['load'] for m in runs.values() for rs in m.values() for r in rs):.1f}")
    for mode, rows in tables.items():
        print(f"-- {mode} ({MODES[mode]})")
        print(f"{'partitioner':<10} {'steps/s':>8} {'step ms':>8} {'slowest ps':>10} {'all ps':>7} {'trainer':>8} "
              f"{'all cpu/2':>9} {'est ms':>7}  per-pserver cpu ms (measured) | est ms (model)")
        for r in rows:
            print(f"{r['partitioner']:<10} {r['steps_per_s']:>8.2f} {r['step_ms']:>8.2f} {r['slowest_cpu_ms']:>10.2f} "
                  f"{r['pservers_cpu_ms']:>7.2f} {r['trainer_cpu_ms']:>8.2f} {r['cpu_bound_ms']:>9.2f} "
                  f"{r['est_step_ms']:>7.2f}  {r['pserver_cpu_ms']} | {r['est_ms']}")
        for ref, found in ratios[mode].items():
            print(f"{ref} against each (ratio of medians; median of the per-round ratios; per round):")
            for other, f in found.items():
                print(f"  vs {other:<10} steps/s x{f['speedup']:.3f}; x{f['speedup_median_of_rounds']:.3f} "
                      f"{f['speedup_per_round']}\n"
                      f"     slowest pserver CPU {other}/{ref} {f['slowest_cpu_ratio']:.3f}; "
                      f"{f['slowest_cpu_ratio_median_of_rounds']:.3f} {f['slowest_cpu_ratio_per_round']}\n"
                      f"     all processes' CPU {other}/{ref} {f['total_cpu_ratio']:.3f}; "
                      f"{f['total_cpu_ratio_median_of_rounds']:.3f} {f['total_cpu_ratio_per_round']}\n"
                      f"     rounds {ref} wins both (steps/s and slowest CPU): {f['wins_both_rounds']} of "
                      f"{len(f['speedup_per_round'])}")
    print("-- the four ratios (of the medians; > 1: the plan ahead): steps/s plan / other, slowest pserver CPU "
          "other / plan")
    for mode in args.modes:
        for ref, found in ratios[mode].items():
            cells = [f"steps/s x{found[o]['speedup']:.3f} vs {o}, slowest CPU {found[o]['slowest_cpu_ratio']:.3f}x "
                     f"vs {o}" for o in ("paddle", "balanced") if o in found]
            wins = all(found[o]["speedup"] > 1 and found[o]["slowest_cpu_ratio"] > 1 for o in ("paddle", "balanced")
                       if o in found)
            chosen = next(r["chosen_from"] for r in tables[mode] if r["partitioner"] == ref)
            print(f"{mode:<6} {ref:<10} ({chosen}): {'; '.join(cells)}; beats both on both: {'yes' if wins else 'no'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
