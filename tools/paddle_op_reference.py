"""Run single ops (and their grads) in Paddle 2.6's static graph on given inputs: the
reference the kernel conformance tests compare with (tests/test_kernels_vision.py).

    $(python3 tools/paddle_env.py 2.6.2) tools/paddle_op_reference.py CASES.json INPUTS.npz OUT.npz

CASES.json is a list of cases, each
    {"id": ..., "op": "conv2d", "inputs": {"Input": ["x"], ...}, "outputs": {"Output": ["y"], ...},
     "attrs": {...}, "state": ["mean", ...], "grads": ["x", "w"], "targets": ["y"], "fetch": ["y", ...]}
INPUTS.npz holds `<id>/<name>` for every input var, and `<id>/<target>@GRAD` for each
target's upstream grad. Each case becomes one Program: the inputs are data vars (`state`
ones are persistable vars set in the scope, for ops that update them in place, such as
batch_norm's Mean/MeanOut), one `append_op` with the attrs as given (Paddle's own op desc
and CPU kernel), then `paddle.static.gradients(targets, grads, target_gradients)` (Paddle's
own grad makers and grad kernels). OUT.npz gets `<id>/<name>` of every output (or of those `fetch` names), every
`state` var after the run, and `<id>/<name>@GRAD` of every `grads` var. One process runs all
cases (Paddle takes ~1 s to import). Paddle only: never imported by the product.
"""

from __future__ import annotations

import numpy.random  # noqa: F401  (before paddle: Paddle's bundled zlib breaks a later import)

import json
import sys

import numpy as np
import paddle


def run_case(case: dict, arrays: dict[str, np.ndarray], out: dict[str, np.ndarray]) -> None:
    cid = case["id"]
    main, startup = paddle.static.Program(), paddle.static.Program()
    scope = paddle.static.Scope()
    place = paddle.CPUPlace()
    state = set(case.get("state", ()))
    with paddle.static.program_guard(main, startup), paddle.static.scope_guard(scope):
        block = main.global_block()
        feed, variables = {}, {}
        for names in case["inputs"].values():
            for name in names:
                value = arrays[f"{cid}/{name}"]
                if name in state:
                    var = block.create_var(name=name, shape=value.shape, dtype=str(value.dtype), persistable=True)
                    scope.var(name).get_tensor().set(value, place)
                else:
                    var = paddle.static.data(name, list(value.shape), str(value.dtype))
                    var.stop_gradient = name not in case["grads"]
                    feed[name] = value
                variables[name] = var
        outputs = {}
        for slot, names in case["outputs"].items():
            outputs[slot] = []
            for name in names:
                if name not in variables:
                    variables[name] = block.create_var(name=name, dtype=next(iter(feed.values())).dtype.name)
                outputs[slot].append(variables[name])
        block.append_op(type=case["op"], inputs={s: [variables[n] for n in ns] for s, ns in case["inputs"].items()},
                        outputs=outputs, attrs=case["attrs"])
        fetch = case.get("fetch") or [n for ns in case["outputs"].values() for n in ns]
        grads = []
        if case["grads"]:
            targets = [variables[n] for n in case["targets"]]
            upstream = []
            for name in case["targets"]:
                value = arrays[f"{cid}/{name}@GRAD"]
                upstream.append(paddle.static.data(f"{name}@UPSTREAM", list(value.shape), str(value.dtype)))
                feed[f"{name}@UPSTREAM"] = value
            grads = paddle.static.gradients(targets, [variables[n] for n in case["grads"]], upstream)
        exe = paddle.static.Executor(place)
        values = exe.run(main, feed=feed, fetch_list=[variables[n] for n in fetch] + list(grads), return_numpy=True)
        for name, value in zip(fetch + [f"{n}@GRAD" for n in case["grads"]], values):
            value = np.asarray(value)
            if value.dtype == object:
                raise SystemExit(f"{cid}: Paddle gave no value for {name}")
            out[f"{cid}/{name}"] = value
        for name in state:
            out[f"{cid}/{name}"] = np.array(scope.find_var(name).get_tensor())


def main(argv: list[str]) -> int:
    cases_path, inputs_path, out_path = argv
    paddle.enable_static()
    cases = json.loads(open(cases_path).read())
    arrays = dict(np.load(inputs_path))
    out: dict[str, np.ndarray] = {}
    for case in cases:
        run_case(case, arrays, out)
    np.savez(out_path, **out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
