"""The CLI's rough edges (issue 24): MAIN read first and named, a folder as MAIN,
`--pservers` count vs list, `-q`, `--full` and the ~200-character line limit, `--json` on
transpile/diff/launch/fetch, `--all-trainers`, `--format`, shell completion."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import PADDLE_PROGRAMS, TESTS
from transpiler import cli
from transpiler.api import transpile
from transpiler.cli import MAX_WIDTH, main
from transpiler.ir import Program
from transpiler.ir.printer import dump

MLP = PADDLE_PROGRAMS / "mlp_adam_2ps"
BERT = PADDLE_PROGRAMS / "bert_adam_2ps_noslice_sync"  # repeats attrs; 2293 vars, ops with 15 slots
EPS = "127.0.0.1:6170,127.0.0.1:6171"
ERROR = "pstranspile: error: "


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_error(code, out, err):
    assert code == 2 and out == "", (code, out, err)
    (line,) = err.splitlines()
    assert line.startswith(ERROR)
    return line


# ------------------------------------------------------------------ MAIN


def test_a_missing_main_is_named_before_its_startup(capsys, tmp_path):
    line = one_error(*run(capsys, "transpile", tmp_path / "typo.pb", "--pservers", EPS, "--trainers", "2",
                          "-o", tmp_path / "o"))
    assert line == f"{ERROR}MAIN {tmp_path / 'typo.pb'}: no such file or folder"
    line = one_error(*run(capsys, "plan", tmp_path / "typo.pb", "--pservers", EPS, "--trainers", "2"))
    assert "MAIN" in line and "typo.pb" in line and "startup" not in line


def test_a_missing_startup_is_named_after_main_loads(capsys, tmp_path):
    shutil.copy(MLP / "main.pb", tmp_path / "main.pb")
    line = one_error(*run(capsys, "plan", tmp_path / "main.pb", "--pservers", EPS, "--trainers", "2"))
    assert f"no --startup given and no {tmp_path / 'startup.pb'}" in line
    line = one_error(*run(capsys, "plan", tmp_path / "main.pb", "--startup", tmp_path / "nope.pb", "--pservers", EPS,
                          "--trainers", "2"))
    assert "nope.pb" in line and "No such file" in line


@pytest.mark.parametrize("layout", ["pb", "pdmodel", "fluid18"])
def test_a_folder_is_accepted_as_main(capsys, tmp_path, layout):
    folder = tmp_path / "model"
    names = {"pb": ("main.pb", "startup.pb"), "pdmodel": ("main.pdmodel", "startup.pdmodel"),
             "fluid18": ("main/__model__", "startup/__model__")}[layout]
    for source, name in zip(("main.pb", "startup.pb"), names, strict=True):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(MLP / source, folder / name)
    code, out, err = run(capsys, "plan", folder, "--pservers", EPS, "--trainers", "2", "--json")
    assert code == 0, err
    expected = transpile(Program.load(MLP / "main.pb"), Program.load(MLP / "startup.pb"), pservers=EPS, trainers=2)
    printed = json.loads(out)
    assert printed.pop("cost")["pservers"]  # `plan --json` is plan.json and the cost report (docs/planner.md)
    assert printed == expected.plan.to_json()


def test_a_folder_without_programs_says_what_it_looked_for(capsys, tmp_path):
    line = one_error(*run(capsys, "plan", tmp_path, "--pservers", EPS, "--trainers", "2"))
    assert "holding none of main.pb, main.pdmodel, main/__model__, __model__" in line


def test_a_pdmodel_main_finds_its_startup_pdmodel(capsys, tmp_path):
    shutil.copy(MLP / "main.pb", tmp_path / "main.pdmodel")
    shutil.copy(MLP / "startup.pb", tmp_path / "startup.pdmodel")
    code, _, err = run(capsys, "plan", tmp_path / "main.pdmodel", "--pservers", EPS, "--trainers", "2")
    assert code == 0, err


# ------------------------------------------------------------------ --pservers


@pytest.mark.parametrize("command", ["transpile", "plan"])
def test_a_count_where_endpoints_are_meant_says_did_you_mean(capsys, tmp_path, command):
    extra = ["-o", tmp_path / "o"] if command == "transpile" else []
    line = one_error(*run(capsys, command, MLP / "main.pb", "--pservers", "2", "--trainers", "2", *extra))
    assert "did you mean --pservers 127.0.0.1:6170,127.0.0.1:6171?" in line and "launch --pservers 2" in line
    assert not (tmp_path / "o").exists()


def test_launch_takes_a_count_and_says_did_you_mean_for_endpoints(capsys):
    line = one_error(*run(capsys, "launch", "--pservers", EPS, "--trainers", "2", "--", "true"))
    assert line.endswith(f"did you mean --pservers 2 --endpoints {EPS}?")
    line = one_error(*run(capsys, "launch", "--pservers", "two", "--trainers", "2", "--", "true"))
    assert "--pservers must be a count" in line


# ------------------------------------------------------------------ -q, width, --full


def test_quiet_silences_the_repeated_attrs_warning_not_errors(capsys, tmp_path):
    code, _, err = run(capsys, "plan", BERT / "main.pb", "--pservers", EPS, "--trainers", "2")
    assert code == 0 and "repeat attrs" in err
    assert all(len(line) <= MAX_WIDTH for line in err.splitlines())
    code, out, err = run(capsys, "plan", BERT / "main.pb", "--pservers", EPS, "--trainers", "2", "-q")
    assert code == 0 and err == "" and out
    code, _, err = run(capsys, "transpile", MLP / "main.pb", "--pservers", EPS, "--trainers", "2", "-o",
                       tmp_path / "o", "--progress", "--quiet")
    assert code == 0 and err == ""
    one_error(*run(capsys, "dump", tmp_path / "missing.pb", "-q"))  # errors still show


@pytest.fixture(scope="module")
def bert_trainer(tmp_path_factory):
    out = tmp_path_factory.mktemp("bert")
    assert main(["transpile", str(BERT / "main.pb"), "--pservers", EPS, "--trainers", "2", "-o", str(out), "-q"]) == 0
    return out / "trainer.pb"


def test_diff_summary_on_bert_fits_the_width_and_says_how_many_more(capsys, bert_trainer):
    code, out, _ = run(capsys, "diff", "--summary-only", BERT / "main.pb", bert_trainer, "-q")
    assert code == 1
    lines = out.splitlines()
    assert max(map(len, lines)) <= MAX_WIDTH
    (removed,) = [line for line in lines if line.startswith("  vars removed: ")]
    shown = removed.split(": ", 1)[1].split(", ... and ")[0].split(", ")
    more = int(removed.split(", ... and ")[1].split(" more")[0])
    code, full, _ = run(capsys, "diff", "--summary-only", BERT / "main.pb", bert_trainer, "-q", "--full")
    (whole,) = [line for line in full.splitlines() if line.startswith("  vars removed: ")]
    everything = whole.split(": ", 1)[1].split(", ")
    assert everything[:len(shown)] == shown and len(everything) == len(shown) + more and len(whole) > 10_000


def test_dump_on_bert_wraps_long_op_lines_and_keeps_every_slot(capsys):
    code, out, _ = run(capsys, "dump", BERT / "main.pb", "-q")
    assert code == 0 and max(map(len, out.splitlines())) <= MAX_WIDTH
    code, full, _ = run(capsys, "dump", BERT / "main.pb", "-q", "--full")
    assert full == dump(Program.load(BERT / "main.pb")) and max(map(len, full.splitlines())) > 800
    # Wrapping only breaks lines: joined back, every op line is the whole one.
    joined, current = [], None
    for line in out.splitlines():
        if line.startswith("      ") and current is not None:
            current += " " + line.strip()
            continue
        if current is not None:
            joined.append(current)
        current = line
    joined.append(current)
    assert joined == full.splitlines()


def test_a_list_too_long_for_any_line_says_and_n_more(capsys, tmp_path):
    from transpiler.cli import wrap_line

    line = "  op 3 send X=[" + ", ".join(f"var_{i}" for i in range(400)) + "] -> Out=[] {op_role=rpc}"
    pieces = wrap_line(line)
    assert max(map(len, pieces)) <= MAX_WIDTH
    assert any("... and" in piece and "more]" in piece for piece in pieces) and pieces[-1].endswith("{op_role=rpc}")


def test_diff_line_diff_keeps_its_markers_when_wrapped(capsys, bert_trainer):
    code, out, _ = run(capsys, "diff", BERT / "main.pb", bert_trainer, "-q")
    assert code == 1 and max(map(len, out.splitlines())) <= MAX_WIDTH
    body = out.split("\n\n", 1)[1].splitlines()
    assert all(line[:1] in " -+@" for line in body)


# ------------------------------------------------------------------ --json


def test_transpile_json(capsys, tmp_path):
    code, out, err = run(capsys, "transpile", MLP / "main.pb", "--pservers", EPS, "--trainers", "2", "-o",
                         tmp_path / "o", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert set(doc) == {"schema", "output", "format", "files", "trainers", "trainer_ids", "pservers", "params",
                        "blocks", "imbalance", "seconds"}
    assert doc["schema"] == "pstranspile.transpile/1" and doc["format"] == "pb" and doc["trainer_ids"] == [0]
    assert doc["pservers"] == EPS.split(",") and (doc["params"], doc["blocks"]) == (6, 8)
    assert sorted(os.path.basename(f) for f in doc["files"]) == sorted(p.name for p in (tmp_path / "o").iterdir())


def test_diff_json_schema(capsys, tmp_path):
    trainer = tmp_path / "o" / "trainer.pb"
    assert main(["transpile", str(MLP / "main.pb"), "--pservers", EPS, "--trainers", "2", "-o", str(tmp_path / "o"),
                 "-q"]) == 0
    capsys.readouterr()
    code, out, _ = run(capsys, "diff", MLP / "main.pb", trainer, "--json")
    doc = json.loads(out)
    assert code == 1 and doc["schema"] == "pstranspile.diff/1" and doc["equal"] is False
    assert set(doc) == {"schema", "a", "b", "equal", "version", "blocks", "blocks_added", "blocks_removed", "notes",
                        "diff"}
    (block,) = doc["blocks"]
    assert set(block) == {"idx", "ops_before", "ops_after", "ops_added", "ops_removed", "vars_added", "vars_removed",
                          "vars_changed", "parent"}
    assert block["ops_removed"] == {"adam": 6} and block["ops_added"]["send"] >= 6 and doc["diff"].startswith("--- ")
    code, out, _ = run(capsys, "diff", MLP / "main.pb", MLP / "main.pb", "--json", "--summary-only")
    doc = json.loads(out)
    assert code == 0 and doc["equal"] is True and doc["blocks"] == [] and doc["diff"] is None


def test_fetch_json(capsys, tmp_path):
    import numpy as np

    from ops.rpc.checkpoint import Checkpointer, VarSlice
    from ops.scope import Scope
    from ops.tensor import LoDTensor

    w = np.arange(12, dtype=np.float32).reshape(6, 2)
    for i, (start, end) in enumerate(((0, 4), (4, 6))):
        scope = Scope()
        scope.set_var(f"w.block{i}", LoDTensor(w[start:end]))
        Checkpointer(tmp_path / "ck", f"ps{i}", ("ps0", "ps1"), {f"w.block{i}": VarSlice("w", (6, 2), (start, end))}
                     ).save(scope, "ckpt-7")
    code, out, err = run(capsys, "fetch", "--checkpoint", tmp_path / "ck", "-o", tmp_path / "vars", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc == {"schema": "pstranspile.fetch/1", "output": str(tmp_path / "vars"),
                   "source": {"kind": "checkpoint", "path": str(tmp_path / "ck"), "step": 7}, "bytes": 48,
                   "vars": [{"name": "w", "dtype": "float32", "shape": [6, 2], "bytes": 48,
                             "file": str(tmp_path / "vars" / "w")}]}


# ------------------------------------------------------------------ --all-trainers, --format


def test_all_trainers_writes_every_trainer_in_one_run(capsys, tmp_path):
    code, out, err = run(capsys, "transpile", MLP / "main.pb", "--pservers", EPS, "--trainers", "3", "-o",
                         tmp_path / "o", "--all-trainers", "--json")
    assert code == 0, err
    names = sorted(p.name for p in (tmp_path / "o").iterdir())
    assert [n for n in names if n.startswith("trainer")] == [
        "trainer_0.pb", "trainer_0_startup.pb", "trainer_1.pb", "trainer_1_startup.pb", "trainer_2.pb",
        "trainer_2_startup.pb"]
    assert json.loads(out)["trainer_ids"] == [0, 1, 2]
    main_program, startup = Program.load(MLP / "main.pb"), Program.load(MLP / "startup.pb")
    for i in range(3):
        one = transpile(main_program, startup, pservers=EPS, trainers=3, trainer_id=i)
        assert (tmp_path / "o" / f"trainer_{i}.pb").read_bytes() == one.trainer.to_bytes()
        assert (tmp_path / "o" / f"trainer_{i}_startup.pb").read_bytes() == one.trainer_startup.to_bytes()
        for endpoint, (pserver, _) in one.pservers.items():  # the pservers do not depend on the trainer id
            stem = "pserver_" + endpoint.replace(":", "_")
            assert (tmp_path / "o" / f"{stem}.pb").read_bytes() == pserver.to_bytes()


@pytest.mark.parametrize(("flags", "trainer_file"), [(["--paddle-names"], "trainer.pdmodel"),
                                                      (["--format", "paddle"], "trainer.pdmodel"),
                                                      (["--format", "fluid18"], "trainer/__model__")])
def test_paddle_file_names_hold_the_same_bytes(capsys, tmp_path, flags, trainer_file):
    code, out, err = run(capsys, "transpile", MLP / "main.pb", "--pservers", EPS, "--trainers", "2", "-o",
                         tmp_path / "o", *flags)
    assert code == 0, err
    run(capsys, "transpile", MLP / "main.pb", "--pservers", EPS, "--trainers", "2", "-o", tmp_path / "pb")
    assert (tmp_path / "o" / trainer_file).read_bytes() == (tmp_path / "pb" / "trainer.pb").read_bytes()
    suffix = trainer_file.replace("trainer", "")
    assert (tmp_path / "o" / f"pserver_127.0.0.1_6171_startup{suffix}").read_bytes() == (
        tmp_path / "pb" / "pserver_127.0.0.1_6171_startup.pb").read_bytes()
    assert not list((tmp_path / "o").glob("*.pb"))
    # and what was written is an input again: the folder of programs dumps like the file
    code, out, _ = run(capsys, "dump", tmp_path / "o" / trainer_file.split("/")[0] if "/" in trainer_file
                       else tmp_path / "o" / trainer_file, "--full")
    assert code == 0 and out == dump(Program.load(tmp_path / "pb" / "trainer.pb"))


def test_a_rerun_with_fewer_pservers_removes_the_old_ones_in_every_layout(capsys, tmp_path):
    for eps in ("127.0.0.1:1,127.0.0.1:2,127.0.0.1:3", "127.0.0.1:1"):
        assert main(["transpile", str(MLP / "main.pb"), "--pservers", eps, "--trainers", "1", "-o",
                     str(tmp_path / "o"), "--format", "fluid18", "-q"]) == 0
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == [
        "plan.json", "pserver_127.0.0.1_1", "pserver_127.0.0.1_1_startup", "trainer", "trainer_startup"]


# ------------------------------------------------------------------ completion


def test_the_cli_runs_without_argcomplete_and_completes_with_it(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent)}
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "argcomplete.py").write_text("raise ImportError('not installed')\n")
    without = subprocess.run([sys.executable, "-m", "transpiler", "--version"], capture_output=True, text=True,
                             env={**env, "PYTHONPATH": f"{blocked}{os.pathsep}{TESTS.parent}"}, check=False)
    assert without.returncode == 0 and without.stdout.startswith("pstranspile ")
    pytest.importorskip("argcomplete", reason="argcomplete (the `completion` extra) is not installed")
    line = "pstranspile tra"
    done = subprocess.run(
        [sys.executable, "-m", "transpiler"], capture_output=True, text=True, check=False, timeout=60,
        env={**env, "_ARGCOMPLETE": "1", "COMP_LINE": line, "COMP_POINT": str(len(line)), "_ARGCOMPLETE_IFS": "\n",
             "_ARGCOMPLETE_STDOUT_FILENAME": str(tmp_path / "words")})
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "words").read_text().split() == ["transpile"]


def test_every_command_takes_quiet_and_full():
    parser = cli.build_parser()
    for command in cli.COMMANDS:
        sub = parser._subparsers._group_actions[0].choices[command.name]  # noqa: SLF001 - argparse has no API
        flags = {flag for action in sub._actions for flag in action.option_strings}  # noqa: SLF001
        assert {"-q", "--quiet", "--full"} <= flags, command.name


def test_a_long_message_keeps_its_head_and_tail_and_cuts_its_list():
    from transpiler.cli import fit_line

    endpoints = ", ".join(f"127.0.0.1:{6000 + i}" for i in range(300))
    line = fit_line(f"pstranspile: error: x is not one of the pserver endpoints ({endpoints}): check it")
    assert len(line) <= MAX_WIDTH and line.startswith("pstranspile: error: x is not one of the pserver endpoints (")
    assert line.endswith(", ... and 293 more): check it") and "127.0.0.1:6006," in line
    path = "/very/long/" + "folder/" * 40 + "main.pb"
    line = fit_line(f"pstranspile: error: {path}: not a ProgramDesc (see `pstranspile --help`)")
    assert len(line) <= MAX_WIDTH and line.endswith("main.pb: not a ProgramDesc (see `pstranspile --help`)")
    assert "..." in line and line.startswith("pstranspile: error: /very/long/")
