"""bench.png: per run (mode x entropy), time over the floor (ms on CPU) and peak memory,
bars per shape and provider. Needs matplotlib (``pip install lp-bench[plot]``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from lp_bench.protocol import row_label


def write_plot(rows: list[dict], path: Path, device: str) -> bool:
    """Draw the rows into ``path``; False (and nothing written) without matplotlib."""
    if importlib.util.find_spec("matplotlib") is None:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("ms") is not None]
    runs = list(dict.fromkeys(row_label(r) for r in ok)) or ["-"]
    groups = list(dict.fromkeys(f"{r['shape']} {r['dtype']}" for r in ok))
    provs = list(dict.fromkeys(r["provider"] for r in ok))
    cuda = device == "cuda"
    key = "x_floor" if cuda else "ms"
    fig, axes = plt.subplots(
        2, len(runs), figsize=(max(6, 2.4 * len(groups)) * len(runs) / 1.5, 7), squeeze=False
    )
    width = 0.8 / max(len(provs), 1)
    for col, run in enumerate(runs):
        sel = [r for r in ok if row_label(r) == run]
        for j, prov in enumerate(provs):
            by_group = {f"{r['shape']} {r['dtype']}": r for r in sel if r["provider"] == prov}
            xs = [i + j * width for i, g in enumerate(groups) if g in by_group]
            rs = [by_group[g] for g in groups if g in by_group]
            axes[0][col].bar(xs, [r[key] or 0 for r in rs], width, label=prov)
            axes[1][col].bar(xs, [r["peak_bytes"] / 2**30 for r in rs], width, label=prov)
        axes[0][col].set_title(run)
        axes[0][col].set_ylabel("time / floor" if cuda else "ms")
        axes[1][col].set_ylabel("peak GiB above inputs")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], groups, fontsize=8)
        if cuda:
            axes[0][col].axhline(1.0, color="k", lw=0.8, ls="--")
    axes[0][0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
