"""Recurrent kernels: Paddle's fused `rnn` op (what `paddle.nn.LSTM`, `GRU` and
`SimpleRNN` build in static mode) and its grad, and the two ops around it:
`coalesce_tensor` (the startup program packs the RNN's weights into one buffer) and
`fill_any_like`.

`rnn` runs `num_layers` unidirectional layers over time-major `Input` [T, N, I]:
`WeightList` is Paddle's flat order, every layer's `[W_ih, W_hh]` first, then every
layer's `[b_ih, b_hh]`; `PreState` is `[h0, c0]` (LSTM) or `[h0]`, each [layers, N, H].
The cells are Paddle's `LSTMCell` (gates i, f, c, o), `GRUCell` (r, z, c; the reset gate
applied after `W_hh`) and `SimpleRNNCell` (tanh / relu). `rnn_grad` recomputes the forward
from the same inputs (nothing is kept in `Reserve` between the two) and back-propagates
through time. Bidirectional layers, `SequenceLength` and dropout between layers (in
training) are refused by name.
"""

from __future__ import annotations

import numpy as np

from ops.kernels.context import KernelError, OpContext
from ops.kernels.registry import register
from ops.kernels.tensor_ops import np_dtype
from ops.tensor import LoDTensor

GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _config(ctx: OpContext) -> tuple[str, int, int]:
    mode = str(ctx.attr("mode"))
    if mode not in GATES:
        raise KernelError(f"rnn: mode {mode!r} is not one of {', '.join(GATES)}")
    if ctx.attr("is_bidirec"):
        raise KernelError("rnn: bidirectional layers are not supported yet")
    if ctx.has_input("SequenceLength"):
        raise KernelError("rnn: SequenceLength (padded sequences of several lengths) is not supported yet")
    layers = int(ctx.attr("num_layers"))
    if float(ctx.attr("dropout_prob")) > 0 and layers > 1 and not ctx.attr("is_test"):
        raise KernelError("rnn: dropout between layers in training is not supported yet")
    weights = ctx.input_names("WeightList")
    if len(weights) != 4 * layers:
        raise KernelError(f"rnn: {layers} unidirectional layers need 4 x {layers} WeightList entries, "
                          f"got {len(weights)}")
    return mode, layers, int(ctx.attr("hidden_size"))


def _layer_weights(ctx: OpContext, layers: int, layer: int) -> tuple[np.ndarray, ...]:
    return (ctx.input("WeightList", 2 * layer), ctx.input("WeightList", 2 * layer + 1),
            ctx.input("WeightList", 2 * layers + 2 * layer), ctx.input("WeightList", 2 * layers + 2 * layer + 1))


def _forward(ctx: OpContext):
    """Per layer: (its input sequence, weights, h per step incl. h0, c per step, gate caches)."""
    mode, layers, _ = _config(ctx)
    x = ctx.input("Input")
    states = [ctx.input("PreState", i) for i in range(2 if mode == "LSTM" else 1)]
    trace = []
    for layer in range(layers):
        w_ih, w_hh, b_ih, b_hh = _layer_weights(ctx, layers, layer)
        h = states[0][layer]
        c = states[1][layer] if mode == "LSTM" else None
        hs, cs, caches = [h], [c], []
        for t in range(x.shape[0]):
            xg = x[t] @ w_ih.T + b_ih
            hg = h @ w_hh.T + b_hh
            if mode == "LSTM":
                i, f, g, o = np.split(xg + hg, 4, axis=-1)
                i, f, g, o = _sigmoid(i), _sigmoid(f), np.tanh(g), _sigmoid(o)
                c = f * c + i * g
                tc = np.tanh(c)
                h = o * tc
                caches.append((i, f, g, o, tc))
            elif mode == "GRU":
                xr, xz, xc = np.split(xg, 3, axis=-1)
                hr, hz, hc = np.split(hg, 3, axis=-1)
                r, z = _sigmoid(xr + hr), _sigmoid(xz + hz)
                cand = np.tanh(xc + r * hc)
                caches.append((r, z, cand, hc))
                h = (h - cand) * z + cand
            else:
                a = xg + hg
                h = np.tanh(a) if mode == "RNN_TANH" else np.maximum(a, 0)
                caches.append(())
            hs.append(h)
            cs.append(c)
        trace.append((x, (w_ih, w_hh, b_ih, b_hh), hs, cs, caches))
        x = np.stack(hs[1:])
    return mode, trace, x


@register("rnn")
def rnn(ctx: OpContext) -> None:
    mode, trace, out = _forward(ctx)
    ctx.set_output("Out", out)
    last_h = np.stack([hs[-1] for _, _, hs, _, _ in trace])
    states = [last_h]
    if mode == "LSTM":
        states.append(np.stack([cs[-1] for _, _, _, cs, _ in trace]))
    ctx.set_outputs("State", states)
    ctx.set_output("Reserve", np.zeros(0, np.uint8))
    ctx.set_output("DropoutState", np.zeros(0, np.uint8))


def _optional_grad(ctx: OpContext, slot: str, i: int, like: np.ndarray) -> np.ndarray:
    names = ctx.op.input(slot)
    if i < len(names):
        value = ctx.scope.find_var(names[i]) if names[i] and names[i] != "@EMPTY@" else None
        if isinstance(value, LoDTensor):
            return value.array
    return np.zeros_like(like)


@register("rnn_grad")
def rnn_grad(ctx: OpContext) -> None:
    mode, trace, out = _forward(ctx)
    layers = len(trace)
    d_out = _optional_grad(ctx, "Out@GRAD", 0, out)
    d_state_h = _optional_grad(ctx, "State@GRAD", 0, np.stack([hs[-1] for _, _, hs, _, _ in trace]))
    d_state_c = _optional_grad(ctx, "State@GRAD", 1, d_state_h) if mode == "LSTM" else None
    weight_grads: list[np.ndarray | None] = [None] * (4 * layers)
    pre_h_grads, pre_c_grads = [], []
    d_seq = d_out  # grad of the top layer's output sequence
    for layer in reversed(range(layers)):
        x, (w_ih, w_hh, b_ih, b_hh), hs, cs, caches = trace[layer]
        dw_ih, dw_hh = np.zeros_like(w_ih), np.zeros_like(w_hh)
        db_ih, db_hh = np.zeros_like(b_ih), np.zeros_like(b_hh)
        dx = np.zeros_like(x)
        dh = d_state_h[layer].copy()
        dc = d_state_c[layer].copy() if mode == "LSTM" else None
        for t in reversed(range(x.shape[0])):
            dh = dh + d_seq[t]
            h_prev = hs[t]
            if mode == "LSTM":
                i, f, g, o, tc = caches[t]
                do = dh * tc
                dc = dc + dh * o * (1 - tc * tc)
                di, df, dg = dc * g, dc * cs[t], dc * i
                dc = dc * f
                dxg = dhg = np.concatenate([di * i * (1 - i), df * f * (1 - f), dg * (1 - g * g), do * o * (1 - o)],
                                           axis=-1)
                dh_direct = 0.0
            elif mode == "GRU":
                r, z, cand, hc = caches[t]
                dz = dh * (h_prev - cand)
                dcand = dh * (1 - z) * (1 - cand * cand)
                dr = dcand * hc * r * (1 - r)
                dzg = dz * z * (1 - z)
                dxg = np.concatenate([dr, dzg, dcand], axis=-1)
                dhg = np.concatenate([dr, dzg, dcand * r], axis=-1)
                dh_direct = dh * z
            else:
                h = hs[t + 1]
                da = dh * (1 - h * h) if mode == "RNN_TANH" else dh * (h > 0)
                dxg = dhg = da
                dh_direct = 0.0
            dw_ih += dxg.T @ x[t]
            dw_hh += dhg.T @ h_prev
            db_ih += dxg.sum(axis=0)
            db_hh += dhg.sum(axis=0)
            dx[t] = dxg @ w_ih
            dh = dh_direct + dhg @ w_hh
        weight_grads[2 * layer], weight_grads[2 * layer + 1] = dw_ih, dw_hh
        weight_grads[2 * layers + 2 * layer], weight_grads[2 * layers + 2 * layer + 1] = db_ih, db_hh
        pre_h_grads.insert(0, dh)
        pre_c_grads.insert(0, dc)
        d_seq = dx
    for name, grad in zip(ctx.op.output("WeightList@GRAD"), weight_grads, strict=False):
        ctx.set_var(name, grad)
    for name, grad in zip(ctx.op.output("Input@GRAD"), [d_seq], strict=False):
        ctx.set_var(name, grad)
    pre = [np.stack(pre_h_grads)] + ([np.stack(pre_c_grads)] if mode == "LSTM" else [])
    for name, grad in zip(ctx.op.output("PreState@GRAD"), pre, strict=False):
        ctx.set_var(name, grad)


@register("coalesce_tensor")
def coalesce_tensor(ctx: OpContext) -> None:
    """Output[i] = Input[i] (`copy_data`) or the constant (`set_constant`); FusedOutput is
    all of them flattened end to end (Paddle's outputs are views into it; ours are values,
    which are never mutated, so a copy is the same thing)."""
    # In the inputs' dtype, not the `dtype` attr: a float64 copy of a program
    # (`as_float64`) widens the vars.
    values = []
    for i in range(len(ctx.input_names("Input"))):
        x = ctx.input("Input", i)
        if ctx.attr("set_constant"):
            values.append(np.full(x.shape, ctx.attr("constant"), dtype=x.dtype))
        elif ctx.attr("copy_data"):
            values.append(x)
        else:
            values.append(np.zeros_like(x))
    dtype = values[0].dtype if values else np_dtype(ctx.attr("dtype"))
    ctx.set_outputs("Output", values)
    ctx.set_output("FusedOutput", np.concatenate([v.reshape(-1) for v in values]) if values else np.zeros(0, dtype))


@register("fill_any_like")
def fill_any_like(ctx: OpContext) -> None:
    """Out = `value` in X's shape, of `dtype` (-1: X's)."""
    x = ctx.input("X")
    code = int(ctx.attr("dtype"))
    dtype = x.dtype if code == -1 else np_dtype(code)
    ctx.set_output("Out", np.full(x.shape, ctx.attr("value"), dtype=dtype))
