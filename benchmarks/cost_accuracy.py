"""The cost model's time estimate against measured pservers, on three workloads.

    python3 benchmarks/cost_accuracy.py [--quick] [--only mlp resnet50 zipf] [--rounds 1]
                                        [--rates RATES.json] [--calibrate [--calibrated-out R.json]] [--json]

Workloads (sync, every pserver's CPU read from /proc, docs/planner.md#accuracy):

- `mlp`: the Paddle-built `mlp_adam_2ps` fixture (784-256-128-10, Adam) trained by
  `examples/train_program.py` under `pstranspile launch`, 2 trainers x 2 pservers, batch 64;
- `resnet50`: the Paddle-built `resnet50_momentum_4ps_sync` fixture (ResNet-50's 161 params,
  25.6M floats, Momentum), 2 trainers x 4 pservers, its pserver traffic REPLAYED: the real
  pservers (`serve_program` on the transpiled pserver programs, a process each) and two
  trainer processes that do what the trainer program's RPC ops do (`ops/rpc/kernels.py`:
  every `send` of a grad block of the declared shape and dtype, the deferred send barrier,
  every `recv` and the fetch barrier in one `SendFetchBatch` per pserver), without the
  forward and backward passes (training ResNet-50 in numpy takes minutes a step);
- `zipf`: `examples/train_ctr.py --variant local-table --rows 1000000 --width 64 --zipf 1.1
  --hot-first --batch 512` (a `[1M, 64]` fp32 table prefetched from its blocks, Adagrad),
  2 trainers x 4 pservers, Paddle's row blocks (round robin); the model is given an id
  sample drawn as the job draws its ids (`benchmarks/planner.py`).

Measured per pserver: **CPU ms per step**, its process's user + system CPU over the steady
steps (after `warm` steps) divided by the steps trainer 0 made meanwhile; and the job's
**wall step time**, trainer 0's ms per steady step. The model (`transpiler.cost.plan_costs`
with the built-in rates or `--rates`) estimates each pserver's ms per step (`est_ms`: CPU
work, the bytes at the calibrated pserver rate, the fixed per-RPC / per-var / per-block
costs); its step-time estimate is the slowest pserver's. Printed per pserver: predicted,
measured CPU (the median of `--rounds`; beside it the lowest and highest round and the
estimate over each, so a round outside 25% shows), their ratio; per workload: the slowest's ratio, Spearman's rank correlation of
predicted and measured, whether the slowest pserver is the same, and the pairwise order of
the pservers the measurement separates by more than `--tie` (10%: closer than that is within
the run-to-run noise of this machine, and no order is claimed). The wall step also counts
the trainers' own compute (and waiting), which the pserver model does not; it is printed
beside, not compared.

`--calibrate` runs `pstranspile calibrate` in the same process before the workloads (under
the load they will see) and reports the estimates with those rates too, beside the
built-in (or `--rates`) ones, against the same measurements (`--calibrated-out` saves them).
The calibration's own repeats (`Rates.noise`) are printed in its source line, each run's
load average (before, after) is kept with it and the range printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

FIXTURES = REPO / "tests" / "fixtures" / "paddle_programs"
ENV = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


# -- the replay harness ----------------------------------------------------------------------

_PSERVER = r"""
import sys
sys.path.insert(0, sys.argv[1])
from ops.rpc.serve import serve_program
from transpiler.ir import Program
main, startup = Program.load(sys.argv[2]), Program.load(sys.argv[3])
serve_program(main, startup, endpoint=sys.argv[4], ready=lambda server: print("ready", flush=True), log=None,
              timeout=600.0)
"""

_TRAINER = r"""
import sys, time
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/benchmarks")
from cost_accuracy import replay_trainer
replay_trainer(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6]))
"""


def replay_trainer(main_path: str, startup_path: str, trainer_id: int, steps: int, think: float) -> None:
    """A trainer that only talks (`transpiler.replay`); prints `step <k> <perf_counter>`
    after each step, then waits `think` seconds (its passes, not run)."""
    from ops.rpc.client import RpcClient
    from transpiler.ir import Program
    from transpiler.replay import replay

    client = RpcClient(trainer_id, timeout=600.0)
    replay(client, Program.load(main_path), Program.load(startup_path), steps,
           lambda step: (print(f"step {step} {time.perf_counter()}", flush=True), time.sleep(think)))
    client.close()


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_replay(result, steps: int, warm: int, think: float) -> dict:
    """Serve `result`'s pserver programs (a process each) and replay its trainers (each
    waiting `think` seconds between steps); the wall step excludes nothing (think included)."""
    eps = list(result.pservers)
    env = {**os.environ, **ENV}
    procs, trainers = [], []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for i, ep in enumerate(eps):
                main, startup = result.pservers[ep]
                Path(f"{tmp}/ps{i}.pb").write_bytes(main.to_bytes())
                Path(f"{tmp}/ps{i}_startup.pb").write_bytes(startup.to_bytes())
                procs.append(subprocess.Popen([sys.executable, "-c", _PSERVER, str(REPO), f"{tmp}/ps{i}.pb",
                                               f"{tmp}/ps{i}_startup.pb", ep], stdout=subprocess.PIPE, text=True,
                                              env=env))
            for proc in procs:
                if proc.stdout.readline().strip() != "ready":
                    raise SystemExit("replay: a pserver did not start")
            for t, (main, startup) in enumerate(result.trainer_programs):
                Path(f"{tmp}/t{t}.pb").write_bytes(main.to_bytes())
                Path(f"{tmp}/t{t}_startup.pb").write_bytes(startup.to_bytes())
                trainers.append(subprocess.Popen([sys.executable, "-c", _TRAINER, str(REPO), f"{tmp}/t{t}.pb",
                                                  f"{tmp}/t{t}_startup.pb", str(t), str(steps), str(think)],
                                                 stdout=subprocess.PIPE, text=True, env=env))
            marks = {}
            for line in trainers[0].stdout:
                _, step, at = line.split()
                step = int(step)
                if step in (warm, steps):
                    marks[step] = (float(at), [cpu_seconds(p.pid) for p in procs])
            for proc in trainers:
                if proc.wait(timeout=600) != 0:
                    raise SystemExit("replay: a trainer failed")
            for proc in procs:
                proc.wait(timeout=120)
        finally:
            for proc in [*trainers, *procs]:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    (t0, c0), (t1, c1) = marks[warm], marks[steps]
    made = steps - warm
    return {"step_ms": round((t1 - t0) / made * 1e3, 3),
            "pserver_cpu_ms": [round((b - a) / made * 1e3, 3) for a, b in zip(c0, c1, strict=True)]}


# -- launched jobs ---------------------------------------------------------------------------

def run_launch(name: str, pservers: int, trainers: int, command: list[str], steps: int, warm: int,
               launch_flags: list[str] = ()) -> dict:
    """A real job under `pstranspile launch`: trainer 0's wall ms per steady step and each
    pserver's CPU ms per step (its usage records, every 0.5 s, over the steady steps)."""
    from partition import steady_rate
    from transpiler.runtime.metrics import read_metrics

    with tempfile.TemporaryDirectory() as tmp:
        launch = [sys.executable, "-m", "transpiler", "launch", "--pservers", str(pservers), "--trainers",
                  str(trainers), "--log-dir", f"{tmp}/logs", "-q", "--timeout", "900", *launch_flags, "--",
                  sys.executable, *command, "--steps", str(steps)]
        done = subprocess.run(launch, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=3600,
                              check=False)
        if done.returncode != 0:
            raise SystemExit(f"{name}: the job failed\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        records = read_metrics(f"{tmp}/logs")
    steps_per_s, mine = steady_rate(name, records, warm)
    times, done_steps = [r["time"] for r in mine], [r["step"] for r in mine]
    cpu = []
    for p in range(pservers):
        usage = sorted((r for r in records if r.get("role") == "pserver" and r.get("pserver") == p),
                       key=lambda r: r["time"])
        usable = [r for r in usage if times[0] <= r["time"] <= times[-1]
                  and float(np.interp(r["time"], times, done_steps)) >= warm]
        if len(usable) < 2:
            raise SystemExit(f"{name}: pserver {p} made {len(usable)} usage report(s) in the steady steps: "
                             "run more --steps")
        a, b = usable[0], usable[-1]
        made = float(np.interp(b["time"], times, done_steps) - np.interp(a["time"], times, done_steps))
        cpu.append(round((b["cpu_seconds"] - a["cpu_seconds"]) / made * 1e3, 3))
    return {"step_ms": round(1e3 / steps_per_s, 3), "pserver_cpu_ms": cpu}


# -- the workloads ---------------------------------------------------------------------------

def fixture_programs(name: str):
    from transpiler.ir import Program

    return Program.load(FIXTURES / name / "main.pb"), Program.load(FIXTURES / name / "startup.pb")


class Workload:
    name = ""
    pservers = trainers = 2

    def endpoints(self) -> list[str]:
        from transpiler.runtime.launch import free_endpoints

        return free_endpoints(self.pservers)

    def predict(self, rates) -> list[float]:
        from transpiler.cost import plan_costs

        result = self.transpile(self.endpoints())
        return [round(c.time_us / 1e3, 3) for c in plan_costs(result.plan, rates, self.id_stats())]

    def id_stats(self):
        return None


class Mlp(Workload):
    name, pservers, trainers, batch = "mlp", 2, 2, 64
    fixture = "mlp_adam_2ps"
    float64 = False

    def transpile(self, eps):
        from transpiler.api import as_float64, transpile

        main, startup = fixture_programs(self.fixture)
        if self.float64:
            main, startup = as_float64(main), as_float64(startup)
        return transpile(main, startup, pservers=eps, trainers=self.trainers)

    def measure(self, steps: int, warm: int) -> dict:
        loss = json.loads((FIXTURES / self.fixture / "case.json").read_text())["loss"]
        command = [str(REPO / "examples" / "train_program.py"), "--main", str(FIXTURES / self.fixture / "main.pb"),
                   "--startup", str(FIXTURES / self.fixture / "startup.pb"), "--loss", loss,
                   "--batch", str(self.batch), *(["--float64"] if self.float64 else [])]
        return run_launch(self.name, self.pservers, self.trainers, command, steps, warm)


class Mlp64(Mlp):
    """The same MLP trained in float64 (`train_program.py --float64`): the `op@fp64` rates."""

    name, float64 = "mlp-fp64", True


class Resnet50(Workload):
    name, pservers, trainers = "resnet50", 4, 2
    fixture = "resnet50_momentum_4ps_sync"

    def transpile(self, eps, trainer_id: int = 0):
        from transpiler.api import transpile

        return transpile(*fixture_programs(self.fixture), pservers=eps, trainers=self.trainers,
                         trainer_id=trainer_id)

    think = 0.01  # seconds, as `pstranspile calibrate`'s replaying trainers (calibrate.THINK)

    def measure(self, steps: int, warm: int) -> dict:
        eps = self.endpoints()
        result = self.transpile(eps)
        result.trainer_programs = [(result.trainer, result.trainer_startup)]
        for t in range(1, self.trainers):
            other = self.transpile(eps, t)
            result.trainer_programs.append((other.trainer, other.trainer_startup))
        return run_replay(result, steps, warm, self.think)


class Zipf(Workload):
    name, pservers, trainers, batch = "zipf", 4, 2, 512
    partitioner = None  # Paddle's row blocks, round robin

    def transpile(self, eps):
        import planner
        from transpiler.api import transpile

        return transpile(*planner.programs(), pservers=eps, trainers=self.trainers, partitioner=self.partitioner)

    def id_stats(self):
        import planner
        from transpiler.cost import IdStats

        return {"emb": IdStats.from_sample(planner.id_sample(200_000), planner.ROWS,
                                           planner.ids_per_trainer_step(self.batch))}

    def measure(self, steps: int, warm: int) -> dict:
        import planner

        command = [str(REPO / "examples" / "train_ctr.py"), "--variant", "local-table", "--rows", str(planner.ROWS),
                   "--width", str(planner.WIDTH), "--zipf", str(planner.ZIPF), "--hot-first",
                   "--batch", str(self.batch)]
        launch = ["--partitioner", self.partitioner] if self.partitioner else []
        return run_launch(self.name, self.pservers, self.trainers, command, steps, warm, launch)


class ZipfColumns(Zipf):
    """The same table cut into 4 column ranges (`--partitioner column`): every id visits
    every pserver (the per-id terms, four times over)."""

    name, partitioner = "zipf-column", "column"


WORKLOADS = {w.name: w for w in (Mlp(), Mlp64(), Resnet50(), Zipf(), ZipfColumns())}
# (steps, warm) per workload: full and --quick
# (resnet50: 26 steady steps, ~150 ms each; 9 read one pserver of four at 50 ms a step, the
# others at 44.4, in one run: 5 of /proc's 10 ms ticks, a pair "apart" by noise)
# (zipf: in place, ~20 steps per s: usage reports come every 0.5 s)
STEPS = {"mlp": ((200, 20), (80, 10)), "mlp-fp64": ((200, 20), (80, 10)), "resnet50": ((30, 4), (8, 2)),
         "zipf": ((150, 15), (60, 8)), "zipf-column": ((150, 15), (60, 8))}


# -- comparing -------------------------------------------------------------------------------

def spearman(a, b) -> float:
    def ranks(values):
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return round(cov / var, 3) if var else 1.0


def apart(a: float, b: float, tie: float) -> bool:
    return max(a, b) > min(a, b) * (1 + tie)


def separated_pairs(measured, predicted, tie: float) -> tuple[int, int, int]:
    """Pairs of pservers the measurement separates by more than `tie`: (how many, how many
    the model orders alike, how many the model calls equal, within `tie`)."""
    pairs = agree = tied = 0
    for i in range(len(measured)):
        for j in range(i + 1, len(measured)):
            if not apart(measured[i], measured[j], tie):
                continue
            pairs += 1
            if not apart(predicted[i], predicted[j], tie):
                tied += 1
            else:
                agree += (measured[i] > measured[j]) == (predicted[i] > predicted[j])
    return pairs, agree, tied


def top(values, tie: float) -> set[int]:
    """The pservers within `tie` of the largest value."""
    return {i for i, v in enumerate(values) if v * (1 + tie) >= max(values)}


def compare(predicted, runs, tie: float) -> dict:
    """The estimate against the median over `runs` of each pserver's measured CPU; beside
    it each pserver's lowest and highest run (`cpu_range`) and the ratios to them
    (`ratio_range`: the estimate over the highest, over the lowest), so that a median
    within 25% with a run outside it shows."""
    cpu = [statistics.median(r["pserver_cpu_ms"][p] for r in runs) for p in range(len(predicted))]
    lows = [min(r["pserver_cpu_ms"][p] for r in runs) for p in range(len(predicted))]
    highs = [max(r["pserver_cpu_ms"][p] for r in runs) for p in range(len(predicted))]
    step = statistics.median(r["step_ms"] for r in runs)
    pairs, agree, tied = separated_pairs(cpu, predicted, tie)
    slowest = max(range(len(cpu)), key=lambda i: cpu[i])
    return {"est_ms": predicted, "pserver_cpu_ms": cpu, "ratio": [round(p / m, 3) for p, m in zip(predicted, cpu, strict=True)],
            "est_step_ms": max(predicted), "slowest_cpu_ms": cpu[slowest],
            "step_ratio": round(max(predicted) / cpu[slowest], 3), "wall_step_ms": step,
            "spearman": spearman(predicted, cpu), "slowest_matches": bool(top(cpu, tie) & top(predicted, tie)),
            "separated_pairs": pairs, "pairs_agree": agree, "pairs_model_tied": tied,
            "spread_measured": round(max(cpu) / min(cpu), 3), "spread_model": round(max(predicted) / min(predicted), 3),
            "cpu_range": [[lo, hi] for lo, hi in zip(lows, highs, strict=True)],
            "ratio_range": [[round(p / hi, 3), round(p / lo, 3)] for p, lo, hi in zip(predicted, lows, highs, strict=True)],
            "runs": runs}


def main() -> int:
    from transpiler.cost import load_rates

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps per job")
    parser.add_argument("--only", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=1, help="measure each workload this many times (medians)")
    parser.add_argument("--tie", type=float, default=0.10, help="measured pservers closer than this are not ordered")
    parser.add_argument("--rates", help="rates from `pstranspile calibrate` (default: the built-in ones)")
    parser.add_argument("--measured", type=Path, action="append", default=[],
                        help="take the runs of these earlier --json outputs instead of measuring (re-predict only)")
    parser.add_argument("--calibrate", action="store_true",
                        help="calibrate first, in this run and under its load, and report the estimates with "
                             "those rates beside the built-in (or --rates) ones")
    parser.add_argument("--calibrated-out", type=Path, help="with --calibrate: write the rates it measured here")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rates = load_rates(args.rates)
    in_run = None
    if args.calibrated_out and not args.calibrate:
        parser.error("--calibrated-out needs --calibrate")
    if args.calibrate:
        from transpiler.calibrate import calibrate

        load = os.getloadavg()[0]
        in_run = calibrate(progress=lambda text: print(f"calibrate: {text}", file=sys.stderr, flush=True))
        noise = "; ".join(f"{k} {', '.join(f'{v:.3g}' for v in vs)}" for k, vs in sorted(in_run.noise.items()))
        after = os.getloadavg()[0]
        in_run = dataclasses.replace(in_run, source=f"{in_run.source}, in this run (load average {load:.1f} before, "
                                                    f"{after:.1f} after; its repeats: {noise})")
        if args.calibrated_out:
            args.calibrated_out.write_text(json.dumps(in_run.to_json(), indent=1) + "\n")
    earlier: dict[str, list] = {}
    for path in args.measured:
        for name, found in json.loads(path.read_text())["workloads"].items():
            earlier.setdefault(name, []).extend(found["runs"])
    out = {}
    for name in args.only:
        work = WORKLOADS[name]
        steps, warm = STEPS[name][1 if args.quick else 0]
        predicted = work.predict(rates)
        runs = list(earlier.get(name, []))
        if args.measured and not runs:
            continue
        for _ in range(0 if runs else args.rounds):
            load = os.getloadavg()[0]
            runs.append({**work.measure(steps, warm), "load": [round(load, 2), round(os.getloadavg()[0], 2)]})
            print(f"{name}: {runs[-1]} (model {predicted})", file=sys.stderr, flush=True)
        out[name] = {"pservers": work.pservers, "trainers": work.trainers, "steps": steps, "warm": warm,
                     **compare(predicted, runs, args.tie)}
        if in_run is not None:
            out[name]["in_run"] = {k: v for k, v in compare(work.predict(in_run), runs, args.tie).items() if k != "runs"}
    if args.json:
        print(json.dumps({"rates": rates.source, "in_run_rates": in_run.to_json() if in_run else None,
                          "workloads": out}, indent=1))
        return 0
    report(rates.source, out, args.tie)
    if in_run is not None:
        print()
        report(in_run.source, {name: {**r["in_run"], "runs": r["runs"]} for name, r in out.items()}, args.tie)
    return 0


def report(source: str, out: dict, tie: float) -> None:
    print(f"rates: {source}; per pserver ms per step: model estimate vs measured CPU (from /proc)")
    print(f"{'workload':<11} {'pserver':>7} {'est ms':>9} {'cpu ms':>9} {'est/cpu':>8} {'cpu ms, runs':>15} "
          f"{'est/cpu, runs':>13}")
    for name, r in out.items():
        for p, (e, c, q) in enumerate(zip(r["est_ms"], r["pserver_cpu_ms"], r["ratio"], strict=True)):
            (lo, hi), (qlo, qhi) = r["cpu_range"][p], r["ratio_range"][p]
            print(f"{name:<11} {p:>7} {e:>9.2f} {c:>9.2f} {q:>8.3f} {f'{lo:.2f}-{hi:.2f}':>15} {f'{qlo:.2f}-{qhi:.2f}':>13}")
    print(f"{'workload':<11} {'est step':>9} {'slowest cpu':>11} {'ratio':>6} {'spread m/e':>11} {'spearman':>8} "
          f"{'slowest ok':>10} {'pairs ok/apart (tied)':>21} {'wall step ms':>12}")
    for name, r in out.items():
        pairs = f"{r['pairs_agree']}/{r['separated_pairs']} ({r['pairs_model_tied']})"
        spread = f"{r['spread_measured']:.2f}/{r['spread_model']:.2f}"
        print(f"{name:<11} {r['est_step_ms']:>9.2f} {r['slowest_cpu_ms']:>11.2f} {r['step_ratio']:>6.3f} {spread:>11} "
              f"{r['spearman']:>8.3f} {str(r['slowest_matches']):>10} {pairs:>21} {r['wall_step_ms']:>12.1f}")
    loads = [x for r in out.values() for run in r["runs"] for x in run.get("load", ())]
    if loads:
        print(f"load average over the runs: {min(loads):.1f}-{max(loads):.1f}")
    print("cpu ms: the median of the runs (their lowest-highest beside it, and the estimate over each); "
          f"spread: slowest / least loaded pserver, measured / estimated; pairs: the pservers the measurement puts more "
          f"than {tie:.0%} apart, the model orders alike / all (those it puts within {tie:.0%}: tied); "
          "the wall step includes the trainers' own compute")


if __name__ == "__main__":
    raise SystemExit(main())
