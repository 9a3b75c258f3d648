"""transpiler/replay.py: a trainer program's RPC ops as the kernels run them, and a replay
against real pservers."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import PADDLE_PROGRAMS
from transpiler.api import transpile
from transpiler.errors import TranspileError
from transpiler.ir import Program
from transpiler.replay import grad_values, rpc_ops


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
