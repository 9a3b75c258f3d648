"""The program builder: layers, names, initializers, backward, optimizers, lr decay,
regularisation and clipping, misuse errors, serialisation and determinism."""

from __future__ import annotations

import hashlib
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from conftest import PADDLE_PROGRAMS
from transpiler.errors import PsTranspilerError, UnknownOpError
from transpiler.frontend import (
    BuildError,
    ParamAttr,
    Program,
    append_backward,
    data,
    initializer,
    layers,
    optimizer,
    program_guard,
    regularizer,
    unique_name,
)
from transpiler.frontend import fluid18_networks as nets
from transpiler.frontend.clip import GradientClipByGlobalNorm, GradientClipByNorm, GradientClipByValue
from transpiler.ir import AttrType, DType, OpRole, VarKind
from transpiler.ir import Program as IRProgram
from transpiler.ir.verifier import verify

ROOT = Path(__file__).resolve().parents[1]


def build(body, *, startup_seed: int = 0):
    main, startup = Program(), Program()
    startup.random_seed = startup_seed
    with unique_name.guard(), program_guard(main, startup):
        result = body()
    return main, startup, result


def types(program, block=0):
    return [op.type for op in program.block(block).ops]


def op_of(program, op_type, index=0):
    return [op for op in program.global_block().ops if op.type == op_type][index]


# ------------------------------------------------------------------ layers and names


def test_fc_names_shapes_and_ops_follow_fluid():
    def body():
        x = layers.data(name="x", shape=[13], dtype="float32")
        h = layers.fc(input=x, size=8, act="tanh")
        return layers.fc(input=h, size=1, param_attr=ParamAttr(name="out.w"), bias_attr=False)

    main, startup, out = build(body)
    block = main.global_block()
    assert types(main) == ["mul", "elementwise_add", "tanh", "mul"]
    assert block.var("fc_0.w_0").shape == (13, 8) and block.var("fc_0.b_0").shape == (8,)
    assert [block.var(f"fc_0.tmp_{i}").shape for i in range(3)] == [(-1, 8)] * 3
    assert out.name == "fc_1.tmp_0" and out.shape == (-1, 1)
    assert block.var("out.w").persistable and not block.var("out.w").is_parameter
    x = block.var("x")
    assert x.shape == (-1, 13) and not x.need_check_feed and not x.stop_gradient  # Fluid 1.8 wrote neither flag
    assert op_of(main, "elementwise_add").attr("axis") == 1
    assert types(startup) == ["uniform_random", "fill_constant", "uniform_random"]  # prepended: last created first
    assert list(startup.global_block().vars) == ["fc_0.w_0", "fc_0.b_0", "out.w"]


def test_fc_over_several_inputs_sums_the_products():
    def body():
        a = layers.data(name="a", shape=[4])
        b = layers.data(name="b", shape=[6])
        return layers.fc(input=[a, b], size=3)

    main, _, out = build(body)
    assert types(main) == ["mul", "mul", "sum", "elementwise_add"]
    assert main.global_block().var("fc_0.w_1").shape == (6, 3)


def test_fluid_data_and_lod_inputs():
    def body():
        img = data(name="img", shape=[None, 784])
        words = layers.data(name="words", shape=[1], dtype="int64", lod_level=1)
        return img, words

    main, _, (img, words) = build(body)
    assert img.shape == (-1, 784) and main.global_block().var("img").need_check_feed
    assert words.shape == (-1, 1) and words.lod_level == 1 and words.dtype == DType.INT64


def test_embedding_and_sequence_pool():
    def body():
        ids = layers.data(name="ids", shape=[1], dtype="int64", lod_level=1)
        emb = layers.embedding(ids, size=[50, 8], is_sparse=True, padding_idx=-1)
        return emb, layers.sequence_pool(emb, pool_type="max")

    main, startup, (emb, pooled) = build(body)
    lookup = op_of(main, "lookup_table")
    assert lookup.attr("padding_idx") == 49 and lookup.attr_type("padding_idx") == AttrType.LONG
    assert lookup.attr("is_sparse") and not lookup.attr("is_distributed") and lookup.attr("remote_prefetch")
    assert emb.shape == (-1, 8) and emb.lod_level == 1
    assert pooled.shape == (-1, 8) and pooled.lod_level == 0
    pool = op_of(main, "sequence_pool")
    assert pool.attr("pooltype") == "MAX" and main.global_block().var(pool.output("MaxIndex")[0]).shape == (-1, 8)
    (init,) = startup.global_block().ops
    assert init.type == "uniform_random" and math.isclose(init.attr("max"), math.sqrt(6 / 58), rel_tol=1e-6)


def test_math_layers_and_operator_overloading():
    def body():
        x = layers.data(name="x", shape=[4])
        y = layers.data(name="y", shape=[4])
        outs = [
            layers.relu(x), layers.sigmoid(x), layers.softmax(x), layers.reduce_sum(x, dim=1),
            layers.reduce_mean(x), layers.sum([x, y]), layers.scale(x, scale=2.0, bias=1.0),
            layers.elementwise_mul(x, y), layers.concat([x, y], axis=1),
        ]
        outs += [x + 1.0, 2.0 * x, x / 4, x - y, x * y]
        return outs

    main, _, outs = build(body)
    assert types(main) == ["relu", "sigmoid", "softmax", "reduce_sum", "reduce_mean", "sum", "scale",
                           "elementwise_mul", "concat", "scale", "scale", "scale", "elementwise_sub", "elementwise_mul"]
    assert [o.shape for o in outs[3:5]] == [(-1,), (1,)]
    assert outs[8].shape == (-1, 8)
    assert [o.name for o in outs[9:]] == ["tmp_0", "tmp_1", "tmp_2", "tmp_3", "tmp_4"]
    scales = [op for op in main.global_block().ops if op.type == "scale"][1:]
    assert [(op.attr("scale"), op.attr("bias")) for op in scales] == [(1.0, 1.0), (2.0, 0.0), (0.25, 0.0)]
    assert op_of(main, "elementwise_sub").attr("axis") == 0  # Fluid: a batch-sized Y is aligned at 0


def test_initializers_prepend_and_take_the_startup_seed():
    def body():
        x = layers.data(name="x", shape=[3])
        layers.fc(input=x, size=2, param_attr=ParamAttr(name="w", initializer=initializer.Normal(0.0, 0.5)),
                  bias_attr=ParamAttr(name="b", initializer=initializer.Constant(0.25)))
        layers.fc(input=x, size=2, param_attr=ParamAttr(name="v", initializer=initializer.Uniform(-0.1, 0.1, seed=7)))

    _, startup, _ = build(body, startup_seed=42)
    ops = startup.global_block().ops
    assert [op.type for op in ops] == ["fill_constant", "uniform_random", "fill_constant", "gaussian_random"]
    gauss, uniform = ops[3], ops[1]
    assert gauss.attr("seed") == 42 and gauss.attr("std") == 0.5 and gauss.attr("shape") == (3, 2)
    assert uniform.attr("seed") == 7 and uniform.attr("min") == pytest.approx(-0.1)
    assert ops[2].attr("value") == 0.25 and ops[2].attr_type("shape") == AttrType.LONGS


def test_shared_parameter_is_initialised_once():
    main, startup = nets.ctr_dist_model()
    inits = [op for op in startup.global_block().ops if op.output("Out") == ("emb",)]
    assert len(inits) == 1


# ------------------------------------------------------------------ backward


def test_backward_roles_seed_and_role_vars():
    main, _ = nets.basic_model()
    ops = main.global_block().ops
    roles = {op.type: op.attr("op_role") for op in ops}
    assert roles["mean"] == int(OpRole.Loss) == 256
    assert roles["mean_grad"] == int(OpRole.Backward) == 1
    assert roles["sgd"] == int(OpRole.Optimize) == 2
    seed = op_of(main, "fill_constant")
    assert seed.attr("op_role") == 257 and seed.output("Out") == ("mean_0.tmp_0@GRAD",)
    assert set(seed.attrs) == {"dtype", "force_cpu", "op_device", "op_role", "shape", "value"}
    assert op_of(main, "mul_grad").attr("op_role_var") == ("fc_w", "fc_w@GRAD")
    assert op_of(main, "mul_grad").output("X@GRAD") == ()  # x is data: no grad
    assert op_of(main, "elementwise_sub_grad").output("Y@GRAD") == ()


def test_backward_renames_and_sums_repeated_grads():
    def body():
        x = layers.data(name="x", shape=[4])
        shared = ParamAttr(name="shared")
        a = layers.fc(input=x, size=4, param_attr=shared, bias_attr=False)
        b = layers.fc(input=a, size=4, param_attr=shared, bias_attr=False)
        loss = layers.mean(b)
        return append_backward(loss)

    main, _, pairs = build(body)
    assert [(p.name, g.name) for p, g in pairs] == [("shared", "shared@GRAD")]
    grads = types(main)[types(main).index("fill_constant"):]
    assert grads == ["fill_constant", "mean_grad", "mul_grad", "mul_grad", "sum"]
    first, second, total = [op for op in main.global_block().ops if op.type in ("mul_grad", "sum")]
    assert first.output("Y@GRAD") == ("shared@GRAD@RENAME@block0@0",)
    assert second.output("Y@GRAD") == ("shared@GRAD@RENAME@block0@1",)
    assert total.input("X") == ("shared@GRAD@RENAME@block0@0", "shared@GRAD@RENAME@block0@1")
    assert total.attr("op_role_var") == ("shared", "shared@GRAD") and first.attr("op_role_var") == ()
    assert main.global_block().var("shared@GRAD@RENAME@block0@1").shape == (4, 4)


def test_sparse_table_grads_are_selected_rows():
    main, _ = nets.ctr_dist_model(is_distributed=False)
    block = main.global_block()
    assert block.var("emb@GRAD").kind == VarKind.SELECTED_ROWS
    assert block.var("emb@GRAD@RENAME@block0@2").kind == VarKind.SELECTED_ROWS
    dense, _ = nets.ctr_dist_model(is_sparse=False, is_distributed=False)
    assert dense.global_block().var("emb@GRAD").kind == VarKind.LOD_TENSOR


def test_second_backward_pass_renames_existing_grads():
    def body():
        x = layers.data(name="x", shape=[4])
        loss = layers.mean(layers.fc(input=x, size=1, param_attr="w", bias_attr=False))
        append_backward(loss)
        return append_backward(loss)

    main, _, pairs = build(body)
    assert pairs[0][1].name == "w@GRAD_0"


# ------------------------------------------------------------------ optimizers


def test_momentum_accumulators_and_startup():
    main, startup = nets.optimizer_model("momentum")
    block = main.global_block()
    assert block.var("fc_w_velocity_0").persistable and block.var("fc_w_velocity_0").shape == (1000, 1000)
    op = op_of(main, "momentum")
    assert op.input("Velocity") == ("fc_b_velocity_0",) and op.output("VelocityOut") == ("fc_b_velocity_0",)
    assert op.attr("mu") == pytest.approx(0.9) and op.attr("use_nesterov") is False
    assert types(startup) == ["fill_constant"] * 4 + ["uniform_random"]
    assert startup.global_block().ops[0].output("Out") == ("learning_rate_0",)


def test_adam_updates_its_beta_powers_itself():
    main, startup = nets.optimizer_model("adam")
    assert types(main)[-2:] == ["adam", "adam"] and "scale" not in types(main)
    op = op_of(main, "adam", 1)
    assert op.input("Beta1Pow") == ("fc_w_beta1_pow_acc_0",) and op.output("Beta2PowOut") == ("fc_w_beta2_pow_acc_0",)
    assert op.attr_type("min_row_size_to_use_multithread") == AttrType.LONG
    beta = [o for o in startup.global_block().ops if o.output("Out") == ("fc_w_beta2_pow_acc_0",)][0]
    assert beta.attr("value") == pytest.approx(0.999) and beta.attr("op_device") == "cpu" and beta.attr("shape") == (1,)
    for name in ("fc_w_moment1_0", "fc_w_moment2_0", "fc_w_beta1_pow_acc_0"):
        assert main.global_block().var(name).persistable and startup.global_block().var(name).persistable


def test_adagrad_moment():
    main, startup = nets.optimizer_model("adagrad")
    op = op_of(main, "adagrad")
    assert op.input("Moment") == ("fc_b_moment_0",) and op.attr("epsilon") == pytest.approx(1e-6)
    assert "fc_w_moment_0" in startup.global_block().vars


def test_per_parameter_learning_rate_is_an_lr_op():
    def body():
        x = layers.data(name="x", shape=[4])
        loss = layers.mean(layers.fc(input=x, size=1, param_attr=ParamAttr(name="w", learning_rate=0.5), bias_attr=False))
        optimizer.SGD(learning_rate=0.1).minimize(loss)

    main, _, _ = build(body)
    scale = op_of(main, "scale")
    assert scale.attr("op_role") == int(OpRole.LRSched | OpRole.Optimize) == 18
    assert op_of(main, "sgd").input("LearningRate") == scale.output("Out")


def test_distributed_table_is_updated_by_sgd_first():
    main, _ = nets.ctr_dist_model()
    optimize = [op for op in main.global_block().ops if op.role == OpRole.Optimize]
    assert [op.role_vars[0] for op in optimize] == ["emb", "ctr_fc.b", "ctr_fc.w", "ctr_out.b", "ctr_out.w"]


def test_distributed_table_optimizer_replaces_fluids_sgd_without_clip_or_regularisation():
    def body():
        ids = layers.data(name="ids", shape=[1], dtype="int64")
        emb = layers.embedding(ids, size=[10, 4], is_sparse=True, is_distributed=True, param_attr=ParamAttr(name="emb"))
        loss = layers.mean(layers.fc(input=emb, size=1, param_attr=ParamAttr(name="w"), bias_attr=False))
        sgd = optimizer.SGD(learning_rate=0.1, regularization=regularizer.L2Decay(1e-4), grad_clip=GradientClipByValue(1.0))
        sgd.distributed_table_optimizer = optimizer.Adam(learning_rate=0.01, lazy_mode=True)
        sgd.minimize(loss)

    main, startup, _ = build(body)
    optimize = [(op.type, op.role_vars[0]) for op in main.global_block().ops if op.role == OpRole.Optimize]
    assert optimize[0] == ("adam", "emb") and ("sgd", "w") in optimize
    assert [op.type for op in main.global_block().ops if "emb" in op.role_vars and op.role == OpRole.Optimize] == ["adam"]
    adam = op_of(main, "adam")
    assert adam.attr("lazy_mode") and adam.input("Moment1") == ("emb_moment1_0",)
    assert {"emb_moment1_0", "emb_moment2_0", "emb_beta1_pow_acc_0"} <= set(startup.global_block().vars)

    def itself():
        ids = layers.data(name="ids", shape=[1], dtype="int64")
        emb = layers.embedding(ids, size=[10, 4], is_sparse=True, is_distributed=True, param_attr=ParamAttr(name="emb"))
        adam = optimizer.Adam(learning_rate=0.01)
        adam.distributed_table_optimizer = adam
        adam.minimize(layers.mean(layers.fc(input=emb, size=1, param_attr=ParamAttr(name="w"), bias_attr=False)))

    main, _, _ = build(itself)
    assert [(op.type, op.role_vars[0]) for op in main.global_block().ops if op.role == OpRole.Optimize] == [
        ("adam", "emb"), ("adam", "w")]


# ------------------------------------------------------------------ lr decay, L2, clip


def test_exponential_decay_ops():
    main, startup = nets.lr_decay_model()
    lr_ops = [op for op in main.global_block().ops if op.role == OpRole.LRSched]
    assert [op.type for op in lr_ops] == ["increment", "cast", "scale", "floor", "fill_constant", "elementwise_pow", "scale"]
    assert main.global_block().ops[0].type == "increment"
    assert lr_ops[2].attr("scale") == pytest.approx(1 / 2100)
    counter = startup.global_block().ops[0]
    assert counter.output("Out") == ("@LR_DECAY_COUNTER@",) and counter.attr("force_cpu") and counter.attr("value") == -1
    assert main.global_block().var("@LR_DECAY_COUNTER@").dtype == DType.INT64


def test_inverse_time_and_natural_exp_decay_ops():
    def body(decay):
        def inner():
            lr = decay(learning_rate=0.5, decay_steps=10, decay_rate=0.5)
            _ = lr  # built for its ops
        return inner

    for decay, expected in (
        (layers.inverse_time_decay, ["increment", "cast", "scale", "scale", "scale", "fill_constant", "elementwise_div"]),
        (layers.natural_exp_decay, ["increment", "cast", "scale", "scale", "exp", "scale"]),
    ):
        main, _, _ = build(body(decay))
        assert types(main) == expected
        assert all(op.role == OpRole.LRSched for op in main.global_block().ops)


def test_piecewise_decay_sub_blocks():
    main, _ = nets.lr_decay_conditional_model()
    conds = [op for op in main.global_block().ops if op.type == "conditional_block"]
    assert [op.attr("sub_block") for op in conds] == [1, 2, 3]
    assert all(op.attr_type("sub_block") == AttrType.BLOCK for op in conds)
    assert [op.input("Input") for op in conds] == [("fill_constant_1.tmp_0",), ("fill_constant_3.tmp_0",),
                                                   ("fill_constant_4.tmp_0",)]
    assert main.global_block().var("_generated_var_0").kind == VarKind.STEP_SCOPES
    for idx in (1, 2, 3):
        block = main.block(idx)
        assert block.parent_idx == 0 and [op.output("Out") for op in block.ops] == [("learning_rate",)]


def test_l2_decay_and_clip_ops_carry_the_optimizer_roles():
    main, _ = nets.l2_decay_model()
    ops = main.global_block().ops
    tail = [(op.type, op.role_vars) for op in ops if op.role == OpRole.Optimize]
    assert tail == [
        ("clip", ("fc_w", "clip_0.tmp_0")),
        ("scale", ("fc_w", "clip_0.tmp_0")),
        ("sum", ("fc_w", "clip_0.tmp_0")),
        ("sgd", ("fc_b", "fc_b@GRAD")),
        ("sgd", ("fc_w", "clip_0.tmp_0")),
    ]
    clip = op_of(main, "clip")
    assert (clip.attr("min"), clip.attr("max")) == (pytest.approx(-0.1), pytest.approx(0.1))
    assert op_of(main, "scale").output("Out") == ("_generated_var_0",)
    assert op_of(main, "sum").input("X") == ("clip_0.tmp_0", "_generated_var_0")


def test_param_attr_gradient_clip_and_regularizer():
    def body():
        x = layers.data(name="x", shape=[4])
        attr = ParamAttr(name="w", regularizer=regularizer.L2Decay(0.01), gradient_clip=GradientClipByValue(1.0))
        loss = layers.mean(layers.fc(input=x, size=1, param_attr=attr, bias_attr=False))
        optimizer.SGD(learning_rate=0.1).minimize(loss)

    main, _, _ = build(body)
    assert types(main)[-4:] == ["clip", "scale", "sum", "sgd"]
    assert op_of(main, "scale").attr("scale") == pytest.approx(0.01)


# ------------------------------------------------------------------ misuse


def test_mul_of_shapes_that_cannot_multiply():
    def body():
        x = layers.data(name="x", shape=[784])
        w = layers.data(name="w", shape=[1000, 10], append_batch_size=False)
        layers.mul(x, w)

    with pytest.raises(BuildError, match=r"^mul_0: .*X \[-1, 784\] and Y \[1000, 10\] cannot multiply"):
        build(body)


def test_shared_param_with_another_shape():
    def body():
        x = layers.data(name="x", shape=[784])
        h = layers.fc(input=x, size=10, param_attr="w")
        layers.fc(input=h, size=10, param_attr="w")

    with pytest.raises(BuildError, match=r"^fc_1: var 'w' exists with shape \[784, 10\]; .* \[10, 10\]"):
        build(body)


def test_grad_of_a_non_float_var():
    def body():
        ids = layers.data(name="ids", shape=[4], dtype="int64", stop_gradient=False)
        loss = layers.mean(layers.fc(input=layers.cast(ids, "float32"), size=1))
        append_backward(loss)

    with pytest.raises(BuildError, match=r"^append_backward: .*'ids' \(int64 \[-1, 4\]\).*only float vars have gradients"):
        build(body)


def test_unknown_optimizer_argument():
    with pytest.raises(BuildError, match=r"^SGD: unknown argument\(s\) momentum \(it takes learning_rate"):
        optimizer.SGD(learning_rate=0.1, momentum=0.9)
    with pytest.raises(BuildError, match=r"^Adam: unknown argument\(s\) beta_1"):
        optimizer.Adam(learning_rate=0.1, beta_1=0.9)
    with pytest.raises(BuildError, match="learning_rate must be a float"):
        optimizer.Momentum(learning_rate="fast", momentum=0.9)

    def body():
        x = layers.data(name="x", shape=[4])
        loss = layers.mean(layers.fc(input=x, size=1))
        optimizer.SGD(0.1).minimize(loss, grad_clip=None)

    with pytest.raises(BuildError, match=r"^SGD: minimize\(\) got unknown argument\(s\) grad_clip"):
        build(body)


def test_other_misuse_names_the_layer():
    cases = {
        r"^SGD: the loss 'fc_0.tmp_1' has shape \[-1, 1\]": lambda: optimizer.SGD(0.1).minimize(
            layers.fc(input=layers.data(name="x", shape=[4]), size=1)),
        r"^sequence_pool_0: .*X \[-1, 4\] has no LoD": lambda: layers.sequence_pool(
            layers.data(name="x", shape=[4]), pool_type="sum"),
        r"^embedding_0: ids 'x' are fp32 \[-1, 1\]": lambda: layers.embedding(
            layers.data(name="x", shape=[1]), size=[10, 2]),
        r"^fc_0: input 'x' is int64 \[-1, 4\]": lambda: layers.fc(
            input=layers.data(name="x", shape=[4], dtype="int64"), size=2),
        r"^fc_0: input 'x' \[-1, -1\] has unknown feature dims": lambda: layers.fc(
            input=layers.data(name="x", shape=[-1, -1], append_batch_size=False), size=2),
        r"^piecewise_decay: len\(values\)": lambda: layers.piecewise_decay([1, 2], [1.0]),
        r"^elementwise_add_0: .*do not broadcast": lambda: layers.elementwise_add(
            layers.data(name="x", shape=[3]), layers.data(name="y", shape=[4], append_batch_size=False)),
    }
    for pattern, make in cases.items():
        with pytest.raises(BuildError, match=pattern):
            build(make)


def test_an_op_the_catalogue_does_not_know():
    with pytest.raises(UnknownOpError, match="fc_0: .*'selu'"):  # (gelu is catalogued now)
        build(lambda: layers.fc(input=layers.data(name="x", shape=[4]), size=2, act="selu"))

    def body():
        x = layers.data(name="x", shape=[4])
        h = layers.fc(input=x, size=2)
        block = h.block
        out = layers.create_tensor("float32", name="mystery_out")
        block.var("mystery_out").shape = (-1, 2)
        block.add_op("mystery_op", {"X": [h.name]}, {"Out": [out.name]})
        append_backward(layers.mean(out))

    with pytest.raises(UnknownOpError, match=r"op 2 \(mystery_op\) feeds the loss"):
        build(body)


def test_errors_are_project_errors():
    assert issubclass(BuildError, PsTranspilerError)


# ------------------------------------------------------------------ bytes


def _paddle_program_class():
    raw = (PADDLE_PROGRAMS / "framework_desc.bin").read_bytes()
    fdp = descriptor_pb2.FileDescriptorProto.FromString(raw)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{fdp.package}.ProgramDesc"))


@pytest.mark.parametrize("name", sorted(nets.NETWORKS))
def test_built_programs_verify_save_load_and_parse_in_paddle(name, tmp_path):
    paddle_program = _paddle_program_class()
    for i, program in enumerate(nets.NETWORKS[name]()):
        verify(program)
        path = tmp_path / f"{i}.pb"
        program.save(path)
        data = path.read_bytes()
        assert data == program.to_bytes()
        assert IRProgram.load(path).to_bytes() == data
        message = paddle_program.FromString(data)
        assert message.IsInitialized() and message.SerializeToString() == data
        stripped = paddle_program()
        stripped.CopyFrom(message)
        stripped.DiscardUnknownFields()
        assert stripped.ByteSize() == len(data)


_DIGEST_SCRIPT = """
import hashlib, importlib.util, sys
from transpiler.frontend import fluid18_networks as nets
h = hashlib.sha256()
for name in sorted(nets.NETWORKS):
    for program in nets.NETWORKS[name]():
        h.update(program.to_bytes())
for example in ("seed_fc3", "mlp", "ctr"):
    spec = importlib.util.spec_from_file_location(example, f"examples/{example}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for program in module.build():
        h.update(program.to_bytes())
print(h.hexdigest())
"""


def test_same_bytes_in_every_process_whatever_the_hash_seed():
    digests = []
    for seed in ("0", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}
        result = subprocess.run([sys.executable, "-c", _DIGEST_SCRIPT], cwd=ROOT, env=env, capture_output=True,
                                text=True, check=True, timeout=120)
        digests.append(result.stdout.strip())
    assert digests[0] == digests[1] and len(digests[0]) == 64


def test_rebuilding_in_one_process_gives_the_same_bytes():
    first = [p.to_bytes() for p in nets.lr_decay_conditional_model()]
    nets.network_with_table(True, True)  # other builds in between must not shift names
    again = [p.to_bytes() for p in nets.lr_decay_conditional_model()]
    assert first == again
    assert hashlib.sha256(b"".join(first)).hexdigest() == hashlib.sha256(b"".join(again)).hexdigest()


# ------------------------------------------------------------------ gradient clip kinds


def _two_layer(clip, via):
    """x [8] → fc 4 (w1, b1) → fc 1 (w2, b2) → square error → mean, SGD(0.1) with `clip`."""
    from transpiler.frontend.clip import set_gradient_clip

    def body():
        x, y = layers.data(name="x", shape=[8]), layers.data(name="y", shape=[1])
        h = layers.fc(input=x, size=4, param_attr=ParamAttr(name="w1"), bias_attr=ParamAttr(name="b1"))
        out = layers.fc(input=h, size=1, param_attr=ParamAttr(name="w2"), bias_attr=ParamAttr(name="b2"))
        loss = layers.mean(layers.square_error_cost(out, y))
        if via == "grad_clip":
            optimizer.SGD(learning_rate=0.1, grad_clip=clip).minimize(loss)
        else:
            set_gradient_clip(clip)
            optimizer.SGD(learning_rate=0.1).minimize(loss)
        return loss

    return build(body)


# What the paddlepaddle 1.8.5 wheel builds for this network (its ops after the backward pass).
GLOBAL_NORM_BY_GRAD_CLIP = ["square", "reduce_sum"] * 4 + ["sum", "sqrt", "fill_constant", "elementwise_max",
                                                           "elementwise_div"] + ["elementwise_mul"] * 4
GLOBAL_NORM_BY_SET_CLIP = ["fill_constant"] + ["square", "reduce_sum"] * 4 + ["sum", "sqrt", "elementwise_max",
                                                                              "elementwise_div"] + ["elementwise_mul"] * 4


@pytest.mark.parametrize(("make", "via", "clip_types"), [
    (lambda: GradientClipByNorm(1.0), "grad_clip", ["clip_by_norm"] * 4),
    (lambda: GradientClipByNorm(1.0), "set", ["clip_by_norm"] * 4),
    (lambda: GradientClipByGlobalNorm(1.0), "grad_clip",
     GLOBAL_NORM_BY_GRAD_CLIP),
    (lambda: GradientClipByGlobalNorm(1.0), "set",
     GLOBAL_NORM_BY_SET_CLIP),
], ids=["norm-grad_clip", "norm-set", "global_norm-grad_clip", "global_norm-set"])
def test_clip_ops_are_fluid18s(make, via, clip_types):
    main, _, _ = _two_layer(make(), via)
    verify(main)
    optimize = [op for op in main.global_block().ops if op.role == OpRole.Optimize]
    assert [op.type for op in optimize] == clip_types + ["sgd"] * 4
    clipped = [op.input("Grad")[0] for op in optimize if op.type == "sgd"]
    last = {op.output("Out")[0]: op for op in optimize if op.type != "sgd"}
    assert all(name in last for name in clipped)  # each sgd reads its grad's clip
    scopes = {op.attr("op_namescope") for op in optimize if op.type != "sgd"}
    assert all(("gradient_clip" if via == "grad_clip" else "@CLIP") in s for s in scopes)


def test_local_training_with_each_clip_kind_clips():
    """One SGD step from the same params: a clip that bites changes the update as it should."""
    import numpy as np

    from ops.executor import Executor
    from ops.scope import Scope

    rng = np.random.default_rng(0)
    feed = {"x": rng.standard_normal((16, 8)).astype(np.float32) * 3, "y": rng.standard_normal((16, 1)).astype(np.float32)}

    def step(clip):
        main, startup, loss = _two_layer(clip, "grad_clip")
        exe, scope = Executor(seed=0), Scope()
        exe.run(startup, scope=scope)
        before = {p: np.array(scope.find_var(p).array) for p in ("w1", "b1", "w2", "b2")}
        exe.run(main, feed=feed, fetch_list=[loss.name], scope=scope)
        return {p: (before[p] - scope.find_var(p).array) / 0.1 for p in before}  # the grad sgd applied

    plain = step(GradientClipByValue(1e9))
    by_value = step(GradientClipByValue(0.01))
    assert all(np.allclose(by_value[p], np.clip(plain[p], -0.01, 0.01), atol=1e-6) for p in plain)
    by_norm = step(GradientClipByNorm(0.1))
    for p in plain:
        norm = np.linalg.norm(plain[p])
        assert np.allclose(by_norm[p], plain[p] * min(1.0, 0.1 / norm), rtol=1e-4, atol=1e-7)
    by_global = step(GradientClipByGlobalNorm(0.1))
    total = np.sqrt(sum(np.sum(np.square(g, dtype=np.float64)) for g in plain.values()))
    assert total > 0.1
    assert all(np.allclose(by_global[p], plain[p] * 0.1 / total, rtol=1e-4, atol=1e-7) for p in plain)


def test_name_scopes_are_the_programs_so_a_rebuild_is_byte_identical():
    """Fluid's scope tree is the process's (a second build gets `/gradient_clip_1/`); ours
    is the main program's, so the same script gives the same bytes however often it runs."""
    first, _, _ = _two_layer(GradientClipByGlobalNorm(1.0), "set")
    second, _, _ = _two_layer(GradientClipByGlobalNorm(1.0), "set")
    assert first.to_bytes() == second.to_bytes()
    scopes = [op.attr("op_namescope") for op in first.global_block().ops if op.type == "elementwise_mul"]
    assert scopes == ["/graident_clip_@CLIP/", "/graident_clip_@CLIP_1/", "/graident_clip_@CLIP_2/",
                      "/graident_clip_@CLIP_3/"]
