"""Launch configuration of the triton backend: one frozen config per phase, pinned per
device class and input dtype, device queries and launch options.

A block size is part of the numerics: another block is another summation order. So configs
are pinned (:func:`config_for`), never chosen from N; the one width that follows a size is
the forward's split, from the vocabulary's width (``plan.split_width``). A tile sweep or a
test runs lp's public ops under another config inside :func:`use_config`, the one tuning
hook: a call takes the config current at its forward, for its backward too.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor


@dataclass(frozen=True)
class LogitsConfig:
    """The logits blocks of the forward statistics and d_logits kernels."""

    block_n: int
    """Rows of a block."""
    block_v: int
    """Columns of a block."""
    block_h: int
    """The K step of the block's GEMM."""
    num_warps: int
    """Warps of a program."""
    num_stages: int
    """Pipeline stages of the K loop."""


@dataclass(frozen=True)
class ForwardConfig:
    """The forward statistics' splits and kernel choice."""

    v_split: int
    """Columns per split (one partial per row and split)."""
    narrow_split: int = 512
    """Columns per split (instead of ``v_split``) of a shard or ``deterministic=True`` tile
    narrower than ``min_splits`` splits of ``v_split`` (``plan.split_width``); <= 0: never.
    Part of the numerics, as ``v_split``; it follows the vocabulary's width, never N."""
    min_splits: int = 32
    """See ``narrow_split``: at small N a row block's splits are the launch's programs, and
    a narrow shard with few wide splits leaves SMs idle."""
    pingpong_max_h: int = 0
    """Calls without entropy in the default mode take the ping-pong kernel on Hopper where
    ``H`` is at most this; 0: never. A launch choice: both kernels give the same bits."""


@dataclass(frozen=True)
class BackwardConfig:
    """The backward's bounded d_logits scratch."""

    vocab_chunk: int
    """Columns of a vocabulary chunk."""
    token_chunk: int
    """Rows of a token chunk."""


@dataclass(frozen=True)
class GemmConfig:
    """lp's fp32-accumulating GEMM (grad_hidden; grad_weight where cuBLAS would break an
    invariance) and its fixed-point variant."""

    block_m: int
    block_n: int
    """Output block width; :func:`~lp_kernels.backends.triton.plan.mm_block_n` may halve
    it (the same bits)."""
    block_k: int
    num_warps: int
    num_stages: int
    narrow_cost: float = 0.575
    """The time of a program of the narrow output block as a fraction of one of the pinned
    block's: the narrow block is taken where that leaves fewer, cheaper waves. A launch
    choice only (docs/history.md has the measurement)."""


@dataclass(frozen=True)
class LossConfig:
    """``linear_logprob_loss``'s chunks and its d_logits kernel over kept logits."""

    rows: int = 8192
    """At most this many rows per chunk of fp32 logits kept from the statistics pass to the
    gradient pass (fewer where the chunk would pass :data:`LOSS_LOGITS_BYTES`). A row's
    outputs do not depend on it."""
    grad_rows: int = 8192
    """At most this many rows per chunk of the two gradient GEMMs (a multiple of the logits
    chunks; fewer where its d_logits would pass :data:`LOSS_GRAD_BYTES`)."""
    block: tuple[int, int, int] = (1, 1024, 16)
    """``(BLOCK_N, BLOCK_V, BLOCKS)`` of the d_logits kernel: each program covers ``BLOCKS``
    consecutive ``BLOCK_N x BLOCK_V`` blocks. A launch choice."""
    bias_block: tuple[int, int, int] = (8, 512, 16)
    """The same when it also sums the bias gradient's columns (one fp32 row of column sums
    per ``BLOCK_N`` rows)."""
    num_warps: int = 8
    num_stages: int = 1


@dataclass(frozen=True)
class DeterministicConfig:
    """``deterministic=True``'s fixed-point sum of grad_hidden."""

    round_tiles: int = 4
    """Tiles wider than half a vocabulary chunk: up to how many tiles' fp32 products wait,
    each in its own ``[N, H]`` buffer, to be rounded into the int64 sum in one pass. Every
    tile is still rounded on its own, so this never changes a bit."""
    fixed_blocks: tuple[int, int, int] | None = None
    """``(BLOCK_M, BLOCK_N, BLOCK_K)`` of the fixed-point GEMM; None: the pinned ones for the
    device and dtype (``fixed_point.fixed_blocks_for``)."""


@dataclass(frozen=True)
class KernelConfig:
    """Every phase's launch configuration."""

    logits: LogitsConfig
    forward: ForwardConfig
    backward: BackwardConfig
    gemm: GemmConfig
    loss: LossConfig = LossConfig()
    deterministic: DeterministicConfig = DeterministicConfig()
    swizzle: int = 8
    """Row blocks per band of the launch order (L2 reuse; <= 0: all rows of the grid). Only
    the order in which blocks run: it never changes a result."""
    tma: bool = True
    """Load the GEMM operands with tensor descriptors (Hopper's bulk tensor copy) where
    :func:`tma_ok` allows; the same products and summation order as pointer loads."""

    def replace(self, **phases: dict[str, Any] | Any) -> KernelConfig:
        """A copy with fields of phases replaced: ``cfg.replace(logits={"block_v": 128},
        tma=False)``."""
        changes: dict[str, Any] = {}
        for name, value in phases.items():
            if isinstance(value, dict):
                value = dataclasses.replace(getattr(self, name), **value)
            changes[name] = value
        return dataclasses.replace(self, **changes)


# Chosen by the tile sweep on H200 (docs/history.md).
GPU_CONFIG = KernelConfig(
    logits=LogitsConfig(block_n=128, block_v=256, block_h=64, num_warps=8, num_stages=3),
    forward=ForwardConfig(v_split=1024, pingpong_max_h=2048),
    backward=BackwardConfig(vocab_chunk=8192, token_chunk=8192),
    gemm=GemmConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3),
)
# Large blocks under the interpreter: its cost scales with the number of block operations.
INTERPRET_CONFIG = KernelConfig(
    logits=LogitsConfig(block_n=64, block_v=256, block_h=64, num_warps=4, num_stages=1),
    forward=ForwardConfig(v_split=1024, narrow_split=0),
    backward=BackwardConfig(vocab_chunk=2048, token_chunk=128),
    gemm=GemmConfig(block_m=64, block_n=64, block_k=256, num_warps=4, num_stages=1),
    loss=LossConfig(rows=64, grad_rows=128, block=(64, 256, 2), bias_block=(64, 256, 2)),
    swizzle=2,
)
# 4-byte inputs. ``input_precision="ieee"`` makes Triton compile their dots to FMAs, where a
# 128 x 256 fp32 block with K steps of 32 needs far more than 255 registers and spills;
# 64 x 128 blocks with K steps of 16 fit the register file (``python -m lp_testing.aot``).
FP32_LOGITS = {"block_n": 64, "block_v": 128, "block_h": 16}
FP32_GEMM = {"block_m": 64, "block_n": 128, "block_k": 16}
LOSS_LOGITS_BYTES = 2 << 30
"""Budget of ``linear_logprob_loss``'s fp32 logits chunk (see ``LossConfig.rows``)."""
LOSS_GRAD_BYTES = 4 << 30
"""Budget of its d_logits chunk (see ``LossConfig.grad_rows``)."""

# GPUs with less shared memory per block than Hopper's 227 KiB (A100: 163 KiB; Ada and
# consumer Ampere: 99 KiB) take 128 x 128 blocks, without tensor descriptors; below
# 160 KiB with two pipeline stages. Untested there: lp's GPU runs are on H100 and H200.
LARGE_SMEM = 200 << 10
MID_SMEM = 160 << 10
_SMEM: dict[int, int] = {}
_SMS: dict[int, int] = {}
_OVERRIDE: contextvars.ContextVar[KernelConfig | None] = contextvars.ContextVar(
    "lp_kernel_config", default=None
)


@contextlib.contextmanager
def use_config(config: KernelConfig) -> Iterator[KernelConfig]:
    """Inside, the triton backend's calls run under ``config`` instead of the pinned one
    (:func:`config_for`): the one tuning hook (tile sweeps, tests). Another block size is
    another summation order, so the bits are those of ``config``; launch choices (swizzle,
    TMA, the narrow GEMM block, ...) never change them. A call keeps the config current at
    its forward for its backward."""
    if not isinstance(config, KernelConfig):
        raise TypeError(f"config must be a KernelConfig, got {type(config).__name__}")
    token = _OVERRIDE.set(config)
    try:
        yield config
    finally:
        _OVERRIDE.reset(token)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def smem_per_block(device: torch.device) -> int:
    """Opt-in shared memory per block of a CUDA device, in bytes (cached per device)."""
    index = _index(device)
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
    index = _index(device)
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def gpu_tier(device: torch.device) -> str:
    """ "large" (Hopper-class shared memory: the pinned GPU_CONFIG), "mid" or "small"."""
    smem = smem_per_block(device)
    return "large" if smem >= LARGE_SMEM else "mid" if smem >= MID_SMEM else "small"


def config_for(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> KernelConfig:
    """The config of a call on ``device`` with inputs of ``dtype``: the one :func:`use_config`
    set, else the pinned one, chosen by the device's shared memory and the dtype, never by a
    size. 4-byte inputs (exact fp32 dots: FMAs, not tensor cores) take narrower blocks."""
    override = _OVERRIDE.get()
    if override is not None:
        return override
    if device.type == "cpu":
        return INTERPRET_CONFIG
    cfg = GPU_CONFIG
    tier = gpu_tier(device)
    if tier != "large":
        stages = 3 if tier == "mid" else 2
        cfg = cfg.replace(
            logits={"block_v": 128, "num_stages": stages},
            gemm={"block_n": 128, "num_stages": stages},
            tma=False,
        )
    if dtype.itemsize > 2:
        cfg = cfg.replace(logits=FP32_LOGITS, gemm=FP32_GEMM)
    return cfg


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


def swizzle_rows(cfg: KernelConfig, blocks_m: int) -> int:
    """Row blocks per band of a launch of ``blocks_m`` row blocks (:attr:`KernelConfig.swizzle`)."""
    return blocks_m if cfg.swizzle <= 0 else min(cfg.swizzle, max(blocks_m, 1))


def even_h(hidden: torch.Tensor, cfg: KernelConfig) -> bool:
    """Whether ``H`` is a multiple of the logits blocks' K step (no K mask in their loads)."""
    return hidden.shape[1] % cfg.logits.block_h == 0


# Multiply-adds contract to FMAs in every kernel, as Triton has always compiled them by
# default; pinned because Triton 3.9 warns that 3.10 turns that default off, which would
# change the bits (and the speed) of every kernel with a Triton upgrade.
FP_FUSION = True


def compile_opts(device: torch.device) -> dict:
    """Compile options every GPU launch pins (none under the interpreter)."""
    return {} if device.type == "cpu" else {"enable_fp_fusion": FP_FUSION}


def launch_opts(phase: Any, device: torch.device) -> dict:
    """``num_warps``, ``num_stages`` (of a phase's config) and :func:`compile_opts` of a GPU
    launch (none on CPU)."""
    if device.type == "cpu":
        return {}
    opts = {"num_warps": phase.num_warps, **compile_opts(device)}
    if hasattr(phase, "num_stages"):
        opts["num_stages"] = phase.num_stages
    return opts


def pad128(x: int) -> int:
    """``x`` rounded up to a multiple of 128 (a bound that specializes alike everywhere)."""
    return triton.cdiv(x, 128) * 128
