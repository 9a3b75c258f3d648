"""Our framework.proto is Paddle 2.6's, field for field, and framework_pb2.py is not stale.

Wire compatibility rests on every field's number, type, label and default matching
Paddle's; only the package name is ours. `framework_desc.bin` is Paddle 2.6's own
serialized `FileDescriptorProto`. The staleness test compiles proto/framework.proto
with protoc and compares descriptors (not file text, so another protoc version that
writes the module differently still passes).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from google.protobuf import descriptor_pb2

from conftest import PADDLE_PROGRAMS, TESTS
from proto import framework_pb2

REPO = TESTS.parent
PADDLE_PACKAGE = "paddle.framework.proto"
OUR_PACKAGE = "pstranspiler.framework"

Field = descriptor_pb2.FieldDescriptorProto


def _paddle() -> descriptor_pb2.FileDescriptorProto:
    return descriptor_pb2.FileDescriptorProto.FromString((PADDLE_PROGRAMS / "framework_desc.bin").read_bytes())


def _ours() -> descriptor_pb2.FileDescriptorProto:
    return descriptor_pb2.FileDescriptorProto.FromString(framework_pb2.DESCRIPTOR.serialized_pb)


def _local_type(type_name: str, package: str) -> str:
    """`.paddle.framework.proto.VarType.Type` -> `VarType.Type`."""
    prefix = f".{package}."
    assert type_name.startswith(prefix), f"{type_name!r} is not in package {package}"
    return type_name[len(prefix):]


def _messages(fd) -> dict[str, descriptor_pb2.DescriptorProto]:
    """Every message, nested ones included, by dotted name."""
    found = {}

    def walk(messages, prefix):
        for message in messages:
            name = prefix + message.name
            found[name] = message
            walk(message.nested_type, name + ".")

    walk(fd.message_type, "")
    return found


def _enums(fd) -> dict[str, descriptor_pb2.EnumDescriptorProto]:
    found = {e.name: e for e in fd.enum_type}
    for name, message in _messages(fd).items():
        for enum in message.enum_type:
            found[f"{name}.{enum.name}"] = enum
    return found


def _field_facts(field: Field, package: str) -> dict:
    return {
        "number": field.number,
        "type": Field.Type.Name(field.type),
        "label": Field.Label.Name(field.label),
        "default": field.default_value if field.HasField("default_value") else None,
        "type_name": _local_type(field.type_name, package) if field.type_name else None,
        "oneof_index": field.oneof_index if field.HasField("oneof_index") else None,
        "packed": field.options.packed if field.options.HasField("packed") else None,
        "extendee": field.extendee or None,
    }


def test_packages_differ_and_syntax_matches():
    paddle, ours = _paddle(), _ours()
    assert paddle.package == PADDLE_PACKAGE
    assert ours.package == OUR_PACKAGE
    assert ours.syntax == paddle.syntax  # "" is proto2 in both
    assert list(ours.dependency) == list(paddle.dependency) == []
    assert not ours.extension and not paddle.extension
    assert not ours.service and not paddle.service


def test_same_enums_and_values():
    paddle, ours = _enums(_paddle()), _enums(_ours())
    assert sorted(ours) == sorted(paddle)
    for name, enum in paddle.items():
        theirs = [(v.name, v.number) for v in enum.value]
        mine = [(v.name, v.number) for v in ours[name].value]
        assert mine == theirs, f"enum {name} differs"
        assert list(ours[name].reserved_name) == list(enum.reserved_name)
        assert [(r.start, r.end) for r in ours[name].reserved_range] == [(r.start, r.end) for r in enum.reserved_range]


def test_same_messages():
    paddle, ours = _messages(_paddle()), _messages(_ours())
    assert sorted(ours) == sorted(paddle)
    # Spot-check that nested messages were walked.
    assert {"OpDesc.Attr", "VarType.LoDTensorDesc", "OpVersionMap.OpVersionPair"} <= set(paddle)


@pytest.mark.parametrize("message_name", sorted(_messages(_paddle())))
def test_message_fields_match_field_by_field(message_name):
    paddle = _messages(_paddle())[message_name]
    ours = _messages(_ours())[message_name]
    their_fields = {f.name: _field_facts(f, PADDLE_PACKAGE) for f in paddle.field}
    our_fields = {f.name: _field_facts(f, OUR_PACKAGE) for f in ours.field}
    assert sorted(our_fields) == sorted(their_fields), f"{message_name}: field names differ"
    for name, facts in their_fields.items():
        assert our_fields[name] == facts, f"{message_name}.{name} differs"
    assert [(r.start, r.end) for r in ours.reserved_range] == [(r.start, r.end) for r in paddle.reserved_range]
    assert list(ours.reserved_name) == list(paddle.reserved_name)
    assert [(r.start, r.end) for r in ours.extension_range] == [(r.start, r.end) for r in paddle.extension_range]
    assert [o.name for o in ours.oneof_decl] == [o.name for o in paddle.oneof_decl]


def test_program_desc_keeps_paddles_reserved_fields():
    (program_desc,) = [m for m in _ours().message_type if m.name == "ProgramDesc"]
    assert [(r.start, r.end) for r in program_desc.reserved_range] == [(2, 3), (3, 4)]


def test_the_comparison_can_fail():
    """A changed default must be caught (guards against a comparison that compares nothing)."""
    paddle = _messages(_paddle())["BlockDesc"]
    (field,) = [f for f in paddle.field if f.name == "forward_block_idx"]
    changed = Field()
    changed.CopyFrom(field)
    changed.default_value = "0"
    assert _field_facts(changed, PADDLE_PACKAGE) != _field_facts(field, PADDLE_PACKAGE)


# ----------------------------------------------------------------- staleness


def _normalise(fd: descriptor_pb2.FileDescriptorProto) -> descriptor_pb2.FileDescriptorProto:
    """Drop what differs between protoc's descriptor set and the embedded descriptor but
    not on the wire: json names (protoc adds them to descriptor sets only) and source info."""
    fd = descriptor_pb2.FileDescriptorProto.FromString(fd.SerializeToString())
    fd.ClearField("source_code_info")

    def strip(messages):
        for message in messages:
            for field in message.field:
                field.ClearField("json_name")
            strip(message.nested_type)

    strip(fd.message_type)
    return fd


def test_generated_module_is_not_stale(tmp_path):
    pytest.importorskip("grpc_tools")
    out = tmp_path / "fds.bin"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I.",
            f"--python_out={tmp_path}",
            f"--descriptor_set_out={out}",
            "proto/framework.proto",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "proto" / "framework_pb2.py").exists()
    compiled = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    (fresh,) = compiled.file
    committed = _normalise(_ours())
    fresh = _normalise(fresh)
    assert fresh.name == committed.name == "proto/framework.proto"
    assert fresh == committed, "proto/framework_pb2.py is stale: run `make proto` and commit the result"
