"""`pstranspile fetch` (whole params out of running pservers or a checkpoint, as Fluid
LoDTensor files), `Session.pull`, and `serve`'s checkpoint options' usage errors."""

from __future__ import annotations

import numpy as np
from sparse_table_support import serving_ctr

from ops.rpc.checkpoint import Checkpointer, VarSlice
from ops.rpc.tensor_file import read_tensor
from ops.scope import Scope
from ops.tensor import LoDTensor
from transpiler.cli import main

ERROR = "pstranspile: error: "


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_fetch_from_a_checkpoint_writes_every_whole_var(capsys, tmp_path):
    w = np.arange(12, dtype=np.float32).reshape(6, 2)
    for i, (start, end) in enumerate(((0, 4), (4, 6))):
        scope = Scope()
        scope.set_var(f"w.block{i}", LoDTensor(w[start:end]))
        layout = {f"w.block{i}": VarSlice("w", (6, 2), (start, end))}
        Checkpointer(tmp_path / "ck", f"ps{i}", ("ps0", "ps1"), layout).save(scope, "ckpt-7")
    code, out, err = run(capsys, "fetch", "--checkpoint", tmp_path / "ck", "-o", tmp_path / "out")
    assert (code, err) == (0, "") and "from checkpoint step 7" in out.splitlines()[0]
    assert np.array_equal(read_tensor(tmp_path / "out" / "w"), w)


def test_fetch_from_running_pservers_assembles_blocks_and_table_rows(capsys, tmp_path):
    with serving_ctr() as ps:
        (tmp_path / "plan.json").write_text(ps.result.plan.to_json_text())
        ids = np.array([3, 10, 11, 998], np.int64)
        client = ps.client()
        for i, endpoint in enumerate(ps.endpoints):
            client.prefetch(endpoint, "emb", ids[ids % 2 == i])
        code, out, err = run(capsys, "fetch", "--plan", tmp_path / "plan.json", "-o", tmp_path / "out")
        assert (code, err) == (0, ""), err
        plan = ps.result.plan
        for param in plan.params:
            blocks = [ps.scopes[ep].find_var(b.name).array for b, ep in zip(param.blocks, param.endpoints, strict=True)]
            assert np.array_equal(read_tensor(tmp_path / "out" / param.param), np.concatenate(blocks)), param.param
        table = read_tensor(tmp_path / "out" / "emb")
        assert table.shape == tuple(plan.table.shape)
        for i, endpoint in enumerate(ps.endpoints):
            shard = ps.scopes[endpoint].find_var("emb")
            assert np.array_equal(table[shard.rows], shard.active_value())
        assert not table[[0, 1, 2]].any()  # never touched


def test_fetch_and_serve_usage_errors(capsys, tmp_path):
    code, _, err = run(capsys, "fetch", "-o", tmp_path / "o")
    assert code == 2 and err.startswith(ERROR + "give --plan")
    code, _, err = run(capsys, "fetch", "--checkpoint", tmp_path, "-o", tmp_path / "o")
    assert code == 2 and "no complete checkpoint" in err
    code, _, err = run(capsys, "serve", "--program", "p.pb", "--startup", "s.pb", "--restore", str(tmp_path))
    assert code == 2 and "need --plan plan.json" in err


def test_serve_checkpoints_into_its_dir_and_restores_from_it(tmp_path):
    """`pstranspile serve --plan --checkpoint-dir`, then `serve --restore` of another
    program's startup values: the restored pserver serves the checkpoint's values."""
    import sys
    import threading

    from e2e_support import EXAMPLES

    from ops.rpc import RpcClient
    from transpiler.api import transpile
    from transpiler.runtime.launch import free_endpoints

    sys.path.insert(0, str(EXAMPLES))
    import seed_fc3

    endpoint = free_endpoints(1)[0]
    result = transpile(*seed_fc3.build(), pservers=[endpoint], trainers=1)
    main_pb, startup_pb = tmp_path / "ps.pb", tmp_path / "ps_startup.pb"
    result.pservers[endpoint][0].save(main_pb)
    result.pservers[endpoint][1].save(startup_pb)
    (tmp_path / "plan.json").write_text(result.plan.to_json_text())
    param = next(p.param for p in result.plan.params if len(p.shape) == 2)  # a weight: drawn at random

    def serve(*extra, seed):
        codes = []
        argv = ["serve", "--program", main_pb, "--startup", startup_pb, "--plan", tmp_path / "plan.json",
                "--timeout", "30", "--seed", seed, *extra]
        thread = threading.Thread(target=lambda: codes.append(main([str(a) for a in argv])), daemon=True)
        thread.start()
        client = RpcClient(0, timeout=30)
        try:
            value = client.get(endpoint, param).array.copy()  # round 0: the startup's (or the restored) values
            client.fetch_barrier([endpoint])
            if "--checkpoint-dir" in extra:
                client.checkpoint_notify([endpoint], "ckpt-0")
            client.complete([endpoint])
        finally:
            client.close()
        thread.join(30)
        return codes, value

    codes, saved = serve("--checkpoint-dir", tmp_path / "ck", seed=1)
    assert codes == [0] and (tmp_path / "ck" / "latest").read_text() == "ckpt-0\n"
    codes, other = serve(seed=2)
    assert codes == [0] and not np.array_equal(other, saved)  # another seed, other initial values
    codes, restored = serve("--restore", tmp_path / "ck", seed=2)
    assert codes == [0] and np.array_equal(restored, saved)
