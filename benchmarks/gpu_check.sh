#!/usr/bin/env bash
# GPU check (issue 13 point 7): the learner, sampler, push and rollout-length benchmarks plus the FP8 vs BF16
# matmul benchmark on one GPU, at sizes that fit about 8 minutes on one H200; every benchmark's RESULT line is
# appended to one results file and a summary is printed at the end.
#
#   benchmarks/gpu_check.sh                       # on a GPU host (JAX_PLATFORMS defaults to cuda here)
#   GPU_CHECK_SMOKE=1 benchmarks/gpu_check.sh     # CPU smoke run: tiny sizes, checks the script end to end
#
# Environment: PYTHON (default .venv/bin/python), GPU_CHECK_OUT (results file; default $OUT/gpu_results.txt when
# $OUT is set, else benchmarks/gpu_results.txt), GPU_CHECK_SMOKE=1 (tiny sizes on CPU), GPU_CHECK_BUDGET_S (total
# seconds, default 470: a benchmark whose timeout would end past it is skipped and says so), JAX_PLATFORMS.
# Each benchmark runs under its own `timeout`; its full log goes next to the results file (<name>.log). A failed,
# timed-out or skipped benchmark writes `<name> FAILED ...` / `<name> SKIPPED ...` instead of its RESULT line; the
# script's exit status is the number of benchmarks without a RESULT line.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
SMOKE=${GPU_CHECK_SMOKE:-0}
if [ -n "${GPU_CHECK_OUT:-}" ]; then
  RESULTS=$GPU_CHECK_OUT
elif [ -n "${OUT:-}" ]; then
  RESULTS=$OUT/gpu_results.txt
else
  RESULTS=benchmarks/gpu_results.txt
fi
mkdir -p "$(dirname "$RESULTS")"
LOGDIR=$(dirname "$RESULTS")/gpu_check_logs
mkdir -p "$LOGDIR"
BUDGET=${GPU_CHECK_BUDGET_S:-470}
if [ "$SMOKE" = 1 ]; then
  export JAX_PLATFORMS=cpu
  BUDGET=${GPU_CHECK_BUDGET_S:-1800}
elif [ -z "${JAX_PLATFORMS:-}" ]; then  # the benchmarks default to cpu when it is unset
  if command -v nvidia-smi >/dev/null; then export JAX_PLATFORMS=cuda
  elif command -v rocm-smi >/dev/null; then export JAX_PLATFORMS=rocm
  else export JAX_PLATFORMS=cuda; fi
fi
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
START=$(date +%s)
FAILED=0
{
  echo "# gpu_check $(date -u '+%Y-%m-%d %H:%M:%S UTC') smoke=$SMOKE JAX_PLATFORMS=$JAX_PLATFORMS commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | sed 's/^/# gpu: /'
} >> "$RESULTS"

# run NAME TIMEOUT_S ARGS...: one benchmark; appends "NAME <its last RESULT line>" or a FAILED / SKIPPED line.
run() {
  local name=$1 limit=$2
  shift 2
  local now left rc line
  now=$(date +%s)
  left=$((BUDGET - (now - START)))
  if [ "$left" -lt "$limit" ]; then
    echo "$name SKIPPED (timeout ${limit}s > ${left}s left of the ${BUDGET}s budget)" | tee -a "$RESULTS"
    FAILED=$((FAILED + 1))
    return
  fi
  echo "== $name (timeout ${limit}s): $*"
  timeout -k 10 "$limit" "$PY" "$@" > "$LOGDIR/$name.log" 2>&1
  rc=$?
  line=$(grep '^RESULT ' "$LOGDIR/$name.log" | tail -n 1)
  if [ "$rc" -eq 0 ] && [ -n "$line" ]; then
    echo "$name $line" | tee -a "$RESULTS"
  else
    [ "$rc" -eq 124 ] && rc="$rc (timed out after ${limit}s)"
    echo "$name FAILED rc=$rc; last lines of $LOGDIR/$name.log:" | tee -a "$RESULTS"
    tail -n 5 "$LOGDIR/$name.log" | sed 's/^/    /' | tee -a "$RESULTS"
    FAILED=$((FAILED + 1))
  fi
  echo "   $(( $(date +%s) - now ))s"
}

if [ "$SMOKE" = 1 ]; then
  run fp8_matmul 300 benchmarks/fp8_matmul.py --sizes 128 --iters 1
  run fp8_experts 300 benchmarks/fp8_experts.py --device --experts 4 --rows 24 --hidden 256 --inter 256 --iters 1
  run sampler 900 benchmarks/sampler.py --configs tiny --batches 2 --modes bf16 --ns 33 48 --rounds 1 --hf-dtypes \
    --skip-memory --compile-cache ''
  run learner_mfu 600 benchmarks/learner_scale.py --sections mfu --mfu-config tiny --mfu-batch 1 --mfu-seq 32 --runs 1
  run weight_push 600 benchmarks/weight_push.py --layouts 1 --runs 1 --quantize-on actor
  run rollout_lengths 600 benchmarks/rollout_lengths.py --config tiny --requests 8 --group 4 --slots 4 --scale 0.0625
  run sampler_memory 900 benchmarks/sampler.py --memory-only --memory-config tiny --compile-cache ''
else
  # in order of priority: a benchmark whose timeout no longer fits the budget is skipped
  # FP8 vs BF16 GEMM throughput (4096^3 and 8192^3; RESULT: 8192), the rollout's fp8_linear beside it
  run fp8_matmul 60 benchmarks/fp8_matmul.py --sizes 4096 8192 --iters 20
  # one rank's Flash expert FFN at decode (32 experts x 48 rows): the block-scaled FP8 kernel vs XLA's FP8 dots vs
  # dequant, timed beside their roofline, outputs compared (the kernel has never run on a GPU before this)
  run fp8_experts 90 benchmarks/fp8_experts.py --device --rows 48 --iters 20
  # decode tok/s vs the HBM roofline (small, B = 8, bf16 and FP8 weights; no transformers run)
  run sampler 150 benchmarks/sampler.py --configs small --batches 8 --modes bf16 fp8 --rounds 2 --hf-dtypes \
    --skip-memory --compile-cache ''
  # train-step MFU, small config (6 layers), 8 x 2048 tokens, bf16 compute
  run learner_mfu 100 benchmarks/learner_scale.py --sections mfu --mfu-config small --mfu-batch 8 --mfu-seq 2048 \
    --runs 3
  # actor -> rollout push on one device (colocated: cast + FP8 quantisation + verification on the GPU)
  run weight_push 60 benchmarks/weight_push.py --layouts 1 --runs 3 --quantize-on actor
  # continuous vs static batching, RL-like length spread (lengths 32 / 512)
  run rollout_lengths 80 benchmarks/rollout_lengths.py --config tiny --slots 32 --scale 0.5
  # the generate program's compiled memory per weight mode on the GPU (`tie_to` "barrier" there)
  run sampler_memory 100 benchmarks/sampler.py --memory-only --compile-cache ''
fi

echo
echo "== summary ($(( $(date +%s) - START ))s; results appended to $RESULTS, logs in $LOGDIR)"
awk '/^# gpu_check /{block=""} {block=block $0 "\n"} END{printf "%s", block}' "$RESULTS"
exit "$FAILED"
