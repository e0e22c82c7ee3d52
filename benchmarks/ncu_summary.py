"""Summarize an Nsight Compute raw CSV of ``ncu_chunk.py``: one line per kernel.

    ncu --import prof.ncu-rep --page raw --csv > prof.csv
    python benchmarks/ncu_summary.py prof.csv --calls cublas_logits,lp_dlogits,... [--out f.json]

``--calls`` names the launches in order (``ncu_chunk.py`` prints them: one kernel per
call). Per kernel: duration, tensor-pipe activity (% of elapsed cycles), L2 hit rate,
registers, grid and block, and the five largest warp-stall reasons (warps stalled per
issued instruction), the numbers docs/benchmarks.md reads.
"""

from __future__ import annotations

import argparse
import csv
import json

_STALL = "smsp__average_warps_issue_stalled_"
_STALL_END = "_per_issue_active.ratio"
_TO_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}


def summarize(path: str, calls: list[str]) -> list[dict]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    head = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    names, units = rows[head], rows[head + 1]
    data = [r for r in rows[head + 2 :] if len(r) == len(names)]
    if calls and len(calls) != len(data):
        raise SystemExit(f"{path}: {len(data)} kernels profiled, but {len(calls)} --calls")
    col = {n: i for i, n in enumerate(names)}
    stalls = [n for n in names if n.startswith(_STALL) and n.endswith(_STALL_END)]
    out = []
    for k, r in enumerate(data):
        dur = col["gpu__time_duration.sum"]
        top = sorted((float(r[col[n]] or 0), n[len(_STALL) : -len(_STALL_END)]) for n in stalls)
        out.append(
            {
                "call": calls[k] if calls else str(k),
                "kernel": r[col["Kernel Name"]],
                "grid": r[col["launch__grid_size"]],
                "block": r[col["launch__block_size"]],
                "registers": r[col["launch__registers_per_thread"]],
                "duration_us": round(float(r[dur]) * _TO_US[units[dur]], 2),
                "tensor_pipe_active_pct": round(
                    float(
                        r[col["sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed"]]
                    ),
                    1,
                ),
                # None where the report lacks the section (MemoryWorkloadAnalysis)
                "l2_hit_pct": (
                    round(float(r[col["lts__t_sector_hit_rate.pct"]]), 1)
                    if "lts__t_sector_hit_rate.pct" in col
                    else None
                ),
                "top_stalls_per_issue": {n: round(v, 2) for v, n in reversed(top[-5:])},
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--calls", default="", help="comma-separated call names, in launch order")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    calls = [c.strip() for c in args.calls.split(",") if c.strip()]
    rows = summarize(args.csv, calls)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    for r in rows:
        stalls = ", ".join(f"{n} {v:.2f}" for n, v in list(r["top_stalls_per_issue"].items())[:3])
        l2 = "  -  " if r["l2_hit_pct"] is None else f"{r['l2_hit_pct']:5.1f}"
        print(
            f"{r['call']:28s} {r['duration_us']:10.1f} us"
            f"  tensor {r['tensor_pipe_active_pct']:5.1f} %  L2 hit {l2} %"
            f"  {r['grid']} x {r['block']}  {stalls}"
        )


if __name__ == "__main__":
    main()
