"""`pstranspile transpile` and `pstranspile plan`: outputs, options, errors."""

from __future__ import annotations

import json

import pytest

from conftest import PADDLE_PROGRAMS
from transpiler.api import transpile
from transpiler.cli import main
from transpiler.ir import Program

MLP = PADDLE_PROGRAMS / "mlp_adam_2ps"
EPS = "127.0.0.1:6170,127.0.0.1:6171"
FILES = ["plan.json", "pserver_127.0.0.1_6170.pb", "pserver_127.0.0.1_6170_startup.pb", "pserver_127.0.0.1_6171.pb",
         "pserver_127.0.0.1_6171_startup.pb", "trainer.pb", "trainer_startup.pb"]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_transpile_writes_every_program_and_the_plan(capsys, tmp_path):
    out_dir = tmp_path / "out"
    code, out, err = run(capsys, "transpile", str(MLP / "main.pb"), "--pservers", EPS, "--trainers", "2",
                         "--trainer-id", "1", "-o", str(out_dir))
    assert code == 0, err
    assert sorted(p.name for p in out_dir.iterdir()) == FILES
    assert "6 params in 8 blocks on 2 pservers" in out
    expected = transpile(Program.load(MLP / "main.pb"), Program.load(MLP / "startup.pb"), pservers=EPS, trainers=2,
                         trainer_id=1)
    assert (out_dir / "trainer.pb").read_bytes() == expected.trainer.to_bytes()
    assert (out_dir / "pserver_127.0.0.1_6171_startup.pb").read_bytes() == expected.pservers["127.0.0.1:6171"][1].to_bytes()
    assert json.loads((out_dir / "plan.json").read_text()) == expected.plan.to_json()


def test_transpile_options_reach_the_transpiler(capsys, tmp_path):
    code, _, err = run(capsys, "transpile", str(MLP / "main.pb"), "--startup", str(MLP / "startup.pb"), "--pservers",
                       EPS, "--trainers", "2", "--async", "--no-slice", "--split-method", "balanced",
                       "--min-block-size", "100", "-o", str(tmp_path / "o"))
    assert code == 0, err
    plan = json.loads((tmp_path / "o" / "plan.json").read_text())
    assert (plan["sync_mode"], plan["slice_var_up"], plan["split_method"], plan["min_block_size"]) == (
        False, False, "balanced", 100)
    trainer = Program.load(tmp_path / "o" / "trainer.pb")
    assert "send_barrier" not in [op.type for op in trainer.global_block().ops]


def test_dump_dir_and_progress(capsys, tmp_path):
    code, _, err = run(capsys, "transpile", str(MLP / "main.pb"), "--pservers", EPS, "--trainers", "2", "-o",
                       str(tmp_path / "o"), "--dump-dir", str(tmp_path / "dumps"), "--progress", "--verify-each-pass")
    assert code == 0
    assert [line.split(":")[1].strip() for line in err.splitlines()] == [
        "pass lower_async_lr_decay", "pass keep_clip_on_trainer", "pass find_optimize", "pass slice_vars", "pass drop_optimize",
        "pass distribute_lookups", "pass insert_sends", "pass insert_recvs", "pass drop_unused_vars",
        "pass trainer_startup", "pass pserver_lr_decay", "pass pserver_optimize_blocks", "pass pserver_norm_reduce",
        "pass pserver_table_blocks",
        "pass pserver_serve", "pass pserver_startup"]
    assert (tmp_path / "dumps" / "05_drop_optimize" / "trainer.txt").read_text().startswith("# ps-transpiler dump")
    folders = sorted((tmp_path / "dumps").iterdir())
    assert len(folders) == 16 and all(sorted(f.iterdir()) for f in folders)  # no pass folder is empty
    assert sorted(p.name for p in folders[1].iterdir()) == ["origin.txt", "origin_startup.txt"]
    assert sorted(p.name for p in folders[2].iterdir()) == ["analysis.txt", "origin.txt", "origin_startup.txt"]


def test_plan_report_and_json(capsys):
    code, out, _ = run(capsys, "plan", str(MLP / "main.pb"), "--pservers", EPS, "--trainers", "2")
    assert code == 0
    assert "imbalance (max / mean elements): 1.005" in out
    assert "  h1.w.block1                            127.0.0.1:6170                  392:784 [392, 256]" in out
    assert out.splitlines()[3].split()[:4] == ["127.0.0.1:6170", "4", "117,002", "468,008"]
    code, out, _ = run(capsys, "plan", str(MLP / "main.pb"), "--pservers", EPS, "--trainers", "2", "--json")
    assert json.loads(out)["params"][1]["blocks"][0]["endpoint"] == "127.0.0.1:6171"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pservers", "127.0.0.1:6170,127.0.0.1:6170", "--trainers", "2"], "listed twice"),
        (["--pservers", "localhost", "--trainers", "2"], "malformed pserver endpoint 'localhost'"),
        (["--pservers", "127.0.0.1:6170,,127.0.0.1:6171", "--trainers", "2"],
         "malformed pserver endpoint list '127.0.0.1:6170,,127.0.0.1:6171': entry 2 of 3 is empty"),
        (["--pservers", ",127.0.0.1:6170", "--trainers", "2"], "entry 1 of 2 is empty"),
        (["--pservers", "127.0.0.1:6170,", "--trainers", "2"], "entry 2 of 2 is empty"),
        (["--pservers", "", "--trainers", "2"], "no pserver endpoints given"),
        (["--pservers", EPS, "--trainers", "0"], "trainers must be an integer >= 1"),
        (["--pservers", EPS, "--trainers", "99999999999999999999"], "trainers must be at most 100000"),
        (["--pservers", "127.0.0.1:06170,127.0.0.1:6170", "--trainers", "2"],
         "127.0.0.1:06170 and 127.0.0.1:6170 name the same socket"),
        (["--pservers", "localhost:6170,127.0.0.1:6170", "--trainers", "2"],
         "localhost:6170 and 127.0.0.1:6170 name the same socket"),
        (["--pservers", "[::1]:6170,[0:0::1]:6170", "--trainers", "2"], "name the same socket"),
        (["--pservers", EPS, "--trainers", "2", "--trainer-id", "2"], r"trainer_id must be in [0, 1]"),
        (["--pservers", EPS, "--trainers", "2", "--min-block-size", "0"], "min_block_size must be an integer >= 1"),
        (["--pservers", EPS, "--trainers", "2", "--split-method", "zigzag"], "unknown split method"),
        (["--pservers", EPS, "--trainers", "2", "--runtime-split"], "needs async mode"),
        (["--trainers", "2"], "the following arguments are required: --pservers"),
    ],
)
def test_bad_arguments_one_line_exit_2_nothing_written(capsys, tmp_path, args, message):
    code, out, err = run(capsys, "transpile", str(MLP / "main.pb"), *args, "-o", str(tmp_path / "o"))
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("pstranspile: error: ") and message in err
    assert not (tmp_path / "o").exists()


def test_whitespace_around_endpoints_is_accepted(capsys):
    code, out, err = run(capsys, "plan", str(MLP / "main.pb"), "--pservers", " 127.0.0.1:6170 , 127.0.0.1:6171 ",
                         "--trainers", "2", "--json")
    assert code == 0, err
    assert json.loads(out)["endpoints"] == ["127.0.0.1:6170", "127.0.0.1:6171"]


def test_bad_programs(capsys, tmp_path):
    garbage = tmp_path / "main.pb"
    garbage.write_bytes(b"\x0a\xff\xff not a program")
    code, _, err = run(capsys, "transpile", str(garbage), "--startup", str(MLP / "startup.pb"), "--pservers", EPS,
                       "--trainers", "2", "-o", str(tmp_path / "o"))
    assert code == 2 and "not a ProgramDesc" in err and err.count("\n") == 1
    code, _, err = run(capsys, "transpile", str(MLP / "startup.pb"), "--startup", str(MLP / "startup.pb"),
                       "--pservers", EPS, "--trainers", "2", "-o", str(tmp_path / "o"))
    assert code == 2 and "no optimizer ops" in err
    lone = tmp_path / "alone" / "main.pb"
    lone.parent.mkdir()
    lone.write_bytes((MLP / "main.pb").read_bytes())
    code, _, err = run(capsys, "plan", str(lone), "--pservers", EPS, "--trainers", "2")
    assert code == 2 and "pass the startup program with --startup" in err
    assert not (tmp_path / "o").exists()


def test_distinct_addresses_on_one_port_are_distinct_pservers(capsys):
    code, out, err = run(capsys, "plan", str(MLP / "main.pb"), "--pservers", "127.0.0.1:6170,127.0.0.2:6170,[::1]:6170",
                         "--trainers", "2", "--json")
    assert code == 0, err
    assert len(json.loads(out)["endpoints"]) == 3


def test_an_older_runs_pserver_files_do_not_linger(capsys, tmp_path):
    out_dir = tmp_path / "out"
    for eps in ("127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003", EPS):
        code, _, err = run(capsys, "transpile", str(MLP / "main.pb"), "--pservers", eps, "--trainers", "2",
                           "-o", str(out_dir))
        assert code == 0, err
    assert sorted(p.name for p in out_dir.iterdir()) == FILES


def test_a_file_in_the_way_of_the_output_folder(capsys, tmp_path):
    (tmp_path / "afile").write_text("")
    code, _, err = run(capsys, "transpile", str(MLP / "main.pb"), "--pservers", EPS, "--trainers", "2",
                       "-o", str(tmp_path / "afile" / "sub"))
    assert code == 2 and err.count("\n") == 1 and "afile is a file, not a directory" in err


def test_a_wrongly_typed_op_role_is_a_user_error(capsys, tmp_path):
    from transpiler.ir import Attr, AttrType

    program = Program.load(MLP / "main.pb")
    program.global_block().ops[3].set_attr("op_role", Attr.of("forward", AttrType.STRING))
    program.save(tmp_path / "bad.pb")
    code, _, err = run(capsys, "transpile", str(tmp_path / "bad.pb"), "--startup", str(MLP / "startup.pb"),
                       "--pservers", EPS, "--trainers", "2", "-o", str(tmp_path / "o"))
    assert code == 2 and err.count("\n") == 1 and "attr op_role is STRING, not INT" in err
    assert not (tmp_path / "o").exists()
    code, _, err = run(capsys, "dump", str(tmp_path / "bad.pb"))
    assert code == 2 and "attr op_role is STRING, not INT" in err


def test_random_seed_seeds_the_unsliced_shuffle(capsys):
    base = ("plan", str(MLP / "main.pb"), "--pservers", EPS, "--trainers", "2", "--no-slice", "--json")
    placements = []
    for seed in ("0", "1", "2"):
        code, out, _ = run(capsys, *base, "--random-seed", seed)
        assert code == 0
        placements.append({p["param"]: p["blocks"][0]["endpoint"] for p in json.loads(out)["params"]})
    code, out, _ = run(capsys, *base)
    assert {p["param"]: p["blocks"][0]["endpoint"] for p in json.loads(out)["params"]} == placements[0]
    assert len({tuple(sorted(p.items())) for p in placements}) > 1
