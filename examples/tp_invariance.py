"""Tensor-parallel invariance with lp-kernels alone: the same log-probs and gradients, bit
for bit, whether the LM head is split over 1, 2 or 4 ranks.

For each TP degree the script starts that many gloo processes on CPU. Each holds one
shard of the head on Megatron's layout: the vocabulary padded to a multiple of 128 x TP
(so the padding, and with it every shard bound, changes with the degree) and cut in even
shards. Every rank computes lp's log-probs, entropy and both gradients for the same
hidden states and tokens, once with ``deterministic=False`` and once with
``deterministic=True``. The table compares each degree with TP 1: the default mode agrees
to rounding; ``deterministic=True`` is bitwise equal (``torch.equal``), which is what lets
an RL trainer compare log-probs across parallel layouts without noise in the ratio.

    python examples/tp_invariance.py                  # TP 1, 2, 4; GPT-2's 50257 ids
    python examples/tp_invariance.py --tp 1,2,3,8 --vocab 32000
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lp_kernels import linear_logprob

NAMES = ("logprob", "entropy", "grad_hidden", "grad_weight")


def megatron_shards(vocab: int, tp: int) -> list[tuple[int, int]]:
    """``(start, size)`` of each rank's rows: Megatron pads the vocabulary to a multiple of
    ``128 * tp`` and splits it evenly."""
    size = -(-vocab // (128 * tp)) * 128
    return [(r * size, size) for r in range(tp)]


def problem(args: argparse.Namespace, seed: int = 0):
    """Hidden states, the whole head (with the most padding any degree needs), targets and
    an upstream gradient."""
    degrees = [int(t) for t in args.tp.split(",")]
    rows = max(sum(size for _, size in megatron_shards(args.vocab, tp)) for tp in degrees)
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(args.tokens, args.hidden, generator=g)
    w = torch.randn(rows, args.hidden, generator=g) * 0.5
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    upstream = torch.randn(args.tokens, generator=g)
    return h, w, targets, upstream


def rank_main(rank: int, tp: int, args: argparse.Namespace, store: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=tp)
    try:
        h, w, targets, upstream = problem(args)
        start, size = megatron_shards(args.vocab, tp)[rank]
        results = {}
        for deterministic in (False, True):
            hidden = h.clone().requires_grad_()
            shard = w[start : start + size].clone().requires_grad_()
            out = linear_logprob(
                hidden, shard, targets, tp_group=dist.group.WORLD, vocab_start=start,
                vocab_size=args.vocab, return_entropy=True, deterministic=deterministic,
            )  # fmt: skip
            # a policy-gradient-like loss with an entropy bonus
            (-(upstream * out.logprob) - 0.01 * out.entropy).sum().backward()
            real = max(0, min(size, args.vocab - start))  # this shard's real rows
            outs = (out.logprob, out.entropy, hidden.grad, shard.grad[:real])
            results[deterministic] = tuple(x.detach().clone() for x in outs)
        torch.save(results, Path(out_dir) / f"tp{tp}-rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_degree(tp: int, args: argparse.Namespace, tmp: str) -> dict:
    """Run ``tp`` ranks; return ``{deterministic: (logprob, entropy, grad_hidden,
    grad_weight of the real vocabulary)}`` as rank 0 saw it (grad_weight: every shard)."""
    store = str(Path(tmp) / f"store-tp{tp}")
    mp.start_processes(
        rank_main, args=(tp, args, store, tmp), nprocs=tp, join=True, start_method="spawn"
    )
    ranks = [torch.load(Path(tmp) / f"tp{tp}-rank{r}.pt") for r in range(tp)]
    for r in ranks[1:]:  # every rank returns the same outputs
        for mode in (False, True):
            pairs = zip(r[mode][:3], ranks[0][mode][:3], strict=True)
            if not all(torch.equal(a, b) for a, b in pairs):
                raise RuntimeError(f"TP {tp}: ranks returned different outputs")
    return {
        mode: (*ranks[0][mode][:3], torch.cat([r[mode][3] for r in ranks]))
        for mode in (False, True)
    }


def compare(a: torch.Tensor, b: torch.Tensor) -> str:
    if torch.equal(a, b):
        return "bitwise"
    return f"{float((a - b).abs().max()):.1e}"


def main(argv: list[str] | None = None) -> list[tuple[int, str, list[str]]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", default="1,2,4", help="TP degrees; the first is the reference")
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=96)
    args = ap.parse_args(argv)
    degrees = [int(t) for t in args.tp.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        results = {tp: run_degree(tp, args, tmp) for tp in degrees}
    ref = results[degrees[0]]
    print(f"max |difference| against TP {degrees[0]} (vocabulary {args.vocab}, Megatron's shards)")
    print(f"{'TP':>3}  {'mode':<14}" + "".join(f"{n:>13}" for n in NAMES))
    rows = []
    for tp in degrees[1:]:
        for mode in (False, True):
            cells = [compare(a, b) for a, b in zip(results[tp][mode], ref[mode], strict=True)]
            name = "deterministic" if mode else "default"
            rows.append((tp, name, cells))
            print(f"{tp:>3}  {name:<14}" + "".join(f"{c:>13}" for c in cells))
    return rows


if __name__ == "__main__":
    main()
