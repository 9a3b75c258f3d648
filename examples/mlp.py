"""An MLP classifier: 784 → fc 256 relu → fc 128 relu → fc 10, softmax cross-entropy, Adam(0.001).

    python3 examples/mlp.py OUT_DIR    # writes OUT_DIR/main.pb and OUT_DIR/startup.pb

The network of the `mlp_adam_2ps` fixture (params `h1.*`, `h2.*`, `out.*`), built with
Fluid 1.x ops: `mean` for the loss, and an `adam` op that updates its own beta powers
(`*_beta1_pow_acc_0`, `*_beta2_pow_acc_0`), as Fluid 1.7+ builds it.
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
        img = data(name="img", shape=[None, 784], dtype="float32")
        label = data(name="label", shape=[None, 1], dtype="int64")
        h1 = layers.fc(input=img, size=256, act="relu", param_attr=ParamAttr(name="h1.w"), bias_attr=ParamAttr(name="h1.b"))
        h2 = layers.fc(input=h1, size=128, act="relu", param_attr=ParamAttr(name="h2.w"), bias_attr=ParamAttr(name="h2.b"))
        logits = layers.fc(input=h2, size=10, param_attr=ParamAttr(name="out.w"), bias_attr=ParamAttr(name="out.b"))
        loss = layers.mean(layers.softmax_with_cross_entropy(logits=logits, label=label))
        optimizer.Adam(learning_rate=0.001).minimize(loss)
    return main, startup


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="mlp.py", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    report(save_programs(args.out_dir, *build()))
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
