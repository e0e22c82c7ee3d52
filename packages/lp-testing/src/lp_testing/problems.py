"""Random LM-head problems, awkward shapes, vocabulary shards and per-dtype tolerances.

A problem is what ``linear_logprob`` takes: ``hidden [*, H]``, ``weight [V_pad, H]`` and
``targets [*]``, plus the options that change the math (temperature, ignore_index, the
real vocabulary size V <= V_pad).

Magnitudes follow a real LM head: ``hidden ~ N(0, 1)`` and ``weight ~ N(0, scale^2 / H)``,
so each logit ``h . w`` is ~ ``N(0, scale^2)``: a few units, with a maximum of 10-15 over a
large vocabulary. Everything is drawn in float32 from seeded generators and then cast, so
the same seed gives the same problem (up to rounding) in every dtype; hidden, weight and
targets each have their own generator, so changing N does not change the weight.

Megatron pads the vocabulary so that it divides evenly over tensor-parallel ranks; rows
``[V, V_pad)`` of the weight are padding and must be excluded from every output. Here the
padding rows are drawn 4x larger than real rows, so that their logits would dominate the
log-sum-exp: a kernel that forgets to mask them fails loudly, not by a rounding error.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import Tensor

__all__ = [
    "AWKWARD_SHAPES",
    "DTYPES",
    "PADDING_SCALE",
    "Problem",
    "Shape",
    "Tolerance",
    "make_problem",
    "nan_tensor",
    "random_upstream",
    "shard",
    "split_vocab",
    "tolerance",
]

PADDING_SCALE: float = 4.0
"""Padding weight rows are this many times larger than real rows (see module docstring)."""

# Offsets that give hidden, weight, targets and upstream gradients independent streams.
_STREAM_HIDDEN, _STREAM_WEIGHT, _STREAM_TARGETS, _STREAM_UPSTREAM = range(4)


def _generator(seed: int, stream: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 4 + stream)
    return gen


@dataclass(frozen=True)
class Problem:
    """One ``linear_logprob`` problem.

    Attributes:
        hidden: ``[*, H]`` float32 | bfloat16 | float16.
        weight: ``[V_pad, H]``, same dtype; rows ``>= vocab_size`` are padding.
        targets: ``[*]`` int64, in ``[0, vocab_size)`` or equal to ``ignore_index``.
        vocab_size: the real vocabulary V (<= V_pad).
        temperature: logits are ``hidden @ weight.T / temperature``.
        ignore_index: target value of rows whose outputs and gradients are zero.
        seed: the seed the problem was drawn from.
    """

    hidden: Tensor
    weight: Tensor
    targets: Tensor
    vocab_size: int
    temperature: float = 1.0
    ignore_index: int = -100
    seed: int = 0

    @property
    def n(self) -> int:
        """Number of rows (tokens), N = targets.numel()."""
        return self.targets.numel()

    @property
    def h(self) -> int:
        """Hidden size H."""
        return self.hidden.shape[-1]

    @property
    def v(self) -> int:
        """Real vocabulary size V."""
        return self.vocab_size

    @property
    def v_padded(self) -> int:
        """Number of weight rows V_pad (>= V)."""
        return self.weight.shape[0]

    @property
    def ignored(self) -> Tensor:
        """``[*]`` bool, True on rows whose target is ``ignore_index``."""
        return self.targets == self.ignore_index

    @property
    def id(self) -> str:
        """Readable id, e.g. ``N37-H64-V1009-pad1024-bf16``."""
        pad = f"-pad{self.v_padded}" if self.v_padded != self.vocab_size else ""
        dt = str(self.hidden.dtype).removeprefix("torch.")
        return f"N{self.n}-H{self.h}-V{self.vocab_size}{pad}-{dt}"

    def op_kwargs(self) -> dict[str, float | int]:
        """Keyword arguments that carry the problem's math options to the op and references.

        Returns:
            ``{"temperature", "ignore_index", "vocab_size"}``.
        """
        return {
            "temperature": self.temperature,
            "ignore_index": self.ignore_index,
            "vocab_size": self.vocab_size,
        }

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> Problem:
        """Copy to another device and/or cast hidden and weight to ``dtype``."""
        return dataclasses.replace(
            self,
            hidden=self.hidden.to(device=device, dtype=dtype),
            weight=self.weight.to(device=device, dtype=dtype),
            targets=self.targets.to(device=device),
        )

    def with_grad(self) -> Problem:
        """Fresh leaf copies of hidden and weight with ``requires_grad=True``."""
        return dataclasses.replace(
            self,
            hidden=self.hidden.detach().clone().requires_grad_(True),
            weight=self.weight.detach().clone().requires_grad_(True),
        )

    def upstream(self, seed: int | None = None) -> dict[str, Tensor]:
        """Random per-row upstream gradients for the three outputs.

        Args:
            seed: defaults to the problem's seed.

        Returns:
            ``{"grad_logprob", "grad_entropy", "grad_lse"}``, each ``[*]`` float32 on the
            problem's device, nonzero on ignored rows too (the op must ignore them).
        """
        seed = self.seed if seed is None else seed
        device = self.targets.device
        g = random_upstream((3, *self.targets.shape), seed=seed, device=device)
        return {"grad_logprob": g[0], "grad_entropy": g[1], "grad_lse": g[2]}


def random_upstream(
    shape: Sequence[int], *, seed: int = 0, device: torch.device | str = "cpu"
) -> Tensor:
    """A random float32 upstream gradient ``~ N(0, 1)`` (drawn on CPU, then moved)."""
    gen = _generator(seed, _STREAM_UPSTREAM, torch.device("cpu"))
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float32).to(device)


def _ignored_rows(n: int, frac: float, gen: torch.Generator) -> Tensor:
    """Indices of the rows to ignore: round(frac * n), at least 1 (n > 1), at most n - 1."""
    count = round(frac * n)
    if frac > 0 and n > 1:
        count = max(count, 1)
    if frac < 1:
        count = min(count, n - 1)
    return torch.randperm(n, generator=gen)[:count]


def make_problem(
    n: int | Sequence[int],
    h: int,
    v: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    ignore_frac: float = 0.0,
    ignore_index: int = -100,
    padded_vocab: int | None = None,
    temperature: float = 1.0,
    scale: float = 3.0,
) -> Problem:
    """Draw a random problem with realistic LM-head magnitudes.

    Args:
        n: number of tokens N, or a leading shape such as ``(B, S)``.
        h: hidden size H.
        v: real vocabulary size V (targets are drawn from ``[0, V)``).
        dtype: dtype of hidden and weight.
        device: where the tensors live. On CPU the draw is device-independent; on other
            devices hidden and weight are drawn there (fast for benchmark shapes), so the
            values depend on the device type.
        seed: everything is a deterministic function of the seed.
        ignore_frac: fraction of rows whose target is ``ignore_index``; when > 0 and N > 1
            at least one row is ignored, and unless it is 1.0 at least one row is not.
        ignore_index: the value used for ignored targets; a real token id is allowed
            (then every row whose drawn target equals it is ignored too).
        padded_vocab: number of weight rows V_pad >= V; rows ``[V, V_pad)`` are Megatron
            padding (drawn large, see module docstring). None means V_pad = V.
        temperature: stored in the problem, for the op and the references.
        scale: standard deviation of the raw logits ``h . w``.

    Returns:
        The problem. The first non-ignored row targets column 0 and the last one targets
        column V - 1 (the last real column); a single row targets V - 1.

    Example:
        >>> p = make_problem(37, 64, 1009, padded_vocab=1024, ignore_frac=0.25)
        >>> p.hidden.shape, p.weight.shape, int(p.ignored.sum())
        (torch.Size([37, 64]), torch.Size([1024, 64]), 9)
    """
    lead = (n,) if isinstance(n, int) else tuple(n)
    n_rows = math.prod(lead)
    v_pad = v if padded_vocab is None else padded_vocab
    if h < 1 or v < 1 or n_rows < 0:
        raise ValueError(f"make_problem: need N >= 0, H >= 1, V >= 1; got {lead}, {h}, {v}")
    if v_pad < v:
        raise ValueError(f"make_problem: padded_vocab ({v_pad}) must be >= v ({v})")
    if not 0.0 <= ignore_frac <= 1.0:
        raise ValueError(f"make_problem: ignore_frac must be in [0, 1], got {ignore_frac}")
    device = torch.device(device)
    gen_device = device if device.type != "meta" else torch.device("cpu")

    gen_h = _generator(seed, _STREAM_HIDDEN, gen_device)
    hidden = torch.randn((n_rows, h), generator=gen_h, device=gen_device)
    gen_w = _generator(seed, _STREAM_WEIGHT, gen_device)
    weight = torch.randn((v_pad, h), generator=gen_w, device=gen_device) * (scale / math.sqrt(h))
    weight[v:] *= PADDING_SCALE

    gen_t = _generator(seed, _STREAM_TARGETS, torch.device("cpu"))
    targets = torch.randint(0, v, (n_rows,), generator=gen_t, dtype=torch.int64)
    ignored = _ignored_rows(n_rows, ignore_frac, gen_t)
    targets[ignored] = ignore_index
    kept = (targets != ignore_index).nonzero().flatten()
    if kept.numel() > 0:
        targets[kept[0]] = 0
        targets[kept[-1]] = v - 1  # wins when one row is kept: the last column is the edge

    return Problem(
        hidden=hidden.to(device=device, dtype=dtype).reshape(*lead, h),
        weight=weight.to(device=device, dtype=dtype),
        targets=targets.to(device).reshape(lead),
        vocab_size=v,
        temperature=temperature,
        ignore_index=ignore_index,
        seed=seed,
    )


def nan_tensor(
    shape: Sequence[int],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Tensor:
    """A tensor filled with NaN, to poison scratch or output buffers.

    An element that a kernel forgets to write then shows up as NaN in the result. Integer
    dtypes have no NaN; they are filled with their largest value instead.
    """
    if dtype.is_floating_point or dtype.is_complex:
        fill: float | int = math.nan
    elif dtype == torch.bool:
        fill = True
    else:
        fill = torch.iinfo(dtype).max
    return torch.full(tuple(shape), fill, dtype=dtype, device=device)


# ----------------------------------------------------------------------------------------
# Vocabulary shards


def _apportion(units: int, weights: Sequence[int]) -> list[int]:
    """Split ``units`` (>= len(weights)) into positive parts ~ proportional to ``weights``.

    Floors of the exact shares, raised to 1; then the remainder goes by largest fractional
    part (ties: lower rank), or the excess is taken back from the largest parts.
    """
    total = sum(weights)
    exact = [units * w / total for w in weights]
    counts = [max(1, math.floor(x)) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - math.floor(exact[i])), i))
    for i in order[: max(0, units - sum(counts))]:
        counts[i] += 1
    while sum(counts) > units:
        counts[counts.index(max(counts))] -= 1
    return counts


def split_vocab(
    v: int,
    world_size: int,
    *,
    mode: Literal["even", "uneven"] = "even",
    multiple: int = 1,
) -> list[tuple[int, int]]:
    """Cut ``[0, v)`` into ``world_size`` contiguous, non-empty shards.

    Shards are counted in units of ``multiple`` (a kernel's vocabulary tile, say): every
    internal bound is a multiple of ``multiple``; only the last shard may end off the grid,
    at ``v``. Split the weight's row count (V_pad, padding included) when sharding a head.

    Args:
        v: number of columns (weight rows) to split.
        world_size: number of shards P.
        mode: ``"even"``: sizes differ by at most one unit (Megatron-style when
            ``v = P * multiple * k``). ``"uneven"``: shard r gets a share ~ ``r + 1`` (the
            last rank holds the most), still every shard non-empty.
        multiple: granularity of the bounds.

    Returns:
        ``[(start, size), ...]`` in rank order; starts are increasing and the shards cover
        ``[0, v)`` exactly.

    Raises:
        ValueError: fewer than ``world_size`` units, or bad arguments.

    Example:
        >>> split_vocab(1009, 2)
        [(0, 505), (505, 504)]
        >>> split_vocab(1000, 3, mode="uneven", multiple=64)
        [(0, 192), (192, 320), (512, 488)]
    """
    if world_size < 1 or multiple < 1 or v < 0:
        raise ValueError(
            f"split_vocab: need v >= 0, world_size >= 1, multiple >= 1; got {v}, "
            f"{world_size}, {multiple}"
        )
    if mode not in ("even", "uneven"):
        raise ValueError(f"split_vocab: mode must be 'even' or 'uneven', got {mode!r}")
    units = -(-v // multiple)
    if units < world_size:
        raise ValueError(
            f"split_vocab: cannot cut {v} columns into {world_size} non-empty shards on a grid "
            f"of {multiple} (only {units} units); use a smaller multiple or fewer ranks"
        )
    weights = [1] * world_size if mode == "even" else [r + 1 for r in range(world_size)]
    counts = _apportion(units, weights)
    bounds: list[tuple[int, int]] = []
    start = 0
    for count in counts:
        end = min(start + count * multiple, v)
        bounds.append((start, end - start))
        start = end
    return bounds


def shard(tensor: Tensor, bounds: Sequence[tuple[int, int]], rank: int, *, dim: int = 0) -> Tensor:
    """Rank ``rank``'s slice of ``tensor`` along ``dim`` (a view, not a copy).

    Args:
        tensor: e.g. the full weight ``[V_pad, H]`` (``dim=0``) or full logits
            ``[*, V_pad]`` (``dim=-1``).
        bounds: from :func:`split_vocab`.
        rank: which shard.
        dim: the vocabulary dimension.

    Returns:
        ``tensor.narrow(dim, start, size)``. Call ``.detach().clone()`` for an independent
        leaf (e.g. a rank's own parameter).
    """
    start, size = bounds[rank]
    return tensor.narrow(dim, start, size)


# ----------------------------------------------------------------------------------------
# Shapes and dtypes for parametrized tests


class Shape(NamedTuple):
    """A problem size (N tokens, H hidden, V vocab); ``str()`` gives a readable test id."""

    n: int
    h: int
    v: int

    @property
    def id(self) -> str:
        return f"N{self.n}-H{self.h}-V{self.v}"

    def __str__(self) -> str:
        return self.id


AWKWARD_SHAPES: tuple[Shape, ...] = (
    Shape(1, 17, 31),  # a single row
    Shape(5, 3, 7),  # tiny H and V: most of every tile is masked
    Shape(7, 13, 257),  # V = 2^8 + 1: one column into a new tile
    Shape(16, 64, 127),  # V one short of a power of two
    Shape(37, 64, 1009),  # primes
    Shape(252, 507, 123),  # odd H larger than V
    Shape(128, 33, 4099),  # prime V, H = 32 + 1
    Shape(64, 128, 4097),  # V = 2^12 + 1
    Shape(1151, 16, 97),  # many rows (prime), few columns
)
"""Small awkward sizes (CPU friendly); use ``ids=str`` in ``pytest.mark.parametrize``."""


@dataclass(frozen=True)
class Tolerance:
    """How close a result in ``dtype`` must be to the fp64 truth.

    Used with :func:`lp_testing.compare.assert_close` and a materialized-logits baseline:
    ``max|ours - truth| <= k * max|baseline - truth| + atol + rtol * max|truth|``.

    Attributes:
        dtype: input dtype of hidden and weight.
        k: allowed multiple of the baseline's max abs error.
        atol: absolute floor (for when the baseline happens to be exact).
        rtol: floor relative to ``max|truth|``.
    """

    dtype: torch.dtype
    k: float
    atol: float
    rtol: float

    @property
    def id(self) -> str:
        return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
            self.dtype, str(self.dtype).removeprefix("torch.")
        )

    def kwargs(self) -> dict[str, float]:
        """``{"k", "atol", "rtol"}`` for :func:`lp_testing.compare.assert_close`."""
        return {"k": self.k, "atol": self.atol, "rtol": self.rtol}

    def __str__(self) -> str:
        return self.id


DTYPES: tuple[Tolerance, ...] = (
    Tolerance(torch.float32, k=4.0, atol=1e-6, rtol=2e-6),
    Tolerance(torch.bfloat16, k=2.0, atol=1e-5, rtol=8e-3),
    Tolerance(torch.float16, k=2.0, atol=1e-6, rtol=1e-3),
)
"""Input dtypes with their tolerances; use ``ids=str`` in ``pytest.mark.parametrize``."""


def tolerance(dtype: torch.dtype) -> Tolerance:
    """The :data:`DTYPES` entry for ``dtype``."""
    for tol in DTYPES:
        if tol.dtype == dtype:
            return tol
    raise KeyError(f"no tolerance for {dtype}; known: {[str(t) for t in DTYPES]}")
