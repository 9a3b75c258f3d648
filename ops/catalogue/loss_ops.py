"""Loss ops. Fluid 1.4+'s `layers.cross_entropy` with hard labels builds `cross_entropy2`
(grad `cross_entropy_grad2`, sic); soft labels keep the old `cross_entropy`."""

from __future__ import annotations

from ops.catalogue import shapes
from ops.catalogue.grad import GradSpec
from ops.catalogue.opdef import Bool, Int, op

OPS = (
    op(
        "cross_entropy",
        "X Label",
        "Y",
        {"soft_label": Bool(False), "ignore_index": Int(-100)},
        grad=GradSpec("cross_entropy_grad", inputs=("X", "Label"), out_grads=("Y",)),
        infer=shapes.cross_entropy,
    ),
    op(
        "cross_entropy2",
        "X Label",
        "Y XShape! MatchX!",
        {"ignore_index": Int(-100)},
        grad=GradSpec("cross_entropy_grad2", inputs=("Label",), outputs=("MatchX", "XShape"), out_grads=("Y",)),
        infer=shapes.cross_entropy,
    ),
    op(
        "softmax_with_cross_entropy",
        "Logits Label",
        "Softmax! Loss",
        {"soft_label": Bool(False), "numeric_stable_mode": Bool(True), "ignore_index": Int(-100), "axis": Int(-1)},
        grad=GradSpec(
            "softmax_with_cross_entropy_grad",
            inputs=("Label",),
            outputs=("Softmax",),
            out_grads=("Loss",),
            in_grads=("Logits",),
        ),
        infer=shapes.softmax_with_cross_entropy,
    ),
)
