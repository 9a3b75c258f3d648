"""The examples: their dumps are golden files, their CLIs write main.pb / startup.pb, and
their networks are the fixtures' (Fluid 1.x op names where Paddle 2.6 renamed them)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PADDLE_PROGRAMS
from ops.catalogue.naming import FLUID18_OP
from transpiler.ir import Program
from transpiler.ir.printer import dump
from transpiler.ir.verifier import verify

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ("seed_fc3", "mlp", "ctr")


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_dump_is_golden(name, golden):
    main, startup = load_example(name).build()
    verify(main)
    verify(startup)
    golden.check(f"examples/{name}_main.txt", dump(main))
    golden.check(f"examples/{name}_startup.txt", dump(startup))


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_cli_writes_and_reports(name, tmp_path, capsys):
    module = load_example(name)
    assert module.cli([str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in printed] == [str(tmp_path / "out" / "main.pb"), str(tmp_path / "out" / "startup.pb")]
    main, startup = module.build()
    assert (tmp_path / "out" / "main.pb").read_bytes() == main.to_bytes()
    assert (tmp_path / "out" / "startup.pb").read_bytes() == startup.to_bytes()
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.endswith(".tmp")]


def test_example_runs_as_a_script(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "seed_fc3.py"), str(tmp_path)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "main.pb" in result.stdout and "startup.pb" in result.stdout
    assert Program.load(tmp_path / "main.pb").global_block().has_var("fc1.w")
    bad = subprocess.run([sys.executable, str(ROOT / "examples" / "seed_fc3.py")], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "usage" in bad.stderr


@pytest.mark.parametrize("name, case", [("seed_fc3", "seed_fc3_sgd_3ps"), ("mlp", "mlp_adam_2ps")])
def test_example_is_the_fixture_network(name, case):
    """Same op sequence (Fluid names) and the same vars with the same dtypes; Fluid 1.8's
    scalars are `[1]` where Paddle 2.6's are `[]`."""
    main, startup = load_example(name).build()
    fixture = Program.load(PADDLE_PROGRAMS / case / "main.pb")
    assert [op.type for op in main.global_block().ops] == [FLUID18_OP.get(op.type, op.type) for op in fixture.global_block().ops]
    ours, theirs = main.global_block().vars, fixture.global_block().vars
    assert list(sorted(ours)) == list(sorted(theirs))
    for var_name, var in theirs.items():
        shape = var.shape if var.shape != () else (1,)
        assert (ours[var_name].dtype, ours[var_name].shape, ours[var_name].persistable) == (var.dtype, shape, var.persistable)
    assert sorted(startup.global_block().vars) == sorted(Program.load(PADDLE_PROGRAMS / case / "startup.pb").global_block().vars)


def test_ctr_example_is_the_fluid18_ctr_network_with_adagrad():
    main, startup = load_example("ctr").build()
    fixture = Program.load(PADDLE_PROGRAMS / "fluid18_ctr_dist_sgd_2ps" / "main.pb")
    ours = [op.type for op in main.global_block().ops]
    theirs = [op.type for op in fixture.global_block().ops]
    assert ours[: theirs.index("sgd")] == theirs[: theirs.index("sgd")]
    assert ours[theirs.index("sgd"):] == ["sgd"] + ["adagrad"] * 4  # the distributed table keeps sgd
    lookups = [op for op in main.global_block().ops if op.type == "lookup_table"]
    assert len(lookups) == 3 and {op.input("W") for op in lookups} == {("emb",)}
    assert all(op.attr("is_sparse") and op.attr("is_distributed") for op in lookups)
    local, _ = load_example("ctr").build(is_distributed=False)
    assert [op.type for op in local.global_block().ops][-5:] == ["adagrad"] * 5
    assert "emb_moment_0" not in startup.global_block().vars and "emb_moment_0" in local.global_block().vars
