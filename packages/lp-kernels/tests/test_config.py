"""Pinned triton launch configs: chosen by the device's shared memory and the dtype only."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize(
    ("smem_kib", "tier"), [(227, "large"), (163, "mid"), (99, "small")], ids=["h100", "a100", "ada"]
)
def test_triton_config_by_shared_memory(smem_kib, tier, monkeypatch):
    """The pinned blocks follow the GPU's shared memory and the dtype, never a size: Hopper
    gets the 128 x 256 blocks with tensor descriptors, smaller GPUs 128 x 128 blocks without
    (fewer stages below 160 KiB), 4-byte inputs (FMA dots) 64 x 128 blocks, K steps of 16."""
    import lp_kernels.backends.triton.config as tri
    import lp_kernels.backends.triton.deterministic as tdet
    import lp_kernels.backends.triton.fixed_point as tfix

    monkeypatch.setattr(tri, "smem_per_block", lambda device: smem_kib << 10)
    dev = torch.device("cuda", 0)
    assert tri.gpu_tier(dev) == tier
    bf16, fp32 = tri.config_for(dev, torch.bfloat16), tri.config_for(dev, torch.float32)
    if tier == "large":
        assert bf16 == tri.GPU_CONFIG and bf16.tma and bf16.logits.block_v == 256
    else:
        assert not bf16.tma and (bf16.logits.block_v, bf16.gemm.block_n) == (128, 128)
        stages = 3 if tier == "mid" else 2
        assert bf16.logits.num_stages == stages and bf16.gemm.num_stages == stages
    assert fp32 == bf16.replace(logits=tri.FP32_LOGITS, gemm=tri.FP32_GEMM)
    assert (fp32.logits.block_n, fp32.logits.block_v, fp32.logits.block_h) == (64, 128, 16)
    assert (fp32.gemm.block_m, fp32.gemm.block_n, fp32.gemm.block_k) == (64, 128, 16)
    det_cfg, fixed = tdet.deterministic_config(dev, torch.bfloat16)
    assert (det_cfg.logits.block_v, det_cfg.forward.v_split) == (128, 128)
    assert fixed == (tfix.FIXED_GPU if tier == "large" else tfix.FIXED_SMALL)
    assert tri.config_for(torch.device("cpu"), torch.float32) == tri.INTERPRET_CONFIG


@pytest.mark.parametrize("vocab, max_tp", [(151936, 8), (248320, 8), (1000, 4), (50, 1)])
def test_deterministic_tile_for_serves_every_degree(vocab, max_tp):
    """The tile divides every even shard of the vocabulary padded to 128 x max_tp, at every
    degree dividing max_tp, and is the widest that divides the max_tp-way shard."""
    from lp_kernels import deterministic_tile_for

    tile = deterministic_tile_for(vocab, max_tp)
    v_pad = -(-vocab // (128 * max_tp)) * 128 * max_tp
    assert tile % 128 == 0 and tile * max_tp == v_pad
    for tp in (d for d in range(1, max_tp + 1) if max_tp % d == 0):
        assert (v_pad // tp) % tile == 0


def test_deterministic_tile_for_rejects_bad_arguments():
    from lp_kernels import deterministic_tile_for

    for args in ((0, 8), (1000, 0), (1000, 2.0), (True, 8)):
        with pytest.raises(ValueError, match="must be a positive int"):
            deterministic_tile_for(*args)


def test_auto_backend_on_a_cuda_device_picks_triton(monkeypatch):
    """``backend="auto"`` asks the CUDA device's capability (faked here: the CPU suite has no
    GPU): >= 8.0 gives the triton Function, below it the torch one."""
    import torch

    from lp_kernels.backends import resolve
    from lp_kernels.backends.torch.linear import LinearLogprobTorch
    from lp_kernels.backends.triton.linear import LinearLogprobTriton

    monkeypatch.setattr(resolve, "triton_importable", lambda: True)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve.resolve_backend("auto", cuda) is LinearLogprobTriton
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert resolve.resolve_backend("auto", cuda) is LinearLogprobTorch
