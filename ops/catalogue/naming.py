"""Where Paddle 2.6 builds a different op (or var) for what Fluid 1.8 built.

The catalogue, the builder and the `fluid18_*` fixtures speak Fluid 1.8; the other
fixtures were built by Paddle 2.6's static graph. The transpiler treats both alike
(it finds optimizer ops by role and slots, not by these names), but tests that set a
builder program beside a 2.6 fixture translate with this table.
"""

from __future__ import annotations

from types import MappingProxyType

# Fluid 1.8 op type -> the op Paddle 2.6 builds for the same layer.
PADDLE26_OP: MappingProxyType[str, str] = MappingProxyType(
    {
        # fluid.layers.mean → paddle.mean builds reduce_mean(reduce_all=True); its output is a
        # 0-D tensor (shape []) where Fluid's mean gives [1] (also the learning rate: [] vs [1]).
        "mean": "reduce_mean",
        "mean_grad": "reduce_mean_grad",
        # fluid.layers.embedding (ids [N, 1]) → paddle.nn.functional.embedding (ids [N]).
        "lookup_table": "lookup_table_v2",
        "lookup_table_grad": "lookup_table_v2_grad",
    }
)
FLUID18_OP: MappingProxyType[str, str] = MappingProxyType({v: k for k, v in PADDLE26_OP.items()})

# Other differences a reader of both kinds of program meets (not op renames):
NOTES = (
    "Paddle 2.6 writes VarDesc.stop_gradient and is_parameter; Fluid 1.8's proto had neither field.",
    "Paddle 2.6 appends initializer ops to the startup program; Fluid 1.8 prepends them (last created first).",
    "Paddle 2.6 adds attrs Fluid 1.8 did not have (with_quant_attr, use_quantizer, mkldnn_data_type, ...) and "
    "slots (sgd/adam MasterParam, adam SkipUpdate / EpsilonTensor).",
    "Paddle 2.6's `send` op has no `epmap` attr; Fluid 1.8's does.",
    "Paddle 2.x computes lr schedules in Python: no lr-decay ops reach its programs.",
    "fluid.layers.cross_entropy with hard labels builds cross_entropy2 (grad cross_entropy_grad2) since 1.4.",
)
