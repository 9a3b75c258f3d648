"""proto/rpc.proto: the generated modules are not stale, and the service is what the
runtime expects (the methods, and the field numbers `ops.rpc.wire` writes by hand)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from google.protobuf import descriptor_pb2

from conftest import TESTS
from ops.rpc import wire
from ops.rpc.service import METHODS, SERVICE_NAME
from proto import rpc_pb2

REPO = TESTS.parent


def _normalise(fd: descriptor_pb2.FileDescriptorProto) -> descriptor_pb2.FileDescriptorProto:
    """Drop what a descriptor set has and the embedded descriptor has not (json names,
    source info): the comparison is of what goes on the wire."""
    fd = descriptor_pb2.FileDescriptorProto.FromString(fd.SerializeToString())
    fd.ClearField("source_code_info")
    messages = list(fd.message_type)
    while messages:  # nested types too (a map field's entry)
        message = messages.pop()
        messages.extend(message.nested_type)
        for field in message.field:
            field.ClearField("json_name")
    return fd


def test_generated_modules_are_not_stale(tmp_path):
    pytest.importorskip("grpc_tools")
    out = tmp_path / "fds.bin"
    done = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I.", f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}",
         f"--descriptor_set_out={out}", "proto/rpc.proto"],
        cwd=REPO, capture_output=True, text=True, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "proto" / "rpc_pb2_grpc.py").exists()
    (fresh,) = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    committed = descriptor_pb2.FileDescriptorProto.FromString(rpc_pb2.DESCRIPTOR.serialized_pb)
    assert _normalise(fresh) == _normalise(committed), "proto/rpc_pb2.py is stale: run `make proto`"
    generated = (REPO / "proto" / "rpc_pb2_grpc.py").read_text()
    for method in METHODS:
        assert f"/{SERVICE_NAME}/{method}" in generated, "proto/rpc_pb2_grpc.py is stale: run `make proto`"


def test_the_service_has_the_runtime_s_methods():
    assert SERVICE_NAME == "pstranspiler.rpc.PServer"
    assert sorted(METHODS) == sorted(
        ["SendVariable", "GetVariable", "PrefetchVariable", "SendBarrier", "FetchBarrier", "SendBatch", "FetchBatch",
         "SendFetchBatch",
         "SendComplete", "CheckpointNotify", "Watch",
         "CheckpointPart", "CheckpointList", "CheckpointCommit", "CheckpointRestore"]
    )


def test_hand_written_field_numbers_match_the_proto():
    fields = rpc_pb2.VariableMessage.DESCRIPTOR.fields_by_name
    assert fields["data"].number == wire.DATA_FIELD
    assert fields["rows"].number == wire.ROWS_FIELD
    assert fields["pad"].number == wire.PAD_FIELD
    for name in ("data", "rows", "pad"):
        assert fields[name].type == fields[name].TYPE_BYTES
