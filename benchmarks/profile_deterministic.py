"""Where does deterministic=True spend its time? Each phase of the triton backend, timed
apart, default mode next to deterministic mode (GPU; the issue 4 cost breakdown).

    python benchmarks/profile_deterministic.py --shapes S1,S4 [--out phases.json]

Phases, each over the whole vocabulary of one GPU (one token chunk of N rows, which is
all of N up to 8192 tokens):

- forward: the statistics kernel (8192-column splits vs one partial per 128-column tile)
  plus the in-order merge;
- d_logits: the recompute kernel (the same in both modes);
- grad_weight: cuBLAS (default) vs lp's fixed-tile Triton GEMM (deterministic);
- grad_hidden: the fp32 accumulate GEMM vs the int64 fixed-point GEMM.

The GEMM phases run on a d_logits buffer of random values (time does not depend on them).
On CPU (TRITON_INTERPRET=1) it runs at a tiny shape only, as a smoke test of the script.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from protocol import SHAPES, make_inputs

import lp_kernels.backends.triton_deterministic as det
import lp_kernels.backends.triton_linear as tri
from lp_kernels._types import LogprobParams


def _timer(device: str):
    def run(fn, reps: int = 3) -> float:
        fn()  # warm-up (and compilation)
        times = []
        for _ in range(reps):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return run


def _phases(mode: str, hidden, weight, t_col, p: LogprobParams, timer, device: str) -> dict:
    """Milliseconds of each phase in one mode ("default" or "det")."""
    n, h = hidden.shape
    v = weight.shape[0]
    fixed = None
    if mode == "det":
        cfg, fixed = det.config_for(hidden.device, hidden.dtype)
    else:
        cfg = tri.config_for(hidden.device, hidden.dtype)
    rows = min(cfg.token_chunk, n)
    h_c, t_c = hidden[:rows], t_col[:rows]
    out: dict = {}

    def fwd():
        return tri.merge(tri.forward_stats(h_c, weight, t_c, p, cfg), entropy=False)

    out["forward"] = timer(fwd)
    lse = fwd()[0]
    buf = torch.randn(rows, tri.buffer_width(v, cfg), device=device).to(hidden.dtype)
    zeros = torch.zeros(rows, device=device)
    acc_w = torch.zeros(cfg.vocab_chunk, h, device=device)
    gw = torch.empty(cfg.vocab_chunk, h, device=device, dtype=hidden.dtype)
    acc_h = torch.zeros(rows, h, device=device)
    acc_i = torch.zeros(rows, h, dtype=torch.int64, device=device)
    scale = torch.ones(rows, device=device)
    chunks = [(v0, min(cfg.vocab_chunk, v - v0)) for v0 in range(0, v, cfg.vocab_chunk)]

    def dlogits():
        for v0, cnt in chunks:
            cols = tri.pad_cols(cnt, buf)
            tri._dlogits(
                h_c, weight, t_c, lse, None, None, None, zeros, buf[:, :cols], v0, cnt, p, cfg
            )

    def grad_w():
        for _, cnt in chunks:
            if mode == "default":
                tri._grad_weight_slice(buf[:, :cnt], h_c, gw[:cnt])
            else:
                tri._matmul_acc_(acc_w[:cnt], buf[:, :cnt].T, h_c, cfg, m_a=tri.pad_cols(cnt, buf))

    def grad_h():
        for v0, cnt in chunks:
            dl, w_c, cols = buf[:, :cnt], weight[v0 : v0 + cnt], tri.pad_cols(cnt, buf)
            if mode == "default":
                tri._matmul_acc_(acc_h, dl, w_c, cfg, k_a=cols)
            else:
                det._matmul_fixed_(acc_i, dl, w_c, scale, cols, fixed, cfg)

    out["dlogits"] = timer(dlogits)
    out["grad_weight"] = timer(grad_w)
    out["grad_hidden"] = timer(grad_h)
    return out


def profile(name: str, n: int, h: int, v: int, device: str) -> dict:
    hidden, weight, targets, _ = make_inputs(n, h, v, device=device)
    p = LogprobParams(
        temperature=1.0, ignore_index=-100, return_entropy=False, return_lse=False,
        vocab_start=0, vocab_size=v, chunk_size=16, max_v_local=v, shard_sizes=(v,),
    )  # fmt: skip
    timer = _timer(device)
    row: dict = {"shape": name, "N": n, "H": h, "V": v}
    for mode in ("default", "det"):
        for phase, ms in _phases(mode, hidden, weight, targets, p, timer, device).items():
            row[f"{mode}_{phase}_ms"] = ms
    if device == "cuda":
        row["gemm_ms"] = timer(lambda: hidden[: min(n, 8192)] @ weight.T)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="S1,S4")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        shapes = [("tiny", 64, 32, 1000)]
    else:
        shapes = [(s, *SHAPES[s]) for s in args.shapes.split(",")]
    rows = [profile(*s, device) for s in shapes]
    phases = ("forward", "dlogits", "grad_weight", "grad_hidden")
    print(f"{'shape':6} {'phase':12} {'default ms':>11} {'det ms':>9} {'det/default':>12}")
    for r in rows:
        for ph in phases:
            a, b = r[f"default_{ph}_ms"], r[f"det_{ph}_ms"]
            print(f"{r['shape']:6} {ph:12} {a:11.2f} {b:9.2f} {b / a:12.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
