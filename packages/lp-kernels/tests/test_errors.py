"""Bad input gets a clear TypeError / ValueError naming the argument and what it expects."""

from __future__ import annotations

import pytest
import torch

from lp_kernels import linear_logprob, vocab_parallel_logprob

H, V, N = 8, 50, 6


def _args():
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(N, H, generator=g),
        torch.randn(V, H, generator=g),
        torch.randint(0, V, (N,), generator=g),
    )


def _call(**over):
    hidden, weight, targets = _args()
    kw = {"hidden": hidden, "weight": weight, "targets": targets} | over
    return linear_logprob(kw.pop("hidden"), kw.pop("weight"), kw.pop("targets"), **kw)


@pytest.mark.parametrize(
    ("over", "exc", "match"),
    [
        ({"hidden": [[1.0]]}, TypeError, "hidden must be a torch.Tensor"),
        (
            {"hidden": torch.ones(N, H, dtype=torch.int64)},
            TypeError,
            "hidden must be float32, bfloat16 or float16",
        ),
        ({"hidden": torch.ones(N, H, dtype=torch.float64)}, TypeError, "hidden must be float32"),
        ({"weight": torch.ones(V)}, ValueError, "weight must have at least 2"),
        ({"weight": torch.ones(2, V, H)}, ValueError, "weight must be 2-D"),
        (
            {"weight": torch.ones(V, H, dtype=torch.float64)},
            TypeError,
            "its dtype is not float32, bfloat16 or float16",
        ),
        ({"weight": torch.ones(V, H + 1)}, ValueError, "hidden size"),
        ({"weight": torch.ones(0, H)}, ValueError, r"weight has no rows \(V_local = 0\)"),
        ({"weight": torch.ones(V, H, device="meta")}, ValueError, "weight is on the meta device"),
        ({"hidden": torch.ones(N, H, device="meta")}, ValueError, "hidden is on the meta device"),
        (
            {"targets": torch.zeros(N, dtype=torch.long, device="meta")},
            ValueError,
            "targets is on the meta device",
        ),
        (
            {"weight": torch.eye(V, H).to_sparse()},
            TypeError,
            "weight must be a dense \\(strided\\) tensor, got layout torch.sparse_coo",
        ),
        (
            {"weight": torch.eye(V, H).to_sparse_csr()},
            TypeError,
            "weight must be a dense \\(strided\\) tensor, got layout torch.sparse_csr",
        ),
        ({"tp_group": "world"}, TypeError, "tp_group must be None or a torch.distributed.Pro"),
        ({"tp_group": 0}, TypeError, "tp_group must be None or a torch.distributed.Pro"),
        ({"ignore_index": -(2**63) - 1}, ValueError, "ignore_index must fit in int64"),
        ({"ignore_index": 2**63}, ValueError, "ignore_index must fit in int64"),
        ({"bias": [0.0] * V}, TypeError, "bias must be a torch.Tensor"),
        ({"bias": torch.zeros(V + 1)}, ValueError, r"its bias must be 1-D \[V_local\]"),
        ({"bias": torch.zeros(1, V)}, ValueError, r"its bias must be 1-D \[V_local\]"),
        ({"bias": torch.zeros(V, dtype=torch.int64)}, TypeError, "bias must be float32"),
        ({"targets": torch.zeros(N)}, TypeError, "targets must be an int64"),
        ({"targets": torch.zeros(N + 1, dtype=torch.long)}, ValueError, "leading shape of hidden"),
        (
            {"hidden": torch.ones(N, 0), "weight": torch.ones(V, 0)},
            ValueError,
            "non-empty last dimension",
        ),
        ({"temperature": 0.0}, ValueError, "temperature must be finite and > 0"),
        ({"temperature": -1.0}, ValueError, "temperature must be finite and > 0"),
        ({"temperature": float("nan")}, ValueError, "temperature must be finite and > 0"),
        ({"temperature": torch.tensor(1.0)}, TypeError, "temperature must be a Python float"),
        ({"temperature": True}, TypeError, "temperature must be a Python float"),
        ({"ignore_index": 1.5}, TypeError, "ignore_index must be an int"),
        ({"ignore_index": 2**63}, ValueError, "ignore_index must fit in int64"),
        ({"chunk_size": 0}, ValueError, "chunk_size must be None or a positive int"),
        ({"backend": "cuda"}, ValueError, "backend must be one of"),
        ({"vocab_size": V + 1}, ValueError, "vocab_size=51 exceeds"),
        ({"vocab_size": 0}, ValueError, "vocab_size must be"),
        ({"vocab_start": 10}, ValueError, "vocab_start=10 needs tp_group"),
        ({"deterministic_tile": 100}, ValueError, "deterministic_tile must be a positive multiple"),
        ({"deterministic_tile": 0}, ValueError, "deterministic_tile must be a positive multiple"),
        ({"deterministic_tile": 256.0}, TypeError, "deterministic_tile must be an int"),
        ({"deterministic_tile": True}, TypeError, "deterministic_tile must be an int"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_bad_arguments(over, exc, match):
    with pytest.raises(exc, match=match):
        _call(**over)


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # read per call, in one place
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        _call(backend="triton")


def test_targets_out_of_range_reports_count_and_range():
    hidden, weight, targets = _args()
    targets[1], targets[4] = V, -3
    with pytest.raises(
        ValueError, match=r"2 target\(s\) are outside \[0, 50\) and not ignore_index=-100"
    ) as info:
        linear_logprob(hidden, weight, targets)
    assert "[1]=50" in str(info.value) and "[4]=-3" in str(info.value)
    with pytest.raises(ValueError, match=r"outside \[0, 40\)"):  # padded vocabulary
        targets[1], targets[4] = 45, 0
        linear_logprob(hidden, weight, targets, vocab_size=40)


def test_validate_false_skips_the_target_check():
    hidden, weight, targets = _args()
    targets[0] = V + 7
    out = linear_logprob(hidden, weight, targets, validate=False)  # no error, no host sync
    assert out.logprob.shape == (N,)


def test_vocab_parallel_logprob_bad_arguments():
    logits = torch.randn(N, V)
    targets = torch.randint(0, V, (N,))
    with pytest.raises(TypeError, match="logits must be float32"):
        vocab_parallel_logprob(logits.double(), targets)
    with pytest.raises(ValueError, match="leading shape of logits"):
        vocab_parallel_logprob(logits, targets[:-1])
    with pytest.raises(ValueError, match="outside"):
        vocab_parallel_logprob(logits, targets + V)
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprob(logits, targets, temperature=-2.0)
    with pytest.raises(ValueError, match="deterministic_tile must be a positive multiple of 128"):
        vocab_parallel_logprob(logits, targets, deterministic=True, deterministic_tile=64)
    with pytest.raises(ValueError, match=r"logits has an empty last dimension \(V_local = 0\)"):
        vocab_parallel_logprob(torch.randn(N, 0), targets)
    with pytest.raises(ValueError, match="logits is on the meta device"):
        vocab_parallel_logprob(logits.to("meta"), targets)
    with pytest.raises(TypeError, match=r"logits must be a dense \(strided\) tensor"):
        vocab_parallel_logprob(logits.to_sparse(), targets)
    with pytest.raises(TypeError, match=r"tp_group must be None or a torch\.distributed"):
        vocab_parallel_logprob(logits, targets, tp_group="world")
    with pytest.raises(ValueError, match="ignore_index must fit in int64"):
        vocab_parallel_logprob(logits, targets, ignore_index=-(2**63) - 1)


@pytest.mark.gpu
def test_weight_on_another_device():
    hidden, weight, targets = _args()
    with pytest.raises(ValueError, match="different device than hidden"):
        linear_logprob(hidden, weight.cuda(), targets)
