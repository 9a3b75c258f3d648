"""The seeds' 3-layer network: a 1000-wide input → fc 10 → fc 1, square error, SGD(0.1).

    python3 examples/seed_fc3.py OUT_DIR    # writes OUT_DIR/main.pb and OUT_DIR/startup.pb

Built with the Fluid-1.x builder, so the ops are Fluid's (`mean`, not Paddle 2.x's
`reduce_mean`); the var names match the `seed_fc3_sgd_3ps` fixture (`fc1.w`, ...).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    import transpiler  # noqa: F401
except ModuleNotFoundError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transpiler.frontend import ParamAttr, Program, data, layers, optimizer, program_guard, unique_name
from transpiler.frontend.io import report, save_programs


def build() -> tuple[Program, Program]:
    main, startup = Program(), Program()
    with unique_name.guard(), program_guard(main, startup):
        x = data(name="x", shape=[None, 1000], dtype="float32")
        y = data(name="y", shape=[None, 1], dtype="float32")
        hidden = layers.fc(input=x, size=10, param_attr=ParamAttr(name="fc1.w"), bias_attr=ParamAttr(name="fc1.b"))
        predict = layers.fc(input=hidden, size=1, param_attr=ParamAttr(name="fc2.w"), bias_attr=ParamAttr(name="fc2.b"))
        loss = layers.mean(layers.square_error_cost(input=predict, label=y))
        optimizer.SGD(learning_rate=0.1).minimize(loss)
    return main, startup


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="seed_fc3.py", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    report(save_programs(args.out_dir, *build()))
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
