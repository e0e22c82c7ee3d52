"""lp-bench: the ``lp`` command and the benchmark protocol of lp-kernels.

Modules, each with one job (none imports another's private names):

- :mod:`lp_bench.cli`: ``lp bench | check | demo | report`` (argparse only);
- :mod:`lp_bench.protocol`: shapes S1-S6, modes, inputs, :class:`~lp_bench.protocol.BenchConfig`
  and the run loop that writes one row per (mode, entropy, provider, shape, dtype);
- :mod:`lp_bench.providers`: what is timed (lp's backends, the materialized path, peers);
  providers only set up a step, they never time or measure;
- :mod:`lp_bench.distill`: the distill mode's problem (a teacher head), its providers,
  its floor and its reference;
- :mod:`lp_bench.timing` / :mod:`lp_bench.memory`: the one harness that times and measures;
- :mod:`lp_bench.check`: ``lp check``, the self-test; :mod:`lp_bench.demo`: ``lp demo``;
- :mod:`lp_bench.table`, :mod:`lp_bench.report`, :mod:`lp_bench.plot`: rendering;
- :mod:`lp_bench.environment`: device, versions, commit, date, and the one read of
  ``TRITON_INTERPRET``.

The fp64 / fp32 reference is lp-testing's (:mod:`lp_testing.reference`).
"""

__version__ = "0.1.0"
