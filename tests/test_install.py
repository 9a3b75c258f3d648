"""The install (pyproject.toml, Makefile): `pip install .` is the transpiler, the CLI and the
local runtime without Ray; `.[ray]` adds Ray; `make install` installs what the tests need."""

from __future__ import annotations

import re

import pytest
from conftest import TESTS

tomllib = pytest.importorskip("tomllib", reason="tomllib is in Python 3.11+")

REPO = TESTS.parent
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def requirement_name(spec: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]+", spec).group(0).lower().replace("_", "-")


def test_the_base_install_does_not_require_ray():
    names = {requirement_name(spec) for spec in PROJECT["dependencies"]}
    assert "ray" not in names
    # what the transpiler, the CLI and the local runtime import
    assert {"protobuf", "numpy", "networkx", "grpcio"} <= names


def test_the_ray_extra_adds_ray():
    assert [requirement_name(spec) for spec in PROJECT["optional-dependencies"]["ray"]] == ["ray"]


def test_make_install_installs_every_extra_the_tests_need():
    makefile = (REPO / "Makefile").read_text()
    extras = re.search(r"pip install .*-e '\.\[([a-z,]+)\]'", makefile).group(1).split(",")
    assert {"dev", "examples", "ray"} <= set(extras)
    assert set(extras) <= set(PROJECT["optional-dependencies"])


def test_the_product_imports_ray_only_in_the_ray_backend():
    """`import ray` appears only in transpiler/runtime/ray.py and ray_actor.py, inside
    functions (the backend imports it lazily), never at module level."""
    top_level, lazy = [], []
    for path in sorted([*(REPO / "transpiler").rglob("*.py"), *(REPO / "ops").rglob("*.py")]):
        for line in path.read_text().splitlines():
            if re.match(r"\s*(import ray\b|from ray\b)", line):
                (lazy if line.startswith(" ") else top_level).append(path.relative_to(REPO).as_posix())
    assert top_level == []
    assert set(lazy) <= {"transpiler/runtime/ray.py", "transpiler/runtime/ray_actor.py"}
