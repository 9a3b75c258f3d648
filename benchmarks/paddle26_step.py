"""Paddle 2.6's side of benchmarks/models_vs_paddle26.py: time local training steps of a
saved (main.pb, startup.pb) pair in Paddle's own static-graph executor (CPU).

    $(python3 tools/paddle_env.py 2.6.2) benchmarks/paddle26_step.py MAIN.pb STARTUP.pb FEED.npz LOSS WARMUP STEPS

Runs under the Paddle 2.6.2 venv's python, never ours. Loads Paddle's bytes with
`Program.parse_from_string`, runs the startup program, then WARMUP untimed and STEPS timed
steps on the same feed (FEED.npz: one array per feed var), and prints one JSON line:
{"seconds": [per-step wall seconds], "cpu": [per-step CPU seconds], "loss": [first, last]}.
"""

from __future__ import annotations

import numpy.random  # noqa: F401  (before paddle: Paddle's bundled zlib breaks a later import)

import json
import sys
import time

import numpy as np
import paddle


def main(argv: list[str]) -> int:
    main_pb, startup_pb, feed_npz, loss, warmup, steps = argv
    paddle.enable_static()
    main = paddle.static.Program.parse_from_string(open(main_pb, "rb").read())
    startup = paddle.static.Program.parse_from_string(open(startup_pb, "rb").read())
    feed = dict(np.load(feed_npz))
    exe = paddle.static.Executor(paddle.CPUPlace())
    scope = paddle.static.Scope()
    losses, seconds, cpu = [], [], []
    with paddle.static.scope_guard(scope):
        exe.run(startup)
        for step in range(int(warmup) + int(steps)):
            start, cpu_start = time.perf_counter(), time.process_time()
            (value,) = exe.run(main, feed=feed, fetch_list=[loss])
            if step >= int(warmup):
                seconds.append(time.perf_counter() - start)
                cpu.append(time.process_time() - cpu_start)
            losses.append(float(np.asarray(value).reshape(-1)[0]))
    print(json.dumps({"seconds": seconds, "cpu": cpu, "loss": [losses[0], losses[-1]]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
