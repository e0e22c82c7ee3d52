"""Is the train step power-bound? Sustained phases of the triton step (plain, softcap 30
with a bias, each option alone) and of four matmuls, with ``nvidia-smi`` sampling the SM
clock, board power and throttle reasons every 50 ms. (GPU only.)

    python benchmarks/step_power.py [--shapes S2,S4] [--secs 4] [--rounds 2] [--out f.json]

Each phase calls its function back to back for ``--secs`` seconds (a synchronize every
fourth call), after one warm-up call of each; the phases follow one another in rounds.
Per phase: milliseconds per call (CUDA events over the phase), the median and lowest SM
clock and the median and highest board power over the phase's samples after its first
0.5 s, the power limit, the highest temperature and the most frequent throttle-reason
mask (``0x4``: the software power cap). A step: ``linear_logprob(hidden, weight, targets,
[softcap=30], [bias=b])`` on ``lp bench``'s inputs (bf16, ``make_inputs`` and
``make_bias``), its logprob times the upstream gradient summed, then
``backward()``; four matmuls: ``torch.mm(hidden, weight.T)`` four times (the floor of
``lp bench``'s train mode).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import tempfile
import time

import torch

from lp_bench.protocol import SHAPES, make_bias, make_inputs
from lp_kernels import linear_logprob

QUERY = "timestamp,clocks.sm,power.draw,power.limit,temperature.gpu,clocks_throttle_reasons.active"


def phases_of(shape: str):
    n, h, v = SHAPES[shape]
    hidden, weight, targets, upstream = make_inputs(n, h, v)  # lp bench's inputs
    bias = make_bias(v).requires_grad_()
    hidden.requires_grad_(), weight.requires_grad_()

    def step(cap: bool, with_bias: bool):
        kw = ({"softcap": 30.0} if cap else {}) | ({"bias": bias} if with_bias else {})
        out = linear_logprob(hidden, weight, targets, **kw)
        (out.logprob * upstream).sum().backward()
        hidden.grad = weight.grad = bias.grad = None

    def floor():
        for _ in range(4):
            torch.mm(hidden, weight.T)

    return {
        "plain": lambda: step(False, False),
        "softcap+bias": lambda: step(True, True),
        "softcap": lambda: step(True, False),
        "bias": lambda: step(False, True),
        "4 matmuls": floor,
    }


def run_phase(fn, secs: float) -> tuple[float, float, float, int]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0, calls = time.time(), 0
    start.record()
    while time.time() - t0 < secs:
        fn()
        calls += 1
        if calls % 4 == 0:
            torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    return t0, time.time(), start.elapsed_time(end) / calls, calls


def samples(path: str) -> list[tuple]:
    rows = []
    with open(path) as f:
        text = f.read().splitlines()
    for line in text:
        c = [x.strip() for x in line.split(",")]
        try:  # nvidia-smi's timestamps are local time, as time.time()'s
            ts = datetime.datetime.strptime(c[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            rows.append((ts, float(c[1]), float(c[2]), float(c[3]), float(c[4]), c[5]))
        except (ValueError, IndexError):  # a header or a cut-off last line
            continue
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="S2,S4")
    parser.add_argument("--secs", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("step_power.py needs a CUDA GPU and nvidia-smi")
    cmd = ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "50"]
    phases = []
    with tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False) as log:
        smi = subprocess.Popen(cmd, stdout=log)
        time.sleep(1.0)
        try:
            for shape in args.shapes.split(","):
                fns = phases_of(shape)
                for fn in fns.values():
                    fn()
                torch.cuda.synchronize()
                for rnd in range(args.rounds):
                    for name, fn in fns.items():
                        t0, t1, ms, calls = run_phase(fn, args.secs)
                        phases.append({"shape": shape, "phase": name, "round": rnd, "t0": t0,
                                       "t1": t1, "ms": ms, "calls": calls})  # fmt: skip
                    time.sleep(0.5)
                del fns
                torch.cuda.empty_cache()
            time.sleep(0.5)
        finally:
            smi.terminate()
            smi.wait()
    rows = samples(log.name)
    os.unlink(log.name)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("shape phase         r  ms/call  SM MHz med  min   W med  max  limit  temp  throttle")
    for ph in phases:
        sel = [r for r in rows if ph["t0"] + 0.5 <= r[0] <= ph["t1"]]
        if not sel:
            print(ph["shape"], ph["phase"], "no samples")
            continue
        ph.update(
            sm_med=statistics.median(r[1] for r in sel), sm_min=min(r[1] for r in sel),
            w_med=statistics.median(r[2] for r in sel), w_max=max(r[2] for r in sel),
            limit=sel[0][3], temp=max(r[4] for r in sel),
            throttle=statistics.mode(r[5] for r in sel),
        )  # fmt: skip
        cells = (ph["shape"], ph["phase"], ph["round"], ph["ms"], ph["sm_med"], ph["sm_min"])
        cells += (ph["w_med"], ph["w_max"], ph["limit"], ph["temp"], ph["throttle"])
        row = "{:5s} {:13s} {} {:8.2f}  {:10.0f} {:4.0f}  {:6.0f} {:4.0f}  {:5.0f}  {:4.0f}  {}"
        print(row.format(*cells))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(phases, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
