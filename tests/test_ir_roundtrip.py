"""Load -> save of every Paddle-built program is byte-identical, and clone() too."""

from __future__ import annotations

import pytest

from conftest import PADDLE_PB_FILES
from transpiler.ir import Program


@pytest.mark.parametrize("path", PADDLE_PB_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_load_save_is_byte_identical(path, tmp_path):
    data = path.read_bytes()
    program = Program.from_bytes(data)
    assert program.to_bytes() == data
    out = tmp_path / "copy.pb"
    program.save(out)
    assert out.read_bytes() == data
    assert Program.load(out).to_bytes() == data


@pytest.mark.parametrize("path", PADDLE_PB_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_clone_is_deep_and_identical(path):
    program = Program.load(path)
    copy = program.clone()
    assert copy.to_bytes() == program.to_bytes()
    block = copy.global_block()
    block.remove_op(block.ops[0])
    next(iter(block.vars.values())).shape = (7,)
    assert program.to_bytes() == path.read_bytes()
