"""The cost part of `pstranspile plan`: per pserver memory by kind (declared by the pserver
programs), traffic, RPCs and estimated time per step (the model), each column's imbalance,
and per param its partition kind and grid; as text, JSON (`cost_json`) and SVG bars."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transpiler.cost import (
    MEMORY_KINDS, IdStats, Rates, declared_memory, format_bytes, imbalance, ids_per_sample, plan_costs, summarize,
)
from transpiler.errors import TranspileError

MEMORY_HEADS = {"params": "params", "optimizer_state": "optimizer", "grad_buffers": "buffers",
                "merged_grads": "merged", "table": "table", "other": "other"}


def partition_kind(param) -> str:
    """whole, row, column or 2-D, from the param's blocks."""
    bands = param.bands()
    if len(param.blocks) == 1:
        return "whole"
    if len(bands) == 1:
        return "column"
    return "row" if all(len(band) == 1 for band in bands) else "2-D"


def grid_text(param) -> str:
    widths = [len(band) for band in param.bands()]
    return f"{len(widths)}x{widths[0]}" if len(set(widths)) == 1 else f"{len(widths)}x{widths}"


def plan_cost_data(result, rates: Rates, ids: Mapping[str, IdStats] | None = None) -> dict[str, Any]:
    """Every figure of the cost report: `summarize` plus the declared memory of each pserver
    program and the per-param rows."""
    plan = result.plan
    costs = plan_costs(plan, rates, ids)
    declared = {ep: declared_memory(plan, ep, main) for ep, (main, _) in result.pservers.items()}
    data = summarize(plan, costs, rates, declared)
    data["imbalance"]["declared_bytes"] = round(imbalance(r.get("declared_bytes", 0) for r in data["pservers"]), 6)
    data["trainers"] = plan.trainers
    data["sync_mode"] = plan.sync_mode
    data["ids"] = {name: {"ids_per_step": s.ids_per_step, "height": s.height,
                          "distribution": "uniform" if s.uniform else "sample", "distinct_ids": int(len(s.ids))}
                   for name, s in sorted((ids or {}).items())}
    data["params"] = [
        {"param": p.param, "kind": partition_kind(p), "grid": [len(band) for band in p.bands()],
         "pservers": sorted(set(p.endpoints), key=plan.endpoints.index)}
        for p in plan.params
    ]
    if plan.table is not None and plan.partitioner != "paddle":  # kept `id % k` by the partitioner (planner: mod)
        data["params"].append({"param": plan.table.table, "kind": "mod", "grid": [1] * len(plan.table.endpoints),
                               "pservers": list(plan.table.endpoints)})
    return data


def format_costs(data: Mapping[str, Any]) -> str:
    rows = data["pservers"]
    mode = "sync" if data["sync_mode"] else "async"
    lines = [
        "",
        f"memory per pserver, declared by its program (bytes; {data['trainers']} trainer(s), {mode})",
        f"{'pserver':<24}" + "".join(f"{MEMORY_HEADS[k]:>12}" for k in MEMORY_KINDS) + f"{'total':>12}",
    ]
    for row in rows:
        memory = row.get("declared", row["memory"])
        total = row.get("declared_bytes", row["memory_bytes"])
        lines.append(f"{row['endpoint']:<24}" + "".join(f"{format_bytes(memory[k]):>12}" for k in MEMORY_KINDS)
                     + f"{format_bytes(total):>12}")
    lines.append(f"{'imbalance (max / mean)':<24}" + "".join(
        f"{imbalance(r.get('declared', r['memory'])[k] for r in rows):>12.3f}" for k in MEMORY_KINDS)
        + f"{data['imbalance'].get('declared_bytes', data['imbalance']['memory_bytes']):>12.3f}")
    runtime = sorted({n for r in rows for n in r.get("runtime_sized", [])})
    if runtime:
        lines.append(f"(batch-sized, counted 0: {', '.join(runtime)})")
    rates = data["rates"]
    lines += [
        "",
        f"per step, estimated (rates: {rates['source']}; {rates['bandwidth'] / 1e6:,.0f} MB/s, "
        f"{rates['rpc_us']:.0f} us per RPC)",
        f"{'pserver':<24}{'in':>12}{'out':>12}{'rpcs':>8}{'lookups':>10}{'compute ms':>12}{'est ms':>10}"
        f"{'partitions':>12}",
    ]
    for row in rows:
        lines.append(f"{row['endpoint']:<24}{format_bytes(row['bytes_in']):>12}{format_bytes(row['bytes_out']):>12}"
                     f"{row['rpcs']:>8.0f}{row['lookups']:>10.0f}{row['compute_ms']:>12.3f}{row['est_ms']:>10.3f}"
                     f"{len(row['partitions']):>12}")
    imb = data["imbalance"]
    lines.append(f"{'imbalance (max / mean)':<24}{imb['bytes_in']:>12.3f}{imb['bytes_out']:>12.3f}{imb['rpcs']:>8.3f}"
                 f"{imb['lookups']:>10.3f}{imb['compute_ms']:>12.3f}{imb['est_ms']:>10.3f}")
    lines.append(f"estimated step: {data['est_step_ms']:.3f} ms (the slowest pserver)")
    for name, stats in data["ids"].items():
        lines.append(f"ids of {name}: {stats['ids_per_step']} per trainer step, {stats['distribution']}"
                     + (f" ({stats['distinct_ids']:,} distinct ids sampled)" if stats["distribution"] == "sample" else ""))
    lines += ["", f"{'param':<40} {'kind':<7} {'grid':<10} pservers"]
    for param in data["params"]:
        grid = param["grid"]
        text = f"{len(grid)}x{grid[0]}" if len(set(grid)) == 1 else f"{len(grid)}x{grid}"
        if param["kind"] == "mod":
            text = f"id%{len(grid)}"
        lines.append(f"{param['param']:<40} {param['kind']:<7} {text:<10} {len(param['pservers'])}")
    return "\n".join(line.rstrip() for line in lines) + "\n"


def cost_svg(data: Mapping[str, Any], *, top: int = 0, width: int = 480) -> tuple[str, int]:
    """SVG elements (a `<g id="cost">`) drawing per pserver a bar of its memory (stacked by
    kind) and a bar of its estimated ms per step, scaled to the largest; and the height used."""
    rows = data["pservers"]
    colours = dict(zip(MEMORY_KINDS, ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#bab0ac"), strict=True))
    most = max((r.get("declared_bytes", r["memory_bytes"]) for r in rows), default=0) or 1
    slowest = max((r["est_ms"] for r in rows), default=0) or 1
    left, label, y = 10, 150, top + 10
    body = ['<g id="cost">', f'<text x="{left}" y="{y + 12}" font-size="13">per pserver: memory by kind '
            f'(max {format_bytes(most)}) and estimated ms per step (max {slowest:.3f})</text>']
    y += 20
    for i, kind in enumerate(MEMORY_KINDS):
        x = left + i * 100
        body.append(f'<rect x="{x}" y="{y}" width="10" height="10" fill="{colours[kind]}"/>'
                    f'<text x="{x + 14}" y="{y + 9}" font-size="10">{MEMORY_HEADS[kind]}</text>')
    y += 18
    for row in rows:
        memory = row.get("declared", row["memory"])
        body.append(f'<text x="{left}" y="{y + 10}" font-size="11">{_xml(row["endpoint"])}</text>')
        x = left + label
        for kind in MEMORY_KINDS:
            w = width * memory[kind] / most
            if w > 0:
                body.append(f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="10" fill="{colours[kind]}">'
                            f'<title>{MEMORY_HEADS[kind]} {format_bytes(memory[kind])}</title></rect>')
            x += w
        y += 12
        w = width * row["est_ms"] / slowest
        body.append(f'<rect x="{left + label}" y="{y}" width="{w:.2f}" height="8" fill="#555">'
                    f'<title>est {row["est_ms"]:.3f} ms per step</title></rect>')
        y += 16
    body.append("</g>")
    return "\n".join(body), y - top


def plan_and_cost_svg(plan_svg_text: str, data: Mapping[str, Any]) -> str:
    """The plan's SVG (`transpiler.plan.plan_svg`) with the cost bars below it."""
    import re

    head, _, rest = plan_svg_text.partition("\n")
    height = int(re.search(r'height="(\d+)"', head).group(1))
    width = int(re.search(r'width="(\d+)"', head).group(1))
    group, used = cost_svg(data, top=height)
    head = head.replace(f'height="{height}"', f'height="{height + used + 10}"')
    head = head.replace(f'width="{width}"', f'width="{max(width, 660)}"')
    body = rest.rsplit("</svg>", 1)[0]
    return f"{head}\n{body}{group}\n</svg>\n"


def _xml(text: str) -> str:
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def id_stats_for(plan, sample, ids_per_step: int | None, batch_size: int, name: str | None) -> dict[str, IdStats]:
    """The `IdStats` of `--id-sample` for the plan's one sparse param or table (or `name`)."""
    candidates = {p.param: p.shape[0] for p in plan.params if p.sparse}
    if plan.table is not None:
        candidates[plan.table.table] = plan.table.shape[0]
    if name is None:
        if len(candidates) != 1:
            known = ", ".join(sorted(candidates)) or "none"
            raise TranspileError(f"--id-sample: the program has {len(candidates)} sparse params or tables ({known}); "
                                 "name one: --id-sample NAME=FILE")
        name = next(iter(candidates))
    if name not in candidates:
        raise TranspileError(f"--id-sample {name}=...: {name!r} is not a sparse param or table of the program "
                             f"(known: {', '.join(sorted(candidates)) or 'none'})")
    per_step = ids_per_step or batch_size * ids_per_sample(sample)
    return {name: IdStats.from_sample(sample, candidates[name], per_step)}


def uniform_stats(plan, batch_size: int) -> dict[str, IdStats]:
    """Uniform ids (`batch_size` per trainer step) for every sparse param and the table."""
    out = {p.param: IdStats.uniform_rows(p.shape[0], batch_size) for p in plan.params if p.sparse}
    if plan.table is not None:
        out[plan.table.table] = IdStats.uniform_rows(plan.table.shape[0], batch_size)
    return out

