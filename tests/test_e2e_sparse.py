"""Sync training with sparse embedding tables on several processes equals local training.

`examples/train_ctr.py` (the CTR example: 3 LoD id slots on one table, sum-pooled, two
fc layers; a synthetic click data set with Zipf-skewed ids) runs as 2 pservers x 2
trainers under `transpiler.runtime.launch`, 20 steps, each trainer on half of every batch; then
locally on the whole batches from what trainer 0 started with. Trainer 0 read the
initial rows of every id the 20 steps touch through the real RPC before its first step
(a distributed table creates a row on first touch, from the pool its initializer
filled), and the local table gets those rows (its other rows stay random: nothing
reads them). Every dense param and every touched table row must match.

* the distributed table (1,000,000 x 16, sharded `id % 2`, sgd on the pservers): float32
  with the bound of `test_e2e_sync.py` (`|dist - local| <= 1e-5 * (|local| + max|local|)`),
  and float64 element by element at rtol 1e-5; the float32 run also checks the trainer's
  memory (it never holds the table) and that the pservers' checkpoint shards merge back
  into the trained rows;
* the distributed table trained by Adam (`--table-optimizer adam`, non-lazy: 100,000 x
  16, its moments sharded and grown with its rows, beta powers per shard): every shard
  row the shard has created moves each step, as every row of the local dense table does;
  float64 element by element at rtol 1e-5 (measured ~3e-12), float32 within the bound of
  the dense proof (measured ~3e-6 of the table's scale);
* the `remote_prefetch` table (`--local-table`: sliced like a param, rows fetched from
  its blocks by `distributed_lookup_table`, Adagrad on the pservers) in float64 at rtol
  1e-5. In float32 its rows differ from local training by ~4e-5 of their scale: Adagrad's
  first update of a row is `lr * g / (|g| + 1e-6)`, which turns a rounding difference
  in a grad element near 1e-6 (a sum of per-example terms that nearly cancel, added in
  another order by the pserver) into a visible one. The float64 run shows ~1e-13: the
  algorithm is the same; the test bounds the float32 run at 1e-4 of the scale;
* the Paddle 2.6 fixture `ctr_v1_sparse_sgd_2ps` (a plain sparse table: SelectedRows
  grads split by row range, the trainer receives the whole table every step) in float32.

The figures are printed with `pytest -s`.
"""

from __future__ import annotations

import contextlib
import io

import numpy as np
from e2e_support import EXAMPLES, launch_script, run_script_locally

from conftest import PADDLE_PROGRAMS
from transpiler.cli import main as cli_main

CTR = str(EXAMPLES / "train_ctr.py")
STEPS, BATCH, ROWS, WIDTH = 20, 32, 1_000_000, 16
ADAM_ROWS = 100_000
RTOL = 1e-5


def train(tmp, *flags: str) -> tuple[dict, dict, dict]:
    """(trainer 0's, trainer 1's, local training's) saved arrays."""
    common = (CTR, "--steps", str(STEPS), "--batch", str(BATCH), "--quiet", *flags)
    launch_script(tmp, (*common, "--save", str(tmp / "params")), pservers=2, trainers=2)
    run_script_locally((*common, "--init", str(tmp / "params" / "trainer_0.npz"), "--save", str(tmp / "local")))
    load = lambda path: dict(np.load(path))  # noqa: E731
    return load(tmp / "params" / "trainer_0.npz"), load(tmp / "params" / "trainer_1.npz"), load(tmp / "local" / "local.npz")


def finals(saved: dict) -> dict[str, str]:
    """Compared key -> the key of its starting value: `final/<param>` and `final_rows/<table>`."""
    out = {k: "init/" + k[len("final/"):] for k in saved if k.startswith("final/")}
    out |= {k: "init_rows/" + k[len("final_rows/"):] for k in saved if k.startswith("final_rows/")}
    return out


def check_equal(case: str, t0: dict, t1: dict, local: dict, *, rtol: float = RTOL, scaled: bool = True,
                table_scale: float | None = None) -> None:
    compared = finals(local)
    assert compared.keys() == finals(t0).keys() and any(k.startswith("final_rows/") for k in compared)
    for key in compared:  # both trainers end with the pservers' values
        assert np.array_equal(t0[key], t1[key]), key
    for key, start in sorted(compared.items()):
        dist, ref = t0[key], local[key]
        diff = np.abs(dist.astype(np.float64) - ref)
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.where(diff == 0, 0.0, diff / np.abs(ref))
        scale = float(np.abs(ref).max())
        print(f"{case}: {key} {list(ref.shape)} {ref.dtype}: max |diff| {diff.max():.2e}, of the scale "
              f"{diff.max() / scale:.2e}, element-wise {rel.max():.2e}")
    for key, start in compared.items():
        dist, ref = t0[key], local[key]
        assert dist.dtype == ref.dtype and np.abs(ref - t0[start]).max() > 0, f"{key} never changed"
        scale = float(np.abs(ref).max())
        bound = table_scale if table_scale is not None and key.startswith("final_rows/") else rtol
        atol = bound * scale if scaled else 0.0
        np.testing.assert_allclose(dist, ref, rtol=rtol, atol=atol, err_msg=f"{case}: {key}")
    assert local["loss"][-5:].mean() < local["loss"][:5].mean(), "the loss did not drop"


def test_distributed_table_of_a_million_rows_equals_local_training(tmp_path):
    checkpoint = tmp_path / "ckpt"
    t0, t1, local = train(tmp_path, "--rows", str(ROWS), "--checkpoint", str(checkpoint))
    check_equal("distributed fp32", t0, t1, local)

    table_bytes = ROWS * WIDTH * 4
    grown = [(saved["rss_kb"][1] - saved["rss_kb"][0]) * 1024 for saved in (t0, t1, local)]
    traffic = t0["traffic"]
    print(f"table {table_bytes / 2**20:.1f} MiB; peak RSS growth during training: trainer 0 {grown[0] / 2**20:.1f} MiB, "
          f"trainer 1 {grown[1] / 2**20:.1f} MiB, local {grown[2] / 2**20:.1f} MiB; peak RSS trainer 0 "
          f"{t0['rss_kb'][1] / 1024:.1f} MiB, local {local['rss_kb'][1] / 1024:.1f} MiB")
    print(f"trainer 0 sent {traffic[:, 0].mean() / 1024:.1f} KiB/step, received {traffic[:, 1].mean() / 1024:.1f} KiB/step "
          f"({len(t0['ids/emb'])} ids touched in {STEPS} steps)")
    assert max(grown[:2]) < table_bytes / 2, "a trainer grew by half the table: something holds it"
    assert grown[2] > table_bytes, "the local run holds the table; its growth should show it"
    assert traffic[:, 0].max() < table_bytes / 100

    # the pservers' checkpoint shards merge back into the trained rows
    shards = sorted(checkpoint.iterdir())
    assert [p.name for p in shards] == ["emb_0", "emb_1"]
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert cli_main(["merge-table", *map(str, shards), "--height", str(ROWS), "-o", str(tmp_path / "emb.npy")]) == 0
    report = out.getvalue()
    print(report, end="")
    ids = t0["ids/emb"]
    assert f"{len(ids):,} rows from the shards, {ROWS - len(ids):,} never touched" in report
    merged = np.load(tmp_path / "emb.npy")
    assert merged.shape == (ROWS, WIDTH) and np.array_equal(merged[ids], t0["final_rows/emb"])
    untouched = np.ones(ROWS, bool)
    untouched[ids] = False
    assert not merged[untouched].any()


def test_distributed_table_in_float64_every_element_matches_to_1e_5(tmp_path):
    t0, t1, local = train(tmp_path, "--rows", str(ROWS), "--float64")
    check_equal("distributed fp64", t0, t1, local, scaled=False)


def test_distributed_table_trained_by_adam_in_float64_every_element_matches_to_1e_5(tmp_path):
    t0, t1, local = train(tmp_path, "--rows", str(ADAM_ROWS), "--table-optimizer", "adam", "--float64")
    check_equal("adam table fp64", t0, t1, local, scaled=False)


def test_distributed_table_trained_by_adam_in_float32(tmp_path):
    # The table's rows get the same 1e-4-of-the-scale bound as the other float32 table:
    # Adam divides by sqrt(v), so a row whose grads are tiny magnifies float32's different
    # summation order (two half batches summed on a pserver against one batch). How much
    # depends on the BLAS kernel: OpenBLAS's Haswell kernels give 2.5e-6 of the scale,
    # its AVX-512 ones 4.1e-5 (one element of 14,704). The float64 test above is the proof.
    t0, t1, local = train(tmp_path, "--rows", str(ADAM_ROWS), "--table-optimizer", "adam")
    check_equal("adam table fp32", t0, t1, local, table_scale=1e-4)


def test_remote_prefetch_table_in_float64_every_element_matches_to_1e_5(tmp_path):
    t0, t1, local = train(tmp_path, "--rows", "100000", "--variant", "local-table", "--float64")
    check_equal("local-table fp64", t0, t1, local, scaled=False)


def test_remote_prefetch_table_in_float32(tmp_path):
    t0, t1, local = train(tmp_path, "--rows", "100000", "--variant", "local-table")
    check_equal("local-table fp32", t0, t1, local, table_scale=1e-4)


def test_paddle_fixture_with_a_plain_sparse_table_equals_local_training(tmp_path):
    main = PADDLE_PROGRAMS / "ctr_v1_sparse_sgd_2ps" / "main.pb"
    t0, t1, local = train(tmp_path, "--main", str(main))
    check_equal("fixture ctr_v1_sparse_sgd_2ps", t0, t1, local)


def test_bytes_sent_per_step_depend_on_the_batch_s_ids_not_on_the_table_s_size(tmp_path):
    """The same batches against a 10k-row and a 1M-row table send the same bytes (the
    table never crosses the wire), bounded by what the batch's unique ids need: per id
    one grad row and its id to a pserver, and its id in a prefetch request."""
    unique, sent = 100, {}
    for rows in (10_000, ROWS):
        run = tmp_path / f"{rows}"
        launch_script(run, (CTR, "--steps", "3", "--batch", "64", "--quiet", "--rows", str(rows),
                            "--unique-ids", str(unique), "--save", str(run / "params")), pservers=2, trainers=1)
        sent[rows] = np.load(run / "params" / "trainer_0.npz")["traffic"][:, 0]
        print(f"{unique} unique ids, {rows:,}-row table: {sent[rows].mean():,.0f} bytes sent per step")
    # the ids differ with the table's size (id = rank * p % rows): their shards' sizes may too
    assert abs(sent[ROWS].mean() - sent[10_000].mean()) < 0.02 * sent[10_000].mean()
    dense = (48 * 32 + 32 + 32 * 2 + 2) * 4
    assert sent[ROWS].max() < unique * (WIDTH * 4 + 8 + 8) + dense + 4096


def test_id_feeds_carry_lod_and_trainers_split_them_by_example():
    """Both scripts' feeds: ids within the table, LoD sequences per example, and two
    trainers' shares that put the global batch back together."""
    import sys

    sys.path.insert(0, str(EXAMPLES))
    import train_ctr
    import train_program

    from transpiler.runtime.role import TRAINER, Role

    main, _ = train_ctr.build_ctr("distributed", 5000)
    shares = [Role(TRAINER, t, 2, ("a:1", "b:2")) for t in range(2)]
    for batch, split in ((train_ctr.ClickData(main, 0).batch(3, 9), train_ctr.shard),
                         (train_program.synthetic_batch(main, 9, 0, 3), train_program.shard)):
        slot0 = batch["slot0"]
        assert slot0.array.dtype == np.int64 and 0 <= slot0.array.min() and slot0.array.max() < 5000
        assert len(slot0.lod[0]) == 10 and batch["click"].shape == (9, 1)
        halves = [split(batch, role) for role in shares]
        assert [len(h["slot0"].lod[0]) - 1 for h in halves] == [4, 5] and [len(h["click"]) for h in halves] == [4, 5]
        for name in ("slot0", "slot1", "slot2"):
            joined = np.concatenate([h[name].array for h in halves])
            assert np.array_equal(joined, batch[name].array), name
    data = train_ctr.ClickData(main, 0)
    assert all(np.array_equal(a.array if hasattr(a, "array") else a, b.array if hasattr(b, "array") else b)
               for a, b in zip(data.batch(5, 8).values(), data.batch(5, 8).values(), strict=True))  # a pure function
