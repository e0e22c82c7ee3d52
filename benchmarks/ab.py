"""The A/B tool: is a kernel change bitwise neutral, and what does it cost?

``bits`` runs a fixed list of cases (both backends and modes, fp32 and bf16, the logit
option sets, the loss op, ``vocab_parallel_logprob``, tensor parallel over 2 and 4 ranks)
through lp's public ops and writes the SHA-256 of every output and gradient; ``compare``
says whether two such files hold the same bits. ``bits`` runs against whatever
``lp_kernels`` is importable: run an older tree by putting its ``packages/lp-kernels/src``
first on PYTHONPATH. ``--device cpu`` runs the triton backend under the interpreter (the
tool sets TRITON_INTERPRET itself) and torch on one thread (a CPU GEMM's bits follow the
thread count)::

    python benchmarks/ab.py bits [--device cpu|cuda] [--out F] [-k SUBSTR] [--no-tp]
    PYTHONPATH=_old/packages/lp-kernels/src python benchmarks/ab.py bits --out old.json
    python benchmarks/ab.py compare old.json new.json [--only-common]

``prepare`` copies a revision's ``lp_kernels`` (``git archive``) to ``_ab_trees`` renamed
``lp_kernels_NAME`` (git-ignored; a device call carries it); ``time`` imports those trees
and this checkout's (``new``, last) into one process and, per mode, shape and option set,
first checks every tree's outputs and gradients against the first tree's (``torch.equal``),
then times them in paired rounds (``lp_bench.timing.paired_rounds``) and prints the median
over rounds of each tree's time over the first tree's, and each set's cost over plain::

    python benchmarks/ab.py prepare REV NAME [--dir _ab_trees]
    python benchmarks/ab.py time --trees NAME[:set+set][,NAME2...] [--modes train,fwd,loss]
        [--shapes S1,S2,S3,S4] [--sets plain,bias,cap,both,ent,both_ent] [--rounds 6]
        [--reps 5] [--device cuda|cpu] [--backend triton] [--out F.json]

Modes: ``train`` (``linear_logprob`` forward + backward of a per-token upstream gradient),
``fwd`` (forward under no_grad), ``loss`` (``linear_logprob_loss``, the DAPO + k3 KL loss
of ``lp bench --mode loss``). Sets: ``plain``, ``bias`` (``lp_bench.protocol.make_bias``),
``cap`` (softcap 30), ``both``; ``ent`` and ``both_ent`` add entropy (its upstream gradient,
or the loss's entropy bonus). ``--trees base,mid:bias``: ``mid`` runs only ``bias``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import io
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from types import ModuleType

# ============================================================================ bits


def compare(path_a: str, path_b: str, only_common: bool = False) -> int:
    """0 if both files hold the same cases with the same digests, else 1 (printed).
    ``only_common``: cases in one file only are listed but do not count (at least one
    case must be in both)."""
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
    if not only_common:
        for name in only_a:
            print(f"ONLY IN {path_a}: {name}")
        for name in only_b:
            print(f"ONLY IN {path_b}: {name}")
    same = len(a.keys() & b.keys()) - len(differ)
    print(f"{same} cases identical, {len(differ)} differ, {len(only_a) + len(only_b)} unmatched")
    if only_common:
        return 1 if differ or not same else 0
    return 1 if differ or only_a or only_b else 0


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
        bias = torch.randn(v, generator=g).to(device=device, dtype=dtype)
        if tp is not None:
            bias = bias[tp[1] : tp[1] + tp[2]]
        bias.requires_grad_(True)
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


def _run_loss(spec: dict, device: str, tp=None) -> dict:
    """One linear_logprob_loss case (a DAPO loss with a KL penalty, and an entropy bonus
    unless ``spec["no_entropy"]``): digests of its per-token outputs, the loss and the
    gradients (the bias' unless ``spec["bias"]`` is False)."""
    import torch

    from lp_kernels import linear_logprob_loss, losses

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[spec["dtype"]]
    n, h, v = spec["shape"]
    kwargs = dict(spec.get("options", {}))
    hidden, weight, targets, upstream = _inputs(
        n, h, v, dtype, device, 0, True, spec.get("vocab_size"), kwargs.get("ignore_index", -100)
    )
    bias = None
    if spec.get("bias", True):
        g = torch.Generator().manual_seed(1)
        bias = torch.randn(v, generator=g).to(device=device, dtype=dtype)
        if tp is not None:
            bias = bias[tp[1] : tp[1] + tp[2]]
        kwargs["bias"] = bias.requires_grad_(True)
    if tp is not None:  # (group, start, size): this rank's shard of the full weight
        group, start, size = tp
        weight = weight[start : start + size]
        kwargs.update(tp_group=group, vocab_start=start)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    old = (-upstream[0].abs() * 3).detach()
    per_token = {"old_logprob": old, "ref_logprob": old - 0.1, "advantages": upstream[1]}
    entropy_coef = 0.0 if spec.get("no_entropy") else 1e-3
    out = linear_logprob_loss(
        hidden, weight, targets, losses.dapo(kl_coef=0.04, entropy_coef=entropy_coef),
        per_token=per_token, backend=spec["backend"], vocab_size=spec.get("vocab_size"),
        **kwargs,
    )  # fmt: skip
    out.loss.backward()
    grads = {"grad_hidden": hidden.grad, "grad_weight": weight.grad}
    if bias is not None:
        grads["grad_bias"] = bias.grad
    return {
        **_digests(out, **grads),
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
    run = _run_loss if spec.get("loss") else _run_linear
    got = run(spec, dev, tp=(dist.group.WORLD, start, end - start))
    if rank != 0:  # every rank's grad shard; the outputs (identical on every rank) of rank 0
        got = {k: d for k, d in got.items() if k.startswith("grad")}
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
        out += _option_set_cases(prefix, (n, h, v), vocab)
    if device == "cuda":  # a step's shapes: several token chunks, and a small N
        for prefix, (n, h, v) in (("s4.", (16400, 2048, 62080)), ("s6.", (1100, 2048, 100000))):
            out += _option_set_cases(prefix, (n, h, v), v - 80, backends=("triton",))
    if with_tp:
        out += _tp_option_set_cases()
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


OPTION_SETS = {  # name -> (bias, spec options)
    "plain": (False, {}),
    "bias": (True, {}),
    "cap": (False, {"softcap": 30.0}),
    "both": (True, {"softcap": 30.0, "temperature": 0.7}),
}


def _option_set_cases(prefix: str, shape, vocab: int, backends=("torch", "triton")) -> list:
    """Every logit option set (plain, bias, cap, both) of ``linear_logprob`` in both modes,
    with and without entropy, and of ``linear_logprob_loss`` with and without entropy (and
    its deterministic, composed path), bf16, ignored rows and a padded vocabulary."""
    out = []
    for backend in backends:
        for name, (bias, opts) in OPTION_SETS.items():
            base = {"backend": backend, "dtype": "bf16", "shape": shape, "ignored": True}
            base.update(vocab_size=vocab, bias=bias)
            tag = f"{prefix}{backend}.sets.{name}"
            for ent in (False, True):
                rich = dict(opts, return_entropy=ent, return_lse=ent)
                for mode, det in (("default", {}), ("det", {"deterministic": True})):
                    spec = dict(base, options=dict(rich, **det))
                    out.append((f"{tag}.{mode}.ent{int(ent)}", "linear", spec))
                loss = dict(base, no_entropy=not ent, options=opts)
                out.append((f"{tag}.loss.ent{int(ent)}", "loss", loss))
            det_loss = dict(base, options=dict(opts, deterministic=True))
            out.append((f"{tag}.loss.det", "loss", det_loss))
    return out


def _tp_option_set_cases() -> list:
    """Tensor-parallel runs over 2 and 4 ranks: the plain and the richest option set, both
    modes, uneven and Megatron-style even shards, ``linear_logprob`` and the loss."""
    n, h = 200, 64
    layouts = {
        2: {"uneven": [0, 1280, 3000], "megatron": [0, 1536, 3072]},
        4: {"uneven": [0, 640, 1280, 2304, 3000], "megatron": [0, 768, 1536, 2304, 3072]},
    }
    out = []
    for world, shapes in layouts.items():
        for backend in ("torch", "triton"):
            for layout, bounds in shapes.items():
                for name in ("plain", "both"):
                    bias, opts = OPTION_SETS[name]
                    spec = {
                        "backend": backend, "dtype": "bf16", "shape": (n, h, bounds[-1]),
                        "vocab_size": 2900, "ignored": True, "bounds": bounds, "bias": bias,
                        "world": world,
                    }  # fmt: skip
                    rich = dict(opts, return_entropy=True, return_lse=True)
                    for mode, det in (("default", {}), ("det", {"deterministic": True})):
                        case = dict(spec, options=dict(rich, **det))
                        out.append((f"tp{world}.{backend}.{layout}.{name}.{mode}", "tp", case))
                    if layout == "uneven":
                        loss = dict(spec, loss=True, options=opts)
                        out.append((f"tp{world}.{backend}.{layout}.{name}.loss", "tp", loss))
    return out


def run_bits(device: str, with_tp: bool, select: str | None) -> dict:
    """Digests of every case on ``device`` whose name contains ``select``: a JSON record."""
    import torch

    results = {}
    gpus = torch.cuda.device_count() if device == "cuda" else 0
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
            world = spec.get("world", 2)
            if device == "cuda" and world > gpus:  # NCCL needs a GPU per rank
                print(f"{name:40s} skipped: {world} ranks, {gpus} GPUs", file=sys.stderr)
                continue
            ranks = run_ranks(_tp_rank, world, spec, device, backend=backend, timeout=600)
            results[name] = {k: d for got in ranks for k, d in got.items()}
        print(f"{name:40s} {time.perf_counter() - t0:6.1f} s", file=sys.stderr)
    import lp_kernels

    meta = {"device": device, "torch": torch.__version__, "lp_kernels": lp_kernels.__file__}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    if device == "cuda":
        meta["gpu"] = torch.cuda.get_device_name()
    return {"meta": meta, "cases": results}


def bits_main(args: argparse.Namespace) -> int:
    if args.device == "cpu":  # before lp_kernels is imported: the triton backend on CPU
        os.environ["TRITON_INTERPRET"] = "1"
        # one thread (the ranks inherit it): a CPU GEMM's bits follow its thread count, which
        # the BLAS may lower under load, so two runs on a busy machine could differ
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    import torch

    if args.device == "cpu":
        torch.set_num_threads(1)

    torch.manual_seed(0)
    with_tp = not args.no_tp
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        with_tp = False  # NCCL needs a GPU per rank
    result = run_bits(args.device, with_tp, args.select)
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


# ============================================================================ trees

PACKAGE = "packages/lp-kernels/src/lp_kernels"
REV_FILE = "AB_REV"  # in a prepared tree: the commit it was made from


def prepare(rev: str, name: str, folder: Path) -> Path:
    """Copy ``rev``'s ``lp_kernels`` to ``folder / lp_kernels_NAME`` with every reference to
    the package renamed (it then imports beside this checkout's); returns the copy."""
    if not name.isidentifier() or name == "new":
        raise ValueError(f"name must be a Python identifier other than 'new', got {name!r}")
    root = Path(__file__).resolve().parents[1]

    def git(*cmd: str) -> bytes:
        return subprocess.run(["git", *cmd], check=True, capture_output=True, cwd=root).stdout

    archive = git("archive", "--format=tar", rev, PACKAGE)
    commit = git("rev-parse", "--short", f"{rev}^{{commit}}").decode().strip()
    dest = folder / f"lp_kernels_{name}"
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    word = re.compile(r"\blp_kernels\b")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            rel = Path(member.name).relative_to(PACKAGE)
            data = tar.extractfile(member).read()
            if rel.suffix == ".py":
                data = word.sub(f"lp_kernels_{name}", data.decode()).encode()
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).write_bytes(data)
    (dest / REV_FILE).write_text(commit + "\n")
    return dest


@dataclasses.dataclass
class Tree:
    """One imported lp_kernels: its name, its package and the sets it runs (None: all)."""

    name: str
    mod: ModuleType
    sets: list[str] | None = None
    rev: str | None = None
    _losses: dict = dataclasses.field(default_factory=dict, repr=False)

    def runs(self, set_name: str) -> bool:
        return self.sets is None or set_name in self.sets

    def loss_fn(self, entropy: bool):
        """``lp bench --mode loss``'s loss, made by this tree's own ``losses`` module."""
        if entropy not in self._losses:
            from lp_bench.protocol import policy_loss

            losses = importlib.import_module(f"{self.mod.__name__}.losses")
            self._losses[entropy] = policy_loss(entropy, losses=losses)
        return self._losses[entropy]


def parse_trees(spec: str, sets: list[str]) -> list[tuple[str, list[str]]]:
    """``base,mid:bias+cap`` -> [("base", sets), ("mid", ["bias", "cap"])]."""
    out = []
    for item in spec.split(","):
        name, _, only = item.partition(":")
        chosen = only.split("+") if only else list(sets)
        unknown = [s for s in chosen if s not in sets]
        if unknown or not name.isidentifier() or name == "new":
            raise ValueError(f"--trees: bad item {item!r} (sets must be among {sets})")
        out.append((name, chosen))
    if out and out[0][1] != list(sets):
        raise ValueError(f"--trees: the first tree ({out[0][0]}) is the reference: every set")
    return out


def load_trees(spec: list[tuple[str, list[str]]], folder: Path, with_new: bool = True) -> list:
    """The prepared trees of ``spec`` (:class:`Tree`), then, with ``with_new``, this
    checkout's ``lp_kernels`` as ``new`` (every set)."""
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    trees = []
    for name, sets in spec:
        mod = importlib.import_module(f"lp_kernels_{name}")
        rev_file = folder / f"lp_kernels_{name}" / REV_FILE
        rev = rev_file.read_text().strip() if rev_file.exists() else None
        trees.append(Tree(name, mod, sets, rev))
    if with_new:
        import lp_kernels

        trees.append(Tree("new", lp_kernels))
    return trees


# ============================================================================ time

MODES = ("train", "fwd", "loss")
SETS = {  # name -> (bias, softcap, entropy)
    "plain": (False, False, False),
    "bias": (True, False, False),
    "cap": (False, True, False),
    "both": (True, True, False),
    "ent": (False, False, True),
    "both_ent": (True, True, True),
}
SOFTCAP = 30.0


def make_step_inputs(n: int, h: int, v: int, device: str = "cuda") -> dict:
    """``lp bench``'s inputs of one shape, a bias and an entropy gradient; leaves need grad."""
    import torch

    from lp_bench.protocol import make_bias, make_inputs

    hidden, weight, targets, g_lp = make_inputs(n, h, v, device=device)
    bias = make_bias(v, device=device)
    for x in (hidden, weight, bias):
        x.requires_grad_()
    g_ent = torch.randn(n, generator=torch.Generator().manual_seed(5)).to(g_lp.device) * 0.1
    return dict(hidden=hidden, weight=weight, targets=targets, g_lp=g_lp, g_ent=g_ent, bias=bias)


def step(tree: Tree, inputs: dict, mode: str, set_name: str, backend: str, per_token=None):
    """One ``mode`` step of ``set_name`` through ``tree``: its outputs (and gradients).
    ``per_token``: the loss's per-token inputs (``loss`` mode)."""
    import torch

    has_bias, has_cap, has_ent = SETS[set_name]
    hidden, weight, bias = inputs["hidden"], inputs["weight"], inputs["bias"]
    kw = {"softcap": SOFTCAP if has_cap else None, "backend": backend, "validate": False}
    if mode == "fwd":  # as lp bench: inputs that do not require grad, under no_grad
        if has_bias:
            kw["bias"] = bias.detach()
        with torch.no_grad():
            out = tree.mod.linear_logprob(
                hidden.detach(), weight.detach(), inputs["targets"], return_entropy=has_ent, **kw
            )
        return [out.logprob] + ([out.entropy] if has_ent else [])
    for x in (hidden, weight, bias):
        x.grad = None
    if has_bias:
        kw["bias"] = bias
    if mode == "loss":
        out = tree.mod.linear_logprob_loss(
            hidden, weight, inputs["targets"], tree.loss_fn(has_ent), per_token=per_token,
            return_entropy=has_ent, **kw,
        )  # fmt: skip
        out.loss.backward()
        vals = [out.loss, out.logprob]
    else:
        out = tree.mod.linear_logprob(
            hidden, weight, inputs["targets"], return_entropy=has_ent, **kw
        )
        if has_ent:
            outs, grads = [out.logprob, out.entropy], [inputs["g_lp"], inputs["g_ent"]]
        else:
            outs, grads = [out.logprob], [inputs["g_lp"]]
        torch.autograd.backward(outs, grads)
        vals = [out.logprob]
    vals += [out.entropy] if has_ent else []
    return vals + [hidden.grad, weight.grad] + ([bias.grad] if has_bias else [])


def loss_inputs(tree: Tree, inputs: dict, set_name: str, backend: str) -> dict:
    """``lp bench``'s per-token loss inputs, from ``tree``'s log-probs of ``set_name``."""
    from lp_bench.protocol import loss_per_token

    return loss_per_token(step(tree, inputs, "fwd", set_name, backend)[0])


def check_bits(trees: list, inputs: dict, mode: str, sets: list[str], backend: str) -> tuple:
    """``({set: {tree: equal}}, {set: per_token})``: each tree's outputs and gradients
    against the first tree's (``torch.equal``); the loss inputs of each set (``loss``)."""
    import torch

    ref, result, per_token = trees[0], {}, {}
    for s in sets:
        if mode == "loss":
            per_token[s] = loss_inputs(ref, inputs, s, backend)
        want = [t.detach().clone() for t in step(ref, inputs, mode, s, backend, per_token.get(s))]
        result[s] = {}
        for tree in trees[1:]:
            if tree.runs(s):
                got = step(tree, inputs, mode, s, backend, per_token.get(s))
                same = all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
                result[s][tree.name] = same
    return result, per_token


def summarize(runs: dict, names: list[str]) -> dict:
    """``set/tree`` -> its median ms, the median over rounds of its time over the first
    tree's (``vs_FIRST``), and of its time over its own plain step's (``over_plain``; this
    checkout's plain step, else the first tree's, for a tree that skips plain)."""
    ref = names[0]
    fallback = "new" if "new" in names else ref
    rows = {}
    for (s, name), times in runs.items():
        base = runs[(s, ref)]
        plain = runs.get(("plain", name)) or runs.get(("plain", fallback))
        rows[f"{s}/{name}"] = {
            "median_ms": statistics.median(times),
            "vs_" + ref: statistics.median(t / b - 1 for t, b in zip(times, base, strict=True)),
            "over_plain": None if s == "plain" or plain is None
            else statistics.median(t / p - 1 for t, p in zip(times, plain, strict=True)),
        }  # fmt: skip
    return rows


def gpu_state() -> dict | None:
    """The GPU's SM clock, its maximum, power and temperature now (``nvidia-smi``), or None."""
    fields = "clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader", "--id=0"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return dict(zip(fields.split(","), (x.strip() for x in out.split(",")), strict=False))


def time_mode(trees: list, inputs: dict, name: str, mode: str, sets: list[str], args) -> dict:
    """Bits, then paired rounds of every (set, tree) of one mode on one shape's ``inputs``
    (named ``name``); printed."""
    from lp_bench.timing import paired_rounds

    bits, per_token = check_bits(trees, inputs, mode, sets, args.backend)
    differ = {t: [s for s in bits if bits[s].get(t) is False] for t in [x.name for x in trees]}
    said = "; ".join(f"{t} differs in {', '.join(d)}" for t, d in differ.items() if d)
    print(f"{mode} {name}: bits vs {trees[0].name}: {said or 'all equal'}", flush=True)
    calls = {
        (s, t.name): lambda t=t, s=s: step(t, inputs, mode, s, args.backend, per_token.get(s))
        for s in sets
        for t in trees
        if t.runs(s)
    }
    runs = paired_rounds(calls, args.rounds, args.reps, args.warm_s, device=args.device)
    rows = summarize(runs, [t.name for t in trees])
    for key, row in rows.items():
        ratio = row[f"vs_{trees[0].name}"]
        cost = "" if row["over_plain"] is None else f"  over plain {100 * row['over_plain']:+.2f} %"
        print(f"  {key:18s} {row['median_ms']:9.3f} ms  {100 * ratio:+.2f} %{cost}", flush=True)
    return {"bits": bits, "rounds": {f"{s}/{t}": r for (s, t), r in runs.items()}, "rows": rows}


def time_main(args: argparse.Namespace) -> int:
    sets, modes = args.sets.split(","), args.modes.split(",")
    for s in sets:
        if s not in SETS:
            raise SystemExit(f"--sets: unknown set {s!r} (known: {', '.join(SETS)})")
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"--modes: unknown mode {m!r} (known: {', '.join(MODES)})")
    if args.device == "cpu" and args.backend == "triton":
        os.environ["TRITON_INTERPRET"] = "1"  # before any lp_kernels is imported
    import torch

    from lp_bench.environment import environment
    from lp_bench.protocol import parse_shapes

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("time: no CUDA GPU (--device cpu runs tiny shapes on CPU)")
    trees = load_trees(parse_trees(args.trees, sets), Path(args.dir))
    record = {
        "env": environment(args.device),
        "gpu_state_before": gpu_state() if args.device == "cuda" else None,
        "trees": {t.name: t.rev for t in trees[:-1]} | {"new": "working tree"},
        "args": vars(args),
        "results": {},
    }
    for name, n, h, v in parse_shapes(args.shapes):
        inputs = make_step_inputs(n, h, v, device=args.device)
        for mode in modes:
            got = time_mode(trees, inputs, name, mode, sets, args)
            if args.device == "cuda":
                got["gpu_state_after"] = gpu_state()
                torch.cuda.empty_cache()
            record["results"].setdefault(mode, {})[name] = got
            if args.out:  # after every mode: a cut-off run keeps what it measured
                Path(args.out).write_text(json.dumps(record, indent=1))
        del inputs
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return 0


# ============================================================================ command line


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    pb = sub.add_parser("bits", help="digests of every case's outputs and gradients")
    pb.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    pb.add_argument("--out", help="write the digests to this JSON file (default: stdout)")
    pb.add_argument("--no-tp", action="store_true", help="skip the tensor-parallel cases")
    pb.add_argument("-k", dest="select", help="run only cases whose name contains this")
    pc = sub.add_parser("compare", help="exit 1 where two bits files differ (printed)")
    pc.add_argument("a")
    pc.add_argument("b")
    pc.add_argument(
        "--only-common", action="store_true", help="compare the cases in both files only"
    )
    pp = sub.add_parser("prepare", help="copy REV's lp_kernels as lp_kernels_NAME")
    pp.add_argument("rev")
    pp.add_argument("name")
    pp.add_argument("--dir", default="_ab_trees")
    pt = sub.add_parser("time", help="bits by torch.equal, then paired rounds")
    pt.add_argument("--trees", required=True, help="NAME[:set+set][,NAME2...] (prepared)")
    pt.add_argument("--dir", default="_ab_trees")
    pt.add_argument("--modes", default="train", help=f"among {','.join(MODES)}")
    pt.add_argument("--shapes", default="S1,S2,S3,S4", help="S1-S6 or NxHxV")
    pt.add_argument("--sets", default=",".join(SETS))
    pt.add_argument("--rounds", type=int, default=6)
    pt.add_argument("--reps", type=int, default=5, help="queued steps per round (median)")
    pt.add_argument("--warm-s", type=float, default=0.6, help="warm-up seconds per call")
    pt.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    pt.add_argument("--backend", default="triton")
    pt.add_argument("--out", default=None, help="JSON record")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.cmd == "bits":
        return bits_main(args)
    if args.cmd == "compare":
        return compare(args.a, args.b, args.only_common)
    if args.cmd == "prepare":
        print(prepare(args.rev, args.name, Path(args.dir)))
        return 0
    return time_main(args)


if __name__ == "__main__":
    sys.exit(main())
