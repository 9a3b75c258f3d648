"""Mutated fixture bytes either load (and then verify or fail with `VerifyError`) or raise
`ProgramFormatError` — never another exception.

Hypothesis flips, inserts, deletes and overwrites bytes and truncates the Paddle-built
fixtures. Derandomized with no example database, so CI sees the same inputs every run.
"""

from __future__ import annotations

import warnings

import pytest
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from conftest import PADDLE_PB_FILES
from proto import framework_pb2
from transpiler.errors import ProgramFormatError, VerifyError
from transpiler.ir import Attr, AttrType, Program
from transpiler.ir.printer import dump, dump_json_text
from transpiler.ir.serde import UnknownFieldsWarning
from transpiler.ir.verifier import verify

FIXTURES = {f"{p.parent.name}/{p.name}": p.read_bytes() for p in PADDLE_PB_FILES}
KINDS = ("flip", "insert", "delete", "overwrite", "truncate")

# 300 mutated fixtures, the same ones every run (a failure repeats), however slow the machine.
MUTATED_BYTES = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
mutation = st.tuples(st.sampled_from(KINDS), st.integers(min_value=0, max_value=2**31), st.integers(0, 255))


def mutate(data: bytes, mutations: list[tuple[str, int, int]]) -> bytes:
    buf = bytearray(data)
    for kind, position, value in mutations:
        if not buf:
            buf.append(value)
            continue
        i = position % len(buf)
        if kind == "flip":
            buf[i] ^= 1 << (value % 8)
        elif kind == "insert":
            buf.insert(i, value)
        elif kind == "delete":
            del buf[i]
        elif kind == "overwrite":
            buf[i] = value
        else:
            del buf[i:]
    return bytes(buf)


def check_bytes(data: bytes) -> None:
    """The property: our error, or a program that verifies or says why it does not."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnknownFieldsWarning)
        try:
            program = Program.from_bytes(data)
        except ProgramFormatError:
            return
        try:
            verify(program, name="fuzzed")
        except VerifyError as exc:
            assert exc.headline.startswith("fuzzed")
        dump(program)
        dump_json_text(program, all_attrs=True)
        first = program.to_bytes()
        second = Program.from_bytes(first).to_bytes()
        assert second == first, "to_bytes -> from_bytes -> to_bytes is not stable"


@MUTATED_BYTES
@given(name=st.sampled_from(sorted(FIXTURES)), mutations=st.lists(mutation, min_size=1, max_size=4))
@example(name="fluid18_basic_sgd_2ps/main.pb", mutations=[("truncate", 0, 0)])
@example(name="fluid18_lr_piecewise_2ps/main.pb", mutations=[("flip", 7, 0)])
def test_mutated_bytes_load_or_raise_our_error(name, mutations):
    check_bytes(mutate(FIXTURES[name], mutations))


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_every_prefix_boundary_of_a_fixture_is_handled(name):
    """Truncation at every 97th byte (a deterministic sweep of the truncate mutation)."""
    data = FIXTURES[name]
    for end in range(0, len(data), 97):
        check_bytes(data[:end])


# ---------------------------------------------------------- invalid UTF-8

# One marker per kind of string field a ProgramDesc has; none is a substring of another.
UTF8_FIELDS = {
    "var name": "ZZ01ZZ",
    "var attr name": "ZZ02ZZ",
    "var attr string": "ZZ03ZZ",
    "op type": "ZZ04ZZ",
    "slot name": "ZZ05ZZ",
    "slot argument": "ZZ06ZZ",
    "attr name": "ZZ07ZZ",
    "STRING attr": "ZZ08ZZ",
    "STRINGS attr": "ZZ09ZZ",
    "VAR attr": "ZZ10ZZ",
    "VARS attr": "ZZ11ZZ",
    "op version name": "ZZ12ZZ",
}


def has_invalid_utf8(data: bytes) -> bool:
    """Whether `data` parses and some string field in it is not valid UTF-8 (the regression
    tests below use it to prove their input really is what they claim)."""
    try:
        message = framework_pb2.ProgramDesc.FromString(data)
    except DecodeError:
        return False
    return _bytes_in_strings(message)


def _bytes_in_strings(message) -> bool:
    for field, value in message.ListFields():
        values = value if field.is_repeated else (value,)
        if field.type == FieldDescriptor.TYPE_STRING and any(isinstance(v, bytes) for v in values):
            return True
        if field.type == FieldDescriptor.TYPE_MESSAGE and any(_bytes_in_strings(v) for v in values):
            return True
    return False


def _program_with_markers() -> bytes:
    m = UTF8_FIELDS
    program = Program.empty()
    block = program.global_block()
    var = block.create_var(m["var name"], dtype="float32", shape=[1])
    var.attrs[m["var attr name"]] = Attr.of(m["var attr string"], AttrType.STRING)
    block.add_op(
        m["op type"],
        {m["slot name"]: ["x", m["slot argument"]]},
        {"Out": "y"},
        {
            m["attr name"]: 1,
            "s": m["STRING attr"],
            "ss": ["ok", m["STRINGS attr"]],
            "v": Attr.of(m["VAR attr"], AttrType.VAR),
            "vs": Attr.of([m["VARS attr"]], AttrType.VARS),
        },
    )
    program.op_version_map = {m["op version name"]: 1}
    return program.to_bytes()


@pytest.mark.parametrize("field", sorted(UTF8_FIELDS))
def test_invalid_utf8_in_any_string_field_is_a_format_error(field):
    """proto2 does not check UTF-8 when parsing, and protobuf's Python API then hands back
    `bytes` for the field; loading must say the bytes are bad, not let `bytes` into the IR."""
    data = _program_with_markers()
    marker = UTF8_FIELDS[field].encode()
    assert data.count(marker) == 1
    broken = data.replace(marker, b"\xff" + marker[1:])
    assert has_invalid_utf8(broken)
    with pytest.raises(ProgramFormatError, match="UTF-8"):
        Program.from_bytes(broken)


def test_the_property_rejects_a_foreign_exception(monkeypatch):
    """Guard: an exception that is not ours must fail the property, not pass silently."""

    def broken(data):
        raise KeyError("not ours")

    monkeypatch.setattr(Program, "from_bytes", staticmethod(broken))
    with pytest.raises(KeyError):
        check_bytes(b"")
