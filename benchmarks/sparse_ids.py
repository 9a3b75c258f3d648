"""What a sync pserver's sparse table block costs per grad row, per prefetched row and per
row updated, measured with Zipf and with uniform (repeating) ids (issue 29).

    python3 benchmarks/sparse_ids.py [--widths 64 16] [--rounds 60] [--repeat 2] [--json]

A real sync pserver (the CTR example's `local-table` program, a `[250000, w]` fp32 block +
Adagrad, as one of the `[1M, 64]` Zipf job's four row blocks) in a child process, two
trainer threads driving it a round at a time as prefetching trainers do
(`transpiler.calibrate.measure_sync_ids`: prefetch the distinct ids, send the dense grads
and the table's grad, the barriers). Id sets, each 8 draws rotated per round:

- `zipf-hot` / `zipf-cold`: the ids of the job (`--zipf 1.1 --hot-first`, 1,920 ids per
  trainer step) that fall in its first / second row block;
- `u<L>x<D>`: `L` lookups per trainer drawn from `D` distinct ids (each in turn);
- each as the trainer sends it **unmerged** (a row per lookup) and **merged** (a row per
  distinct id of the trainer's step: what a trainer that sums several lookups' grads
  sends, Paddle's MergeAdd; the CTR example's three slots do).

Per width, a least-squares fit of the pserver's CPU µs per round to
`fixed + a·(grad rows received) + b·(rows prefetched, and updated: they move together)`; the
fit's residual on each set says whether Zipf ids cost other than their counts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transpiler.calibrate import measure_sync_ids  # noqa: E402

BLOCK_ROWS, TABLE_ROWS, IDS_PER_STEP, DRAWS = 250_000, 1_000_000, 1920, 8


def zipf_block(rng, start: int, zipf: float = 1.1):
    """Per trainer, `DRAWS` steps of the job's ids falling in the block at row `start`."""
    out = []
    for _ in range(2):
        mine = []
        for _ in range(DRAWS):
            ids = (rng.zipf(zipf, IDS_PER_STEP) - 1) % TABLE_ROWS
            mine.append((ids[(ids >= start) & (ids < start + BLOCK_ROWS)] - start).astype(np.int64))
        out.append(mine)
    return out


def repeating(rng, lookups: int, distinct: int):
    """Per trainer `lookups` ids a step; the two trainers' steps drawn from `distinct` ids."""
    out = [[], []]
    for _ in range(DRAWS):
        ids = np.resize(rng.choice(BLOCK_ROWS, distinct, replace=False), 2 * lookups).astype(np.int64)
        rng.shuffle(ids)
        out[0].append(ids[0::2].copy())
        out[1].append(ids[1::2].copy())
    return out


def id_sets(seed: int = 1) -> dict[str, list]:
    rng = np.random.default_rng(seed)
    base = {"zipf-hot": zipf_block(rng, 0), "zipf-cold": zipf_block(rng, BLOCK_ROWS),
            "u512x1024": repeating(rng, 512, 1024), "u1536x128": repeating(rng, 1536, 128),
            "u4096x256": repeating(rng, 4096, 256), "u4096x8192": repeating(rng, 4096, 8192)}
    sets = {}
    for name, draws in base.items():
        sets[name] = draws
        if name != "u512x1024":  # its ids barely repeat
            sets[name + " merged"] = [[np.unique(d) for d in mine] for mine in draws]
    return sets


def counts(draws) -> tuple[float, float, float]:
    """(grad rows sent, rows prefetched, distinct rows updated) per round, means over the draws."""
    sent = np.mean([sum(len(draws[t][d]) for t in range(2)) for d in range(DRAWS)])
    fetched = np.mean([sum(len(np.unique(draws[t][d])) for t in range(2)) for d in range(DRAWS)])
    updated = np.mean([len(np.unique(np.concatenate([draws[t][d] for t in range(2)]))) for d in range(DRAWS)])
    return float(sent), float(fetched), float(updated)


def fit(rows: list[dict]) -> dict[str, float]:
    """Least squares: fixed + per grad row sent + per distinct row (prefetched by a trainer,
    and updated: the two move together, 0.9-1x, so one term)."""
    x = np.array([[1.0, r["sent"], r["fetched"]] for r in rows])
    y = np.array([r["cpu_us"] for r in rows])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    for r, p in zip(rows, x @ coef, strict=True):
        r["fit_us"] = round(float(p), 1)
    return {"fixed_us": float(coef[0]), "per_sent_row_us": float(coef[1]), "per_fetched_row_us": float(coef[2])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 16])
    parser.add_argument("--rounds", type=int, default=60, help="rounds per block (3 blocks per set, the median)")
    parser.add_argument("--repeat", type=int, default=2, help="measure every set this many times (medians)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sets = id_sets()
    names = list(sets)
    out = {"load_average": os.getloadavg(), "widths": {}}
    for width in args.widths:
        runs = []
        for r in range(args.repeat):  # alternate the order: a pserver's CPU drifts within a run
            order = names if r % 2 == 0 else names[::-1]
            cpu = measure_sync_ids([sets[n] for n in order], width=width, table_rows=BLOCK_ROWS, rounds=args.rounds)
            runs.append(dict(zip(order, cpu, strict=True)))
        rows = []
        for name in names:
            sent, fetched, updated = counts(sets[name])
            rows.append({"set": name, "sent": round(sent, 1), "fetched": round(fetched, 1), "updated": round(updated, 1),
                         "cpu_us": float(np.median([run[name] for run in runs])),
                         "runs_us": [round(run[name], 1) for run in runs]})
        out["widths"][width] = {"fit": fit(rows), "sets": rows}
    out["load_average_after"] = os.getloadavg()
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"load average {out['load_average'][0]:.2f} -> {out['load_average_after'][0]:.2f}")
    for width, res in out["widths"].items():
        f = res["fit"]
        print(f"width {width}: fixed {f['fixed_us']:.0f} us + {f['per_sent_row_us']:.3f} per grad row sent "
              f"+ {f['per_fetched_row_us']:.3f} per row prefetched (and updated)")
        print(f"  {'set':20s} {'sent':>7s} {'fetched':>7s} {'updated':>7s} {'cpu us':>8s} {'fit us':>8s}  runs")
        for r in res["sets"]:
            print(f"  {r['set']:20s} {r['sent']:7.0f} {r['fetched']:7.0f} {r['updated']:7.0f} {r['cpu_us']:8.0f} "
                  f"{r['fit_us']:8.0f}  {r['runs_us']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
