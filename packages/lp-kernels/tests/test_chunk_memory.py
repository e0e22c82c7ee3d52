"""``chunk_size`` bounds the torch paths' scratch by ``min(N, chunk_size)`` rows.

A block of the torch paths used to be padded to ``chunk_size`` rows whatever N: N = 4 with
``chunk_size=2**20`` allocated about 0.5 GiB at V = 128 (16 GiB at V = 4096). The meter
below is a ``TorchDispatchMode`` that sums the bytes of every storage the call allocates
(and refuses, before allocating, a factory call over its limit, so that the unfixed code
fails here instead of exhausting the machine).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lp_kernels import linear_logprob, vocab_parallel_logprob

aten = torch.ops.aten
_FACTORIES = {  # op -> index of its size argument
    aten.empty.memory_format: 0,
    aten.empty_strided.default: 0,
    aten.zeros.default: 0,
    aten.ones.default: 0,
    aten.full.default: 0,
    aten.new_empty.default: 1,
    aten.new_zeros.default: 1,
    aten.new_full.default: 1,
    aten.new_empty_strided.default: 1,
}
LIMIT = 64 << 20  # no single allocation of these tiny calls needs more


class AllocationMeter(TorchDispatchMode):
    """Sums the bytes of the storages created under it (views and in-place ops add none)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FACTORIES:
            numel = 1
            for d in args[_FACTORIES[func]]:
                numel *= int(d)
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            if numel * dtype.itemsize > LIMIT:
                raise MemoryError(f"{func} asks for {numel * dtype.itemsize} bytes")
        ins = {
            t.untyped_storage().data_ptr()
            for t in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        out = func(*args, **kwargs)
        seen: set[int] = set()  # storages new to this op (a freed address may come back)
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if ptr and ptr not in ins and ptr not in seen:
                    seen.add(ptr)
                    self.total += storage.nbytes()
                    self.largest = max(self.largest, storage.nbytes())
        return out


N, H, V = 4, 16, 300


def _linear(chunk_size, deterministic):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, H, generator=g).requires_grad_()
    w = torch.randn(V, H, generator=g).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g)

    def call():
        out = linear_logprob(
            h, w, t, return_entropy=True, backend="torch", chunk_size=chunk_size,
            deterministic=deterministic, deterministic_tile=128 if deterministic else None,
        )  # fmt: skip
        (out.logprob + out.entropy).sum().backward()

    return call


def _logits(chunk_size, deterministic):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, V, generator=g).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g)

    def call():
        out = vocab_parallel_logprob(
            x, t, return_entropy=True, chunk_size=chunk_size, deterministic=deterministic
        )
        (out.logprob + out.entropy).sum().backward()

    return call


def _measure(call) -> AllocationMeter:
    meter = AllocationMeter()
    with meter:
        call()
    return meter


@pytest.mark.parametrize("make", [_linear, _logits], ids=["linear_logprob", "logits"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_huge_chunk_size_allocates_as_a_small_one(make, deterministic):
    """N = 4, chunk_size = 2**20: the bytes of chunk_size = 16 (one 16-row block; a few
    bytes of scalars aside)."""
    huge = _measure(make(2**20, deterministic))
    small = _measure(make(16, deterministic))
    assert huge.total <= small.total + 1024, (huge.total, small.total)
    # one block of 16 rows: about 16 x V_local x 4 bytes per buffer (the deterministic
    # logits path: a group of 16384 columns), far from 2**20 rows
    assert huge.largest <= 16 * 16384 * 4, huge.largest


def test_block_rows_follow_min_n_and_chunk():
    from lp_kernels.core.chunks import block_rows

    assert block_rows(4, 2**20) == 16
    assert block_rows(100, 2**20) == 128
    assert block_rows(100, 64) == 64
    assert block_rows(100, 100) == 100
    assert block_rows(90, 100) == 100  # the next power of two, capped at the chunk
    assert block_rows(0, 256) == 16
    assert block_rows(3, 1) == 16
