"""How transpile time grows with program size.

Builds deep Adam MLPs the way Fluid lays them out (per layer: mul, elementwise_add,
relu; their grads; one adam per param with moments and beta powers initialised in the
startup program), transpiles them for 4 pservers and 2 trainers, and prints the time of
transpile + every pserver program + the trainer program, per op, and the growth factor
between sizes. Paddle 1.8's transpiler on this machine (from the issue): 93 ops 0.22 s,
253 ops 1.2 s, 813 ops 10.4 s, 2,413 ops 173 s.

Then the real models (the Paddle-built fixtures: ResNet-50, a BERT-base encoder): our load
(µs per op), our API `transpile` on the loaded programs, `pstranspile transpile` end to end
(a fresh interpreter: startup, imports, load, transpile, verify, save; bytecode cached, as
for an installed command), and Paddle 2.6's own transpiler timed in the same run, in process
(`tools/paddle_transpile_time.py`: `transpile` and the getters only), where its venv is
installed (`tools/paddle_env.py 2.6.2`); without it those columns are left empty and a note
says so. Times are the best of `--repeat` rounds, wall clock and CPU (user + system, the
CLI's child process included); in each round Paddle transpiles once (in a process kept for
the case), then our API three times and the CLI once: interleaved, so that on a shared
machine both sides meet the same load. Both sides free what they built after the clocks
stop. The ratios are of CPU time, the steadier figure on a shared machine.

    python benchmarks/transpile_scaling.py [--ops 93 253 813 2413 10000 100000] [--repeat 3] [--no-real]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transpiler.api import transpile  # noqa: E402
from transpiler.ir import AttrType, DType, OpRole, Program  # noqa: E402
from transpiler.ir.attrs import Attr  # noqa: E402
from transpiler.ir.serde import program_from_bytes  # noqa: E402

REAL_CASES = ("resnet50_momentum_4ps_sync", "bert_adam_4ps_async")
FIXTURES = ROOT / "tests" / "fixtures" / "paddle_programs"

PADDLE_SECONDS = {93: 0.22, 253: 1.2, 813: 10.4, 2413: 173.0}


def _role(op, role: OpRole, role_vars=()):
    op.set_attr("op_role", Attr.of(int(role), AttrType.INT))
    op.set_attr("op_role_var", Attr.of(tuple(role_vars), AttrType.STRINGS))


def build_mlp(layers: int, width: int = 64) -> tuple[Program, Program]:
    """A `layers`-deep Adam MLP; main has 8 ops per layer plus 4."""
    main, startup = Program.empty(), Program.empty()
    block, init = main.global_block(), startup.global_block()

    def var(name, shape, *, persistable=False, program_block=block):
        return program_block.create_var(name, dtype=DType.FP32, shape=shape, persistable=persistable)

    var("x", (-1, width))
    for b in (block, init):
        b.create_var("learning_rate_0", dtype=DType.FP32, shape=(1,), persistable=True)
    fill = init.add_op("fill_constant", outputs={"Out": ["learning_rate_0"]}, attrs={"value": 0.01, "shape": [1]})
    _role(fill, OpRole.Forward)
    params = []
    current = "x"
    for i in range(layers):
        w, b_, mul_out, add_out, act = f"fc_{i}.w_0", f"fc_{i}.b_0", f"fc_{i}.tmp_0", f"fc_{i}.tmp_1", f"fc_{i}.tmp_2"
        for name, shape in ((w, (width, width)), (b_, (width,))):
            var(name, shape, persistable=True)
            var(name, shape, persistable=True, program_block=init)
            op = init.add_op("uniform_random" if name == w else "fill_constant", outputs={"Out": [name]},
                             attrs={"shape": list(shape), "seed": 0})
            _role(op, OpRole.Forward)
            params.append((name, shape))
        for name in (mul_out, add_out, act):
            var(name, (-1, width))
        _role(block.add_op("mul", {"X": [current], "Y": [w]}, {"Out": [mul_out]}, {"x_num_col_dims": 1}), OpRole.Forward)
        _role(block.add_op("elementwise_add", {"X": [mul_out], "Y": [b_]}, {"Out": [add_out]}, {"axis": 1}),
              OpRole.Forward)
        _role(block.add_op("relu", {"X": [add_out]}, {"Out": [act]}), OpRole.Forward)
        current = act
    var("loss", (1,))
    _role(block.add_op("mean", {"X": [current]}, {"Out": ["loss"]}), OpRole.Forward | OpRole.Loss)
    var("loss@GRAD", (1,))
    _role(block.add_op("fill_constant", outputs={"Out": ["loss@GRAD"]}, attrs={"value": 1.0, "shape": [1]}),
          OpRole.Backward | OpRole.Loss)
    var(current + "@GRAD", (-1, width))
    _role(block.add_op("mean_grad", {"X": [current], "Out@GRAD": ["loss@GRAD"]}, {"X@GRAD": [current + "@GRAD"]}),
          OpRole.Backward)
    for i in reversed(range(layers)):
        w, b_ = f"fc_{i}.w_0", f"fc_{i}.b_0"
        x = "x" if i == 0 else f"fc_{i - 1}.tmp_2"
        names = {n: n + "@GRAD" for n in (f"fc_{i}.tmp_0", f"fc_{i}.tmp_1", w, b_, x)}
        for grad, shape in ((names[f"fc_{i}.tmp_0"], (-1, width)), (names[f"fc_{i}.tmp_1"], (-1, width)),
                            (names[w], (width, width)), (names[b_], (width,))):
            var(grad, shape)
        if i:
            var(names[x], (-1, width))
        _role(block.add_op("relu_grad", {"Out": [f"fc_{i}.tmp_2"], "Out@GRAD": [f"fc_{i}.tmp_2@GRAD"]},
                           {"X@GRAD": [names[f"fc_{i}.tmp_1"]]}), OpRole.Backward)
        _role(block.add_op("elementwise_add_grad", {"X": [f"fc_{i}.tmp_0"], "Y": [b_], "Out@GRAD": [names[f"fc_{i}.tmp_1"]]},
                           {"X@GRAD": [names[f"fc_{i}.tmp_0"]], "Y@GRAD": [names[b_]]}, {"axis": 1}),
              OpRole.Backward, (b_, names[b_]))
        _role(block.add_op("mul_grad", {"X": [x], "Y": [w], "Out@GRAD": [names[f"fc_{i}.tmp_0"]]},
                           {"X@GRAD": [names[x]] if i else [], "Y@GRAD": [names[w]]}), OpRole.Backward, (w, names[w]))
    for name, shape in params:
        slots = {}
        for acc, acc_shape in (("moment1", shape), ("moment2", shape), ("beta1_pow_acc", (1,)), ("beta2_pow_acc", (1,))):
            acc_name = f"{name}_{acc}_0"
            var(acc_name, acc_shape, persistable=True)
            var(acc_name, acc_shape, persistable=True, program_block=init)
            _role(init.add_op("fill_constant", outputs={"Out": [acc_name]}, attrs={"shape": list(acc_shape)}),
                  OpRole.Forward)
            slots[acc] = acc_name
        op = block.add_op(
            "adam",
            {"Param": [name], "Grad": [name + "@GRAD"], "LearningRate": ["learning_rate_0"],
             "Moment1": [slots["moment1"]], "Moment2": [slots["moment2"]], "Beta1Pow": [slots["beta1_pow_acc"]],
             "Beta2Pow": [slots["beta2_pow_acc"]]},
            {"ParamOut": [name], "Moment1Out": [slots["moment1"]], "Moment2Out": [slots["moment2"]],
             "Beta1PowOut": [slots["beta1_pow_acc"]], "Beta2PowOut": [slots["beta2_pow_acc"]]},
            {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8},
        )
        _role(op, OpRole.Optimize, (name, name + "@GRAD"))
    return main, startup


def layers_for(ops: int) -> int:
    return max(1, round((ops - 3) / 8))


def measure(ops: int, repeat: int) -> tuple[int, float]:
    main, startup = build_mlp(layers_for(ops))
    wall, _cpu_seconds = _best(lambda: transpile(
        main, startup, pservers="127.0.0.1:6170,127.0.0.1:6171,127.0.0.1:6172,127.0.0.1:6173", trainers=2), repeat)
    return main.num_ops(), wall


def _cpu() -> float:
    """CPU seconds (user + system) of this process and its waited-for children."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _timed(run) -> tuple[float, float]:
    """Wall and CPU seconds of one `run()`. What it returns is freed after the clocks stop,
    as Paddle's programs are in `tools/paddle_transpile_time.py`."""
    start, start_cpu = time.perf_counter(), _cpu()
    result = run()
    wall, cpu = time.perf_counter() - start, _cpu() - start_cpu
    del result
    return wall, cpu


def _best(run, repeat: int) -> tuple[float, float]:
    """The best wall and the best CPU seconds of `repeat` runs."""
    return _best_of([_timed(run) for _ in range(repeat)])


def _best_of(runs: list[tuple[float, float]]) -> tuple[float, float]:
    return min(wall for wall, _ in runs), min(cpu for _, cpu in runs)


def _cli_argv(case_dir: Path, case: dict, out: str) -> list[str]:
    argv = [sys.executable, "-m", "transpiler", "transpile", str(case_dir / "main.pb"),
            "--startup", str(case_dir / "startup.pb"), "--pservers", case["pservers"],
            "--trainers", str(case["trainers"]), "--trainer-id", str(case["trainer_id"]),
            "--split-method", {"RoundRobin": "round_robin", "HashName": "hash_name"}[case["split_method"]],
            "--min-block-size", str(case["min_block_size"]), "-o", out]
    return argv + ([] if case["sync_mode"] else ["--async"]) + ([] if case["slice_var_up"] else ["--no-slice"])


class PaddleRounds:
    """Paddle 2.6's in-process transpile of one case, timed once per `run()` in a process
    kept for the case (`tools/paddle_transpile_time.py --rounds`), so that its runs can be
    interleaved with ours: on a shared machine, both sides then meet the same load."""

    READY_SECONDS, RUN_SECONDS = 600, 600

    def __init__(self, case_name: str) -> None:
        from tools.paddle_env import PADDLE_SPEED_ENV, installed

        self.process = None
        python = installed("2.6.2")
        if python is None:
            raise PaddleUnavailable("Paddle 2.6.2 is not installed (python3 tools/paddle_env.py 2.6.2 installs it)")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        # Paddle's warnings go to a file: a pipe nobody reads until the end could fill and stall it.
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(
            [str(python), str(ROOT / "tools" / "paddle_transpile_time.py"), case_name, "--rounds"],
            env={**env, **PADDLE_SPEED_ENV}, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.stderr, text=True)
        self._line(self.READY_SECONDS)

    def run(self) -> tuple[float, float]:
        """(wall, CPU) seconds of one Paddle transpile."""
        self.process.stdin.write("run\n")
        self.process.stdin.flush()
        result = self._line(self.RUN_SECONDS)
        return result["seconds"], result["cpu_seconds"]

    def _line(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline() if ready else ""
        if not line:
            self.stderr.seek(0)
            why = "timed out" if not ready else f"exited: {self.stderr.read().strip().splitlines()[-1:]}"
            self.close()
            raise PaddleUnavailable(f"Paddle's run {why}")
        return json.loads(line)

    def close(self) -> None:
        """Stop the process (stdin closed ends its loop; killed if it does not end)."""
        if self.process is not None and self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.stderr.close()


class PaddleUnavailable(Exception):
    """Why there is no Paddle column (not installed, or its run failed)."""


def real_models(repeat: int, api_runs_per_round: int = 3) -> None:
    """Per case: our load; then `repeat` rounds of one Paddle transpile, our best of
    `api_runs_per_round` API runs and one CLI run, interleaved; the best of each."""
    print()
    print(f"{'case':<27} {'ops':>5} {'load us/op':>10} {'API s':>13} {'CLI s':>13} {'Paddle 2.6 s':>13} "
          f"{'API x':>5} {'CLI x':>5}")
    notes = []
    # The CLI runs as an installed command does: with its bytecode cached (an environment that
    # sets PYTHONDONTWRITEBYTECODE would otherwise have every run compile every module), after
    # one untimed run that writes the cache.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    for name in REAL_CASES:
        case_dir = FIXTURES / name
        case = json.loads((case_dir / "case.json").read_text())
        data, startup_data = (case_dir / "main.pb").read_bytes(), (case_dir / "startup.pb").read_bytes()
        main, startup = program_from_bytes(data), program_from_bytes(startup_data)
        ops = main.num_ops()
        load, _ = _best(lambda: program_from_bytes(data), max(repeat, 5))
        run_api = lambda: transpile(  # noqa: E731
            main, startup, pservers=case["pservers"], trainers=case["trainers"], trainer_id=case["trainer_id"],
            sync_mode=case["sync_mode"], slice_var_up=case["slice_var_up"], split_method=case["split_method"],
            min_block_size=case["min_block_size"])
        try:
            paddle: PaddleRounds | None = PaddleRounds(name)
        except PaddleUnavailable as why:
            paddle = None
            notes.append(f"{name}: {why}")
        api_runs, cli_runs, paddle_runs = [], [], []
        try:
            with tempfile.TemporaryDirectory() as out:
                run_cli = lambda: subprocess.run(_cli_argv(case_dir, case, out), env=env, check=True,  # noqa: E731
                                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                run_cli()  # untimed: writes the bytecode cache
                for _ in range(repeat):
                    if paddle is not None:
                        try:
                            paddle_runs.append(paddle.run())
                        except PaddleUnavailable as why:
                            paddle = None
                            notes.append(f"{name}: {why}")
                    api_runs.extend(_timed(run_api) for _ in range(api_runs_per_round))
                    cli_runs.append(_timed(run_cli))
        finally:
            if paddle is not None:
                paddle.close()
        api, cli = _best_of(api_runs), _best_of(cli_runs)
        if paddle_runs and paddle is not None:
            best = _best_of(paddle_runs)
            columns = f"{best[0]:>6.2f} ({best[1]:>4.2f}) {best[1] / api[1]:>5.0f} {best[1] / cli[1]:>5.1f}"
        else:
            columns = f"{'':>13} {'':>5} {'':>5}"
        print(f"{name:<27} {ops:>5} {load / ops * 1e6:>10.1f} {api[0]:>6.3f} ({api[1]:.3f}) "
              f"{cli[0]:>6.3f} ({cli[1]:.3f}) {columns}", flush=True)
    print(f"seconds: wall (CPU), the best of {repeat} rounds, each one Paddle run, {api_runs_per_round} API runs and "
          "one CLI run; API: transpile() on loaded programs (its final verify included); CLI: `pstranspile "
          "transpile` in a fresh interpreter, files written; x: Paddle's CPU seconds / ours (the machine is shared: "
          "CPU time is the steadier figure)")
    for note in notes:
        print("note:", note)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, nargs="+", default=[93, 253, 813, 2413, 10_000, 100_000])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-real", dest="real", action="store_false", help="skip the real-model rows")
    args = parser.parse_args(argv)
    print(f"{'ops':>8} {'seconds':>9} {'us/op':>8} {'growth':>8} {'Paddle 1.8 (s)':>15}")
    previous = None
    for target in args.ops:
        ops, seconds = measure(target, args.repeat if target <= 10_000 else 1)
        growth = "" if previous is None else f"{(seconds / previous[1]) / (ops / previous[0]):8.2f}"
        paddle = PADDLE_SECONDS.get(target)
        print(f"{ops:>8} {seconds:>9.3f} {seconds / ops * 1e6:>8.1f} {growth:>8} {'' if paddle is None else paddle:>15}",
              flush=True)
        previous = (ops, seconds)
    print("growth = (time ratio) / (size ratio) against the previous row; 1.0 is linear")
    if args.real:
        real_models(args.repeat)


if __name__ == "__main__":
    main()
