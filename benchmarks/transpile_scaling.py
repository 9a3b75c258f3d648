"""How transpile time grows with program size.

Builds deep Adam MLPs the way Fluid lays them out (per layer: mul, elementwise_add,
relu; their grads; one adam per param with moments and beta powers initialised in the
startup program), transpiles them for 4 pservers and 2 trainers, and prints the time of
transpile + every pserver program + the trainer program, per op, and the growth factor
between sizes. Paddle 1.8's transpiler on this machine (from the issue): 93 ops 0.22 s,
253 ops 1.2 s, 813 ops 10.4 s, 2,413 ops 173 s.

    python benchmarks/transpile_scaling.py [--ops 93 253 813 2413 10000 100000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transpiler.api import transpile  # noqa: E402
from transpiler.ir import AttrType, DType, OpRole, Program  # noqa: E402
from transpiler.ir.attrs import Attr  # noqa: E402

PADDLE_SECONDS = {93: 0.22, 253: 1.2, 813: 10.4, 2413: 173.0}


def _role(op, role: OpRole, role_vars=()):
    op.set_attr("op_role", Attr.of(int(role), AttrType.INT))
    op.set_attr("op_role_var", Attr.of(tuple(role_vars), AttrType.STRINGS))


def build_mlp(layers: int, width: int = 64) -> tuple[Program, Program]:
    """A `layers`-deep Adam MLP; main has 8 ops per layer plus 4."""
    main, startup = Program.empty(), Program.empty()
    block, init = main.global_block(), startup.global_block()

    def var(name, shape, *, persistable=False, program_block=block):
        return program_block.create_var(name, dtype=DType.FP32, shape=shape, persistable=persistable)

    var("x", (-1, width))
    for b in (block, init):
        b.create_var("learning_rate_0", dtype=DType.FP32, shape=(1,), persistable=True)
    fill = init.add_op("fill_constant", outputs={"Out": ["learning_rate_0"]}, attrs={"value": 0.01, "shape": [1]})
    _role(fill, OpRole.Forward)
    params = []
    current = "x"
    for i in range(layers):
        w, b_, mul_out, add_out, act = f"fc_{i}.w_0", f"fc_{i}.b_0", f"fc_{i}.tmp_0", f"fc_{i}.tmp_1", f"fc_{i}.tmp_2"
        for name, shape in ((w, (width, width)), (b_, (width,))):
            var(name, shape, persistable=True)
            var(name, shape, persistable=True, program_block=init)
            op = init.add_op("uniform_random" if name == w else "fill_constant", outputs={"Out": [name]},
                             attrs={"shape": list(shape), "seed": 0})
            _role(op, OpRole.Forward)
            params.append((name, shape))
        for name in (mul_out, add_out, act):
            var(name, (-1, width))
        _role(block.add_op("mul", {"X": [current], "Y": [w]}, {"Out": [mul_out]}, {"x_num_col_dims": 1}), OpRole.Forward)
        _role(block.add_op("elementwise_add", {"X": [mul_out], "Y": [b_]}, {"Out": [add_out]}, {"axis": 1}),
              OpRole.Forward)
        _role(block.add_op("relu", {"X": [add_out]}, {"Out": [act]}), OpRole.Forward)
        current = act
    var("loss", (1,))
    _role(block.add_op("mean", {"X": [current]}, {"Out": ["loss"]}), OpRole.Forward | OpRole.Loss)
    var("loss@GRAD", (1,))
    _role(block.add_op("fill_constant", outputs={"Out": ["loss@GRAD"]}, attrs={"value": 1.0, "shape": [1]}),
          OpRole.Backward | OpRole.Loss)
    var(current + "@GRAD", (-1, width))
    _role(block.add_op("mean_grad", {"X": [current], "Out@GRAD": ["loss@GRAD"]}, {"X@GRAD": [current + "@GRAD"]}),
          OpRole.Backward)
    for i in reversed(range(layers)):
        w, b_ = f"fc_{i}.w_0", f"fc_{i}.b_0"
        x = "x" if i == 0 else f"fc_{i - 1}.tmp_2"
        names = {n: n + "@GRAD" for n in (f"fc_{i}.tmp_0", f"fc_{i}.tmp_1", w, b_, x)}
        for grad, shape in ((names[f"fc_{i}.tmp_0"], (-1, width)), (names[f"fc_{i}.tmp_1"], (-1, width)),
                            (names[w], (width, width)), (names[b_], (width,))):
            var(grad, shape)
        if i:
            var(names[x], (-1, width))
        _role(block.add_op("relu_grad", {"Out": [f"fc_{i}.tmp_2"], "Out@GRAD": [f"fc_{i}.tmp_2@GRAD"]},
                           {"X@GRAD": [names[f"fc_{i}.tmp_1"]]}), OpRole.Backward)
        _role(block.add_op("elementwise_add_grad", {"X": [f"fc_{i}.tmp_0"], "Y": [b_], "Out@GRAD": [names[f"fc_{i}.tmp_1"]]},
                           {"X@GRAD": [names[f"fc_{i}.tmp_0"]], "Y@GRAD": [names[b_]]}, {"axis": 1}),
              OpRole.Backward, (b_, names[b_]))
        _role(block.add_op("mul_grad", {"X": [x], "Y": [w], "Out@GRAD": [names[f"fc_{i}.tmp_0"]]},
                           {"X@GRAD": [names[x]] if i else [], "Y@GRAD": [names[w]]}), OpRole.Backward, (w, names[w]))
    for name, shape in params:
        slots = {}
        for acc, acc_shape in (("moment1", shape), ("moment2", shape), ("beta1_pow_acc", (1,)), ("beta2_pow_acc", (1,))):
            acc_name = f"{name}_{acc}_0"
            var(acc_name, acc_shape, persistable=True)
            var(acc_name, acc_shape, persistable=True, program_block=init)
            _role(init.add_op("fill_constant", outputs={"Out": [acc_name]}, attrs={"shape": list(acc_shape)}),
                  OpRole.Forward)
            slots[acc] = acc_name
        op = block.add_op(
            "adam",
            {"Param": [name], "Grad": [name + "@GRAD"], "LearningRate": ["learning_rate_0"],
             "Moment1": [slots["moment1"]], "Moment2": [slots["moment2"]], "Beta1Pow": [slots["beta1_pow_acc"]],
             "Beta2Pow": [slots["beta2_pow_acc"]]},
            {"ParamOut": [name], "Moment1Out": [slots["moment1"]], "Moment2Out": [slots["moment2"]],
             "Beta1PowOut": [slots["beta1_pow_acc"]], "Beta2PowOut": [slots["beta2_pow_acc"]]},
            {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8},
        )
        _role(op, OpRole.Optimize, (name, name + "@GRAD"))
    return main, startup


def layers_for(ops: int) -> int:
    return max(1, round((ops - 3) / 8))


def measure(ops: int, repeat: int) -> tuple[int, float]:
    main, startup = build_mlp(layers_for(ops))
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        transpile(main, startup, pservers="127.0.0.1:6170,127.0.0.1:6171,127.0.0.1:6172,127.0.0.1:6173", trainers=2)
        best = min(best, time.perf_counter() - start)
    return main.num_ops(), best


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, nargs="+", default=[93, 253, 813, 2413, 10_000, 100_000])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"{'ops':>8} {'seconds':>9} {'us/op':>8} {'growth':>8} {'Paddle 1.8 (s)':>15}")
    previous = None
    for target in args.ops:
        ops, seconds = measure(target, args.repeat if target <= 10_000 else 1)
        growth = "" if previous is None else f"{(seconds / previous[1]) / (ops / previous[0]):8.2f}"
        paddle = PADDLE_SECONDS.get(target)
        print(f"{ops:>8} {seconds:>9.3f} {seconds / ops * 1e6:>8.1f} {growth:>8} {'' if paddle is None else paddle:>15}",
              flush=True)
        previous = (ops, seconds)
    print("growth = (time ratio) / (size ratio) against the previous row; 1.0 is linear")


if __name__ == "__main__":
    main()
