"""Time Paddle 2.6's own legacy transpiler on a real-model case, in process: the reference
column of `benchmarks/transpile_scaling.py`.

    $(python3 tools/paddle_env.py 2.6.2) tools/paddle_transpile_time.py CASE [--repeat N]

Builds the case's network as `tools/make_paddle_fixtures.py` does (its shim for the ops
2.6 no longer registers, its hidden empty slots, the op callstacks stripped as in the
fixtures), then times only `DistributeTranspiler.transpile(...)` and the getters of every
pserver's main and startup program and of the trainer program. Each repeat transpiles a
fresh build (transpiling changes the programs). Prints one JSON line: the case, the main
program's op count and the best wall and CPU (this process's) times in seconds.

With `--rounds`, it instead times one transpile per line read from stdin and prints each
as a JSON line (until stdin closes): `benchmarks/transpile_scaling.py` interleaves these
rounds with its own runs, so both sides are timed under the same load of a shared machine.
"""

from __future__ import annotations

import numpy.random  # noqa: F401  (before paddle: Paddle's bundled zlib breaks a later import)

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import make_paddle_fixtures as fixtures  # noqa: E402  (installs the shim for unregistered ops)
import paddle  # noqa: E402
from paddle.distributed.transpiler import DistributeTranspiler, DistributeTranspilerConfig  # noqa: E402


def transpile_seconds(case: str) -> tuple[int, float, float]:
    net, n_pservers, trainers, sync_mode, slice_var_up = fixtures.CASES[case]
    main, startup, _loss = fixtures.build(net)
    fixtures.strip_callstacks(main)
    fixtures.strip_callstacks(startup)
    pservers = fixtures.endpoints(n_pservers)
    config = DistributeTranspilerConfig()
    config.slice_var_up = slice_var_up
    config.split_method = paddle.distributed.transpiler.distribute_transpiler.RoundRobin
    config.min_block_size = fixtures.MIN_BLOCK_SIZE
    config.sync_mode = sync_mode
    ops = main.global_block().desc.op_size()
    with fixtures.empty_slots_hidden():
        started, cpu = time.perf_counter(), time.process_time()
        transpiler = DistributeTranspiler(config)
        transpiler.transpile(0, program=main, pservers=pservers, trainers=trainers, sync_mode=sync_mode,
                             startup_program=startup)
        for endpoint in pservers.split(","):
            transpiler.get_pserver_programs(endpoint)
        transpiler.get_trainer_program(wait_port=False)
        return ops, time.perf_counter() - started, time.process_time() - cpu


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=sorted(fixtures.CASES))
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--rounds", action="store_true", help="one timed transpile per line of stdin")
    args = parser.parse_args(argv)
    paddle.enable_static()
    if args.rounds:
        print(json.dumps({"ready": args.case}), flush=True)
        for _line in sys.stdin:
            ops, seconds, cpu_seconds = transpile_seconds(args.case)
            print(json.dumps({"case": args.case, "ops": ops, "seconds": seconds, "cpu_seconds": cpu_seconds}),
                  flush=True)
        return
    runs = [transpile_seconds(args.case) for _ in range(args.repeat)]
    print(json.dumps({"case": args.case, "ops": runs[0][0], "seconds": min(r[1] for r in runs),
                      "cpu_seconds": min(r[2] for r in runs)}))


if __name__ == "__main__":
    main()
