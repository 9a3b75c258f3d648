"""transpiler/replay.py: a trainer program's RPC ops as the kernels run them, and a replay
against real pservers."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import PADDLE_PROGRAMS
from transpiler.api import transpile
from transpiler.errors import TranspileError
from transpiler.ir import Program
from transpiler.replay import grad_values, rpc_ops, sparse_replay


def _mlp(trainer_id: int = 0):
    folder = PADDLE_PROGRAMS / "mlp_adam_2ps"
    return transpile(Program.load(folder / "main.pb"), Program.load(folder / "startup.pb"),
                     pservers=["127.0.0.1:6170", "127.0.0.1:6171"], trainers=2, trainer_id=trainer_id)


def test_rpc_ops_send_every_grad_block_and_fetch_every_param_block():
    result = _mlp(1)
    ops = rpc_ops(result.trainer)
    plan = result.plan
    blocks = [(ep, param.grad_block_name(block.index), block) for param in plan.params
              for block, ep in zip(param.blocks, param.endpoints, strict=True)]
    assert sorted((ep, name) for ep, name, *_ in ops.sends) == sorted(
        (ep, f"{name}.trainer_1") for ep, name, _ in blocks)
    assert sorted(ops.recvs) == sorted((ep, block.name) for ep, _, block in blocks)
    assert ops.send_barrier == ops.fetch_barrier == ["127.0.0.1:6170", "127.0.0.1:6171"]
    values = grad_values(result.trainer, ops)
    declared = result.trainer.global_block().vars
    for (_, _, value), (_, _, var_name, _) in zip(values, ops.sends, strict=True):
        assert value.dtype == np.float32 and list(value.shape) == [int(d) for d in declared[var_name].shape]
    assert sum(v.size for _, _, v in values) == sum(int(np.prod(p.shape)) for p in plan.params)
    first = rpc_ops(result.trainer_startup)
    assert first.fetch_barrier and not first.sends


def test_rpc_ops_refuse_a_sparse_table():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import train_ctr

    main, startup = train_ctr.build_ctr("local-table", 1000, 8)
    result = transpile(main, startup, pservers=["127.0.0.1:6170", "127.0.0.1:6171"], trainers=2)
    with pytest.raises(TranspileError, match="only dense traffic is replayed"):
        rpc_ops(result.trainer)


def _ctr(rows: int = 1000, width: int = 8, trainer_id: int = 0, variant: str = "local-table"):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import train_ctr

    main, startup = train_ctr.build_ctr(variant, rows, width)
    return transpile(main, startup, pservers=["127.0.0.1:6170", "127.0.0.1:6171"], trainers=2, trainer_id=trainer_id)


def test_sparse_replay_keeps_the_rpc_ops_and_the_table_grad_s_plumbing_only():
    result = _ctr(trainer_id=1)
    replayed = sparse_replay(result.trainer)
    kept = [op.type for op in replayed.program.global_block().ops]
    full = [op.type for op in result.trainer.global_block().ops]
    wanted = {"distributed_lookup_table", "send", "send_barrier", "recv", "fetch_barrier", "lookup_table_grad", "sum",
              "split_selected_rows"}
    assert kept == [t for t in full if t in wanted]  # in the trainer's order, nothing else
    assert kept.count("lookup_table_grad") == 3 and "mul_grad" not in kept and "mul" not in kept
    assert replayed.id_slots == ["slot0", "slot1", "slot2"] and replayed.width == 8
    # the compute replaced: the lookups' output grads per step, the dense grads sent, at their declared shapes
    assert sorted(g for g, _ in replayed.grad_of_lookups) == [f"embedding_{i}.tmp_0@GRAD" for i in range(3)]
    declared = result.trainer.global_block().vars
    sent = {n for op in result.trainer.global_block().ops if op.type == "send" for n in op.input("X")}
    assert set(replayed.dense_grads) == {n for n in sent if n.startswith("ctr_")}
    for name, value in replayed.dense_grads.items():
        assert name.endswith(".trainer_1") and list(value.shape) == [int(d) for d in declared[name].shape]
    # a step's feeds: the batch's ids as they are, a grad row per id (the LoD kept)
    from ops.tensor import LoDTensor

    ids = LoDTensor.from_lengths(np.array([[3], [5], [3], [900]], np.int64), [[2, 1, 1]])
    feed = replayed.feed({"slot0": ids, "slot1": ids, "slot2": ids, "click": np.zeros((3, 1), np.int64)})
    assert "click" not in feed and feed["slot0"] is ids
    grad = feed["embedding_0.tmp_0@GRAD"]
    assert grad.array.shape == (4, 8) and grad.array.dtype == np.float32 and grad.lod[0].tolist() == [0, 2, 3, 4]


def test_sparse_replay_of_the_distributed_table_keeps_its_id_split_and_prefetch():
    replayed = sparse_replay(_ctr(variant="distributed").trainer)
    assert [op.type for op in replayed.program.global_block().ops] == (
        ["split_ids", "prefetch"] + ["send"] * 4 + ["lookup_table_grad"] * 3
        + ["sum", "split_ids", "send", "send_barrier"] + ["recv"] * 4 + ["fetch_barrier"])
    assert replayed.id_slots == ["slot0", "slot1", "slot2"] and len(replayed.dense_grads) == 4


def test_sparse_replay_refuses_a_program_without_a_prefetched_table():
    with pytest.raises(TranspileError, match="prefetches no table"):
        sparse_replay(_mlp().trainer)


@pytest.mark.parametrize("variant", ["local-table", "distributed"])
def test_a_replayed_ctr_job_sends_and_receives_what_the_real_job_does(tmp_path, variant):
    """`train_ctr.py --replay` against real pservers: trainer 0's bytes sent and received,
    step by step (the prefetched rows, the SelectedRows grads of the batch's ids, the dense
    grads and params), equal the real job's; no loss is computed."""
    import re

    from e2e_support import EXAMPLES, launch_script

    traffic = {}
    for mode in ("job", "replay"):
        args = (str(EXAMPLES / "train_ctr.py"), "--variant", variant, "--rows", "5000", "--width", "8",
                "--steps", "4", "--batch", "32") + (("--replay",) if mode == "replay" else ())
        launch_script(tmp_path / mode, args, pservers=2, trainers=2)
        log = (tmp_path / mode / "logs" / "trainer.0.log").read_text()
        traffic[mode] = re.findall(r"\[progress\] trainer=0 step=(\d+)( loss=\S+)? .*sent=(\d+) recv=(\d+)", log)
    assert [(s, b, r) for s, _, b, r in traffic["replay"]] == [(s, b, r) for s, _, b, r in traffic["job"]]
    assert [t[0] for t in traffic["job"]] == ["1", "2", "3", "4"]
    assert all(t[1] for t in traffic["job"]) and not any(t[1] for t in traffic["replay"])
