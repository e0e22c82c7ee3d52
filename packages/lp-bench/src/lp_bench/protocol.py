"""The performance protocol of ``lp bench``: shapes, modes, inputs, and the run loop.

One run is a grid: shapes x dtypes x modes x {logprob, +entropy} x providers, one row
each (the row schema is :data:`ROW_KEYS`); the ``distill`` mode's rows are shapes x dtypes
x teacher scales x kinds x providers instead (:func:`distill_rows`, the problem and its
providers in :mod:`lp_bench.distill`). Per shape and dtype, in one process:

- inputs: bf16 (on GPU) ``hidden [N, H]``, ``weight [V, H]`` with LM-like logit magnitudes
  (std about 2), targets, a per-token upstream gradient for logprob (and one for entropy);
  with ``bias``, a random ``bias [V]`` in the input dtype (:func:`make_bias`), a leaf that
  requires grad in train mode; with ``softcap``, the logits' cap (both passed to every
  provider, whose row is skipped where it cannot take them);
- floor (GPU only), per mode, measured in the same run at steady state: ``train`` and
  ``loss``: four back-to-back cuBLAS ``[N, H] x [H, V]`` matmuls (forward logits, backward
  recompute, two gradient GEMMs); ``fwd``: one such matmul; ``distill``: those four plus
  two of the teacher's ``[N, H_t] x [H_t, V]`` (its forward and backward logits);
- ``loss`` mode's objective (:func:`policy_loss`, :func:`loss_per_token`), made once per
  shape from the reference's log-probs: DAPO's clipped surrogate (clip 0.2 / 0.28,
  token-mean weights) with a k3 KL penalty (0.04) to reference log-probs; old and reference
  log-probs are the model's own plus independent noise (std 0.1: about 2 % of the ratios
  fall outside the clip bounds), one advantage per 1024-token sequence; made under
  ``check=False`` too;
- reference: :func:`lp_testing.reference.reference_chunked`, fp32 with TF32 off on GPU,
  fp64 on CPU, a block of rows at a time, independent of lp;
- each provider (:mod:`lp_bench.providers`): median of ``reps`` timed steps after
  ``warmup`` steps (and, on GPU, at least ``warm_s`` seconds of them, so that each is timed
  at the clock its own sustained load settles to); peak memory above the inputs, the
  returned gradients included (:mod:`lp_bench.memory`); norm-wise relative errors of
  logprob, entropy and the gradients (hidden, weight, bias) against the reference, max abs
  error of logprob; in ``loss`` mode the loss's relative error too.

``train`` steps run forward + backward; ``fwd`` steps run under ``torch.no_grad`` with
inputs that do not require grad; ``loss`` steps run forward + backward of the summed loss.
With entropy, a train step backpropagates through both logprob and entropy; a fwd step
computes both; a loss step adds an entropy bonus (:data:`ENTROPY_COEF`) to the loss. The
loss mode's reference evaluates the loss on the reference's outputs under autograd: its
derivatives per row are the upstream gradients of the reference's gradient pass.

Under tensor parallelism (``tp > 1``, every rank of a torchrun launch runs the loop),
each rank holds an even 128-aligned shard of the head and of the bias (:func:`tp_shard`);
the floor is
that of one rank's shard; times and peaks are the maxima over the ranks; errors are rank
0's outputs, its grad_weight shard and the all-reduced grad_hidden against the full
reference. Single-device providers are marked skipped.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lp_bench.distill import (
    KINDS,
    TEACHER_SCALES,
    DistillProblem,
    Kind,
    distill_floor,
    distill_reference,
    make_distill_provider,
    make_teacher,
)
from lp_bench.memory import peak_bytes
from lp_bench.providers import (
    MODES,
    LossProblem,
    Mode,
    Unsupported,
    is_deterministic,
    make_provider,
)
from lp_bench.timing import all_ranks_max, floor_call, steady_warmup, time_cpu, time_cuda

SHAPES: dict[str, tuple[int, int, int]] = {
    "S1": (8192, 4096, 151936),
    "S2": (16384, 2048, 248320),
    "S3": (32768, 4096, 128256),
    "S4": (16384, 2048, 62080),
    "S5": (2048, 4096, 151936),
    "S6": (1024, 2048, 248320),
}
"""The GPU protocol's shapes (N tokens, H hidden, V vocabulary)."""
CPU_SHAPES: dict[str, tuple[int, int, int]] = {"cpu": (256, 128, 16003)}
"""The embedded default problem of ``lp bench`` on CPU (seconds on 2 cores)."""
DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
"""Input dtypes by their command-line name."""
FLOOR_MATMULS: dict[str, int] = {"train": 4, "fwd": 1, "loss": 4, "distill": 6}
"""The floor of each mode, in matmuls of the step's shape (``loss``: the train step's, which
``linear_logprob_loss``'s three GEMMs can go below; ``distill``: four of the student's shape
and two of the teacher's, :func:`lp_bench.distill.distill_floor`)."""
SEQ_LEN = 1024
"""Tokens per sequence in ``loss`` mode (one advantage per sequence)."""
KL_COEF = 0.04
"""``loss`` mode: the k3 KL penalty's coefficient (GRPO's beta)."""
ENTROPY_COEF = 1e-3
"""``loss`` mode with entropy: the entropy bonus's coefficient."""
LOSS_NOISE = 0.1
"""``loss`` mode: std of the noise between the model's log-probs and the old / reference
log-probs (about 2 % of the ratios fall outside DAPO's clip bounds)."""
ERROR_KEYS = (
    "err_loss",
    "err_divergence",
    "err_logprob",
    "maxabs_logprob",
    "err_entropy",
    "err_grad_hidden",
    "err_grad_weight",
    "err_grad_bias",
)
ENV_ROW_KEYS = ("device", "device_name", "torch", "triton", "lp_kernels", "commit", "date")
"""The run's environment, copied into every row so that each row stands alone."""
ROW_KEYS = (
    "mode",
    "entropy",
    "entropy_computed",
    "deterministic",
    "provider",
    "shape",
    "N",
    "H",
    "V",
    "dtype",
    "tp",
    "temperature",
    "softcap",
    "bias",
    "kind",
    "beta",
    "H_t",
    "floor_ms",
    "floor_matmuls",
    "ms",
    "ms_all",
    "x_floor",
    "peak_bytes",
    "peak_gib",
    *ERROR_KEYS,
    "note",
    "skipped",
    "error",
    *ENV_ROW_KEYS,
)
"""Every row of a ``bench.json`` has exactly these keys (None where not measured)."""

Shape = tuple[str, int, int, int]  # (name, N, H, V)


def tile_arg(spec: str, vocab: int) -> int:
    """A ``--det-tile`` of the benchmark scripts: an int, or ``tpN`` for the widest tile of
    TP degrees dividing N (``tp8``: ``linear_logprob``'s default)."""
    from lp_kernels import deterministic_tile_for

    if spec.startswith("tp"):
        return deterministic_tile_for(vocab, int(spec[2:]))
    return int(spec)


def parse_shapes(text: str) -> tuple[Shape, ...]:
    """``S1,S3,512x256x32003`` -> ((name, N, H, V), ...); ValueError names the bad item."""
    known = SHAPES | CPU_SHAPES
    shapes = []
    for item in (s.strip() for s in text.split(",")):
        if item in known:
            shapes.append((item, *known[item]))
            continue
        m = re.fullmatch(r"(\d+)x(\d+)x(\d+)", item)
        if not m:
            raise ValueError(f"{item!r} is neither a shape name ({', '.join(known)}) nor NxHxV")
        n, h, v = (int(x) for x in m.groups())
        if n < 1 or h < 1 or v < 2:
            raise ValueError(f"{item!r}: need N >= 1, H >= 1, V >= 2")
        shapes.append((item, n, h, v))
    if not shapes:
        raise ValueError("no shape given")
    return tuple(shapes)


def parse_modes(text: str) -> tuple[Mode, ...]:
    """``train``, ``fwd``, ``loss`` or a list (``train,fwd``) -> the modes; ValueError names
    the bad item."""
    modes = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    if not modes:
        raise ValueError("no mode given")
    return modes  # type: ignore[return-value]


def make_inputs(
    n: int,
    h: int,
    v: int,
    *,
    seed: int = 0,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
):
    """hidden/weight with LM-like logit magnitudes (std about 2), targets, upstream grad."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(device, dtype)
    weight = (torch.randn(v, h, generator=g) * (2.0 / h**0.5)).to(device, dtype)
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    grad_out = torch.randn(n, generator=g).to(device)
    return hidden, weight, targets, grad_out


def make_bias(v: int, *, seed: int = 0, device: str = "cuda", dtype=torch.bfloat16):
    """A random LM-head ``bias [V]`` (std 1) in ``dtype``, from its own seed stream (the
    other inputs of :func:`make_inputs` are the same with and without it)."""
    g = torch.Generator(device="cpu").manual_seed(seed + 2)
    return torch.randn(v, generator=g).to(device, dtype)


def tp_shard(weight: torch.Tensor, tp: int, rank: int) -> tuple[torch.Tensor, int]:
    """This rank's ``[V_pad / tp, H]`` shard of ``weight`` (or ``[V_pad / tp]`` of a bias
    ``[V]``) and its global start.

    The vocabulary is padded to a multiple of 128 x tp (as Megatron pads it), with zero
    rows that ``vocab_size`` excludes, so shards are even and 128-aligned
    (``deterministic=True`` accepts them).
    """
    v, rest = weight.shape[0], weight.shape[1:]
    size = -(-v // (128 * tp)) * 128
    start = rank * size
    shard = torch.zeros((size, *rest), dtype=weight.dtype, device=weight.device)
    real = max(0, min(size, v - start))
    shard[:real] = weight[start : start + real]
    return shard, start


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Norm-wise relative error of ``a`` against ``ref`` (in ``ref``'s dtype)."""
    return float((a.to(ref.dtype) - ref).norm() / ref.norm().clamp_min(1e-30))


def default_dtypes(device: str) -> tuple[str, ...]:
    """bf16 on GPU; fp32 and bf16 on CPU."""
    return ("bf16",) if device == "cuda" else ("fp32", "bf16")


@dataclass(frozen=True)
class BenchConfig:
    """One ``lp bench`` run: the grid and how each cell is measured."""

    shapes: tuple[Shape, ...]
    """(name, N, H, V) of each shape."""
    providers: tuple[str, ...]
    """Provider names (:data:`lp_bench.providers.ALL_PROVIDERS`)."""
    dtypes: tuple[str, ...]
    """Input dtypes, keys of :data:`DTYPES`."""
    device: str
    """``"cuda"`` or ``"cpu"``."""
    modes: tuple[Mode, ...] = ("train",)
    """``train`` (forward + backward), ``fwd`` (forward under no_grad) and/or ``loss``
    (forward + backward of an RL loss)."""
    entropy: tuple[bool, ...] = (False,)
    """Without and/or with entropy (its gradient too in train mode; an entropy bonus in the
    loss mode's objective)."""
    temperature: float = 1.0
    """Logits are divided by it."""
    reps: int = 5
    """Timed steps; the median is reported."""
    warmup: int = 2
    """Untimed steps before them (at least)."""
    warm_s: float = 0.0
    """GPU: warm each timed call up for at least this many seconds (steady clocks)."""
    check: bool = True
    """Compute the reference and the errors."""
    seed: int = 0
    """Seed of the inputs."""
    tp: int = 1
    """Tensor-parallel degree: under torchrun, each rank holds V / tp rows of the head."""
    softcap: float | None = None
    """Final-logit cap ``c``: ``z = c * tanh(l / c) / T``; None: no cap."""
    bias: bool = False
    """Add a random LM-head bias ``[V]`` (:func:`make_bias`) to the logits."""
    kinds: tuple[Kind, ...] = ("reverse_kl",)
    """``distill`` mode: the divergences (:data:`lp_bench.distill.KINDS`)."""
    beta: float = 0.5
    """``distill`` mode: jsd's mixture weight of the teacher, in (0, 1)."""
    teacher_scales: tuple[int, ...] = TEACHER_SCALES
    """``distill`` mode: teacher hidden sizes ``H_t``, in multiples of the student's ``H``."""

    def __post_init__(self) -> None:
        for mode in self.modes:
            if mode not in MODES:
                raise ValueError(f"BenchConfig.modes: {mode!r} is not one of {MODES}")
        for name in self.dtypes:
            if name not in DTYPES:
                raise ValueError(f"BenchConfig.dtypes: {name!r} is not one of {tuple(DTYPES)}")
        if not (self.modes and self.entropy and self.providers and self.shapes and self.dtypes):
            raise ValueError("BenchConfig: shapes, providers, dtypes, modes, entropy are non-empty")
        if self.reps < 1 or self.warmup < 0 or self.warm_s < 0 or self.tp < 1:
            raise ValueError("BenchConfig: need reps >= 1, warmup >= 0, warm_s >= 0, tp >= 1")
        if self.softcap is not None and not (0 < self.softcap < float("inf")):
            raise ValueError(
                f"BenchConfig.softcap: must be None or a finite number > 0, got {self.softcap}"
            )
        if "distill" in self.modes:
            self._check_distill()

    def _check_distill(self) -> None:
        """Reject distill-mode settings it does not run (with the fix in the message)."""
        bad = [k for k in self.kinds if k not in KINDS]
        if bad or not self.kinds:
            raise ValueError(f"BenchConfig.kinds: need one or more of {KINDS}, got {self.kinds}")
        if not 0 < self.beta < 1:
            raise ValueError(f"BenchConfig.beta: jsd needs 0 < beta < 1, got {self.beta}")
        if not self.teacher_scales or min(self.teacher_scales) < 1:
            raise ValueError(
                f"BenchConfig.teacher_scales: need integers >= 1, got {self.teacher_scales}"
            )
        if self.tp > 1 or self.softcap is not None or self.bias:
            raise ValueError(
                "BenchConfig: distill mode runs on one device without softcap or bias; "
                "drop --tp / --softcap / --bias or run distill separately"
            )

    @property
    def size(self) -> int:
        """The number of rows of the run."""
        others = len([m for m in self.modes if m != "distill"]) * len(self.entropy)
        if "distill" in self.modes:  # entropy plays no part in a distill row
            others += len(self.kinds) * len(self.teacher_scales)
        return len(self.shapes) * len(self.dtypes) * others * len(self.providers)


def run_label(mode: str, entropy: bool) -> str:
    """``train``, ``train+entropy``, ``fwd``, ``fwd+entropy``, ``loss``, ``loss+entropy``."""
    return f"{mode}+entropy" if entropy else mode


def row_label(row: dict) -> str:
    """A row's run: :func:`run_label`, or for a distill row ``distill <kind>, H_t=<s>H``
    (jsd with its beta: ``distill jsd(0.5), H_t=2H``)."""
    if row["mode"] != "distill":
        return run_label(row["mode"], row["entropy"])
    kind = f"jsd({row['beta']:g})" if row["kind"] == "jsd" else row["kind"]
    scale = row["H_t"] // row["H"] if row["H_t"] % row["H"] == 0 else f"{row['H_t'] / row['H']:g}"
    return f"distill {kind}, H_t={scale}H"


def options_label(softcap: float | None, bias: bool | None) -> str:
    """``softcap 30, bias``, ``softcap 30``, ``bias`` or ``""``: a run's logit options."""
    parts = [] if softcap is None else [f"softcap {softcap:g}"]
    return ", ".join(parts + (["bias"] if bias else []))


def losses_unavailable() -> str | None:
    """None if ``lp_kernels.losses`` (the loss mode's objective) is importable, else why not."""
    import importlib.util

    if importlib.util.find_spec("lp_kernels.losses") is None:
        return "lp_kernels.losses is not importable (an lp-kernels without the RL losses)"
    return None


def policy_loss(entropy: bool = False, losses=None):
    """The ``loss`` mode's ``loss_fn``: DAPO (clip 0.2 / 0.28) with a k3 KL penalty
    (:data:`KL_COEF`) to ``ref_logprob``; with ``entropy``, an entropy bonus
    (:data:`ENTROPY_COEF`). A :class:`lp_kernels.losses.PolicyLoss`, made by ``losses``
    (another tree's ``lp_kernels.losses`` module; None: this one's)."""
    if losses is None:
        from lp_kernels import losses

    bonus = ENTROPY_COEF if entropy else 0.0
    return losses.dapo(kl_coef=KL_COEF, kl_estimator="k3", entropy_coef=bonus)


def loss_per_token(logprob: torch.Tensor, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """The ``loss`` mode's per-token inputs from the model's log-probs ``logprob [N]``.

    ``old_logprob`` and ``ref_logprob``: ``logprob`` plus independent noise of std
    :data:`LOSS_NOISE`; ``advantages``: one N(0, 1) value per sequence of
    ``min(SEQ_LEN, N)`` tokens, broadcast over its tokens; ``weights``: token-mean
    (``lp_kernels.losses.token_weights``, 1 / N each). All ``[N]`` fp32 on ``logprob``'s
    device, drawn from CPU generators seeded with ``seed``.
    """
    from lp_kernels import losses

    n = logprob.numel()
    t = min(SEQ_LEN, n)
    b = -(-n // t)
    g = torch.Generator(device="cpu").manual_seed(seed + 3)
    base = logprob.detach().reshape(-1).float().cpu()
    mask = (torch.arange(b * t) < n).view(b, t)
    per_token = {
        "old_logprob": base + LOSS_NOISE * torch.randn(n, generator=g),
        "ref_logprob": base + LOSS_NOISE * torch.randn(n, generator=g),
        "advantages": torch.randn(b, generator=g).repeat_interleave(t)[:n],
        "weights": losses.token_weights(mask, "token-mean")[mask],
    }
    return {k: v.to(logprob.device) for k, v in per_token.items()}


def bench_reference(cfg: BenchConfig, inputs: tuple, **upstream) -> dict:
    """The reference of ``inputs = (hidden, weight, targets, bias)`` (the full head) with
    the run's options: :func:`lp_testing.reference.reference_chunked` in fp32 on GPU (TF32
    off), fp64 on CPU; ``upstream``: its ``grad_logprob`` / ``grad_entropy`` / ``grad_lse``."""
    from lp_testing.reference import reference_chunked

    hidden, weight, targets, bias = inputs
    return reference_chunked(
        hidden,
        weight,
        targets,
        **upstream,
        temperature=cfg.temperature,
        bias=bias,
        softcap=cfg.softcap,
        dtype=torch.float32 if cfg.device == "cuda" else torch.float64,
    )


def loss_reference(cfg: BenchConfig, inputs: tuple, outputs: dict, problem: LossProblem) -> dict:
    """The loss and its gradients on the reference: ``problem.loss_fn`` on the reference's
    ``outputs`` under autograd gives each row's derivatives w.r.t. logprob / entropy / lse,
    the upstream gradients of the reference's gradient pass. Adds ``"loss"`` (0-d)."""
    use = {"logprob": True, "entropy": problem.entropy, "lse": problem.lse}
    leaves = {k: outputs[k].detach().clone().requires_grad_() for k, on in use.items() if on}
    with torch.enable_grad():
        loss = problem.loss_fn(*(leaves.get(k) for k in use), **problem.per_token).sum()
        grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    upstream = {f"grad_{k}": g for k, g in zip(leaves, grads, strict=True) if g is not None}
    return bench_reference(cfg, inputs, **upstream) | {"loss": loss.detach()}


def new_row(cfg: BenchConfig, shape: Shape, dtype_name: str, env: dict | None) -> dict:
    """A row of :data:`ROW_KEYS` with the run's fields filled: the environment (``env``,
    from :func:`lp_bench.environment.environment`), the shape, dtype and ``cfg``'s options;
    the rest None."""
    name, n, h, v = shape
    row = dict.fromkeys(ROW_KEYS) | {k: (env or {}).get(k) for k in ENV_ROW_KEYS}
    row |= {"shape": name, "N": n, "H": h, "V": v, "dtype": dtype_name, "tp": cfg.tp}
    return row | {"temperature": cfg.temperature, "softcap": cfg.softcap, "bias": cfg.bias}


def _loss_inputs(cfg: BenchConfig, reference: Callable[..., dict]):
    """``(per_token, why_not)``: the loss mode's per-token inputs from the reference's
    log-probs (``reference("fwd")``), the same on every rank, or None and why not (None
    and None without loss mode)."""
    if "loss" not in cfg.modes:
        return None, None
    why = losses_unavailable()
    if why is not None:
        return None, why
    per_token = loss_per_token(reference("fwd")["logprob"], seed=cfg.seed)
    if cfg.tp > 1:  # every rank's loss must see the same values
        import torch.distributed as dist

        for value in per_token.values():
            dist.broadcast(value, 0)
    return per_token, None


def bench_problem(
    shape: Shape,
    dtype_name: str,
    cfg: BenchConfig,
    on_row: Callable[[dict], None] | None = None,
    env: dict | None = None,
) -> list[dict]:
    """Every mode, entropy setting and provider of ``cfg`` on one shape and dtype.

    Returns one row per (mode, entropy, provider), in that order, with the keys of
    :data:`ROW_KEYS`; ``on_row`` is called with each as it is done; ``env`` (from
    :func:`lp_bench.environment.environment`) fills the environment keys.
    """
    _, n, h, v = shape
    cuda = cfg.device == "cuda"
    hidden, weight, targets, grad_out = make_inputs(
        n, h, v, seed=cfg.seed, device=cfg.device, dtype=DTYPES[dtype_name]
    )
    bias = None
    if cfg.bias:
        bias = make_bias(v, seed=cfg.seed, device=cfg.device, dtype=DTYPES[dtype_name])
    tp_kwargs, shard, bias_shard, start = None, weight, bias, 0
    if cfg.tp > 1:
        import torch.distributed as dist

        shard, start = tp_shard(weight, cfg.tp, dist.get_rank())
        if bias is not None:
            bias_shard, _ = tp_shard(bias, cfg.tp, dist.get_rank())
        tp_kwargs = {"tp_group": dist.group.WORLD, "vocab_start": start, "vocab_size": v}
    grad_ent = None
    if any(cfg.entropy):
        gen = torch.Generator().manual_seed(cfg.seed + 1)
        grad_ent = torch.randn(n, generator=gen).to(cfg.device)
    refs: dict[str, dict] = {}
    ref_inputs = (hidden, weight, targets, bias)

    def reference(key: str, **upstream) -> dict:
        if key not in refs:
            refs[key] = bench_reference(cfg, ref_inputs, **upstream)
        return refs[key]

    per_token, loss_skip = _loss_inputs(cfg, reference)
    rows = []
    for mode in cfg.modes:
        if mode == "distill":  # its own problem, with a teacher
            rows += distill_rows(shape, dtype_name, cfg, on_row, env)
            continue
        floor = None
        if cuda:
            fl = floor_call(hidden, shard, FLOOR_MATMULS[mode])
            warm = steady_warmup(fl, cfg.warmup, cfg.warm_s, cfg.tp)
            floor = statistics.median(time_cuda(fl, warmup=warm, reps=cfg.reps))
            if cfg.tp > 1:
                floor = all_ranks_max(floor, cfg.device)
        for entropy in cfg.entropy:
            problem = None
            if per_token is not None and mode == "loss":
                problem = LossProblem(
                    policy_loss(entropy), per_token, min(SEQ_LEN, n), entropy=entropy
                )
            ref = None
            if cfg.check:
                if mode == "fwd":  # outputs only, the same with and without entropy
                    ref = reference("fwd")
                elif mode == "train":
                    up = {"grad_logprob": grad_out}
                    if entropy:
                        up["grad_entropy"] = grad_ent
                    ref = reference(run_label(mode, entropy), **up)
                elif problem is not None:
                    key = run_label(mode, entropy)
                    if key not in refs:
                        refs[key] = loss_reference(cfg, ref_inputs, reference("fwd"), problem)
                    ref = refs[key]
            for prov in cfg.providers:
                row = new_row(cfg, shape, dtype_name, env)
                row |= {"mode": mode, "entropy": entropy, "provider": prov, "floor_ms": floor}
                row["deterministic"] = is_deterministic(prov)
                row["floor_matmuls"] = FLOOR_MATMULS[mode] if cuda else None
                inputs = (hidden, shard, targets, grad_out, grad_ent, bias_shard)
                if mode == "loss" and problem is None:
                    row["skipped"] = loss_skip
                else:
                    _measure(row, cfg, inputs, ref, tp_kwargs, problem)
                if cfg.tp > 1:
                    _gather_row(row, cfg)
                if cuda:
                    torch.cuda.empty_cache()
                rows.append(row)
                if on_row:
                    on_row(row)
    return rows


def _gather_row(row: dict, cfg: BenchConfig) -> None:
    """TP: the slowest rank's time and the largest peak (every rank calls this)."""
    for key in ("ms", "peak_bytes"):
        got = all_ranks_max(-1.0 if row[key] is None else float(row[key]), cfg.device)
        row[key] = None if got is None or got < 0 else got
    if row["peak_bytes"] is not None:
        row["peak_bytes"] = int(row["peak_bytes"])
        row["peak_gib"] = row["peak_bytes"] / 2**30
    if row["ms"] is not None and row["floor_ms"]:
        row["x_floor"] = row["ms"] / row["floor_ms"]


def _measure(
    row: dict,
    cfg: BenchConfig,
    inputs: tuple,
    ref: dict | None,
    tp_kwargs,
    loss: LossProblem | None = None,
) -> None:
    """Time, memory and errors of one provider, into ``row`` (a failure is a row too);
    ``loss``: the objective of a ``loss``-mode row."""
    hidden, shard, targets, grad_out, grad_ent, bias = inputs
    mode, prov = row["mode"], row["provider"]
    grads = mode != "fwd"
    try:
        prep = make_provider(
            prov,
            mode=mode,
            temperature=cfg.temperature,
            entropy=row["entropy"],
            tp=tp_kwargs,
            softcap=cfg.softcap,
            bias=bias is not None,
            loss=loss,
        )
    except Unsupported as exc:
        row["skipped"] = str(exc)
        return
    row["entropy_computed"], row["note"] = prep.entropy, prep.note
    hl = hidden.detach().requires_grad_(grads)
    wl = shard.detach().requires_grad_(grads)
    bl = None if bias is None else bias.detach().requires_grad_(grads)
    extra = {} if bl is None else {"bias": bl}

    def clear() -> None:
        hl.grad = wl.grad = None
        if bl is not None:
            bl.grad = None

    def step():
        clear()
        with torch.set_grad_enabled(grads):
            return prep.step(hl, wl, targets, grad_out, grad_ent, **extra)

    try:
        times = timed_runs(step, cfg)
        clear()
        peak = peak_bytes(step, cfg.device)
        out = step()  # the results checked (the memory run may be traced)
        logprob, ent = out[0], out[1]
        value = out[2] if mode == "loss" else None  # the loss, 0-d
        ms = statistics.median(times)
        row.update(ms=ms, ms_all=times, peak_bytes=peak, peak_gib=peak / 2**30)
        row["x_floor"] = ms / row["floor_ms"] if row["floor_ms"] else None
        if ref is not None:
            if logprob is not None:
                row["err_logprob"] = rel_err(logprob, ref["logprob"])
                row["maxabs_logprob"] = float(
                    (logprob.to(ref["logprob"].dtype) - ref["logprob"]).abs().max()
                )
            if ent is not None:
                row["err_entropy"] = rel_err(ent, ref["entropy"])
            if value is not None:
                row["err_loss"] = rel_err(value, ref["loss"])
            # train: the gradients of the upstream gradient on the outputs it returned (a
            # scalar-loss peer's are another function's); loss: those of the loss it returned
            if (mode == "train" and logprob is not None) or value is not None:
                _grad_errors(row, ref, (hl, wl, bl), tp_kwargs)
        del out, logprob, ent, value
    except Exception as exc:  # a provider's failure is a row, not the end of the run
        row["error"] = failure(exc)
    clear()


def timed_runs(step: Callable[[], object], cfg: BenchConfig) -> list[float]:
    """Milliseconds of ``cfg.reps`` calls of ``step`` after its warm-up (CUDA events and
    :func:`steady_warmup` on GPU, ``perf_counter`` on CPU)."""
    if cfg.device == "cuda":
        warm = steady_warmup(step, cfg.warmup, cfg.warm_s, cfg.tp)
        return time_cuda(step, warmup=warm, reps=cfg.reps)
    return time_cpu(step, warmup=cfg.warmup, reps=cfg.reps)


def failure(exc: Exception) -> str:
    """A failed row's ``error``: ``OOM: ...`` or ``<Type>: <first line>``."""
    if isinstance(exc, torch.OutOfMemoryError):
        return f"OOM: {str(exc).splitlines()[0]}"
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _grad_errors(row: dict, ref: dict, leaves: tuple, tp_kwargs) -> None:
    """The gradients' errors against ``ref`` (this rank's shard of weight and bias)."""
    hl, wl, bl = leaves
    start = 0 if tp_kwargs is None else tp_kwargs["vocab_start"]
    real = max(0, min(wl.shape[0], row["V"] - start))
    row["err_grad_hidden"] = rel_err(hl.grad, ref["grad_hidden"])
    row["err_grad_weight"] = rel_err(wl.grad[:real], ref["grad_weight"][start : start + real])
    if bl is not None:
        if bl.grad is None:
            raise RuntimeError("no gradient reached the bias (the step ignored it)")
        row["err_grad_bias"] = rel_err(bl.grad[:real], ref["grad_bias"][start : start + real])


def distill_rows(
    shape: Shape,
    dtype_name: str,
    cfg: BenchConfig,
    on_row: Callable[[dict], None] | None = None,
    env: dict | None = None,
) -> list[dict]:
    """The distill mode's rows of one shape and dtype, one per (teacher scale, kind,
    provider) in that order, with the keys of :data:`ROW_KEYS` (``entropy`` False).

    The student's ``hidden``, ``weight`` and per-row upstream gradient are
    :func:`make_inputs`'s (those of the other modes). Per teacher scale,
    the teacher (:func:`lp_bench.distill.make_teacher`) and, on GPU, the floor
    (:func:`lp_bench.distill.distill_floor`, six GEMMs); per kind, the reference
    (:func:`lp_bench.distill.distill_reference`: fp32 with TF32 off on GPU, fp64 on CPU).
    """
    _, n, h, v = shape
    hidden, weight, _, grad_out = make_inputs(
        n, h, v, seed=cfg.seed, device=cfg.device, dtype=DTYPES[dtype_name]
    )
    cuda = cfg.device == "cuda"
    fixed = new_row(cfg, shape, dtype_name, env) | {"mode": "distill", "entropy": False}
    fixed["floor_matmuls"] = FLOOR_MATMULS["distill"] if cuda else None
    rows = []
    for scale in cfg.teacher_scales:
        teacher = make_teacher(hidden, weight, scale, seed=cfg.seed)
        floor = None
        if cuda:
            fl = distill_floor(hidden, weight, DistillProblem(*teacher))
            warm = steady_warmup(fl, cfg.warmup, cfg.warm_s)
            floor = statistics.median(time_cuda(fl, warmup=warm, reps=cfg.reps))
        for kind in cfg.kinds:
            problem = DistillProblem(
                *teacher, kind=kind, beta=cfg.beta, temperature=cfg.temperature
            )
            ref = None
            if cfg.check:
                dtype = torch.float32 if cuda else torch.float64
                ref = distill_reference(hidden, weight, problem, grad_out, dtype=dtype)
            for prov in cfg.providers:
                row = fixed | {"provider": prov, "kind": kind, "H_t": scale * h}
                row |= {"beta": cfg.beta if kind == "jsd" else None, "floor_ms": floor}
                row["deterministic"] = is_deterministic(prov)
                _measure_distill(row, cfg, (hidden, weight, grad_out), problem, ref)
                if cuda:
                    torch.cuda.empty_cache()
                rows.append(row)
                if on_row:
                    on_row(row)
            del problem, ref
    return rows


def _measure_distill(
    row: dict, cfg: BenchConfig, student: tuple, problem: DistillProblem, ref: dict | None
) -> None:
    """Time, memory and errors of one distill-mode provider, into ``row`` (a failure is a
    row too): ``err_divergence`` and the gradients' errors for a per-row divergence,
    ``err_loss`` (the summed divergence) for a provider that returns a scalar only."""
    hidden, weight, grad_out = student
    try:
        prep = make_distill_provider(row["provider"], problem)
    except Unsupported as exc:
        row["skipped"] = str(exc)
        return
    except Exception as exc:  # e.g. the op's probe failing otherwise than by ValueError
        row["error"] = failure(exc)
        return
    row["entropy_computed"], row["note"] = False, prep.note
    hl, wl = hidden.detach().requires_grad_(), weight.detach().requires_grad_()

    def clear() -> None:
        hl.grad = wl.grad = None

    def step():
        clear()
        return prep.step(hl, wl, grad_out)

    try:
        times = timed_runs(step, cfg)
        clear()
        peak = peak_bytes(step, cfg.device)
        div, loss = step()
        ms = statistics.median(times)
        row.update(ms=ms, ms_all=times, peak_bytes=peak, peak_gib=peak / 2**30)
        row["x_floor"] = ms / row["floor_ms"] if row["floor_ms"] else None
        if ref is not None and div is not None:
            row["err_divergence"] = rel_err(div, ref["divergence"])
            row["err_grad_hidden"] = rel_err(hl.grad, ref["grad_hidden"])
            row["err_grad_weight"] = rel_err(wl.grad, ref["grad_weight"])
        if ref is not None and loss is not None:
            row["err_loss"] = rel_err(loss, ref["divergence"].sum())
        del div, loss
    except Exception as exc:  # a provider's failure is a row, not the end of the run
        row["error"] = failure(exc)
    clear()


def run_bench(
    cfg: BenchConfig,
    *,
    env: dict | None = None,
    on_row: Callable[[dict], None] | None = None,
    on_problem: Callable[[str], None] | None = None,
    on_rows: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    """Every shape and dtype of ``cfg`` (:func:`bench_problem`); all rows, in order.

    ``on_problem`` is called with ``"<shape> <dtype>"`` before each problem starts,
    ``on_rows`` with every row so far after each problem ends (a record that survives an
    interrupted run).
    """
    rows: list[dict] = []
    for shape in cfg.shapes:
        for dtype_name in cfg.dtypes:
            if on_problem:
                on_problem(f"{shape[0]} {dtype_name}")
            rows += bench_problem(shape, dtype_name, cfg, on_row, env)
            if on_rows:
                on_rows(rows)
    return rows
