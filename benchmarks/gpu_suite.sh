#!/usr/bin/env bash
# The GPU runbook: one device-tool call runs the GPU-marked tests, then the benchmarks.
# Usage (repository root, on a CUDA host without nox, e.g. the device tool):
#   bash benchmarks/gpu_suite.sh [tests|tests-core|tests-rest] [megatron] [hf] [bench] [loss] [sweep]
#       [profile-step] [ncu] [tp] [ab-tp] [ab] [ab-bits] [colsum] [power]
#   (default: tests megatron bench sweep)
# SWEEP_ARGS / SWEEP_TAG pass options to the sweep stage (sweep_tiles.py --help);
# STEP_SHAPES (default S1,S4), STEP_TRACE=1 (chrome traces, large) and STEP_ARGS (e.g.
# "--softcap 30 --bias") to profile-step; POWER_SHAPES (default S2,S4) to power
# (benchmarks/step_power.py: SM clock and board power over sustained step phases);
# STEP_SHAPES also to ncu (default S2,S1; Nsight Compute's counters, on hosts where ncu can
# read them); the bench stage runs the whole grid (lp bench --grid: train/fwd x entropy
# off/on x default/deterministic, S1-S6) into $OUT/bench/bench.json and renders it with
# lp report into $OUT/bench/bench.md; BENCH_SHAPES (default S1,S2,S3,S4,S5,S6),
# BENCH_BACKENDS (lp bench --backends; default: the grid's) and BENCH_ARGS (more lp bench
# options, e.g. "--mode train") narrow it; the loss stage runs lp bench --mode loss (a
# DAPO + k3 KL step: linear_logprob_loss, linear_logprob + the loss, the materialized path,
# liger's GRPO loss) into $OUT/loss/bench.{json,md}, with the same three variables; AB_OLD to ab-tp (an older tree's
# packages/lp-kernels/src, e.g. made by `git archive REV packages/lp-kernels/src | tar -x -C
# _old` before the call and carried with it; AB_SHAPES, AB_BACKENDS: its lp bench
# options); ab: the same on one GPU, lp bench alternating between this tree and AB_OLD
# (AB_RUNS runs each, default 2; AB_SHAPES default S1,S2,S3,S4; AB_BACKENDS default
# lp-triton; AB_ARGS more options, e.g. "--softcap 30 --bias" or "--mode fwd"), one line
# per run and shape (ms and x floor), then the median milliseconds of each tree and their
# ratio: a kernel change's A/B in one call; colsum: benchmarks/colsum_tile.py without and with
# --softcap 30 (COLSUM_SHAPES, default S1,S2: the blocks of H 4096 and 2048) into
# $OUT/colsum*.json; MARK to the pytest stages (default "gpu or multigpu"; MARK=gpu skips
# the NCCL tests, e.g. tests-core after tp on -x2).
# Writes logs, JUnit XML and bench/bench.{json,md,png} under $OUT (default ./gpu-out).
# megatron-core / liger-kernel / cut-cross-entropy wheels, when present under .whl/,
# are installed into /tmp/site first (the GPU image lacks them). Set LP_COMMIT to the
# commit under test where the checkout's git metadata is not reliable (a copied tree):
# lp bench records it in bench.json.
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
    hf)  # lp-hf on the GPU: a real vocabulary, bf16, parity and peak memory vs the logits path
      run_pytest hf packages/lp-hf/tests -s || status=1 ;;
    ab-bits)  # bitwise A/B of every output and gradient against an older tree (AB_OLD)
      python3 benchmarks/ab_bits.py --device cuda --out "$OUT/bits-new.json" \
        > "$OUT/bits-new.log" 2>&1 || status=1
      PYTHONPATH=$PWD/${AB_OLD:?AB_OLD: the older tree\'s lp-kernels src}:$PYTHONPATH \
        python3 benchmarks/ab_bits.py --device cuda --out "$OUT/bits-old.json" \
        > "$OUT/bits-old.log" 2>&1 || status=1
      python3 benchmarks/ab_bits.py --compare "$OUT/bits-old.json" "$OUT/bits-new.json" \
        | tail -n 20 || status=1 ;;
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
    bench)  # the grid into one bench.json, then its markdown tables (docs/benchmarks.md)
      mkdir -p "$OUT/bench"
      python3 -m lp_bench.cli bench --grid --shapes "${BENCH_SHAPES:-S1,S2,S3,S4,S5,S6}" \
        ${BENCH_BACKENDS:+--backends "$BENCH_BACKENDS"} ${BENCH_ARGS:-} --out "$OUT/bench" \
        2>&1 | tee "$OUT/bench/bench.log" | tail -n 60 || status=1
      python3 -m lp_bench.cli report "$OUT/bench/bench.json" > "$OUT/bench/bench.md" \
        || status=1
      cat "$OUT/bench/bench.md" ;;
    loss)  # lp bench --mode loss into one bench.json, then its markdown tables
      mkdir -p "$OUT/loss"
      python3 -m lp_bench.cli bench --mode loss --shapes "${BENCH_SHAPES:-S1,S2,S3,S4,S5,S6}" \
        ${BENCH_BACKENDS:+--backends "$BENCH_BACKENDS"} ${BENCH_ARGS:-} --out "$OUT/loss" \
        2>&1 | tee "$OUT/loss/bench.log" | tail -n 40 || status=1
      python3 -m lp_bench.cli report "$OUT/loss/bench.json" > "$OUT/loss/bench.md" \
        || status=1
      cat "$OUT/loss/bench.md" ;;
    colsum)  # the bias gradient's column sums, tl.sum against the reduce-scatter: checks, block times
      for cap in "" 30; do
        python3 benchmarks/colsum_tile.py --shapes "${COLSUM_SHAPES:-S1,S2}" ${cap:+--softcap $cap} \
          --out "$OUT/colsum${cap:+-cap$cap}.json" || status=1
      done ;;
    sweep)
      python3 benchmarks/sweep_tiles.py ${SWEEP_ARGS:-} --out "$OUT/sweep${SWEEP_TAG:-}.json" 2>&1 \
        | tee "$OUT/sweep${SWEEP_TAG:-}.log" | tail -n 30 || status=1 ;;
    tp)  # issues 4 and 8: every GPU of the host; NCCL parity and bitwise TP invariance at the
      # S2 head (TP 2/4/8 as present), then lp bench --tp over all GPUs at S2
      gpus=$(nvidia-smi -L | wc -l)
      run_pytest tp packages/lp-kernels/tests/test_gpu.py -k "s2_head or deterministic_bitwise" \
        || status=1
      mkdir -p "$OUT/tp"
      torchrun --standalone --nproc-per-node "$gpus" -m lp_bench.cli bench --tp "$gpus" \
        --shapes S2 --backends lp-triton,lp-triton-det --reps 3 --warmup 1 --out "$OUT/tp" \
        2>&1 | tee "$OUT/tp/bench.log" | tail -n 15 || status=1 ;;
    ab-tp)  # A/B of the TP step against an older tree (AB_OLD), alternating, 4 runs each;
      # both sides run this tree's lp bench (lp-bench/src) on their own lp_kernels
      gpus=$(nvidia-smi -L | wc -l)
      for i in 1 2 3 4; do
        for tag in new old; do
          src=$pk/lp-kernels/src
          [ "$tag" = old ] && src=$PWD/${AB_OLD:?AB_OLD: the older tree\'s lp-kernels src}
          [ "$i" = 1 ] && echo "$tag: $(PYTHONPATH=$src python3 -c \
            'import lp_kernels; print(lp_kernels.__file__)')"
          PYTHONPATH=$src:$pk/lp-testing/src:$pk/lp-megatron/src:$pk/lp-bench/src${PYTHONPATH:+:$PYTHONPATH} \
            torchrun --standalone --nproc-per-node "$gpus" -m lp_bench.cli bench --tp "$gpus" \
            --shapes "${AB_SHAPES:-S2}" --backends "${AB_BACKENDS:-lp-triton,lp-triton-det}" \
            --reps 5 --warmup 1 --out "$OUT/ab-$tag-$i" > "$OUT/ab-$tag-$i.log" 2>&1 || status=1
          echo "$tag $i: $(grep -E '^ *[^ ]+ +[^ ]+ +[^ ]+ +lp-' "$OUT/ab-$tag-$i.log" | tr -s ' ' | tr '\n' ';')"
        done
      done ;;
    ab)  # single-GPU A/B of lp bench against an older tree (AB_OLD), runs alternating;
      # few files (the device tool brings back at most 8): one record per run
      # (ab-TAG-I.json), the runs' logs appended to one ab.log
      for i in $(seq "${AB_RUNS:-2}"); do
        for tag in new old; do
          src=$pk/lp-kernels/src
          [ "$tag" = old ] && src=$PWD/${AB_OLD:?AB_OLD: the older tree\'s lp-kernels src}
          echo "=== ab-$tag-$i: $src" >> "$OUT/ab.log"
          PYTHONPATH=$src:$pk/lp-testing/src:$pk/lp-megatron/src:$pk/lp-bench/src${PYTHONPATH:+:$PYTHONPATH} \
            python3 -m lp_bench.cli bench --shapes "${AB_SHAPES:-S1,S2,S3,S4}" \
            --backends "${AB_BACKENDS:-lp-triton}" --reps 3 --no-check ${AB_ARGS:-} \
            --out "$OUT/ab-$tag-$i" >> "$OUT/ab.log" 2>&1 || status=1
          mv "$OUT/ab-$tag-$i/bench.json" "$OUT/ab-$tag-$i.json" && rm -rf "${OUT:?}/ab-$tag-$i"
        done
      done
      python3 benchmarks/ab_summary.py "$OUT" || status=1 ;;
    ncu)  # issue 3: hardware counters of each chunk kernel against cuBLAS's (ncu_chunk.py)
      for s in $(echo "${STEP_SHAPES:-S2,S1}" | tr , ' '); do
        (cd benchmarks && ncu --clock-control none --nvtx --nvtx-include "measured/" \
          --section SpeedOfLight --section WarpStateStats --section LaunchStats \
          --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
          --section Occupancy -f -o "$OUT/ncu-$s" python3 ncu_chunk.py --shape "$s" --forward \
          > "$OUT/ncu-$s.log" 2>&1) || status=1
        ncu --import "$OUT/ncu-$s.ncu-rep" --page raw --csv > "$OUT/ncu-$s.csv" || status=1
        python3 benchmarks/ncu_summary.py "$OUT/ncu-$s.csv" --out "$OUT/ncu-$s.json" \
          --calls "$(grep '^ran ' "$OUT/ncu-$s.log" | sed 's/^ran //; s/ //g')" || status=1
      done ;;
    profile-step)  # issue 3: kernel-by-kernel busy time of one step against its wall time
      (cd benchmarks && python3 profile_step.py --shapes ${STEP_SHAPES:-S1,S4} --det ${STEP_TRACE:+--trace "$OUT"} \
        ${STEP_ARGS:-} --out "$OUT/step.json") 2>&1 | tee "$OUT/step.log" | tail -n 60 || status=1 ;;
    power)  # sustained step phases (plain, softcap 30 + bias, each alone, 4 matmuls), SM clock and power
      python3 benchmarks/step_power.py --shapes "${POWER_SHAPES:-S2,S4}" --out "$OUT/power.json" \
        2>&1 | tee "$OUT/power.log" || status=1 ;;
    *) echo "unknown stage $stage"; status=2 ;;
  esac
done
exit $status
