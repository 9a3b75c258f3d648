"""The numpy kernels and their registry.

`register("op")` adds a kernel, `get_kernel("op")` finds one (raising `UnknownOpError`
— "no kernel for op 'x'" — for an op nobody registered). Importing this package
registers every family below; the RPC layer registers `send`, `recv`, ... into the same
registry from its own module.

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

from ops.kernels import control, initializers, loss, math_ops, nn, optimizers, sparse, tensor_ops  # noqa: F401  (registers)
from ops.kernels import recurrent  # noqa: F401  (registers)
from ops.kernels import transformer  # noqa: F401  (registers)
from ops.kernels import vision  # noqa: F401  (registers)
from ops.kernels.context import Frame, KernelError, OpContext, RunContext
from ops.kernels.registry import (
    KernelSpec,
    differentiable_ops,
    get_kernel,
    has_kernel,
    register,
    register_lazily,
    registered_ops,
    restore_kernel,
    swap_kernel,
    unregister,
)

__all__ = [
    "Frame",
    "KernelError",
    "KernelSpec",
    "OpContext",
    "RunContext",
    "differentiable_ops",
    "get_kernel",
    "has_kernel",
    "register",
    "register_lazily",
    "registered_ops",
    "restore_kernel",
    "swap_kernel",
    "unregister",
]
