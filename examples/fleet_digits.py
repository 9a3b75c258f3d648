"""A Fluid 1.8 fleet script (the form of seed 002's), on a real network and data set;
only its import lines differ from the script Paddle runs.

    pstranspile launch --pservers 2 --trainers 2 -- python3 examples/fleet_digits.py --mode sync
    pstranspile launch --pservers 2 --trainers 2 -- python3 examples/fleet_digits.py --mode async
    pstranspile launch --pservers 2 --trainers 2 -- python3 examples/fleet_digits.py --mode geo --geo-every 5

Under Paddle 1.8 the imports would be

    import paddle.fluid as fluid
    from paddle.fluid.incubate.fleet.parameter_server.distribute_transpiler import fleet, StrategyFactory
    from paddle.fluid.incubate.fleet.base import role_maker

The net: scikit-learn's bundled digits (8x8 images, 10 classes), fc 64 relu → fc 10
softmax, cross-entropy, SGD. Every worker walks the same global batches and trains on its
contiguous share. The role comes from Paddle's variables (`TRAINING_ROLE`,
`PADDLE_PSERVERS_IP_PORT_LIST` or `PADDLE_PSERVER_ENDPOINTS`, `PADDLE_TRAINERS_NUM`,
`PADDLE_TRAINER_ID`, `POD_IP` + `PADDLE_PORT`), given to `UserDefinedRoleMaker` as the
seed does (`--role-maker user`) or read by `PaddleCloudRoleMaker` (`--role-maker cloud`).
Each worker prints `worker_index: I, stepS cost = C` and, with `--out DIR`, writes its
losses to `DIR/losses_<I>.json`; with `--save DIR` the first worker saves the trained
persistables (Fluid's LoDTensor files) there (`--save-init DIR`: those it starts from;
`--save-inference DIR`: the inference model, `__model__` and its params).
`--sparse` / `--distributed` read the pixels through an `is_sparse` / `is_distributed`
embedding table, `--decay` decays the learning rate, `--float64` builds the net in float64.
`--mode local` trains the same net on the same batches in this process without fleet
(`python3 examples/fleet_digits.py --mode local`; `--init DIR` starts it from saved
persistables): the reference the distributed modes are compared with.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

try:
    import transpiler  # noqa: F401
except ModuleNotFoundError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import transpiler.fluid as fluid  # noqa: E402
from transpiler.fleet import StrategyFactory, fleet, role_maker  # noqa: E402


def digits(seed: int = 0, dtype: str = "float32", data: Path | None = None):
    """The digits, shuffled: from scikit-learn, or from `data` (an .npz of its `data` and
    `target`, for an interpreter without scikit-learn)."""
    if data is not None:
        with np.load(str(data)) as saved:
            pixels, target = saved["data"], saved["target"]
    else:
        from sklearn.datasets import load_digits

        loaded = load_digits()
        pixels, target = loaded.data, loaded.target
    order = np.random.default_rng(seed).permutation(len(target))
    images = (pixels[order] / 16.0).astype(dtype)
    labels = target[order].astype("int64").reshape(-1, 1)
    return images, labels


def net(sparse=False, distributed=False, dtype="float32"):
    label = fluid.layers.data(name="label", shape=[1], dtype="int64")
    if sparse or distributed:  # each pixel's (position, intensity) an id of an embedding table
        ids = fluid.layers.data(name="ids", shape=[64, 1], dtype="int64")
        emb = fluid.layers.embedding(input=ids, size=[64 * 17, 4], is_sparse=True, is_distributed=distributed,
                                     dtype=dtype)
        hidden = fluid.layers.fc(input=emb, size=64, act="relu")
    else:
        img = fluid.layers.data(name="img", shape=[64], dtype=dtype)
        hidden = fluid.layers.fc(input=img, size=64, act="relu")
    predict = fluid.layers.fc(input=hidden, size=10, act="softmax")
    cost = fluid.layers.cross_entropy(input=predict, label=label)
    return fluid.layers.mean(cost), predict


def make_role(kind: str):
    if kind == "cloud":
        return role_maker.PaddleCloudRoleMaker()
    endpoints = (os.getenv("PADDLE_PSERVERS_IP_PORT_LIST") or os.getenv("PADDLE_PSERVER_ENDPOINTS")).split(",")
    is_worker = os.getenv("TRAINING_ROLE") == "TRAINER"
    if is_worker:
        current_id = int(os.getenv("PADDLE_TRAINER_ID"))
    else:
        current_id = endpoints.index(os.getenv("PADDLE_CURRENT_ENDPOINT") or
                                     "%s:%s" % (os.getenv("POD_IP"), os.getenv("PADDLE_PORT")))
    return role_maker.UserDefinedRoleMaker(
        current_id=current_id,
        role=role_maker.Role.WORKER if is_worker else role_maker.Role.SERVER,
        worker_num=int(os.getenv("PADDLE_TRAINERS_NUM")),
        server_endpoints=endpoints)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("sync", "async", "half_async", "geo", "local"), default="sync",
                        help="a fleet strategy, or local: plain fluid training in this process, no fleet")
    parser.add_argument("--sparse", action="store_true", help="the pixels through a sparse embedding table")
    parser.add_argument("--distributed", action="store_true",
                        help="the pixels through a distributed lookup table (is_distributed=True)")
    parser.add_argument("--decay", action="store_true", help="exponential lr decay (x0.8 every 5 steps, staircase)")
    parser.add_argument("--float64", action="store_true", help="the net in float64")
    parser.add_argument("--data", type=Path, help="the digits as an .npz (data, target) instead of scikit-learn's")
    parser.add_argument("--geo-every", type=int, default=5, help="GEO-SGD's update_frequency (--mode geo)")
    parser.add_argument("--role-maker", choices=("user", "cloud"), default="user")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=64, help="the global batch (all workers together)")
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--save", type=Path)
    parser.add_argument("--init", type=Path, help="a folder of persistables the servers (--mode local: the "
                        "trainer) start from")
    parser.add_argument("--save-init", type=Path, help="the first worker saves the persistables it starts from here")
    parser.add_argument("--save-inference", type=Path, help="the first worker saves the inference model here")
    args = parser.parse_args(argv)

    dtype = "float64" if args.float64 else "float32"
    sparse = args.sparse or args.distributed
    avg_cost, predict = net(args.sparse, args.distributed, dtype)
    learning_rate = args.lr
    if args.decay:
        learning_rate = fluid.layers.exponential_decay(args.lr, decay_steps=5, decay_rate=0.8, staircase=True)
    optimizer = fluid.optimizer.SGD(learning_rate=learning_rate)
    if args.mode == "local":  # the reference: the same net and batches, no fleet (one worker's share)
        optimizer.minimize(avg_cost)
        exe = fluid.Executor(fluid.CPUPlace())
        exe.run(fluid.default_startup_program())
        if args.init is not None:
            fluid.io.load_persistables(exe, str(args.init), fluid.default_main_program())
        return train(args, exe, avg_cost, predict, sparse, dtype, 0, 1, lambda: True)

    role = make_role(args.role_maker)
    fleet.init(role)
    strategy = {"sync": StrategyFactory.create_sync_strategy, "async": StrategyFactory.create_async_strategy,
                "half_async": StrategyFactory.create_half_async_strategy,
                "geo": lambda: StrategyFactory.create_geo_strategy(args.geo_every)}[args.mode]()
    optimizer = fleet.distributed_optimizer(optimizer, strategy)
    optimizer.minimize(avg_cost)

    if fleet.is_server():
        fleet.init_server(args.init)
        fleet.run_server()
    elif fleet.is_worker():
        fleet.init_worker()
        exe = fluid.Executor(fluid.CPUPlace())
        exe.run(fluid.default_startup_program())
        train(args, exe, avg_cost, predict, sparse, dtype, fleet.worker_index(), fleet.worker_num(),
              fleet.is_first_worker)
        fleet.stop_worker()
    return 0


def save(args, exe, folder, is_first_worker) -> None:
    if folder is not None and is_first_worker():
        if args.mode == "local":
            fluid.io.save_persistables(exe, str(folder), fluid.default_main_program())
        else:
            fleet.save_persistables(exe, folder)


def train(args, exe, avg_cost, predict, sparse, dtype, i, n, is_first_worker) -> int:
    images, labels = digits(dtype=dtype, data=args.data)
    save(args, exe, args.save_init, is_first_worker)
    losses = []
    for step in range(args.steps):
        lo = step * args.batch % (len(labels) - args.batch)
        rows = slice(lo + args.batch * i // n, lo + args.batch * (i + 1) // n)
        feed = {"label": labels[rows]}
        if sparse:
            feed["ids"] = (np.arange(64) * 17 + np.rint(images[rows] * 16)).astype("int64").reshape(-1, 64, 1)
        else:
            feed["img"] = images[rows]
        cost_val = exe.run(program=fluid.default_main_program(), feed=feed,
                           fetch_list=[avg_cost.name])
        losses.append(float(np.mean(cost_val[0])))
        print("worker_index: %d, step%d cost = %f" % (i, step, losses[-1]), flush=True)
    save(args, exe, args.save, is_first_worker)
    if args.save_inference is not None and is_first_worker():
        feeds = ["ids"] if sparse else ["img"]
        if args.mode == "local":
            fluid.io.save_inference_model(str(args.save_inference), feeds, [predict], exe)
        else:
            fleet.save_inference_model(exe, str(args.save_inference), feeds, [predict])
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / ("losses_%d.json" % i)).write_text(json.dumps(losses))
    return 0


if __name__ == "__main__":
    sys.exit(main())
