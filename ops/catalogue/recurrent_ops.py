"""The fused recurrent op Paddle 2.x builds for `paddle.nn.LSTM` / `GRU` / `SimpleRNN`
(`rnn`, and `rnn_grad` as Paddle 2.6 registers it), `coalesce_tensor` (the startup
program packs an RNN's weights into one buffer: `FusedOutput`) and `fill_any_like`
(the zero grad of an RNN output nothing reads). The builder does not build them
(`GRAD_UNSUPPORTED`): Paddle-built programs carry their grad ops."""

from __future__ import annotations

from ops.catalogue.opdef import GRAD_UNSUPPORTED, Bool, Float, Int, Longs, Str, op
from transpiler.ir.types import OpRole

_RNN_ATTRS = {
    "dropout_prob": Float(0.0), "is_bidirec": Bool(False), "input_size": Int(10), "hidden_size": Int(100),
    "num_layers": Int(1), "mode": Str("LSTM"), "seed": Int(0), "is_test": Bool(False),
}

OPS = (
    op("rnn", "Input PreState* WeightList* SequenceLength?", "DropoutState? Reserve! Out State*", _RNN_ATTRS,
       grad=GRAD_UNSUPPORTED),
    op("rnn_grad", "Input PreState* WeightList* SequenceLength? Out DropoutState? Reserve Out@GRAD State@GRAD*",
       "Input@GRAD PreState@GRAD* WeightList@GRAD*", _RNN_ATTRS, role=OpRole.Backward),
    op("coalesce_tensor", "Input*", "Output* FusedOutput", {
        "dtype": Int(), "copy_data": Bool(False), "set_constant": Bool(False), "persist_output": Bool(False),
        "constant": Float(0.0), "use_align": Bool(True), "align_size": Int(-1),
        "user_defined_size_of_dtype": Int(-1), "concated_shapes": Longs([]), "concated_ranks": Longs([]),
    }, grad=GRAD_UNSUPPORTED),
    op("fill_any_like", "X", "Out", {"value": Float(0.0), "dtype": Int(-1)}, grad=GRAD_UNSUPPORTED),
)
