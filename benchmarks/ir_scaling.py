"""How the IR's costs grow with program size: load, verify, graph build, dump, save.

Builds synthetic training programs shaped like Fluid's (a chain of fc layers: `mul`,
`elementwise_add`, `relu`, their grad ops and one `sgd` per parameter; ops carry ~10
attrs as Paddle's do, callstacks included; every var declared), then times each stage
and prints µs per op and the growth ratio between consecutive sizes. A ratio of
(time ratio) / (size ratio) near 1.0 is linear growth; well above 1 is superlinear.

    python3 benchmarks/ir_scaling.py [--sizes 1000,10000,100000] [--repeat 3] [--gc-off] [--calls]

Wall-clock µs/op on a shared 2-core machine vary by ±30% between runs; `--calls` gives
a clock-free check (Python calls per op stay constant when growth is linear).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transpiler.ir import Attr, AttrType, Program  # noqa: E402
from transpiler.ir.graph import BlockGraph  # noqa: E402
from transpiler.ir.printer import dump  # noqa: E402
from transpiler.ir.types import OpRole  # noqa: E402
from transpiler.ir.verifier import verify  # noqa: E402

OPS_PER_LAYER = 8  # mul, elementwise_add, relu, relu_grad, elementwise_add_grad, mul_grad, sgd, sgd
WIDTH = 64
STAGES = ("load", "verify", "graph", "dump", "save")


def _common(role: OpRole, layer: int, role_var: tuple[str, ...] = ()) -> dict:
    attrs = {
        "op_role": int(role),
        "op_device": "",
        "use_mkldnn": False,
        "with_quant_attr": False,
        "op_namescope": f"/fc_{layer}/",
        "op_callstack": (
            f'  File "train.py", line {100 + layer}, in build',
            "    hidden = fluid.layers.fc(hidden, size=64, act='relu')",
            '  File "paddle/fluid/layers/nn.py", line 345, in fc',
            "    helper.append_op(type='mul', ...)",
        ),
    }
    attrs["op_role_var"] = Attr.of(role_var, AttrType.STRINGS)  # [] cannot be inferred
    return attrs


def build_program(num_ops: int) -> Program:
    """A chain of `num_ops // 8` fc layers with backward and sgd, all in block 0."""
    layers = max(1, num_ops // OPS_PER_LAYER)
    program = Program.empty()
    block = program.global_block()
    block.create_var("x0", dtype="float32", shape=(-1, WIDTH), stop_gradient=True, need_check_feed=True)
    block.create_var("learning_rate", dtype="float32", shape=(1,), persistable=True)
    for i in range(layers):
        for name, shape, persistable in (
            (f"fc_{i}.w", (WIDTH, WIDTH), True),
            (f"fc_{i}.b", (WIDTH,), True),
            (f"fc_{i}.tmp_0", (-1, WIDTH), False),
            (f"fc_{i}.tmp_1", (-1, WIDTH), False),
            (f"x{i + 1}", (-1, WIDTH), False),
        ):
            block.create_var(name, dtype="float32", shape=shape, persistable=persistable, is_parameter=persistable)
            block.create_var(name + "@GRAD", dtype="float32", shape=shape)
    block.create_var("x0@GRAD", dtype="float32", shape=(-1, WIDTH))
    for i in range(layers):  # forward
        x, w, b, t0, t1, y = f"x{i}", f"fc_{i}.w", f"fc_{i}.b", f"fc_{i}.tmp_0", f"fc_{i}.tmp_1", f"x{i + 1}"
        fwd = _common(OpRole.Forward, i)
        block.add_op("mul", {"X": x, "Y": w}, {"Out": t0}, {**fwd, "x_num_col_dims": 1, "y_num_col_dims": 1,
                                                           "scale_x": 1.0, "scale_y": [1.0]})
        block.add_op("elementwise_add", {"X": t0, "Y": b}, {"Out": t1}, {**fwd, "axis": 1, "x_data_format": "",
                                                                         "y_data_format": "", "Scale_out": 1.0})
        block.add_op("relu", {"X": t1}, {"Out": y}, {**fwd, "use_cudnn": False, "is_test": False,
                                                     "alpha": 0.0, "threshold": 6.0})
    for i in reversed(range(layers)):  # backward
        x, w, b, t0, t1, y = f"x{i}", f"fc_{i}.w", f"fc_{i}.b", f"fc_{i}.tmp_0", f"fc_{i}.tmp_1", f"x{i + 1}"
        bwd = _common(OpRole.Backward, i)
        block.add_op("relu_grad", {"Out": y, "Out@GRAD": y + "@GRAD"}, {"X@GRAD": t1 + "@GRAD"},
                     {**bwd, "use_cudnn": False, "is_test": False, "alpha": 0.0, "threshold": 6.0})
        block.add_op("elementwise_add_grad", {"X": t0, "Y": b, "Out@GRAD": t1 + "@GRAD"},
                     {"X@GRAD": t0 + "@GRAD", "Y@GRAD": b + "@GRAD"},
                     {**_common(OpRole.Backward, i, (b, b + "@GRAD")), "axis": 1, "x_data_format": "",
                      "y_data_format": "", "Scale_out": 1.0})
        block.add_op("mul_grad", {"X": x, "Y": w, "Out@GRAD": t0 + "@GRAD"},
                     {"X@GRAD": x + "@GRAD", "Y@GRAD": w + "@GRAD"},
                     {**_common(OpRole.Backward, i, (w, w + "@GRAD")), "x_num_col_dims": 1, "y_num_col_dims": 1,
                      "scale_x": 1.0, "scale_y": [1.0]})
    for i in range(layers):  # optimize
        for param in (f"fc_{i}.w", f"fc_{i}.b"):
            block.add_op("sgd", {"Param": param, "Grad": param + "@GRAD", "LearningRate": "learning_rate"},
                              {"ParamOut": param}, {**_common(OpRole.Optimize, i, (param, param + "@GRAD")),
                                                    "multi_precision": False, "lazy_mode": False, "master": ""})
    return program


def best_time(fn: Callable[[], object], repeat: int, gc_off: bool = False) -> float:
    best = float("inf")
    for _ in range(repeat):
        gc.collect()
        if gc_off:
            gc.disable()
        try:
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
        finally:
            gc.enable()
    return best


def count_calls(fn: Callable[[], object]) -> int:
    """Python function calls one run makes: a clock-free measure of the work done."""
    profile = cProfile.Profile()
    profile.enable()
    fn()
    profile.disable()
    return pstats.Stats(profile).total_calls  # type: ignore[attr-defined]


def stages(num_ops: int) -> tuple[int, dict[str, Callable[[], object]]]:
    data = build_program(num_ops).to_bytes()
    program = Program.from_bytes(data)
    block = program.global_block()
    return program.num_ops(), {
        "load": lambda: Program.from_bytes(data),
        "verify": lambda: verify(program),
        "graph": lambda: BlockGraph(block),
        "dump": lambda: dump(program),
        "save": program.to_bytes,
    }


def measure(num_ops: int, repeat: int, gc_off: bool = False, calls: bool = False):
    """(ops, seconds per stage, Python calls per stage or None)."""
    ops, fns = stages(num_ops)
    times = {name: best_time(fn, repeat, gc_off) for name, fn in fns.items()}
    counts = {name: count_calls(fn) for name, fn in fns.items()} if calls else None
    return ops, times, counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000", help="comma-separated op counts")
    parser.add_argument("--repeat", type=int, default=3, help="best of N runs per stage")
    parser.add_argument(
        "--gc-off",
        action="store_true",
        help="disable the cyclic GC while timing (separates Python's full collections, which scan "
        "the whole heap, from the IR's own cost)",
    )
    parser.add_argument(
        "--calls",
        action="store_true",
        help="also count Python function calls per op (constant per op = linear, whatever the clock says)",
    )
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    rows = [measure(n, args.repeat, args.gc_off, args.calls) for n in sizes]

    head = f"{'ops':>8} " + " ".join(f"{s + ' ms':>10}" for s in STAGES) + "  " + " ".join(
        f"{s + ' µs/op':>13}" for s in STAGES
    )
    print(head)
    for ops, times, _counts in rows:
        print(
            f"{ops:>8} "
            + " ".join(f"{times[s] * 1e3:>10.1f}" for s in STAGES)
            + "  "
            + " ".join(f"{times[s] * 1e6 / ops:>13.2f}" for s in STAGES)
        )
    if len(rows) > 1:
        print("\ngrowth (time ratio / size ratio; 1.0 = linear)")
        print(f"{'sizes':>17} " + " ".join(f"{s:>8}" for s in STAGES))
        for (n0, t0, _c0), (n1, t1, _c1) in zip(rows, rows[1:], strict=False):
            ratio = n1 / n0
            print(f"{f'{n0}->{n1}':>17} " + " ".join(f"{t1[s] / t0[s] / ratio:>8.2f}" for s in STAGES))
    if args.calls:
        print("\nPython calls per op")
        print(f"{'ops':>8} " + " ".join(f"{s:>8}" for s in STAGES))
        for ops, _times, counts in rows:
            assert counts is not None
            print(f"{ops:>8} " + " ".join(f"{counts[s] / ops:>8.1f}" for s in STAGES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
