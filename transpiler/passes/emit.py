"""Building the ops the transpiler inserts, with the attr types Fluid 1.8.5 gives them.

The types matter: the programs must load in Paddle, whose op makers check them
(`sections` is INTS on `split_byref` but LONGS on `send`, for instance).
"""

from __future__ import annotations

from typing import Any

from transpiler.errors import UnknownOpError
from transpiler.ir import Attr, AttrType, Op, OpRole
from transpiler.ir.types import OP_ROLE_ATTR, OP_ROLE_VAR_ATTR

A = AttrType

# Attrs of each op the transpiler emits: name -> (type, default). Emitted ops get every
# attr, defaults filled in, as Paddle's op makers would.
EMITTED_OP_ATTRS: dict[str, dict[str, tuple[AttrType, Any]]] = {
    "send": {
        "epmap": (A.STRINGS, ()),
        "sections": (A.LONGS, ()),
        "send_varnames": (A.STRINGS, ()),
        "trainer_id": (A.INT, 0),
        "merge_add": (A.BOOLEAN, False),
        "use_send_handler": (A.BOOLEAN, True),
    },
    "recv": {
        "epmap": (A.STRINGS, ()),
        "recv_varnames": (A.STRINGS, ()),
        "trainer_id": (A.INT, 0),
        "with_barrier": (A.BOOLEAN, True),
    },
    "send_barrier": {"endpoints": (A.STRINGS, ()), "trainer_id": (A.INT, 0), "half_async": (A.BOOLEAN, False)},
    "fetch_barrier": {"endpoints": (A.STRINGS, ()), "trainer_id": (A.INT, 0)},
    "split_byref": {"sections": (A.INTS, ()), "num": (A.INT, 0)},
    "concat": {"axis": (A.INT, 0)},
    "sum": {"use_mkldnn": (A.BOOLEAN, False)},
    "scale": {"scale": (A.FLOAT, 1.0), "bias": (A.FLOAT, 0.0), "bias_after_scale": (A.BOOLEAN, True)},
    "listen_and_serv": {
        "endpoint": (A.STRING, "127.0.0.1:6164"),
        "pserver_id": (A.INT, -1),
        "Fanin": (A.INT, 1),
        "sync_mode": (A.BOOLEAN, True),
        "distributed_mode": (A.INT, 0),
        "optimize_blocks": (A.BLOCKS, ()),
        "grad_to_block_id": (A.STRINGS, ()),
        "sparse_grad_to_param": (A.STRINGS, ()),
        "lr_decay_block_id": (A.INT, -1),
        "rpc_get_thread_num": (A.INT, 12),
        "rpc_send_thread_num": (A.INT, 12),
        "rpc_prefetch_thread_num": (A.INT, 12),
    },
    "fill_constant": {
        "shape": (A.LONGS, ()),
        "dtype": (A.INT, 5),
        "value": (A.FLOAT, 0.0),
        "str_value": (A.STRING, ""),
        "force_cpu": (A.BOOLEAN, False),
    },
}


def make_op(
    op_type: str,
    inputs: dict | None = None,
    outputs: dict | None = None,
    attrs: dict[str, Any] | None = None,
    *,
    role: OpRole,
    role_vars: tuple[str, ...] = (),
) -> Op:
    """A detached op with every attr typed and defaulted; `IRError` on a bad value."""
    try:
        signature = EMITTED_OP_ATTRS[op_type]
    except KeyError:
        raise UnknownOpError(f"the transpiler does not know how to emit op {op_type!r}") from None
    attrs = dict(attrs or {})
    unknown = sorted(set(attrs) - set(signature))
    if unknown:
        raise UnknownOpError(f"op {op_type!r} has no attr(s) {unknown}")
    op = Op(op_type, inputs, outputs)
    for name, (attr_type, default) in signature.items():
        op.set_attr(name, Attr.of(attrs.get(name, default), attr_type))
    op.set_attr(OP_ROLE_ATTR, Attr.of(int(role), AttrType.INT))
    op.set_attr(OP_ROLE_VAR_ATTR, Attr.of(tuple(role_vars), AttrType.STRINGS))
    return op
