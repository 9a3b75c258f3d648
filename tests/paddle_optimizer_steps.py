"""Run one optimizer op for a few steps with Paddle's own kernel (run by the Paddle venv's
Python, from tests/test_kernels_optimizers.py).

    python paddle_optimizer_steps.py CASES.json IN.npz OUT.npz

CASES.json: [{"name", "type", "attrs", "steps"}]; IN.npz holds `<name>/<slot>` for every
input slot (the state) and `<name>/Grad<k>` per step; OUT.npz gets `<name>/<slot>Out` after
the last step (each step's outputs fed back as the next step's inputs).
"""

import json
import sys

import numpy as np
import paddle

STATE = ("Param", "Moment1", "Moment2", "Beta1Pow", "Beta2Pow")


def run(case, given, exe):
    name, steps = case["name"], case["steps"]
    state = {slot: given[f"{name}/{slot}"] for slot in (*STATE, "LearningRate")}
    main = paddle.static.Program()
    with paddle.static.program_guard(main):
        block = main.global_block()
        shapes = {**{slot: v.shape for slot, v in state.items()}, "Grad": state["Param"].shape}
        var = {slot: block.create_var(name=slot, shape=shape, dtype="float64", persistable=False)
               for slot, shape in shapes.items()}
        outs = {f"{slot}Out": block.create_var(name=f"{slot}Out", shape=state[slot].shape, dtype="float64")
                for slot in STATE}
        block.append_op(type=case["type"], inputs={slot: [v] for slot, v in var.items()},
                        outputs={slot: [v] for slot, v in outs.items()}, attrs=case["attrs"])
    names = sorted(outs)
    for k in range(steps):
        feed = {**state, "Grad": given[f"{name}/Grad{k}"]}
        values = exe.run(main, feed=feed, fetch_list=names)
        for out, value in zip(names, values):
            state[out[:-3]] = np.asarray(value)
    return {f"{name}/{slot}Out": state[slot] for slot in STATE}


def main(argv):
    paddle.enable_static()
    cases = json.loads(open(argv[0]).read())
    given = dict(np.load(argv[1]))
    exe = paddle.static.Executor(paddle.CPUPlace())
    out = {}
    for case in cases:
        out.update(run(case, given, exe))
    np.savez(argv[2], **out)


if __name__ == "__main__":
    main(sys.argv[1:])
