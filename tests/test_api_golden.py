"""Golden dumps of the transpiled examples: every (example, sync/async, slice/no slice,
RoundRobin/HashName, 1/2/4 pservers) combination, one file each under
tests/golden/transpile/, holding the plan report and every program's dump.

`make golden` rewrites them; review that diff like code. The CTR example appears three
times: with its distributed table, with a sparse table prefetched from its blocks, and
with a dense table.
"""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

import pytest

from transpiler.api import transpile
from transpiler.ir.printer import dump
from transpiler.plan import format_plan

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = {
    "seed_fc3": lambda module: module.build(),
    "mlp": lambda module: module.build(),
    "ctr": lambda module: module.build(),  # a distributed table (is_sparse, is_distributed)
    "ctr_local": lambda module: module.build(is_sparse=True, is_distributed=False),  # prefetched from its blocks
    "ctr_dense": lambda module: module.build(is_sparse=False, is_distributed=False),
}
MODULE = {"seed_fc3": "seed_fc3", "mlp": "mlp", "ctr": "ctr", "ctr_local": "ctr", "ctr_dense": "ctr"}
COMBINATIONS = list(
    itertools.product(EXAMPLES, ("sync", "async"), ("slice", "noslice"), ("round_robin", "hash_name"), (1, 2, 4))
)


def build(example: str):
    spec = importlib.util.spec_from_file_location(f"golden_{example}", ROOT / "examples" / f"{MODULE[example]}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return EXAMPLES[example](module)


def render(result) -> str:
    parts = ["# plan", format_plan(result.plan), "# trainer", dump(result.trainer), "# trainer_startup",
             dump(result.trainer_startup)]
    for endpoint, (main, startup) in result.pservers.items():
        parts += [f"# pserver {endpoint}", dump(main), f"# pserver {endpoint} startup", dump(startup)]
    return "\n".join(parts)


@pytest.fixture(scope="module")
def programs():
    return {name: build(name) for name in EXAMPLES}


@pytest.mark.parametrize(("example", "mode", "slicing", "method", "n"), COMBINATIONS,
                         ids=["-".join(map(str, c)) for c in COMBINATIONS])
def test_transpiled_example(programs, golden, example, mode, slicing, method, n):
    main, startup = programs[example]
    result = transpile(
        main,
        startup,
        pservers=",".join(f"127.0.0.1:{6170 + i}" for i in range(n)),
        trainers=2,
        sync_mode=mode == "sync",
        slice_var_up=slicing == "slice",
        split_method=method,
        verify=True,
    )
    golden.check(f"transpile/{example}-{mode}-{slicing}-{method}-{n}ps.txt", render(result))
