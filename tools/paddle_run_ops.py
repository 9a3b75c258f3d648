"""Run ops on Paddle 2.6's own CPU kernels: the reference the kernel conformance tests
compare ours against (tests/test_kernels_vision.py, tests/test_kernels_transformer.py).

    $(python3 tools/paddle_env.py 2.6.2) tools/paddle_run_ops.py CASES.json ARRAYS.npz OUT.npz

CASES.json is a list of cases of two kinds; one process runs them all (Paddle takes ~1 s to
import). Paddle is a test dependency only: never imported by the product.

* `{"id", "op": "conv2d", "inputs": {"Input": ["x"], ...}, "outputs": {"Output": ["y"], ...},
  "attrs": {...}, "state": ["mean", ...], "grads": ["x", "w"], "targets": ["y"], "fetch": ["y", ...]}`:
  ARRAYS.npz holds `<id>/<name>` for every input var and `<id>/<target>@GRAD` for each
  target's upstream grad. The inputs are data vars (`state` ones are persistable vars set in
  the scope, for ops that update them in place, such as batch_norm's Mean/MeanOut), one
  `append_op` with the attrs as given (Paddle's own op desc and CPU kernel), then
  `paddle.static.gradients(targets, grads, target_gradients)` (Paddle's own grad makers and
  grad kernels). OUT.npz gets `<id>/<name>` of every output (or of the `fetch` names), every
  `state` var after the run, and `<id>/<name>@GRAD` of every `grads` var. A case Paddle
  refuses stops the tool (exit status not 0).
* `{"id", "ops": [{"type", "inputs", "outputs", "attrs"}], "feeds": {name: array key},
  "fetch": [names]}`: op descs built by hand, exactly as given (a grad op is appended as the
  op its maker would emit, with the slots the case wires), run by Paddle's executor on the
  fed arrays, each case in a forked child. OUT.npz gets `<id>/<fetched name>` for each
  fetch; a case Paddle refuses gets `<id>/__error__` (its message) instead.
"""

from __future__ import annotations

import numpy.random  # noqa: F401  (before paddle: Paddle's bundled zlib breaks a later import)

import json
import os
import sys

import numpy as np
import paddle
from paddle.base import framework


_SETTERS = {  # framework.proto AttrType -> OpDesc setter
    0: "_set_int32_attr", 1: "_set_float32_attr", 2: "_set_str_attr", 3: "_set_int32s_attr",
    4: "_set_float32s_attr", 5: "_set_strs_attr", 6: "_set_bool_attr", 7: "_set_bools_attr",
    9: "_set_int64_attr", 11: "_set_int64s_attr", 12: "_set_float64s_attr", 15: "_set_float64_attr",
}


def _proto_types(op_type: str) -> dict[str, int]:
    """The attr types Paddle's maker declares for the op (a grad op: its forward op's)."""
    holder = framework.OpProtoHolder.instance()
    for name in (op_type, op_type[: -len("_grad")] if op_type.endswith("_grad") else None):
        if name and name in holder.op_proto_map:
            return {a.name: a.type for a in holder.get_op_proto(name).attrs}
    return {}


def _set_attr(desc, name: str, value, declared: dict[str, int]) -> None:
    """Typed as Paddle's maker declares it, else from the Python value."""
    if name in declared and declared[name] in _SETTERS:
        getattr(desc, _SETTERS[declared[name]])(name, value)
    elif isinstance(value, list) and value and all(isinstance(v, bool) for v in value):
        desc._set_bools_attr(name, value)
    elif isinstance(value, list) and all(isinstance(v, int) for v in value):
        desc._set_int32s_attr(name, value)
    elif isinstance(value, float):
        desc._set_float32_attr(name, value)
    elif isinstance(value, bool):
        desc._set_bool_attr(name, value)
    elif isinstance(value, int):
        desc._set_int32_attr(name, value)
    else:
        desc._set_attr(name, value)


def run_case(case: dict, arrays) -> dict[str, np.ndarray]:
    """A `"ops"` case: its op descs as given, run by Paddle's executor."""
    main, startup = paddle.static.Program(), paddle.static.Program()
    block = main.global_block()
    feed = {name: arrays[key] for name, key in case["feeds"].items()}
    for name, value in feed.items():
        block.create_var(name=name, shape=value.shape, dtype=value.dtype, persistable=False)
    for op in case["ops"]:
        for args in (*op["inputs"].values(), *op["outputs"].values()):
            for name in args:
                if not block.has_var(name):
                    block.create_var(name=name, dtype="float32", persistable=False)
    forward_attrs: dict[str, dict] = {}
    for op in case["ops"]:
        desc = block.desc.append_op()
        desc.set_type(op["type"])
        for slot, args in op["inputs"].items():
            desc.set_input(slot, args)
        for slot, args in op["outputs"].items():
            desc.set_output(slot, args)
        declared = _proto_types(op["type"])
        for name, value in op["attrs"].items():
            _set_attr(desc, name, value, declared)
        if op["type"] in framework.OpProtoHolder.instance().op_proto_map:
            desc.check_attrs()  # Paddle's defaults for the attrs the case leaves out
            forward_attrs[op["type"]] = {n: desc.attr(n) for n in desc.attr_names()}
        else:  # a grad op: the attrs its maker would copy from the forward op
            for name, value in forward_attrs.get(op["type"][: -len("_grad")], {}).items():
                if not desc.has_attr(name):
                    _set_attr(desc, name, value, declared)
    main._sync_with_cpp()
    exe = paddle.static.Executor(paddle.CPUPlace())
    values = exe.run(main, feed=feed, fetch_list=case["fetch"], return_numpy=True)
    return dict(zip(case["fetch"], values))


def run_isolated(case: dict, arrays, scratch: str) -> dict[str, np.ndarray]:
    """Run one case in a forked child: Paddle's failing grad kernels can corrupt memory
    (a later, valid case then crashes), so no case shares a process with another."""
    path = f"{scratch}.{os.getpid()}.npz"
    pid = os.fork()
    if pid == 0:  # the child: run, save, leave without Python's cleanup
        code = 0
        try:
            out = {f"{case['id']}/{k}": np.asarray(v) for k, v in run_case(case, arrays).items()}
            odd = [k for k, v in out.items() if v.dtype == object]
            if odd:
                raise TypeError(f"Paddle fetched no tensor for {odd}")
        except Exception as exc:  # Paddle refuses the case: the test decides what that means
            out = {f"{case['id']}/__error__": np.array(str(exc).strip().splitlines()[0][:500])}
        try:
            np.savez(path, **out)
        except Exception:
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if not os.path.exists(path):
        return {f"{case['id']}/__error__": np.array(f"Paddle's process died (wait status {status})")}
    with np.load(path) as saved:
        out = {k: saved[k] for k in saved.files}
    os.unlink(path)
    return out


def run_with_grads(case: dict, arrays: dict[str, np.ndarray], out: dict[str, np.ndarray]) -> None:
    """A `"op"` case: one `append_op`, then Paddle's own grad makers (`paddle.static.gradients`)."""
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


def main(argv: list[str]) -> None:
    cases_path, arrays_path, out_path = argv
    paddle.enable_static()
    cases = json.loads(open(cases_path).read())
    with np.load(arrays_path) as saved:
        arrays = {k: saved[k] for k in saved.files}
    out: dict[str, np.ndarray] = {}
    for case in cases:
        if "op" in case:
            run_with_grads(case, arrays, out)
        else:
            out.update(run_isolated(case, arrays, out_path))
    np.savez(out_path, **out)


if __name__ == "__main__":
    main(sys.argv[1:])
