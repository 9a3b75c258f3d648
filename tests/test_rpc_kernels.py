"""The trainer's barrier kernels: a `send_barrier` is deferred to the `fetch_barrier` (one
message per pserver for both) only where nothing but `recv`s runs between them."""

from __future__ import annotations

import numpy as np
import pytest

import ops.rpc  # noqa: F401 - registers the RPC kernels
from ops.executor import Executor
from ops.scope import Scope
from ops.tensor import LoDTensor
from transpiler.ir import Program

EP = "127.0.0.1:6170"


class RecordingClient:
    """What the kernels ask of the client, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.early: dict[str, bool] = {}  # name -> the send kernel's `early`

    def send_async(self, endpoint: str, name: str, value, *, merge_add: bool = False, early: bool = False) -> None:
        self.calls.append(("send", endpoint, name))
        self.early[name] = early

    def flush(self) -> None:
        self.calls.append(("flush",))

    def send_barrier(self, endpoints, *, defer: bool = False) -> None:
        self.calls.append(("send_barrier", tuple(endpoints), defer))

    def fetch_barrier(self, endpoints, requests=()) -> list:
        requests = list(requests)
        self.calls.append(("fetch_barrier", tuple(endpoints), tuple(requests)))
        return [LoDTensor(np.zeros(1, np.float32)) for _ in requests]

    def get_many(self, requests) -> list:
        requests = list(requests)
        self.calls.append(("get_many", tuple(requests)))
        return [LoDTensor(np.zeros(1, np.float32)) for _ in requests]

    def receives_early(self) -> bool:  # the fetch barrier waits for its replies (tests/test_early_recv.py)
        return False


def trainer_program(*between: tuple) -> Program:
    """send g, send_barrier, `between`, recv w, fetch_barrier."""
    program = Program.empty()
    block = program.global_block()
    block.add_op("send", {"X": ["g"]}, {}, {"epmap": [EP]})
    block.add_op("send_barrier", {}, {}, {"endpoints": [EP]})
    for op_type, inputs, outputs, attrs in between:
        block.add_op(op_type, inputs, outputs, attrs)
    block.add_op("recv", {}, {"Out": ["w"]}, {"epmap": [EP]})
    block.add_op("fetch_barrier", {}, {}, {"endpoints": [EP]})
    return program


def run_twice(program: Program) -> list[tuple]:
    client = RecordingClient()
    exe = Executor(env={"rpc": client, "trainer_id": 0})
    for _ in range(2):  # the second run reads the memoised answer
        exe.run(program, feed={"g": np.ones(1, np.float32), "x": np.ones(1, np.float32)}, scope=Scope())
    return client.calls


@pytest.mark.parametrize(
    ("between", "deferred"),
    [
        ((), True),
        ((("recv", {}, {"Out": ["v"]}, {"epmap": [EP]}),), True),
        ((("scale", {"X": ["x"]}, {"Out": ["y"]}, {"scale": 2.0}),), False),
    ],
    ids=["nothing between", "another recv between", "a compute op between"],
)
def test_the_send_barrier_is_deferred_only_when_recvs_alone_lead_to_the_fetch_barrier(between, deferred):
    calls = run_twice(trainer_program(*between))
    barriers = [call for call in calls if call[0] == "send_barrier"]
    assert barriers == [("send_barrier", (EP,), deferred)] * 2
    fetches = [call for call in calls if call[0] == "fetch_barrier"]
    assert len(fetches) == 2 and all((EP, "w") in call[2] for call in fetches)


def test_a_send_barrier_without_a_fetch_barrier_after_it_is_not_deferred():
    program = Program.empty()
    block = program.global_block()
    block.add_op("send", {"X": ["g"]}, {}, {"epmap": [EP]})
    block.add_op("send_barrier", {}, {}, {"endpoints": [EP]})
    block.add_op("recv", {}, {"Out": ["w"]}, {"epmap": [EP]})
    calls = run_twice(program)
    assert [call for call in calls if call[0] == "send_barrier"] == [("send_barrier", (EP,), False)] * 2


def test_a_send_may_go_early_only_when_a_send_barrier_follows_it():
    """Early sends (`RpcClient.send_async(early=True)`) are for a sync step: a `send` with a
    `send_barrier` after it; an async `send` (no barrier) keeps its queue-and-flush."""
    client = RecordingClient()
    exe = Executor(env={"rpc": client, "trainer_id": 0})
    program = trainer_program()
    exe.run(program, feed={"g": np.ones(1, np.float32)}, scope=Scope())
    assert client.early == {"g": True}
    async_program = Program.empty()
    async_program.global_block().add_op("send", {"X": ["g"]}, {}, {"epmap": [EP]})
    client.early.clear()
    exe.run(async_program, feed={"g": np.ones(1, np.float32)}, scope=Scope())
    assert client.early == {"g": False} and client.calls[-1] == ("flush",)
