#!/usr/bin/env bash
# Every paper's headline comparison at small scale, on the embedded default, with one
# shared base/teacher and fixed seeds; then one table, each paper's claims with a verdict
# from paired-bootstrap intervals, and RESULTS.md generated whole from this run.
#   bash scripts/reproduce.sh            # every run at its method's default; rewrites RESULTS.md
#   bash scripts/reproduce.sh --smoke    # every entry for 2 steps, 4 questions (CI); report in $OUT-smoke
#   ITERS=700 EXAMPLES=1000 bash scripts/reproduce.sh   # 700 steps for every run, 1000 questions
#   INIT_FROM=/ckpt/Qwen3-1.7B DATA=train.json EVAL_DATA=dev.json bash scripts/reproduce.sh   # a GPU
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/checks.sh && arguments "--smoke" "$@"
if [ "${1:-}" = "--smoke" ]; then  # its own defaults; a setting given still wins (ITERS=5 ran 2 steps)
  : "${ITERS:=2}" "${EXAMPLES:=4}" "${RESULTS:=${OUT:-out/suite}-smoke/RESULTS.md}"
  [ -z "${INIT_FROM:-}${DATA:-}${EVAL_DATA:-}" ] ||  # (they were read by nothing)
    { echo "error: INIT_FROM, DATA, EVAL_DATA: --smoke trains its own tiny base on the synthetic set" >&2; exit 1; }
fi
# Every run trains at its method's default (the steps and flags of `python train.py --method M`,
# the README's defaults table); ITERS overrides them all. Two runs at a time with one thread each
# (small models use cores better so: ~1.3x the throughput of one run on two threads); the runs
# of one suite share the teacher rows (eval.sibling_teacher_rows). Each run's wall time is in the log.
ITERS=${ITERS-}                  # training steps for every run and stage ("" = each method's default)
PRE_ITERS=${PRE_ITERS:-${ITERS:-100}}  # --pretrain: pic's ae+lm (and on a real checkpoint ata's rel)
JOBS=${JOBS:-2}                  # runs at a time
EXAMPLES=${EXAMPLES:-400}        # held-out questions per row (the same questions for every row)
SEED=${SEED:-1337}
OUT=${OUT:-out/suite}
RESULTS=${RESULTS:-RESULTS.md}   # the generated report; the plot goes beside it (.png)
whole_numbers ITERS PRE_ITERS JOBS EXAMPLES SEED
at_most 40 ITERS PRE_ITERS && at_most 20 EXAMPLES
for var in DATA EVAL_DATA; do  # the tiny base's suite reads its synthetic set: a file without INIT_FROM is a slip
  if [ -n "${INIT_FROM:-}" ]; then
    [ -f "${!var:-}" ] || { echo "error: INIT_FROM needs $var=a QA file (${var}=${!var:-}: no such file)" >&2; exit 1; }
  elif [ -n "${!var:-}" ]; then
    echo "error: $var=${!var} without INIT_FROM: the tiny base's suite trains on its synthetic set" >&2; exit 1
  fi
done
python scripts/results_md.py --check RESULTS --out "$RESULTS"  # the report it writes last: checked before any run
[ "${1:-}" != --smoke ] || OUT=$OUT-smoke
same_code "$OUT"  # (made here; the same command again resumes its runs: train_one)
CORES=$(getconf _NPROCESSORS_ONLN)    # nproc would read OMP_NUM_THREADS back
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( CORES / JOBS > 0 ? CORES / JOBS : 1 ))}
start=$(date +%s)
EVAL_EACH=$EXAMPLES              # each run evaluates itself after training (eval.py), JOBS at a time
COMMON=(--seed "$SEED" --quiet)
BASE=tiny_base
CTOK_ITERS=(--max_iters 500)     # tiny base: the multi-ratio tokens' steps, as RESULTS.md's rows ran them
CMD="${ITERS:+ITERS=$ITERS }${ITERS:-PRE_ITERS=$PRE_ITERS }JOBS=$JOBS EXAMPLES=$EXAMPLES SEED=$SEED${INIT_FROM:+ INIT_FROM=$INIT_FROM DATA=${DATA:-} EVAL_DATA=${EVAL_DATA:-}} bash scripts/reproduce.sh"
if [ "${1:-}" = "--smoke" ]; then
  BASE=$OUT/base CMD="bash scripts/reproduce.sh --smoke"
  EVAL_EACH=0  # the table's one eval.py evaluates every run: a process start costs more than 4 questions
  COMMON+=(--batch_size 2 --eval_interval 2 --init_from "$BASE")  # (2 steps: one validation and checkpoint, at the end)
  python train.py --method base --out_dir "$BASE" --max_iters 2 --batch_size 2 --quiet \
    $([ ! -f "$BASE/run.json" ] || echo --resume)  # (trained anew, it changed the base under the runs it resumes)
elif [ -n "${INIT_FROM:-}" ]; then
  BASE=$INIT_FROM CTOK_ITERS=()
  COMMON+=(--init_from "$INIT_FROM" --data "$DATA" --eval_data "$EVAL_DATA")
fi
COMMON+=(--eval_examples "$EVAL_EACH")
evaluated=() pids=()
train_one() {  # NAME FLAGS...: one run dir, its output in NAME.log (ITERS's --max_iters comes last: it wins); a run an
  # earlier command began (a run.json in its dir) resumes, and one it finished only reads its rows back
  local name=$1 t=$SECONDS resume=(); shift
  [ -z "$(find "$OUT/$name" -name run.json 2> /dev/null)" ] || resume=(--resume)
  echo "== $name: $* ${ITERS:+--max_iters $ITERS}${resume[*]:+ (resumed)}"
  python train.py --out_dir "$OUT/$name" "${COMMON[@]}" "$@" ${ITERS:+--max_iters "$ITERS"} "${resume[@]}" \
    >> "$OUT/$name.log" 2>&1 ||
    { echo "error: $name failed: $(tail -n 1 "$OUT/$name.log") (all of it: $OUT/$name.log)" >&2; return 1; }
  echo "   $name: $(( SECONDS - t )) s"
}
job() {  # a command in the background, at most JOBS at a time; a failed one stops the suite
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done
  "$@" & pids+=($!)
}
run() { evaluated+=("$OUT/$1"); job train_one "$@"; }  # trained, evaluated, one table row each
trap stop_runs EXIT

# The longest chains start first, so that no core idles at the end.
# pic Table 4 (pic_blockwise_causal): block-wise vs full causal mask (qa alone), and the paper's two
# stages (pic's default: ae+lm pretraining on the text stream, then qa finetuning from it) against
# qa alone; each at pic's tiny default otherwise (ratio 4, read at 4 and 16)
run pic-blockwise-ae+lm   --method pic --pretrain "$PRE_ITERS"
run pic-blockwise         --method pic --pretrain 0
run pic-causal            --method pic --pretrain 0 --mask causal
# ata_compressor Tables 2 and 6: ATA vs no adaptive allocation vs no selective reconstruction, each
# pretrained with `rel`, then finetuned with `qa` (§3.5); on the tiny base `rel` stalls `qa` on some
# seeds (ata.py), so there each row is ata's default, `qa` alone
for v in "" no_aac no_selective; do
  name=ata${v:+-$v}
  run $name --method ata ${v:+--$v} ${INIT_FROM:+--pretrain "$PRE_ITERS"}
done
# sentence_gist Tables 1-2: quality vs achieved ratio for N_g = 1, 2, 4, 8
for g in 8 4 2 1; do run gist-$g --method sentence_gist --gists $g; done
# meanpool_multi_ratio Tables 1/3: mean pooling vs compression tokens (causal, bidirectional),
# multi- vs single-ratio, no linear layer, ratio sampling
run meanpool              --method meanpool --ratio 4,8,16
run meanpool-single4      --method meanpool --ratio 4
run meanpool-single16     --method meanpool --ratio 16
run meanpool-no_linear    --method meanpool --ratio 4,8,16 --no_linear
run meanpool-sampling     --method meanpool --ratio 4,8,16 --ratio_sampling
# (the tokens as Table 1's multi-ratio rows, which the claims compare; their default trains at 4 alone)
run ctok-causal           --method pic --mem single --mask causal --ratio 4,8,16 "${CTOK_ITERS[@]}"
run ctok-bidir            --method pic --mem single --mask bidir --ratio 4,8,16 "${CTOK_ITERS[@]}"
# sac_semantic_anchor Tables 3-4, at the paper's default 5x: SAC vs w/o bidirectional mask,
# w/o anchor embedding, random anchors
run sac-r5                --method sac --ratio 5
run sac-causal-r5         --method sac --ratio 5 --causal
run sac-no_emb-r5         --method sac --ratio 5 --no_anchor_embedding
run sac-random-r5         --method sac --ratio 5 --anchors random
while true; do wait -n || case $? in 127) break ;; *) exit 1 ;; esac; done  # as each ends (127: none left)

table=()  # the table in the papers' order
for family in meanpool ctok pic gist sac ata; do
  for d in "${evaluated[@]}"; do [[ $(basename "$d") == $family* ]] && table+=("$d"); done
done
[ ${#table[@]} -eq ${#evaluated[@]} ] || { echo "error: a run's name starts with no family above" >&2; exit 1; }
python eval.py "${table[@]}" --n "$EXAMPLES" --out "$OUT/results.json" | tee "$OUT/results.md"
python scripts/claims.py "$OUT/results.json" | tee -a "$OUT/results.md"
wall=$(( $(date +%s) - start ))
echo "suite: $wall s, commit $(git rev-parse --short HEAD 2>/dev/null || echo none)" | tee -a "$OUT/results.md"
OMP_NUM_THREADS=$CORES python scripts/results_md.py "$OUT/results.json" --out "$RESULTS" --base "$BASE" --command "$CMD" --wall_s "$wall"
