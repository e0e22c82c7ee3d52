"""Pinned launch configurations of the triton backend, device queries and launch options.

A tile config is part of the numerics: another tile is another summation order. So
configs are pinned per device class and input dtype (:func:`config_for`), never chosen
from N; the one width that follows a size is the forward's split, from the vocabulary's
width (:func:`split_width`). The tile sweep (``benchmarks/sweep_tiles.py``) times other configs by
passing one (``lp_kernels.backends.triton.function.linear_logprob_with_config``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from lp_kernels.core.types import LogprobParams


@dataclass(frozen=True)
class TileConfig:
    """Pinned launch configuration (part of the numerics: another tile is another order)."""

    block_n: int
    block_v: int
    block_h: int
    v_split: int
    vocab_chunk: int
    token_chunk: int
    mm_block_m: int
    mm_block_n: int
    mm_block_k: int
    num_warps: int
    num_stages: int
    group: int = 8
    """Row blocks per group of the launch order (L2 reuse; <= 0: all rows of the grid).
    Only the order in which tiles run: it never changes a result."""
    tma: bool = True
    """Load the GEMM operands with tensor descriptors (Hopper's bulk tensor copy) where
    :func:`tma_ok` allows; the same products and summation order as pointer loads."""
    narrow_cost: float = 0.575
    """The time of a program of the GEMM's narrow output tile (128 x 128) as a fraction of
    one of the pinned tile (128 x 256): :func:`~lp_kernels.backends.triton.gemm.mm_block_n`
    takes the narrow tile where that leaves fewer, cheaper waves. A launch choice only: both
    tiles give the same bits (docs/benchmarks.md has the measurement)."""
    round_group: int = 4
    """``deterministic=True`` with tiles wider than half a vocabulary chunk: up to how many
    tiles' fp32 products wait, each in its own ``[N, H]`` buffer, to be rounded into the
    int64 sum in one pass (``deterministic.round_slots``). Every tile is still rounded on
    its own, so the grouping never changes a bit."""
    loss_rows: int = 8192
    """``linear_logprob_loss``: at most this many rows per block of fp32 logits kept from
    the statistics pass to the gradient pass (fewer where the block would pass
    :data:`LOSS_LOGITS_BYTES`; within that bound a gradient block's rows are cut into the
    logits blocks that fill the GPU's waves best, ``loss.logits_blocks``). A row's
    outputs do not depend on it."""
    loss_grad_rows: int = 8192
    """``linear_logprob_loss``: at most this many rows per block of the two gradient GEMMs
    (a multiple of the logits blocks; fewer where its d_logits buffer would pass
    :data:`LOSS_GRAD_BYTES`). One block for all N needs no fp32 grad_weight accumulator."""
    loss_block: tuple[int, int, int] = (1, 1024, 16)
    """``(BLOCK_N, BLOCK_V, TILES)`` of ``linear_logprob_loss``'s elementwise d_logits
    kernel over the kept logits: each program covers ``TILES`` consecutive ``BLOCK_N x
    BLOCK_V`` tiles. A launch choice: every element's arithmetic is its own."""
    loss_bias_block: tuple[int, int, int] = (8, 512, 16)
    """The same kernel's block when it also sums the bias gradient's columns: one fp32 row
    of column sums per ``BLOCK_N`` rows, so ``BLOCK_N`` bounds that buffer."""
    loss_warps: int = 8
    """Warps of that kernel's programs (a launch choice, as ``loss_block``)."""
    narrow_split: int = 512
    """Columns per forward split (instead of ``v_split``) of a shard or ``deterministic=True``
    tile narrower than ``min_splits`` splits of ``v_split`` (:func:`split_width`); <= 0:
    never. Part of the numerics, as ``v_split``; it follows the vocabulary's width, never
    N."""
    min_splits: int = 32
    """See ``narrow_split``: at small N a row block's splits are the launch's programs, and
    a narrow shard (tensor parallel) with few wide splits leaves SMs idle."""
    pingpong_max_h: int = 0
    """The forward statistics of a default-mode call without entropy (capped or biased
    too) take the ping-pong kernel (``pingpong.pingpong_stats``) on Hopper where ``H`` is
    at most this; 0: never. A launch choice: both kernels give the same bits
    (docs/benchmarks.md has the measurements that set it)."""
    fixed_tiles: tuple[int, int, int] | None = None
    """``(BLOCK_M, BLOCK_N, BLOCK_K)`` of ``deterministic=True``'s fixed-point GEMM; None:
    the pinned ones for the device and dtype (``fixed_point.fixed_tiles_for``)."""


# Chosen by benchmarks/sweep_tiles.py on H200 (docs/benchmarks.md).
GPU_CONFIG = TileConfig(
    block_n=128, block_v=256, block_h=64, v_split=1024, vocab_chunk=8192, token_chunk=8192,
    mm_block_m=128, mm_block_n=256, mm_block_k=64, num_warps=8, num_stages=3,
    group=8, tma=True, pingpong_max_h=2048,
)  # fmt: skip
# Large blocks under the interpreter: its cost scales with the number of block operations.
INTERPRET_CONFIG = TileConfig(
    block_n=64, block_v=256, block_h=64, v_split=1024, vocab_chunk=2048, token_chunk=128,
    mm_block_m=64, mm_block_n=64, mm_block_k=256, num_warps=4, num_stages=1,
    group=2, tma=True, loss_rows=64, loss_grad_rows=128, loss_block=(64, 256, 2),
    loss_bias_block=(64, 256, 2), narrow_split=0,
)  # fmt: skip
LOSS_LOGITS_BYTES = 2 << 30
"""Budget of ``linear_logprob_loss``'s fp32 logits block (see ``TileConfig.loss_rows``)."""
LOSS_GRAD_BYTES = 4 << 30
"""Budget of its d_logits block (see ``TileConfig.loss_grad_rows``)."""


# GPUs with less shared memory per block than Hopper's 227 KiB (A100: 163 KiB; Ada and
# consumer Ampere: 99 KiB) take 128 x 128 tiles, without tensor descriptors; below
# 160 KiB with two pipeline stages. Untested there: lp's GPU runs are on H200.
LARGE_SMEM = 200 << 10
MID_SMEM = 160 << 10
_SMEM: dict[int, int] = {}
_SMS: dict[int, int] = {}


def smem_per_block(device: torch.device) -> int:
    """Opt-in shared memory per block of a CUDA device, in bytes (cached per device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMEM:
        props = torch.cuda.get_device_properties(index)
        smem = getattr(props, "shared_memory_per_block_optin", 0)
        if not smem:  # by compute capability (H100/H200: 227 KiB, A100: 163 KiB)
            smem = (227 << 10) if props.major >= 9 else (163 << 10)
        _SMEM[index] = int(smem)
    return _SMEM[index]


def sm_count(device: torch.device) -> int | None:
    """Streaming multiprocessors of a CUDA device (cached per device); None elsewhere (the
    interpreter has no waves of programs)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def gpu_tier(device: torch.device) -> str:
    """ "large" (Hopper-class shared memory: the pinned GPU_CONFIG), "mid" or "small"."""
    smem = smem_per_block(device)
    return "large" if smem >= LARGE_SMEM else "mid" if smem >= MID_SMEM else "small"


def config_for(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> TileConfig:
    """The pinned config for a device and input dtype: chosen by the device's shared
    memory and the dtype, never by a size. 4-byte inputs (exact fp32 dots: FMAs, not
    tensor cores) take :data:`FP32_TILES`."""
    if device.type == "cpu":
        return INTERPRET_CONFIG
    cfg = GPU_CONFIG
    tier = gpu_tier(device)
    if tier != "large":
        cfg = dataclasses.replace(
            cfg, block_v=128, mm_block_n=128, tma=False, num_stages=3 if tier == "mid" else 2
        )
    if dtype.itemsize > 2:
        cfg = dataclasses.replace(cfg, **FP32_TILES)
    return cfg


# 4-byte inputs. ``input_precision="ieee"`` makes Triton compile their dots to FMAs, where a
# 128 x 256 fp32 tile with K steps of 32 needs far more than 255 registers and spills to a
# stack frame; 64 x 128 tiles with K steps of 16 fit the register file with no stack frame
# (``python -m lp_testing.aot`` prints both).
FP32_TILES = {
    "block_n": 64, "block_v": 128, "block_h": 16,
    "mm_block_m": 64, "mm_block_n": 128, "mm_block_k": 16,
}  # fmt: skip


def split_width(cols: int, cfg: TileConfig) -> int:
    """Columns per forward split of a ``cols``-wide vocabulary (the widest shard of the
    group, or a ``deterministic=True`` tile): ``cfg.v_split``, or ``cfg.narrow_split``
    where that would leave fewer than ``cfg.min_splits`` splits. A function of the
    vocabulary's width and the config only: every N, and every rank of a group, splits
    alike."""
    if cfg.narrow_split <= 0 or triton.cdiv(cols, cfg.v_split) >= cfg.min_splits:
        return cfg.v_split
    return cfg.narrow_split


def tma_ok(*tensors: torch.Tensor) -> bool:
    """Whether every 2-D tensor can back a tensor descriptor: unit last stride, 16-byte
    aligned base and row stride, no empty dimension."""
    for t in tensors:
        size = t.element_size()
        if t.dim() != 2 or t.stride(1) != 1 or 0 in t.shape:
            return False
        if t.data_ptr() % 16 or (t.stride(0) * size) % 16:
            return False
    return True


def descriptor(t: torch.Tensor, rows: int, cols: int, block: tuple[int, int]):
    """A tensor descriptor over ``rows x cols`` elements from ``t``'s base with its row
    stride (it may reach past ``t``'s view into the same buffer: padded columns)."""
    return TensorDescriptor(t, [rows, cols], [t.stride(0), 1], list(block))


def group_size(cfg: TileConfig, blocks_m: int) -> int:
    return blocks_m if cfg.group <= 0 else min(cfg.group, max(blocks_m, 1))


def logit_flags(hidden: torch.Tensor, cfg: TileConfig) -> dict:
    """Constexpr flags of the two logit-tile kernels (forward statistics, d_logits)."""
    return {
        "EVEN_H": hidden.shape[1] % cfg.block_h == 0,
        "INTERPRET": hidden.device.type == "cpu",
        "PRECISION": "ieee",
    }


# Multiply-adds contract to FMAs in every kernel, as Triton has always compiled them by
# default; pinned because Triton 3.9 warns that 3.10 turns that default off, which would
# change the bits (and the speed) of every kernel with a Triton upgrade.
FP_FUSION = True


def compile_opts(device: torch.device) -> dict:
    """Compile options every GPU launch pins (none under the interpreter)."""
    return {} if device.type == "cpu" else {"enable_fp_fusion": FP_FUSION}


def launch_opts(cfg: TileConfig, device: torch.device) -> dict:
    """``num_warps``, ``num_stages`` and :func:`compile_opts` of a GPU launch (none on CPU)."""
    if device.type == "cpu":
        return {}
    return {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, **compile_opts(device)}


def pad128(x: int) -> int:
    """``x`` rounded up to a multiple of 128 (a bound that specializes alike everywhere)."""
    return triton.cdiv(x, 128) * 128


def cap_args(p: LogprobParams) -> tuple[float, float]:
    """``(cap, 1 / cap)`` of the kernels' ``SOFTCAP`` path (unused without a cap)."""
    return (
        (p.transform.softcap, 1.0 / p.transform.softcap)
        if p.transform.softcap is not None
        else (1.0, 1.0)
    )
