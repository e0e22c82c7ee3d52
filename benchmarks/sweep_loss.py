"""Time ``linear_logprob_loss`` (the fused RL loss, three GEMMs) against the 4-matmul floor,
lp's log-prob path + the same loss, and the materialized path; sweep its block rows and the
forward's split; time the forward-only split at every shape. GPU only.

    python benchmarks/sweep_loss.py --shapes S1,S2,S3,S4,S5,S6 [--variants a,b] [--out f.json]

The step is a DAPO-style loss (clip 0.2 / 0.28) with a k3 KL penalty to reference
log-probs (coefficient 0.04), token-mean weights and one advantage per 1024-token sequence.
Each variant replaces fields of the pinned config and runs through
``linear_logprob_loss_with_config``. Errors are norm-wise relative to lp's log-prob path
(``lp``) in the same run: loss, grad_hidden, grad_weight.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch
import torch.nn.functional as F

from lp_bench.protocol import make_inputs, parse_shapes
from lp_bench.timing import floor_call, steady_warmup, time_cuda
from lp_kernels import linear_logprob, linear_logprob_loss
from lp_kernels.backends.triton.config import config_for
from lp_kernels.backends.triton.function import linear_logprob_with_config
from lp_kernels.backends.triton.loss import linear_logprob_loss_with_config
from lp_kernels.losses import dapo, token_weights

VARIANTS = {
    "pinned": {},
    "r1k": {"loss_rows": 1024},
    "r2k": {"loss_rows": 2048},
    "r4k": {"loss_rows": 4096},
    "g4k": {"loss_grad_rows": 4096},
    "g16k": {"loss_grad_rows": 16384},
    "vs4k": {"v_split": 4096},
    "vs4k-r4k": {"v_split": 4096, "loss_rows": 4096},
    "lb8": {"loss_block": (8, 512, 1)},
    "lb32": {"loss_block": (32, 256, 1)},
    "lb8x16": {"loss_block": (8, 512, 16)},
}
LOSS = dapo(kl_coef=0.04)


def per_token(n: int, logprob: torch.Tensor) -> dict:
    g = torch.Generator(device="cpu").manual_seed(1)
    seqs = max(1, n // 1024)
    adv = torch.randn(seqs, generator=g).repeat_interleave(-(-n // seqs))[:n]
    noise = torch.randn(2, n, generator=g) * 0.05
    mask = torch.ones(1, n)
    dev = logprob.device
    return {
        "old_logprob": (logprob.cpu() + noise[0]).to(dev),
        "ref_logprob": (logprob.cpu() + noise[1]).to(dev),
        "advantages": adv.to(dev),
        "weights": token_weights(mask, "token-mean").reshape(-1).to(dev),
    }


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def profiled(shape: str, label: str, fn) -> dict:
    """One profiled call of ``fn`` after a warm-up: the step's wall ms, the GPU busy ms, and
    busy ms per kernel name (largest 10)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name[:90]] = kernels.get(e.name[:90], 0.0) + e.device_time / 1e3
    top = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:10])
    return {"shape": shape, "provider": f"profile/{label}", "wall_ms": start.elapsed_time(end),
            "busy_ms": sum(kernels.values()), "kernels_ms": top}  # fmt: skip


def shape_rows(s, n, h, v, args, base, timed) -> list[dict]:
    """The rows of one shape (its tensors are freed when it returns)."""
    rows = []
    hidden, weight, targets, _ = make_inputs(n, h, v)
    hl, wl = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    with torch.no_grad():
        lp0 = linear_logprob(hidden, weight, targets, validate=False).logprob
    pt = per_token(n, lp0)
    floor = timed(floor_call(hidden, weight))
    floor1 = timed(floor_call(hidden, weight, matmuls=1))
    base_bytes = torch.cuda.memory_allocated()

    def run(fn):
        hl.grad = wl.grad = None
        loss = fn()
        loss.backward()
        return loss.detach(), hl.grad, wl.grad

    def lp_step():
        out = linear_logprob(hl, wl, targets, validate=False, return_lse=True)
        return LOSS(out.logprob, None, out.lse, **pt).sum()

    def mat_step():
        logits = F.linear(hl, wl).float()
        logp = torch.log_softmax(logits, dim=-1)
        lp = logp.gather(-1, targets[:, None]).squeeze(-1)
        return LOSS(lp, None, torch.logsumexp(logits, -1), **pt).sum()

    steps = {"lp": lp_step}
    if not args.no_materialized:
        steps["materialized"] = mat_step
    for name in args.variants.split(","):
        cfg = dataclasses.replace(base, **VARIANTS[name])

        def fused(cfg=cfg):
            return linear_logprob_loss_with_config(
                hl, wl, targets, LOSS, cfg, per_token=pt, validate=False
            ).loss

        steps[f"lp-loss/{name}"] = fused
    steps["lp-loss/public"] = lambda: linear_logprob_loss(
        hl, wl, targets, LOSS, per_token=pt, validate=False
    ).loss
    if args.profile:
        for label in ("lp-loss/pinned", "lp"):
            rows.append(profiled(s, label, lambda fn=steps[label]: run(fn)))
            print(json.dumps(rows[-1]), flush=True)
    ref = None
    for label, fn in steps.items():
        row = {"shape": s, "n": n, "h": h, "v": v, "provider": label, "floor_ms": floor}
        try:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            got = run(fn)
            torch.cuda.synchronize()
            row["peak_gib"] = (torch.cuda.max_memory_allocated() - base_bytes) / 2**30
            if ref is None:
                ref = tuple(x.clone() for x in got)
            row["err"] = [rel(a, b) for a, b in zip(got, ref, strict=True)]
            row["ms"] = timed(lambda fn=fn: run(fn))
            row["x_floor"] = row["ms"] / floor
        except Exception as exc:  # report and go on
            row["error"] = repr(exc)[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)
    if not args.no_fwd:
        for name, fields in (("pinned", {}), ("vs4k", {"v_split": 4096})):
            cfg = dataclasses.replace(base, **fields)
            for ent in (False, True):

                def fwd(cfg=cfg, ent=ent):
                    with torch.no_grad():
                        return linear_logprob_with_config(
                            hidden, weight, targets, cfg, validate=False, return_entropy=ent
                        ).logprob

                ms = timed(fwd)
                row = {"shape": s, "provider": f"fwd/{name}", "entropy": ent, "ms": ms,
                       "floor1_ms": floor1, "x_floor1": ms / floor1}  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="S1,S2,S3,S4,S5,S6")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--no-materialized", action="store_true")
    ap.add_argument("--no-fwd", action="store_true", help="skip the forward-only v_split rows")
    ap.add_argument(
        "--profile", action="store_true",
        help="per shape, one profiled step of lp-loss (pinned) and lp: GPU busy time by kernel",
    )  # fmt: skip
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warm-s", type=float, default=1.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    base = config_for(torch.device("cuda"), torch.bfloat16)
    rows = []

    def timed(fn):
        warm = steady_warmup(fn, 1, args.warm_s)
        return statistics.median(time_cuda(fn, warmup=warm, reps=args.reps))

    for s, n, h, v in parse_shapes(args.shapes):
        rows += shape_rows(s, n, h, v, args, base, timed)
        torch.cuda.empty_cache()
    print(f"\n{'shape':6} {'provider':22} {'x floor':>8} {'ms':>9} {'GiB':>6}  err (loss, gh, gw)")
    for r in rows:
        if "busy_ms" in r:
            print(f"{r['shape']:6} {r['provider']:22} wall {r['wall_ms']:.2f} ms, busy "
                  f"{r['busy_ms']:.2f} ms: " + "; ".join(
                      f"{k[:40]} {v:.2f}" for k, v in r["kernels_ms"].items()))  # fmt: skip
        elif "x_floor1" in r:
            print(f"{r['shape']:6} {r['provider'] + ('+ent' if r['entropy'] else ''):22} "
                  f"{r['x_floor1']:8.3f} {r['ms']:9.2f}   (x one matmul)")  # fmt: skip
        elif "error" in r:
            print(f"{r['shape']:6} {r['provider']:22} error {r['error'][:80]}")
        else:
            err = ", ".join(f"{e:.1e}" for e in r["err"])
            print(f"{r['shape']:6} {r['provider']:22} {r['x_floor']:8.3f} {r['ms']:9.2f} "
                  f"{r['peak_gib']:6.2f}  {err}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
