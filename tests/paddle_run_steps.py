"""Run a saved (main.pb, startup.pb) pair with Paddle's own executor, for the conformance
tests (tests/test_control_flow.py runs it with Paddle 2.6.2's venv; the product never
imports Paddle):

    python paddle_run_steps.py MAIN.pb STARTUP.pb IN.npz OUT.npz LOSS STEPS [MAIN.pb ... STEPS]...

IN.npz holds `param/<name>` (values set after the startup program ran) and
`step<k>/<feed name>` (the feeds of step k); OUT.npz gets `loss/<k>` and `param/<name>`
(the params after the last step). Several runs (six arguments each) share one process:
Paddle takes seconds to import."""

from __future__ import annotations

import numpy.random  # noqa: F401  (before paddle: Paddle's bundled zlib breaks a later import)

import sys

import numpy as np
import paddle


def main(argv: list[str]) -> None:
    if not argv or len(argv) % 6:
        raise SystemExit("usage: paddle_run_steps.py (MAIN.pb STARTUP.pb IN.npz OUT.npz LOSS STEPS)...")
    for start in range(0, len(argv), 6):
        run(*argv[start:start + 6])


def run(main_pb: str, startup_pb: str, inputs: str, output: str, loss: str, steps: str) -> None:
    paddle.enable_static()
    main_program = paddle.static.Program.parse_from_string(open(main_pb, "rb").read())
    startup = paddle.static.Program.parse_from_string(open(startup_pb, "rb").read())
    given = np.load(inputs)
    place = paddle.CPUPlace()
    exe = paddle.static.Executor(place)
    scope = paddle.static.Scope()
    out: dict[str, np.ndarray] = {}
    with paddle.static.scope_guard(scope):
        exe.run(startup)
        params = [k[len("param/"):] for k in given.files if k.startswith("param/")]
        for name in params:
            scope.var(name).get_tensor().set(given[f"param/{name}"], place)
        for k in range(int(steps)):
            prefix = f"step{k}/"
            feed = {key[len(prefix):]: given[key] for key in given.files if key.startswith(prefix)}
            (value,) = exe.run(main_program, feed=feed, fetch_list=[loss])
            out[f"loss/{k}"] = np.asarray(value)
        for name in params:
            out[f"param/{name}"] = np.array(scope.find_var(name).get_tensor())
    np.savez(output, **out)


if __name__ == "__main__":
    main(sys.argv[1:])
