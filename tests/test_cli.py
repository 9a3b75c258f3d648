"""`pstranspile`: dump / diff / graph, and one stderr line with exit 2 for every bad input."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PADDLE_PROGRAMS, TESTS
from proto import framework_pb2
from transpiler import __version__, cli
from transpiler.cli import Command, arg, build_parser, main
from transpiler.ir import Program
from transpiler.ir.printer import dump, dump_json

BASIC = PADDLE_PROGRAMS / "fluid18_basic_sgd_2ps" / "main.pb"
PIECEWISE = PADDLE_PROGRAMS / "fluid18_lr_piecewise_2ps" / "main.pb"
ERROR = "pstranspile: error: "


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_error(code: int, out: str, err: str, *fragments: str) -> None:
    assert code == 2
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(ERROR), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture
def broken_pb(tmp_path, monkeypatch):
    """The basic fixture with op 3 reading a var nobody declares, as a path relative to the
    test's folder (the current dir): the error lines that name it must not depend on how
    long the temp path is (a pytest-xdist worker's is longer, and lines are cut at 200)."""
    program = Program.load(BASIC)
    program.global_block().ops[3].set_input("Y", "ghost")
    program.save(tmp_path / "broken.pb")
    monkeypatch.chdir(tmp_path)
    return Path("broken.pb")


# ------------------------------------------------------------------- basics


def test_version(capsys):
    code, out, err = run(capsys, "--version")
    assert (code, out, err) == (0, f"pstranspile {__version__}\n", "")


def test_help_lists_every_command(capsys):
    code, out, _err = run(capsys, "--help")
    assert code == 0
    for command in cli.COMMANDS:
        assert command.name in out


def test_registry_builds_one_subparser_per_command():
    calls = []

    def run_hello(args):
        calls.append(args.name)
        return 0

    extra = Command("hello", "say hello", (arg("name"),), run_hello)
    parser = build_parser((*cli.COMMANDS, extra))
    args = parser.parse_args(["hello", "world"])
    assert args.run(args) == 0 and calls == ["world"]
    names = [c.name for c in cli.COMMANDS]
    assert names[:3] == ["dump", "diff", "graph"] and len(set(names)) == len(names)


# --------------------------------------------------------------------- dump


def test_dump_text(capsys):
    code, out, err = run(capsys, "dump", BASIC, "--full")  # whole lines, as the printer makes them
    assert (code, err) == (0, "")
    assert out == dump(Program.load(BASIC))
    assert out == (TESTS / "golden" / "dump" / "fluid18_basic_sgd_2ps.main.txt").read_text()


def test_dump_json_block_and_all_attrs(capsys):
    code, out, _ = run(capsys, "dump", PIECEWISE, "--json", "--block", "2")
    assert code == 0 and json.loads(out) == dump_json(Program.load(PIECEWISE), block=2)
    code, out, _ = run(capsys, "dump", PIECEWISE, "--block", "1")
    assert code == 0 and "block 1 parent=0" in out and "block 0 " not in out
    code, out, _ = run(capsys, "dump", PIECEWISE, "--all-attrs")
    assert code == 0 and "op_callstack=" in out


def test_dump_to_a_file(capsys, tmp_path):
    target = tmp_path / "out.txt"
    code, out, err = run(capsys, "dump", BASIC, "-o", target)
    assert (code, out, err) == (0, "", "")
    assert target.read_text() == dump(Program.load(BASIC))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"], "no temp file left"
    mask = os.umask(0)
    os.umask(mask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~mask


def test_dump_verifies_by_default(capsys, broken_pb):
    code, out, err = run(capsys, "dump", broken_pb)
    assert_one_error(code, out, err, str(broken_pb), "block 0, op 3 (square)", "Y='ghost'")


def test_dump_no_verify_dumps_anyway(capsys, broken_pb):
    code, out, err = run(capsys, "dump", "--no-verify", broken_pb)
    assert code == 0 and err == "" and "Y=[ghost]" in out


def test_unknown_fields_give_a_warning_line(capsys, tmp_path):
    message = framework_pb2.ProgramDesc.FromString(BASIC.read_bytes())
    path = tmp_path / "newer.pb"
    path.write_bytes(message.SerializeToString() + bytes([0xF8, 0x06, 0x01]))  # field 111, varint 1
    code, out, err = run(capsys, "dump", path, "--full")
    assert code == 0 and out == dump(Program.load(BASIC))
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pstranspile: warning: ") and "dropped" in lines[0]


# --------------------------------------------------------------- bad input


def _bad_inputs(tmp_path):
    data = BASIC.read_bytes()
    files = {
        "garbage": b"\x00\x01\x02garbage\xff\xfe" * 10,
        "truncated": data[: len(data) // 2],
        "empty": b"",
        "json": json.dumps({"blocks": [{"idx": 0, "ops": []}]}).encode(),
        # A var name that is not UTF-8 (same length, so the wire format stays valid).
        "invalid_utf8": data.replace(b"square_error_cost_0.tmp_0", b"\xffquare_error_cost_0.tmp_0", 1),
    }
    paths = {}
    for name, content in files.items():
        paths[name] = tmp_path / f"{name}.pb"
        paths[name].write_bytes(content)
    paths["missing"] = tmp_path / "missing.pb"
    paths["directory"] = tmp_path
    return paths


@pytest.mark.parametrize("kind", ["garbage", "truncated", "empty", "json", "invalid_utf8", "missing", "directory"])
@pytest.mark.parametrize("command", ["dump", "diff", "graph"])
def test_bad_files_give_one_error_line(capsys, tmp_path, kind, command):
    path = _bad_inputs(tmp_path)[kind]
    argv = {
        "dump": ["dump", path],
        "diff": ["diff", BASIC, path],
        "graph": ["graph", path, "-o", tmp_path / "g.dot"],
    }[command]
    code, out, err = run(capsys, *argv)
    assert_one_error(code, out, err, str(path))
    assert not (tmp_path / "g.dot").exists()


def test_messages_say_what_is_wrong(capsys, tmp_path):
    paths = _bad_inputs(tmp_path)
    assert "no blocks" in run(capsys, "dump", paths["empty"])[2]
    assert "not a ProgramDesc" in run(capsys, "dump", paths["garbage"])[2]
    assert "No such file" in run(capsys, "dump", paths["missing"])[2]


@pytest.mark.parametrize("command", ["dump", "graph"])
@pytest.mark.parametrize("block", ["9", "-1", "4"])
def test_block_out_of_range(capsys, tmp_path, command, block):
    argv = ["dump", PIECEWISE, "--block", block] if command == "dump" else [
        "graph", PIECEWISE, "--block", block, "-o", tmp_path / "g.dot"]
    code, out, err = run(capsys, *argv)
    assert_one_error(code, out, err, f"--block {block} is out of range", "blocks 0..3")


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        ([], "required: COMMAND"),
        (["frobnicate"], "invalid choice"),
        (["dump"], "required: P.pb"),
        (["dump", str(BASIC), "--block", "x"], "invalid int value"),
        (["dump", str(BASIC), "--bogus"], "unrecognized arguments"),
        (["diff", str(BASIC)], "required: B.pb"),
        (["graph", str(BASIC)], "required: -o/--output"),
    ],
)
def test_bad_arguments_give_one_error_line(capsys, argv, fragment):
    code, out, err = run(capsys, *argv)
    assert_one_error(code, out, err, fragment, "--help")


def test_unwritable_output(capsys, tmp_path):
    target = tmp_path / "no" / "such" / "dir.txt"
    code, out, err = run(capsys, "dump", BASIC, "-o", target)
    assert_one_error(code, out, err, f"cannot write {target}: No such file or directory")


def test_a_closed_pipe_stops_quietly(capsys, monkeypatch):
    """`pstranspile dump P.pb | head`: no traceback, no error line, exit 141 as a shell reports."""

    class ClosedPipe(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def fileno(self):
            raise io.UnsupportedOperation("fileno")

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    code = main(["dump", str(BASIC)])
    assert code == 141
    assert capsys.readouterr().err == ""


def test_a_bug_is_one_internal_error_line_with_exit_3(capsys, monkeypatch):
    def explode(args):
        raise KeyError("oops")

    monkeypatch.setattr(cli, "COMMANDS", (Command("dump", "x", (arg("program"),), explode),))
    monkeypatch.delenv("PSTRANSPILE_TRACEBACK", raising=False)
    code, out, err = run(capsys, "dump", BASIC)
    assert code == 3 and out == ""
    (line,) = err.splitlines()
    assert line.startswith("pstranspile: internal error: KeyError")


# --------------------------------------------------------------------- diff


def test_diff_equal_files(capsys):
    code, out, err = run(capsys, "diff", BASIC, BASIC)
    assert (code, out, err) == (0, "", "")


def test_diff_different_files(capsys):
    other = PADDLE_PROGRAMS / "fluid18_lr_exp_decay_2ps" / "main.pb"
    code, out, err = run(capsys, "diff", BASIC, other)
    assert code == 1 and err == ""
    lines = out.splitlines()
    assert lines[:3] == [f"--- {BASIC}", f"+++ {other}", "block 0: ops 13 -> 20"]
    assert "  ops added: cast, elementwise_pow, fill_constant, floor, increment, scale x2" in lines
    assert "  vars removed: learning_rate_0" in lines
    assert "@@ " in out and "+  op 0 increment" in out
    code, short, _ = run(capsys, "diff", BASIC, other, "--summary-only")
    assert code == 1 and "@@" not in short and out.startswith(short)


def test_diff_noise_only_with_and_without_all_attrs(capsys, tmp_path):
    program = Program.load(BASIC)
    program.global_block().ops[0].set_attr("op_callstack", ["moved.py:1"])
    path = tmp_path / "moved.pb"
    program.save(path)
    code, out, _ = run(capsys, "diff", BASIC, path)
    assert code == 1 and "text dumps are equal but the bytes differ" in out and "moved.py:1" in out
    code, out, _ = run(capsys, "diff", "--all-attrs", BASIC, path)
    assert code == 1 and '+  op 0 mul' in out and "moved.py:1" in out


# -------------------------------------------------------------------- graph


def test_graph_dot(capsys, tmp_path):
    target = tmp_path / "g.dot"
    code, out, err = run(capsys, "graph", PIECEWISE, "-o", target)
    assert (code, out, err) == (0, "", "")
    text = target.read_text()
    assert text.startswith('digraph "main.pb" {') and "cluster_b3" in text
    code, _, _ = run(capsys, "graph", PIECEWISE, "--block", "0", "-o", tmp_path / "b0.gv")
    assert code == 0 and "cluster_b1" not in (tmp_path / "b0.gv").read_text()


def test_graph_verifies_by_default(capsys, tmp_path, broken_pb):
    target = tmp_path / "g.dot"
    code, out, err = run(capsys, "graph", broken_pb, "-o", target)
    assert_one_error(code, out, err, str(broken_pb), "block 0, op 3 (square)", "Y='ghost'")
    assert not target.exists()


def test_graph_no_verify_draws_anyway(capsys, tmp_path, broken_pb):
    target = tmp_path / "g.dot"
    code, out, err = run(capsys, "graph", "--no-verify", broken_pb, "-o", target)
    assert (code, out, err) == (0, "", "")
    assert 'b0_op3 [label="3: square"' in target.read_text()  # the broken op is drawn


def test_graph_unknown_format(capsys, tmp_path):
    code, out, err = run(capsys, "graph", BASIC, "-o", tmp_path / "g.png")
    assert_one_error(code, out, err, ".dot, .gv or .svg")


def test_graph_svg_without_graphviz(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    code, out, err = run(capsys, "graph", BASIC, "-o", tmp_path / "g.svg")
    assert_one_error(code, out, err, "install Graphviz or write .dot")
    assert not (tmp_path / "g.svg").exists()


def test_graph_svg_when_dot_fails(capsys, tmp_path, monkeypatch):
    fake = tmp_path / "dot"
    fake.write_text("#!/bin/sh\necho 'syntax error in line 1' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(shutil, "which", lambda name: str(fake))
    code, out, err = run(capsys, "graph", BASIC, "-o", tmp_path / "g.svg")
    assert_one_error(code, out, err, "`dot -Tsvg` failed: syntax error in line 1")


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz is not installed")
def test_graph_svg(capsys, tmp_path):
    target = tmp_path / "g.svg"
    code, out, err = run(capsys, "graph", PIECEWISE, "-o", target)
    assert (code, out, err) == (0, "", "")
    assert "<svg" in target.read_text()


# --------------------------------------------------------------- subprocess


def test_python_dash_m_transpiler(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent)}
    ok = subprocess.run(
        [sys.executable, "-m", "transpiler", "dump", str(BASIC), "--full"], capture_output=True, text=True, env=env, check=False
    )
    assert ok.returncode == 0 and ok.stderr == "" and ok.stdout == dump(Program.load(BASIC))
    garbage = tmp_path / "garbage.pb"
    garbage.write_bytes(b"\xff" * 40)
    bad = subprocess.run(
        [sys.executable, "-m", "transpiler", "dump", str(garbage)], capture_output=True, text=True, env=env, check=False
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and bad.stderr.startswith(ERROR)
