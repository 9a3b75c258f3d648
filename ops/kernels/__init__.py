"""The numpy kernels and their registry.

`register("op")` adds a kernel, `get_kernel("op")` finds one (raising `UnknownOpError`
— "no kernel for op 'x'" — for an op nobody registered). Importing this package
registers every family below: `math_ops`, `tensor_ops`, `optimizers` and `initializers`
at once, the others by name (`LAZY_FAMILIES`), their module imported when a program
first runs one of their ops. The RPC layer registers `send`, `recv`, ... into the same
registry from its own modules, by name too.

| module | ops |
|---|---|
| `math_ops` | elementwise_*, relu/tanh/sigmoid/exp/sqrt/square/log/abs, floor, mul, mean, reduce_*, scale, sum, clip |
| `nn` | softmax, lookup_table(_v2), sequence_pool, top_k(_v2), accuracy |
| `loss` | cross_entropy, cross_entropy2, softmax_with_cross_entropy |
| `tensor_ops` | fill_constant, fill_zeros_like, assign, assign_value, cast, increment, concat, reshape2, transpose2, comparisons, logical ops, ref_by_trainer_id |
| `control` | conditional_block(_grad), while(_grad), select_input, select_output, feed, fetch |
| `recurrent` | rnn, rnn_grad (LSTM, GRU, simple RNN), coalesce_tensor, fill_any_like |
| `optimizers` | sgd, momentum, lars_momentum, adam, adamax, adagrad, decayed_adagrad, rmsprop, ftrl |
| `sparse` | split_byref, split_selected_rows, split_ids, merge_ids, lookup_sparse_table, fake_init |
| `initializers` | uniform_random, gaussian_random, truncated_gaussian_random |
| `transformer` | matmul_v2, layer_norm, dropout, gelu, slice, range, tril_triu, unsqueeze2, squared_l2_norm |
| `vision` | conv2d, depthwise_conv2d, batch_norm, pool2d, flatten_contiguous_range (and grads) |
"""

from __future__ import annotations

from ops.kernels import initializers, math_ops, optimizers, tensor_ops  # noqa: F401  (registers)
from ops.kernels.context import Frame, KernelError, OpContext, RunContext
from ops.kernels.registry import (
    KernelSpec,
    differentiable_ops,
    get_kernel,
    has_kernel,
    load_kernels,
    register,
    register_lazily,
    registered_ops,
    restore_kernel,
    swap_kernel,
    unregister,
)

# The families a pserver's programs (initializers, sums, scales, optimizers) seldom run:
# registered by name, each imported when a program first runs one of its ops
# (`register_lazily`; what a process imports stays resident for its whole run, issue 30).
# `tests/test_kernels_registry.py` checks each names exactly what its module registers.
LAZY_FAMILIES: dict[str, tuple[str, ...]] = {
    "ops.kernels.control": ("conditional_block", "conditional_block_grad", "feed", "fetch", "read_from_array",
                            "select_input", "select_output", "while", "while_grad", "write_to_array"),
    "ops.kernels.loss": ("cross_entropy", "cross_entropy2", "cross_entropy_grad", "cross_entropy_grad2",
                         "softmax_with_cross_entropy", "softmax_with_cross_entropy_grad"),
    "ops.kernels.nn": ("accuracy", "lookup_table", "lookup_table_grad", "lookup_table_v2", "lookup_table_v2_grad",
                       "sequence_pool", "sequence_pool_grad", "softmax", "softmax_grad", "top_k", "top_k_v2"),
    "ops.kernels.recurrent": ("coalesce_tensor", "fill_any_like", "rnn", "rnn_grad"),
    "ops.kernels.sparse": ("fake_init", "lookup_sparse_table", "merge_ids", "split", "split_byref", "split_ids",
                           "split_selected_rows", "split_selected_rows_by_columns"),
    "ops.kernels.transformer": ("dropout", "dropout_grad", "gelu", "gelu_grad", "layer_norm", "layer_norm_grad",
                                "matmul_v2", "matmul_v2_grad", "range", "slice", "slice_grad", "squared_l2_norm",
                                "squared_l2_norm_grad", "tril_triu", "tril_triu_grad", "unsqueeze2", "unsqueeze2_grad"),
    "ops.kernels.vision": ("batch_norm", "batch_norm_grad", "conv2d", "conv2d_grad", "depthwise_conv2d",
                           "depthwise_conv2d_grad", "flatten_contiguous_range", "flatten_contiguous_range_grad",
                           "pool2d", "pool2d_grad"),
}
for _module, _op_types in LAZY_FAMILIES.items():
    register_lazily(_module, _op_types)

__all__ = [
    "LAZY_FAMILIES",
    "Frame",
    "KernelError",
    "KernelSpec",
    "OpContext",
    "RunContext",
    "differentiable_ops",
    "get_kernel",
    "has_kernel",
    "load_kernels",
    "register",
    "register_lazily",
    "registered_ops",
    "restore_kernel",
    "swap_kernel",
    "unregister",
]
