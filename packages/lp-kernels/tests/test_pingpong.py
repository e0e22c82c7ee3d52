"""The ping-pong forward kernel (Gluon, Hopper): the same bits as the Triton kernel.

``forward_stats`` takes ``pingpong.pingpong_stats`` on Hopper for default-mode calls
without entropy at ``H <= ForwardConfig.pingpong_max_h`` (a launch choice), with or without a
softcap and a bias. The GPU tests compare its partials, and whole calls with their
gradients, with the Triton kernel's under ``torch.equal`` on awkward shapes, for each
option alone and together; the CPU test compiles every variant for sm_90 with the
installed Triton (Gluon has no interpreter).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from lp_kernels.core.transform import LogitTransform
from lp_kernels.core.types import LogprobParams

pytest.importorskip("triton")


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (sm_90)")


def _configs(dtype):
    from lp_kernels.backends.triton.config import config_for

    on = config_for(torch.device("cuda"), dtype)
    return on, on.replace(forward={"pingpong_max_h": 0})


_OPTIONS = [(None, False), (5.0, False), (None, True), (30.0, True)]
"""(softcap, bias) of the parity tests: neither, each alone, both (a cap of 5 puts most
logits on the tanh's curve)."""


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("softcap, bias", _OPTIONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "n, h, v, first, max_v",
    [
        (1, 64, 1000, 0, 0),
        (300, 200, 5003, 0, 0),  # H not a multiple of the K block, V of the logits block
        (4099, 520, 70001, 0, 0),
        (1024, 2048, 33000, 0, 0),
        (257, 2048, 7000, 7000, 7040),  # a TP shard: ids from 7000, the widest shard 7040
        (129, 136, 600, 0, 40000),  # splits past this shard's end
    ],
)
def test_pingpong_partials_are_the_triton_kernels(dtype, n, h, v, first, max_v, softcap, bias):
    from lp_kernels.backends.triton import forward
    from lp_kernels.backends.triton.pingpong import pingpong_ok, pingpong_stats
    from lp_kernels.backends.triton.plan import shard_splits

    gen = torch.Generator(device="cuda").manual_seed(n + h + v)
    hidden = torch.randn(n, h, device="cuda", generator=gen).to(dtype)
    weight = (torch.randn(v, h, device="cuda", generator=gen) * 0.05).to(dtype)
    b_real = torch.randn(v, device="cuda", generator=gen) if bias else None
    if bias:
        b_real[1] = -0.0  # a negative zero starts its column's sums as it is
    targets = torch.randint(first - 50, first + v + 50, (n,), device="cuda", generator=gen)
    targets[::5] = -100
    if n > 3:
        targets[3] = first + v - 1  # the shard's last column
    on, off = _configs(dtype)
    for ignore_index, temperature in ((-100, 1.0), (first + 17, 0.7)):
        p = LogprobParams(
            transform=LogitTransform(temperature=temperature, softcap=softcap),
            ignore_index=ignore_index, return_entropy=False, return_lse=True,
            vocab_start=first, vocab_size=first + v + 100, chunk_size=0, max_v_local=max_v,
        )  # fmt: skip
        assert not pingpong_ok(hidden, weight, p, off)
        assert pingpong_ok(hidden, weight, p, on)
        # the kernel itself
        width, splits = shard_splits(v, p, on)
        got = torch.empty((splits, n, 4), device="cuda")
        pingpong_stats(hidden, weight, targets, first, p, on, got, width, b_real)
        want = forward.forward_stats(hidden, weight, targets, first, p, off, b_real).clone()
        assert got.shape == want.shape
        assert torch.equal(got, want), (got - want).abs().nan_to_num().max()


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("softcap, bias", _OPTIONS)
@pytest.mark.parametrize("n", [1, 515])
def test_pingpong_calls_match_the_triton_kernel_with_gradients(n, softcap, bias):
    """Whole calls (forward through the ping-pong kernel, backward as ever): every output
    and gradient (the bias's too) as with the Triton forward, bit for bit; rows alone as
    in the batch."""
    from lp_kernels import linear_logprob
    from lp_kernels.backends.triton.config import use_config

    gen = torch.Generator(device="cuda").manual_seed(n)
    hidden = torch.randn(n, 1536, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (torch.randn(32003, 1536, device="cuda", generator=gen) * 0.03).to(torch.bfloat16)
    b_in = torch.randn(32003, device="cuda", generator=gen).to(torch.bfloat16) if bias else None
    targets = torch.randint(0, 32003, (n,), device="cuda", generator=gen)
    targets[::7] = -100
    on, off = _configs(torch.bfloat16)
    kw = dict(temperature=0.8, softcap=softcap, backend="triton")
    results = []
    for cfg in (on, off):
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        b = None if b_in is None else b_in.clone().requires_grad_()
        with use_config(cfg):
            out = linear_logprob(h, w, targets, bias=b, return_lse=True, **kw)
        (out.logprob * torch.linspace(-1, 1, n, device="cuda")).sum().backward()
        results.append((out.logprob, out.lse, h.grad, w.grad) + ((b.grad,) if bias else ()))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    with use_config(on):
        first = linear_logprob(hidden[:1], weight, targets[:1], bias=b_in, **kw)
    assert torch.equal(first.logprob, results[0][0][:1])


def test_pingpong_rule(monkeypatch):
    """Which calls the rule admits (no GPU needed: a stand-in CUDA tensor and device): the
    pinned Hopper config's bf16 / fp16 calls without entropy or deterministic mode at H <=
    2048, with a softcap or not (a bias does not enter the rule), and nothing else."""
    import types

    from lp_kernels.backends.triton import pingpong
    from lp_kernels.backends.triton.config import GPU_CONFIG, config_for

    if not pingpong.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    major = {"value": 9}
    monkeypatch.setattr(pingpong, "_major", lambda device: major["value"])
    monkeypatch.setattr(pingpong, "tma_ok", lambda *tensors: True)

    def tensor(h, dtype=torch.bfloat16):
        return types.SimpleNamespace(device=torch.device("cuda", 0), shape=(512, h), dtype=dtype)

    def params(temperature=1.0, softcap=None, **kw):
        base = dict(
            transform=LogitTransform(temperature=temperature, softcap=softcap),
            ignore_index=-100, return_entropy=False, return_lse=False, vocab_start=0,
            vocab_size=1000, chunk_size=0,
        )  # fmt: skip
        return LogprobParams(**{**base, **kw})

    ok = pingpong.pingpong_ok
    w = tensor(2048)
    assert ok(tensor(2048), w, params(), GPU_CONFIG)
    assert ok(tensor(64, torch.float16), tensor(64, torch.float16), params(), GPU_CONFIG)
    assert not ok(tensor(2056), w, params(), GPU_CONFIG)  # H over pingpong_max_h
    assert not ok(tensor(2048), w, params(return_entropy=True), GPU_CONFIG)
    assert ok(tensor(2048), w, params(softcap=30.0, temperature=0.7), GPU_CONFIG)
    assert not ok(tensor(2048), w, params(softcap=30.0, return_entropy=True), GPU_CONFIG)
    assert not ok(tensor(2048), w, params(deterministic=True), GPU_CONFIG)
    assert not ok(tensor(2048, torch.float32), tensor(2048, torch.float32), params(), GPU_CONFIG)
    assert not ok(tensor(2048), tensor(2048, torch.float16), params(), GPU_CONFIG)
    assert not ok(tensor(2048), w, params(), GPU_CONFIG.replace(forward={"pingpong_max_h": 0}))
    assert not ok(tensor(2048), w, params(), GPU_CONFIG.replace(logits={"block_v": 128}))
    assert not ok(tensor(2048), w, params(), GPU_CONFIG.replace(logits={"block_n": 64}))
    cpu = types.SimpleNamespace(device=torch.device("cpu"), shape=(512, 64), dtype=torch.bfloat16)
    assert not ok(cpu, w, params(), GPU_CONFIG)
    assert not ok(tensor(2048), w, params(), config_for(torch.device("cpu")))  # interpreter
    for other in (8, 10, 12):  # Ampere, Blackwell (and ROCm, which reads 0)
        major["value"] = other
        assert not ok(tensor(2048), w, params(), GPU_CONFIG)


_COMPILE = r"""
import json, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from lp_kernels.backends.triton import pingpong
from lp_kernels.backends.triton.config import GPU_CONFIG
from lp_testing.aot import resources

cfg = GPU_CONFIG
h_block = [pingpong.HALF, cfg.logits.block_h]
w_block = [cfg.logits.block_v, cfg.logits.block_h]
lay_h = gl.NVMMASharedLayout.get_default_for(h_block, gl.bfloat16)
lay_w = gl.NVMMASharedLayout.get_default_for(w_block, gl.bfloat16)
for bias in (False, True):
    for cap in (False, True):
        sig = {  # the kernel's parameters, in order; an absent bias is a constexpr None
            "h_desc": f"tensordesc<bf16{h_block},{lay_h}>",
            "w_desc": f"tensordesc<bf16{w_block},{lay_w}>",
            "t_ptr": "*i64", "stats_ptr": "*fp32", "b_ptr": "*fp32" if bias else "constexpr",
            "N": "i32", "H": "i32", "V_real": "i32", "ignore_index": "i32", "col0": "i32",
            "inv_t": "fp32", "cap": "fp32", "inv_cap": "fp32", "splits": "i32", "rows": "i32",
            "scale": "fp32", "V_SPLIT": "constexpr", "NSTAGES": "constexpr",
            "IGNORED": "constexpr", "HAS_BIAS": "constexpr", "CAP": "constexpr",
            "SCALE": "constexpr", "REGS": "constexpr",
        }
        names = list(sig)
        consts = {"V_SPLIT": cfg.forward.v_split, "NSTAGES": pingpong.STAGES, "IGNORED": -2,
                  "HAS_BIAS": bias, "CAP": cap, "SCALE": False, "REGS": pingpong.CONSUMER_REGS}
        if not bias:
            consts["b_ptr"] = None
        src = GluonASTSource(pingpong.pingpong_stats_kernel, sig,
                             {(names.index(k),): v for k, v in consts.items()})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 4, "enable_fp_fusion": True})
        print(json.dumps({"bias": bias, "cap": cap, "shared": k.metadata.shared,
                          "res": resources(k.asm["cubin"]),
                          "ptx": [l.strip() for l in k.asm["ptx"].splitlines()
                                  if "setmaxnreg" in l]}))
"""


def test_pingpong_kernel_compiles_for_sm90(tmp_path):
    """The installed Triton compiles the Gluon kernel for sm_90 (no GPU needed), with and
    without the cap and the bias: its shared memory fits Hopper's 227 KiB, the
    warpgroups' registers are reassigned (setmaxnreg) as the kernel asks, and no variant
    spills more than its ceiling."""
    from lp_kernels.backends.triton import pingpong

    if not pingpong.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    import json

    variants = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert len(variants) == 4, proc.stdout[-2000:]
    for out in variants:
        assert out["shared"] <= 227 << 10
        if out["res"] is not None:
            # Stack frames: 0 B for every variant with Triton 3.6 (the GPU machine's);
            # with 3.9, 16 B, and 0.5 KB with the bias (values of the tile's columns kept
            # across the main loop), the ceilings below.
            _, stack = out["res"]
            assert stack <= (640 if out["bias"] else 16), out
        assert any(f"setmaxnreg.inc.sync.aligned.u32 \t{pingpong.CONSUMER_REGS};" in x
                   for x in out["ptx"]), out["ptx"]  # fmt: skip
