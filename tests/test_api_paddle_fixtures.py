"""Transpiling Paddle-built programs gives what Paddle's own transpiler gave
(tests/fixtures/paddle_programs/<case>/expected.json).

Compared: the trainer's op-type sequence (block 0) and its startup's; every pserver's
per-block op-type lists, block-0 vars with their shapes, startup ops with their outputs,
`listen_and_serv` inputs and attrs; `recv` outputs and epmaps; `send` epmaps where Paddle
kept them (2.6 dropped the attr); `split_byref` sections. `grad_to_block_id` is compared
as a set: Paddle builds it with `list(set(...))`, so its order follows the hash seed; ours is block order.

Deliberate differences, each applied to Paddle's output below by `adjusted()` so the rest
is compared exactly:
* the trainer keeps no lr-decay sub-blocks and no vars only the removed optimize / lr ops
  used (Paddle leaves them behind, unused);
* the distributed table's update block averages the trainers' grads (`sum, scale, sgd`)
  like every other param's; Paddle's `sum, sgd` makes sync training differ from local
  training by a factor of `trainers` on the table;
* a sparse table that is not prefetched (`ctr_v1_sparse_sgd_2ps`) is received by the
  trainer's startup program like any param; Paddle 2.6 `fake_init`s it, so the trainer's
  first lookups read an uninitialised table;
* the prefetch output var on a pserver is `[-1, width]`; 1.8 wrote an infer-shape
  leftover (`[2, 16]`).
"""

from __future__ import annotations

import json

import pytest

from conftest import PADDLE_PROGRAMS, load_case_json
from transpiler.api import transpile
from transpiler.errors import TranspileError
from transpiler.ir import Program

CASES = [
    "ctr_v1_dist_sgd_2ps",
    "ctr_v1_sparse_sgd_2ps",
    "fluid18_basic_sgd_2ps",
    "fluid18_ctr_dist_sgd_2ps",
    "fluid18_lr_exp_decay_2ps",
    "fluid18_lr_piecewise_2ps",
    "mlp_adam_2ps",
    "seed_fc3_sgd_3ps",
]
# Cases whose trainer startup deliberately differs (see the module docstring).
STARTUP_RECEIVES_SPARSE_TABLE = {"ctr_v1_sparse_sgd_2ps"}


def run_case(name: str):
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
        verify=True,
    )
    return result, adjusted(expected)


def adjusted(expected: dict) -> dict:
    """Paddle's output with our deliberate fixes applied (see the module docstring)."""
    for pserver in expected["pservers"].values():
        for block in pserver["main"][1:]:
            types = [op["type"] for op in block["ops"]]
            if types == ["sum", "sgd"]:  # the distributed table's update block
                merged = block["ops"][0]["outputs"]["Out"]
                block["ops"].insert(1, {"type": "scale", "inputs": {"X": merged}, "outputs": {"Out": merged},
                                        "attrs": {}})
        for program in pserver.values():
            for name, var in program[0]["vars"].items():
                if name.startswith("prefetch_compress_out_tmp_"):
                    var["shape"] = [-1, *var["shape"][1:]]
    return expected


def op_types(block) -> list[str]:
    return [op.type for op in block.ops]


def expected_types(block: dict) -> list[str]:
    return [op["type"] for op in block["ops"]]


@pytest.fixture(params=CASES)
def case(request):
    return (request.param, *run_case(request.param))


def test_trainer_op_sequence(case):
    _, result, expected = case
    assert op_types(result.trainer.global_block()) == expected_types(expected["trainer"][0])


def test_trainer_startup_op_sequence(case):
    name, result, expected = case
    if name in STARTUP_RECEIVES_SPARSE_TABLE:
        pytest.skip("deliberately different: see test_a_sparse_table_that_is_not_prefetched_is_received")
    assert op_types(result.trainer_startup.global_block()) == expected_types(expected["trainer_startup"][0])


def test_pserver_blocks(case):
    _, result, expected = case
    assert list(result.pservers) == list(expected["pservers"])
    for endpoint, (main, _) in result.pservers.items():
        want = expected["pservers"][endpoint]["main"]
        assert [op_types(b) for b in main.blocks] == [expected_types(b) for b in want], endpoint


def test_pserver_vars_and_shapes(case):
    _, result, expected = case
    for endpoint, (main, startup) in result.pservers.items():
        for program, key in ((main, "main"), (startup, "startup")):
            ours = {n: list(v.shape) for n, v in program.global_block().vars.items() if v.shape is not None}
            theirs = {n: v["shape"] for n, v in expected["pservers"][endpoint][key][0]["vars"].items() if v["shape"] is not None}
            theirs_named = {n for n, v in expected["pservers"][endpoint][key][0]["vars"].items()}
            assert ours == theirs, (endpoint, key)
            assert set(program.global_block().vars) == theirs_named, (endpoint, key)


def test_pserver_startup_ops(case):
    _, result, expected = case
    for endpoint, (_, startup) in result.pservers.items():
        ours = [(op.type, list(op.output("Out"))) for op in startup.global_block().ops]
        theirs = [(op["type"], op["outputs"]["Out"]) for op in expected["pservers"][endpoint]["startup"][0]["ops"]]
        assert ours == theirs, endpoint
        for op in startup.global_block().ops:
            if op.has_attr("shape"):
                (out,) = op.output("Out")
                assert tuple(op.attr("shape")) == startup.global_block().var(out).shape


def test_listen_and_serv(case):
    _, result, expected = case
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
        assert set(ours.attr("grad_to_block_id")) == set(theirs["attrs"]["grad_to_block_id"])
        assert list(ours.attr("sparse_grad_to_param")) == theirs["attrs"]["sparse_grad_to_param"]
        optimize_blocks = ours.attr("optimize_blocks")
        assert list(optimize_blocks) == sorted(optimize_blocks)
        assert ours.attr("pserver_id") == list(result.pservers).index(endpoint)


def test_rpc_op_attrs(case):
    name, result, expected = case
    programs = [(result.trainer, expected["trainer"][0])]
    if name not in STARTUP_RECEIVES_SPARSE_TABLE:
        programs.append((result.trainer_startup, expected["trainer_startup"][0]))
    for program, want in programs:
        kinds = ("recv", "send", "split_byref", "split_selected_rows", "split_ids", "prefetch", "merge_ids")
        ours = [op for op in program.global_block().ops if op.type in kinds]
        theirs = [op for op in want["ops"] if op["type"] in kinds]
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


def test_send_epmaps_match_paddle_recv_epmaps(case):
    """2.6 dropped `epmap` from `send`; the grad of a block must go where its param is fetched from."""
    _, result, _ = case
    block = result.trainer.global_block()
    recv_ep = {out: ep for op in block.ops if op.type == "recv" for out, ep in zip(op.output("Out"), op.attr("epmap"), strict=True)}
    for param in result.plan.params:
        for var_block, endpoint in zip(param.blocks, param.endpoints, strict=True):
            assert recv_ep[var_block.name] == endpoint


def test_a_sparse_table_that_is_not_prefetched_is_received():
    result, _ = run_case("ctr_v1_sparse_sgd_2ps")
    startup = result.trainer_startup.global_block()
    # the original initializers (minus the learning rate's), a recv per param, the barrier, one concat
    assert op_types(startup) == ["uniform_random", "uniform_random", "fill_constant", "uniform_random",
                                 "fill_constant"] + ["recv"] * 5 + ["fetch_barrier", "concat"]
    recvs = [list(op.output("Out")) for op in startup.ops if op.type == "recv"]
    assert ["emb.block0", "emb.block1"] in recvs
    assert startup.ops[-1].input("X") == ("emb.block0", "emb.block1") and startup.ops[-1].output("Out") == ("emb",)


def test_every_fixture_case_is_covered():
    assert set(CASES) == {p.name for p in PADDLE_PROGRAMS.iterdir() if (p / "case.json").exists()}
    assert all(json.loads((PADDLE_PROGRAMS / n / "case.json").read_text())["sync_mode"] for n in CASES)
