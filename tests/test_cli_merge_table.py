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


# ------------------------------------------------------------------ pieces of a partitioned table

PIECES_PLAN = {"partitioner": "custom", "params": [{"param": "emb", "shape": [6, 4], "distributed": True, "blocks": [
    {"name": "emb.block0", "endpoint": "a:1", "row_offset": 0, "rows": 3, "col_offset": 0, "cols": 2},
    {"name": "emb.block1", "endpoint": "b:1", "row_offset": 0, "rows": 3, "col_offset": 2, "cols": 2},
    {"name": "emb.block2", "endpoint": "a:1", "row_offset": 3, "rows": 3, "col_offset": 0, "cols": 4},
]}], "table": None}


def write_piece(path, rows, value, height):
    from ops.rpc.checkpoint import encode_table
    from ops.tensor import SelectedRows

    pool = np.full((height, value.shape[1]), 7, value.dtype)  # unused preallocated rows: never merged
    pool[: len(rows)] = value
    data, spare = encode_table(SelectedRows(np.asarray(rows, np.int64), pool, height))
    path.write_bytes(data)
    path.with_name(path.name + "@POOL").write_bytes(spare)
    return path


@pytest.fixture(params=[np.float32, np.float64])
def pieces(request, tmp_path):
    """A 6 x 4 table in three pieces, as a checkpoint holds them: rows 0-2 in two column
    pieces (ids 2 and 0 touched, first-touch order), rows 3-5 whole (id 4 touched)."""
    import json

    whole = np.arange(24, dtype=request.param).reshape(6, 4) + 1
    (tmp_path / "plan.json").write_text(json.dumps(PIECES_PLAN))
    (tmp_path / "ps0").mkdir()
    (tmp_path / "ps1").mkdir()
    return whole, [
        write_piece(tmp_path / "ps0" / "emb.block0", [2, 0], whole[[2, 0], 0:2], 3),
        write_piece(tmp_path / "ps1" / "emb.block1", [0, 2], whole[[0, 2], 2:4], 3),
        write_piece(tmp_path / "ps0" / "emb.block2", [1], whole[[4]], 3),
    ]


def test_pieces_and_the_plan_make_the_whole_table(capsys, pieces, tmp_path):
    whole, files = pieces
    pools = sorted(tmp_path.glob("ps*/*@POOL"))
    code, out, err = run(capsys, "merge-table", *files, *pools, "--plan", tmp_path / "plan.json", "--fill", "-1",
                         "-o", tmp_path / "t.npy")
    assert (code, err) == (0, ""), err
    table = np.load(tmp_path / "t.npy")
    want = np.full((6, 4), -1, whole.dtype)
    want[[0, 2, 4]] = whole[[0, 2, 4]]
    assert table.dtype == whole.dtype and np.array_equal(table, want)
    lines = out.splitlines()
    assert lines[0] == f"{tmp_path / 't.npy'}: 6 x 4 {whole.dtype} (npy) from 3 piece(s) of emb:"
    assert lines[1:4] == [f"  {files[0]}: 2 rows", f"  {files[1]}: 2 rows", f"  {files[2]}: 1 rows"]
    assert lines[4:] == ["skipped 3 @POOL file(s) (the pieces' unused preallocated rows)",
                         "3 rows from the pieces, 3 never touched (written as -1)"]


def test_a_checkpoint_manifest_is_a_plan_too(capsys, pieces, tmp_path):
    import json

    whole, files = pieces
    (tmp_path / "MANIFEST.json").write_text(json.dumps({"format": "x", "plan": PIECES_PLAN, "parts": {}}))
    code, _, err = run(capsys, "merge-table", *files, "--plan", tmp_path / "MANIFEST.json", "-o", tmp_path / "t")
    assert (code, err) == (0, "")
    assert np.array_equal(read_tensor(tmp_path / "t")[[0, 2, 4]], whole[[0, 2, 4]])


def _bad_plan(tmp_path, edit):
    import copy
    import json

    plan = copy.deepcopy(PIECES_PLAN)
    edit(plan["params"][0]["blocks"])
    (tmp_path / "bad.json").write_text(json.dumps(plan))
    return tmp_path / "bad.json"


@pytest.mark.parametrize(
    "case, fragment",
    [
        ("missing", "1 of emb's 3 pieces missing, e.g. emb.block1 (rows [0, 3), columns [2, 4), on b:1)"),
        ("twice", "are the same piece emb.block0"),
        ("half_row", "row 1 of emb is in some of its column pieces but not in"),
        ("no_plan", "is a piece of a table cut by a partitioner: pass --plan"),
        ("with_shard", "is not a piece of a partitioned table like"),
        ("only_pool", "a piece's unused preallocated rows (@POOL)"),
        ("overlap", "the plan's pieces of emb overlap at rows [0, 3), column 1"),
        ("gap", "leave rows [0, 3) columns [3, 4) uncovered"),
        ("dense", "dense.w.block0 is a block of dense.w, not a piece of a partitioned table"),
        ("unknown", "other.block0 is not a piece of a partitioned table in the plan (its pieces are named like"),
        ("other_plan", "a piece of 3 rows x 2 columns, the plan's emb.block0 is 2 x 2 (a checkpoint of another plan?)"),
        ("out_of_piece", "row 3 is outside the piece's 3 rows"),
        ("height", "--height 9, but emb in"),
    ],
)
def test_bad_pieces_are_one_line_and_exit_2(capsys, pieces, tmp_path, case, fragment):
    import json

    whole, files = pieces
    zeros = lambda n, width: np.zeros((n, width), whole.dtype)  # noqa: E731
    plan = tmp_path / "plan.json"
    args = [*files, "--plan", plan]
    if case == "missing":
        args = [files[0], files[2], "--plan", plan]
    elif case == "twice":
        (tmp_path / "copy").mkdir()
        (tmp_path / "copy" / "emb.block0").write_bytes(files[0].read_bytes())
        args = [*files, tmp_path / "copy" / "emb.block0", "--plan", plan]
    elif case == "half_row":
        write_piece(files[1], [0, 2, 1], zeros(3, 2), 3)
    elif case == "no_plan":
        args = files
    elif case == "with_shard":
        write_shard(tmp_path / "emb_0", np.array([1]), np.zeros((1, 4), np.float32), 3)
        args = [*files, tmp_path / "emb_0", "--plan", plan]
    elif case == "only_pool":
        args = [files[0].with_name("emb.block0@POOL"), "--plan", plan]
    elif case == "overlap":
        args = [*files, "--plan", _bad_plan(tmp_path, lambda b: b[1].update(col_offset=1, cols=3))]
    elif case == "gap":
        args = [*files, "--plan", _bad_plan(tmp_path, lambda b: b[1].update(cols=1))]
    elif case == "unknown":
        args = [*files, write_piece(tmp_path / "other.block0", [0], zeros(1, 4), 3), "--plan", plan]
    elif case == "dense":
        plan = _bad_plan(tmp_path, lambda b: None)
        doc = json.loads(plan.read_text())
        doc["params"].append({"param": "dense.w", "shape": [3, 3], "blocks": [{"name": "dense.w.block0"}]})
        plan.write_text(json.dumps(doc))
        (tmp_path / "dense.w.block0").write_bytes(bytes(40))  # a LoDTensor file starts with version 0 too
        args = [*files, tmp_path / "dense.w.block0", "--plan", plan]
    elif case == "other_plan":
        args = [*files, "--plan", _bad_plan(tmp_path, lambda b: (b[0].update(rows=2), b[1].update(rows=2),
                                                                b[2].update(row_offset=2, rows=4)))]
    elif case == "out_of_piece":
        write_piece(files[2], [3], zeros(1, 4), 3)
    elif case == "height":
        args = [*args, "--height", 9]
    code, out, err = run(capsys, "merge-table", *args, "-o", tmp_path / "t.npy")
    assert code == 2 and out == "" and len(err.splitlines()) == 1 and err.startswith(ERROR), err
    assert fragment in err, err
    assert not (tmp_path / "t.npy").exists()


def test_a_malformed_plan_entry_is_one_line(capsys, pieces, tmp_path):
    _, files = pieces
    code, _, err = run(capsys, "merge-table", *files, "--plan", _bad_plan(tmp_path, lambda b: b[2].pop("cols")),
                       "-o", tmp_path / "t.npy")
    assert code == 2 and len(err.splitlines()) == 1 and "the plan's entry of emb is malformed" in err, err
