#!/usr/bin/env bash
# Every paper's headline comparison at small scale, on the embedded default, with one
# shared base/teacher and fixed seeds; then one table, each paper's claims with a verdict
# from paired-bootstrap intervals, and RESULTS.md generated whole from this run.
#   bash scripts/reproduce.sh            # the suite at the budget below; rewrites RESULTS.md
#   bash scripts/reproduce.sh --smoke    # every entry for 2 steps, 4 questions (CI); report in $OUT-smoke
#   ITERS= EXAMPLES=1000 bash scripts/reproduce.sh   # each method's default steps (300-500), 1000 questions
#   INIT_FROM=/ckpt/Qwen3-1.7B DATA=train.json EVAL_DATA=dev.json bash scripts/reproduce.sh   # a GPU
set -euo pipefail
cd "$(dirname "$0")/.."
# Budget: <= 60 min on 2 CPU cores. From a 60-step, 100-question run (1084 s for the 29 runs):
# ~0.5 s per training step, ~60 questions/s per evaluated ratio; 29 x 150 steps ~ 38 min, and
# 25 runs x (teacher, no context, 1-3 ratios) x 400 questions ~ 12 min.
ITERS=${ITERS-150}               # training steps per run and per pretraining stage ("" = each method's default)
EXAMPLES=${EXAMPLES:-400}        # held-out questions per row (the same questions for every row)
SEED=${SEED:-1337}
OUT=${OUT:-out/suite}
RESULTS=${RESULTS:-RESULTS.md}   # the generated report; the plot goes beside it (.png)
start=$(date +%s)
COMMON=(--seed "$SEED" --quiet)
BASE=tiny_base
CMD="ITERS=$ITERS EXAMPLES=$EXAMPLES SEED=$SEED${INIT_FROM:+ INIT_FROM=$INIT_FROM DATA=${DATA:-} EVAL_DATA=${EVAL_DATA:-}} bash scripts/reproduce.sh"
if [ "${1:-}" = "--smoke" ]; then
  OUT=$OUT-smoke ITERS=2 EXAMPLES=4
  RESULTS=$OUT/RESULTS.md BASE=$OUT/base CMD="bash scripts/reproduce.sh --smoke"
  COMMON+=(--batch_size 2 --init_from "$BASE")
  python train.py --method base --out_dir "$BASE" --max_iters 2 --batch_size 2 --quiet
elif [ -n "${INIT_FROM:-}" ]; then
  BASE=$INIT_FROM
  COMMON+=(--init_from "$INIT_FROM" --data "$DATA" --eval_data "$EVAL_DATA")
fi
[ -n "$ITERS" ] && COMMON+=(--max_iters "$ITERS")
COMMON+=(--eval_examples "$EXAMPLES")
evaluated=()
train_one() { local name=$1; shift; echo "== $name: $*"; python train.py --out_dir "$OUT/$name" "${COMMON[@]}" "$@" > /dev/null; }
run() { train_one "$@"; evaluated+=("$OUT/$1"); }        # trained, evaluated, one table row each
stage() { train_one "$@" --eval_examples 0; }          # a pretraining stage: trained, not evaluated

# meanpool_multi_ratio Tables 1/3: mean pooling vs compression tokens (causal, bidirectional),
# multi- vs single-ratio, no linear layer, ratio sampling
run meanpool              --method meanpool --ratio 4,8,16
run meanpool-single4      --method meanpool --ratio 4
run meanpool-single16     --method meanpool --ratio 16
run meanpool-no_linear    --method meanpool --ratio 4,8,16 --no_linear
run meanpool-sampling     --method meanpool --ratio 4,8,16 --ratio_sampling
run ctok-causal           --method pic --ratio 4,8,16 --mask causal --mem single
run ctok-bidir            --method pic --ratio 4,8,16 --mask bidir --mem single
# pic Table 4: block-wise vs full causal mask (at 4x and 16x), and the paper's two stages
# (ae+lm pretraining on the text stream, then qa finetuning from it)
run pic-blockwise         --method pic --ratio 4,16 --mask blockwise
run pic-causal            --method pic --ratio 4,16 --mask causal
stage pic-pretrain        --method pic --ratio 16 --objective ae+lm
run pic-blockwise-ae+lm   --method pic --ratio 16 --init_from "$OUT/pic-pretrain"
# sentence_gist Tables 1-2: quality vs achieved ratio for N_g = 1, 2, 4, 8
for g in 1 2 4 8; do run gist-$g --method sentence_gist --gists $g; done
# sac Tables 3-4 (at 5x): SAC vs w/o bidirectional mask, w/o anchor embedding, random
# anchors; and SAC at 15x (the paper's other ratio)
run sac-r5                --method sac --ratio 5
run sac-causal-r5         --method sac --ratio 5 --causal
run sac-no_emb-r5         --method sac --ratio 5 --no_anchor_embedding
run sac-random-r5         --method sac --ratio 5 --anchors random
run sac-r15               --method sac --ratio 15
# ata Tables 2 and 6: ATA vs no adaptive allocation vs no selective reconstruction, each
# pretrained with `rel` (reconstruct the relevant chunk) then finetuned with `qa` (§3.4)
for v in "" no_aac no_selective; do
  flags=(--method ata ${v:+--$v}); name=ata${v:+-$v}
  stage $name-rel         "${flags[@]}" --objective rel
  run $name               "${flags[@]}" --init_from "$OUT/$name-rel"
done

python eval.py "${evaluated[@]}" --out "$OUT/results.json" | tee "$OUT/results.md"
python scripts/claims.py "$OUT/results.json" | tee -a "$OUT/results.md"
wall=$(( $(date +%s) - start ))
echo "suite: $wall s, commit $(git rev-parse --short HEAD 2>/dev/null || echo none)" | tee -a "$OUT/results.md"
python scripts/results_md.py "$OUT/results.json" --out "$RESULTS" --base "$BASE" --command "$CMD" --wall_s "$wall"
