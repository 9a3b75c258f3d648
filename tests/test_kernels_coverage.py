"""Every op the runtime may be asked to run has a kernel: each op type of the catalogue,
and each op type of Paddle's own programs — the fixtures' `main.pb` / `startup.pb` (every
block) and the programs Paddle's transpiler made of them (kept in `expected.json`) — in
tests/fixtures/paddle_programs/ and in ../shared/paddle_programs/ when it is there.

A missing kernel is otherwise found only when a program using the op runs
(`UnknownOpError`), which for a pserver-side optimizer is deep inside an RPC test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import PADDLE_PROGRAMS, REAL_MODEL_CASES, TESTS

import ops.kernels  # noqa: F401  (registers the numpy kernels)
import ops.rpc  # noqa: F401  (registers send, recv, listen_and_serv, prefetch, save, ...)
import ops.rpc.kernels  # noqa: F401
from ops.catalogue.registry import CATALOGUE
from ops.kernels import has_kernel
from transpiler.ir import Program

# Catalogue op types without a kernel on purpose, each with the reason. Keep it empty
# unless an op truly cannot run in this runtime.
NO_KERNEL: dict[str, str] = {}

SHARED_PROGRAMS = TESTS.parent.parent / "shared" / "paddle_programs"
PROGRAM_DIRS = {"fixtures": PADDLE_PROGRAMS, "shared": SHARED_PROGRAMS}


def _files(pattern: str) -> list[tuple[str, Path]]:
    """(test id, path) of each file matching `pattern` in each program folder that exists,
    but the real models' (their ops without a kernel: test_paddle_real_models.py)."""
    return [
        (f"{label}/{path.parent.name}/{path.name}", path)
        for label, folder in PROGRAM_DIRS.items()
        if folder.is_dir()
        for path in sorted(folder.glob(pattern))
        if path.parent.name not in REAL_MODEL_CASES
    ]


PB_FILES = _files("*/*.pb")
EXPECTED_FILES = _files("*/expected.json")


def test_every_catalogue_op_has_a_kernel():
    missing = sorted(t for t in CATALOGUE if not has_kernel(t) and t not in NO_KERNEL)
    assert not missing, f"catalogue ops without a kernel: {missing}"


def test_the_no_kernel_list_is_not_stale():
    stale = sorted(t for t in NO_KERNEL if t not in CATALOGUE or has_kernel(t))
    assert not stale, f"NO_KERNEL lists ops that are not in the catalogue or now have a kernel: {stale}"


def test_the_fixture_programs_are_found():
    assert len(PB_FILES) >= 2 * (len(list(PADDLE_PROGRAMS.glob("*/case.json"))) - len(REAL_MODEL_CASES)) > 0
    assert EXPECTED_FILES


@pytest.mark.parametrize("path", [p for _, p in PB_FILES], ids=[i for i, _ in PB_FILES])
def test_every_op_of_a_paddle_program_has_a_kernel(path):
    program = Program.load(path)
    missing = sorted({(block.idx, op.type) for block in program.blocks for op in block.ops if not has_kernel(op.type)})
    assert not missing, f"{path}: (block, op type) without a kernel: {missing}"


def _expected_programs(expected: dict) -> dict[str, list[dict]]:
    if "paddle_transpiler_error" in expected:  # Paddle's transpiler failed on it (lstm_sgd_2ps): no programs
        return {}
    programs = {"trainer": expected["trainer"], "trainer_startup": expected["trainer_startup"]}
    for endpoint, pair in expected["pservers"].items():
        programs[f"{endpoint} main"] = pair["main"]
        programs[f"{endpoint} startup"] = pair["startup"]
    return programs


@pytest.mark.parametrize("path", [p for _, p in EXPECTED_FILES], ids=[i for i, _ in EXPECTED_FILES])
def test_every_op_paddle_transpiled_has_a_kernel(path):
    expected = json.loads(path.read_text())
    programs = _expected_programs(expected)
    assert programs or "paddle_transpiler_error" in expected
    missing = sorted(
        {
            (name, idx, op["type"])
            for name, blocks in programs.items()
            for idx, block in enumerate(blocks)
            for op in block["ops"]
            if not has_kernel(op["type"])
        }
    )
    assert not missing, f"{path}: (program, block, op type) without a kernel: {missing}"
