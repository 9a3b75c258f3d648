"""Build Fluid 1.8.5 fixtures and record what Fluid 1.8.5's own transpiler makes of them.

Run with the Fluid 1.8.5 reference venv's Python 3.7 (a test and tool dependency only):

    $(python3 tools/paddle_env.py 1.8.5) tools/make_fluid18_fixtures.py [CASE ...]

It writes tests/fixtures/paddle_programs/<case>/{main.pb,startup.pb,case.json,expected.json}
in the format of tests/fixtures/paddle_programs/README.md (expected.json: Paddle's trainer,
trainer startup and pserver programs, op types, slots and the placement attrs). Names start
afresh for each build and the script runs under PYTHONHASHSEED=0 (it re-executes itself):
running it twice gives the same bytes.
"""

import json
import os
import sys

import paddle
import paddle.fluid as fluid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "paddle_programs")
KEPT_ATTRS = (
    "Fanin", "grad_to_block_id", "sparse_grad_to_param", "lr_decay_block_id", "distributed_mode", "endpoint",
    "epmap", "sections", "height_sections", "table_names", "send_varnames", "recv_varnames", "endpoints",
    "trainer_id", "axis",
)


def clip_norm_momentum():
    """x[64] -> fc 512 relu -> fc 1, square error; set_gradient_clip(GradientClipByNorm(0.01))
    on every param, L2Decay(1e-4), Momentum(0.1, 0.9). fc_0.w_0 (32768 elements) is sliced."""
    x = fluid.data(name="x", shape=[None, 64], dtype="float32")
    y = fluid.data(name="y", shape=[None, 1], dtype="float32")
    h = fluid.layers.fc(x, size=512, act="relu")
    out = fluid.layers.fc(h, size=1)
    loss = fluid.layers.mean(fluid.layers.square(out - y))
    fluid.clip.set_gradient_clip(fluid.clip.GradientClipByNorm(clip_norm=0.01))
    fluid.optimizer.Momentum(learning_rate=0.1, momentum=0.9,
                             regularization=fluid.regularizer.L2Decay(1e-4)).minimize(loss)
    return loss.name


CASES = {
    # case -> (network, description, optimizer, pservers, trainers)
    "fluid18_clip_norm_momentum_2ps": (
        clip_norm_momentum,
        "x[64] -> fc 512 relu -> fc 1, square error; set_gradient_clip(GradientClipByNorm(0.01)), L2Decay(1e-4)",
        "Momentum (lr 0.1, 0.9)", 2, 2),
}


def block_json(block):
    ops = []
    for op in block.ops:
        ops.append({
            "type": op.type,
            "inputs": {slot: list(op.input(slot)) for slot in op.input_names if op.input(slot)},
            "outputs": {slot: list(op.output(slot)) for slot in op.output_names if op.output(slot)},
            "attrs": {name: _plain(op.attr(name)) for name in KEPT_ATTRS if op.has_attr(name)},
        })
    variables = {}
    for name, var in block.vars.items():
        try:
            shape = list(var.shape)
        except Exception:  # a var kind without a tensor desc
            shape = None
        variables[name] = {"shape": shape, "type": str(var.type).split(".")[-1], "persistable": bool(var.persistable)}
    return {"ops": ops, "vars": variables}


def _plain(value):
    return list(value) if isinstance(value, (list, tuple)) else value


def program_json(program):
    return [block_json(block) for block in program.blocks]


def strip_callstacks(program):
    for block in program.blocks:
        for op in block.ops:
            if op.desc.has_attr("op_callstack"):
                op.desc.remove_attr("op_callstack")


def make_case(name):
    network, description, optimizer, n_pservers, trainers = CASES[name]
    folder = os.path.join(OUT, name)
    if not os.path.isdir(folder):
        os.makedirs(folder)
    main, startup = fluid.Program(), fluid.Program()
    with fluid.unique_name.guard(), fluid.program_guard(main, startup):
        loss = network()
    strip_callstacks(main)
    strip_callstacks(startup)
    with open(os.path.join(folder, "main.pb"), "wb") as f:
        f.write(main.desc.serialize_to_string())
    with open(os.path.join(folder, "startup.pb"), "wb") as f:
        f.write(startup.desc.serialize_to_string())
    pservers = ",".join("127.0.0.1:%d" % (6170 + i) for i in range(n_pservers))
    case = {"pservers": pservers, "trainers": trainers, "trainer_id": 0, "sync_mode": True, "slice_var_up": True,
            "split_method": "RoundRobin", "min_block_size": 8192, "loss": loss, "network": description,
            "optimizer": optimizer, "paddle": paddle.__version__, "generator": "tools/make_fluid18_fixtures.py",
            "real_model": False}
    with open(os.path.join(folder, "case.json"), "w") as f:
        f.write(json.dumps(case, indent=1) + "\n")
    config = fluid.DistributeTranspilerConfig()
    config.slice_var_up = True
    config.min_block_size = 8192
    transpiler = fluid.DistributeTranspiler(config=config)
    transpiler.transpile(0, program=main, pservers=pservers, trainers=trainers, sync_mode=True,
                         startup_program=startup)
    programs = {}
    for endpoint in pservers.split(","):
        pserver_main, pserver_startup = transpiler.get_pserver_programs(endpoint)
        programs[endpoint] = {"main": program_json(pserver_main), "startup": program_json(pserver_startup)}
    expected = {"pservers": programs, "trainer": program_json(transpiler.get_trainer_program(wait_port=False)),
                "trainer_startup": program_json(transpiler.startup_program)}
    text = json.dumps(expected, separators=(",", ":"), sort_keys=False)
    with open(os.path.join(folder, "expected.json"), "w") as f:
        f.write(text + "\n")
    print("%s: %d trainer ops" % (name, len(expected["trainer"][0]["ops"])))


def main(argv):
    if os.environ.get("PYTHONHASHSEED") != "0":
        env = dict(os.environ, PYTHONHASHSEED="0")
        os.execve(sys.executable, [sys.executable, __file__] + argv, env)
    for name in argv or CASES:
        make_case(name)


if __name__ == "__main__":
    main(sys.argv[1:])
