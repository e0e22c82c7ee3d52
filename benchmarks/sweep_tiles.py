"""Time Triton tile configurations of the lp triton backend (forward and backward apart).

Tile configs are pinned in ``lp_kernels.backends.triton.config`` (a different tile is a
different summation order); this script is how the pinned one was chosen. GPU only.

    python benchmarks/sweep_tiles.py --shapes S1,S4 [--variants a,b] [--det] [--out f.json]

Each variant replaces fields of the pinned bf16 config (``config_for``) and runs through
``linear_logprob_with_config``, which takes the config as an argument (``deterministic=True``
derives its own from it, so ``--det`` times that mode under the same variant). Before
timing, ``--bits`` checks that the order-only variants (tensor-descriptor against pointer
loads, launch grouping, other output tiles) give bitwise the pinned config's outputs and
gradients.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch

from lp_bench.protocol import make_inputs, parse_shapes, tile_arg
from lp_bench.timing import floor_call, steady_warmup, time_cuda
from lp_kernels.backends.triton.config import TileConfig, config_for
from lp_kernels.backends.triton.function import linear_logprob_with_config

# Each variant: TileConfig fields replaced in the pinned config. "old": no grouping,
# pointer loads, 128 x 128 tiles. ``fixed_tiles`` sets the fixed-point GEMM's tiles of
# deterministic=True (BLOCK_M, BLOCK_N, BLOCK_K); ``narrow_cost`` and ``round_group`` are
# launch choices that never change the bits.
VARIANTS = {
    "old": {"group": 0, "tma": False, "block_v": 128, "mm_block_n": 128},
    "pinned": {},
    "bv128": {"block_v": 128},
    "mm128": {"mm_block_n": 128},
    "s4": {"num_stages": 4},
    "g16": {"group": 16},
    "notma": {"tma": False},
    "bn256-bv128": {"block_n": 256, "block_v": 128},
    "chunk16k": {"vocab_chunk": 16384},
    "chunk24k": {"vocab_chunk": 24576},
    "tok16k": {"token_chunk": 16384},
    "mm256x128": {"mm_block_m": 256, "mm_block_n": 128},
    "fx128x128": {"fixed_tiles": (128, 128, 64)},
    "fx64x256": {"fixed_tiles": (64, 256, 64)},
    "fx64x128": {"fixed_tiles": (64, 128, 64)},
    "vs4k": {"v_split": 4096},
    "vs2k": {"v_split": 2048},
    "vs1k": {"v_split": 1024},
    "vs512": {"v_split": 512},
    "mm64": {"mm_block_m": 64},
    "bn64": {"block_n": 64},
    # the GEMM's output tile never narrowed by the grid (triton.gemm.mm_block_n)
    "mmwide": {"narrow_cost": float("inf")},
    # tiles whose fp32 products are rounded into grad_hidden's int64 sum per pass (the
    # default tile's plan; pinned: TileConfig.round_group)
    "rg1": {"round_group": 1},
    "rg2": {"round_group": 2},
    "rg3": {"round_group": 3},
    "rg4": {"round_group": 4},
}


def _config(base: TileConfig, variant: dict) -> TileConfig:
    return dataclasses.replace(base, **variant)


DET_TILE = {"tile": "128"}  # --det-tile: ints or tpN (bench.tile_arg, per shape), comma-separated


def _det_tile(vocab: int, spec: str | None = None) -> int:
    """The tile of ``spec`` (default: the first of --det-tile) at this vocabulary."""
    return tile_arg(spec or DET_TILE["tile"].split(",")[0], vocab)


def _run(cfg: TileConfig, hl, wl, targets, grad_out, det: str | None):
    hl.grad = wl.grad = None
    out = linear_logprob_with_config(
        hl, wl, targets, cfg, validate=False, return_entropy=True,
        deterministic=det is not None,
        deterministic_tile=_det_tile(wl.shape[0], det or None) if det is not None else 128,
    )  # fmt: skip
    (out.logprob * grad_out + out.entropy * grad_out.flip(0)).sum().backward()
    return out.logprob.detach(), out.entropy.detach(), hl.grad.clone(), wl.grad.clone()


# Variants that change only the order in which tiles run or how operands load: their
# outputs and gradients must be bitwise equal to the pinned config's.
ORDER_ONLY = {
    "pointer": {"tma": False},
    "ungrouped": {"group": 1},
    # another fixed-point tile: the same leaf products if the MMAs keep their K order
    # (not needed for TP invariance)
    "fx64x128": {"fixed_tiles": (64, 128, 64)},
    # each tile rounded on its own, whatever the group (with --det-tile tp8: 8 tiles)
    "rg1": {"round_group": 1},
    "rg3": {"round_group": 3},
    # other output tiles with the same MMA per element and the same K order: equal if the
    # tensor cores' sum of one element does not depend on the instruction's N (or on M)
    "mm128": {"mm_block_n": 128},
    "mm64": {"mm_block_m": 64},
    "bn64": {"block_n": 64},
    # the GEMM's pinned 128 x 256 tile where the grid would pick the narrow one
    "mmwide": {"narrow_cost": float("inf")},
}


def check_bits(base: TileConfig) -> list[dict]:
    """Order-only variants against the pinned config, bitwise, at an awkward N: the default
    mode, deterministic=True at the first --det-tile, and at 4224-column tiles (5 tiles,
    the last cut: the one-tile-per-piece plan of the GPU config's 8192-column chunks)."""
    rows = []
    hidden, weight, targets, grad_out = make_inputs(1000, 512, 20011)
    hl, wl = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    for det in (None, "", "4224"):
        mode = det is not None and _det_tile(wl.shape[0], det or None)  # False or the tile
        ref = _run(base, hl, wl, targets, grad_out, det)
        for name, fields in ORDER_ONLY.items():
            try:
                got = _run(_config(base, fields), hl, wl, targets, grad_out, det)
                same = [torch.equal(a, b) for a, b in zip(ref, got, strict=True)]
                row = {"check": f"{name}_bits", "deterministic": mode, "equal": same}
            except Exception as exc:  # report and go on
                row = {"check": f"{name}_bits", "deterministic": mode, "error": repr(exc)[:300]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="S1,S4", help="names (S1-S4) or NxHxV, comma-separated")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--det", action="store_true", help="also time deterministic=True")
    ap.add_argument(
        "--det-only", action="store_true", help="time deterministic=True only (with --det)"
    )
    ap.add_argument(
        "--det-tile", default="128",
        help="deterministic_tile of --det, comma-separated (each is timed; the first is "
        "--bits' deterministic run's): an int, or tpN (tp8: V padded to 1024 / 8, "
        "linear_logprob's default)",
    )  # fmt: skip
    ap.add_argument(
        "--bits", action="store_true", help="order-only variants against pinned, bitwise"
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--warm-s", type=float, default=1.0,
        help="warm every timed call up for >= S seconds: steady clocks (lp bench's protocol)",
    )  # fmt: skip
    ap.add_argument(
        "--rounds", type=int, default=1,
        help="time every variant (and the floor) in R rounds, in turn, and take the median "
        "of the rounds' medians: slow drift of the GPU's clock then falls on every variant alike",
    )  # fmt: skip
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    DET_TILE["tile"] = args.det_tile
    base = config_for(torch.device("cuda"), torch.bfloat16)
    rows = []
    if args.bits:
        rows = check_bits(base)
    for s, n, h, v in parse_shapes(args.shapes):
        hidden, weight, targets, grad_out = make_inputs(n, h, v)

        def timed(fn):  # median ms at steady clocks, as lp bench times
            warm = steady_warmup(fn, 1, args.warm_s)
            return statistics.median(time_cuda(fn, warmup=warm, reps=args.reps))

        hl, wl = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        det_tiles = args.det_tile.split(",") if args.det else []
        labels = [
            (name, det)
            for name in args.variants.split(",")
            for det in ([] if args.det_only else [None]) + det_tiles
        ]  # fmt: skip
        times: dict = {"floor": []}  # label -> [(fwd ms, total ms) per round] or error
        for _ in range(args.rounds):
            times["floor"].append(timed(floor_call(hidden, weight)))
            for name, det in labels:
                label = name + (f"/det{det}" if det else "")
                if isinstance(times.get(label), str):
                    continue  # failed in an earlier round
                cfg = _config(base, VARIANTS[name])

                def fwd(hl=hl, wl=wl, targets=targets, det=det, cfg=cfg):
                    return linear_logprob_with_config(
                        hl,
                        wl,
                        targets,
                        cfg,
                        validate=False,
                        deterministic=det is not None,
                        deterministic_tile=_det_tile(wl.shape[0], det) if det else 128,
                    ).logprob

                def step(hl=hl, wl=wl, grad_out=grad_out, fwd=fwd):
                    hl.grad = wl.grad = None
                    fwd().backward(grad_out)

                try:
                    times.setdefault(label, []).append((timed(fwd), timed(step)))
                except Exception as exc:  # report and go on: a variant may not compile
                    times[label] = repr(exc)[:300]
        floor = statistics.median(times.pop("floor"))
        for label, got in times.items():
            if isinstance(got, str):
                row = {"shape": s, "variant": label, "error": got}
            else:
                t_f = statistics.median(f for f, _ in got)
                t_all = statistics.median(t for _, t in got)
                row = {
                    "shape": s, "variant": label, "fwd_ms": t_f, "total_ms": t_all,
                    "bwd_ms": t_all - t_f, "floor_ms": floor, "x_floor": t_all / floor,
                    "rounds_total_ms": [t for _, t in got],
                }  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
        del hidden, weight, hl, wl
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"{'shape':5} {'variant':24} {'fwd':>8} {'bwd':>8} {'total':>8} {'x floor':>7}")
    for r in rows:
        if "check" in r and "error" in r:
            print(f"bits  {r['check']} det={r['deterministic']!s:5} {r['error']}")
        elif "check" in r:
            print(f"bits  {r['check']} det={r['deterministic']!s:5} equal={r['equal']}")
        elif "error" in r:
            print(f"{r['shape']:5} {r['variant']:24} {r['error']}")
        else:
            print(
                f"{r['shape']:5} {r['variant']:24} {r['fwd_ms']:8.2f} {r['bwd_ms']:8.2f} "
                f"{r['total_ms']:8.2f} {r['x_floor']:7.3f}"
            )


if __name__ == "__main__":
    main()
