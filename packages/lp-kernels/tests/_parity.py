"""Shared parity check of linear_logprob against fp64 (used by several test modules)."""

from __future__ import annotations

import torch

from lp_kernels import linear_logprob
from lp_testing import assert_close, assert_zero, materialized_baseline, reference_all


def check_against_fp64(
    problem,
    tol,
    *,
    entropy: bool,
    lse: bool,
    chunk_size=None,
    backend="torch",
    deterministic=False,
    deterministic_tile=128,
    softcap=None,
):
    """Run linear_logprob with random per-row upstream gradients; compare everything to fp64.

    Tolerances are relative to the materialized-logits path in the same dtype.
    """
    p = problem.with_grad()
    up = p.upstream()
    grads = {"grad_logprob": up["grad_logprob"]}
    if entropy:
        grads["grad_entropy"] = up["grad_entropy"]
    if lse:
        grads["grad_lse"] = up["grad_lse"]
    out = linear_logprob(
        p.hidden,
        p.weight,
        p.targets,
        temperature=p.temperature,
        ignore_index=p.ignore_index,
        vocab_size=p.vocab_size,
        return_entropy=entropy,
        return_lse=lse,
        chunk_size=chunk_size,
        backend=backend,
        deterministic=deterministic,
        deterministic_tile=deterministic_tile,
        softcap=softcap,
    )
    loss = (out.logprob * grads["grad_logprob"]).sum()
    if entropy:
        loss = loss + (out.entropy * grads["grad_entropy"]).sum()
    if lse:
        loss = loss + (out.lse * grads["grad_lse"]).sum()
    loss.backward()

    cap = {} if softcap is None else {"softcap": softcap}
    truth = reference_all(p.hidden, p.weight, p.targets, **grads, **cap, **p.op_kwargs())
    base = materialized_baseline(p.hidden, p.weight, p.targets, **grads, **cap, **p.op_kwargs())
    tag = f"[{tol}, {p.id}]"
    names = ["logprob"] + (["entropy"] if entropy else []) + (["lse"] if lse else [])
    for name in names:
        got = getattr(out, name)
        assert got.dtype == torch.float32 and got.shape == p.targets.shape
        assert_close(got, truth[name], baseline=base[name], name=name + tag, **tol.kwargs())
        assert_zero(got, where=p.ignored, name=f"{name} on ignored rows{tag}")
    assert out.entropy is None or entropy
    assert out.lse is None or lse
    assert p.hidden.grad.dtype == p.hidden.dtype and p.weight.grad.dtype == p.weight.dtype
    assert_close(
        p.hidden.grad,
        truth["grad_hidden"],
        baseline=base["grad_hidden"],
        name="grad_hidden" + tag,
        **tol.kwargs(),
    )
    assert_close(
        p.weight.grad,
        truth["grad_weight"],
        baseline=base["grad_weight"],
        name="grad_weight" + tag,
        **tol.kwargs(),
    )
    assert_zero(p.hidden.grad, where=p.ignored, name=f"grad_hidden on ignored rows{tag}")
    assert_zero(p.weight.grad[p.vocab_size :], name=f"grad_weight of padded rows{tag}")
