"""CUDA-only checks: NCCL tensor parallelism, no host sync with validate=False.

Parity, determinism and batch invariance on CUDA run in the other modules through the
``device`` fixture (``cuda`` parameter, marked ``gpu``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lp_kernels import linear_logprob, vocab_parallel_logprob
from lp_testing import (
    assert_bitwise_equal,
    assert_close,
    make_problem,
    reference_all,
    run_ranks,
    split_vocab,
)


def _nccl_rank(rank, world, problem, mode, reduce, backend):
    dev = torch.device("cuda", rank)
    bounds = split_vocab(problem.v_padded, world, mode=mode)
    start, size = bounds[rank]
    h = problem.hidden.to(dev).requires_grad_()
    w = problem.weight[start : start + size].to(dev).requires_grad_()
    out = linear_logprob(
        h,
        w,
        problem.targets.to(dev),
        tp_group=dist.group.WORLD,
        vocab_start=start,
        reduce_grad_hidden=reduce,
        return_entropy=True,
        return_lse=True,
        backend=backend,
        **problem.op_kwargs(),
    )
    g = torch.linspace(-1, 1, problem.n, device=dev)
    (out.logprob * g + out.entropy * g.flip(0) + out.lse * 0.5).sum().backward()
    return bounds, out.logprob, out.entropy, out.lse, h.grad, w.grad


@pytest.mark.multigpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("mode", "reduce"), [("even", True), ("uneven", True), ("uneven", False)])
def test_nccl_tp2_matches_single_gpu(dtype, mode, reduce, backend):
    world = 2
    problem = make_problem(
        1031, 256, 20011, dtype=dtype, seed=3, ignore_frac=0.1, padded_vocab=20096, temperature=0.9
    )
    p = problem.to("cuda").with_grad()
    ref = linear_logprob(
        p.hidden,
        p.weight,
        p.targets,
        return_entropy=True,
        return_lse=True,
        backend=backend,
        **p.op_kwargs(),
    )
    g = torch.linspace(-1, 1, p.n, device="cuda")
    (ref.logprob * g + ref.entropy * g.flip(0) + ref.lse * 0.5).sum().backward()
    results = run_ranks(
        _nccl_rank, world, problem, mode, reduce, backend, backend="nccl", timeout=90
    )
    eps = 1e-5 if dtype == torch.float32 else 1e-2
    partial = torch.zeros_like(p.hidden.grad, dtype=torch.float32)
    for rank, (bounds, lp, ent, lse, gh, gw) in enumerate(results):
        start, size = bounds[rank]
        tag = f"[{dtype} {mode} reduce={reduce} rank {rank}]"
        for name, got, want in (
            ("logprob", lp, ref.logprob),
            ("entropy", ent, ref.entropy),
            ("lse", lse, ref.lse),
        ):
            assert_close(got, want.cpu(), rtol=1e-5, atol=1e-4, name=name + tag)
        assert_close(
            gw,
            p.weight.grad[start : start + size].cpu(),
            rtol=eps,
            atol=eps,
            name="grad_weight" + tag,
        )
        if reduce:
            assert_close(gh, p.hidden.grad.cpu(), rtol=eps, atol=eps, name="grad_hidden" + tag)
        else:
            partial += gh.cuda().float()
        assert torch.equal(lp, results[0][1]) and torch.equal(ent, results[0][2])
    if not reduce:
        assert_close(partial, p.hidden.grad.float(), rtol=eps, atol=eps, name="sum of partials")


STEADY_MODES = {  # (backend, deterministic)
    "triton": ("triton", False),
    "torch": ("torch", False),
    "triton-deterministic": ("triton", True),
    "torch-deterministic": ("torch", True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(STEADY_MODES))
def test_no_host_sync_with_validate_false(mode):
    backend, deterministic = STEADY_MODES[mode]
    p = make_problem(
        512, 128, 5003, dtype=torch.bfloat16, device="cuda", seed=1, ignore_frac=0.1
    ).with_grad()
    kw = {
        "return_entropy": True, "return_lse": True, "validate": False, "backend": backend,
        "deterministic": deterministic, **p.op_kwargs(),
    }  # fmt: skip
    linear_logprob(p.hidden, p.weight, p.targets, **kw).logprob.sum().backward()  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = linear_logprob(p.hidden, p.weight, p.targets, **kw)
        (out.logprob + out.entropy + out.lse).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(STEADY_MODES))
def test_cuda_graph_capture_replays_eager_bits(mode):
    """Forward + backward captured in a CUDA graph (``validate=False``: no host sync)
    and replayed on new inputs copied into its static buffers: the eager bits."""
    backend, deterministic = STEADY_MODES[mode]
    kw = {
        "return_entropy": True, "return_lse": True, "validate": False, "backend": backend,
        "deterministic": deterministic,
    }  # fmt: skip
    problems = [
        make_problem(300, 128, 5003, dtype=torch.bfloat16, device="cuda", seed=s, ignore_frac=0.1)
        for s in (3, 4)
    ]
    g = torch.linspace(-1, 1, 300, device="cuda")

    def step(hidden, weight, targets):
        out = linear_logprob(hidden, weight, targets, **kw, **problems[0].op_kwargs())
        (out.logprob * g - 0.25 * out.entropy + g.flip(0) * out.lse).sum().backward()
        return out

    def eager(p):
        h, w = (x.detach().clone().requires_grad_() for x in (p.hidden, p.weight))
        out = step(h, w, p.targets)
        return (*out, h.grad, w.grad)

    hidden = problems[0].hidden.detach().clone().requires_grad_()
    weight = problems[0].weight.detach().clone().requires_grad_()
    targets = problems[0].targets.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture (Triton compiles, pools fill)
        for _ in range(2):
            step(hidden, weight, targets)
            hidden.grad = weight.grad = None
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step(hidden, weight, targets)
    for p in problems[::-1]:
        with torch.no_grad():
            hidden.copy_(p.hidden), weight.copy_(p.weight), targets.copy_(p.targets)
        graph.replay()
        torch.cuda.synchronize()
        got = (*static, hidden.grad, weight.grad)
        for name, a, b in zip(
            ("logprob", "entropy", "lse", "grad_hidden", "grad_weight"), got, eager(p), strict=True
        ):
            assert_bitwise_equal(a, b, f"{name} (problem seed {p.seed})")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(STEADY_MODES))
def test_memory_flat_over_1000_calls(mode):
    """1,000 forward + backward calls: torch.cuda.memory_allocated returns to one value."""
    backend, deterministic = STEADY_MODES[mode]
    p = make_problem(
        300, 128, 5003, dtype=torch.bfloat16, device="cuda", seed=2, ignore_frac=0.1
    ).with_grad()
    g = torch.linspace(-1, 1, p.n, device="cuda")
    kw = {
        "return_entropy": True, "validate": False, "backend": backend,
        "deterministic": deterministic, **p.op_kwargs(),
    }  # fmt: skip
    seen = []
    for i in range(1000):
        out = linear_logprob(p.hidden, p.weight, p.targets, **kw)
        (out.logprob * g + out.entropy).sum().backward()
        del out
        p.hidden.grad = p.weight.grad = None
        if i >= 10:  # after warm-up (allocator pools, Triton compilation)
            seen.append(torch.cuda.memory_allocated())
    torch.cuda.synchronize()
    assert min(seen) == max(seen), f"memory_allocated moved: {min(seen)} .. {max(seen)} bytes"


def _fp32_reference_logprob(hidden, weight, targets, rows=1024):
    """Chunked fp32 reference of logprob and grad_hidden for upstream gradient 1 (TF32 off)."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        lp = torch.empty(hidden.shape[0], device=hidden.device)
        gh = torch.empty(hidden.shape, device=hidden.device)
        w32 = weight.float()
        for r0 in range(0, hidden.shape[0], rows):
            z = hidden[r0 : r0 + rows].float() @ w32.T
            ls = torch.log_softmax(z, dim=-1)
            t = targets[r0 : r0 + rows]
            lp[r0 : r0 + rows] = ls.gather(1, t[:, None]).squeeze(1)
            dz = -ls.exp_()
            dz[torch.arange(len(t), device=t.device), t] += 1.0
            gh[r0 : r0 + rows] = dz @ w32
        return lp, gh
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize(
    ("n", "h", "v"),
    [(17000, 64, 130003), (40, 8192, 262147)],
    ids=["NxV>2^31", "VxH>2^31"],
)
def test_large_index_products(n, h, v, backend):
    """int64 offsets: N x V and V x H past 2^31 (row * stride computed in int64)."""
    assert n * v > 2**31 or v * h > 2**31
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, h, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, h, device="cuda", generator=g) * (2 / h**0.5)).to(torch.bfloat16)
    targets = torch.randint(0, v, (n,), device="cuda", generator=g)
    targets[-1] = v - 1  # the last column of the last row: the largest offsets
    out = linear_logprob(hidden, weight, targets, backend=backend)
    out.logprob.sum().backward()
    ref_lp, ref_gh = _fp32_reference_logprob(hidden.detach(), weight, targets)
    assert_close(out.logprob, ref_lp, rtol=1e-4, atol=1e-3, name=f"logprob[{backend}]")
    rel = float((hidden.grad.float() - ref_gh).norm() / ref_gh.norm())
    assert rel < 1e-2, f"grad_hidden relative error {rel:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("v", [5003, 3 * 8192 + 5003], ids=["one-chunk", "four-chunks"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "det"])
def test_size_dependent_launches_keep_batch_invariance(deterministic, dtype, v, monkeypatch):
    """What follows N without changing the bits: lp's GEMM takes its narrow output block
    where the pinned grid leaves the GPU mostly idle (triton.plan.mm_block_n), and the
    default backward takes several vocabulary chunks per launch at small N
    (triton.plan.chunks_per_launch). At H = 2048, 8,192 rows take the pinned block, one
    chunk per launch; 1,024 rows and a single row the narrow block, and (four chunks) all
    four chunks in one launch. A row's outputs and its grad_hidden row are the same bits in
    all three."""
    import lp_kernels.backends.triton.gemm as gemm
    import lp_kernels.backends.triton.plan as tri
    from lp_kernels.backends.triton.config import config_for

    n, h = 8192, 2048
    by_grid, widths = gemm.mm_block_n, {}

    def spy(cfg, m, cols, device):
        width = by_grid(cfg, m, cols, device)
        if cols == h:  # grad_hidden's GEMM ([rows, H]; grad_weight's has the chunk's rows)
            widths.setdefault(m, set()).add(width)
        return width

    monkeypatch.setattr(gemm, "mm_block_n", spy)  # where the GEMM and chunks_per_launch read it
    monkeypatch.setattr(tri, "mm_block_n", spy)
    p = make_problem(n, h, v, dtype=dtype, device="cuda", seed=4, ignore_frac=0.05)
    up = torch.randn(n, generator=torch.Generator().manual_seed(1)).to("cuda")

    def run(rows):
        hid = p.hidden[rows].detach().clone().requires_grad_()
        out = linear_logprob(
            hid, p.weight, p.targets[rows], return_entropy=True, backend="triton",
            deterministic=deterministic, deterministic_tile=5120,  # one tile: fp32 leaves
        )  # fmt: skip
        (out.logprob * up[rows] + out.entropy * up[rows].abs()).sum().backward()
        return out.logprob, out.entropy, hid.grad

    full = run(torch.arange(n, device="cuda"))
    for rows in (torch.arange(3, n, 8, device="cuda"), torch.tensor([4321], device="cuda")):
        got = run(rows)
        for name, a, b in zip(("logprob", "entropy", "grad_hidden"), full, got, strict=True):
            assert_bitwise_equal(b, a[rows], f"{name}, {rows.numel()} rows")
    if v < 8192:  # one vocabulary chunk (with several, one launch's GEMM is narrow anyway)
        assert widths[n] == {256} and widths[n // 8] == {128} and widths[1] == {128}, widths
    else:
        cfg = config_for(torch.device("cuda"), dtype)
        dev = torch.device("cuda")
        assert [tri.chunks_per_launch(m, h, v, cfg, dev) for m in (n, n // 8, 1)] == [1, 4, 4]


@pytest.mark.gpu
@pytest.mark.parametrize("h", [2048, 4096])
def test_deterministic_tile_launches_keep_batch_invariance(h, monkeypatch):
    """deterministic=True with tiles wider than a vocabulary chunk (chunks of a tile): at
    8,192 rows one launch per chunk; at 1,024 and 2,048 rows one launch per tile
    (triton.plan.tile_launch_k), whose grad_hidden GEMM keeps each chunk's sum
    (chunk_k): split side by side on the pinned block at H = 2048 (gemm.split_chunks), one
    launch per chunk on the pinned block at H = 4096. A row's outputs and grad_hidden row
    are the same bits in all of them; grad_weight (cuBLAS, whose kernel follows the
    merged shape) the same bits run to run."""
    import lp_kernels.backends.triton.gemm as gemm
    from lp_kernels.backends.triton.config import config_for
    from lp_kernels.backends.triton.plan import tile_launch_k

    n, v, tile = 8192, 40000, 20096
    cfg = config_for(torch.device("cuda"), torch.bfloat16)
    assert tile_launch_k(n, tile, cfg) is None
    assert tile_launch_k(1024, tile, cfg) is not None
    splits = []
    by_rule = gemm.split_chunks

    def spy(*args):
        splits.append(by_rule(*args))
        return splits[-1]

    monkeypatch.setattr(gemm, "split_chunks", spy)
    p = make_problem(n, h, v, dtype=torch.bfloat16, device="cuda", seed=6, ignore_frac=0.05)
    up = torch.randn(n, generator=torch.Generator().manual_seed(2)).to("cuda")

    def run(rows):
        hid = p.hidden[rows].detach().clone().requires_grad_()
        w = p.weight.detach().clone().requires_grad_()
        out = linear_logprob(
            hid, w, p.targets[rows], return_entropy=True, backend="triton",
            deterministic=True, deterministic_tile=tile,
        )  # fmt: skip
        (out.logprob * up[rows] + out.entropy * up[rows].abs()).sum().backward()
        return out.logprob, out.entropy, hid.grad, w.grad

    full = run(torch.arange(n, device="cuda"))
    for m in (1024, 2048):
        splits.clear()
        rows = torch.arange(5, n, n // m, device="cuda")[:m]
        got = run(rows)
        for name, a, b in zip(("logprob", "entropy", "grad_hidden"), full, got, strict=False):
            assert_bitwise_equal(b, a[rows], f"{name}, {m} rows")
        assert splits and any(splits) == (h == 2048 and m == 1024), (m, splits)
        ref = run(rows)  # the same rows again: grad_weight reproducible
        assert_bitwise_equal(got[3], ref[3], f"grad_weight, {m} rows, run to run")


# deterministic=True over NCCL: shard bounds on multiples of 128 of V_pad = 20480
DET_VOCAB, DET_PADDED = 20011, 20480
DET_LAYOUTS = {
    2: {"even": [(0, 10240), (10240, 10240)], "uneven": [(0, 12800), (12800, 7680)]},
    4: {
        "even": [(5120 * r, 5120) for r in range(4)],
        "uneven": [(0, 2560), (2560, 7680), (10240, 128), (10368, 10112)],
    },
    8: {
        "even": [(2560 * r, 2560) for r in range(8)],
        "uneven": [
            (0, 1280),
            (1280, 3840),
            (5120, 128),
            (5248, 2432),
            (7680, 5120),
            (12800, 2560),
            (15360, 3840),
            (19200, 1280),
        ],
    },
}


def _det_rank(rank, world, problem, bounds, backend="auto"):
    dev = torch.device("cuda", rank)
    start, size = bounds[rank]
    h = problem.hidden.to(dev).requires_grad_()
    w = problem.weight[start : start + size].to(dev).requires_grad_()
    out = linear_logprob(
        h, w, problem.targets.to(dev), tp_group=dist.group.WORLD, vocab_start=start,
        return_entropy=True, return_lse=True, deterministic=True, backend=backend,
        **problem.op_kwargs(),
    )  # fmt: skip
    g = torch.linspace(-1, 1, problem.n, device=dev)
    (out.logprob * g + out.entropy * g.flip(0) + out.lse * 0.5).sum().backward()
    return out.logprob, out.entropy, out.lse, h.grad, w.grad


@pytest.mark.multigpu
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_nccl_deterministic_bitwise_across_tp(dtype, backend):
    """TP = 1 (one GPU), 2, 4 and 8 (when present), even and uneven: the same bits
    everywhere, with either backend."""
    problem = make_problem(
        1031, 256, DET_VOCAB, dtype=dtype, seed=3, ignore_frac=0.1, padded_vocab=DET_PADDED,
        temperature=0.9,
    )  # fmt: skip
    p = problem.to("cuda").with_grad()
    ref = linear_logprob(
        p.hidden, p.weight, p.targets, return_entropy=True, return_lse=True, deterministic=True,
        backend=backend, **p.op_kwargs(),
    )  # fmt: skip
    g = torch.linspace(-1, 1, p.n, device="cuda")
    (ref.logprob * g + ref.entropy * g.flip(0) + ref.lse * 0.5).sum().backward()
    want = [x.detach().cpu() for x in (ref.logprob, ref.entropy, ref.lse, p.hidden.grad)]
    names = ("logprob", "entropy", "lse", "grad_hidden")
    degrees = [w for w in DET_LAYOUTS if w <= torch.cuda.device_count()]
    differ = []
    for world in degrees:
        for mode, bounds in DET_LAYOUTS[world].items():
            results = run_ranks(
                _det_rank, world, problem, bounds, backend, backend="nccl", timeout=120
            )
            grad_w = torch.cat([r[4] for r in results])
            pairs = [(f"{name} rank {rank}", a, b) for rank, got in enumerate(results)
                     for name, a, b in zip(names, got[:4], want, strict=True)]  # fmt: skip
            pairs.append(("grad_weight", grad_w, p.weight.grad.cpu()))
            for what, a, b in pairs:
                if not torch.equal(a, b):
                    n_diff = int((a != b).sum())
                    err = float((a.double() - b.double()).abs().max())
                    differ.append(f"TP{world} {mode} {what}: {n_diff} elements, max {err:.3g}")
    assert not differ, "not bitwise equal to TP1:\n" + "\n".join(differ)


# The S2 head of docs/benchmarks.md (vocabulary 248320), padded as Megatron pads it for
# TP 8 (a multiple of 128 x 8), so that every TP degree up to 8 splits the same weight
# evenly on 128-column bounds. TP 4 and 8 run where that many GPUs are present.
S2_HEAD = {"n": 1031, "h": 1024, "v": 248320, "v_padded": 248832}


def _s2_problem(shape: dict):
    return make_problem(
        shape["n"], shape["h"], shape["v"], dtype=torch.bfloat16, seed=4, ignore_frac=0.1,
        padded_vocab=shape["v_padded"], temperature=0.9,
    )  # fmt: skip


def _megatron_layout(vocab: int, world: int) -> list[tuple[int, int]]:
    """Megatron's even shards of ``vocab`` padded to a multiple of 128 x TP."""
    return split_vocab(-(-vocab // (128 * world)) * 128 * world, world, multiple=128)


def _s2_rank(
    rank, world, backend, reduce, deterministic, shape=S2_HEAD, device="cuda", megatron=False
):  # fmt: skip
    dev = torch.device(device, rank) if device == "cuda" else torch.device(device)
    problem = _s2_problem(shape)
    if megatron:  # 128 x TP padding: off the default tile's grid at TP 2 and 4
        start, size = _megatron_layout(shape["v"], world)[rank]
    else:
        start, size = split_vocab(shape["v_padded"], world, mode="even", multiple=128)[rank]
    h = problem.hidden.to(dev).requires_grad_()
    w = problem.weight[start : start + size].to(dev).requires_grad_()
    out = linear_logprob(
        h, w, problem.targets.to(dev), tp_group=dist.group.WORLD, vocab_start=start,
        reduce_grad_hidden=reduce, return_entropy=True, return_lse=True, backend=backend,
        deterministic=deterministic, **problem.op_kwargs(),
    )  # fmt: skip
    g = torch.linspace(-1, 1, problem.n, device=dev)
    (out.logprob * g + out.entropy * g.flip(0) + out.lse * 0.5).sum().backward()
    return (start, size), out.logprob, out.entropy, out.lse, h.grad, w.grad


def _s2_reference(backend: str, deterministic: bool, shape=S2_HEAD, device="cuda"):
    p = _s2_problem(shape).to(device).with_grad()
    ref = linear_logprob(
        p.hidden, p.weight, p.targets, return_entropy=True, return_lse=True, backend=backend,
        deterministic=deterministic, **p.op_kwargs(),
    )  # fmt: skip
    g = torch.linspace(-1, 1, p.n, device=device)
    (ref.logprob * g + ref.entropy * g.flip(0) + ref.lse * 0.5).sum().backward()
    outs = (ref.logprob, ref.entropy, ref.lse, p.hidden.grad, p.weight.grad)
    return [x.detach().cpu() for x in outs]


def check_s2_head(world: int, shape=S2_HEAD, device="cuda", dist_backend="nccl") -> None:
    """Both backends against one device (reduced and partial grad_hidden), then
    deterministic=True bitwise against one device (see test_nccl_s2_head)."""
    names = ("logprob", "entropy", "lse")
    kw = {"shape": shape, "device": device}
    for backend in ("triton", "torch"):
        want = _s2_reference(backend, False, **kw)
        for reduce in (True, False):
            results = run_ranks(
                _s2_rank, world, backend, reduce, False, backend=dist_backend, timeout=300, **kw
            )
            partial = torch.zeros_like(want[3], dtype=torch.float32)
            for rank, ((start, size), *got) in enumerate(results):
                tag = f" [TP{world} {backend} reduce={reduce} rank {rank}]"
                for name, a, b in zip(names, got[:3], want[:3], strict=True):
                    assert_close(a, b, rtol=1e-5, atol=1e-4, name=name + tag)
                assert_close(got[4], want[4][start : start + size], rtol=1e-2, atol=1e-2,
                             name="grad_weight" + tag)  # fmt: skip
                if reduce:
                    assert_close(got[3], want[3], rtol=1e-2, atol=1e-2, name="grad_hidden" + tag)
                else:
                    partial += got[3].float()
            if not reduce:
                assert_close(partial, want[3].float(), rtol=1e-2, atol=1e-2, name="sum")
    differ = []
    for backend in ("triton", "torch"):
        want = _s2_reference(backend, True, **kw)
        for megatron in (False, True):  # shards on the default tile's grid, then Megatron's
            results = run_ranks(
                _s2_rank, world, backend, True, True, backend=dist_backend, timeout=300,
                megatron=megatron, **kw,
            )  # fmt: skip
            for rank, ((start, size), *got) in enumerate(results):
                pairs = list(zip((*names, "grad_hidden"), got[:4], want[:4], strict=True))
                pairs.append(("grad_weight", got[4], want[4][start : start + size]))
                tag = f"{backend} {'megatron ' if megatron else ''}rank {rank}"
                differ += [f"{tag} {n}" for n, a, b in pairs if not torch.equal(a, b)]
    assert not differ, f"deterministic TP{world} not bitwise equal to one device: {differ}"


@pytest.mark.multigpu
@pytest.mark.parametrize("world", [2, 4, 8], ids=lambda w: f"tp{w}")
def test_nccl_s2_head(world):
    """The S2 head (V 248320, H 1024, N 1031, bf16) split over 2, 4 or 8 GPUs: both backends
    match one GPU, with reduced and partial grad_hidden; deterministic=True is bitwise
    equal to one GPU, on shards of the default tile's grid and on Megatron's shards (whose
    tiles cross bounds at TP 2 and 4: the halo rows go over NCCL). Skipped where fewer
    GPUs are present."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs; found {torch.cuda.device_count()}")
    check_s2_head(world)


# An uneven layout whose second shard lies inside the second 31104-column tile.
_INSIDE = [(0, 31232), (31232, 256), (31488, 92928), (124416, 124416)]


def _shared_layout(kind: str, world: int, tile: int) -> list[tuple[int, int]]:
    if kind == "megatron":
        return _megatron_layout(S2_HEAD["v"], world)
    if kind == "inside":
        return _INSIDE
    return split_vocab(S2_HEAD["v_padded"], world, mode="even", multiple=tile)


def _shared_gpu_rank(rank, world, tile, kind, backend="triton", chunk=None):
    """One gloo rank of the S2 head on GPU 0, which every rank shares (see below)."""
    from lp_testing import gloo_cuda_via_host

    problem = _s2_problem(S2_HEAD)
    start, size = _shared_layout(kind, world, tile)[rank]
    dev = torch.device("cuda", 0)
    h = problem.hidden.to(dev).requires_grad_()
    w = problem.weight[start : start + size].to(dev).requires_grad_()
    with gloo_cuda_via_host():
        out = linear_logprob(
            h, w, problem.targets.to(dev), tp_group=dist.group.WORLD, vocab_start=start,
            return_entropy=True, return_lse=True, deterministic=True, deterministic_tile=tile,
            backend=backend, chunk_size=chunk, **problem.op_kwargs(),
        )  # fmt: skip
        g = torch.linspace(-1, 1, problem.n, device=dev)
        (out.logprob * g + out.entropy * g.flip(0) + out.lse * 0.5).sum().backward()
    return (start, size), out.logprob, out.entropy, out.lse, h.grad, w.grad


_SHARED_CASES = [  # (backend, tile, layout kind, torch token chunk)
    ("triton", 128, "grid", None),
    ("triton", 31104, "grid", None),
    ("triton", 31104, "megatron", None),
    ("triton", 4096, "megatron", None),
    ("triton", 31104, "inside", None),
    ("torch", 128, "grid", None),
    ("torch", 31104, "megatron", None),
    ("torch", 4096, "megatron", 256),
    ("torch", 31104, "inside", 256),
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "backend, tile, kind, chunk",
    _SHARED_CASES,
    ids=[f"{b}-tile{t}-{k}" + (f"-chunk{c}" if c else "") for b, t, k, c in _SHARED_CASES],
)
def test_deterministic_tp_layouts_sharing_one_gpu(backend, tile, kind, chunk):
    """The S2 head (V_pad 248832) split 2, 4 and 8 ways over gloo ranks that all run on one
    GPU: the triton kernels of each shard, on the GPU, give bitwise the single-process
    result, with the default tile and with V_pad / 8 = 31104 (the widest for TP 1-8) on
    shards of the tile's grid, on Megatron's shards of each degree (128 x TP padding:
    124160 and 62080 at TP 2 and 4, off the 31104 and 4096 grids, so tiles cross shard
    bounds and take the next rank's rows; one tile per backward chunk at 31104, several at
    4096), and (``inside``, TP 4 only) on uneven shards one of which lies inside a tile
    that starts on the rank before it. It checks the kernels' layout invariance where fewer GPUs
    than ranks are present; the NCCL runs (test_nccl_s2_head) check the same with one GPU
    per rank. The torch backend too (cuBLAS GEMMs and torch reductions on one tile's shape),
    with its default token chunk (all 1031 rows) and with 256-row chunks (grad_weight summed
    over five)."""
    p = _s2_problem(S2_HEAD).to("cuda").with_grad()
    ref = linear_logprob(
        p.hidden, p.weight, p.targets, return_entropy=True, return_lse=True, deterministic=True,
        deterministic_tile=tile, backend=backend, chunk_size=chunk, **p.op_kwargs(),
    )  # fmt: skip
    g = torch.linspace(-1, 1, p.n, device="cuda")
    (ref.logprob * g + ref.entropy * g.flip(0) + ref.lse * 0.5).sum().backward()
    want = [x.detach().cpu() for x in (ref.logprob, ref.entropy, ref.lse, p.hidden.grad)]
    grad_w = p.weight.grad.cpu()
    del p, ref
    names = ("logprob", "entropy", "lse", "grad_hidden")
    differ = []
    for world in (4,) if kind == "inside" else (2, 4, 8):
        results = run_ranks(_shared_gpu_rank, world, tile, kind, backend, chunk, timeout=300)
        for rank, ((start, size), *got) in enumerate(results):
            pairs = list(zip(names, got[:4], want, strict=True))
            pairs.append(("grad_weight", got[4], grad_w[start : start + size]))
            differ += [f"TP{world} rank {rank} {n}" for n, a, b in pairs if not torch.equal(a, b)]
    assert not differ, f"deterministic_tile={tile}: not bitwise equal to one process: {differ}"


def _s2_logits(dev):
    """The S2 head's logits ``[1031, 248832]`` bf16, from one GEMM (the same bits in
    every process)."""
    problem = _s2_problem(S2_HEAD)
    return problem, problem.hidden.to(dev) @ problem.weight.to(dev).T


def _logits_step(logits, problem, dev, tile, **tp):
    logits = logits.detach().requires_grad_()
    out = vocab_parallel_logprob(
        logits, problem.targets.to(dev), return_entropy=True, return_lse=True,
        deterministic=True, deterministic_tile=tile, **problem.op_kwargs(), **tp,
    )  # fmt: skip
    g = torch.linspace(-1, 1, problem.n, device=dev)
    (out.logprob * g + out.entropy * g.flip(0) + out.lse * 0.5).sum().backward()
    return [x.detach().cpu() for x in (out.logprob, out.entropy, out.lse, logits.grad)]


def _shared_gpu_logits_rank(rank, world, tile):
    from lp_testing import gloo_cuda_via_host

    dev = torch.device("cuda", 0)
    problem, logits = _s2_logits(dev)
    start, size = _megatron_layout(S2_HEAD["v"], world)[rank]
    with gloo_cuda_via_host():
        got = _logits_step(
            logits[:, start : start + size], problem, dev, tile, tp_group=dist.group.WORLD,
            vocab_start=start,
        )  # fmt: skip
    return (start, size), *got


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [128, 31104])
def test_vocab_parallel_deterministic_layouts_sharing_one_gpu(tile):
    """``vocab_parallel_logprob(deterministic=True)`` on CUDA: the S2 head's logits split
    2, 4 and 8 ways on Megatron's shards (on the 128-column grid; at 31104 only TP 8's are
    on the tile grid) over gloo ranks sharing one GPU give bitwise the single-process
    outputs and logits gradient."""
    problem, logits = _s2_logits(torch.device("cuda"))
    want = _logits_step(logits, problem, logits.device, tile)
    del logits
    names = ("logprob", "entropy", "lse")
    differ = []
    for world in (2, 4, 8) if tile == 128 else (8,):
        for rank, ((start, size), *got) in enumerate(
            run_ranks(_shared_gpu_logits_rank, world, tile, timeout=300)
        ):
            pairs = list(zip(names, got[:3], want[:3], strict=True))
            pairs.append(("grad_logits", got[3], want[3][:, start : start + size]))
            differ += [f"TP{world} rank {rank} {n}" for n, a, b in pairs if not torch.equal(a, b)]
    assert not differ, f"deterministic_tile={tile}: not bitwise equal to one process: {differ}"


@pytest.mark.gpu
def test_torch_deterministic_warns_about_many_narrow_tiles_on_cuda():
    """The torch backend's deterministic mode makes its calls tile by tile: with more than
    MANY_TILES tiles per shard on CUDA (here 313 tiles of 128 columns) it says so and what
    to use, at the caller's line; with the default tile it is silent."""
    import warnings

    p = make_problem(64, 32, 40000, dtype=torch.bfloat16, device="cuda", seed=2)
    kw = {"backend": "torch", "deterministic": True, **p.op_kwargs()}
    match = r"313 tiles of deterministic_tile=128 .* backend='triton'"
    with pytest.warns(UserWarning, match=match) as record:
        linear_logprob(p.hidden, p.weight, p.targets, deterministic_tile=128, **kw)
    assert [w.filename for w in record] == [__file__]  # it points at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        linear_logprob(p.hidden, p.weight, p.targets, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_probabilities_below_2_pow_minus_126_flush_to_zero(deterministic):
    """The triton kernels' softmax terms and probabilities flush below 2^-126
    (``tl_utils.exp_ftz``, design.md "Precision policy"): a column 95 nats below every
    row's largest logit (p about 3e-42) gets an exactly zero grad_weight row, where the fp64
    truth is a nonzero value under 2^-126; every output and every other gradient stays
    within fp32 rounding of the truth."""
    n, h, v = 64, 16, 1000
    gen = torch.Generator().manual_seed(0)
    hidden = torch.zeros(n, h)
    hidden[:, 0] = 1.0
    hidden[:, 1:] = torch.randn(n, h - 1, generator=gen) * 0.1
    weight = torch.randn(v, h, generator=gen) * 0.1
    weight[:, 0] = torch.randn(v, generator=gen)
    weight[1, 0] = -88.0  # column 1: p = e^(-95 +- 1) in every row (lse about 7)
    targets = torch.randint(2, v, (n,), generator=gen)
    g_lp = torch.linspace(-1, 1, n)
    g_ent = torch.full((n,), 0.01)
    truth = reference_all(hidden, weight, targets, grad_logprob=g_lp, grad_entropy=g_ent)
    hd = hidden.cuda().requires_grad_()
    wt = weight.cuda().requires_grad_()
    out = linear_logprob(
        hd, wt, targets.cuda(), return_entropy=True, backend="triton",
        deterministic=deterministic,
    )  # fmt: skip
    torch.autograd.backward([out.logprob, out.entropy], [g_lp.cuda(), g_ent.cuda()])
    assert torch.equal(wt.grad[1], torch.zeros_like(wt.grad[1]))
    assert 0 < truth["grad_weight"][1].abs().max() < 2.0**-126
    got = {"logprob": out.logprob, "entropy": out.entropy}
    got |= {"grad_hidden": hd.grad, "grad_weight": wt.grad}
    for name, value in got.items():
        want = truth[name]
        err = (value.double().cpu() - want).abs().max() / want.abs().max()
        assert err < 1e-5, (name, float(err))
