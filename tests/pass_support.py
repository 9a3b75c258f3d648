"""Helpers of the per-pass tests: a tiny program built with the frontend, and the
pipeline run up to (and including) one pass."""

from __future__ import annotations

from transpiler.config import make_options
from transpiler.frontend import ParamAttr, Program, data, layers, optimizer, program_guard, unique_name
from transpiler.ir import Program as IRProgram
from transpiler.ir.printer import dump
from transpiler.passes import PIPELINE, run_pipeline
from transpiler.passes.bundle import Bundle

EPS = "127.0.0.1:6174,127.0.0.1:6175"


def tiny(*, rows: int = 4, lr_decay: bool = False, embedding: str | None = None,
         table_optimizer: str | None = None) -> tuple[Program, Program]:
    """`x [-1, rows]` → fc 2 (`w`, `b`) → mean → SGD; `lr_decay` adds exponential decay;
    `embedding="sparse"|"distributed"` reads `x` through a 10-row embedding `emb` first;
    `table_optimizer="adam"|"momentum"|"decayed_adagrad"` trains the distributed `emb` with
    that optimizer (Fluid's sgd otherwise)."""
    main, startup = Program(), Program()
    with unique_name.guard(), program_guard(main, startup):
        if embedding is None:
            x = data(name="x", shape=[None, rows], dtype="float32")
        else:
            ids = data(name="ids", shape=[None, 1], dtype="int64")
            x = layers.embedding(ids, size=[10, rows], is_sparse=True, is_distributed=embedding == "distributed",
                                 param_attr=ParamAttr(name="emb"))
        out = layers.fc(input=x, size=2, param_attr=ParamAttr(name="w"), bias_attr=ParamAttr(name="b"))
        loss = layers.mean(out)
        lr = layers.exponential_decay(0.1, decay_steps=10, decay_rate=0.5) if lr_decay else 0.1
        sgd = optimizer.SGD(learning_rate=lr)
        if table_optimizer is not None:
            sgd.distributed_table_optimizer = {
                "adam": lambda: optimizer.Adam(learning_rate=0.01),
                "momentum": lambda: optimizer.Momentum(learning_rate=0.01, momentum=0.9),
                "decayed_adagrad": lambda: optimizer.DecayedAdagrad(learning_rate=0.01),
            }[table_optimizer]()
        sgd.minimize(loss)
    return main, startup


def run_until(name: str, main: IRProgram, startup: IRProgram, **options) -> Bundle:
    """The bundle after pass `name`, the pipeline run from the start."""
    options.setdefault("pservers", EPS)
    options.setdefault("trainers", 2)
    options.setdefault("trainer_id", 0)
    for key in ("sync_mode", "slice_var_up", "split_method", "min_block_size"):
        options.setdefault(key, None)
    names = [step.name for step in PIPELINE]
    bundle = Bundle(origin=main.clone(), origin_startup=startup.clone())
    return run_pipeline(bundle, make_options(None, **options), passes=PIPELINE[: names.index(name) + 1])


def ops(program: IRProgram, block: int = 0) -> str:
    """The op lines of one block of the text dump, without their attrs: what a test reads."""
    header, out, inside = f"block {block} ", [], False
    for line in dump(program).splitlines():
        if line.startswith("block "):
            inside = line.startswith(header)
        elif inside and line.startswith("  op "):
            out.append(line[2:].split(" {")[0] + "\n")
    return "".join(out)
