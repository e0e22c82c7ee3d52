"""Where the host's time goes when it issues one step of the triton backend (cProfile).

``small_n.py`` found that at a thousand tokens the host, not the GPU, sets the step's pace.
This profiles the host side of forward + backward (``validate=False``, no host sync), with
a long GPU spin queued ahead so that the host never waits on the GPU. GPU only::

    python benchmarks/host_profile.py --shape 1024x2048x248320 [--steps 5] [--out prof.txt]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from lp_kernels import linear_logprob
from lp_kernels.bench import make_inputs, parse_shapes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1024x2048x248320")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--entropy", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ((_, n, h, v),) = parse_shapes(args.shape)
    hidden, weight, targets, grad_out = make_inputs(n, h, v)
    hl, wl = hidden.detach().requires_grad_(), weight.detach().requires_grad_()

    def step():
        hl.grad = wl.grad = None
        out = linear_logprob(
            hl, wl, targets, backend="triton", validate=False, return_entropy=args.entropy
        )
        (out.logprob * grad_out + (out.entropy if args.entropy else 0)).sum().backward()

    for _ in range(3):  # compile and warm the caches
        step()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU spin: the host never waits
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(args.steps):
        step()
    prof.disable()
    host_ms = (time.perf_counter() - t0) * 1e3 / args.steps
    torch.cuda.synchronize()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    text = f"{args.shape}: host {host_ms:.2f} ms per step (under cProfile)\n" + buf.getvalue()
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
