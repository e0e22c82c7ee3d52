"""Token chunks of the torch paths: rows per chunk, and the chunk loop.

Every chunk of a call has the same number of rows (the last one zero-padded), at least 16:
BLAS picks other kernels for a few rows (MKL's GEMV path for one or two rows changes the
bits), so one block shape per call keeps a row's bits independent of N on CPU. The rows per
chunk follow the shard width and the device, never N.
"""

from __future__ import annotations

import torch

_SCRATCH_BYTES = {"cuda": 1 << 30, "cpu": 1 << 27}
_MIN_ROWS = 16
_MAX_ROWS = {"cuda": 4096, "cpu": 256}


def default_chunk_rows(v_real: int, device: torch.device) -> int:
    """Rows per chunk: a power of two keeping one fp32 [C, V_r] buffer within budget.

    Depends on the shard width and device only, never on the token count.
    """
    kind = "cuda" if device.type == "cuda" else "cpu"
    rows = _SCRATCH_BYTES[kind] // (4 * max(v_real, 1))
    rows = 1 << max(rows.bit_length() - 1, 0)
    return max(_MIN_ROWS, min(rows, _MAX_ROWS[kind]))


def padded_rows(
    x: torch.Tensor, r0: int, r1: int, rows: int, fill: float | bool = 0
) -> torch.Tensor:
    """Rows ``[r0, r1)`` of ``x`` padded with ``fill`` to ``rows`` rows (a view if unpadded)."""
    if r1 - r0 == rows:
        return x[r0:r1]
    out = torch.full((rows, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)
    out[: r1 - r0] = x[r0:r1]
    return out


def block_rows(n: int, chunk: int) -> int:
    """Rows of every block of ``n`` token rows under a ``chunk``: ``chunk`` (at least 16)
    when ``n`` fills it, else ``n`` rounded up to a power of two (at least 16, at most the
    chunk). So the scratch is bounded by ``min(n, chunk)`` rows (up to 2 x, or 16 rows),
    whatever ``chunk_size`` says, and one call has one block shape."""
    chunk = max(chunk, _MIN_ROWS)  # BLAS takes other code paths for a few rows
    if n >= chunk:
        return chunk
    return min(chunk, max(_MIN_ROWS, 1 << max(n - 1, 0).bit_length()))


def chunks(n: int, chunk: int):
    """``(r0, r1, rows)`` for each block; every block is padded to ``rows`` rows
    (:func:`block_rows`)."""
    rows = block_rows(n, chunk)
    for r0 in range(0, n, rows):
        yield r0, min(n, r0 + rows), rows


CHUNK_COLUMNS = 16384
"""``vocab_parallel_logprob(deterministic=True)``: the columns of one vocabulary chunk of its
reductions (:func:`chunk_tiles` whole tiles)."""


def chunk_tiles(tile: int) -> int:
    """Tiles per vocabulary chunk of :data:`CHUNK_COLUMNS` columns (at least one)."""
    return max(1, CHUNK_COLUMNS // tile)
