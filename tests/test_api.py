"""The transpile API: modes, options, Paddle-compat getters, errors, determinism.

Op lists marked "fluid" are Fluid 1.8.5's real output for the same network (Paddle 1.8's
unittests test_dist_transpiler_async_decay.py and test_dist_transpiler_config.py, run on
the paddlepaddle 1.8.5 wheel); the fluid18_basic fixture is Paddle's TestBasicModel network.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PADDLE_PROGRAMS
from transpiler.api import DistributeTranspiler, transpile
from transpiler.config import DistributeTranspilerConfig
from transpiler.dispatch import PSDispatcher
from transpiler.errors import TranspileError, UnknownOpError
from transpiler.ir import Program

EPS = "127.0.0.1:6174,127.0.0.1:6175"
FORWARD_BACKWARD = ["mul", "elementwise_add", "elementwise_sub", "square", "mean", "fill_constant", "mean_grad",
                    "square_grad", "elementwise_sub_grad", "elementwise_add_grad"]


def load(case: str) -> tuple[Program, Program]:
    return Program.load(PADDLE_PROGRAMS / case / "main.pb"), Program.load(PADDLE_PROGRAMS / case / "startup.pb")


def types(program: Program, block: int = 0) -> list[str]:
    return [op.type for op in program.block(block).ops]


def basic(**kwargs):
    main, startup = load("fluid18_basic_sgd_2ps")
    kwargs.setdefault("pservers", EPS)
    kwargs.setdefault("trainers", 2)
    return transpile(main, startup, verify=True, **kwargs)


def test_inputs_are_never_changed():
    main, startup = load("fluid18_lr_piecewise_2ps")
    before = main.to_bytes(), startup.to_bytes()
    transpile(main, startup, pservers=EPS, trainers=2, sync_mode=False)
    transpile(main, startup, pservers=EPS, trainers=2)
    assert (main.to_bytes(), startup.to_bytes()) == before


def test_sync_with_one_trainer_sends_what_the_pserver_expects():
    """Paddle 1.8 sums `<grad>.trainer_0` on the pserver while the trainer sends `<grad>` (the `sync_mode or ...` precedence slip of Paddle PR #22344)."""
    result = basic(trainers=1)
    sends = [n for op in result.trainer.global_block().ops if op.type == "send" for n in op.input("X")]
    assert sends == ["fc_b@GRAD", "fc_w@GRAD.block0", "fc_w@GRAD.block1"]
    main, _ = result.pservers["127.0.0.1:6174"]
    assert main.global_block().ops[0].input("X") == ("fc_b@GRAD", "fc_w@GRAD.block1")
    assert [types(main, i) for i in range(1, main.num_blocks)] == [["sgd"], ["sgd"]]
    assert "send_barrier" in types(result.trainer)


def test_half_async_matches_fluid():  # test_dist_transpiler_config.py TestBasicModelHalfAsync
    result = basic(sync_mode=False)
    assert types(result.trainer) == FORWARD_BACKWARD + ["send", "mul_grad", "split_byref", "send", "recv", "recv",
                                                        "concat"]
    main, _ = result.pservers["127.0.0.1:6174"]
    serve = main.global_block().ops[0]
    assert serve.attr("distributed_mode") == 2 and serve.attr("sync_mode") is False
    assert serve.input("X") == ("fc_b@GRAD", "fc_w@GRAD.block1")
    assert [types(main, i) for i in range(1, main.num_blocks)] == [["sgd"], ["sgd"]]
    recvs = [op for op in result.trainer.global_block().ops if op.type == "recv"]
    sends = [op for op in result.trainer.global_block().ops if op.type == "send"]
    assert [r.input("X") for r in recvs] == [s.output("Out") for s in sends]  # each recv waits for its own send
    assert types(result.trainer_startup) == ["fill_constant", "uniform_random", "recv", "recv", "fetch_barrier", "concat"]


def test_async_with_runtime_split_matches_fluid():  # test_dist_transpiler_config.py TestBasicModelAsync
    config = DistributeTranspilerConfig()
    config.sync_mode = False
    config.runtime_split_send_recv = True
    result = basic(config=config)
    assert types(result.trainer) == FORWARD_BACKWARD + ["send", "mul_grad", "send", "recv", "recv"]
    ops = result.trainer.global_block().ops
    send_w = [op for op in ops if op.type == "send"][1]
    assert send_w.input("X") == ("fc_w@GRAD",)
    assert send_w.attr("sections") == (500, 500)
    assert send_w.attr("send_varnames") == ("fc_w@GRAD.block0", "fc_w@GRAD.block1")
    recv_w = [op for op in ops if op.type == "recv"][1]
    assert recv_w.output("Out") == ("fc_w",) and recv_w.attr("recv_varnames") == ("fc_w.block0", "fc_w.block1")
    main, _ = result.pservers["127.0.0.1:6174"]
    assert main.global_block().ops[0].attr("distributed_mode") == 1


def test_sync_config_matches_fluid():  # test_dist_transpiler_config.py TestBasicModelSync
    result = basic()
    assert types(result.trainer) == FORWARD_BACKWARD + ["send", "mul_grad", "split_byref", "send", "send_barrier",
                                                        "recv", "recv", "fetch_barrier", "concat"]


def test_transpile_argument_sets_the_mode_of_trainer_and_pservers_alike():
    """Paddle takes the pserver's mode from the config and the trainer's from the argument (Paddle 1.7/1.8; a sync pserver and an async trainer hang)."""
    transpiler = DistributeTranspiler()  # default config: sync_mode=True
    main, startup = load("fluid18_basic_sgd_2ps")
    transpiler.transpile(0, program=main, startup_program=startup, pservers=EPS, trainers=2, sync_mode=False)
    assert "send_barrier" not in types(transpiler.get_trainer_program())
    assert transpiler.get_pserver_program("127.0.0.1:6174").global_block().ops[0].attr("distributed_mode") == 2


def test_async_lr_decay_matches_fluid():  # test_dist_transpiler_async_decay.py
    main, startup = load("fluid18_lr_exp_decay_2ps")
    result = transpile(main, startup, pservers=EPS, trainers=2, sync_mode=False, verify=True)
    assert types(result.trainer) == FORWARD_BACKWARD + ["send", "mul_grad", "split_byref", "send", "send", "recv",
                                                        "recv", "concat"]
    counter_send = [op for op in result.trainer.global_block().ops if op.type == "send"][-1]
    assert counter_send.input("X") == ("@LR_DECAY_COUNTER@.trainer_0",)
    assert counter_send.attr("epmap") == tuple(EPS.split(","))
    assert counter_send.attr("merge_add") is True and counter_send.attr("use_send_handler") is False
    assert types(result.trainer_startup) == ["fill_constant"] * 4 + ["uniform_random", "recv", "recv",
                                                                      "fetch_barrier", "concat"]
    values = {op.output("Out")[0]: op.attr("value") for op in result.trainer_startup.global_block().ops
              if op.type == "fill_constant"}
    assert values["@LR_DECAY_COUNTER@"] == -2.0
    assert values["@LR_DECAY_COUNTER@.trainer_0"] == values["@LR_DECAY_COUNTER@.trainer_1"] == 1.0
    main0, startup0 = result.pservers["127.0.0.1:6174"]
    assert types(main0, 1) == ["sum", "cast", "scale", "floor", "fill_constant", "elementwise_pow", "scale"]
    assert main0.block(1).ops[0].input("X") == ("@LR_DECAY_COUNTER@.trainer_0", "@LR_DECAY_COUNTER@.trainer_1")
    assert [types(main0, i) for i in (2, 3)] == [["sgd"], ["sgd"]]
    assert [main0.block(i).parent_idx for i in (2, 3)] == [1, 1]
    assert types(startup0) == ["fill_constant"] * 4 + ["uniform_random"]


def test_lr_decay_block_comes_first_and_parents_the_optimize_blocks():  # test_dist_transpiler.py TestLRDecay
    main, startup = load("fluid18_lr_exp_decay_2ps")
    result = transpile(main, startup, pservers=EPS, trainers=2, verify=True)
    main0, _ = result.pservers["127.0.0.1:6174"]
    serve = main0.global_block().ops[0]
    assert serve.attr("lr_decay_block_id") == 1 and serve.attr("optimize_blocks") == (1, 2, 3)
    assert types(main0, 1) == ["increment", "cast", "scale", "floor", "fill_constant", "elementwise_pow", "scale"]
    assert [main0.block(i).parent_idx for i in range(1, 4)] == [0, 1, 1]


def test_piecewise_decay_carries_its_sub_blocks():  # test_dist_transpiler.py TestLRDecayConditional
    main, startup = load("fluid18_lr_piecewise_2ps")
    result = transpile(main, startup, pservers=EPS, trainers=2, verify=True)
    main0, _ = result.pservers["127.0.0.1:6174"]
    assert main0.num_blocks == 7
    assert [types(main0, i) for i in (2, 3, 4)] == [["assign"]] * 3
    assert [op.attr("sub_block") for op in main0.block(1).ops if op.type == "conditional_block"] == [2, 3, 4]
    assert main0.global_block().ops[0].attr("optimize_blocks") == (1, 5, 6)
    assert result.trainer.num_blocks == 1  # Paddle leaves three orphan ['assign'] blocks behind


def test_no_slice_keeps_vars_whole():  # test_dist_transpiler.py TestNoSliceVar
    # TranspilerTest's main program has random_seed 1 (a Python attr the .pb does not carry):
    # Paddle's seeded shuffle keeps [fc_b, fc_w], so fc_w is dealt to the second pserver.
    result = basic(slice_var_up=False, random_seed=1)
    _, startup1 = result.pservers["127.0.0.1:6175"]
    assert startup1.global_block().var("fc_w").shape == (1000, 1000)
    assert "split_byref" not in types(result.trainer) and "concat" not in types(result.trainer)


def placed(result) -> dict[str, str]:
    return {p.param: p.endpoints[0] for p in result.plan.params}


def test_unsliced_round_robin_deals_paddles_seeded_shuffle():
    """Paddle (1.8 and 2.6) shuffles the grads with np.random.seed(program.random_seed)
    before round robin when vars are not sliced; a loaded program's seed is 0."""
    assert placed(basic(slice_var_up=False)) == {"fc_b": "127.0.0.1:6175", "fc_w": "127.0.0.1:6174"}
    assert placed(basic(slice_var_up=False, random_seed=1)) == {"fc_b": "127.0.0.1:6174", "fc_w": "127.0.0.1:6175"}
    config = DistributeTranspilerConfig()
    config.random_seed = 1
    assert placed(basic(slice_var_up=False, config=config)) == {"fc_b": "127.0.0.1:6174", "fc_w": "127.0.0.1:6175"}
    # sliced, or another dispatcher: program order
    assert placed(basic(slice_var_up=False, split_method="balanced")) == {"fc_b": "127.0.0.1:6175",
                                                                          "fc_w": "127.0.0.1:6174"}
    with pytest.raises(TranspileError, match="random_seed must be an integer"):
        basic(slice_var_up=False, random_seed=-1)


def test_a_builder_programs_random_seed_seeds_the_shuffle():
    from transpiler.frontend import fluid18_networks as nets

    main, startup = nets.basic_model()  # TranspilerTest: main.random_seed = 1
    assert main.random_seed == 1
    result = transpile(main, startup, pservers=EPS, trainers=2, slice_var_up=False)
    assert placed(result) == {"fc_b": "127.0.0.1:6174", "fc_w": "127.0.0.1:6175"}  # as 1.8.5 placed them (facts §3.3)
    result = transpile(main, startup, pservers=EPS, trainers=2, slice_var_up=False, random_seed=0)
    assert placed(result) == {"fc_b": "127.0.0.1:6175", "fc_w": "127.0.0.1:6174"}


def test_large_block_size():  # test_dist_transpiler.py TestBasicModelWithLargeBlockSize
    result = basic(min_block_size=1048576)
    assert types(result.trainer) == FORWARD_BACKWARD + ["send", "mul_grad", "send", "send_barrier", "recv", "recv",
                                                        "fetch_barrier"]
    main0, startup0 = result.pservers["127.0.0.1:6174"]
    assert types(main0, 1) == ["sum", "scale", "sgd"] and main0.num_blocks == 2
    assert types(startup0) == ["fill_constant", "fill_constant"]
    assert result.pservers["127.0.0.1:6175"][1].global_block().var("fc_w").shape == (1000, 1000)


def test_an_empty_pserver_gets_one_empty_block():  # test_dist_transpiler.py TestEmptyPserverOptimizeBlocks
    main, startup = load("seed_fc3_sgd_3ps")
    eps = ",".join(f"127.0.0.1:{6170 + i}" for i in range(5))
    result = transpile(main, startup, pservers=eps, trainers=2, slice_var_up=False, verify=True)
    empty, empty_startup = result.pservers["127.0.0.1:6174"]
    assert empty.num_blocks == 2 and len(empty.block(1)) == 0
    serve = empty.global_block().ops[0]
    assert serve.input("X") == () and serve.attr("grad_to_block_id") == () and serve.attr("optimize_blocks") == (1,)
    assert len(empty_startup.global_block()) == 0


class AllOnFirst(PSDispatcher):
    def dispatch(self, varlist):
        return [self.eps[0] for _ in varlist]


def test_two_blocks_of_one_param_on_one_pserver_get_their_own_state():
    main, startup = load("mlp_adam_2ps")
    result = transpile(main, startup, pservers="127.0.0.1:6170,127.0.0.1:6171", trainers=2, split_method=AllOnFirst,
                       verify=True)
    main0, startup0 = result.pservers["127.0.0.1:6170"]
    adams = [op for block in main0.blocks for op in block.ops if op.type == "adam"]
    h1 = [op for op in adams if op.input("Param")[0].startswith("h1.w")]
    assert [op.input("Moment1") for op in h1] == [("h1.w_moment1_0.block0",), ("h1.w_moment1_0.block1",)]
    assert [op.input("Beta1Pow") for op in h1] == [("h1.w_beta1_pow_acc_0.block0",), ("h1.w_beta1_pow_acc_0.block1",)]
    assert main0.global_block().var("h1.w_moment1_0.block1").shape == (392, 256)
    inits = {op.output("Out")[0] for op in startup0.global_block().ops}
    assert {"h1.w_moment1_0.block0", "h1.w_moment1_0.block1", "h1.w_beta1_pow_acc_0.block1"} <= inits
    assert result.pservers["127.0.0.1:6171"][0].num_blocks == 2  # the other one is empty


@pytest.mark.parametrize("method", ["hash_name", "balanced", "round_robin"])
@pytest.mark.parametrize("case", ["mlp_adam_2ps", "fluid18_lr_piecewise_2ps"])
@pytest.mark.parametrize("n_pservers", [1, 2, 4])
def test_every_split_method_gives_verified_programs(method, case, n_pservers):
    main, startup = load(case)
    eps = ",".join(f"127.0.0.1:{7000 + i}" for i in range(n_pservers))
    result = transpile(main, startup, pservers=eps, trainers=2, split_method=method, verify=True)
    assert set(result.pservers) == set(eps.split(","))
    assert result.plan.split_method == method


def test_seeded_initializers_get_one_seed_per_block():
    main, startup = load("fluid18_basic_sgd_2ps")
    for op in startup.global_block().ops:
        if op.type == "uniform_random":
            op.set_attr("seed", 7)
    result = transpile(main, startup, pservers=EPS, trainers=2)
    seeds = {ep: [op.attr("seed") for op in s.global_block().ops if op.type == "uniform_random"]
             for ep, (_, s) in result.pservers.items()}
    assert seeds == {"127.0.0.1:6175": [7], "127.0.0.1:6174": [8]}  # fc_w.block0 on 6175, block1 on 6174


def test_pserver_programs_do_not_depend_on_the_trainer_id():
    main, startup = load("mlp_adam_2ps")
    first = transpile(main, startup, pservers=EPS, trainers=3, trainer_id=0)
    last = transpile(main, startup, pservers=EPS, trainers=3, trainer_id=2)
    for ep in first.pservers:
        assert [p.to_bytes() for p in first.pservers[ep]] == [p.to_bytes() for p in last.pservers[ep]]
    assert first.plan.to_json() == last.plan.to_json()
    sends = [n for op in last.trainer.global_block().ops if op.type == "send" for n in op.input("X")]
    assert all(name.endswith(".trainer_2") for name in sends)


def test_paddle_style_api_returns_copies_and_never_mutates_the_startup():
    main, startup = load("fluid18_basic_sgd_2ps")
    before = startup.to_bytes()
    transpiler = DistributeTranspiler()
    transpiler.transpile(0, program=main, pservers=EPS, trainers=2, startup_program=startup, slice_var_up=True,
                         split_method="RoundRobin")
    pserver, pstartup = transpiler.get_pserver_programs("127.0.0.1:6174")
    assert transpiler.get_startup_program("127.0.0.1:6174", pserver).to_bytes() == pstartup.to_bytes()
    assert startup.to_bytes() == before  # Paddle rewrites the shapes of these ops (`get_startup_program` calls `op._set_attr("shape", ...)` on them)
    trainer = transpiler.get_trainer_program()
    trainer.global_block().remove_op(trainer.global_block().ops[0])
    assert len(transpiler.get_trainer_program().global_block()) == len(trainer.global_block()) + 1
    assert transpiler.get_trainer_startup_program().to_bytes() != before
    with pytest.raises(TranspileError, match="not one of the pservers"):
        transpiler.get_pserver_program("127.0.0.1:9999")


def test_getters_before_transpile_raise():
    with pytest.raises(TranspileError, match="call transpile"):
        DistributeTranspiler().get_trainer_program()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pservers": "127.0.0.1:6174,127.0.0.1:6174"}, "listed twice"),
        ({"pservers": "127.0.0.1"}, "malformed pserver endpoint"),
        ({"pservers": "host:70000"}, "malformed pserver endpoint"),
        ({"pservers": ""}, "no pserver endpoints"),
        ({"pservers": "127.0.0.1:6174,,127.0.0.1:6175"},
         r"malformed pserver endpoint list '127.0.0.1:6174,,127.0.0.1:6175': entry 2 of 3 is empty"),
        ({"pservers": ",127.0.0.1:6174"}, "entry 1 of 2 is empty"),
        ({"pservers": "127.0.0.1:6174,"}, "entry 2 of 2 is empty"),
        ({"pservers": ["127.0.0.1:6174", " "]}, "entry 2 of 2 is empty"),
        ({"trainers": 0}, "trainers must be an integer >= 1"),
        ({"trainer_id": 2}, r"trainer_id must be in \[0, 1\]"),
        ({"trainer_id": -1}, r"trainer_id must be in \[0, 1\]"),
        ({"min_block_size": 0}, "min_block_size must be an integer >= 1"),
        ({"split_method": "zigzag"}, "unknown split method"),
    ],
)
def test_bad_arguments(kwargs, message):
    main, startup = load("fluid18_basic_sgd_2ps")
    args = {"pservers": EPS, "trainers": 2, **kwargs}
    with pytest.raises(TranspileError, match=message):
        transpile(main, startup, **args)


def test_whitespace_around_endpoints_is_accepted():
    spaced = basic(pservers=" 127.0.0.1:6174 , 127.0.0.1:6175 ")
    assert tuple(spaced.pservers) == ("127.0.0.1:6174", "127.0.0.1:6175")
    assert spaced.trainer.to_bytes() == basic().trainer.to_bytes()


def test_unsupported_modes_say_so():
    main, startup = load("fluid18_basic_sgd_2ps")
    for field, value, message in (("mode", "nccl2", "only 'pserver'"), ("enable_dc_asgd", True, "dc_asgd"),
                                  ("runtime_split_send_recv", True, "needs async mode")):
        config = DistributeTranspilerConfig()
        setattr(config, field, value)
        with pytest.raises(TranspileError, match=message):
            transpile(main, startup, pservers=EPS, trainers=2, config=config)


def test_a_program_without_optimizer_ops_is_refused():
    main, startup = load("fluid18_basic_sgd_2ps")
    block = main.global_block()
    block.remove_ops([op for op in block.ops if op.type == "sgd"])
    with pytest.raises(TranspileError, match="no optimizer ops"):
        transpile(main, startup, pservers=EPS, trainers=2)


def test_an_optimizer_the_catalogue_does_not_know_is_named():
    main, startup = load("fluid18_basic_sgd_2ps")
    for op in main.global_block().ops:
        if op.type == "sgd":
            op.type = "fancy_sgd"
    with pytest.raises(UnknownOpError, match="fancy_sgd"):
        transpile(main, startup, pservers=EPS, trainers=2)


@pytest.mark.parametrize("sync_mode", [True, False])
def test_an_op_the_catalogue_does_not_know_passes_through_untouched(sync_mode):
    """DESIGN: op knowledge lives in tables, and an op no pass needs to know is left alone."""
    from ops.catalogue import make_op

    main, startup = load("fluid18_basic_sgd_2ps")
    block = main.global_block()
    add = next(op for op in block.ops if op.type == "elementwise_add")
    block.create_var("custom_0.tmp_0", dtype=block.var("fc_0.tmp_1").dtype, shape=[-1, 1000])
    custom = block.insert_after(add, "my_custom_op", {"X": ["fc_0.tmp_1"], "Bias": ["fc_b"]},
                                {"Out": ["custom_0.tmp_0"]}, {"alpha": 0.5, "mode": "fast", "axes": [1, 2]})
    with pytest.raises(UnknownOpError):
        make_op("my_custom_op", {}, {}, {})  # really unknown to the catalogue
    result = transpile(main, startup, pservers=EPS, trainers=2, sync_mode=sync_mode, verify=True)

    ops = result.trainer.global_block().ops
    (kept,) = [op for op in ops if op.type == "my_custom_op"]
    assert (dict(kept.inputs), dict(kept.outputs), dict(kept.attrs)) == (
        dict(custom.inputs), dict(custom.outputs), dict(custom.attrs))
    assert [(name, kept.attr_type(name)) for name in kept.attrs] == [(n, custom.attr_type(n)) for n in custom.attrs]
    before, after = ops[kept.index - 1], ops[kept.index + 1]
    assert (before.type, before.output("Out"), after.type, after.input("X")) == (
        "elementwise_add", ("fc_0.tmp_1",), "elementwise_sub", ("fc_0.tmp_1",))
    assert result.trainer.global_block().var("custom_0.tmp_0").shape == (-1, 1000)
    for pserver, _ in result.pservers.values():  # it is forward work: it never leaves the trainer
        assert "my_custom_op" not in [op.type for b in pserver.blocks for op in b.ops]


PASS_FOLDERS = ["01_lower_async_lr_decay", "02_keep_clip_on_trainer", "03_find_optimize", "04_slice_vars",
                "05_drop_optimize", "06_distribute_lookups", "07_insert_sends", "08_insert_recvs", "09_drop_unused_vars",
                "10_trainer_startup", "11_pserver_lr_decay", "12_pserver_optimize_blocks", "13_pserver_norm_reduce",
                "14_pserver_table_blocks", "15_pserver_serve", "16_pserver_startup"]


def test_dump_dir_has_every_program_after_every_pass(tmp_path):
    basic(dump_dir=tmp_path)
    passes = sorted(p.name for p in tmp_path.iterdir())
    assert passes == PASS_FOLDERS
    for name in passes:  # no pass folder is empty: each holds the whole state after its pass
        files = sorted(p.name for p in (tmp_path / name).iterdir())
        assert {"origin.txt", "origin_startup.txt"} <= set(files), (name, files)
        assert ("analysis.txt" in files) == (name >= "03")  # the analysis exists from find_optimize on
        assert ("plan.json" in files) == (name >= "04")
        assert all((tmp_path / name / f).stat().st_size > 0 for f in files)
    last = sorted(p.name for p in (tmp_path / passes[-1]).iterdir())
    assert "trainer.txt" in last and "plan.json" in last and "pserver_127_0_0_1_6175_startup.txt" in last
    analysis = (tmp_path / "03_find_optimize" / "analysis.txt").read_text()
    assert "param fc_w grad=fc_w@GRAD optimizer=" in analysis and "optimize_ops [" in analysis
    assert (tmp_path / "03_find_optimize" / "origin.txt").read_text().startswith("# ps-transpiler dump")


def test_a_reused_dump_dir_holds_only_the_latest_run(tmp_path):
    main, startup = load("fluid18_basic_sgd_2ps")
    transpile(main, startup, pservers="127.0.0.1:1,127.0.0.1:2,127.0.0.1:3", trainers=1, dump_dir=tmp_path)
    transpile(main, startup, pservers="127.0.0.1:1", trainers=1, dump_dir=tmp_path)
    last = sorted(p.name for p in (tmp_path / PASS_FOLDERS[-1]).iterdir())
    assert [f for f in last if f.startswith("pserver_")] == ["pserver_127_0_0_1_1.txt", "pserver_127_0_0_1_1_startup.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left behind


def test_dump_dir_shows_what_the_async_lr_decay_lowering_rewrote(tmp_path):
    from transpiler.ir.printer import dump

    main, startup = load("fluid18_lr_exp_decay_2ps")
    transpile(main, startup, pservers=EPS, trainers=2, sync_mode=False, dump_dir=tmp_path)
    before = dump(main)
    after = (tmp_path / "01_lower_async_lr_decay" / "origin.txt").read_text()
    assert " increment X=[@LR_DECAY_COUNTER@]" in before and " increment " not in after
    assert " sum X=[@LR_DECAY_COUNTER@.trainer_0, @LR_DECAY_COUNTER@.trainer_1]" in after
    assert "lr_counter @LR_DECAY_COUNTER@ updated_by=0:sum" in (
        tmp_path / "03_find_optimize" / "analysis.txt").read_text()
    assert (tmp_path / "01_lower_async_lr_decay" / "origin_startup.txt").read_text() != dump(startup)


DUMP_SCRIPT = """
import sys
from transpiler.api import transpile
from transpiler.ir import Program
root, out = sys.argv[1], sys.argv[2]
for case, sync in (("fluid18_ctr_dist_sgd_2ps", True), ("fluid18_lr_exp_decay_2ps", False)):
    main = Program.load(f"{root}/{case}/main.pb"); startup = Program.load(f"{root}/{case}/startup.pb")
    transpile(main, startup, pservers="a:1,b:2,c:3", trainers=2, sync_mode=sync, split_method="hash_name",
              dump_dir=f"{out}/{case}")
"""


def test_dumps_are_identical_under_any_hash_seed(tmp_path):
    trees = []
    for seed in ("0", "4242"):
        out = tmp_path / seed
        run_with_hash_seed(seed, DUMP_SCRIPT, PADDLE_PROGRAMS, out)
        trees.append({str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()})
    assert len(trees[0]) > 30 and trees[0] == trees[1]


def test_save_writes_every_file(tmp_path):
    written = basic().save(tmp_path / "out")
    names = sorted(p.name for p in written)
    assert names == sorted(["trainer.pb", "trainer_startup.pb", "pserver_127.0.0.1_6174.pb",
                            "pserver_127.0.0.1_6174_startup.pb", "pserver_127.0.0.1_6175.pb",
                            "pserver_127.0.0.1_6175_startup.pb", "plan.json"])
    assert Program.load(tmp_path / "out" / "trainer.pb").to_bytes() == basic().trainer.to_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def docs_python_snippets(section: str) -> list[str]:
    """The ```python blocks of one `## section` of docs/api.md (up to its first `###`)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    start = text.index(f"\n## {section}\n")
    return re.findall(r"```python\n(.*?)```", text[start:text.index("\n### ", start)], re.S)


def test_docs_python_api_snippets_run(tmp_path, monkeypatch):
    first, paddle = docs_python_snippets("Transpiling: the Python API")
    for name in ("main.pb", "startup.pb"):
        shutil.copy(PADDLE_PROGRAMS / "mlp_adam_2ps" / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    ours, theirs = {}, {}
    exec(compile(first, "docs/api.md", "exec"), ours)
    exec(compile(paddle, "docs/api.md", "exec"), theirs)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "plan.json", "pserver_10.0.0.1_6170.pb", "pserver_10.0.0.1_6170_startup.pb", "pserver_10.0.0.2_6170.pb",
        "pserver_10.0.0.2_6170_startup.pb", "trainer.pb", "trainer_startup.pb"]
    result, t = ours["result"], theirs["t"]
    assert theirs["trainer"].to_bytes() == result.trainer.to_bytes()
    assert theirs["trainer_startup"].to_bytes() == result.trainer_startup.to_bytes()
    assert theirs["pserver"].to_bytes() == ours["main0"].to_bytes() == t.get_pserver_program("10.0.0.1:6170").to_bytes()
    assert (theirs["pserver_startup"].to_bytes() == ours["startup0"].to_bytes()
            == t.get_startup_program("10.0.0.1:6170", theirs["pserver"]).to_bytes())


DETERMINISM_SCRIPT = """
import hashlib, sys
from transpiler.api import transpile
from transpiler.ir import Program
root = sys.argv[1]
digest = hashlib.sha256()
for case, method in (("mlp_adam_2ps", "hash_name"), ("fluid18_lr_piecewise_2ps", "round_robin")):
    main = Program.load(f"{root}/{case}/main.pb"); startup = Program.load(f"{root}/{case}/startup.pb")
    for sync in (True, False):
        r = transpile(main, startup, pservers="a:1,b:2,c:3", trainers=3, trainer_id=1, sync_mode=sync,
                      split_method=method)
        for p in (r.trainer, r.trainer_startup, *[x for pair in r.pservers.values() for x in pair]):
            digest.update(p.to_bytes())
        digest.update(r.plan.to_json_text().encode())
print(digest.hexdigest())
"""


def run_with_hash_seed(seed: str, script: str, *args) -> str:
    """Run `script` in a fresh interpreter with PYTHONHASHSEED=seed; its stdout."""
    env = {**os.environ, "PYTHONHASHSEED": seed}
    root = Path(__file__).resolve().parents[1]
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], env=env, cwd=root,
                          capture_output=True, text=True, check=True).stdout


def test_byte_identical_output_under_any_hash_seed():
    digests = {run_with_hash_seed(seed, DETERMINISM_SCRIPT, PADDLE_PROGRAMS).strip() for seed in ("0", "1", "4242")}
    assert len(digests) == 1


@pytest.mark.parametrize("case", ["plain", "clip", "async_lr_decay"])
def test_the_callers_programs_are_lent_never_changed_nor_frozen(case):
    """transpile() hands the caller's programs to the passes without copying them: none may
    change them, the lowerings that rewrite the original (clip ops kept on the trainer, the
    async lr-decay counter) work on copies, and the analysed original is not frozen."""
    from pass_support import tiny
    from test_pass_keep_clip_on_trainer import clipped

    from transpiler.frontend.clip import GradientClipByValue

    main, startup = clipped(GradientClipByValue(1.0)) if case == "clip" else tiny(lr_decay=case == "async_lr_decay")
    before = (main.to_bytes(), startup.to_bytes())
    roles = [op.attr("op_role") for op in main.global_block().ops]
    result = transpile(main, startup, pservers=EPS, trainers=2, sync_mode=case != "async_lr_decay", clip_mode="trainer")
    assert (main.to_bytes(), startup.to_bytes()) == before
    assert [op.attr("op_role") for op in main.global_block().ops] == roles
    assert not main.frozen and not startup.frozen
    if case == "clip":  # the trainer keeps the clip ops, as Backward ops, and sends the clipped grads
        assert any(op.type == "clip" for op in result.trainer.global_block().ops)
    if case == "async_lr_decay":
        assert any(name.startswith("@LR_DECAY_COUNTER@.trainer_") for name in result.trainer_startup.global_block().vars)
    # The result shares nothing the caller can change through its own programs.
    trainer_bytes = result.trainer.to_bytes()
    for op in main.global_block().ops:
        op.set_attr("op_role", 0)
        if op.input("X"):
            op.set_input("X", ["changed"])
    main.global_block().create_var("added_after", dtype="float32", shape=(1,))
    assert result.trainer.to_bytes() == trainer_bytes
