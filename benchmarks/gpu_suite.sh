#!/usr/bin/env bash
# The GPU runbook: one device-tool call runs GPU-marked tests and benchmarks, offline (a CUDA
# host with torch and triton, no network, no nox), from the repository root:
#   bash benchmarks/gpu_suite.sh [STAGE...]        (default: tests megatron bench sweep)
# Stages:
#   tests | tests-core + tests-rest   GPU tests (MARK, default "gpu or multigpu"; MARK=gpu
#                                     skips NCCL); tests-core/-rest: the kernels' in two calls
#   megatron, hf                      lp-megatron's and lp-hf's GPU tests
#   bench                             lp bench --grid (BENCH_SHAPES, default S1-S6;
#                                     BENCH_BACKENDS; BENCH_ARGS) -> bench/bench.{json,md}
#   loss | distill                    lp bench --mode loss / distill (distill: S1,S2,S4,S5;
#                                     BENCH_ARGS e.g. "--kind all"), same variables -> STAGE/bench.*
#   sweep                             benchmarks/sweep.py SWEEP_OP (tiles, default, or loss;
#                                     SWEEP_ARGS, e.g. "--bits --det"; SWEEP_TAG)
#   profile-step                      benchmarks/profile_step.py (STEP_SHAPES, default S1,S4;
#                                     STEP_ARGS, e.g. "--softcap 30 --bias"; STEP_TRACE=1)
#   tp                                TP tests and lp bench --tp over every GPU at S2
#   ab-bits                           ab.py bits on this tree and on AB_OLD (an older tree's
#                                     lp-kernels src, e.g. `git archive REV packages/lp-kernels/src
#                                     | tar -x -C _old`, carried), then ab.py compare
#   ab                                ab.py time against trees made by `ab.py prepare` (carry
#                                     _ab_trees): AB_TREES (e.g. base), AB_MODES (default train),
#                                     AB_SHAPES (default S1,S2,S3,S4), AB_ARGS (e.g. "--sets plain,bias")
# Writes logs, JUnit XML and records under $OUT (default ./gpu-out). Wheels under .whl/
# (megatron-core, liger-kernel, cut-cross-entropy) are installed into /tmp/site first. Set
# LP_COMMIT to the commit under test where the checkout's git metadata is stale (a copy).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
pk=$PWD/packages
src_path=$(printf '%s:' "$pk"/*/src)  # every workspace package from source
src_path=${src_path%:}
export PYTHONPATH=$src_path${PYTHONPATH:+:$PYTHONPATH}
stages=${*:-tests megatron bench sweep}
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$OUT/gpu.txt"
run_pytest() {  # name, pytest args...
  # The log goes to $OUT line by line (-v), so a call cut off by the device tool's time
  # limit still brings back what ran; the last 40 lines (with the 15 slowest tests, for
  # planning the next call) are echoed at the end.
  local name=$1 rc
  shift
  python3 -m pytest -p lp_testing.plugin -m "${MARK:-gpu or multigpu}" -v -W ignore --durations=15 \
    --junitxml="$OUT/$name.xml" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  tail -n 40 "$OUT/$name.log"
  return "$rc"
}
for stage in $stages; do
  echo "=== $stage $(date +%T)"
  case $stage in
    tests)
      run_pytest kernels packages/lp-kernels/tests packages/lp-testing/tests \
        packages/lp-bench/tests packages/lp-hf/tests || status=1 ;;
    tests-core)  # the GPU-only modules, determinism and deterministic mode (not the parity grid)
      run_pytest kernels-core packages/lp-kernels/tests/test_gpu.py \
        packages/lp-kernels/tests/test_determinism.py \
        packages/lp-kernels/tests/test_deterministic.py || status=1 ;;
    tests-rest)  # with tests-core, the kernels part of tests in two calls of the device tool
      run_pytest kernels-rest packages/lp-kernels/tests \
        --ignore=packages/lp-kernels/tests/test_gpu.py \
        --ignore=packages/lp-kernels/tests/test_determinism.py \
        --ignore=packages/lp-kernels/tests/test_deterministic.py || status=1 ;;
    megatron)
      run_pytest megatron packages/lp-megatron/tests || status=1 ;;
    hf)  # lp-hf on the GPU: a real vocabulary, bf16, parity and peak memory vs the logits path
      run_pytest hf packages/lp-hf/tests -s || status=1 ;;
    bench)  # the grid into one bench.json, then its markdown tables (docs/benchmarks.md)
      mkdir -p "$OUT/bench"
      python3 -m lp_bench.cli bench --grid --shapes "${BENCH_SHAPES:-S1,S2,S3,S4,S5,S6}" \
        ${BENCH_BACKENDS:+--backends "$BENCH_BACKENDS"} ${BENCH_ARGS:-} --out "$OUT/bench" \
        2>&1 | tee "$OUT/bench/bench.log" | tail -n 60 || status=1
      python3 -m lp_bench.cli report "$OUT/bench/bench.json" > "$OUT/bench/bench.md" \
        || status=1
      cat "$OUT/bench/bench.md" ;;
    loss|distill)  # lp bench --mode loss / distill into one bench.json, then its tables
      mkdir -p "$OUT/$stage"
      shapes=S1,S2,S3,S4,S5,S6
      [ "$stage" = distill ] && shapes=S1,S2,S4,S5
      python3 -m lp_bench.cli bench --mode "$stage" --shapes "${BENCH_SHAPES:-$shapes}" \
        ${BENCH_BACKENDS:+--backends "$BENCH_BACKENDS"} ${BENCH_ARGS:-} --out "$OUT/$stage" \
        2>&1 | tee "$OUT/$stage/bench.log" | tail -n 40 || status=1
      python3 -m lp_bench.cli report "$OUT/$stage/bench.json" > "$OUT/$stage/bench.md" \
        || status=1
      cat "$OUT/$stage/bench.md" ;;
    sweep)  # variants of the pinned launch config under use_config, against the floor
      python3 benchmarks/sweep.py "${SWEEP_OP:-tiles}" ${SWEEP_ARGS:-} \
        --out "$OUT/sweep${SWEEP_TAG:-}.json" 2>&1 | tee "$OUT/sweep${SWEEP_TAG:-}.log" \
        | tail -n 40 || status=1 ;;
    profile-step)  # kernel-by-kernel busy time of one step against its wall time
      python3 benchmarks/profile_step.py --shapes "${STEP_SHAPES:-S1,S4}" --det \
        ${STEP_TRACE:+--trace "$OUT"} ${STEP_ARGS:-} --out "$OUT/step.json" 2>&1 \
        | tee "$OUT/step.log" | tail -n 60 || status=1 ;;
    tp)  # every GPU of the host: NCCL parity and bitwise TP invariance at the S2 head
      # (TP 2/4/8 as present), then lp bench --tp over all GPUs at S2
      gpus=$(nvidia-smi -L | wc -l)
      run_pytest tp packages/lp-kernels/tests/test_gpu.py -k "s2_head or deterministic_bitwise" \
        || status=1
      mkdir -p "$OUT/tp"
      torchrun --standalone --nproc-per-node "$gpus" -m lp_bench.cli bench --tp "$gpus" \
        --shapes S2 --backends lp-triton,lp-triton-det --reps 3 --warmup 1 --out "$OUT/tp" \
        2>&1 | tee "$OUT/tp/bench.log" | tail -n 15 || status=1 ;;
    ab-bits)  # every output's and gradient's digest on this tree and on AB_OLD, compared
      python3 benchmarks/ab.py bits --device cuda --out "$OUT/bits-new.json" \
        > "$OUT/bits-new.log" 2>&1 || status=1
      PYTHONPATH=$PWD/${AB_OLD:?AB_OLD: the older tree\'s lp-kernels src}:$PYTHONPATH \
        python3 benchmarks/ab.py bits --device cuda --out "$OUT/bits-old.json" \
        > "$OUT/bits-old.log" 2>&1 || status=1
      python3 benchmarks/ab.py compare "$OUT/bits-old.json" "$OUT/bits-new.json" \
        | tail -n 20 || status=1 ;;
    ab)  # a kernel change's A/B in one process: bits by torch.equal, then paired rounds
      python3 benchmarks/ab.py time --trees "${AB_TREES:?AB_TREES: trees made by ab.py prepare}" \
        --modes "${AB_MODES:-train}" --shapes "${AB_SHAPES:-S1,S2,S3,S4}" ${AB_ARGS:-} \
        --out "$OUT/ab.json" 2>&1 | tee "$OUT/ab.log" | tail -n 80 || status=1 ;;
    *) echo "unknown stage $stage"; status=2 ;;
  esac
done
exit $status
