"""The RPC service through a real gRPC server on loopback: large tensors, interop with a
stock generated stub, prefetch, checkpoints, and the errors a client sees."""

from __future__ import annotations

import socket

import grpc
import numpy as np
import pytest
from rpc_support import running_pserver

from ops.rpc import RpcClient, RpcError
from ops.rpc.checkpoint import Checkpointer, VarSlice
from ops.rpc.errors import BindError
from ops.rpc.server import PServer, ServeConfig
from ops.rpc.tensor_file import read_tensor
from ops.scope import Scope
from ops.tensor import LoDTensor, SelectedRows
from proto import rpc_pb2, rpc_pb2_grpc


def test_a_tensor_above_64_mb_goes_through_a_real_server():
    """gRPC's default receive limit is 4 MB; 64 MiB + 4 bytes must go both ways."""
    big = np.arange(16 * 1024 * 1024 + 1, dtype=np.float32)
    big[::4097] = -1.5
    assert big.nbytes > 64 * 1024 * 1024
    with running_pserver(sync_mode=False) as ps:
        client = ps.client(0)
        client.send(ps.address, "big", LoDTensor(big))
        stored = ps.scope.find_var("big").array
        assert stored.shape == big.shape and np.array_equal(stored, big)
        back = client.get(ps.address, "big").array
        assert back.dtype == np.float32 and np.array_equal(back, big)
        client.complete([ps.address])
        ps.join()
    assert not ps.errors


def test_selected_rows_and_lod_go_through_the_server():
    with running_pserver(sync_mode=False) as ps:
        client = ps.client(0)
        rows = SelectedRows([3, 1], np.ones((2, 4), np.float64), height=6)
        client.send(ps.address, "g", rows)
        got = client.get(ps.address, "g")
        assert isinstance(got, SelectedRows) and got.rows.tolist() == [3, 1] and got.height == 6
        seq = LoDTensor.from_lengths(np.arange(6, dtype=np.int64).reshape(3, 2), [[2, 1]])
        client.send(ps.address, "s", seq)
        assert [level.tolist() for level in client.get(ps.address, "s").lod] == [[0, 2, 3]]


def test_a_stock_generated_stub_speaks_to_the_server():
    with running_pserver(sync_mode=False) as ps:
        with grpc.insecure_channel(ps.address) as channel:
            stub = rpc_pb2_grpc.PServerStub(channel)
            request = rpc_pb2.VariableMessage(
                varname="w", has_value=True, data_type=5, dims=[2, 2], data=np.arange(4, dtype="<f4").tobytes()
            )
            stub.SendVariable(request, timeout=10)
            reply = stub.GetVariable(rpc_pb2.VariableMessage(varname="w"), timeout=10)
            assert list(reply.dims) == [2, 2] and np.frombuffer(reply.data, "<f4").tolist() == [0, 1, 2, 3]
            stub.FetchBarrier(rpc_pb2.BarrierMessage(trainer_id=0), timeout=10)
            stub.SendBatch(rpc_pb2.VarBatch(trainer_id=0, vars=[request], barrier=True), timeout=10)
            batch = stub.FetchBatch(rpc_pb2.FetchRequest(trainer_id=0, varnames=["w"], barrier=True), timeout=10)
            assert [np.frombuffer(v.data, "<f4").tolist() for v in batch.vars] == [[0, 1, 2, 3]]
            stub.SendComplete(rpc_pb2.CompleteMessage(trainer_id=0), timeout=10)
        ps.join()
    assert not ps.errors


def test_prefetch_reads_rows_of_a_dense_or_auto_grown_table():
    scope = Scope()
    scope.set_var("dense", LoDTensor(np.arange(12, dtype=np.float32).reshape(6, 2)))
    table = SelectedRows(np.zeros(0, np.int64), np.zeros((4, 2), np.float32), height=1000,
                         initializer=lambda n: np.full((n, 2), 7.0, np.float32))
    table.value[:] = 5.0
    scope.set_var("table", table)
    with running_pserver(sync_mode=False, scope=scope) as ps:
        client = ps.client(0)
        assert client.prefetch(ps.address, "dense", [4, 0]).array.tolist() == [[8, 9], [0, 1]]
        rows = client.prefetch(ps.address, "table", [900, 3, 900]).array
        assert rows.tolist() == [[5, 5], [5, 5], [5, 5]] and table.rows.tolist() == [900, 3]
        with pytest.raises(RpcError, match="OUT_OF_RANGE"):
            client.prefetch(ps.address, "dense", [6])
        with pytest.raises(RpcError, match="no table 'nope'"):
            client.prefetch(ps.address, "nope", [0])


def test_checkpoint_notify_saves_the_pserver_s_part_into_its_checkpoint_dir(tmp_path):
    scope = Scope()
    scope.set_var("w", LoDTensor(np.ones((2, 3), np.float32)))
    layout = {"w": VarSlice("w", (2, 3))}
    checkpointer = Checkpointer(tmp_path / "root", "ps0", ("ps0",), layout)
    with running_pserver(sync_mode=False, scope=scope, checkpointer=checkpointer) as ps:
        ps.client(0).checkpoint_notify([ps.address], "ckpt-3")
    assert (tmp_path / "root" / "latest").read_text() == "ckpt-3\n"
    assert read_tensor(tmp_path / "root" / "ckpt-3" / "ps0" / "w").tolist() == [[1, 1, 1]] * 2


def test_errors_a_client_sees_name_the_call_the_var_and_the_pserver():
    with running_pserver(sync_mode=False, known_vars=frozenset({"g"})) as ps:
        client = ps.client(0)
        with pytest.raises(RpcError, match=rf"get of nope on pserver {ps.address} failed \(NOT_FOUND\).*has no var 'nope'"):
            client.get(ps.address, "nope")
        with pytest.raises(RpcError, match="trainer 0's send of 'other': the pserver does not receive that var"):
            client.send(ps.address, "other", np.ones(2, np.float32))
        with pytest.raises(RpcError, match="trainer id 5 is out of range for Fanin 1"):
            ps.client(5).fetch_barrier([ps.address])


def test_a_pserver_that_never_comes_is_a_clear_connect_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: nothing answers here
        client = RpcClient(0, timeout=5.0, connect_timeout=0.5)
        with pytest.raises(RpcError, match=rf"trainer 0 cannot reach pserver 127.0.0.1:{port} within 0.5 s"):
            client.get(f"127.0.0.1:{port}", "w")
        client.close()


def test_a_busy_port_is_a_bind_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        server = PServer(ServeConfig(endpoint=f"127.0.0.1:{port}", fanin=1), Scope(), lambda idx: None)
        with pytest.raises(BindError, match=f"cannot listen on 127.0.0.1:{port}: port {port} is in use$"):
            server.start()


def test_the_cli_says_a_busy_port_in_one_line(tmp_path):
    """gRPC's own `add_port.cc` line must not leak before ours."""
    import subprocess
    import sys

    from conftest import PADDLE_PROGRAMS

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        out = tmp_path / "o"
        cli = [sys.executable, "-m", "transpiler"]
        subprocess.run([*cli, "transpile", str(PADDLE_PROGRAMS / "seed_fc3_sgd_3ps" / "main.pb"), "--pservers",
                        f"127.0.0.1:{port}", "--trainers", "1", "-o", str(out)], check=True, capture_output=True)
        stem = f"pserver_127.0.0.1_{port}"
        done = subprocess.run([*cli, "serve", "--program", str(out / f"{stem}.pb"), "--startup",
                               str(out / f"{stem}_startup.pb")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr == f"pstranspile: error: pserver 127.0.0.1:{port}: cannot listen on 127.0.0.1:{port}: port {port} is in use\n"
