"""Real models built and transpiled by Paddle 2.6.2 (tools/make_paddle_fixtures.py):
ResNet-50 with Momentum, a BERT-base encoder, a small BERT-style encoder and a GPT-style
decoder with Adam, in tests/fixtures/paddle_programs.

Each loads, saves byte-identically, verifies (BERT's `reshape2` ops repeat attrs: a warning,
not a refusal), works through the CLI, and transpiles (verified) to what Paddle's own
transpiler made, compared as in test_api_paddle_fixtures.py (paddle_fixtures_support).

Deliberate differences, applied by comparing the trainer's sends as a set of units (a
`split_byref` with its `send`, or a lone `send`) and everything else in order:
* the sends of the grads one op writes (`batch_norm_grad`'s Scale@GRAD and Bias@GRAD, ...)
  come in param order; Paddle inserts each at the op's index + 1, so they come reversed;
* with gradient clipping, Paddle 2.6's clip multiplies each grad in place
  (`elementwise_mul` in `/gradient_clip/`, Optimize role); Paddle inserts the grad's send
  after that op and then removes it from the trainer, so all sends land after the whole
  backward pass. Ours follow the last writer the trainer keeps, the backward op, so the
  trainer op sequence differs in where the sends are, nowhere else.

* gradient clipping (`bert_adam_clip_2ps_sync`, ClipGradByGlobalNorm): Paddle 2.6 builds the
  clip in `/gradient_clip/`, which its transpiler's `@CLIP` test misses, so it moves the clip
  ops to the pservers, each computing a "global" norm from its own grads. We keep every
  gradient-clip op on the trainer (transpiler/passes/keep_clip_on_trainer.py), which sends
  the clipped grad: the comparisons take Paddle's programs with the clip moved back
  (`clip_moved_to_trainer`). The clip multiplies each grad in place, so the sent grads,
  their splits and their names are Paddle's.

* unsliced (`slice_var_up=False`), `listen_and_serv`'s X lists the grads in block order, as
  `grad_to_block_id` does; Paddle's follows its shuffled dispatch order (the set is the same;
  the pserver runtime reads it as a set).

Unsliced placement is Paddle's: its grads, in optimizer order, shuffled with
`np.random.seed(program.random_seed)` (0: a loaded program's) then dealt round-robin;
`test_unsliced_placement_is_a_seeded_shuffle_then_round_robin` pins the rule down.
"""

from __future__ import annotations

import functools
import json
from collections import Counter

import numpy as np
import pytest

from conftest import PADDLE_PROGRAMS, REAL_MODEL_CASES
from ops import catalogue
from proto import framework_pb2
from paddle_fixtures_support import COMPARISONS, compare_rpc_ops, op_types, run_case
from transpiler.cli import main as cli_main
from transpiler.ir import Op, OpRole, Program
from transpiler.ir.verifier import check, check_warnings, verify

UNSLICED = [c for c in REAL_MODEL_CASES if not json.loads((PADDLE_PROGRAMS / c / "case.json").read_text())["slice_var_up"]]
# (case, comparison) -> why it fails until the gap is closed (none at the moment).
KNOWN_GAPS: dict[tuple[str, str], str] = {}
# Compared as in test_api_paddle_fixtures, but the trainer's RPC ops: `trainer_rpc_ops` below.
REAL_COMPARISONS = {name: check for name, check in COMPARISONS.items() if name != "rpc_op_attrs"}
PADDLE_RANDOM_SEED = 0  # Paddle's default `Program.random_seed`, which make_paddle_fixtures.py keeps
CLIP_ON_TRAINER = {"bert_adam_clip_2ps_sync"}  # see the module docstring
CLIP_SCOPE = "/gradient_clip/"


def clip_ops(program: Program) -> list[Op]:
    return [op for op in program.global_block().ops if op.attr("op_namescope", "") == CLIP_SCOPE]


def clip_moved_to_trainer(case: str, expected: dict) -> dict:
    """Paddle's programs as they would be with the clip on the trainer: each optimize
    block without its clip ops (between the trainers' `sum, scale` and the optimizer) and
    each pserver without the clip's temporaries. The trainer's ops are compared apart."""
    main = Program.load(PADDLE_PROGRAMS / case / "main.pb")
    clip = clip_ops(main)
    kept_writers = {name for op in main.global_block().ops if op not in clip for name in op.output_names}
    temporaries = {name for op in clip for name in op.output_names} - kept_writers
    types = {op.type for op in clip}
    out = json.loads(json.dumps(expected))
    for pserver in out["pservers"].values():
        for block in pserver["main"][1:]:
            moved = block["ops"][2:-1]
            assert {op["type"] for op in moved} <= types, [op["type"] for op in moved]
            block["ops"] = block["ops"][:2] + block["ops"][-1:]
        for program in ("main", "startup"):
            block = pserver[program][0]
            block["vars"] = {n: v for n, v in block["vars"].items() if n not in temporaries}
    return out


def test_the_real_model_cases_are_there():
    assert {c.split("_")[0] for c in REAL_MODEL_CASES} == {"resnet50", "resnet", "bert", "gpt"}
    assert len(REAL_MODEL_CASES) == 8 and len(UNSLICED) == 2


def is_bert(case: str) -> bool:
    """A transformer (BERT or GPT): its multi-head attention's reshape2 ops repeat attrs."""
    return case.startswith(("bert_", "gpt_"))


@functools.cache
def transpiled(case: str):
    return run_case(case)


def as_dict(op: Op) -> dict:
    """Our op in expected.json's form (empty slots left out, as there)."""
    return {"type": op.type, "inputs": {k: list(v) for k, v in op.inputs.items() if v},
            "outputs": {k: list(v) for k, v in op.outputs.items() if v}}


def send_units(ops: list[dict]) -> tuple[list[dict], Counter]:
    """(the ops but the sends and their splits, the sends as (split outputs, sections, sent vars))."""
    rest, units = [], Counter()
    split = None
    for op in ops:
        if op["type"] == "split_byref":
            split = op
        elif op["type"] == "send":
            parts = (tuple(split["outputs"]["Out"]), tuple(split["attrs"]["sections"])) if split else ((), ())
            assert split is None or list(parts[0]) == op["inputs"]["X"], "a split_byref not followed by its send"
            units[(*parts, tuple(op["inputs"]["X"]))] += 1
            split = None
        else:
            assert split is None, "a split_byref not followed by its send"
            rest.append(op)
    return rest, units


def compare_trainer_rpc_ops(result, expected) -> None:
    kept = [op for op in result.trainer.global_block().ops if op.attr("op_namescope", "") != CLIP_SCOPE]
    ours = [as_dict(op) | {"attrs": {"sections": list(op.attr("sections", ()))}} for op in kept]
    our_rest, our_units = send_units(ours)
    their_rest, their_units = send_units(expected["trainer"][0]["ops"])
    assert our_units == their_units
    rest_ops = [op for op in kept if op.type not in ("send", "split_byref")]
    assert [op["type"] for op in our_rest] == [op["type"] for op in their_rest]
    compare_rpc_ops(rest_ops, their_rest)
    compare_rpc_ops(result.trainer_startup.global_block().ops, expected["trainer_startup"][0]["ops"])


def compare_trainer_op_sequence_clip_kept(result, expected) -> None:
    """Paddle's trainer ops (sends aside: ours follow each grad's clip) with the clip ops
    added back where the original has them: after the backward pass, in its order."""
    clip = [op for op in result.trainer.global_block().ops if op.attr("op_namescope", "") == CLIP_SCOPE]
    ours = [op.type for op in result.trainer.global_block().ops if op.type not in ("send", "split_byref")]
    theirs = [op["type"] for op in expected["trainer"][0]["ops"] if op["type"] not in ("send", "split_byref")]
    barrier = theirs.index("send_barrier")
    assert ours == theirs[:barrier] + [op.type for op in clip] + theirs[barrier:]


def comparison_params():
    params = []
    for case in REAL_MODEL_CASES:
        checks = dict(REAL_COMPARISONS, trainer_rpc_ops=compare_trainer_rpc_ops)
        if case in CLIP_ON_TRAINER:
            checks["trainer_op_sequence"] = compare_trainer_op_sequence_clip_kept
        for name, check_fn in checks.items():
            gap = KNOWN_GAPS.get((case, name))
            marks = [pytest.mark.xfail(strict=True, reason=gap)] if gap else []
            params.append(pytest.param(case, check_fn, id=f"{case}-{name}", marks=marks))
    return params


@pytest.mark.parametrize(("case", "compare"), comparison_params())
def test_transpile_matches_paddle(case, compare):
    result, expected, _ = transpiled(case)
    if case in CLIP_ON_TRAINER and compare is not compare_trainer_op_sequence_clip_kept:
        expected = clip_moved_to_trainer(case, expected)
    if case in UNSLICED and compare is REAL_COMPARISONS["listen_and_serv"]:
        expected = received_in_block_order(result, expected)
    compare(result, expected)


def received_in_block_order(result, expected) -> dict:
    """Paddle's programs with each `listen_and_serv`'s X in our (block) order, once it is the same set."""
    out = json.loads(json.dumps(expected))
    for endpoint, (main, _) in result.pservers.items():
        theirs = out["pservers"][endpoint]["main"][0]["ops"][0]["inputs"]
        ours = list(main.global_block().ops[0].input("X"))
        assert sorted(ours) == sorted(theirs.get("X", [])), endpoint
        theirs["X"] = ours
    return out


# ------------------------------------------------------------------ the programs


@pytest.fixture(params=REAL_MODEL_CASES)
def case(request) -> str:
    return request.param


def _wire_repeats(data: bytes) -> tuple[int, int]:
    """(ops, ops that write an attr name twice), read with protobuf alone."""
    message = framework_pb2.ProgramDesc.FromString(data)
    ops = [op for block in message.blocks for op in block.ops]
    return len(ops), sum(len({a.name for a in op.attrs}) < len(op.attrs) for op in ops)


@pytest.mark.parametrize("file", ["main.pb", "startup.pb"])
def test_load_save_is_byte_identical(case, file):
    data = (PADDLE_PROGRAMS / case / file).read_bytes()
    program = Program.from_bytes(data)
    assert program.to_bytes() == data
    assert program.clone().to_bytes() == data


def test_verifies_and_warns_only_about_repeated_attrs(case):
    main_data = (PADDLE_PROGRAMS / case / "main.pb").read_bytes()
    main, startup = Program.from_bytes(main_data), Program.load(PADDLE_PROGRAMS / case / "startup.pb")
    for program in (main, startup):
        verify(program)
        assert check(program) == []
    assert check_warnings(startup) == []
    ops, repeating = _wire_repeats(main_data)
    # Paddle 2.6 writes repeated attrs into BERT and GPT (reshape2), not into ResNet-50.
    assert (repeating > 0) == is_bert(case)
    if repeating:
        (warning,) = check_warnings(main, name="main.pb")
        assert warning.startswith(f"main.pb: {repeating} of {ops} ops repeat attrs (mkldnn_data_type (")
    else:
        assert check_warnings(main) == []


def test_the_repeated_attrs_are_reshape2s_and_the_last_value_is_kept():
    message = framework_pb2.ProgramDesc.FromString((PADDLE_PROGRAMS / "bert_adam_4ps_async" / "main.pb").read_bytes())
    program = Program.load(PADDLE_PROGRAMS / "bert_adam_4ps_async" / "main.pb")
    repeating = Counter()
    for wire, op in zip(message.blocks[0].ops, program.global_block().ops, strict=True):
        names = [a.name for a in wire.attrs]
        for name in {n for n in names if names.count(n) > 1}:
            repeating[(op.type, name)] += 1
            last = [a for a in wire.attrs if a.name == name][-1]
            assert op.attr(name) == (last.b if name != "mkldnn_data_type" else last.s)
    # 12 layers x 4 reshape2 (q, k, v, and the heads merged back), and their grads
    assert repeating == {(t, n): 48 for t in ("reshape2", "reshape2_grad")
                         for n in ("mkldnn_data_type", "use_mkldnn", "use_quantizer")}


def test_the_ops_the_catalogue_does_not_know_yet():
    """These models use ops the catalogue (and so the runtime) does not have yet; the
    transpiler passes them through. Update this list when entries are added."""
    types = set()
    for case in REAL_MODEL_CASES:
        for file in ("main.pb", "startup.pb"):
            types |= {op.type for _, op in Program.load(PADDLE_PROGRAMS / case / file).all_ops()}
    assert sorted(t for t in types if catalogue.get(t) is None) == ["transpose2", "transpose2_grad"]


def test_unsliced_placement_is_a_seeded_shuffle_then_round_robin():
    """What Paddle did, and we do: the grads, in optimizer order, shuffled with
    `np.random.seed(program.random_seed)`, then dealt round-robin; each param is received
    from its grad's pserver. `random_seed` is a Python attr of Paddle's `Program`, not in
    the ProgramDesc; the generator left it at Paddle's default, 0, our default for a loaded program."""
    for case in UNSLICED:
        result, expected, info = transpiled(case)
        endpoints = info["pservers"].split(",")
        params = [p.param for p in result.plan.params]
        shuffled = list(params)
        np.random.seed(PADDLE_RANDOM_SEED)
        np.random.shuffle(shuffled)
        paddle_rule = {param: endpoints[i % len(endpoints)] for i, param in enumerate(shuffled)}
        theirs = {op["outputs"]["Out"][0]: op["attrs"]["epmap"][0]
                  for op in expected["trainer"][0]["ops"] if op["type"] == "recv"}
        assert theirs == paddle_rule, case
        assert {p.param: p.endpoints[0] for p in result.plan.params} == paddle_rule, case
        assert set(paddle_rule.values()) != {endpoints[0]}  # not trivially one pserver


def test_paddle_2_6_moves_the_clip_to_the_pservers_we_keep_it_on_the_trainer():
    """Paddle 2.6's clip ops are in `/gradient_clip/`, not `@CLIP`: its transpiler leaves them
    Optimize ops, drops them from the trainer, and puts each grad's `squared_l2_norm` and
    in-place `elementwise_mul` before its `adam` on the pserver, and the global norm
    (`sum`, `sqrt`, `fill_constant`, `elementwise_max`, `elementwise_div`) in one block of
    each pserver, from that pserver's norms only. Ours keeps all of them on the trainer,
    in the original's order, and the pserver blocks are `sum, scale, adam`."""
    result, expected, _ = transpiled("bert_adam_clip_2ps_sync")
    main = Program.load(PADDLE_PROGRAMS / "bert_adam_clip_2ps_sync" / "main.pb")
    clip = clip_ops(main)
    assert {op.type for op in clip} == {"squared_l2_norm", "sum", "sqrt", "fill_constant", "elementwise_max",
                                        "elementwise_div", "elementwise_mul"}
    assert not [op for _, op in main.all_ops() if "@CLIP" in op.attr("op_namescope", "")]
    assert "squared_l2_norm" not in {op["type"] for op in expected["trainer"][0]["ops"]}
    global_norm = ["squared_l2_norm", "sum", "sqrt", "fill_constant", "elementwise_max", "elementwise_div"]
    for endpoint, pserver in expected["pservers"].items():
        blocks = [[op["type"] for op in block["ops"]] for block in pserver["main"][1:]]
        assert all(b[:3] == ["sum", "scale", "squared_l2_norm"] and b[-2:] == ["elementwise_mul", "adam"]
                   for b in blocks), endpoint
        assert sum(b[2:-2] == global_norm for b in blocks) == 1, endpoint
    ours = clip_ops(result.trainer)

    def slots(op: Op) -> tuple:  # the trainer renames an unsliced grad it sends to <grad>.trainer_0
        names = {k: tuple(n.removesuffix(".trainer_0") for n in v) for k, v in (*op.inputs.items(), *op.outputs.items())}
        return op.type, names

    assert [slots(op) for op in ours] == [slots(op) for op in clip]
    assert {op.role for op in ours} == {OpRole.Backward}  # re-tagged, as Paddle's @CLIP rule does
    for main_program, _ in result.pservers.values():
        assert all(op_types(b) == ["sum", "scale", "adam"] for b in main_program.blocks[1:])


# ------------------------------------------------------------------ the CLI


def test_cli_dump_and_transpile(case, tmp_path, capsys):
    folder = PADDLE_PROGRAMS / case
    info = json.loads((folder / "case.json").read_text())
    for file in ("main.pb", "startup.pb"):
        assert cli_main(["dump", str(folder / file), "-o", str(tmp_path / f"{file}.txt"), "--full"]) == 0  # whole paths in warnings
    _, err = capsys.readouterr()
    warnings = err.splitlines()
    assert len(warnings) == (1 if is_bert(case) else 0), err
    assert all(line.startswith(f"pstranspile: warning: {folder / 'main.pb'}: ") for line in warnings)
    argv = ["transpile", str(folder / "main.pb"), "--startup", str(folder / "startup.pb"),
            "--pservers", info["pservers"], "--trainers", str(info["trainers"]), "-o", str(tmp_path / "out"), "--full"]
    argv += [] if info["sync_mode"] else ["--async"]
    argv += [] if info["slice_var_up"] else ["--no-slice"]
    assert cli_main(argv) == 0
    _, err = capsys.readouterr()
    assert err.splitlines() == warnings, err
    written = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"trainer.pb", "trainer_startup.pb", "plan.json"} <= written
    assert len([n for n in written if n.startswith("pserver_") and not n.endswith("_startup.pb")]) == len(
        info["pservers"].split(","))
