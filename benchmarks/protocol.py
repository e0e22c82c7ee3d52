"""DESIGN.md's GPU performance protocol: lp against the matmul floor, measured in one run.

A thin wrapper: the protocol lives in ``lp_kernels.bench`` (also behind ``lp bench``,
which adds CPU runs, dtypes, temperature, entropy, peers and a plot). For each shape
(N tokens, H hidden, V vocab), bf16 inputs, a per-token logprob with a random upstream
gradient, forward + backward:

- floor: 4 x the median time of one cuBLAS bf16 ``[N, H] x [H, V]`` matmul (forward
  logits, backward recompute, two gradient GEMMs), measured in the same process;
- each provider: median of ``--reps`` timed runs after ``--warmup`` runs (CUDA
  events), peak memory above the inputs (``torch.cuda.max_memory_allocated``, the
  returned gradients included), and errors against an fp32 reference (norm-wise
  relative error of logprob, grad_hidden, grad_weight; max abs error of logprob).

The fp32 reference is computed independently of lp: row chunks of fp32 logits
(TF32 off), ``log_softmax``, and the closed-form gradient ``g * (onehot - softmax)``.

Usage (on a GPU host)::

    python benchmarks/protocol.py --shapes S1,S2,S3,S4 --providers lp-torch,materialized \
        --out results/ --commit $(git rev-parse --short HEAD)

Providers: lp-triton, lp-torch, lp-auto, materialized, liger, cce (peers when importable).
Prints a table last and writes ``protocol.json`` under ``--out``.
"""

from __future__ import annotations

from lp_kernels.bench import (  # noqa: F401  (re-exported: sweep_tiles.py imports them)
    PROVIDERS,
    SHAPES,
    bench_shape,
    environment,
    fp32_reference,
    make_inputs,
    print_table,
    protocol_main,
    rel_err,
    time_cuda,
)


def main(argv: list[str] | None = None) -> int:
    return protocol_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
