#!/usr/bin/env bash
# Issue 13 item 6 (drafter depth): the h200-smollm2 preset's generate -> extract on 8,192 default prompts, then one
# `sweep` over num_draft_layers, 354 steps each (~1.5 epochs), validation every 118 steps. Run on the GPU host from
# the checkout root after `bash .offline/offline-install && export PYTHONPATH=/root/site:$PWD`; OUT receives the
# figures. Usage: bash docs/results/h200_smollm2_depth_sweep.sh WORKDIR OUT data|sweep
set -euo pipefail
W=${1:?workdir}; OUT=${2:?out}; PART=${3:?data or sweep}
mkdir -p "$W" "$OUT"
start=$(date +%s)
if [ "$PART" = data ]; then
  python -m stages.cli generate --preset h200-smollm2 --set generate.max_prompts=8192 -o "$W/corpus" 2>&1 | tail -4
  python -m stages.cli extract --preset h200-smollm2 --corpus "$W/corpus" -o "$W/cache" 2>&1 | tail -3
  echo "data ready after $(( $(date +%s) - start )) s"
  exit 0
fi
python -m stages.cli sweep --preset h200-smollm2 --cache "$W/cache" -o "$W/sweep" \
  --grid num_draft_layers=3,5,8 --set train.max_steps=354 --set train.eval_every=118 \
  --set train.save_every=1000 --set train.keep_last=1 2>&1 | tail -12
echo "done after $(( $(date +%s) - start )) s"
cp "$W/sweep/sweep.json" "$OUT/depth_sweep.json"
for run in "$W"/sweep/num_draft_layers*; do cp "$run/metrics.jsonl" "$OUT/depth_sweep_$(basename "$run" | tr '=' '_')_metrics.jsonl"; done
