"""Print the markdown table of docs/benchmarks.md from an ``lp bench --out`` JSON record.

"x burst floor" is time over ``floor_single_ms`` (4 x one matmul timed first on an idle
GPU, the floor of records before the steady-state protocol; "-" in those records).

python benchmarks/table_from_json.py docs/results/h200-2026-11-29-final.json
"""

from __future__ import annotations

import json
import sys


def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(path: str) -> str:
    with open(path) as f:
        doc = json.load(f)
    env = doc["env"]
    lines = [
        f"<!-- {path}: {env.get('gpu')}, torch {env.get('torch')}, triton {env.get('triton')}, "
        f"{env.get('date')} -->",
        "| shape | provider | ms | floor ms | x floor | x burst floor | GiB | err logprob "
        "| max abs logprob | err grad_hidden | err grad_weight |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        if "ms" not in r:
            why = r.get("skipped") or r.get("error")
            lines.append(f"| {r['shape']} | {r['provider']} | {why} | | | | | | | | |")
            continue
        lines.append(
            f"| {r['shape']} | {r['provider']} | {r['ms']:.2f} | {_f(r.get('floor_ms'), '.2f')} "
            f"| {_f(r.get('x_floor'), '.3f')} | {_f(r.get('x_floor_single'), '.3f')} "
            f"| {r['peak_gib']:.2f} "
            f"| {_f(r.get('err_logprob'), '.2e')} | {_f(r.get('maxabs_logprob'), '.1e')} "
            f"| {_f(r.get('err_grad_hidden'), '.2e')} | {_f(r.get('err_grad_weight'), '.2e')} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(table(p))
        print()
