#!/usr/bin/env bash
# One setting over several seeds, then a table per seed: how much a tiny-base row owes to its seed.
#   bash scripts/seeds.sh 1337,1,2 --method pic --mem single --mask bidir
#   JOBS=15 bash scripts/seeds.sh 1,2,3,4,5,6,7 --method pic --mem single --mask causal --dtype float32   # a GPU
# --seed draws the held-out questions too, so rows of different seeds are not paired; to pair
# two settings, run both on one seed and use scripts/compare.py.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/checks.sh
case "${1:-}" in -h|--help) arguments "" "$1" ;; esac  # the header
[ $# -ge 1 ] || { echo "usage: bash scripts/seeds.sh SEED,SEED,... TRAIN_FLAGS..." >&2; exit 2; }
SEEDS=$1; shift
OUT=${OUT:-out/seeds}
for flag in "$@"; do  # each run's own; a second one would be overridden in silence
  case $flag in --seed|--seed=*|--out_dir|--out_dir=*)
    echo "error: $flag: seeds.sh sets each run's --seed and --out_dir (OUT=$OUT/seedN)" >&2; exit 1 ;;
  esac
done
last() {  # FLAG ARGS...: the value FLAG is given last ("--flag V" or "--flag=V"), or ""
  local flag=$1 value="" before=""; shift
  for arg in "$@"; do
    if [ "$before" = "$flag" ]; then value=$arg; fi
    case $arg in "$flag="*) value=${arg#*=} ;; esac
    before=$arg
  done
  echo "$value"
}
if [[ $(last --eval_examples "$@") =~ ^0+$ ]]; then  # (checked before any run trains: the table comes after all)
  echo "error: --eval_examples 0: seeds.sh's table reads each run's evaluation" >&2; exit 1
fi
case $(last --method "$@") in teacher|base)
  echo "error: --method $(last --method "$@"): seeds.sh's table reads a compressor's evaluation (eval.py)" >&2; exit 1 ;;
esac
JOBS=${JOBS:-2}                  # runs at a time, one thread each
whole_numbers JOBS
[[ $SEEDS =~ ^[0-9]{1,18}(,[0-9]{1,18})*$ ]] ||  # (train.py refused a long one after the seeds before it trained)
  { echo "error: seeds $SEEDS: want whole numbers of at most 18 digits, like 1337,1,2" >&2; exit 1; }
twice=$(tr , '\n' <<< "$SEEDS" | sed 's/^0*\([0-9]\)/\1/' | sort | uniq -d | head -n 1)
[ -z "$twice" ] || { echo "error: seeds $SEEDS: $twice twice (two runs would train into one dir)" >&2; exit 1; }
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
same_code "$OUT"  # (made here; the same command again resumes its runs)
dirs=() pids=()
trap stop_runs EXIT
reap() {  # waits for a run to end; a failed one is one line, and the script stops there
  local ended="" rc=0 i
  wait -n -p ended || rc=$?
  [ "$rc" = 0 ] || [ -z "${ended:-}" ] || for i in "${!pids[@]}"; do
    [ "${pids[$i]}" != "$ended" ] ||
      { echo "error: ${dirs[$i]} failed: $(tail -n 1 "${dirs[$i]}.log") (all of it: ${dirs[$i]}.log)" >&2; exit 1; }
  done
  [ -n "${ended:-}" ]  # (false: none left; wait -p unsets it)
}
for s in ${SEEDS//,/ }; do
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do reap; done
  dirs+=("$OUT/seed$s")
  resume=$([ -z "$(find "$OUT/seed$s" -name run.json 2> /dev/null)" ] || echo --resume)  # (begun by an earlier command)
  python train.py "$@" --seed "$s" --out_dir "$OUT/seed$s" --quiet $resume >> "$OUT/seed$s.log" 2>&1 & pids+=($!)
done
while reap; do :; done
n=$(last --eval_examples "$@")  # (a run resumed with nothing to train keeps the --eval_examples it began with)
for d in "${dirs[@]}"; do  # one table per seed (its own questions and teacher), read from metrics.json
  echo "== $d"; python eval.py "$d" ${n:+--n "$n"}
done
