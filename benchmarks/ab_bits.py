"""A/B bits harness: SHA-256 digests of every output and gradient of lp's public ops.

Runs a fixed list of cases through the public API only (``lp_kernels.linear_logprob``,
``lp_kernels.vocab_parallel_logprob``), so the same script runs against any tree of
lp-kernels, and writes one JSON of digests (the bytes of each tensor). Two such files
compare equal exactly when every case gave the same bits::

    python benchmarks/ab_bits.py --device cpu --out a.json      # triton: interpreter
    python benchmarks/ab_bits.py --compare a.json b.json        # exit 1, names what differs

Cases: both backends, fp32 and bf16, the default mode and ``deterministic=True`` (the
default tile and ``deterministic_tile=128``), with and without entropy and lse,
temperature != 1, ignored rows, a padded vocabulary (``vocab_size`` < rows), several token
and vocabulary chunks, the small-N path (a group of vocabulary chunks per launch),
``vocab_parallel_logprob`` in both modes, and 2-rank gloo tensor-parallel runs (uneven and
Megatron-style even shards, both modes; rank 0's outputs and every rank's grad shard). On
CUDA the same cases also run at larger shapes; tensor parallel there only with two GPUs
(NCCL).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", help="write the digests to this JSON file")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two JSON files")
    parser.add_argument("--no-tp", action="store_true", help="skip the tensor-parallel cases")
    parser.add_argument("-k", dest="select", help="run only cases whose name contains this")
    return parser.parse_args(argv)


def compare(path_a: str, path_b: str) -> int:
    """0 if both files hold the same cases with the same digests, else 1 (printed)."""
    with open(path_a) as f:
        a = json.load(f)["cases"]
    with open(path_b) as f:
        b = json.load(f)["cases"]
    differ = sorted(k for k in a.keys() & b.keys() if a[k] != b[k])
    only_a, only_b = sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())
    for name in differ:
        keys = a[name].keys() | b[name].keys()
        fields = sorted(f for f in keys if a[name].get(f) != b[name].get(f))
        print(f"DIFFERS {name}: {', '.join(fields)}")
    for name in only_a:
        print(f"ONLY IN {path_a}: {name}")
    for name in only_b:
        print(f"ONLY IN {path_b}: {name}")
    same = len(a.keys() & b.keys()) - len(differ)
    print(f"{same} cases identical, {len(differ)} differ, {len(only_a) + len(only_b)} unmatched")
    return 1 if differ or only_a or only_b else 0


# ----------------------------------------------------------------------------- cases


def _digest(t) -> str | None:
    """SHA-256 of a tensor's bytes (dtype and shape included), or None."""
    if t is None:
        return None
    import torch

    t = t.detach().cpu().contiguous()
    head = f"{t.dtype}:{tuple(t.shape)}:".encode()
    return hashlib.sha256(head + t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _inputs(
    n: int, h: int, v: int, dtype, device, seed: int, ignored: bool, vocab_size=None,
    ignore_index: int = -100,
):  # fmt: skip
    import torch

    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype)
    targets = torch.randint(0, vocab_size or v, (n,), generator=g)
    if ignored:
        targets[::7] = ignore_index
    upstream = torch.randn(3, n, generator=g)
    return hidden.to(device), weight.to(device), targets.to(device), upstream.to(device)


def _loss(out, upstream):
    if upstream is None:  # out.sum(): expanded (stride 0) upstream gradients
        return sum(x.sum() for x in (out.logprob, out.entropy, out.lse) if x is not None)
    loss = (out.logprob * upstream[0]).sum()
    if out.entropy is not None:
        loss = loss + (out.entropy * upstream[1]).sum()
    if out.lse is not None:
        loss = loss + (out.lse * upstream[2]).sum()
    return loss


def _digests(out, **grads) -> dict:
    """Digests of the op's three outputs, then of each gradient given (by its key)."""
    outputs = {"logprob": out.logprob, "entropy": out.entropy, "lse": out.lse}
    return {name: _digest(t) for name, t in {**outputs, **grads}.items()}


def _run_linear(spec: dict, device: str, tp=None) -> dict:
    """One linear_logprob case: digests of its outputs and of both gradients."""
    import torch

    from lp_kernels import linear_logprob

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[spec["dtype"]]
    n, h, v = spec["shape"]
    kwargs = dict(spec.get("options", {}))
    hidden, weight, targets, upstream = _inputs(
        n, h, v, dtype, device, spec.get("seed", 0), spec.get("ignored", False),
        spec.get("vocab_size"), kwargs.get("ignore_index", -100),
    )  # fmt: skip
    if spec.get("int32"):
        targets = targets.int()
    if spec.get("sum"):
        upstream = None
    bias = None
    if spec.get("bias"):
        g = torch.Generator().manual_seed(1)
        bias = torch.randn(v, generator=g).to(device=device, dtype=dtype).requires_grad_(True)
        kwargs["bias"] = bias
    if tp is not None:  # (group, start, size): this rank's shard of the full weight
        group, start, size = tp
        weight = weight[start : start + size]
        kwargs.update(tp_group=group, vocab_start=start)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    out = linear_logprob(
        hidden, weight, targets, backend=spec["backend"], vocab_size=spec.get("vocab_size"),
        **kwargs,
    )  # fmt: skip
    _loss(out, upstream).backward()
    grads = {"grad_hidden": hidden.grad, "grad_weight": weight.grad}
    if bias is not None:
        grads["grad_bias"] = bias.grad
    return _digests(out, **grads)


def _run_loss(spec: dict, device: str) -> dict:
    """One linear_logprob_loss case (a DAPO loss with a KL penalty and an entropy bonus):
    digests of its per-token outputs, the loss and the three gradients."""
    import torch

    from lp_kernels import linear_logprob_loss, losses

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[spec["dtype"]]
    n, h, v = spec["shape"]
    kwargs = dict(spec.get("options", {}))
    hidden, weight, targets, upstream = _inputs(
        n, h, v, dtype, device, 0, True, None, kwargs.get("ignore_index", -100)
    )
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(v, generator=g).to(device=device, dtype=dtype).requires_grad_(True)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    old = (-upstream[0].abs() * 3).detach()
    per_token = {"old_logprob": old, "ref_logprob": old - 0.1, "advantages": upstream[1]}
    out = linear_logprob_loss(
        hidden, weight, targets, losses.dapo(kl_coef=0.04, entropy_coef=1e-3),
        per_token=per_token, bias=bias, backend=spec["backend"], **kwargs,
    )  # fmt: skip
    out.loss.backward()
    return {
        **_digests(out, grad_hidden=hidden.grad, grad_weight=weight.grad, grad_bias=bias.grad),
        "loss": _digest(out.loss),
        "token_loss": _digest(out.token_loss),
    }


def _run_vocab_parallel(spec: dict, device: str) -> dict:
    import torch

    from lp_kernels import vocab_parallel_logprob

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[spec["dtype"]]
    n, h, v = spec["shape"]
    hidden, weight, targets, upstream = _inputs(
        n, h, v, torch.float32, device, spec.get("seed", 0), spec.get("ignored", False),
        spec.get("vocab_size"),
    )  # fmt: skip
    logits = (hidden @ weight.T).to(dtype).requires_grad_(True)
    out = vocab_parallel_logprob(
        logits, targets, vocab_size=spec.get("vocab_size"), **spec.get("options", {})
    )
    _loss(out, upstream).backward()
    return _digests(out, grad_logits=logits.grad)


def _tp_rank(rank: int, world: int, spec: dict, device: str) -> dict:
    """One rank of a tensor-parallel case (run by lp_testing.run_ranks)."""
    import torch.distributed as dist

    bounds = spec["bounds"]  # shard starts, then the end
    dev = f"cuda:{rank}" if device == "cuda" else "cpu"
    start, end = bounds[rank], bounds[rank + 1]
    got = _run_linear(spec, dev, tp=(dist.group.WORLD, start, end - start))
    if rank != 0:  # every rank's grad shard; the outputs (identical on every rank) of rank 0
        got = {"grad_weight": got["grad_weight"], "grad_hidden": got["grad_hidden"]}
    return {f"rank{rank}.{k}" if k.startswith("grad") else k: d for k, d in got.items()}


def cases(device: str, with_tp: bool) -> list[tuple[str, str, dict]]:
    """``(name, kind, spec)`` for every case on ``device``."""
    shapes = {"cpu": [("", (300, 64, 5000), 40)]}
    # CUDA: the CPU shapes, then the larger ones (N 640: the narrow tile and chunk groups)
    shapes["cuda"] = shapes["cpu"] + [("big.", (4096, 2048, 32000), 640)]
    out = []
    for prefix, (n, h, v), small_n in shapes[device]:
        vocab = v - 100  # padded vocabulary: the last 100 rows are padding
        for backend in ("torch", "triton"):
            for dtype in ("fp32", "bf16"):
                base = {"backend": backend, "dtype": dtype, "shape": (n, h, v)}
                tag = f"{prefix}{backend}.{dtype}"
                rich = {"return_entropy": True, "return_lse": True, "temperature": 0.7}
                out.append((f"{tag}.plain", "linear", dict(base)))
                out.append(
                    (
                        f"{tag}.rich",
                        "linear",
                        dict(base, ignored=True, vocab_size=vocab, options=rich),
                    )
                )
                out.append(
                    (
                        f"{tag}.smalln",
                        "linear",
                        dict(base, shape=(small_n, h, v), ignored=True, options=rich),
                    )
                )
                for tile_name, tile in (("dtile", None), ("t128", 128)):
                    det = dict(rich, deterministic=True, deterministic_tile=tile)
                    out.append(
                        (
                            f"{tag}.det.{tile_name}",
                            "linear",
                            dict(base, ignored=True, vocab_size=vocab, options=det),
                        )
                    )
                out.append(
                    (
                        f"{tag}.det.plain",
                        "linear",
                        dict(base, options={"deterministic": True}),
                    )
                )
        for backend in ("torch", "triton"):
            # the model-coverage options, an ignore_index that is a real id, int32 targets,
            # expanded upstream gradients, and the loss op
            cover = {"softcap": 30.0, "ignore_index": 42, "return_entropy": True}
            base = {"backend": backend, "dtype": "bf16", "shape": (n, h, v)}
            tag = f"{prefix}{backend}.bf16"
            spec = dict(base, ignored=True, bias=True, int32=True, options=cover)
            out.append((f"{tag}.cover", "linear", spec))
            out.append((f"{tag}.cover.sum", "linear", dict(spec, sum=True)))
            det = dict(cover, deterministic=True)
            out.append((f"{tag}.cover.det", "linear", dict(spec, options=det)))
            sn = dict(spec, shape=(small_n, h, v), sum=True)
            out.append((f"{tag}.cover.smalln", "linear", sn))
            loss_opts = {"softcap": 30.0, "ignore_index": 42, "temperature": 0.7}
            out.append((f"{tag}.loss", "loss", dict(base, options=loss_opts)))
        for dtype in ("fp32", "bf16"):
            base = {"dtype": dtype, "shape": (n, h, v), "ignored": True, "vocab_size": vocab}
            rich = {"return_entropy": True, "return_lse": True, "temperature": 0.7}
            tag = f"{prefix}vocab_parallel.{dtype}"
            out.append((f"{tag}.plain", "vocab_parallel", dict(base, ignored=False)))
            out.append((f"{tag}.rich", "vocab_parallel", dict(base, options=rich)))
            det = dict(rich, deterministic=True)
            out.append((f"{tag}.det", "vocab_parallel", dict(base, options=det)))
    if with_tp:
        n, h, v = 200, 64, 3000
        layouts = {
            "uneven": [0, 1280, 3000],  # shard bounds on multiples of 128 (deterministic)
            "megatron": [0, 1536, 3072],  # even shards of a head padded to 3072 rows
        }
        for backend in ("torch", "triton"):
            for layout, bounds in layouts.items():
                v_rows = bounds[-1]
                for mode, opts in (
                    ("default", {}),
                    ("det", {"deterministic": True}),
                    ("det128", {"deterministic": True, "deterministic_tile": 128}),
                ):
                    if mode == "det128" and (backend, layout) != ("triton", "uneven"):
                        continue
                    rich = {"return_entropy": True, "return_lse": True, "temperature": 0.7}
                    spec = {
                        "backend": backend,
                        "dtype": "bf16" if backend == "triton" else "fp32",
                        "shape": (n, h, v_rows),
                        "vocab_size": 2900,
                        "ignored": True,
                        "bounds": bounds,
                        "options": dict(rich, **opts),
                    }
                    out.append((f"tp2.{backend}.{layout}.{mode}", "tp", spec))
    return out


def run(device: str, with_tp: bool, select: str | None) -> dict:
    import torch

    results = {}
    for name, kind, spec in cases(device, with_tp):
        if select and select not in name:
            continue
        t0 = time.perf_counter()
        if kind == "linear":
            results[name] = _run_linear(spec, device)
        elif kind == "vocab_parallel":
            results[name] = _run_vocab_parallel(spec, device)
        elif kind == "loss":
            results[name] = _run_loss(spec, device)
        else:
            from lp_testing import run_ranks

            backend = "nccl" if device == "cuda" else "gloo"
            ranks = run_ranks(_tp_rank, 2, spec, device, backend=backend, timeout=600)
            results[name] = {k: d for got in ranks for k, d in got.items()}
        print(f"{name:40s} {time.perf_counter() - t0:6.1f} s", file=sys.stderr)
    meta = {"device": device, "torch": torch.__version__}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    if device == "cuda":
        meta["gpu"] = torch.cuda.get_device_name()
    return {"meta": meta, "cases": results}


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.compare:
        return compare(*args.compare)
    if args.device == "cpu":  # before lp_kernels is imported: the triton backend on CPU
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    torch.manual_seed(0)
    with_tp = not args.no_tp
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        with_tp = False  # NCCL needs a GPU per rank
    result = run(args.device, with_tp, args.select)
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
