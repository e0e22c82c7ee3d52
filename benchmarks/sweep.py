"""Sweep the triton backend's launch configuration: time variants of the pinned config, and
check that the variants which only reorder work give the pinned config's bits.

A block size is part of the numerics (another block is another summation order), so the
config is pinned (``lp_kernels.backends.triton.config.config_for``); this tool is how the
pinned one was chosen. A variant is a dict of phase fields applied to the pinned config of
the device and bf16 by ``KernelConfig.replace``, e.g. ``{"logits": {"block_v": 128},
"tma": False}``; lp's public ops run under it inside ``use_config`` (the backward under
its forward's config)::

    python benchmarks/sweep.py tiles [--shapes S1,S4] [--variants a,b] [--bits] [--det]
        [--det-only] [--det-tile 128,tp8] [--bias] [--rounds R] [--reps N] [--warm-s S]
        [--no-time] [--out F.json]
    python benchmarks/sweep.py loss [--shapes S1,S2,S3,S4,S5,S6] [--variants a,b] [--bias]
        [--no-materialized] [--fwd-variants pinned,vs4k] [--profile] [timing options]
    python benchmarks/sweep.py tiles|loss --list

``tiles`` times ``linear_logprob``'s forward and its train step (forward + backward of a
per-token upstream gradient) per variant; ``--det`` adds deterministic=True at each
``--det-tile`` (``--det-only``: only that). ``--bits`` first checks, per shape, that every
order-only variant (``*`` in ``--list``) gives bitwise (``torch.equal``) the pinned
config's logprob, entropy and gradients: in the default mode, in deterministic=True at the
first ``--det-tile`` and at 4224-column tiles (the last one cut: one tile per vocabulary
chunk under the GPU config's 8192-column chunks). An awkward N (``--shapes
1000x512x20011``) covers the row masks.

``loss`` times ``linear_logprob_loss`` per variant against lp's log-prob path plus the same
loss (``lp``) and the materialized logits (``materialized``). The loss is ``lp bench``'s
(``lp_bench.protocol.policy_loss``: DAPO, clip 0.2 / 0.28, a k3 KL penalty of 0.04, token-
mean weights, one advantage per 1024 tokens). Each row has its peak memory, its norm-wise
errors (loss, grad_hidden, grad_weight) relative to ``lp`` and whether its bits equal
``lp-loss/pinned``'s; then the forward alone (``fwd/NAME``, with and without entropy) per
``--fwd-variants`` against one matmul. ``--profile`` adds one profiled step (GPU busy time
by kernel) of ``lp-loss/pinned`` and ``lp``.

Timing: per shape, every call and the floor (four ``[N, H] x [H, V]`` matmuls; one for a
forward) in the same process, in ``--rounds`` paired rounds (``lp_bench.timing``): the
median over rounds of each call's median of ``--reps``, after ``--warm-s`` seconds of
warm-up (steady clocks). A variant that fails (one that does not compile) gives an error
row. Inputs are ``lp bench``'s (``lp_bench.protocol.make_inputs``, bf16).

Without a GPU the tool runs the triton backend on CPU under Triton's interpreter (it sets
TRITON_INTERPRET itself), with the interpreter's pinned config and tiny default shapes (a
smoke test): the bits checks hold that config to the same rule as on a GPU, but the times
are ``time.perf_counter`` ms of interpreted calls, which show that the tool runs and rank
nothing (``--no-time`` skips them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from statistics import median

import torch

from lp_bench.environment import environment
from lp_bench.memory import peak_bytes
from lp_bench.protocol import (
    loss_per_token,
    make_bias,
    make_inputs,
    parse_shapes,
    policy_loss,
    rel_err,
    tile_arg,
)
from lp_bench.timing import floor_call, paired_rounds

# ============================================================================ variants

# name -> changes of the pinned config. "old": no launch swizzle, pointer loads, 128 x 128
# logits and GEMM blocks. ``num_stages`` was one field of both kernels' K loops ("s4").
TILE_VARIANTS: dict[str, dict] = {
    "old": {"swizzle": 0, "tma": False, "logits": {"block_v": 128}, "gemm": {"block_n": 128}},
    "pinned": {},
    "bv128": {"logits": {"block_v": 128}},
    "bn64": {"logits": {"block_n": 64}},
    "bn256-bv128": {"logits": {"block_n": 256, "block_v": 128}},
    "s4": {"logits": {"num_stages": 4}, "gemm": {"num_stages": 4}},
    "g16": {"swizzle": 16},
    "swizzle1": {"swizzle": 1},
    "notma": {"tma": False},
    "chunk16k": {"backward": {"vocab_chunk": 16384}},
    "chunk24k": {"backward": {"vocab_chunk": 24576}},
    "tok16k": {"backward": {"token_chunk": 16384}},
    "mm128": {"gemm": {"block_n": 128}},
    "mm64": {"gemm": {"block_m": 64}},
    "mm256x128": {"gemm": {"block_m": 256, "block_n": 128}},
    # the GEMM's pinned output block where the grid would take the narrow one
    "mmwide": {"gemm": {"narrow_cost": float("inf")}},
    "vs4k": {"forward": {"v_split": 4096}},
    "vs2k": {"forward": {"v_split": 2048}},
    "vs1k": {"forward": {"v_split": 1024}},
    "vs512": {"forward": {"v_split": 512}},
    # deterministic=True: the fixed-point GEMM's (BLOCK_M, BLOCK_N, BLOCK_K), and how many
    # wide tiles' fp32 products wait to be rounded into grad_hidden's int64 sum in one pass
    "fx128x128": {"deterministic": {"fixed_blocks": (128, 128, 64)}},
    "fx64x256": {"deterministic": {"fixed_blocks": (64, 256, 64)}},
    "fx64x128": {"deterministic": {"fixed_blocks": (64, 128, 64)}},
    "rg1": {"deterministic": {"round_tiles": 1}},
    "rg2": {"deterministic": {"round_tiles": 2}},
    "rg3": {"deterministic": {"round_tiles": 3}},
    "rg4": {"deterministic": {"round_tiles": 4}},
}
# Variants that change only the order in which blocks run or how operands load, or blocks
# whose elements keep their products and K order (equal if the tensor cores' sum of one
# element does not depend on the instruction's N or M): ``--bits`` holds them to the pinned
# config's bits. fx64x128: the same 128-column leaves if the MMAs keep their K order;
# rg1 / rg3: each tile is rounded on its own, however many a round takes.
ORDER_ONLY = ("notma", "swizzle1", "fx64x128", "rg1", "rg3", "mm128", "mm64", "bn64", "mmwide")
WIDE_TILE = "4224"  # --bits' second deterministic tile (see the docstring)

# name -> changes of the pinned config for linear_logprob_loss. bb* matter with --bias only.
LOSS_VARIANTS: dict[str, dict] = {
    "pinned": {},
    "r1k": {"loss": {"rows": 1024}},
    "r2k": {"loss": {"rows": 2048}},
    "r4k": {"loss": {"rows": 4096}},
    "g4k": {"loss": {"grad_rows": 4096}},
    "g16k": {"loss": {"grad_rows": 16384}},
    "vs4k": {"forward": {"v_split": 4096}},
    "vs4k-r4k": {"forward": {"v_split": 4096}, "loss": {"rows": 4096}},
    "lb8": {"loss": {"block": (8, 512, 1)}},
    "lb32": {"loss": {"block": (32, 256, 1)}},
    "lb8x16": {"loss": {"block": (8, 512, 16)}},
    "bb16": {"loss": {"bias_block": (16, 512, 16)}},
    "bb32x8": {"loss": {"bias_block": (32, 256, 8)}},
    "w4": {"loss": {"num_warps": 4}},
}
OPS = {"tiles": (TILE_VARIANTS, ORDER_ONLY), "loss": (LOSS_VARIANTS, ())}


def describe(variant: dict) -> str:
    """``logits.block_v=128, tma=False``; ``(pinned)`` for no change."""
    parts = []
    for name, value in variant.items():
        if isinstance(value, dict):
            parts += [f"{name}.{field}={v}" for field, v in value.items()]
        else:
            parts.append(f"{name}={value}")
    return ", ".join(parts) or "(pinned)"


def configs(base, table: dict, names: list[str]) -> dict:
    """name -> ``base.replace(**table[name])`` (a misspelt field raises here, at once)."""
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {', '.join(table)}")
    return {name: base.replace(**table[name]) for name in names}


def print_table(op: str, base, device: str) -> None:
    table, order_only = OPS[op]
    configs(base, table, list(table))
    said = " (*: order-only, --bits checks them)" if order_only else ""
    print(f"{op} variants of the pinned config on {device}{said}")
    for name, variant in table.items():
        print(f"  {name:12s} {'*' if name in order_only else ' '} {describe(variant)}")


# ============================================================================ problem


@dataclasses.dataclass
class Problem:
    """One shape's inputs (``lp bench``'s): leaves that require grad, targets, a per-token
    upstream gradient, an optional bias."""

    hidden: torch.Tensor
    weight: torch.Tensor
    targets: torch.Tensor
    grad_out: torch.Tensor
    bias: torch.Tensor | None

    @classmethod
    def make(cls, n: int, h: int, v: int, device: str, bias: bool) -> Problem:
        hidden, weight, targets, grad_out = make_inputs(n, h, v, device=device)
        b = make_bias(v, device=device).requires_grad_() if bias else None
        return cls(hidden.requires_grad_(), weight.requires_grad_(), targets, grad_out, b)

    def leaves(self) -> list[torch.Tensor]:
        return [x for x in (self.hidden, self.weight, self.bias) if x is not None]

    def zero_grad(self) -> None:
        for x in self.leaves():
            x.grad = None

    def grads(self) -> dict[str, torch.Tensor]:
        names = ("grad_hidden", "grad_weight", "grad_bias")
        return {name: x.grad.clone() for name, x in zip(names, self.leaves(), strict=False)}

    def call(self, cfg, det_tile: int | None = None, **kw):
        """``linear_logprob`` under ``cfg`` (deterministic=True at ``det_tile``, if any)."""
        from lp_kernels import linear_logprob
        from lp_kernels.backends.triton.config import use_config

        with use_config(cfg):
            return linear_logprob(
                self.hidden,
                self.weight,
                self.targets,
                bias=self.bias,
                backend="triton",
                validate=False,
                deterministic=det_tile is not None,
                deterministic_tile=det_tile,
                **kw,
            )

    def forward(self, cfg, det_tile: int | None = None) -> torch.Tensor:
        return self.call(cfg, det_tile).logprob

    def step(self, cfg, det_tile: int | None = None) -> None:
        self.zero_grad()
        self.forward(cfg, det_tile).backward(self.grad_out)

    def outputs(self, cfg, det_tile: int | None) -> dict[str, torch.Tensor]:
        """logprob, entropy and the gradients of a step with both upstream gradients."""
        self.zero_grad()
        out = self.call(cfg, det_tile, return_entropy=True)
        (out.logprob * self.grad_out + out.entropy * self.grad_out.flip(0)).sum().backward()
        return {"logprob": out.logprob.detach(), "entropy": out.entropy.detach(), **self.grads()}


# ============================================================================ timing


def time_calls(calls: dict[str, dict[str, Callable]], args, device: str) -> tuple[dict, dict]:
    """``label -> part -> ms per round`` and ``label -> error``: each label's calls run
    once (a label whose call raises is reported and dropped: a variant may not compile),
    then every call in paired rounds (``lp_bench.timing.paired_rounds``)."""
    errors = {}
    for label, parts in calls.items():
        try:
            for fn in parts.values():
                fn()
        except Exception as exc:  # report and go on
            errors[label] = repr(exc)[:300]
    flat = {
        (label, part): fn
        for label, parts in calls.items()
        if label not in errors
        for part, fn in parts.items()
    }
    runs = paired_rounds(flat, args.rounds, args.reps, args.warm_s, device=device)
    times: dict = {}
    for (label, part), ms in runs.items():
        times.setdefault(label, {})[part] = ms
    return times, errors


def floors(p: Problem) -> dict[str, Callable]:
    """The floor of a train step (4 matmuls) and of a forward (1)."""
    hidden, weight = p.hidden.detach(), p.weight.detach()
    return {"step": floor_call(hidden, weight), "fwd": floor_call(hidden, weight, matmuls=1)}


# ============================================================================ tiles


def check_bits(p: Problem, shape: str, base, det_tiles: list[int]) -> list[dict]:
    """Every order-only variant against the pinned config, bitwise: the default mode,
    deterministic=True at the first --det-tile and at :data:`WIDE_TILE`."""
    rows = []
    variants = configs(base, TILE_VARIANTS, list(ORDER_ONLY))
    for tile in (None, det_tiles[0], int(WIDE_TILE)):
        ref = p.outputs(base, tile)
        for name, cfg in variants.items():
            row = {"op": "tiles", "check": "bits", "shape": shape, "variant": name}
            row["deterministic"] = tile or False
            try:
                got = p.outputs(cfg, tile)
                row["equal"] = {k: torch.equal(ref[k], got[k]) for k in ref}
            except Exception as exc:  # report and go on
                row["error"] = repr(exc)[:300]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def time_tiles(p: Problem, shape: str, base, det_tiles: list[int], args, device) -> list[dict]:
    """The forward and the train step of every variant (and mode), against the floor."""
    modes = ([] if args.det_only else [None]) + (det_tiles if args.det or args.det_only else [])
    calls: dict = {"floor": {"step": floors(p)["step"]}}
    for name, cfg in configs(base, TILE_VARIANTS, args.variants).items():
        for tile in modes:
            label = name if tile is None else f"{name}/det{tile}"
            calls[label] = {
                "fwd": lambda cfg=cfg, tile=tile: p.forward(cfg, tile),
                "step": lambda cfg=cfg, tile=tile: p.step(cfg, tile),
            }
    times, errors = time_calls(calls, args, device)
    floor = median(times.pop("floor")["step"])
    rows = []
    for label in list(calls)[1:]:
        row = {"op": "tiles", "shape": shape, "variant": label}
        if label in errors:
            row["error"] = errors[label]
        else:
            fwd, step = median(times[label]["fwd"]), median(times[label]["step"])
            row.update(fwd_ms=fwd, bwd_ms=step - fwd, total_ms=step, floor_ms=floor)
            row.update(x_floor=step / floor, rounds_total_ms=times[label]["step"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def run_tiles(p: Problem, shape: tuple, base, args, device: str) -> list[dict]:
    det_tiles = list(dict.fromkeys(tile_arg(t, shape[3]) for t in args.det_tile.split(",")))
    rows = check_bits(p, shape[0], base, det_tiles) if args.bits else []
    if not args.no_time:
        rows += time_tiles(p, shape[0], base, det_tiles, args, device)
    return rows


def report_tiles(rows: list[dict]) -> None:
    print(f"\n{'shape':12} {'variant':24} {'fwd':>8} {'bwd':>8} {'total':>8} {'x floor':>7}")
    for r in rows:
        head = f"{r['shape']:12} {r['variant']:24}"
        if "check" in r:
            differ = [k for k, same in r.get("equal", {}).items() if not same]
            said = r.get("error") or (f"DIFFER: {', '.join(differ)}" if differ else "equal")
            print(f"{head} bits det={r['deterministic']!s:5} {said}")
        elif "error" in r:
            print(f"{head} error {r['error'][:80]}")
        else:
            print(
                f"{head} {r['fwd_ms']:8.2f} {r['bwd_ms']:8.2f} {r['total_ms']:8.2f} "
                f"{r['x_floor']:7.3f}"
            )


# ============================================================================ loss


def loss_steps(p: Problem, base, per_token: dict, args) -> dict[str, Callable]:
    """provider -> a call returning its loss (not yet backpropagated)."""
    import torch.nn.functional as F

    from lp_kernels import linear_logprob_loss
    from lp_kernels.backends.triton.config import use_config

    loss_fn = policy_loss()

    def lp() -> torch.Tensor:
        out = p.call(base, return_lse=True)
        return loss_fn(out.logprob, None, out.lse, **per_token).sum()

    def materialized() -> torch.Tensor:
        logits = F.linear(p.hidden, p.weight, p.bias).float()
        lse = torch.logsumexp(logits, -1)
        logprob = logits.gather(-1, p.targets[:, None]).squeeze(-1) - lse
        return loss_fn(logprob, None, lse, **per_token).sum()

    def fused(cfg) -> torch.Tensor:
        with use_config(cfg):
            return linear_logprob_loss(
                p.hidden,
                p.weight,
                p.targets,
                loss_fn,
                per_token=per_token,
                bias=p.bias,
                backend="triton",
                validate=False,
            ).loss

    steps = {"lp": lp} | ({} if args.no_materialized else {"materialized": materialized})
    for name, cfg in configs(base, LOSS_VARIANTS, args.variants).items():
        steps[f"lp-loss/{name}"] = lambda cfg=cfg: fused(cfg)
    return steps


def loss_backward(p: Problem, step: Callable) -> torch.Tensor:
    """One step: the loss, backpropagated (the gradients stay on the leaves)."""
    p.zero_grad()
    loss = step()
    loss.backward()
    return loss.detach()


def loss_outputs(p: Problem, step: Callable) -> list[torch.Tensor]:
    """The loss and (copies of) the gradients of one step."""
    return [loss_backward(p, step), *p.grads().values()]


def check_loss(p: Problem, shape: tuple, steps: dict, device: str) -> dict[str, dict]:
    """provider -> its row before timing: peak memory, errors relative to ``lp`` (loss,
    grad_hidden, grad_weight[, grad_bias]), bits equal to ``lp-loss/pinned``'s."""
    rows, outs = {}, {}
    s, n, h, v = shape
    for label, step in steps.items():
        row = {"op": "loss", "shape": s, "N": n, "H": h, "V": v, "provider": label}
        try:
            p.zero_grad()
            row["peak_gib"] = peak_bytes(lambda step=step: loss_backward(p, step), device) / 2**30
            outs[label] = loss_outputs(p, step)
        except Exception as exc:  # report and go on
            row["error"] = repr(exc)[:300]
        rows[label] = row
    ref, pinned = outs.get("lp"), outs.get("lp-loss/pinned")
    for label, got in outs.items():
        if ref is not None:
            pairs = zip(got, ref, strict=True)
            rows[label]["err"] = [rel_err(a.float(), b.float()) for a, b in pairs]
        if pinned is not None and label.startswith("lp-loss/"):
            rows[label]["equal_pinned"] = all(
                torch.equal(a, b) for a, b in zip(got, pinned, strict=True)
            )
    return rows


def fwd_calls(p: Problem, base, args) -> dict[str, Callable]:
    """``fwd/NAME[+ent]`` -> a forward under no_grad with inputs that do not require grad."""
    from lp_kernels import linear_logprob
    from lp_kernels.backends.triton.config import use_config

    names = [n for n in args.fwd_variants.split(",") if n]
    hidden, weight = p.hidden.detach(), p.weight.detach()
    bias = None if p.bias is None else p.bias.detach()

    def fwd(cfg, entropy: bool) -> torch.Tensor:
        with torch.no_grad(), use_config(cfg):
            return linear_logprob(
                hidden,
                weight,
                p.targets,
                bias=bias,
                backend="triton",
                validate=False,
                return_entropy=entropy,
            ).logprob

    calls = {}
    for name, cfg in configs(base, LOSS_VARIANTS, names).items():
        for ent in (False, True):
            calls[f"fwd/{name}" + ("+ent" if ent else "")] = lambda c=cfg, e=ent: fwd(c, e)
    return calls


def run_loss(p: Problem, shape: tuple, base, args, device: str) -> list[dict]:
    """The rows of one shape: every provider's loss step, then the forwards."""
    with torch.no_grad():
        logprob = p.call(base).logprob
    steps = loss_steps(p, base, loss_per_token(logprob), args)
    rows = check_loss(p, shape, steps, device)
    profiles = profile_loss(p, shape[0], steps) if args.profile and device == "cuda" else []
    if not args.no_time:
        fwds = fwd_calls(p, base, args)
        rows |= {label: {"op": "loss", "shape": shape[0], "provider": label} for label in fwds}
        calls = {k: {"ms": lambda f=f: loss_backward(p, f)} for k, f in steps.items()}
        calls |= {k: {"ms": f} for k, f in fwds.items()}
        time_loss(p, rows, calls, args, device)
    for row in [*profiles, *rows.values()]:
        print(json.dumps(row), flush=True)
    return [*profiles, *rows.values()]


def time_loss(p: Problem, rows: dict, calls: dict, args, device: str) -> None:
    """Time ``calls`` (those whose row has no error) with the floors; into their rows."""
    calls = {"floor": floors(p)} | {k: c for k, c in calls.items() if "error" not in rows[k]}
    times, errors = time_calls(calls, args, device)
    floor = {part: median(ms) for part, ms in times.pop("floor").items()}
    for label, row in rows.items():
        if label in errors:
            row["error"] = errors[label]
        elif label in times:
            which = "fwd" if label.startswith("fwd/") else "step"
            ms = median(times[label]["ms"])
            row.update(ms=ms, floor_ms=floor[which], x_floor=ms / floor[which])
            row["floor_matmuls"] = 1 if which == "fwd" else 4


def profile_loss(p: Problem, shape: str, steps: dict) -> list[dict]:
    """One profiled step of ``lp-loss/pinned`` and of ``lp`` (GPU): wall ms, GPU busy ms
    and busy ms of the 10 largest kernels."""
    from torch.profiler import ProfilerActivity, profile

    rows = []
    for label in ("lp-loss/pinned", "lp"):
        if label not in steps:
            continue
        loss_backward(p, steps[label])
        torch.cuda.synchronize()
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            start.record()
            loss_backward(p, steps[label])
            end.record()
            torch.cuda.synchronize()
        kernels: dict[str, float] = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                kernels[e.name[:90]] = kernels.get(e.name[:90], 0.0) + e.device_time / 1e3
        top = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:10])
        rows.append(
            {
                "op": "loss",
                "shape": shape,
                "provider": f"profile/{label}",
                "wall_ms": start.elapsed_time(end),
                "busy_ms": sum(kernels.values()),
                "kernels_ms": top,
            }
        )
    return rows


def report_loss(rows: list[dict]) -> None:
    head = f"{'shape':12} {'provider':22} {'x floor':>8} {'ms':>9} {'GiB':>6}"
    print(f"\n{head}  err (loss, gh, gw[, gb]) vs lp")
    for r in rows:
        head = f"{r['shape']:12} {r['provider']:22}"
        if "busy_ms" in r:
            top = "; ".join(f"{k[:40]} {v:.2f}" for k, v in r["kernels_ms"].items())
            print(f"{head} wall {r['wall_ms']:.2f} ms, busy {r['busy_ms']:.2f} ms: {top}")
        elif "error" in r:
            print(f"{head} error {r['error'][:80]}")
        else:
            x = f"{r['x_floor']:8.3f} {r['ms']:9.2f}" if "ms" in r else f"{'-':>8} {'-':>9}"
            gib = f"{r['peak_gib']:6.2f}" if "peak_gib" in r else f"{'':6}"
            err = ", ".join(f"{e:.1e}" for e in r.get("err", []))
            same = {True: "  bits = pinned", False: "  bits != pinned"}.get(r.get("equal_pinned"))
            print(f"{head} {x} {gib}  {err}{same or ''}")


# ============================================================================ command line


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--shapes",
        help="S1-S6 or NxHxV, comma-separated (default: per op on a GPU; 33x64x517 on CPU)",
    )
    common.add_argument("--variants", help="names, comma-separated (default: all; --list)")
    common.add_argument("--list", action="store_true", help="print the variants and exit")
    common.add_argument("--bias", action="store_true", help="with an LM-head bias (and grad)")
    common.add_argument("--rounds", type=int, default=1, help="paired rounds (median)")
    common.add_argument("--reps", type=int, default=5, help="timed calls per round (median)")
    common.add_argument("--warm-s", type=float, default=1.0, help="warm-up seconds per call")
    common.add_argument("--no-time", action="store_true", help="checks only, no timing")
    common.add_argument("--out", help="JSON record (rewritten after every shape)")
    sub = ap.add_subparsers(dest="op", required=True)
    pt = sub.add_parser("tiles", parents=[common], help="linear_logprob's blocks")
    pt.add_argument("--bits", action="store_true", help="order-only variants vs pinned, bitwise")
    pt.add_argument("--det", action="store_true", help="also time deterministic=True")
    pt.add_argument("--det-only", action="store_true", help="time deterministic=True only")
    pt.add_argument(
        "--det-tile",
        default="128",
        help="deterministic tiles, comma-separated (each timed; --bits takes the first): "
        "an int, or tpN (tp8: the widest tile for TP degrees up to 8, linear_logprob's default)",
    )
    pl = sub.add_parser("loss", parents=[common], help="linear_logprob_loss's chunks, blocks")
    pl.add_argument("--no-materialized", action="store_true", help="skip the logits path")
    pl.add_argument(
        "--fwd-variants",
        default="pinned,vs4k",
        help="forward-only rows of these variants ('' for none)",
    )
    pl.add_argument("--profile", action="store_true", help="GPU busy time by kernel")
    args = ap.parse_args(argv)
    table = OPS[args.op][0]
    args.variants = args.variants.split(",") if args.variants else list(table)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":  # before lp_kernels is imported: the triton backend on CPU
        os.environ["TRITON_INTERPRET"] = "1"
    from lp_kernels.backends.triton.config import config_for

    base = config_for(torch.device(device), torch.bfloat16)
    if args.list:
        print_table(args.op, base, device)
        return 0
    default = {"tiles": "S1,S4", "loss": "S1,S2,S3,S4,S5,S6"}[args.op]
    shapes = parse_shapes(args.shapes or (default if device == "cuda" else "33x64x517"))
    record = {"env": environment(device), "args": vars(args), "rows": []}
    run = run_tiles if args.op == "tiles" else run_loss
    for shape in shapes:
        p = Problem.make(*shape[1:], device=device, bias=args.bias)
        record["rows"] += run(p, shape, base, args, device)
        del p
        if device == "cuda":
            torch.cuda.empty_cache()
        if args.out:  # after every shape: a cut-off run keeps what it measured
            Path(args.out).write_text(json.dumps(record, indent=1))
    (report_tiles if args.op == "tiles" else report_loss)(record["rows"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
