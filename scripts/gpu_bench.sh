#!/usr/bin/env bash
# Issue 79's GPU checks in four device calls of at most 9 minutes each; every command's output goes to
# $OUT/<name>.txt (the device tool's returned folder; default out/gpu_bench, --smoke's out/gpu_bench-smoke), each
# command under its own timeout.
# A session's 15 minutes of device time (the machine's start included) hold about two parts: run them in order,
# a later session going on from the first part not run. Each call names kind="nvidia-h200": eager meanpool kd at
# Llama-3.1-8B shapes peaks at 104 GB (BENCHMARKS.md); on a GPU under 100 GiB (an H100) the 8B training rows run
# at --train_batch 4, not 8, and device.txt says so (their MFU is not the H200 rows' at 8).
#   run(command="bash scripts/gpu_bench.sh part1", timeout_s=600)  # the gpu tests (but CUDA graphs'); bench.py train
#       at Llama-3.1-8B shapes: meanpool kd and the compression tokens, one decoder pass for all ratios and a pass
#       per ratio, eager and --compile
#   run(command="bash scripts/gpu_bench.sh part2", timeout_s=600)  # bench.py attention at B = 8 x 4K (pic block-wise,
#       sentence_gist's listed blocks); ttft from a 16x Memory at Llama-3.2-1B and Llama-3.1-8B, eager and --compile,
#       each with and without generate's CUDA graphs
#   run(command="bash scripts/gpu_bench.sh part3", timeout_s=600)  # meanpool kd against its transformers + peft twin
#       at Llama-3.1-8B (fused projections against peft's module per projection), eager and --compile; its profile
#   run(command="bash scripts/gpu_bench.sh part4", timeout_s=600)  # the CUDA-graph tests; bench.py train at
#       Llama-3.1-8B, --compile --cuda_graphs (meanpool kd, pic qa); its profile
# --smoke (after the part): the same commands at the tiny shapes on a CPU, in seconds: the tests collected, not run,
# no --compile (tests/test_suite.py).
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}:${2:-}:${3:-}" in  # before anything is written
  part[1-4]::|part[1-4]:--smoke:) ;;
  *) echo "usage: bash scripts/gpu_bench.sh part1|part2|part3|part4 [--smoke]" >&2; exit 2 ;;
esac
[ "${2:-}" = --smoke ] || command -v nvidia-smi > /dev/null ||  # (part1 trained 8B shapes on the CPU)
  { echo "error: gpu_bench.sh $1 runs on a GPU machine (no nvidia-smi here); --smoke runs it on the CPU" >&2; exit 1; }
SMOKE=$([ "${2:-}" = --smoke ] && echo 1 || echo "")
OUT=${OUT:-out/gpu_bench}${SMOKE:+-smoke}  # (a smoke run into the GPU's folder replaced its files with CPU rows)
[ -n "${OUT// }" ] && mkdir -p "$OUT" 2> /dev/null && [ -w "$OUT" ] ||  # (it went on, exit 0, writing nothing)
  { echo "error: OUT=$OUT: not a folder this can make or write to" >&2; exit 1; }
ROWS="meanpool kd,meanpool kd per ratio,tokens kd,tokens kd per ratio"
SHAPE=$([ -n "$SMOKE" ] && echo "--tiny" || echo "--shapes llama-3.1-8b")
export PYTHONUNBUFFERED=1  # a step its timeout stops keeps the rows it printed
ITERS=$([ -n "$SMOKE" ] && echo 1 || echo 5)

step() {  # step NAME SECONDS COMMAND...: its output to $OUT/NAME.txt, and a line here
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  echo "$name: rc $rc, $((SECONDS - t0)) s" | tee -a "$OUT/steps.txt"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/device.txt" 2>&1 || echo "no GPU" > "$OUT/device.txt"
git rev-parse --short HEAD >> "$OUT/device.txt" 2>/dev/null || true
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2> /dev/null | head -n 1 || true)
if [ -n "$gpu_mib" ] && [ "$gpu_mib" -lt 102400 ]; then  # (--tiny keeps its own batch of 2)
  SHAPE="$SHAPE --train_batch 4"
  echo "train rows at --train_batch 4: this GPU has $(( gpu_mib / 1024 )) GiB" | tee -a "$OUT/device.txt"
fi
case "${1:-}" in
  part1)
    step gpu_tests 180 python -m pytest -v -p no:cacheprovider -m gpu ${SMOKE:+--co} \
      -n "$([ -n "$SMOKE" ] && echo 0 || echo 4)" -k "not cuda_graph" tests/test_gpu.py  # -v: each test as it ends
      # (a step its timeout stops prints no summary); the CUDA-graph tests: part4, in a step of their own
    step train 160 python benchmarks/bench.py train $SHAPE --methods "$ROWS" --iters "$ITERS"
    [ -n "$SMOKE" ] || step train_compile 200 python benchmarks/bench.py train $SHAPE --methods "$ROWS" --iters 5 --compile
    ;;
  part2)
    if [ -n "$SMOKE" ]; then
      step attention 120 python benchmarks/bench.py attention --lengths 512 --iters 1
    else
      step attention 240 python benchmarks/bench.py attention --attn_batch 8 --lengths 4096 --iters 3
    fi
    TTFT=$([ -n "$SMOKE" ] && echo "--tiny" || echo "--shapes llama-3.2-1b,llama-3.1-8b")
    step ttft 140 python benchmarks/bench.py ttft $TTFT
    [ -n "$SMOKE" ] || step ttft_compile 140 python benchmarks/bench.py ttft $TTFT --compile
    ;;
  part3)
    step twins 200 python benchmarks/hf_twins.py $SHAPE --methods "meanpool kd" --iters "$ITERS"
    if [ -z "$SMOKE" ]; then
      step twins_compile 250 python benchmarks/hf_twins.py $SHAPE --methods "meanpool kd" --iters 5 --compile
      step profile 120 python benchmarks/bench.py train $SHAPE --methods "meanpool kd" --iters 3 --compile --profile
    fi
    ;;
  part4)
    step gpu_graph_tests 120 python -m pytest -v -p no:cacheprovider -m gpu ${SMOKE:+--co} -k cuda_graph tests/test_gpu.py
    if [ -z "$SMOKE" ]; then  # CUDA graphs only on CUDA: the smoke checks the flag's one-line error
      step train_graphs 280 python benchmarks/bench.py train $SHAPE --methods "meanpool kd,pic qa" --iters 5 \
        --compile --cuda_graphs
      step profile_graphs 170 python benchmarks/bench.py train $SHAPE --methods "meanpool kd" --iters 3 --compile \
        --cuda_graphs --profile
    else
      step train_graphs 60 python benchmarks/bench.py train $SHAPE --cuda_graphs
    fi
    ;;
esac
