"""Helpers the Paddle-fixture tests share (no tests here): transpile a case folder of
tests/fixtures/paddle_programs with its case.json's arguments, and compare the result with
what Paddle's own transpiler made (expected.json), one comparison a function.

Each comparison asserts; the test modules say which apply to which case (and why a case
deviates). `COMPARISONS` names them all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from conftest import PADDLE_PROGRAMS, load_case_json
from transpiler.api import TranspileResult, transpile
from transpiler.ir import Op, Program

RPC_KINDS = ("recv", "send", "split_byref", "split_selected_rows", "split_ids", "prefetch", "merge_ids")


def run_case(name: str) -> tuple[TranspileResult, dict, dict]:
    """Our transpile of case `name` (verified), Paddle's expected.json, and case.json;
    gradient clips on the trainers (`clip_mode="trainer"`), as Paddle's transpiler keeps them."""
    case_dir = PADDLE_PROGRAMS / name
    case, expected = load_case_json(case_dir)
    result = transpile(
        Program.load(case_dir / "main.pb"),
        Program.load(case_dir / "startup.pb"),
        pservers=case["pservers"],
        trainers=case["trainers"],
        trainer_id=case["trainer_id"],
        sync_mode=case["sync_mode"],
        slice_var_up=case["slice_var_up"],
        split_method=case["split_method"],
        min_block_size=case["min_block_size"],
        clip_mode="trainer",
        verify=True,
    )
    return result, expected, case


def op_types(block) -> list[str]:
    return [op.type for op in block.ops]


def expected_types(block: dict) -> list[str]:
    return [op["type"] for op in block["ops"]]


def compare_trainer_op_sequence(result: TranspileResult, expected: dict) -> None:
    assert op_types(result.trainer.global_block()) == expected_types(expected["trainer"][0])


def compare_trainer_startup_op_sequence(result: TranspileResult, expected: dict) -> None:
    assert op_types(result.trainer_startup.global_block()) == expected_types(expected["trainer_startup"][0])


def compare_pserver_blocks(result: TranspileResult, expected: dict) -> None:
    assert list(result.pservers) == list(expected["pservers"])
    for endpoint, (main, _) in result.pservers.items():
        want = expected["pservers"][endpoint]["main"]
        assert [op_types(b) for b in main.blocks] == [expected_types(b) for b in want], endpoint


def compare_pserver_vars_and_shapes(result: TranspileResult, expected: dict) -> None:
    for endpoint, (main, startup) in result.pservers.items():
        for program, key in ((main, "main"), (startup, "startup")):
            want = expected["pservers"][endpoint][key][0]["vars"]
            ours = {n: list(v.shape) for n, v in program.global_block().vars.items() if v.shape is not None}
            theirs = {n: v["shape"] for n, v in want.items() if v["shape"] is not None}
            assert ours == theirs, (endpoint, key)
            assert set(program.global_block().vars) == set(want), (endpoint, key)


def compare_pserver_startup_ops(result: TranspileResult, expected: dict) -> None:
    for endpoint, (_, startup) in result.pservers.items():
        ours = [(op.type, list(op.output("Out"))) for op in startup.global_block().ops]
        theirs = [(op["type"], op["outputs"]["Out"]) for op in expected["pservers"][endpoint]["startup"][0]["ops"]]
        assert ours == theirs, endpoint
        for op in startup.global_block().ops:
            if op.has_attr("shape"):
                (out,) = op.output("Out")
                assert tuple(op.attr("shape")) == startup.global_block().var(out).shape


def compare_listen_and_serv(result: TranspileResult, expected: dict) -> None:
    for endpoint, (main, _) in result.pservers.items():
        (ours,) = main.global_block().ops
        (theirs,) = expected["pservers"][endpoint]["main"][0]["ops"]
        assert ours.type == "listen_and_serv"
        assert list(ours.input("X")) == theirs["inputs"].get("X", [])
        for attr in ("Fanin", "lr_decay_block_id", "distributed_mode", "endpoint"):
            assert ours.attr(attr) == theirs["attrs"][attr], attr
        for attr in ("prefetch_var_name_to_block_id", "checkpint_block_id"):
            if attr in theirs["attrs"]:
                assert ours.attr(attr) == theirs["attrs"][attr], attr
        # Paddle's order depends on the hash seed (facts §10.8), ours is block order.
        assert set(ours.attr("grad_to_block_id")) == set(theirs["attrs"]["grad_to_block_id"])
        assert list(ours.attr("sparse_grad_to_param")) == theirs["attrs"]["sparse_grad_to_param"]
        optimize_blocks = ours.attr("optimize_blocks")
        assert list(optimize_blocks) == sorted(optimize_blocks)
        assert ours.attr("pserver_id") == list(result.pservers).index(endpoint)


def compare_rpc_op_attrs(result: TranspileResult, expected: dict, *, with_startup: bool = True) -> None:
    programs = [(result.trainer, expected["trainer"][0])]
    if with_startup:
        programs.append((result.trainer_startup, expected["trainer_startup"][0]))
    for program, want in programs:
        compare_rpc_ops(program.global_block().ops, want["ops"])


def compare_rpc_ops(ours: Sequence[Op], theirs: Sequence[dict]) -> None:
    """The RPC and split ops among `ours` and Paddle's `theirs`, pairwise in order."""
    ours = [op for op in ours if op.type in RPC_KINDS]
    theirs = [op for op in theirs if op["type"] in RPC_KINDS]
    assert len(ours) == len(theirs)
    for mine, paddle in zip(ours, theirs, strict=True):
        if mine.type == "recv":
            assert list(mine.output("Out")) == paddle["outputs"]["Out"]
            assert list(mine.attr("epmap")) == paddle["attrs"]["epmap"]
        elif mine.type == "send":
            assert list(mine.input("X")) == paddle["inputs"]["X"]
            if "epmap" in paddle["attrs"]:
                assert list(mine.attr("epmap")) == paddle["attrs"]["epmap"]
        elif mine.type == "split_byref":
            assert list(mine.attr("sections")) == paddle["attrs"]["sections"]
            assert list(mine.output("Out")) == paddle["outputs"]["Out"]
        elif mine.type == "split_selected_rows":
            assert list(mine.attr("height_sections")) == paddle["attrs"]["height_sections"]
            assert list(mine.output("Out")) == paddle["outputs"]["Out"]
        else:
            assert {k: list(v) for k, v in mine.inputs.items() if v} == paddle["inputs"]
            assert {k: list(v) for k, v in mine.outputs.items()} == paddle["outputs"]
            if "epmap" in paddle["attrs"]:
                assert list(mine.attr("epmap")) == paddle["attrs"]["epmap"]


def compare_send_epmaps_with_recv_epmaps(result: TranspileResult, expected: dict) -> None:
    """2.6 dropped `epmap` from `send`; the grad of a block must go where its param is fetched from."""
    block = result.trainer.global_block()
    recv_ep = {
        out: ep
        for op in block.ops
        if op.type == "recv"
        for out, ep in zip(op.output("Out"), op.attr("epmap"), strict=True)
    }
    for param in result.plan.params:
        for var_block, endpoint in zip(param.blocks, param.endpoints, strict=True):
            assert recv_ep[var_block.name] == endpoint


COMPARISONS: dict[str, Callable[[TranspileResult, dict], None]] = {
    "trainer_op_sequence": compare_trainer_op_sequence,
    "trainer_startup_op_sequence": compare_trainer_startup_op_sequence,
    "pserver_blocks": compare_pserver_blocks,
    "pserver_vars_and_shapes": compare_pserver_vars_and_shapes,
    "pserver_startup_ops": compare_pserver_startup_ops,
    "listen_and_serv": compare_listen_and_serv,
    "rpc_op_attrs": compare_rpc_op_attrs,
    "send_epmaps_match_recv_epmaps": compare_send_epmaps_with_recv_epmaps,
}
