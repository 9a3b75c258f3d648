"""Interop: the programs pstranspile writes train on Fluid 1.8.5's own C++ runtime exactly as
the programs Fluid 1.8.5's DistributeTranspiler writes (issue 12).

    python tools/interop.py [--case NAME ...] [--work DIR] [--stagger SECONDS] [--start-barrier] [--repeat N]

Per case: Fluid 1.8.5 builds the program (tools/interop_paddle/paddle_side.py, run by the
Paddle venv's Python 3.7, made on demand by tools/paddle_env.py); (a) Paddle's transpiler and
(b) `pstranspile transpile` (our CLI, nothing else of ours) turn it into trainer and pserver
programs; each set runs on Paddle's runtime (pservers `exe.run(pserver_program)`, trainers
`exe.run(trainer_program)`, 127.0.0.1 only) from the same initial values on the same batches;
then the per-step losses of every trainer and the final params (trainer 0, after the last
recv; remote tables read back through the trainer's own prefetch ops) are compared.
Prints one line per case, then `interop: K/N cases equal`. Exit 0 when all are equal.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import paddle_env  # noqa: E402
from local_procs import free_ports  # noqa: E402

PADDLE_SIDE = ROOT / "tools" / "interop_paddle" / "paddle_side.py"
FIXTURES = ROOT / "tests" / "fixtures" / "paddle_programs"
RUN_TIMEOUT = 60.0       # seconds for one run's trainers
# seconds a pserver may take to exit after the trainers, then it is killed: Fluid 1.8.5's
# pservers (sync and async) did not exit on their own after every trainer's exe.close() here
PSERVER_GRACE = 1.0


@dataclass(frozen=True)
class Case:
    name: str
    what: str
    reference: str = "paddle"   # "paddle": Paddle's transpiler; "local": one Paddle process
    rtol: float = 0.0           # 0: bit-equal
    fixture: str = ""           # a folder of tests/fixtures/paddle_programs: its programs as they are
    partitioner: str = ""       # ours transpiled with `--partitioner` (Paddle's: its row slicing)


CASES = [
    Case("dense_sync", "MLP 64-256-10, Adam, sliced fc_0.w_0, sync"),
    Case("fixture_basic_sgd", "Paddle's own test network x[1000] -> fc 1000, square error, SGD "
         "(fixture fluid18_basic_sgd_2ps), sync", fixture="fluid18_basic_sgd_2ps"),
    # Paddle's transpiler cuts rows only: the reference is its row-sliced programs, ours cut
    # the weights by columns (split axis 1 / concat axis 1 on the trainer), on 3 pservers
    Case("dense_column", "MLP 64-256-10, Adam, weights cut by columns (--partitioner column), sync",
         partitioner="column"),
    Case("conv_column", "conv2d 8x1x3x3 -> fc 10, Adam, every weight cut by columns (--partitioner column; "
         "the rank-4 filter as its [8, 9] matrix: reshape2 around split / concat), sync", partitioner="column"),
    Case("dense_async", "MLP, SGD, async, 1 trainer"),
    Case("lr_decay", "MLP, SGD on exponential_decay (lr-decay block on the pservers), sync"),
    Case("lr_piecewise_l2", "MLP, Momentum on piecewise_decay (conditional sub-blocks on the pservers), L2Decay, sync"),
    Case("sparse_prefetch", "2000x16 is_sparse embedding (remote prefetch, sliced), SGD, sync"),
    Case("sparse_async_adam", "the remote-prefetch table, Adam, async, 1 trainer"),
    # Fluid 1.8.5's transpiler raises IndexError on an is_distributed table (Paddle #26479):
    # the reference is Paddle training the program in one process on both trainers' batches;
    # a mean of two half-batch means is not bit-equal to the mean of the whole batch.
    Case("distributed_table", "2000x16 is_distributed embedding, SGD, sync", reference="local", rtol=1e-5),
    Case("distributed_table_async", "the is_distributed table, SGD, async, 1 trainer", reference="local"),
]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class CaseFailed(Exception):
    pass


def paddle_env_vars() -> dict[str, str]:
    env = dict(os.environ)
    env.update(paddle_env.PADDLE_SPEED_ENV)
    env.pop("PYTHONPATH", None)          # Paddle's side never sees our package
    env["PYTHONHASHSEED"] = "0"
    return env


def run_checked(cmd: list[str], what: str, timeout: float = 300.0, env: dict | None = None) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise CaseFailed(f"{what} timed out after {timeout:.0f} s") from None
    if done.returncode != 0:
        raise CaseFailed(f"{what} failed: {last_error(done.stderr)}")
    return done.stdout


def last_error(text: str) -> str:
    """The line of a log that says what went wrong (Paddle's error line, else the last one)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    for marker in ("Error:", "Error Message Summary", "EnforceNotMet", "Exception:"):
        hits = [i for i, line in enumerate(lines) if marker in line]
        if hits:
            i = hits[-1]
            if marker == "Error Message Summary" and i + 2 < len(lines):
                return lines[i + 2]
            return lines[i]
    return lines[-1] if lines else "(no output)"


def ours(args: list[str]) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return run_checked([sys.executable, "-m", "transpiler", *args], "pstranspile " + args[0], env=env)


def stop(proc: subprocess.Popen) -> None:
    """Stop a process this harness started, and its process group, by its own pid."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def run_programs(py: Path, case_dir: Path, progs: Path, spec: dict, eps: list[str], out: Path,
                 stagger: float = 0.0, start_barrier: bool = False) -> list[Path]:
    """The pservers, then the trainers (trainer i launched i * `stagger` seconds after trainer
    0), on Paddle's runtime; each trainer's result file."""
    env = paddle_env_vars()
    out.mkdir(parents=True, exist_ok=True)
    procs: list[tuple[str, subprocess.Popen, Path]] = []
    results = [out / f"trainer{i}.npz" for i in range(spec["trainers"])]
    try:
        for i, ep in enumerate(eps):
            log_path = out / f"pserver{i}.log"
            with open(log_path, "w") as log_file:
                procs.append((f"pserver {ep}", subprocess.Popen(
                    [str(py), str(PADDLE_SIDE), "pserver", str(case_dir), str(progs), ep, str(out)],
                    stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True), log_path))
        trainers = []
        for i in range(spec["trainers"]):
            if i and stagger:
                time.sleep(stagger)
            log_path = out / f"trainer{i}.log"
            with open(log_path, "w") as log_file:
                proc = subprocess.Popen(
                    [str(py), str(PADDLE_SIDE), "trainer", str(case_dir), str(progs), str(i), str(results[i])]
                    + (["--start-barrier"] if start_barrier else []),
                    stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            procs.append((f"trainer {i}", proc, log_path))
            trainers.append((f"trainer {i}", proc, log_path))
        deadline = time.monotonic() + RUN_TIMEOUT
        for name, proc, log_path in trainers:
            while proc.poll() is None:
                for other, oproc, opath in procs:
                    if other.startswith("pserver") and oproc.poll() not in (None, 0, -signal.SIGKILL):
                        raise CaseFailed(f"{other} exited {oproc.returncode}: {last_error(opath.read_text())}")
                if time.monotonic() > deadline:
                    raise CaseFailed(f"{name} still running after {RUN_TIMEOUT:.0f} s: {last_error(log_path.read_text())}")
                time.sleep(0.2)
            if proc.returncode != 0:
                raise CaseFailed(f"{name} exited {proc.returncode}: {last_error(log_path.read_text())}")
        grace = time.monotonic() + PSERVER_GRACE
        for name, proc, _ in procs:
            while proc.poll() is None and time.monotonic() < grace:
                time.sleep(0.1)
    finally:
        for name, proc, _ in procs:
            stop(proc)
            if name.startswith("pserver"):
                paddle_env.remove_port_file(proc.pid)
    return results


def run_local(py: Path, case_dir: Path, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    result = out / "local.npz"
    run_checked([str(py), str(PADDLE_SIDE), "local", str(case_dir), str(result)], "local Paddle run",
                env=paddle_env_vars())
    return [result]


def transpile_ours(case_dir: Path, progs: Path, spec: dict, eps: list[str], partitioner: str = "") -> None:
    """Our CLI once per trainer id; the pserver programs (the same for every id) beside them."""
    for tid in range(spec["trainers"]):
        args = ["transpile", str(case_dir / "main.pb"), "--startup", str(case_dir / "startup.pb"),
                "--pservers", ",".join(eps), "--trainers", str(spec["trainers"]), "--trainer-id", str(tid),
                "-o", str(progs / f"t{tid}"), "--clip-mode", "trainer"]  # Fluid's runtime has no cross-pserver sum
        if not spec["sync"]:
            args.append("--async")
        if partitioner:
            args += ["--partitioner", partitioner]
        ours(args)
    for path in sorted((progs / "t0").glob("pserver_*.pb")):
        for tid in range(1, spec["trainers"]):
            if (progs / f"t{tid}" / path.name).read_bytes() != path.read_bytes():
                raise CaseFailed(f"our {path.name} differs between trainer ids 0 and {tid}")
        shutil.copy(path, progs / path.name)
    if partitioner:  # where each 2-D partition lies, for the pservers' initial values
        shutil.copy(progs / "t0" / "plan.json", progs / "plan.json")


def compare(case: Case, spec: dict, ref: list[Path], got: list[Path]) -> tuple[str, int, float]:
    """(what differs, '' when equal: bit-equal, or within case.rtol of each array's max |value|;
    how many arrays were compared; the worst relative difference under a tolerance)."""
    problems = []
    worst = 0.0
    ref_data = [dict(np.load(p)) for p in ref]
    got_data = [dict(np.load(p)) for p in got]
    if case.reference == "local":
        # one process on the whole batches: its loss is the mean of the trainers' half-batch losses
        pairs = [("losses (mean over trainers)", ref_data[0]["losses"],
                  np.mean([d["losses"] for d in got_data], axis=0))]
    else:
        pairs = [(f"trainer {i} losses", r["losses"], g["losses"]) for i, (r, g) in enumerate(zip(ref_data, got_data))]
    names = spec["params"] + [t["name"] for t in spec["tables"]]
    pairs += [(name, ref_data[0]["param:" + name], got_data[0]["param:" + name]) for name in names]
    for what, a, b in pairs:
        if a.shape != b.shape:
            problems.append(f"{what}: shape {list(a.shape)} vs {list(b.shape)}")
            continue
        if case.rtol == 0.0:
            if not np.array_equal(a, b):
                diff = float(np.max(np.abs(a.astype("float64") - b)))
                problems.append(f"{what}: max |diff| {diff:.3g}")
        else:
            scale = float(np.max(np.abs(a))) or 1.0
            diff = float(np.max(np.abs(a.astype("float64") - b)))
            worst = max(worst, diff / scale)
            if diff > case.rtol * scale:
                problems.append(f"{what}: max |diff| {diff:.3g} > {case.rtol:g} x {scale:.3g}")
    return "; ".join(problems), len(pairs), worst


def startup_values(run: Path) -> dict[str, np.ndarray]:
    values = {}
    for path in sorted(run.glob("startup_values_*.npz")):
        values.update(np.load(path))
    return values


def compare_startups(ref_run: Path, got_run: Path) -> str:
    """Whether both runs' pserver startups made the same params before the harness set them."""
    ref, got = startup_values(ref_run), startup_values(got_run)
    differ = sorted(n for n in set(ref) | set(got)
                    if n not in ref or n not in got or not np.array_equal(ref[n], got[n]))
    if not differ:
        return "the pserver startups' own initial values are equal too"
    return f"the pserver startups' own initial values differ for {', '.join(differ)} (set to one array in both runs)"


@dataclass(frozen=True)
class RunOptions:
    """How the programs are started: trainer i `stagger` * i seconds after trainer 0; with
    `start_barrier`, no trainer starts step 0 before every trainer ran its startup (the
    harness's old default, no longer needed, see docs/interop.md); our programs `repeat`
    times against the one reference run, each run compared."""

    stagger: float = 0.0
    start_barrier: bool = False
    repeat: int = 1


def run_case(case: Case, py: Path, work: Path, opts: RunOptions = RunOptions()) -> tuple[bool, str]:
    case_dir = work / case.name
    shutil.rmtree(case_dir, ignore_errors=True)
    fixture = ["--fixture", str(FIXTURES / case.fixture)] if case.fixture else []
    run_checked([str(py), str(PADDLE_SIDE), "build", case.name, str(case_dir), *fixture], "Fluid 1.8.5 build",
                env=paddle_env_vars())
    spec = json.loads((case_dir / "case.json").read_text())
    ports = free_ports(2 * spec["pservers"])
    eps_a = [f"127.0.0.1:{p}" for p in ports[:spec["pservers"]]]
    eps_b = [f"127.0.0.1:{p}" for p in ports[spec["pservers"]:]]
    mode = f"{spec['pservers']} pservers x {spec['trainers']} trainer(s), {'sync' if spec['sync'] else 'async'}, {spec['steps']} steps"
    if case.reference == "paddle":
        run_checked([str(py), str(PADDLE_SIDE), "transpile", str(case_dir), str(case_dir / "paddle"),
                     "--pservers", ",".join(eps_a), "--trainers", str(spec["trainers"])]
                    + ([] if spec["sync"] else ["--async"]), "Fluid 1.8.5's DistributeTranspiler",
                    env=paddle_env_vars())
        ref = run_programs(py, case_dir, case_dir / "paddle", spec, eps_a, case_dir / "run_paddle",
                           opts.stagger, opts.start_barrier)
        against = "Paddle's transpiler's programs"
    else:
        ref = run_local(py, case_dir, case_dir / "run_local")
        against = "Paddle training locally"
    transpile_ours(case_dir, case_dir / "ours", spec, eps_b, case.partitioner)
    if opts.stagger:
        mode += f", trainers started {opts.stagger:g} s apart"
    failures = []
    for run in range(opts.repeat):
        out = case_dir / ("run_ours" if opts.repeat == 1 else f"run_ours_{run}")
        try:
            got = run_programs(py, case_dir, case_dir / "ours", spec, eps_b, out, opts.stagger, opts.start_barrier)
        except CaseFailed as error:
            if opts.repeat == 1:
                raise
            failures.append(f"run {run}: {error}")
            log(f"{case.name}: run {run}: FAILED: {error}")
            continue
        problems, count, worst = compare(case, spec, ref, got)
        if problems:
            failures.append(f"run {run}: DIFFERENT: {problems}")
        if opts.repeat > 1:
            log(f"{case.name}: run {run}: {'DIFFERENT' if problems else 'equal'}")
    if opts.repeat > 1:
        mode += f"; our programs run {opts.repeat} times, {opts.repeat - len(failures)} equal"
    if failures:
        return False, f"{case.name}: DIFFERENT from {against} ({mode}): {'; '.join(failures[:3])}"
    how = "bit-equal" if case.rtol == 0.0 else f"equal within {case.rtol:g} of each value's scale (worst {worst:.2g})"
    note = ""
    if case.reference == "paddle":
        note = "; " + compare_startups(case_dir / "run_paddle",
                                       case_dir / ("run_ours" if opts.repeat == 1 else "run_ours_0"))
    return True, f"{case.name}: equal to {against} ({mode}; losses and params, {count} arrays {how}){note}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", action="append", choices=[c.name for c in CASES],
                        help="run only this case (repeatable; default all)")
    parser.add_argument("--work", help="keep the programs, logs and results in this directory")
    parser.add_argument("--stagger", type=float, default=0.0, metavar="SECONDS",
                        help="start trainer i SECONDS * i after trainer 0 (default 0)")
    parser.add_argument("--start-barrier", action="store_true",
                        help="trainers start step 0 together, after every trainer's startup (off by default)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run our programs N times against the one reference run (default 1)")
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.stagger < 0:
        parser.error("--repeat must be >= 1 and --stagger >= 0")
    opts = RunOptions(args.stagger, args.start_barrier, args.repeat)
    cases = [c for c in CASES if not args.case or c.name in args.case]
    try:
        py = paddle_env.ensure("1.8.5", log=log)
    except paddle_env.PaddleUnavailable as error:
        print(f"interop: skipped: {error}")
        return 2
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="interop-"))
    work.mkdir(parents=True, exist_ok=True)
    equal = 0
    try:
        for case in cases:
            started = time.monotonic()
            try:
                ok, line = run_case(case, py, work, opts)
            except CaseFailed as error:
                ok, line = False, f"{case.name}: FAILED: {error}"
            equal += ok
            print(f"{line} [{time.monotonic() - started:.0f} s]", flush=True)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    print(f"interop: {equal}/{len(cases)} cases equal", flush=True)
    return 0 if equal == len(cases) else 1


if __name__ == "__main__":
    sys.exit(main())
