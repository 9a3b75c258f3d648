"""Fluid 1.8.5's side of the interop check (run by the Paddle venv's Python 3.7, never by ours).

It must not import ps-transpiler: it talks to it only through the .pb files the harness
(tools/interop.py) hands over. Subcommands, each one process:

    build CASE DIR [--fixture FIX]     build CASE with fluid.layers (or copy the Fluid 1.8.5
                                       fixture FIX): DIR/main.pb, startup.pb,
                                       case.json (feeds, loss, params, tables), init.npz
    transpile DIR OUT --pservers EPS --trainers N [--async]
                                       Paddle's own DistributeTranspiler: OUT/t<i>/trainer.pb,
                                       trainer_startup.pb and OUT/pserver_<host>_<port>[_startup].pb
    pserver DIR PROGS EP RUN           run one pserver of PROGS on Paddle's runtime (blocks)
    trainer DIR PROGS ID OUT.npz       run trainer ID of PROGS (PROGS/t<ID>) for the case's steps
    local DIR OUT.npz                  train DIR/main.pb in one process on the trainers' batches

Every run starts from init.npz (set on the pservers after their startup, or locally after the
startup), and trainer i of step s is fed batch(s, i), seeded: both transpilers' programs see
the same values.
"""

import json
import os
import re
import socket
import sys
import time
import traceback

import numpy as np

import paddle.fluid as fluid
from paddle.fluid import core

BATCH = 16           # rows per trainer per step
TABLE_ROWS = 2000      # 2000x16: sliced in 2 blocks at the default min_block_size
EMB = 16


# ---------------------------------------------------------------------------------------------
# cases

def _mlp(optimizer, x_dim=64):
    x = fluid.data(name="x", shape=[None, x_dim], dtype="float32")
    label = fluid.data(name="label", shape=[None, 1], dtype="int64")
    hidden = fluid.layers.fc(x, size=256, act="relu")          # 64x256: sliced in 2 blocks
    out = fluid.layers.fc(hidden, size=10, act="softmax")
    loss = fluid.layers.mean(fluid.layers.cross_entropy(out, label))
    optimizer.minimize(loss)
    feeds = [{"name": "x", "kind": "dense", "dim": x_dim}, {"name": "label", "kind": "label", "classes": 10}]
    return loss, feeds, []


def _conv_net(optimizer, x_dim=64):
    """x[64] seen as a 1x8x8 image -> conv2d 8 filters 3x3 (an [8, 1, 3, 3] filter: ours
    cuts it by columns of its [8, 9] matrix, reshape2 around the split and concat) -> fc 10."""
    x = fluid.data(name="x", shape=[None, x_dim], dtype="float32")
    label = fluid.data(name="label", shape=[None, 1], dtype="int64")
    image = fluid.layers.reshape(x, [-1, 1, 8, 8])
    conv = fluid.layers.conv2d(image, num_filters=8, filter_size=3, act="relu")
    out = fluid.layers.fc(conv, size=10, act="softmax")
    loss = fluid.layers.mean(fluid.layers.cross_entropy(out, label))
    optimizer.minimize(loss)
    feeds = [{"name": "x", "kind": "dense", "dim": x_dim}, {"name": "label", "kind": "label", "classes": 10}]
    return loss, feeds, []


def _embedding_net(optimizer, distributed):
    ids = fluid.data(name="ids", shape=[None, 1], dtype="int64")
    label = fluid.data(name="label", shape=[None, 1], dtype="int64")
    emb = fluid.layers.embedding(ids, size=[TABLE_ROWS, EMB], is_sparse=True, is_distributed=distributed,
                                 param_attr=fluid.ParamAttr(name="emb"))
    hidden = fluid.layers.fc(emb, size=32, act="relu")
    out = fluid.layers.fc(hidden, size=10, act="softmax")
    loss = fluid.layers.mean(fluid.layers.cross_entropy(out, label))
    optimizer.minimize(loss)
    feeds = [{"name": "ids", "kind": "ids", "rows": TABLE_ROWS}, {"name": "label", "kind": "label", "classes": 10}]
    tables = [{"name": "emb", "rows": TABLE_ROWS, "width": EMB, "distributed": distributed}]
    return loss, feeds, tables


CASES = {
    # name: (network, pservers, trainers, sync, steps)
    "dense_sync": (lambda: _mlp(fluid.optimizer.Adam(learning_rate=0.01)), 2, 2, True, 5),
    # the harness transpiles ours with `--partitioner column`: 64x256 cut into 3 column ranges
    "dense_column": (lambda: _mlp(fluid.optimizer.Adam(learning_rate=0.01)), 3, 2, True, 5),
    # ours with `--partitioner column`: the rank-4 conv filter cut by columns of its matrix
    "conv_column": (lambda: _conv_net(fluid.optimizer.Adam(learning_rate=0.01)), 3, 2, True, 5),
    "dense_async": (lambda: _mlp(fluid.optimizer.SGD(learning_rate=0.1)), 2, 1, False, 5),
    "lr_decay": (lambda: _mlp(fluid.optimizer.SGD(learning_rate=fluid.layers.exponential_decay(
        learning_rate=0.5, decay_steps=2, decay_rate=0.5, staircase=True))), 2, 2, True, 5),
    "lr_piecewise_l2": (lambda: _mlp(fluid.optimizer.Momentum(
        learning_rate=fluid.layers.piecewise_decay(boundaries=[2, 4], values=[0.5, 0.25, 0.1]), momentum=0.9,
        regularization=fluid.regularizer.L2Decay(1e-4))), 2, 2, True, 6),
    "sparse_prefetch": (lambda: _embedding_net(fluid.optimizer.SGD(learning_rate=0.5), False), 2, 2, True, 5),
    "sparse_async_adam": (lambda: _embedding_net(fluid.optimizer.Adam(learning_rate=0.01), False), 2, 1, False, 5),
    "distributed_table_async": (lambda: _embedding_net(fluid.optimizer.SGD(learning_rate=0.5), True), 2, 1, False, 5),
    "distributed_table": (lambda: _embedding_net(fluid.optimizer.SGD(learning_rate=0.5), True), 2, 2, True, 5),
}


def _fixture(name, loss, feeds):
    """A program Fluid 1.8.5 built earlier, from tests/fixtures/paddle_programs/<name> (the
    harness passes its path): its main.pb and startup.pb as they are."""
    def network(fixture_dir):
        with open(os.path.join(fixture_dir, "main.pb"), "rb") as f:
            main_bytes = f.read()
        with open(os.path.join(fixture_dir, "startup.pb"), "rb") as f:
            startup_bytes = f.read()
        return main_bytes, startup_bytes, loss, feeds, []
    network.fixture = name
    return network


CASES["fixture_basic_sgd"] = (
    _fixture("fluid18_basic_sgd_2ps", "mean_0.tmp_0",
             [{"name": "x", "kind": "dense", "dim": 1000}, {"name": "y", "kind": "target"}]), 2, 2, True, 5)


def build(case, out_dir, fixture_dir=None):
    network, pservers, trainers, sync, steps = CASES[case]
    if getattr(network, "fixture", None):
        main_bytes, startup_bytes, loss_name, feeds, tables = network(fixture_dir)
    else:
        main, startup = fluid.Program(), fluid.Program()
        main.random_seed = startup.random_seed = 1
        with fluid.program_guard(main, startup), fluid.unique_name.guard():
            loss, feeds, tables = network()
        main_bytes, startup_bytes = main.desc.serialize_to_string(), startup.desc.serialize_to_string()
        loss_name = loss.name
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "main.pb"), "wb") as f:
        f.write(main_bytes)
    with open(os.path.join(out_dir, "startup.pb"), "wb") as f:
        f.write(startup_bytes)
    # a loaded Program has no Parameter objects: the params are what optimizer ops update
    block = fluid.Program.parse_from_string(main_bytes).global_block()
    names = sorted(set(n for op in block.ops if "Param" in op.input_names for n in op.input("Param")))
    rng = np.random.RandomState(2020)
    init = {}
    params = []
    table_names = {t["name"] for t in tables}
    for name in names:
        shape = [int(d) for d in block.var(name).shape]
        if name in table_names:
            # every row of a table alike: a distributed shard hands out rows from its pool in
            # first-touch order, which two concurrent trainers make nondeterministic
            row = rng.uniform(-0.1, 0.1, size=(1, shape[1])).astype("float32")
            init[name] = np.repeat(row, shape[0], axis=0)
        else:
            init[name] = rng.uniform(-0.1, 0.1, size=shape).astype("float32")
            params.append(name)
    np.savez(os.path.join(out_dir, "init.npz"), **init)
    spec = {"case": case, "pservers": pservers, "trainers": trainers, "sync": sync, "steps": steps,
            "loss": loss_name, "feeds": feeds, "params": params, "tables": tables}
    with open(os.path.join(out_dir, "case.json"), "w") as f:
        json.dump(spec, f, indent=1)


def batch(spec, step, trainer):
    """The feed of `trainer` at `step`: the same in every run of the case."""
    rng = np.random.RandomState(1000 * step + trainer)
    feed = {}
    for item in spec["feeds"]:
        if item["kind"] == "dense":
            feed[item["name"]] = rng.uniform(-1, 1, size=(BATCH, item["dim"])).astype("float32")
        elif item["kind"] == "target":
            feed[item["name"]] = rng.uniform(-1, 1, size=(BATCH, 1)).astype("float32")
        elif item["kind"] == "label":
            feed[item["name"]] = rng.randint(0, item["classes"], size=(BATCH, 1)).astype("int64")
        else:
            feed[item["name"]] = rng.randint(0, item["rows"], size=(BATCH, 1)).astype("int64")
    return feed


# ---------------------------------------------------------------------------------------------
# Paddle's own transpiler, written in ps-transpiler's file layout

def _load(path):
    with open(path, "rb") as f:
        return fluid.Program.parse_from_string(f.read())


def _save(program, path):
    with open(path, "wb") as f:
        f.write(program.desc.serialize_to_string())


def _pserver_file(ep, suffix=""):
    host, port = ep.rsplit(":", 1)
    return "pserver_%s_%s%s.pb" % (host, port, suffix)


def _transpiler(case_dir, trainer_id, eps, trainers, sync):
    main, startup = _load(os.path.join(case_dir, "main.pb")), _load(os.path.join(case_dir, "startup.pb"))
    config = fluid.DistributeTranspilerConfig()
    config.sync_mode = sync        # 1.7+ takes the pservers' mode from here (facts §10.3)
    t = fluid.DistributeTranspiler(config=config)
    t.transpile(trainer_id, program=main, pservers=eps, trainers=trainers, sync_mode=sync,
                startup_program=startup)
    return t, startup


def transpile(case_dir, out_dir, eps, trainers, sync):
    for tid in range(trainers):
        # a fresh transpile per program: get_startup_program rewrites the trainer startup (§10)
        t, startup = _transpiler(case_dir, tid, eps, trainers, sync)
        sub = os.path.join(out_dir, "t%d" % tid)
        os.makedirs(sub, exist_ok=True)
        _save(t.get_trainer_program(wait_port=False), os.path.join(sub, "trainer.pb"))
        _save(startup, os.path.join(sub, "trainer_startup.pb"))
    for ep in eps.split(","):
        t, _ = _transpiler(case_dir, 0, eps, trainers, sync)
        prog = t.get_pserver_program(ep)
        _save(prog, os.path.join(out_dir, _pserver_file(ep)))
        _save(t.get_startup_program(ep, prog), os.path.join(out_dir, _pserver_file(ep, "_startup")))


# ---------------------------------------------------------------------------------------------
# running on Paddle's runtime

def _spec(case_dir):
    with open(os.path.join(case_dir, "case.json")) as f:
        return json.load(f)


def _block_rows(progs_dir):
    """{param: {block index: rows}} over every pserver program of the run: blocks are row
    ranges in index order, so block i starts after the rows of blocks 0..i-1."""
    found = {}
    for name in sorted(os.listdir(progs_dir)):
        if name.startswith("pserver_") and not name.endswith("_startup.pb"):
            for var in _load(os.path.join(progs_dir, name)).global_block().vars.values():
                m = re.match(r"^(.*)\.block(\d+)$", var.name)
                if m:
                    found.setdefault(m.group(1), {})[int(m.group(2))] = int(var.shape[0])
    return found


def _set(name, value, place, selected_rows=False):
    var = fluid.global_scope().find_var(name)
    if var is None:
        raise SystemExit("interop: %s is not in the scope after the startup" % name)
    if selected_rows:
        var.get_selected_rows().get_tensor().set(value, place)
    else:
        var.get_tensor().set(value, place)


def _get(name, selected_rows=False):
    var = fluid.global_scope().find_var(name)
    return np.array(var.get_selected_rows().get_tensor() if selected_rows else var.get_tensor())


def _partitions(progs_dir):
    """{block var: (row_offset, rows, col_offset, cols)} of the 2-D partitions in the run's
    plan.json (ours with a partitioner, which the harness copies beside the programs)."""
    path = os.path.join(progs_dir, "plan.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        plan = json.load(f)
    return {b["name"]: (b["row_offset"], b["rows"], b["col_offset"], b["cols"])
            for p in plan["params"] for b in p["blocks"] if "cols" in b}


def serve(case_dir, progs_dir, ep, run_dir):
    spec = _spec(case_dir)
    init = np.load(os.path.join(case_dir, "init.npz"))
    prog = _load(os.path.join(progs_dir, _pserver_file(ep)))
    startup = _load(os.path.join(progs_dir, _pserver_file(ep, "_startup")))
    place = fluid.CPUPlace()
    exe = fluid.Executor(place)
    exe.run(startup)
    blocks = _block_rows(progs_dir)
    partitions = _partitions(progs_dir)
    tables = {t["name"]: t for t in spec["tables"]}
    own = {}   # what the pserver startup itself made of each param, kept for the harness's report
    for var in prog.global_block().vars.values():
        if var.type not in (core.VarDesc.VarType.LOD_TENSOR, core.VarDesc.VarType.SELECTED_ROWS):
            continue
        shape = [int(d) for d in var.shape]
        m = re.match(r"^(.*)\.block(\d+)$", var.name)
        if var.name in init.files or (m and m.group(1) in init.files):
            own[var.name] = _get(var.name, var.type == core.VarDesc.VarType.SELECTED_ROWS)
        if var.name in init.files:
            full = init[var.name]
            if var.name in tables and tables[var.name]["distributed"]:
                value = full[:shape[0]]            # the shard's row pool (all rows alike)
            else:
                value = full
            _set(var.name, value, place, var.type == core.VarDesc.VarType.SELECTED_ROWS)
        elif m and var.name in partitions:
            r0, rows, c0, cols = partitions[var.name]
            whole = init[m.group(1)]
            _set(var.name, np.ascontiguousarray(whole.reshape(whole.shape[0], -1)[r0:r0 + rows, c0:c0 + cols]), place)
        elif m and m.group(1) in init.files:
            index = int(m.group(2))
            start = sum(rows for i, rows in blocks[m.group(1)].items() if i < index)
            _set(var.name, init[m.group(1)][start:start + shape[0]], place)
    np.savez(os.path.join(run_dir, "startup_values_%s.npz" % ep.rsplit(":", 1)[1]), **own)
    print("interop: pserver %s serving" % ep, flush=True)
    exe.run(prog)


def _wait_ports(eps, seconds=60.0):
    """As Paddle's own wait_server_ready: until each pserver accepts a connection."""
    deadline = time.time() + seconds
    for ep in eps:
        host, port = ep.rsplit(":", 1)
        while True:
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                break
            except OSError:
                pass
            if time.time() > deadline:
                raise SystemExit("interop: pserver %s did not open its port in %.0f s" % (ep, seconds))
            time.sleep(0.2)


def _prefetch_all(trainer_prog, table, exe):
    """The whole remote table, read through the trainer's own prefetch ops on ids 0..rows-1:
    its `distributed_lookup_table`, or its `split_ids -> prefetch -> merge_ids` (the nets here
    look each table up once, so the chain reads one Ids var)."""
    block = trainer_prog.global_block()
    chain = []
    for op in block.ops:
        if any(n.endswith("@GRAD") or "@GRAD." in n for n in op.input_arg_names):
            continue
        if op.type == "distributed_lookup_table" and any(
                n == table["name"] or n.startswith(table["name"] + ".block") for n in op.attr("table_names")):
            chain.append(op)
        elif op.type in ("split_ids", "prefetch", "merge_ids"):
            chain.append(op)
    if not chain:
        raise SystemExit("interop: the trainer program has no prefetch op for table %s" % table["name"])
    ids_name = chain[0].input("Ids")[0]
    prog = fluid.Program()
    new = prog.global_block()
    new.create_var(name="interop_all_ids", shape=[-1, 1], dtype="int64")
    for name in set(n for op in chain for n in op.input_arg_names + op.output_arg_names) - {ids_name}:
        src = block.var(name)
        new.create_var(name=name, shape=src.shape, dtype=src.dtype, type=src.type, persistable=src.persistable)
    for op in chain:
        inputs = {slot: [new.var("interop_all_ids" if n == ids_name else n) for n in op.input(slot)]
                  for slot in op.input_names}
        outputs = {slot: [new.var(n) for n in op.output(slot)] for slot in op.output_names}
        new.append_op(type=op.type, inputs=inputs, outputs=outputs, attrs=op.all_attrs())
    last = chain[-1]
    out_name = last.output("Outputs" if last.type == "distributed_lookup_table" else "Out")[0]
    out, = exe.run(prog, feed={"interop_all_ids": np.arange(table["rows"], dtype="int64").reshape(-1, 1)},
                   fetch_list=[out_name])
    return np.array(out)


def _start_barrier(run_dir, trainer_id, trainers, seconds=60.0):
    """Step 0 only once every trainer has its params. Without this, when trainer 1 started 3 s
    after trainer 0 (its step-0 grads reaching Fluid 1.8.5's sync pserver before trainer 1's
    startup fetch), OUR programs stalled the pserver's gRPC for 25 s at a time in 10 of 35
    runs; Paddle's own programs in 0 of 21. Cause not found (see docs/interop.md); the barrier
    keeps the comparison about training, and is the same for both programs."""
    open(os.path.join(run_dir, "started.%d" % trainer_id), "w").close()
    deadline = time.time() + seconds
    while not all(os.path.exists(os.path.join(run_dir, "started.%d" % i)) for i in range(trainers)):
        if time.time() > deadline:
            raise SystemExit("interop: trainer %d: the other trainers did not start in %.0f s" % (trainer_id, seconds))
        time.sleep(0.05)


def train(case_dir, progs_dir, trainer_id, out_path, start_barrier=False):
    spec = _spec(case_dir)
    sub = os.path.join(progs_dir, "t%d" % trainer_id)
    prog = _load(os.path.join(sub, "trainer.pb"))
    startup = _load(os.path.join(sub, "trainer_startup.pb"))
    eps = [n for n in os.listdir(progs_dir) if n.startswith("pserver_") and not n.endswith("_startup.pb")]
    eps = [n[len("pserver_"):-len(".pb")].rsplit("_", 1) for n in eps]
    _wait_ports(["%s:%s" % (h, p) for h, p in sorted(eps)])
    place = fluid.CPUPlace()
    exe = fluid.Executor(place)
    exe.run(startup)
    if start_barrier:
        _start_barrier(os.path.dirname(os.path.abspath(out_path)), trainer_id, spec["trainers"])
    print("interop: trainer %d started" % trainer_id, flush=True)
    losses = []
    for step in range(spec["steps"]):
        loss, = exe.run(prog, feed=batch(spec, step, trainer_id), fetch_list=[spec["loss"]],
                        use_program_cache=True)
        losses.append(np.array(loss).reshape(-1)[0])
        print("interop: trainer %d step %d loss %r" % (trainer_id, step, float(losses[-1])), flush=True)
    result = {"losses": np.array(losses, dtype="float32")}
    if trainer_id == 0:
        scope = fluid.global_scope()
        for name in spec["params"]:
            result["param:" + name] = np.array(scope.find_var(name).get_tensor())
        for table in spec["tables"]:
            result["param:" + table["name"]] = _prefetch_all(prog, table, exe)
    np.savez(out_path, **result)
    exe.close()


def local(case_dir, out_path):
    spec = _spec(case_dir)
    prog = _load(os.path.join(case_dir, "main.pb"))
    startup = _load(os.path.join(case_dir, "startup.pb"))
    init = np.load(os.path.join(case_dir, "init.npz"))
    place = fluid.CPUPlace()
    exe = fluid.Executor(place)
    exe.run(startup)
    for name in init.files:
        _set(name, init[name], place)
    losses = []
    for step in range(spec["steps"]):
        parts = [batch(spec, step, t) for t in range(spec["trainers"])]
        feed = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        loss, = exe.run(prog, feed=feed, fetch_list=[spec["loss"]], use_program_cache=True)
        losses.append(np.array(loss).reshape(-1)[0])
    result = {"losses": np.array(losses, dtype="float32")}
    for name in init.files:
        result["param:" + name] = np.array(fluid.global_scope().find_var(name).get_tensor())
    np.savez(out_path, **result)


def main(argv):
    cmd, args = argv[0], argv[1:]
    if cmd == "build":
        build(args[0], args[1], args[args.index("--fixture") + 1] if "--fixture" in args else None)
    elif cmd == "transpile":
        case_dir, out_dir = args[0], args[1]
        eps = args[args.index("--pservers") + 1]
        trainers = int(args[args.index("--trainers") + 1])
        transpile(case_dir, out_dir, eps, trainers, "--async" not in args)
    elif cmd == "pserver":
        serve(args[0], args[1], args[2], args[3])
    elif cmd == "trainer":
        train(args[0], args[1], int(args[2]), args[3], "--start-barrier" in args)
    elif cmd == "local":
        local(args[0], args[1])
    else:
        raise SystemExit("interop: unknown command %r" % cmd)


if __name__ == "__main__":
    # os._exit: a Paddle process whose gRPC client or server threads are still up can hang
    # in interpreter shutdown after an error; the harness would only see a timeout
    code = 0
    try:
        main(sys.argv[1:])
    except SystemExit as error:
        if isinstance(error.code, int):
            code = error.code
        elif error.code is not None:
            print(error.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
