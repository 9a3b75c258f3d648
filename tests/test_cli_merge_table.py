"""`pstranspile merge-table`: shards in, one table out, a report of where rows came from;
one stderr line and exit 2 for every bad input."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from conftest import TESTS
from ops.rpc.table_io import write_shard
from ops.rpc.tensor_file import read_tensor
from transpiler.cli import main

ERROR = "pstranspile: error: "


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def shards(tmp_path):
    """Two pservers' shards of a 10 x 2 table sharded id % 2 (ids 0, 4 and 8 on one, 3 on the other)."""
    write_shard(tmp_path / "emb_0", np.array([4, 0, 8]), np.array([[4, 4], [0, 0], [8, 8]], np.float32), 5)
    write_shard(tmp_path / "emb_1", np.array([3]), np.array([[3, 3]], np.float32), 5)
    return tmp_path / "emb_0", tmp_path / "emb_1"


def test_merge_rebuilds_the_table_and_says_where_rows_came_from(capsys, shards, tmp_path):
    out_path = tmp_path / "table.npy"
    code, out, err = run(capsys, "merge-table", *shards, "--height", 10, "-o", out_path)
    assert (code, err) == (0, "")
    table = np.load(out_path)
    assert table.shape == (10, 2) and table.dtype == np.float32
    assert table[:, 0].tolist() == [0, 0, 0, 3, 4, 0, 0, 0, 8, 0]
    lines = out.splitlines()
    assert lines[0] == f"{out_path}: 10 x 2 float32 (npy) from 2 shard(s):"
    assert lines[1:3] == [f"  {shards[0]}: 3 rows", f"  {shards[1]}: 1 rows"]
    assert lines[3] == "4 rows from the shards, 6 never touched (written as 0)"


def test_merge_without_height_stops_at_the_largest_id_and_fill_marks_untouched_rows(capsys, shards, tmp_path):
    code, out, _ = run(capsys, "merge-table", *shards, "--fill", "nan", "-o", tmp_path / "t.npy")
    table = np.load(tmp_path / "t.npy")
    assert code == 0 and table.shape == (9, 2) and np.isnan(table[[1, 2, 5, 6, 7]]).all()
    assert out.splitlines()[-1] == "4 rows from the shards, 5 never touched (written as nan); height = the largest id + 1"


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["{0}", "{0}"], "id 0 is in two shards"),
        (["{0}", "--height", "5"], "id 8 does not fit a table of height 5"),
        (["{missing}"], "cannot read"),
        (["{junk}"], "not a table shard (not a numpy .npz archive)"),
        (["{plain}"], "not a table shard (a bare numpy array"),
        (["{0}", "--height", "0"], "--height must be >= 1"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, shards, tmp_path, argv, fragment):
    (tmp_path / "junk").write_text("not a shard")
    np.save(tmp_path / "plain.npy", np.zeros((2, 2)))
    names = {"missing": tmp_path / "absent", "junk": tmp_path / "junk", "plain": tmp_path / "plain.npy"}
    args = [a.format(shards[0], **names) for a in argv]
    code, out, err = run(capsys, "merge-table", *args, "-o", tmp_path / "t.npy")
    assert code == 2 and out == "" and len(err.splitlines()) == 1 and err.startswith(ERROR), err
    assert fragment in err, err
    assert not (tmp_path / "t.npy").exists()


def test_an_unwritable_output_is_one_line(capsys, shards, tmp_path):
    (tmp_path / "dir").mkdir()
    code, _, err = run(capsys, "merge-table", *shards, "-o", tmp_path / "dir")
    assert code == 2 and err.startswith(f"{ERROR}cannot write {tmp_path / 'dir'}") and len(err.splitlines()) == 1


def test_the_command_runs_as_a_module(shards, tmp_path):
    done = subprocess.run([sys.executable, "-m", "transpiler", "merge-table", *map(str, shards), "-o",
                           str(tmp_path / "t.npy")], cwd=TESTS.parent, capture_output=True, text=True, check=False)
    assert done.returncode == 0 and "4 rows from the shards" in done.stdout, done.stderr


def test_the_height_can_come_from_the_plan(capsys, shards, tmp_path):
    import json

    (tmp_path / "plan.json").write_text(json.dumps({"table": {"table": "emb", "shape": [12, 2]}}))
    code, out, _ = run(capsys, "merge-table", *shards, "--plan", tmp_path / "plan.json", "-o", tmp_path / "t.npy")
    assert code == 0 and np.load(tmp_path / "t.npy").shape == (12, 2) and "8 never touched" in out
    (tmp_path / "dense.json").write_text(json.dumps({"table": None}))
    code, out, err = run(capsys, "merge-table", *shards, "--plan", tmp_path / "dense.json", "-o", tmp_path / "t.npy")
    assert code == 2 and "the plan has no distributed table" in err


def test_merge_writes_fluid_s_lodtensor_file_unless_the_output_is_npy(capsys, shards, tmp_path):
    code, out, _ = run(capsys, "merge-table", *shards, "--height", 10, "-o", tmp_path / "emb")
    assert code == 0 and "(lodtensor)" in out.splitlines()[0]
    assert read_tensor(tmp_path / "emb")[:, 0].tolist() == [0, 0, 0, 3, 4, 0, 0, 0, 8, 0]
    code, _, _ = run(capsys, "merge-table", *shards, "--format", "npy", "-o", tmp_path / "emb.bin")
    assert code == 0 and np.load(tmp_path / "emb.bin").shape == (9, 2)
