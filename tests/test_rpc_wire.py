"""Tensors on the wire: round trips of every dtype, LoD, SelectedRows, non-contiguous
and big-endian arrays; zero-copy, aligned receive; bytes any protobuf reader accepts;
clear errors for broken messages."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ops.rpc import wire
from ops.rpc.wire import COPY_BELOW, WireError, decode_batch, decode_var, encode_batch, encode_var, var_parts
from ops.tensor import LoDTensor, SelectedRows
from proto import rpc_pb2

DTYPES = ["float32", "float64", "float16", "int64", "int32", "int16", "int8", "uint8", "bool"]


def roundtrip(value, **kwargs):
    return decode_var(encode_var("v", value, **kwargs))


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_round_trips(dtype):
    array = (np.arange(24) % 7).astype(dtype).reshape(2, 3, 4)
    got = roundtrip(LoDTensor(array)).value
    assert got.array.dtype == array.dtype and got.array.shape == (2, 3, 4)
    np.testing.assert_array_equal(got.array, array)


def test_lod_and_request_fields_round_trip():
    value = LoDTensor.from_lengths(np.arange(10, dtype=np.float32).reshape(5, 2), [[2, 1], [1, 1, 3]])
    got = roundtrip(value, trainer_id=3, merge_add=True)
    assert got.name == "v" and got.trainer_id == 3 and got.merge_add
    assert [level.tolist() for level in got.value.lod] == [[0, 2, 3], [0, 1, 2, 5]]
    np.testing.assert_array_equal(got.value.array, value.array)


def test_selected_rows_round_trip_with_rows_and_height():
    value = SelectedRows([7, 2, 7], np.arange(6, dtype=np.float32).reshape(3, 2), height=10)
    got = roundtrip(value).value
    assert isinstance(got, SelectedRows) and got.height == 10
    assert got.rows.tolist() == [7, 2, 7]
    np.testing.assert_array_equal(got.to_dense(), value.to_dense())


def test_an_auto_grown_table_travels_without_its_spare_capacity():
    table = SelectedRows([4, 9], np.ones((5, 3), np.float32), height=100)  # 5 slots, 2 used
    got = roundtrip(table).value
    assert got.value.shape == (2, 3) and got.rows.tolist() == [4, 9]


def test_empty_selected_rows_and_empty_and_scalar_tensors():
    got = roundtrip(SelectedRows.empty(8, (3,))).value
    assert got.rows.size == 0 and got.value.shape == (0, 3) and got.height == 8
    assert roundtrip(np.zeros((0, 4), np.float32)).value.array.shape == (0, 4)
    scalar = roundtrip(np.array(2.5, np.float64)).value.array
    assert scalar.shape == () and scalar == 2.5


def test_non_contiguous_views_are_sent_by_value():
    base = np.arange(60, dtype=np.float32).reshape(6, 10)
    for view in (base.T, base[:, ::3], base[::2], base[1:4, 2:5]):
        assert not view.flags.c_contiguous or view is base
        np.testing.assert_array_equal(roundtrip(LoDTensor(view)).value.array, view)


def test_big_endian_arrays_arrive_as_the_same_numbers():
    array = np.arange(6, dtype=">f4").reshape(2, 3)
    got = roundtrip(array).value.array
    np.testing.assert_array_equal(got, array.astype("<f4"))


def test_receive_is_zero_copy_read_only_and_aligned():
    array = np.random.default_rng(0).standard_normal((3000, 7)).astype(np.float32)  # 84 kB: over COPY_BELOW
    data = encode_var("v", array)
    assert len(data) > COPY_BELOW
    got = decode_var(data).value.array
    assert np.shares_memory(got, np.frombuffer(data, np.uint8)) and np.array_equal(got, array)
    assert not got.flags.writeable and got.flags.aligned
    # `data` starts 64-byte aligned inside the message.
    offset = got.ctypes.data - np.frombuffer(data, np.uint8).ctypes.data
    assert offset % 64 == 0


def test_a_small_message_is_parsed_whole_and_its_arrays_copied_read_only():
    array = np.random.default_rng(1).standard_normal((300, 7)).astype(np.float32)  # 8 kB
    data = encode_var("v", array)
    got = decode_var(data).value.array
    assert np.array_equal(got, array) and not np.shares_memory(got, np.frombuffer(data, np.uint8))
    assert not got.flags.writeable and got.flags.aligned


@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_messages_either_side_of_the_copy_threshold_decode_the_same(delta):
    head = len(encode_var("v", np.zeros(0, np.uint8)))  # everything but the data and its pad
    for size in range(COPY_BELOW + delta - head - 80, COPY_BELOW + delta - head + 1):
        data = encode_var("v", np.arange(size, dtype=np.uint8))
        if len(data) == COPY_BELOW + delta:
            break
    else:
        pytest.fail("no size gives a message of that length")
    got = decode_var(data).value.array
    assert np.array_equal(got, np.arange(size, dtype=np.uint8)) and not got.flags.writeable
    assert np.shares_memory(got, np.frombuffer(data, np.uint8)) == (len(data) >= COPY_BELOW)
    batch = decode_batch(encode_batch([var_parts("v", got)]))
    assert np.array_equal(batch.vars[0].value.array, got)


def test_any_protobuf_reader_parses_our_bytes_and_we_parse_theirs():
    value = LoDTensor.from_lengths(np.arange(6, dtype=np.int64).reshape(3, 2), [[1, 2]])
    message = rpc_pb2.VariableMessage.FromString(encode_var("x", value, trainer_id=1))
    assert message.varname == "x" and message.trainer_id == 1 and list(message.dims) == [3, 2]
    assert message.data_type == 3 and np.frombuffer(message.data, "<i8").tolist() == list(range(6))
    theirs = rpc_pb2.VariableMessage(
        varname="y", has_value=True, kind=rpc_pb2.SELECTED_ROWS, data_type=5, dims=[2, 2], height=9,
        rows=np.array([1, 8], "<i8").tobytes(), data=np.arange(4, dtype="<f4").tobytes(),
    ).SerializeToString()
    got = decode_var(theirs)
    assert got.name == "y" and got.value.rows.tolist() == [1, 8] and got.value.value.tolist() == [[0, 1], [2, 3]]


@pytest.mark.parametrize("big", [False, True])
def test_a_batch_round_trips_zero_copy_aligned_and_any_protobuf_reader_parses_it(big):
    arrays = [np.arange(20000 if big else 5, dtype=np.float32), np.ones((3, 7), np.float64), np.arange(2, dtype=np.int64)]
    data = encode_batch([var_parts(f"v{i}", a, trainer_id=3) for i, a in enumerate(arrays)], trainer_id=3, barrier=True)
    assert (len(data) >= COPY_BELOW) == big
    batch = decode_batch(data)
    assert batch.trainer_id == 3 and batch.barrier and [v.name for v in batch.vars] == ["v0", "v1", "v2"]
    base = np.frombuffer(data, np.uint8).ctypes.data
    for var, array in zip(batch.vars, arrays, strict=True):
        assert np.array_equal(var.value.array, array) and not var.value.array.flags.writeable
    first = batch.vars[0].value.array  # over COPY_BELOW it is a view of the message, aligned
    assert np.shares_memory(first, np.frombuffer(data, np.uint8)) == big
    assert not big or (first.ctypes.data - base) % 64 == 0
    theirs = rpc_pb2.VarBatch.FromString(data)
    assert theirs.trainer_id == 3 and theirs.barrier and [v.varname for v in theirs.vars] == ["v0", "v1", "v2"]
    empty = rpc_pb2.VarBatch(trainer_id=-1).SerializeToString()
    assert decode_batch(empty).trainer_id == -1 and decode_batch(encode_batch([], trainer_id=-1)).vars == ()


def test_a_send_fetch_batch_carries_the_names_to_fetch_and_the_fetch_barrier_both_ways():
    data = encode_batch([var_parts("g", np.ones(4, np.float32), trainer_id=1)], trainer_id=1, barrier=True,
                        fetch=["w@0", "b"], fetch_barrier=True)
    batch = decode_batch(data)
    assert batch.fetch == ("w@0", "b") and batch.fetch_barrier and batch.barrier and batch.vars[0].name == "g"
    assert (batch.vars[0].value.array.ctypes.data - np.frombuffer(data, np.uint8).ctypes.data) % 64 == 0
    theirs = rpc_pb2.VarBatch.FromString(data)
    assert list(theirs.fetch) == ["w@0", "b"] and theirs.fetch_barrier and theirs.vars[0].varname == "g"
    ours = decode_batch(rpc_pb2.VarBatch(trainer_id=0, fetch=["é"], fetch_barrier=False).SerializeToString())
    assert ours.fetch == ("é",) and not ours.fetch_barrier
    assert decode_batch(encode_batch([])).fetch == () and not decode_batch(encode_batch([])).fetch_barrier
    with pytest.raises(WireError, match="UTF-8"):
        decode_batch(b"\x22\x01\xff")  # field 4, one byte that is not UTF-8


def test_a_request_without_a_value():
    got = decode_var(encode_var("w", trainer_id=2, table_name="t"))
    assert got.value is None and got.trainer_id == 2 and got.table_name == "t"


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (encode_var("v", np.ones(4, np.float32))[:-3], "truncated"),
        (encode_var("v", np.ones(40000, np.float32))[:-3], "truncated"),
        (rpc_pb2.VariableMessage(varname="v", has_value=True, data_type=5, dims=[3], data=b"\0" * 8).SerializeToString(),
         "8 data bytes"),
        (rpc_pb2.VariableMessage(varname="v", has_value=True, data_type=77).SerializeToString(), "unknown data_type"),
        (b"\x0f\x00", "wire type"),
        (rpc_pb2.VariableMessage(varname="v", has_value=True, data_type=5, dims=[2, 1], data=b"\0" * 8,
                                 lod=[rpc_pb2.LoDLevel(offsets=[0, 5])]).SerializeToString(), "LoD"),
    ],
)
def test_broken_messages_are_wire_errors(data, match):
    with pytest.raises(WireError, match=match):
        decode_var(data)


def test_values_that_cannot_travel_are_wire_errors():
    with pytest.raises(WireError, match="only LoDTensor"):
        encode_var("v", [1, 2, 3])
    with pytest.raises(WireError, match="no Paddle equivalent"):
        encode_var("v", np.array(["a"]))


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(dtype=st.sampled_from([np.float32, np.float64, np.int64, np.int32, np.uint8]),
                  shape=hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)))
def test_round_trip_property(array):
    got = roundtrip(array).value.array
    assert got.dtype == array.dtype and got.shape == array.shape
    np.testing.assert_array_equal(got, array)


def test_the_hand_walk_stops_at_a_bounded_number_of_fields():
    """A message over COPY_BELOW is walked in Python: its time must not be the sender's
    choice. 40,000 one-byte flags (each a field) before the data, or a batch of names to
    fetch past the caller's bound, are refused as soon as the count passes."""
    flags = b"\x48\x01" * 40_000  # field 9 (merge_add), varint 1
    data = flags + encode_var("v", np.zeros(COPY_BELOW // 4, np.float32))
    assert 40_000 > wire.MAX_VAR_FIELDS and len(data) > COPY_BELOW
    with pytest.raises(WireError, match="more than 4096 fields"):
        decode_var(data)
    batch = encode_batch([], fetch=[f"name{i:07d}" for i in range(10_000)])
    assert len(batch) > COPY_BELOW and len(decode_batch(batch).fetch) == 10_000
    with pytest.raises(WireError, match="more than 100 fields"):
        decode_batch(batch, max_fields=100)
