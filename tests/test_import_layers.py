"""Imports go down the layers, never up: a module may import its own layer and the
layers below it. Every import counts, top-level, in a function or under TYPE_CHECKING.

Lowest first. Where the leftovers sit:
- the package roots `transpiler` (`__version__`) and `ops` (a docstring) import nothing;
  `proto` is generated protobuf code: with `transpiler.errors` they are the floor;
- `transpiler.naming` and `transpiler.fileio` are leaves above `transpiler.errors`;
- `transpiler.ir.precision` (float64 copies of a program) is part of `transpiler.ir`;
- `ops.testing` (`run_op`: one op through the executor) sits with `ops.executor`.

Beside the layers, some modules may be imported only by a few others: the generated
protobuf modules only by the IR's serde and the RPC layer, and the executor and the RPC
layer, above their own layers, only by the runtime (and the CLI): the runtime is the one
layer that imports both the transpiler API and the programs' execution.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("transpiler", "ops", "proto")

LAYERS: tuple[tuple[str, ...], ...] = (
    ("proto", "transpiler.errors"),  # and the package roots themselves (ROOTS)
    ("transpiler.naming",),
    ("transpiler.fileio",),
    ("transpiler.ir",),
    ("ops.catalogue",),
    ("ops.tensor", "ops.scope", "ops.heap"),
    ("ops.kernels",),
    ("ops.executor", "ops.testing"),
    ("transpiler.plan",),
    ("transpiler.dispatch",),
    ("transpiler.partition", "transpiler.planner", "transpiler.cost", "transpiler.cost_report"),  # a partitioner may be the cost planner
    ("transpiler.config",),
    ("ops.rpc", "transpiler.passes", "transpiler.frontend"),
    ("transpiler.output",),
    ("transpiler.api",),
    ("transpiler.runtime",),
    ("transpiler.fluid", "transpiler.fleet", "transpiler.remote"),  # user APIs over the runtime
    ("transpiler.cli", "transpiler.__main__", "transpiler.calibrate", "transpiler.replay"),  # calibrate runs a real pserver
)

# module -> the only modules (outside its own layer) that may import it
ONLY_IMPORTED_BY: dict[str, tuple[str, ...]] = {
    "proto": ("transpiler.ir.serde", "ops.rpc"),
    "ops.executor": ("ops.testing", "ops.rpc", "transpiler.runtime", "transpiler.fluid", "transpiler.fleet", "transpiler.remote", "transpiler.cli", "transpiler.calibrate"),
    "ops.rpc": ("transpiler.runtime", "transpiler.fluid", "transpiler.fleet", "transpiler.remote", "transpiler.cli",
                "transpiler.calibrate"),
}

ROOTS = ("transpiler", "ops")  # the `__init__` of each: the floor, but not a prefix for its modules
LAYER_OF: dict[str, int] = {name: index for index, names in enumerate(LAYERS) for name in names}


def _owner(module: str, names: dict[str, int] | tuple[str, ...]) -> str | None:
    """The longest entry of `names` that is `module` or a package holding it."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in names:
            return prefix
    return None


def layer_of(module: str) -> int:
    if module in ROOTS:
        return 0
    owner = _owner(module, LAYER_OF)
    if owner is None:
        raise LookupError(f"{module} is in no layer: add it to LAYERS in {Path(__file__).name}")
    return LAYER_OF[owner]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = REPO.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported_modules(module: str, source: str, *, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, module) for every import of a project module in `source`, anywhere in it."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.append((node.lineno, target if _is_module(target) else base))
    return [(line, name) for line, name in found if name.split(".")[0] in PACKAGES]


def layer_violations(module: str, source: str, *, is_package: bool = False) -> list[str]:
    """What in `source` (the text of `module`) imports upwards or past an import fence."""
    problems = []
    own = layer_of(module)
    for line, target in imported_modules(module, source, is_package=is_package):
        where = f"{module}:{line} imports {target}"
        try:
            if layer_of(target) > own:
                problems.append(f"{where}, a higher layer")
        except LookupError as exc:
            problems.append(f"{where}: {exc}")
            continue
        fenced = _owner(target, tuple(ONLY_IMPORTED_BY))
        if fenced and layer_of(target) != own and not _owner(module, ONLY_IMPORTED_BY[fenced]):
            problems.append(f"{where}, which only {', '.join(ONLY_IMPORTED_BY[fenced])} may import")
    return problems


def project_modules() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (REPO / package).rglob("*.py"))


def test_every_module_sits_in_a_layer():
    unplaced = []
    for path in project_modules():
        try:
            layer_of(module_name(path))
        except LookupError as exc:
            unplaced.append(str(exc))
    assert not unplaced


@pytest.mark.parametrize("path", project_modules(), ids=lambda p: str(p.relative_to(REPO)))
def test_imports_only_go_down(path):
    module = module_name(path)
    assert layer_violations(module, path.read_text(), is_package=path.name == "__init__.py") == []


# ------------------------------------------------------------ the checker itself


@pytest.mark.parametrize(
    "source",
    [
        "from transpiler.api import transpile\n",
        "import transpiler.runtime.session\n",
        "def f():\n    from transpiler.passes import run_pipeline\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from transpiler.output import write_programs\n",
        "from .. import plan\n",
    ],
)
def test_an_upward_import_is_caught(source):
    (problem,) = layer_violations("transpiler.ir.fake", source)
    assert problem.startswith("transpiler.ir.fake:") and "a higher layer" in problem


def test_a_downward_or_same_layer_import_passes():
    source = "from transpiler.errors import IRError\nfrom transpiler.ir.types import DType\nfrom . import attrs\n"
    assert layer_violations("transpiler.ir.fake", source) == []


def test_the_api_may_not_reach_the_executor_or_rpc():
    problems = layer_violations("transpiler.api", "import ops.rpc.client\nfrom ops.executor import Executor\n")
    assert len(problems) == 2 and all("may import" in p for p in problems)
    assert layer_violations("transpiler.runtime.fake", "from ops.executor import Executor\nimport ops.rpc\n") == []


def test_a_module_outside_every_layer_is_reported():
    (problem,) = layer_violations("transpiler.api", "import transpiler.nowhere_yet\n")
    assert "is in no layer" in problem
