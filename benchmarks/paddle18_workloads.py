"""The workloads of `benchmarks/vs_paddle18.py`, built and trained by Fluid 1.8.5 itself.

Runs under the Paddle 1.8.5 venv's python (`tools/paddle_env.py 1.8.5`), never ours, and
imports nothing of this package: Paddle must see its own programs, run its own way.

    python benchmarks/paddle18_workloads.py build OUT
    python benchmarks/paddle18_workloads.py run OUT/mlp --steps 200 --warmup 20 --batch 128

`build` writes `OUT/<workload>/main.pb`, `startup.pb` and `workload.json` (the loss var and
the feeds) for `mlp` (784-512-512-10, softmax cross-entropy, Adam) and `emb` (a 100k x 64
`is_sparse` embedding, which Fluid 1.8 marks `remote_prefetch`, + fc 64 + fc 10, SGD), and
`wide4096` / `wide8192` / `wide16384` (x -> fc S relu -> fc 10, SGD: a 64 MB / 256 MB / 1 GB
weight, issue 30), and `deep2048` (x -> 3 x fc 2048 relu -> fc 10, SGD: three 16 MB
weights, room for early sends).

`run` trains one workload in the role Paddle's environment variables give (`TRAINING_ROLE`,
`PADDLE_PSERVER_ENDPOINTS`, `PADDLE_TRAINERS_NUM`, `PADDLE_TRAINER_ID`,
`PADDLE_CURRENT_ENDPOINT`; none: locally), loading the saved programs with
`Program.parse_from_string` and transpiling them with Fluid's `DistributeTranspiler`, sync.
A trainer (or a local run) prints one `timing: {json}` line at the end, for the steps after
`--warmup`: wall seconds, this process's CPU seconds, its peak RSS (`peak_rss`, VmHWM
bytes), and the wall-clock start and end (so a
harness can match its CPU samples of the pservers to the window); a pserver serves until the
harness stops it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import paddle.fluid as fluid

ROWS, WIDTH, CLASSES = 100000, 64, 10


LABEL = ("label", [1], "int64", CLASSES)  # a feed: name, shape past the batch, dtype, ids below


def classify(hidden, optimizer):
    """fc 10 and softmax cross-entropy against the `label` feed, minimised: the loss."""
    label = fluid.data(name="label", shape=[-1, 1], dtype="int64")
    logits = fluid.layers.fc(hidden, CLASSES)
    loss = fluid.layers.mean(fluid.layers.softmax_with_cross_entropy(logits, label))
    optimizer.minimize(loss)
    return loss


def mlp():
    """784-512-512-10 with softmax cross-entropy, Adam."""
    x = fluid.data(name="x", shape=[-1, 784], dtype="float32")
    hidden = fluid.layers.fc(x, 512, act="relu")
    hidden = fluid.layers.fc(hidden, 512, act="relu")
    loss = classify(hidden, fluid.optimizer.Adam(learning_rate=0.001))
    return loss, [("x", [784], "float32", None), LABEL]


def emb():
    """A 100k x 64 sparse embedding (remote prefetch in 1.8) + fc 64 + fc 10, SGD."""
    ids = fluid.data(name="ids", shape=[-1, 1], dtype="int64")
    rows = fluid.layers.embedding(ids, size=[ROWS, WIDTH], is_sparse=True, is_distributed=False)
    hidden = fluid.layers.fc(rows, WIDTH, act="relu")
    loss = classify(hidden, fluid.optimizer.SGD(learning_rate=0.01))
    return loss, [("ids", [1], "int64", ROWS), LABEL]


def wide(size: int):
    """x[batch, size] -> fc size (relu) -> fc 10, SGD: a step that mostly moves the size x size
    weight (64 MB at 4096, 256 MB at 8192 in float32) to and from the pservers."""

    def body():
        x = fluid.data(name="x", shape=[-1, size], dtype="float32")
        hidden = fluid.layers.fc(x, size, act="relu")
        loss = classify(hidden, fluid.optimizer.SGD(learning_rate=0.01))
        return loss, [("x", [size], "float32", None), LABEL]

    body.__doc__ = f"x[batch, {size}] -> fc {size} (relu) -> fc 10, SGD."
    return body


def deep(size: int, layers: int):
    """x[batch, size] -> `layers` x fc size (relu) -> fc 10, SGD: several big weights, each
    grad ready while backward still runs the layers below it (room for early sends)."""

    def body():
        hidden = x = fluid.data(name="x", shape=[-1, size], dtype="float32")
        for _ in range(layers):
            hidden = fluid.layers.fc(hidden, size, act="relu")
        loss = classify(hidden, fluid.optimizer.SGD(learning_rate=0.01))
        return loss, [("x", [size], "float32", None), LABEL]

    body.__doc__ = f"x[batch, {size}] -> {layers} x fc {size} (relu) -> fc 10, SGD."
    return body


WORKLOADS = {"mlp": mlp, "emb": emb, "wide4096": wide(4096), "wide8192": wide(8192), "wide16384": wide(16384),
             "deep2048": deep(2048, 3)}


def build(out: str) -> None:
    for name, body in WORKLOADS.items():
        main, startup = fluid.Program(), fluid.Program()
        with fluid.program_guard(main, startup), fluid.unique_name.guard():
            loss, feeds = body()
        folder = os.path.join(out, name)
        os.makedirs(folder, exist_ok=True)
        for file, program in (("main.pb", main), ("startup.pb", startup)):
            with open(os.path.join(folder, file), "wb") as f:
                f.write(program.desc.serialize_to_string())
        spec = {"loss": loss.name, "feeds": [dict(zip(("name", "shape", "dtype", "high"), f)) for f in feeds]}
        with open(os.path.join(folder, "workload.json"), "w") as f:
            json.dump(spec, f, indent=1)


def batch_of(feeds, batch: int, seed: int, step: int) -> dict:
    """Global batch `step`: ids and labels uniform below `high`, floats normal (sd 0.1) -
    the same kind of data, made the same way, as our `examples/train_program.py`."""
    rng = np.random.default_rng([seed, step])
    out = {}
    for feed in feeds:
        shape = [batch] + feed["shape"]
        if feed["high"] is not None:
            out[feed["name"]] = rng.integers(0, feed["high"], size=shape).astype(np.int64)
        else:
            out[feed["name"]] = (rng.standard_normal(shape) * 0.1).astype(feed["dtype"])
    return out


def peak_rss():
    """This process's peak resident set so far (VmHWM, bytes)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def load(folder: str):
    programs = []
    for file in ("main.pb", "startup.pb"):
        with open(os.path.join(folder, file), "rb") as f:
            programs.append(fluid.Program.parse_from_string(f.read()))
    with open(os.path.join(folder, "workload.json")) as f:
        return programs[0], programs[1], json.load(f)


def train(exe, program, spec, args, trainer_id: int, trainers: int) -> None:
    """`--warmup` + `--steps` steps on this trainer's share of each global batch; the
    `timing:` line for the last `--steps`."""
    share = args.batch // trainers
    start, cpu, wall = time.perf_counter(), time.process_time(), time.time()
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            start, cpu, wall = time.perf_counter(), time.process_time(), time.time()
        feed = {k: v[trainer_id * share:(trainer_id + 1) * share] for k, v in batch_of(spec["feeds"], args.batch, args.seed, step).items()}
        exe.run(program, feed=feed, fetch_list=[spec["loss"]], use_program_cache=True)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    window = {"steps": args.steps, "seconds": seconds, "cpu": cpu, "start": wall, "end": wall + seconds,
              "peak_rss": peak_rss()}
    print("timing: " + json.dumps(window), flush=True)


def run(args) -> None:
    main, startup, spec = load(args.folder)
    exe = fluid.Executor(fluid.CPUPlace())
    role = os.environ.get("TRAINING_ROLE")
    if role is None:
        exe.run(startup)
        train(exe, main, spec, args, 0, 1)
        return
    trainers = int(os.environ["PADDLE_TRAINERS_NUM"])
    trainer_id = int(os.environ.get("PADDLE_TRAINER_ID", "0"))
    transpiler = fluid.DistributeTranspiler(config=fluid.DistributeTranspilerConfig())
    transpiler.transpile(trainer_id, program=main, pservers=os.environ["PADDLE_PSERVER_ENDPOINTS"],
                         trainers=trainers, sync_mode=True, startup_program=startup)
    if role == "PSERVER":
        endpoint = os.environ["PADDLE_CURRENT_ENDPOINT"]
        program = transpiler.get_pserver_program(endpoint)
        exe.run(transpiler.get_startup_program(endpoint, program))
        exe.run(program)  # serves; sync pservers may outlive the trainers: the harness stops them
        return
    exe.run(startup)
    train(exe, transpiler.get_trainer_program(), spec, args, trainer_id, trainers)
    exe.close()  # tells the pservers this trainer is done


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("build").add_argument("out")
    runner = commands.add_parser("run")
    runner.add_argument("folder")
    runner.add_argument("--steps", type=int, default=100, help="timed steps")
    runner.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    runner.add_argument("--batch", type=int, default=64, help="the global batch (all trainers together)")
    runner.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "build":
        build(args.out)
    else:
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
