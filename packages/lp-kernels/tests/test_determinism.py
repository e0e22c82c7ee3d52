"""Run-to-run reproducibility, batch invariance and chunk-size invariance, bit for bit."""

from __future__ import annotations

import os

import pytest
import torch

from lp_kernels import linear_logprob, vocab_parallel_logprob
from lp_testing import assert_bitwise_equal, make_problem


def _run(
    hidden, weight, targets, *, chunk_size=None, temperature=0.9, vocab_size=None, backend="torch"
):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    out = linear_logprob(
        h,
        w,
        targets,
        return_entropy=True,
        return_lse=True,
        chunk_size=chunk_size,
        temperature=temperature,
        vocab_size=vocab_size,
        backend=backend,
    )
    g = torch.linspace(-1, 1, targets.numel(), device=targets.device)
    (out.logprob * g + out.entropy * g.flip(0) + out.lse * 0.25).sum().backward()
    return out, h.grad, w.grad


DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _skip_torch_backend_on_cuda(device: str, backend: str) -> None:
    """Batch invariance on CUDA is the triton backend's (the default there).

    The torch backend runs cuBLAS GEMMs and torch reductions, whose summation order
    depends on the shape and even on a row's position in the block: measured on H200,
    fixed-shape zero-padded chunks still change bits. On CPU it is invariant (tested).
    """
    if device == "cuda" and backend == "torch":
        pytest.skip("torch backend on CUDA is not batch-invariant; the triton backend is")


@pytest.mark.parametrize("dtype", list(DTYPE_IDS), ids=DTYPE_IDS.get)
def test_run_to_run_bitwise(dtype, device, backend):
    p = make_problem(
        67, 48, 1031, dtype=dtype, device=device, seed=11, ignore_frac=0.1, padded_vocab=1040
    )
    a = _run(p.hidden, p.weight, p.targets, vocab_size=p.vocab_size, chunk_size=32, backend=backend)
    b = _run(p.hidden, p.weight, p.targets, vocab_size=p.vocab_size, chunk_size=32, backend=backend)
    for name, x, y in zip(("logprob", "entropy", "lse"), a[0], b[0], strict=True):
        assert_bitwise_equal(x, y, name)
    assert_bitwise_equal(a[1], b[1], "grad_hidden")
    assert_bitwise_equal(a[2], b[2], "grad_weight")


@pytest.mark.parametrize("dtype", list(DTYPE_IDS), ids=DTYPE_IDS.get)
def test_batch_and_chunk_invariance(dtype, device, backend):
    """A row's outputs do not depend on N or on other rows; nothing per row depends on chunk_size.

    (grad_hidden rows under a changed batch are checked in the next test, where each row
    keeps its upstream gradient.)
    """
    _skip_torch_backend_on_cuda(device, backend)
    p = make_problem(150, 40, 2053, dtype=dtype, device=device, seed=5, ignore_frac=0.05)
    full, gh_full, _ = _run(p.hidden, p.weight, p.targets, backend=backend)

    def check(rows):
        sub, _, _ = _run(p.hidden[rows], p.weight, p.targets[rows], backend=backend)
        for name, a, b in zip(("logprob", "entropy", "lse"), full, sub, strict=True):
            assert_bitwise_equal(b, a[rows], f"{name} rows {rows[:4].tolist()}..")

    gen = torch.Generator().manual_seed(0)
    for rows in (
        torch.tensor([17]),  # N = 1
        torch.arange(0, 150, 2),
        torch.randperm(150, generator=gen)[:37],
    ):
        check(rows.to(p.hidden.device))
    for chunk in (16, 48, 7, 150):
        out, gh, _ = _run(p.hidden, p.weight, p.targets, chunk_size=chunk, backend=backend)
        for name, a, b in zip(("logprob", "entropy", "lse"), full, out, strict=True):
            assert_bitwise_equal(b, a, f"{name} chunk_size={chunk}")
        assert_bitwise_equal(gh, gh_full, f"grad_hidden chunk_size={chunk}")


@pytest.mark.parametrize("dtype", list(DTYPE_IDS), ids=DTYPE_IDS.get)
def test_grad_hidden_row_batch_invariance(dtype, device, backend):
    """grad_hidden of a row, with the same upstream gradient for it, whatever shares the call."""
    _skip_torch_backend_on_cuda(device, backend)
    p = make_problem(96, 32, 1009, dtype=dtype, device=device, seed=9)
    up = torch.randn(96, generator=torch.Generator().manual_seed(2)).to(device)

    def grad_rows(rows):
        h = p.hidden[rows].detach().clone().requires_grad_()
        out = linear_logprob(h, p.weight, p.targets[rows], return_entropy=True, backend=backend)
        (out.logprob * up[rows] + out.entropy * up[rows].flip(0).abs()).sum().backward()
        return h.grad

    # The entropy weights depend on the subset through flip(); use only rows where they agree.
    full = grad_rows(torch.arange(96, device=device))
    for rows in (torch.arange(96, device=device)[40:41], torch.arange(96, device=device)[::3]):
        h = p.hidden[rows].detach().clone().requires_grad_()
        out = linear_logprob(h, p.weight, p.targets[rows], return_entropy=True, backend=backend)
        (out.logprob * up[rows] + out.entropy * up.flip(0).abs()[rows]).sum().backward()
        assert_bitwise_equal(h.grad, full[rows], f"grad_hidden rows {rows[:3].tolist()}..")


def test_vocab_parallel_logprob_batch_and_chunk_invariance(device):
    _skip_torch_backend_on_cuda(device, "torch")  # the logits op is torch code
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(120, 3001, generator=g) * 4).to(device)
    targets = torch.randint(0, 3001, (120,), generator=g).to(device)
    full = vocab_parallel_logprob(logits, targets, return_entropy=True, return_lse=True)
    for rows in (torch.tensor([3]), torch.arange(0, 120, 7)):
        rows = rows.to(device)
        sub = vocab_parallel_logprob(
            logits[rows], targets[rows], return_entropy=True, return_lse=True
        )
        for name, a, b in zip(("logprob", "entropy", "lse"), full, sub, strict=True):
            assert_bitwise_equal(b, a[rows], name)
    for chunk in (1, 17, 64):
        out = vocab_parallel_logprob(
            logits, targets, return_entropy=True, return_lse=True, chunk_size=chunk
        )
        for name, a, b in zip(("logprob", "entropy", "lse"), full, out, strict=True):
            assert_bitwise_equal(b, a, f"{name} chunk_size={chunk}")


@pytest.mark.parametrize(
    "deterministic", [None, 128, 384], ids=["default", "det", "det-tile384"]
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_load_path_and_launch_order_do_not_change_bits(
    dtype, deterministic, device, monkeypatch
):
    """Tensor-descriptor loads against pointer loads, the swizzled launch order against
    another swizzle, the GEMM's pinned output block against its narrow one (chosen by the
    grid: triton.plan.mm_block_n), in both modes (deterministic: tile 128, or 384 with a
    cut last tile): the same products in the same order, so the same bits (the load path
    is chosen by H, dtype and alignment; see triton.config.tma_ok). Each config is set
    for the call (config.use_config)."""
    import lp_kernels.backends.triton.gemm as gemm
    import lp_kernels.backends.triton.plan as plan
    from lp_kernels.backends.triton.config import config_for, tma_ok, use_config

    base = config_for(torch.device(device), dtype)
    by_grid = gemm.mm_block_n
    p = make_problem(
        67, 64, 1031, dtype=dtype, device=device, seed=5, ignore_frac=0.1, padded_vocab=1152
    )
    results = []
    changes = [{}, {"tma": False}, {"swizzle": 1}, {"swizzle": 0, "tma": False}]
    if device == "cpu" or base.gemm.block_n >= 256:  # the widths mm_block_n chooses from
        changes += [{"div": 1}, {"div": 2}, {"div": 2, "tma": False}]
    for change in changes:
        # the GEMM's output block: chosen by the grid (None), the config's width or its half
        div = change.pop("div", None)
        width = by_grid if div is None else (lambda cfg, *_, d=div: cfg.gemm.block_n // d)
        monkeypatch.setattr(gemm, "mm_block_n", width)  # the GEMM's and chunks_per_launch's
        monkeypatch.setattr(plan, "mm_block_n", width)
        h = p.hidden.detach().clone().requires_grad_()
        w = p.weight.detach().clone().requires_grad_()
        with use_config(base.replace(**change)):
            out = linear_logprob(
                h, w, p.targets, return_entropy=True, return_lse=True, temperature=0.9,
                vocab_size=1031, backend="triton", deterministic=deterministic is not None,
                deterministic_tile=deterministic or 128,
            )  # fmt: skip
        g = torch.linspace(-1, 1, p.n, device=device)
        (out.logprob * g + out.entropy * g.flip(0) + out.lse * 0.25).sum().backward()
        results.append((out.logprob, out.entropy, out.lse, h.grad, w.grad))
    assert tma_ok(p.hidden, p.weight)  # the first run took the descriptor path
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert_bitwise_equal(a, b)


@pytest.mark.parametrize("h", [48, 50], ids=["tma", "pointers"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_vocabulary_chunks_per_launch_do_not_change_bits(dtype, h, device, monkeypatch):
    """At small N the default backward takes several vocabulary chunks per launch
    (triton.plan.chunks_per_launch, chosen by N): the outputs and grad_hidden are bitwise
    those of one launch per chunk, for counts that divide the shard's chunks or not and a
    last chunk cut short (padded vocabulary, ignored rows, temperature, entropy), through
    tensor descriptors (one GEMM launch per launch's chunks) or pointers (H = 50: rows not
    16-byte aligned; one GEMM launch per chunk). grad_weight takes one cuBLAS GEMM per
    launch on CUDA (its kernel may follow the shape), so it is compared to fp32 accuracy
    there."""
    import lp_kernels.backends.triton.linear as tlin
    from lp_kernels.backends.triton.config import config_for, tma_ok
    from lp_kernels.backends.triton.plan import chunks_per_launch

    interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if (device == "cpu") != interpreting:
        pytest.skip("the triton kernels run under the interpreter on CPU, compiled on CUDA")
    chunk = config_for(torch.device(device), dtype).backward.vocab_chunk
    v_real, v_pad = 3 * chunk + 700, 3 * chunk + 768
    p = make_problem(
        13, h, v_real, dtype=dtype, device=device, seed=8, ignore_frac=0.15, padded_vocab=v_pad
    )
    assert tma_ok(p.hidden, p.weight) == (h == 48)
    dev = torch.device(device)
    assert chunks_per_launch(13, h, v_real, config_for(dev, dtype), dev) == 4
    results = {}
    for per_launch in (1, 2, 3, 4):
        monkeypatch.setattr(tlin, "chunks_per_launch", lambda *_, k=per_launch: k)
        hid = p.hidden.detach().clone().requires_grad_()
        w = p.weight.detach().clone().requires_grad_()
        out = linear_logprob(
            hid, w, p.targets, return_entropy=True, return_lse=True, temperature=0.9,
            vocab_size=v_real, backend="triton",
        )  # fmt: skip
        g = torch.linspace(-1, 1, p.n, device=device)
        (out.logprob * g + out.entropy * g.flip(0) + out.lse * 0.25).sum().backward()
        results[per_launch] = (out.logprob, out.entropy, out.lse, hid.grad, w.grad)
    names = ("logprob", "entropy", "lse", "grad_hidden")
    for per_launch in (2, 3, 4):
        for name, a, b in zip(names, results[1], results[per_launch], strict=False):
            assert_bitwise_equal(b, a, f"{name}, {per_launch} chunks per launch")
        a, b = results[1][4].double(), results[per_launch][4].double()
        assert float((a - b).norm() / a.norm()) < (1e-6 if dtype == torch.float32 else 1e-2)


def _gemm_problem(device: str, dtype, seed: int, m: int, k: int, n: int):
    """``(cfg, A [m, k], B [k, n], C [m, n] fp32)`` for lp's GEMM on ``device``; skips
    where the triton kernels do not run there (the interpreter on CPU, compiled on CUDA)."""
    from lp_kernels.backends.triton.config import config_for

    interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if (device == "cpu") != interpreting:
        pytest.skip("the triton kernels run under the interpreter on CPU, compiled on CUDA")
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=gen).to(device, dtype)
    b = torch.randn(k, n, generator=gen).to(device, dtype)
    c = torch.randn(m, n, generator=gen).to(device)
    return config_for(torch.device(device), dtype), a, b, c


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_gemm_c_tile_through_descriptor_or_pointers(dtype, device, monkeypatch):
    """The grad_hidden GEMM's accumulating form (every vocabulary chunk after the first)
    sums A @ B over K from +0.0 and then adds C once, reading and writing C through a
    tensor descriptor (``C_TMA``: C allows one) or through pointers (C's base not 16-byte
    aligned): the same bits either way, and C + A @ B to fp32 accuracy. M and N are not
    multiples of the blocks (clipped stores)."""
    from lp_kernels.backends.triton.config import tma_ok
    from lp_kernels.backends.triton.gemm import matmul_acc

    m, k, n = 131, 256, 200
    cfg, a, b, c0 = _gemm_problem(device, dtype, 11, m, k, n)
    out = {}
    for c_tma in (True, False):
        # an element's offset from a 16-byte boundary rules out a descriptor over C
        store = torch.empty(m * n + 1, device=device)
        c = store[: m * n] if c_tma else store[1:]
        c = c.view(m, n)
        c.copy_(c0)
        assert tma_ok(c) == c_tma
        matmul_acc(c, a, b, cfg, k_a=k, accumulate=True)
        out[c_tma] = c
    assert cfg.tma and tma_ok(a, b, c0)  # the first call took the descriptor path
    assert_bitwise_equal(out[True], out[False])
    ref = c0.double() + a.double() @ b.double()
    assert float((out[True].double() - ref).norm() / ref.norm()) < 1e-6


@pytest.mark.parametrize("accumulate", [False, True], ids=["overwrite", "accumulate"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_gemm_chunks_in_one_launch_or_one_per_chunk(dtype, accumulate, device, monkeypatch):
    """grad_hidden's GEMM over K in chunks (``chunk_k``: the default backward's chunks per
    launch, ``deterministic=True``'s chunks of a tile in one launch): one launch on the
    narrow output block (``MULTI``, with tensor descriptors), one launch per chunk on the
    block the waves pick, or the chunks side by side (``SPLIT``, then their ordered sum),
    each on both output block widths (forced), bitwise equal to explicit calls per chunk in
    order, and to C + A @ B within fp32 accuracy. M and N are not multiples of the blocks."""
    import lp_kernels.backends.triton.gemm as gemm
    from lp_kernels.backends.triton.plan import narrow_block_n

    m, n, chunk = 131, 200, 256
    k = 3 * chunk + 128  # a last chunk cut short
    cfg, a, b, c0 = _gemm_problem(device, dtype, 12, m, k, n)

    sums = []  # the ordered sums launched (SPLIT ran)
    ordered_sum = gemm.ordered_sum_kernel

    class Spy:
        def __getitem__(self, grid):
            sums.append(grid)
            return ordered_sum[grid]

    monkeypatch.setattr(gemm, "ordered_sum_kernel", Spy())

    def run(width, chunk_k, split):
        monkeypatch.setattr(gemm, "mm_block_n", lambda *_: width)
        monkeypatch.setattr(gemm, "split_chunks", lambda *_: split)
        c = c0.clone()
        launched = len(sums)
        gemm.matmul_acc(c, a, b, cfg, k_a=k, accumulate=accumulate, chunk_k=chunk_k)
        assert len(sums) - launched == int(split)
        return c

    per_call = c0.clone()
    monkeypatch.setattr(gemm, "mm_block_n", lambda *_: cfg.gemm.block_n)
    for k0 in range(0, k, chunk):
        kc = min(chunk, k - k0)
        gemm.matmul_acc(
            per_call, a[:, k0 : k0 + kc], b[k0 : k0 + kc], cfg, k_a=kc,
            accumulate=accumulate or k0 > 0,
        )  # fmt: skip
    for width in sorted({narrow_block_n(cfg), cfg.gemm.block_n}):
        for split in (False, True):
            got = run(width, chunk, split)
            assert_bitwise_equal(got, per_call, f"output block {width}, split {split}")
    ref = a.double() @ b.double() + (c0.double() if accumulate else 0)
    assert float((per_call.double() - ref).norm() / ref.norm()) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_round_tiles_do_not_change_bits(dtype, device, monkeypatch):
    """deterministic=True with tiles wider than half a vocabulary chunk: the fp32 products
    of DeterministicConfig.round_tiles tiles are rounded into grad_hidden's int64 sum in one
    pass. Each tile is still rounded on its own, so passes of 1, 2, 3 and 5 tiles (5 tiles
    here, the last cut by the vocabulary; 3 token chunks) give the same bits; and passes
    of 2 write every element (NaN-poisoned allocations)."""
    import lp_kernels.backends.triton.deterministic as tdet
    from lp_kernels.backends.triton.config import config_for, use_config
    from lp_kernels.core.matmul import scratch

    interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if (device == "cpu") != interpreting:
        pytest.skip("the triton kernels run under the interpreter on CPU, compiled on CUDA")
    base = config_for(torch.device(device), dtype)
    base = base.replace(backward={"vocab_chunk": 256, "token_chunk": 32})
    p = make_problem(
        67, 64, 1031, dtype=dtype, device=device, seed=7, ignore_frac=0.1, padded_vocab=1152
    )
    results = []
    for tiles, poison in ((1, False), (2, False), (3, False), (5, False), (2, True)):
        cfg = base.replace(deterministic={"round_tiles": tiles})
        per_round = tdet.tiles_per_round(5, p.n, p.hidden.shape[1], cfg.deterministic.round_tiles)
        assert per_round == tiles
        monkeypatch.setattr(scratch, "poison", poison)
        h = p.hidden.detach().clone().requires_grad_()
        w = p.weight.detach().clone().requires_grad_()
        with use_config(cfg):
            out = linear_logprob(
                h, w, p.targets, return_entropy=True, return_lse=True, temperature=0.9,
                vocab_size=1031, backend="triton", deterministic=True, deterministic_tile=256,
            )  # fmt: skip
        g = torch.linspace(-1, 1, p.n, device=device)
        (out.logprob * g + out.entropy * g.flip(0) + out.lse * 0.25).sum().backward()
        results.append((out.logprob, out.entropy, out.lse, h.grad, w.grad))
    assert torch.isfinite(results[0][3]).all()
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert_bitwise_equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "det"])
def test_every_output_and_gradient_element_written(dtype, deterministic, device, monkeypatch):
    """NaN-poisoned scratch and outputs (grad_weight is not zero-filled first; the fp32
    accumulators are overwritten by their first chunk): the results equal those of zeroed
    allocations, bit for bit, with several token chunks, several vocabulary chunks and
    padding rows (the triton backend's interpreter config on CPU)."""
    from lp_kernels.core.matmul import scratch

    p = make_problem(
        131, 32, 2300, dtype=dtype, device=device, seed=9, ignore_frac=0.1, padded_vocab=2432
    )
    results = []
    for poison in (False, True):
        monkeypatch.setattr(scratch, "poison", poison)
        h = p.hidden.detach().clone().requires_grad_()
        w = p.weight.detach().clone().requires_grad_()
        out = linear_logprob(
            h, w, p.targets, return_entropy=True, vocab_size=2300, backend="triton",
            deterministic=deterministic,
        )  # fmt: skip
        g = torch.linspace(-1, 1, p.n, device=device)
        (out.logprob * g + out.entropy * g.flip(0)).sum().backward()
        results.append((out.logprob, out.entropy, h.grad, w.grad))
    assert torch.equal(results[1][3][2300:], torch.zeros_like(results[1][3][2300:]))
    for a, b in zip(*results, strict=True):
        assert_bitwise_equal(a, b)


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "det"])
def test_dlogits_buffer_is_exactly_zero_past_the_chunk(deterministic, device, monkeypatch):
    """The d_logits chunks the gradient GEMMs read (NaN-poisoned scratch) hold exact zeros
    in their padded columns [v_count, cols) (the kernels' padded K bound assumes them) and
    in ignored rows, even where those rows' hidden is NaN, while the real columns of live
    rows are written."""
    import lp_kernels.backends.triton.backward as tbwd
    import lp_kernels.backends.triton.deterministic as tdet
    import lp_kernels.backends.triton.linear as tlin
    from lp_kernels.core.matmul import scratch

    monkeypatch.setattr(scratch, "poison", True)
    seen = []  # (v_count, rows r0:r1, the token chunk with its padded columns)

    class Spy(tbwd.DlogitsChunks):
        def __iter__(self):
            for v_begin, v_count, blocks in super().__iter__():

                def record(blocks=blocks, v_count=v_count):
                    for r0, r1, dl, cols in blocks:
                        full = torch.as_strided(dl, (dl.shape[0], cols), dl.stride())
                        seen.append((v_count, r0, r1, full.clone()))
                        yield r0, r1, dl, cols

                yield v_begin, v_count, record()

    monkeypatch.setattr(tlin, "DlogitsChunks", Spy)  # where each mode's backward builds it
    monkeypatch.setattr(tdet, "DlogitsChunks", Spy)
    p = make_problem(128, 16, 1031, device=device, seed=3, padded_vocab=1152, temperature=0.9)
    targets = p.targets.clone()
    targets[70::5] = p.ignore_index  # ignored rows only in the second half (row blocks
    # without a dead row take no zeroing select in blocks that need none)
    h = p.hidden.detach().clone()
    h[70::5] = float("nan")  # an ignored row's hidden need not be finite
    h.requires_grad_()
    linear_logprob(
        h,
        p.weight,
        targets,
        return_entropy=True,
        vocab_size=1031,
        backend="triton",
        deterministic=deterministic,
    ).logprob.sum().backward()
    ignored = targets == p.ignore_index
    assert any(block.shape[1] > v_count for v_count, _, _, block in seen)
    for v_count, r0, r1, block in seen:
        dead = ignored[r0:r1]
        assert torch.equal(block[:, v_count:], torch.zeros_like(block[:, v_count:]))
        assert torch.equal(block[dead], torch.zeros_like(block[dead]))
        assert torch.isfinite(block[~dead, :v_count]).all()
