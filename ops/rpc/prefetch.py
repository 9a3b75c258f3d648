"""The trainer's prefetch kernels: `prefetch` (the distributed table) and
`distributed_lookup_table` (a `remote_prefetch` sparse table).

* `prefetch(X=[ids_0..], Out=[rows_0..], epmap)`: `X[i]` holds the (deduplicated) ids
  `split_ids` routed to pserver `i` (`id % M == i`); pserver `epmap[i]` runs the prefetch
  block keyed by `X[i]`'s name with those ids and answers with the rows, which land
  in `Out[i]` (`[len(ids), width]`); `merge_ids` puts them back in the lookups' order.
* `distributed_lookup_table(Ids=[..], W, Outputs=[..], table_names, height_sections,
  endpoints, padding_idx)`: the table is cut by row ranges (block `i` holds rows
  `[offset_i, offset_i + height_sections[i])` as var `table_names[i]` on `endpoints[i]`);
  the ids of every slot are deduplicated, each asks the block holding it for row
  `id - offset_i`, and the rows are scattered back into each output (one row per id,
  with the id tensor's LoD); `padding_idx` ids read zeros and are not fetched.

Each pserver gets one request per kernel call, and they travel in parallel. Nothing
here holds the table: only the rows of this batch's unique ids cross the wire.
`fetch_by_modulo` and `fetch_by_sections` are the same fetches for scripts (reading
a distributed table's rows before and after training, say).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ops.kernels.context import KernelError, OpContext
from ops.kernels.registry import register
from ops.rpc.client import PrefetchRequest, RpcClient
from ops.rpc.kernels import client_of

NO_PADDING = -1


def fetch_by_modulo(client: RpcClient, epmap: Sequence[str], names: Sequence[str], ids: np.ndarray) -> np.ndarray:
    """Rows of `ids` from a table sharded `id % len(epmap)`, whose pserver `i` keys its
    prefetch block by `names[i]`; one row per id, in `ids`' order."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    uniq, inverse = np.unique(ids, return_inverse=True)
    shard = uniq % len(epmap)
    picks = [np.flatnonzero(shard == i) for i in range(len(epmap))]
    requests = [PrefetchRequest(ep, name, uniq[pick]) for ep, name, pick in zip(epmap, names, picks, strict=True)]
    rows = _gather(client, requests, picks, uniq.size)
    return rows[inverse.reshape(-1)]


def fetch_by_sections(
    client: RpcClient, endpoints: Sequence[str], tables: Sequence[str], sections: Sequence[int], ids: np.ndarray,
    column_sections: Sequence[int] | None = None, column_offsets: Sequence[int] | None = None,
) -> np.ndarray:
    """Rows of `ids` from a table cut into row ranges (`sections` rows each, block `i`
    named `tables[i]` on `endpoints[i]`); one row per id, in `ids`' order. With
    `column_sections` and `column_offsets` (each block's width and first column) the
    blocks are 2-D partitions in row-major order (`_bands`: a block at column 0 starts a
    row band, whose blocks share its `sections` rows): every block of the band holding an
    id is asked for its piece of the row, and the pieces are joined in column order."""
    if column_sections:
        return _fetch_2d(client, endpoints, tables, sections, column_sections, column_offsets or (), ids)
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    uniq, inverse = np.unique(ids, return_inverse=True)
    offsets = np.concatenate(([0], np.cumsum(np.asarray(sections, dtype=np.int64))))
    if uniq.size and (uniq[0] < 0 or uniq[-1] >= offsets[-1]):
        bad = int(uniq[0]) if uniq[0] < 0 else int(uniq[-1])
        raise KernelError(f"id {bad} is outside the table's {int(offsets[-1])} rows")
    block = np.searchsorted(offsets[1:], uniq, side="right")
    picks = [np.flatnonzero(block == i) for i in range(len(tables))]
    requests = [
        PrefetchRequest(ep, table, uniq[pick] - offsets[i], table)
        for i, (ep, table, pick) in enumerate(zip(endpoints, tables, picks, strict=True))
    ]
    rows = _gather(client, requests, picks, uniq.size)
    return rows[inverse.reshape(-1)]


def _bands(offsets: Sequence[int], count: int) -> list[list[int]]:
    """The blocks (indices) of each row band: a block at column offset 0 starts a band."""
    if len(offsets) != count or not count or int(offsets[0]) != 0:
        raise KernelError(f"{len(offsets)} column_offsets for {count} blocks (the first must be 0)")
    bands: list[list[int]] = []
    for i, offset in enumerate(offsets):
        if int(offset) == 0:
            bands.append([i])
        else:
            bands[-1].append(i)
    return bands


def _fetch_2d(client: RpcClient, endpoints: Sequence[str], tables: Sequence[str], sections: Sequence[int],
              widths: Sequence[int], starts: Sequence[int], ids: np.ndarray) -> np.ndarray:
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    uniq, inverse = np.unique(ids, return_inverse=True)
    bands = _bands(starts, len(widths))
    heights = np.asarray([int(sections[band[0]]) for band in bands], dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(heights)))
    if uniq.size and (uniq[0] < 0 or uniq[-1] >= offsets[-1]):
        bad = int(uniq[0]) if uniq[0] < 0 else int(uniq[-1])
        raise KernelError(f"id {bad} is outside the table's {int(offsets[-1])} rows")
    band_of = np.searchsorted(offsets[1:], uniq, side="right")
    requests, picks, columns = [], [], []
    for j, band in enumerate(bands):
        pick = np.flatnonzero(band_of == j)
        start = 0
        for k in band:
            if pick.size:
                requests.append(PrefetchRequest(endpoints[k], tables[k], uniq[pick] - offsets[j], tables[k]))
                picks.append(pick)
                columns.append((start, start + int(widths[k])))
            start += int(widths[k])
    if not requests:
        raise KernelError("a prefetch needs at least one id")
    answers = client.prefetch_many(requests)
    width = sum(int(widths[k]) for k in bands[0])
    first = answers[0].array
    rows = np.empty((uniq.size, width), dtype=first.dtype)
    for request, pick, (c0, c1), answer in zip(requests, picks, columns, answers, strict=True):
        array = answer.array.reshape(answer.array.shape[0], -1)
        if array.shape != (pick.size, c1 - c0):
            raise KernelError(f"pserver {request.endpoint} answered {list(array.shape)} for {pick.size} ids "
                              f"of {c1 - c0} columns")
        rows[pick, c0:c1] = array
    return rows[inverse.reshape(-1)]


def _gather(client: RpcClient, requests: list[PrefetchRequest], picks: list[np.ndarray], count: int) -> np.ndarray:
    """Send the non-empty requests at once; scatter each answer to its picks' places."""
    live = [i for i, pick in enumerate(picks) if pick.size]
    if not live:
        raise KernelError("a prefetch needs at least one id")
    answers = client.prefetch_many([requests[i] for i in live])
    first = answers[0].array
    rows = np.empty((count, *first.shape[1:]), dtype=first.dtype)
    for i, answer in zip(live, answers, strict=True):
        array = answer.array
        if array.shape[0] != picks[i].size or array.shape[1:] != first.shape[1:]:
            raise KernelError(
                f"pserver {requests[i].endpoint} answered {list(array.shape)} for {picks[i].size} ids "
                f"(rows of {list(first.shape[1:])} expected)"
            )
        rows[picks[i]] = array
    return rows


# ------------------------------------------------------------------ kernels


@register("prefetch")
def prefetch(ctx: OpContext) -> None:
    names, outs = ctx.input_names("X"), ctx.output_names("Out")
    epmap = [str(ep) for ep in ctx.attr("epmap")]
    if not len(names) == len(outs) == len(epmap):
        raise KernelError(f"prefetch: {len(names)} X, {len(outs)} Out and {len(epmap)} endpoints in epmap")
    client = client_of(ctx)
    ids = [ctx.input("X", i).reshape(-1).astype(np.int64, copy=False) for i in range(len(names))]
    live = [i for i, part in enumerate(ids) if part.size]
    answers = client.prefetch_many([PrefetchRequest(epmap[i], names[i], ids[i]) for i in live])
    fetched = dict(zip(live, (a.array for a in answers), strict=True))
    for i, out in enumerate(outs):
        rows = fetched.get(i)
        if rows is None:
            rows = np.zeros((0, *_row_shape(ctx, out, fetched)), dtype=_dtype(ctx, out, fetched))
        elif rows.shape[0] != ids[i].size:
            raise KernelError(f"prefetch: pserver {epmap[i]} answered {rows.shape[0]} rows for {ids[i].size} ids")
        ctx.set_output("Out", rows, i=i)


def _row_shape(ctx: OpContext, name: str, fetched: dict[int, np.ndarray]) -> tuple[int, ...]:
    if fetched:
        return next(iter(fetched.values())).shape[1:]
    var = ctx.decl(name)
    if var is None or var.shape is None or any(d < 0 for d in var.shape[1:]):
        raise KernelError(f"prefetch: the row shape of {name!r} is unknown")
    return tuple(var.shape[1:])


def _dtype(ctx: OpContext, name: str, fetched: dict[int, np.ndarray]) -> np.dtype:
    if fetched:
        return next(iter(fetched.values())).dtype
    var = ctx.decl(name)
    return var.dtype.to_numpy() if var is not None and var.dtype is not None else np.dtype(np.float32)


@register("distributed_lookup_table", defaults={"column_sections": (), "column_offsets": ()})
def distributed_lookup_table(ctx: OpContext) -> None:
    tables = [str(t) for t in ctx.attr("table_names")]
    sections = [int(h) for h in ctx.attr("height_sections")]
    endpoints = [str(ep) for ep in ctx.attr("endpoints")]
    if not tables or not len(tables) == len(sections) == len(endpoints):
        raise KernelError(
            f"distributed_lookup_table: {len(tables)} table_names, {len(sections)} height_sections, "
            f"{len(endpoints)} endpoints"
        )
    outs = ctx.output_names("Outputs")
    id_arrays = [ctx.input("Ids", i) for i in range(len(ctx.input_names("Ids")))]
    if len(id_arrays) != len(outs):
        raise KernelError(f"distributed_lookup_table: {len(id_arrays)} Ids for {len(outs)} Outputs")
    v2 = str(ctx.attr("lookup_table_version")) == "lookup_table_v2"
    for ids in id_arrays:
        if not v2 and (ids.ndim == 0 or ids.shape[-1] != 1):
            raise KernelError(f"distributed_lookup_table: Ids must end in a dimension of 1, got {list(ids.shape)}")
    flat = [ids.reshape(-1).astype(np.int64, copy=False) for ids in id_arrays]
    everything = np.concatenate(flat) if flat else np.zeros(0, np.int64)
    columns = [int(c) for c in ctx.attr("column_sections")]  # ours: 2-D partitions (transpiler.partition)
    starts = [int(c) for c in ctx.attr("column_offsets")]
    if columns:
        height = sum(int(sections[band[0]]) for band in _bands(starts, len(columns)))
    else:
        height = sum(sections)
    pad = int(ctx.attr("padding_idx"))
    if pad < NO_PADDING:
        pad += height  # Paddle 2.x: negative counts from the end
    wanted = everything[everything != pad] if pad != NO_PADDING else everything
    if wanted.size and (int(wanted.min()) < 0 or int(wanted.max()) >= height):
        bad = int(wanted.min()) if int(wanted.min()) < 0 else int(wanted.max())
        raise KernelError(f"distributed_lookup_table: id {bad} is out of the table's range [0, {height})")
    client = client_of(ctx)
    uniq = np.unique(wanted)
    rows = fetch_by_sections(client, endpoints, tables, sections, uniq, columns, starts) if uniq.size else None
    width, dtype = _table_row(ctx, rows)
    for i, (ids, array) in enumerate(zip(flat, id_arrays, strict=True)):
        out = np.zeros((ids.size, *width), dtype=dtype)
        keep = ids != pad if pad != NO_PADDING else np.ones(ids.size, bool)
        if rows is not None and keep.any():
            out[keep] = rows[np.searchsorted(uniq, ids[keep])]
        lead = array.shape if v2 else array.shape[:-1]
        ctx.set_output("Outputs", out.reshape(*lead, *width), lod=ctx.lod("Ids", i), i=i)


def _table_row(ctx: OpContext, rows: np.ndarray | None) -> tuple[tuple[int, ...], np.dtype]:
    """Row shape and dtype: from the fetched rows, else from W (a `fake_init` placeholder
    or its declaration)."""
    if rows is not None:
        return rows.shape[1:], rows.dtype
    w = ctx.optional_value("W")
    if w is not None and hasattr(w, "shape") and len(w.shape) >= 2:
        return tuple(w.shape[1:]), np.dtype(w.dtype)
    var = ctx.decl(ctx.input_names("W")[0]) if ctx.input_names("W") else None
    if var is None or var.shape is None or var.dtype is None:
        raise KernelError("distributed_lookup_table: the table's row shape is unknown")
    return tuple(var.shape[1:]), var.dtype.to_numpy()
