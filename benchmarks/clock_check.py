"""Does the order of measurement move the floor or lp's time? (issue 3, protocol check)

``lp bench`` times the floor GEMM first, then the fp32 reference, then each provider. Under
sustained tensor-core load an H200 lowers its SM clock to stay within its power limit, so
a measurement taken right after idle can run at a higher clock than one taken after
seconds of GEMMs. This script times the floor (4 GEMMs as one call) and an lp step
(forward + backward) at each shape four ways:

- ``floor-first``: floor reps, then lp reps (the order of ``lp bench``);
- ``lp-first``: lp reps, then floor reps;
- ``interleaved``: reps alternate floor, lp, floor, lp, ...;
- ``after-idle``: each timed call after 1 s of idle GPU;

while ``nvidia-smi`` samples the SM clock and power every 50 ms (``clocks.csv``). Every
timed call records its start time, so the log shows the clock each call ran at.

Usage: python3 clock_check.py --shapes S1,S4 --reps 10 --out OUT/clock.json
       python3 clock_check.py --summarize OUT/clock.json OUT/clock-clocks.csv  (no GPU)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

import torch
from protocol import SHAPES, make_inputs, time_cuda

from lp_kernels import linear_logprob
from lp_kernels.bench import floor_call


def _timed(fn) -> tuple[float, float]:
    """(host time at start, ms) of one call; time_cuda synchronises before it."""
    t0 = time.time()
    return t0, time_cuda(fn, warmup=0, reps=1)[0]


def run_shape(name: str, n: int, h: int, v: int, reps: int, det: bool) -> dict:
    hidden, weight, targets, grad_out = make_inputs(n, h, v, device="cuda")
    hl, wl = hidden.detach().requires_grad_(), weight.detach().requires_grad_()

    def step():
        hl.grad = wl.grad = None
        out = linear_logprob(hl, wl, targets, backend="triton", validate=False, deterministic=det)
        out.logprob.backward(grad_out)

    fns = {"floor": floor_call(hidden, weight), "lp": step}
    for fn in fns.values():  # compile, allocate
        for _ in range(2):
            fn()
    torch.cuda.synchronize()
    result: dict = {"shape": name, "N": n, "H": h, "V": v, "deterministic": det}
    calls: list[dict] = []

    def record(protocol: str, which: str):
        t0, ms = _timed(fns[which])
        calls.append({"protocol": protocol, "fn": which, "t": t0, "ms": ms})
        return ms

    orders = {
        "floor-first": ["floor"] * reps + ["lp"] * reps,
        "lp-first": ["lp"] * reps + ["floor"] * reps,
        "interleaved": ["floor", "lp"] * reps,
    }
    for protocol, order in orders.items():
        time.sleep(2.0)  # the same idle start for every protocol
        for which in order:
            record(protocol, which)
    for which in ["floor", "lp"] * max(reps // 2, 2):
        time.sleep(1.0)
        record("after-idle", which)
    for protocol in [*orders, "after-idle"]:
        f = statistics.median(
            c["ms"] for c in calls if c["protocol"] == protocol and c["fn"] == "floor"
        )
        s = statistics.median(
            c["ms"] for c in calls if c["protocol"] == protocol and c["fn"] == "lp"
        )
        result[protocol] = {"floor_ms": f, "lp_ms": s, "x_floor": s / f}
    result["calls"] = calls
    return result


def clock_summary(json_path: str, csv_path: str) -> list[dict]:
    """Mean SM clock (MHz) and power (W) of the nvidia-smi samples taken during each
    protocol's floor and lp calls of a finished run (host clocks in UTC)."""
    import bisect
    import datetime

    samples = []
    with open(csv_path) as f:
        for line in f:
            cols = [c.strip() for c in line.split(",")]
            try:
                when = datetime.datetime.strptime(cols[0], "%Y/%m/%d %H:%M:%S.%f")
            except (ValueError, IndexError):
                continue
            stamp = when.replace(tzinfo=datetime.UTC).timestamp()
            samples.append((stamp, float(cols[1].split()[0]), float(cols[2].split()[0])))
    stamps = [s[0] for s in samples]
    with open(json_path) as f:
        results = json.load(f)["results"]
    out = []
    for r in results:
        for protocol in ("floor-first", "lp-first", "interleaved", "after-idle"):
            for fn in ("floor", "lp"):
                clk, watts = [], []
                for c in r["calls"]:
                    if c["protocol"] != protocol or c["fn"] != fn:
                        continue
                    i = bisect.bisect_left(stamps, c["t"])
                    j = bisect.bisect_left(stamps, c["t"] + c["ms"] / 1e3)
                    for _, mhz, w in samples[max(i - 1, 0) : j + 1]:
                        clk.append(mhz)
                        watts.append(w)
                out.append(
                    {
                        "shape": r["shape"], "deterministic": r["deterministic"],
                        "protocol": protocol, "fn": fn, "ms": r[protocol][f"{fn}_ms"],
                        "mhz": statistics.mean(clk) if clk else None,
                        "watts": statistics.mean(watts) if watts else None,
                    }
                )  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--summarize", nargs=2, metavar=("JSON", "CSV"),
        help="print the clock and power of each protocol's calls from a finished run",
    )  # fmt: skip
    parser.add_argument("--shapes", default="S1,S4")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--det", action="store_true", help="time deterministic=True as well")
    parser.add_argument("--out", default="clock.json")
    args = parser.parse_args()
    if args.summarize:
        print(f"{'shape':6} {'mode':8} {'protocol':12} {'call':6} {'ms':>8} {'MHz':>6} {'W':>5}")
        for r in clock_summary(*args.summarize):
            mode = "det" if r["deterministic"] else "default"
            mhz = "-" if r["mhz"] is None else f"{r['mhz']:.0f}"
            w = "-" if r["watts"] is None else f"{r['watts']:.0f}"
            print(f"{r['shape']:6} {mode:8} {r['protocol']:12} {r['fn']:6} {r['ms']:8.2f} "
                  f"{mhz:>6} {w:>5}")  # fmt: skip
        return
    results = []
    with open(args.out.replace(".json", "-clocks.csv"), "w") as log:
        smi = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
             "--format=csv,noheader", "-lms", "50"],
            stdout=log,
        )  # fmt: skip
        try:
            for name in args.shapes.split(","):
                for det in (False, True) if args.det else (False,):
                    results.append(run_shape(name, *SHAPES[name], args.reps, det))
        finally:
            smi.terminate()
            smi.wait()
    with open(args.out, "w") as f:
        json.dump({"host_time_zone": time.strftime("%z"), "results": results}, f, indent=1)
    print(f"{'shape':6} {'mode':8} {'protocol':12} {'floor ms':>9} {'lp ms':>8} {'x floor':>8}")
    for r in results:
        mode = "det" if r["deterministic"] else "default"
        for protocol in ("floor-first", "lp-first", "interleaved", "after-idle"):
            p = r[protocol]
            print(f"{r['shape']:6} {mode:8} {protocol:12} {p['floor_ms']:9.2f} {p['lp_ms']:8.2f} "
                  f"{p['x_floor']:8.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
