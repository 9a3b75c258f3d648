"""Run a sparse optimizer op (a SelectedRows grad, duplicate rows included) for a few steps
with Paddle's own kernel (run by the Paddle venv's Python, from tests/test_kernels_optimizers.py).

    python paddle_sparse_optimizer_steps.py CASES.json IN.npz OUT.npz

CASES.json: [{"name", "type", "attrs", "state": {slot: out slot}, "steps", "separate": [slot]}]; IN.npz holds
`<name>/<slot>` per state slot and `LearningRate`, and per step `<name>/rows<k>` (the grad's
rows, repeats allowed) and `<name>/value<k>`; OUT.npz gets `<name>/<slot>` after the last
step. The state lives in the scope: each step's op writes its outputs over its inputs, but
for the `separate` slots, whose outputs go to their own vars and are copied back after the step.
"""

import json
import sys

import numpy as np
import paddle
from paddle.base import core



def run(case, given, exe, place):
    name, steps, state = case["name"], case["steps"], case["state"]
    scope = paddle.static.Scope()
    main = paddle.static.Program()
    with paddle.static.program_guard(main):
        block = main.global_block()
        param = given[f"{name}/Param"]
        ins = {}
        for slot in (*state, "LearningRate"):
            value = given[f"{name}/{slot}"]
            ins[slot] = [block.create_var(name=slot, shape=value.shape, dtype="float64", persistable=True)]
        ins["Grad"] = [block.create_var(name="Grad", shape=param.shape, dtype="float64",
                                        type=core.VarDesc.VarType.SELECTED_ROWS,
                                        persistable=True)]
        # a slot of `separate` writes its own out var, copied back after each step
        separate = set(case.get("separate", ()))
        outs = {out: [block.create_var(name=out, shape=given[f"{name}/{slot}"].shape, dtype="float64",
                                       persistable=True) if slot in separate else block.var(slot)]
                for slot, out in state.items()}
        block.append_op(type=case["type"], inputs=ins, outputs=outs, attrs=case["attrs"])
    with paddle.static.scope_guard(scope):
        for slot in (*state, "LearningRate"):
            scope.var(slot).get_tensor().set(given[f"{name}/{slot}"], place)
        for k in range(steps):
            grad = scope.var("Grad").get_selected_rows()
            grad.set_height(param.shape[0])
            grad.set_rows([int(r) for r in given[f"{name}/rows{k}"]])
            grad.get_tensor().set(given[f"{name}/value{k}"], place)
            exe.run(main)
            for slot in separate:
                scope.var(slot).get_tensor().set(np.array(scope.find_var(state[slot]).get_tensor()), place)
        return {f"{name}/{slot}": np.array(scope.find_var(slot).get_tensor()) for slot in state}


def main() -> None:
    cases = json.loads(open(sys.argv[1]).read())
    given = dict(np.load(sys.argv[2]))
    paddle.enable_static()
    place = paddle.CPUPlace()
    exe = paddle.static.Executor(place)
    out = {}
    for case in cases:
        out.update(run(case, given, exe, place))
    np.savez(sys.argv[3], **out)


if __name__ == "__main__":
    main()
