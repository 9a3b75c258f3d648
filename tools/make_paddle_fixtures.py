"""Build the real-model fixtures (ResNet-50, a small ResNet, a BERT-base encoder, a small
BERT-style encoder, a GPT-style decoder) and the small control-flow programs with Paddle 2.6.2 and
record what Paddle's own legacy transpiler makes of them.

Run it from the repository root with the Paddle 2.6.2 reference venv (a test and tool
dependency only; the product never imports Paddle):

    $(python3 tools/paddle_env.py 2.6.2) tools/make_paddle_fixtures.py [CASE ...]

It writes tests/fixtures/paddle_programs/<case>/{main.pb,startup.pb,case.json,expected.json}
in the format of tests/fixtures/paddle_programs/README.md: `main.pb` / `startup.pb` are
`program.desc.serialize_to_string()` before transpiling, without the `op_callstack` attrs
(see `strip_callstacks`: with them each case folder is 4-8 MB); `expected.json` is the
output of Paddle's `DistributeTranspiler` (pserver mode, `RoundRobin`) with the attrs that
matter for placement kept and the random `__control_var@<random>` names renumbered
`__control_var@N` in order of appearance, written without indentation (1-1.5 MB each;
indented they would be twice that).

Deterministic: names and name scopes start afresh for each build; the programs'
`random_seed` stays at 0, which seeds the shuffle Paddle's transpiler gives unsliced grads;
and the script runs under `PYTHONHASHSEED=0` (it re-executes itself) because Paddle's
transpiler iterates sets of names (grad_to_block_id's order). Running it twice gives the
same bytes.
"""

from __future__ import annotations

import numpy.random  # noqa: F401  (before paddle: Paddle's bundled zlib breaks a later import)

import contextlib
import json
import os
import sys
from pathlib import Path

import paddle
from paddle.base import framework
from paddle.base.proto import framework_pb2
from paddle.distributed.transpiler import DistributeTranspiler, DistributeTranspilerConfig

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "paddle_programs"
MIN_BLOCK_SIZE = 8192

# The attrs expected.json keeps: the ones that say where things go (the same selection as
# the older fixtures).
KEPT_ATTRS = (
    "Fanin", "grad_to_block_id", "sparse_grad_to_param", "lr_decay_block_id", "distributed_mode", "endpoint",
    "epmap", "sections", "height_sections", "table_names", "send_varnames", "recv_varnames", "endpoints",
    "trainer_id", "axis",
)
CONTROL_VAR = "__control_var@"


def endpoints(count: int) -> str:
    return ",".join(f"127.0.0.1:{6170 + i}" for i in range(count))


# ---------------------------------------------------------------------- Paddle shim

_operator_init = framework.Operator.__init__


def _operator_init_unregistered(self, block, desc, type=None, inputs=None, outputs=None, attrs=None):
    """Paddle 2.6 no longer registers some ops its own legacy transpiler inserts
    (`split_byref`, ...), so `Operator` refuses them; build those descs by hand, slots and
    attrs as given, so the transpiler can finish. Registered ops go through Paddle as is."""
    if type is None or desc.type() or type in framework.OpProtoHolder.instance().op_proto_map:
        _operator_init(self, block, desc, type, inputs, outputs, attrs)
        return
    from paddle.static.amp.fp16_utils import DEFAULT_AMP_OPTIONS

    self.block, self.desc = block, desc
    self._cuda_graph_attr = framework._current_cuda_graph_mode
    self._amp_options = DEFAULT_AMP_OPTIONS
    desc.set_type(type)
    for slots, setter in ((inputs, desc.set_input), (outputs, desc.set_output)):
        for slot, args in (slots or {}).items():
            args = args if isinstance(args, (list, tuple)) else [args]
            setter(slot, [a if isinstance(a, str) else a.name for a in args])
    for args in (outputs or {}).values():
        for arg in args if isinstance(args, (list, tuple)) else [args]:
            if not isinstance(arg, str):
                arg.op = self
    attrs = dict(attrs or {})
    attrs.setdefault(framework.core.op_proto_and_checker_maker.kOpRoleAttrName(), block.program._op_role)
    for name, value in attrs.items():
        if value is not None:
            self._update_desc_attr(name, value)


framework.Operator.__init__ = _operator_init_unregistered


@contextlib.contextmanager
def empty_slots_hidden():
    """2.6's legacy transpiler reads `op.input(slot)[0]` of every optimizer slot
    (`_append_pserver_ops`, `_get_distributed_optimizer_vars`) and raises `IndexError` on
    2.6's own `momentum` op, whose optional `MasterParam` slot is written empty. While it
    runs, `Operator.input_names` leaves empty slots out (the pserver's optimizer op then
    has no `MasterParam` slot; nothing else changes)."""
    input_names = framework.Operator.input_names
    framework.Operator.input_names = property(lambda op: [n for n in op.desc.input_names() if op.desc.input(n)])
    try:
        yield
    finally:
        framework.Operator.input_names = input_names


# ---------------------------------------------------------------------- networks


def resnet50() -> str:
    image = paddle.static.data("image", [-1, 3, 224, 224], "float32")
    label = paddle.static.data("label", [-1, 1], "int64")
    logits = paddle.vision.models.resnet50(num_classes=1000)(image)
    loss = paddle.nn.functional.cross_entropy(logits, label)
    paddle.optimizer.Momentum(learning_rate=0.1, momentum=0.9).minimize(loss)
    return loss.name


def resnet_small() -> str:
    """ResNet-50's op types at a size that trains in seconds: ResNet-50's stem (7x7/2 conv,
    batch norm, relu, 3x3/2 max pool) on 32x32 images, three of paddle.vision's own
    `BottleneckBlock`s (the first two with a 1x1 conv + batch norm downsample, the second
    of stride 2, the third an identity shortcut), adaptive average pool, flatten, a 10-way
    linear head; Momentum as ResNet-50's."""
    from paddle import nn
    from paddle.vision.models.resnet import BottleneckBlock

    def downsample(inplanes: int, planes: int, stride: int):
        return nn.Sequential(nn.Conv2D(inplanes, planes, 1, stride=stride, bias_attr=False), nn.BatchNorm2D(planes))

    image = paddle.static.data("image", [-1, 3, 32, 32], "float32")
    label = paddle.static.data("label", [-1, 1], "int64")
    net = nn.Sequential(
        nn.Conv2D(3, 8, 7, stride=2, padding=3, bias_attr=False), nn.BatchNorm2D(8), nn.ReLU(),
        nn.MaxPool2D(kernel_size=3, stride=2, padding=1),
        BottleneckBlock(8, 4, downsample=downsample(8, 16, 1)),
        BottleneckBlock(16, 8, stride=2, downsample=downsample(16, 32, 2)),
        BottleneckBlock(32, 8),
        nn.AdaptiveAvgPool2D((1, 1)), nn.Flatten(1), nn.Linear(32, 10),
    )
    loss = paddle.nn.functional.cross_entropy(net(image), label)
    paddle.optimizer.Momentum(learning_rate=0.1, momentum=0.9).minimize(loss)
    return loss.name


def bert(clip: bool, vocab=30522, hidden=768, heads=12, layers=12, ffn=3072, max_len=512, seq=128) -> str:
    ids = paddle.static.data("src_ids", [-1, seq], "int64")
    pos = paddle.static.data("pos_ids", [-1, seq], "int64")
    label = paddle.static.data("label", [-1, 1], "int64")
    word = paddle.nn.Embedding(vocab, hidden, sparse=False)(ids)
    position = paddle.nn.Embedding(max_len, hidden, sparse=False)(pos)
    x = paddle.nn.Dropout(0.1)(paddle.nn.LayerNorm(hidden)(word + position))
    layer = paddle.nn.TransformerEncoderLayer(hidden, heads, ffn, dropout=0.1, activation="gelu")
    x = paddle.nn.TransformerEncoder(layer, layers)(x)
    pooled = paddle.tanh(paddle.nn.Linear(hidden, hidden)(x[:, 0]))
    logits = paddle.nn.Linear(hidden, 2)(paddle.nn.Dropout(0.1)(pooled))
    loss = paddle.nn.functional.cross_entropy(logits, label)
    grad_clip = paddle.nn.ClipGradByGlobalNorm(1.0) if clip else None
    paddle.optimizer.Adam(learning_rate=1e-4, grad_clip=grad_clip).minimize(loss)
    return loss.name


# ------------------------------------------------------------- control flow, recurrent
# Small float32 programs (`x` [N, 4] and `y` [N, 1] fed, mean square error, SGD). Each
# branch predicate depends on a parameter, not on the batch: every trainer then takes the
# branch local training takes, so distributed training can equal local training.


def _mse(out) -> str:
    y = paddle.static.data("y", [-1, 1], "float32")
    loss = paddle.mean(paddle.square(paddle.static.nn.fc(out, 1) - y))
    paddle.optimizer.SGD(learning_rate=0.1).minimize(loss)
    return loss.name


def _fc(h, name: str, activation=None):
    """An fc layer whose weight is called `name` (Paddle's `mul` op: no `matmul_v2`)."""
    return paddle.static.nn.fc(h, 8, weight_attr=paddle.ParamAttr(name=name), bias_attr=False, activation=activation)


def _first_bias_not_negative():
    """mean(fc_0.b_0) >= 0: a branch predicate on a parameter (see above); the bias starts
    at 0, so the first step takes the true branch, and training moves it."""
    return paddle.mean(paddle.static.default_main_program().global_block().var("fc_0.b_0")) >= 0.0


def cond_net() -> str:
    x = paddle.static.data("x", [-1, 4], "float32")
    h = paddle.static.nn.fc(x, 8)
    out = paddle.static.nn.cond(_first_bias_not_negative(), lambda: _fc(h, "gate_w", "tanh"),
                                lambda: _fc(h, "gate_v", "sigmoid") * 2.0)
    return _mse(out)


def switch_case_net() -> str:
    x = paddle.static.data("x", [-1, 4], "float32")
    h = paddle.static.nn.fc(x, 8)
    # 1 or 2 (branch 0 is never taken): 1 until training has moved the bias past 0.0005
    bias = paddle.static.default_main_program().global_block().var("fc_0.b_0")
    index = paddle.cast(paddle.mean(bias) >= 0.0005, "int64") + 1
    out = paddle.static.nn.switch_case(index, {
        0: lambda: h * 0.5,
        1: lambda: _fc(h, "switch_w1", "tanh"),
        2: lambda: _fc(h, "switch_w2", "sigmoid"),
    })
    return _mse(out)


def while_loop_net() -> str:
    x = paddle.static.data("x", [-1, 4], "float32")
    h = paddle.static.nn.fc(x, 8, activation="tanh")
    i, n = paddle.full([1], 0, "int64"), paddle.full([1], 3, "int64")
    _, h = paddle.static.nn.while_loop(lambda i, h: i < n, lambda i, h: [i + 1, _fc(h, "loop_w", "tanh")], [i, h])
    return _mse(h)


def cond_in_while_net() -> str:
    x = paddle.static.data("x", [-1, 4], "float32")
    h = paddle.static.nn.fc(x, 8, activation="tanh")
    i, n = paddle.full([1], 0, "int64"), paddle.full([1], 3, "int64")

    def body(i, h):
        step = paddle.static.nn.cond(i < 1, lambda: _fc(h, "first_w", "tanh"), lambda: _fc(h, "later_w", "sigmoid"))
        return [i + 1, step]

    _, h = paddle.static.nn.while_loop(lambda i, h: i < n, body, [i, h])
    return _mse(h)


def while_array_net() -> str:
    x = paddle.static.data("x", [-1, 4], "float32")
    h = paddle.static.nn.fc(x, 8, activation="tanh")
    i, n = paddle.full([1], 0, "int64"), paddle.full([1], 3, "int64")
    steps = paddle.tensor.array_write(h, i, array=paddle.tensor.create_array("float32"))

    def body(i, h, steps):
        h, i = _fc(h, "loop_w", "tanh"), i + 1
        return [i, h, paddle.tensor.array_write(h, i, array=steps)]

    # (The loop's last h is used too: when nothing reads it, Paddle 2.6's while_grad makes
    # its zero grad from the var's declared shape, [-1, 8], and fails.)
    _, h, steps = paddle.static.nn.while_loop(lambda i, h, steps: i < n, body, [i, h, steps])
    return _mse(paddle.tensor.array_read(steps, paddle.full([1], 1, "int64")) + h)


def lstm_net() -> str:
    # Time-major input and fed initial states: the LSTM alone, without the shape / slice /
    # transpose ops batch-major input and zero initial states add around it.
    x = paddle.static.data("x", [3, -1, 4], "float32")  # [time, batch, features]
    h0, c0 = paddle.static.data("h0", [1, -1, 8], "float32"), paddle.static.data("c0", [1, -1, 8], "float32")
    _, (h, _) = paddle.nn.LSTM(4, 8, time_major=True)(x, (h0, c0))
    return _mse(paddle.mean(h, axis=0))  # [1, batch, 8] -> [batch, 8]

def gpt(vocab=1000, hidden=64, heads=4, layers=2, ffn=256, seq=16) -> str:
    """A GPT-2-style decoder as PaddleNLP's GPT builds its inputs: position ids from
    `arange(seq).unsqueeze(0)` (range, unsqueeze2), a causal mask from
    `tril(ones([seq, seq]))` turned into 0 / -1e4 and unsqueezed to [1, 1, seq, seq]
    (tril_triu, scale, unsqueeze2) and added to the attention scores; pre-LN blocks with the
    tanh-approximated gelu (GPT-2's), a final LayerNorm and the LM head tied to the word
    embedding (`matmul_v2(x, W, trans_y=True)`); next-token cross entropy on every position."""
    ids = paddle.static.data("src_ids", [-1, seq], "int64")
    label = paddle.static.data("label", [-1, seq, 1], "int64")
    word = paddle.nn.Embedding(vocab, hidden)
    position = paddle.nn.Embedding(seq, hidden)
    pos_ids = paddle.arange(seq, dtype="int64").unsqueeze(0)
    x = paddle.nn.Dropout(0.1)(word(ids) + position(pos_ids))
    causal = paddle.tril(paddle.ones([seq, seq], dtype="float32"))
    mask = ((causal - 1.0) * 1e4).unsqueeze([0, 1])
    for _ in range(layers):
        block = paddle.nn.TransformerEncoderLayer(hidden, heads, ffn, dropout=0.1, activation="gelu",
                                                  normalize_before=True)
        block.activation = lambda t: paddle.nn.functional.gelu(t, approximate=True)
        x = block(x, src_mask=mask)
    x = paddle.nn.LayerNorm(hidden)(x)
    logits = paddle.matmul(x, word.weight, transpose_y=True)
    loss = paddle.nn.functional.cross_entropy(logits, label)
    paddle.optimizer.Adam(learning_rate=1e-3).minimize(loss)
    return loss.name


SMALL_BERT = {"vocab": 1000, "hidden": 64, "heads": 4, "layers": 2, "ffn": 256, "max_len": 64, "seq": 32}

# ------------------------------------------------------- optimizers and clips that need norms
# x[64] -> fc 512 relu -> fc 1, square error: fc_0.w_0 (64 x 512 = 32768 elements) is cut
# into 3 blocks over 3 pservers at min_block_size 8192.


def norm_mlp(optimizer) -> str:
    x = paddle.static.data("x", [-1, 64], "float32")
    y = paddle.static.data("y", [-1, 1], "float32")
    h = paddle.static.nn.fc(x, 512, activation="relu")
    loss = paddle.mean(paddle.square(paddle.static.nn.fc(h, 1) - y))
    optimizer().minimize(loss)
    return loss.name


def two_clip_groups_mlp() -> str:
    """The norm MLP trained by two SGDs, each with its own ClipGradByGlobalNorm: the hidden
    layer's grads (group "hidden", 0.01) and the output layer's ("output", 0.005) are
    clipped by their own group's norm."""
    x = paddle.static.data("x", [-1, 64], "float32")
    y = paddle.static.data("y", [-1, 1], "float32")
    h = paddle.static.nn.fc(x, 512, activation="relu")
    loss = paddle.mean(paddle.square(paddle.static.nn.fc(h, 1) - y))
    params_grads = paddle.static.append_backward(loss)
    hidden = [(p, g) for p, g in params_grads if p.name.startswith("fc_0.")]
    output = [(p, g) for p, g in params_grads if not p.name.startswith("fc_0.")]
    paddle.optimizer.SGD(0.1, grad_clip=paddle.nn.ClipGradByGlobalNorm(0.01, group_name="hidden")).apply_gradients(
        hidden)
    paddle.optimizer.SGD(0.1, grad_clip=paddle.nn.ClipGradByGlobalNorm(0.005, group_name="output")).apply_gradients(
        output)
    return loss.name


def _decayed(name: str) -> bool:
    return name.endswith(".w_0")  # AdamW's apply_decay_param_fun: weights decay, biases do not


NORM_NETS = {
    "mlp_clip_global": ("x[64] -> fc 512 relu -> fc 1, square error; grad_clip=ClipGradByGlobalNorm(0.01)",
                        "SGD (lr 0.1)", lambda: norm_mlp(lambda: paddle.optimizer.SGD(
                            0.1, grad_clip=paddle.nn.ClipGradByGlobalNorm(0.01)))),
    "mlp_clip_two_groups": ("x[64] -> fc 512 relu -> fc 1, square error; two ClipGradByGlobalNorm groups: "
                            "fc_0's grads (\"hidden\", 0.01) and fc_1's (\"output\", 0.005)",
                            "two SGDs (lr 0.1), one per group (append_backward, apply_gradients)",
                            two_clip_groups_mlp),
    "mlp_clip_value": ("x[64] -> fc 512 relu -> fc 1, square error; grad_clip=ClipGradByValue(0.001)",
                       "SGD (lr 0.1)", lambda: norm_mlp(lambda: paddle.optimizer.SGD(
                           0.1, grad_clip=paddle.nn.ClipGradByValue(0.001)))),
    "mlp_adamw": ("x[64] -> fc 512 relu -> fc 1, square error", "AdamW (lr 0.01, weight_decay 0.1, weights only)",
                  lambda: norm_mlp(lambda: paddle.optimizer.AdamW(0.01, weight_decay=0.1,
                                                                  apply_decay_param_fun=_decayed))),
    "mlp_lamb": ("x[64] -> fc 512 relu -> fc 1, square error", "Lamb (lr 0.01, lamb_weight_decay 0.01)",
                 lambda: norm_mlp(lambda: paddle.optimizer.Lamb(0.01, lamb_weight_decay=0.01))),
    "mlp_lars": ("x[64] -> fc 512 relu -> fc 1, square error", "LarsMomentum (lr 0.1, momentum 0.9)",
                 lambda: norm_mlp(lambda: paddle.incubate.optimizer.LarsMomentumOptimizer(0.1, 0.9))),
    "mlp_lars_l2": ("x[64] -> fc 512 relu -> fc 1, square error",
                    "LarsMomentum (lr 0.1, momentum 0.9) with regularization=L2Decay(0.01) (scale + sum ahead of "
                    "each lars_momentum)",
                    lambda: norm_mlp(lambda: paddle.incubate.optimizer.LarsMomentumOptimizer(
                        0.1, 0.9, regularization=paddle.regularizer.L2Decay(0.01)))),
    "mlp_lars_clip_value": ("x[64] -> fc 512 relu -> fc 1, square error; grad_clip=ClipGradByValue(0.001)",
                            "LarsMomentum (lr 0.1, momentum 0.9)",
                            lambda: norm_mlp(lambda: paddle.incubate.optimizer.LarsMomentumOptimizer(
                                0.1, 0.9, grad_clip=paddle.nn.ClipGradByValue(0.001)))),
}


NETS = {
    "resnet50": ("ResNet-50 (paddle.vision.models.resnet50, 1000 classes), image [N,3,224,224]", "Momentum",
                 resnet50),
    "resnet_small": ("a small ResNet with ResNet-50's op types: 7x7/2 stem + 3x3/2 max pool, 3 paddle.vision "
                     "BottleneckBlocks (8->16->32 channels, one stride 2), adaptive avg pool, 10 classes; image "
                     "[N,3,32,32]", "Momentum", resnet_small),
    "bert": ("BERT-base encoder: 30522x768 word + 512x768 position embeddings, 12 layers, 12 heads, FFN 3072, "
             "gelu, seq 128, 2-class head", "Adam", lambda: bert(clip=False)),
    "bert_clip": ("the BERT encoder with grad_clip=ClipGradByGlobalNorm(1.0)", "Adam", lambda: bert(clip=True)),
    "cond": ("x[4] -> fc 8 -> paddle.static.nn.cond(mean(fc_0.b_0) >= 0, tanh(h @ gate_w), 2 sigmoid(h @ gate_v)) "
             "-> fc 1, "
             "square error", "SGD", cond_net),
    "switch_case": ("x[4] -> fc 8 -> paddle.static.nn.switch_case(1 + (mean(fc_0.b_0) >= 0.0005), {0: h/2, "
                    "1: tanh(h @ switch_w1), 2: sigmoid(h @ switch_w2)}) -> fc 1, square error", "SGD",
                    switch_case_net),
    "while_loop": ("x[4] -> fc 8 tanh -> paddle.static.nn.while_loop 3 times h = tanh(h @ loop_w) -> fc 1, "
                   "square error", "SGD", while_loop_net),
    "cond_in_while": ("x[4] -> fc 8 tanh -> while_loop 3 times: h = cond(i < 1, tanh(h @ first_w), "
                      "sigmoid(h @ later_w)) -> fc 1, square error", "SGD", cond_in_while_net),
    "while_array": ("x[4] -> fc 8 tanh -> while_loop 3 times h = tanh(h @ loop_w), each step's h written to a "
                    "tensor array (array_write) -> array_read step 1 + the last h -> fc 1, square error", "SGD",
                    while_array_net),
    "lstm": ("x[3, N, 4] (time-major), h0, c0 [1, N, 8] -> paddle.nn.LSTM(4, 8) -> last hidden state -> fc 1, "
             "square error", "SGD", lstm_net),
    "bert_small": ("a small BERT-style encoder (the BERT-base net's code): 1000x64 word + 64x64 position "
                   "embeddings, 2 layers, 4 heads, FFN 256, gelu, dropout 0.1, seq 32, 2-class head", "Adam",
                   lambda: bert(clip=False, **SMALL_BERT)),
    "gpt": ("a GPT-2-style decoder: 1000x64 word (tied LM head) + 16x64 position embeddings, 2 pre-LN layers, "
            "4 heads, FFN 256, tanh gelu, dropout 0.1, causal mask from range/tril_triu/unsqueeze2, seq 16, "
            "next-token cross entropy", "Adam (lr 1e-3)", gpt),
    **NORM_NETS,
}
# The small control-flow networks: trained on the numpy kernels by the per-case tests
# (tests/conftest.py tells them from the real models by `"real_model": false`).
SMALL_NETS = {"cond", "switch_case", "while_loop", "cond_in_while", "while_array", "lstm", *NORM_NETS}

# case -> (network, pservers, trainers, sync_mode, slice_var_up)
CASES = {
    "resnet50_momentum_4ps_sync": ("resnet50", 4, 2, True, True),
    "resnet50_momentum_8ps_noslice": ("resnet50", 8, 2, True, False),
    "resnet_small_momentum_3ps_sync": ("resnet_small", 3, 2, True, True),
    "bert_adam_4ps_async": ("bert", 4, 2, False, True),
    "bert_adam_2ps_noslice_sync": ("bert", 2, 2, True, False),
    "bert_adam_clip_2ps_sync": ("bert_clip", 2, 2, True, True),
    "cond_sgd_2ps": ("cond", 2, 2, True, True),
    "switch_case_sgd_3ps": ("switch_case", 3, 2, True, True),
    "while_loop_sgd_3ps": ("while_loop", 3, 2, True, True),
    "cond_in_while_sgd_2ps": ("cond_in_while", 2, 2, True, True),
    "while_array_sgd_2ps": ("while_array", 2, 2, True, True),
    "lstm_sgd_2ps": ("lstm", 2, 2, True, True),
    "bert_small_adam_3ps_sync": ("bert_small", 3, 2, True, True),
    "gpt_adam_3ps_sync": ("gpt", 3, 2, True, True),
    "mlp_clip_global_sgd_3ps": ("mlp_clip_global", 3, 2, True, True),
    "mlp_clip_value_sgd_3ps": ("mlp_clip_value", 3, 2, True, True),
    "mlp_clip_two_groups_sgd_3ps": ("mlp_clip_two_groups", 3, 2, True, True),
    "mlp_adamw_3ps": ("mlp_adamw", 3, 2, True, True),
    "mlp_lamb_3ps": ("mlp_lamb", 3, 2, True, True),
    "mlp_lars_3ps": ("mlp_lars", 3, 2, True, True),
    "mlp_lars_l2_3ps": ("mlp_lars_l2", 3, 2, True, True),
    "mlp_lars_clip_value_3ps": ("mlp_lars_clip_value", 3, 2, True, True),
}


def build(net: str):
    main, startup = paddle.static.Program(), paddle.static.Program()
    framework._name_scope = framework.NameScope()  # op_namescope counters (`/optimizer_7/`) start afresh
    with paddle.utils.unique_name.guard(), paddle.static.program_guard(main, startup):
        loss = NETS[net][2]()
    return main, startup, loss


# ---------------------------------------------------------------------- saving


def strip_callstacks(program) -> None:
    """Remove every op's `op_callstack` attr: with them a case folder is 4-8 MB (a BERT
    op's Python stack is ~3 KB, and Paddle also stacks its startup initializers). Every
    other byte is Paddle's own serialization (`remove_attr` on its `OpDesc`, then Paddle's
    `serialize_to_string`)."""
    for block in program.blocks:
        for op in block.ops:
            if op.desc.has_attr("op_callstack"):
                op.desc.remove_attr("op_callstack")


def repeated_attr_ops(data: bytes) -> tuple[int, int, dict[str, int]]:
    """(ops, ops with an attr name written twice, how often each repeated name is repeated)."""
    message = framework_pb2.ProgramDesc.FromString(data)
    ops, repeated, names = 0, 0, {}
    for block in message.blocks:
        for op in block.ops:
            ops += 1
            seen: set[str] = set()
            twice = False
            for attr in op.attrs:
                if attr.name in seen:
                    names[attr.name] = names.get(attr.name, 0) + 1
                    twice = True
                seen.add(attr.name)
            repeated += twice
    return ops, repeated, names


# ---------------------------------------------------------------------- expected.json


def block_json(block) -> dict:
    ops = []
    for op in block.ops:
        ops.append({
            "type": op.type,
            "inputs": {slot: list(op.input(slot)) for slot in op.input_names if op.input(slot)},
            "outputs": {slot: list(op.output(slot)) for slot in op.output_names if op.output(slot)},
            "attrs": {name: _plain(op.attr(name)) for name in KEPT_ATTRS if op.has_attr(name)},
        })
    variables = {}
    for name, var in block.vars.items():
        try:
            shape = list(var.shape)
        except Exception:  # a var kind without a tensor desc (RAW, STEP_SCOPES, ...)
            shape = None
        variables[name] = {"shape": shape, "type": var.type.name, "persistable": bool(var.persistable)}
    return {"ops": ops, "vars": variables}


def _plain(value):
    return list(value) if isinstance(value, (list, tuple)) else value


def program_json(program) -> list[dict]:
    return [block_json(block) for block in program.blocks]


def renumber_control_vars(node, names: dict[str, str]):
    """`__control_var@<random>` -> `__control_var@N`, N in order of first appearance."""
    if isinstance(node, str):
        if node.startswith(CONTROL_VAR):
            return names.setdefault(node, f"{CONTROL_VAR}{len(names)}")
        return node
    if isinstance(node, list):
        return [renumber_control_vars(v, names) for v in node]
    if isinstance(node, dict):
        return {renumber_control_vars(k, names): renumber_control_vars(v, names) for k, v in node.items()}
    return node


def make_case(name: str) -> None:
    net, n_pservers, trainers, sync_mode, slice_var_up = CASES[name]
    folder = OUT / name
    folder.mkdir(parents=True, exist_ok=True)
    main, startup, loss = build(net)
    strip_callstacks(main)
    strip_callstacks(startup)
    main_bytes = main.desc.serialize_to_string()
    (folder / "main.pb").write_bytes(main_bytes)
    (folder / "startup.pb").write_bytes(startup.desc.serialize_to_string())
    ops, repeated, names = repeated_attr_ops(main_bytes)
    print(f"{name}: main.pb {len(main_bytes)} bytes, {ops} ops, {repeated} repeat attrs {names}")

    pservers = endpoints(n_pservers)
    case = {
        "pservers": pservers,
        "trainers": trainers,
        "trainer_id": 0,
        "sync_mode": sync_mode,
        "slice_var_up": slice_var_up,
        "split_method": "RoundRobin",
        "min_block_size": MIN_BLOCK_SIZE,
        "loss": loss,
        "network": NETS[net][0],
        "optimizer": NETS[net][1],
        "paddle": paddle.__version__,
        "generator": "tools/make_paddle_fixtures.py",
    }
    if net in SMALL_NETS:
        case["real_model"] = False
    (folder / "case.json").write_text(json.dumps(case, indent=1) + "\n")

    config = DistributeTranspilerConfig()
    config.slice_var_up = slice_var_up
    config.split_method = paddle.distributed.transpiler.distribute_transpiler.RoundRobin
    config.min_block_size = MIN_BLOCK_SIZE
    # The pserver's `distributed_mode` follows the config, not `transpile(sync_mode=...)`:
    # with the argument alone 2.6 writes an async trainer and a SYNC (0) listen_and_serv.
    config.sync_mode = sync_mode
    transpiler = DistributeTranspiler(config)
    with empty_slots_hidden():
        try:
            transpiler.transpile(0, program=main, pservers=pservers, trainers=trainers, sync_mode=sync_mode,
                                 startup_program=startup)
            programs = {}
            for endpoint in pservers.split(","):
                pserver_main, pserver_startup = transpiler.get_pserver_programs(endpoint)
                programs[endpoint] = {"main": program_json(pserver_main), "startup": program_json(pserver_startup)}
        except Exception as exc:  # noqa: BLE001  (recorded: what Paddle's transpiler does with this program)
            if net not in SMALL_NETS:
                raise
            error = f"{type(exc).__name__}: {exc}"
            print(f"{name}: Paddle's transpiler fails: {error}")
            (folder / "expected.json").write_text(json.dumps({"paddle_transpiler_error": error}) + "\n")
            return
        expected = {
            "trainer": program_json(transpiler.get_trainer_program(wait_port=False)),
            "trainer_startup": program_json(transpiler.startup_program),
            "pservers": programs,
        }
    expected = renumber_control_vars(expected, {})
    ordered = {key: expected[key] for key in ("pservers", "trainer", "trainer_startup")}
    (folder / "expected.json").write_text(json.dumps(ordered, separators=(",", ":")) + "\n")


def main(argv: list[str]) -> None:
    if os.environ.get("PYTHONHASHSEED") != "0":
        # Paddle's transpiler iterates sets of names (grad_to_block_id's order, facts §10.8).
        os.execve(sys.executable, [sys.executable, __file__, *argv], {**os.environ, "PYTHONHASHSEED": "0"})
    paddle.enable_static()
    for name in argv or CASES:
        if name not in CASES:
            raise SystemExit(f"unknown case {name!r}; cases: {', '.join(CASES)}")
        make_case(name)


if __name__ == "__main__":
    main(sys.argv[1:])
