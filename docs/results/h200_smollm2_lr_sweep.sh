#!/usr/bin/env bash
# Issue 13 item 6 (learning rate): the h200-smollm2 preset's generate -> extract on 4,096 default prompts, then one
# `sweep` over the learning rate, ~1 epoch (118 steps) each, validation every 40 steps. Run on the GPU host from
# the checkout root after `bash .offline/offline-install && export PYTHONPATH=/root/site:$PWD`; OUT receives the
# figures. Usage: bash docs/results/h200_smollm2_lr_sweep.sh WORKDIR OUT
set -euo pipefail
W=${1:?workdir}; OUT=${2:?out}
mkdir -p "$W" "$OUT"
start=$(date +%s)
python -m stages.cli generate --preset h200-smollm2 --set generate.max_prompts=4096 -o "$W/corpus" 2>&1 | tail -4
python -m stages.cli extract --preset h200-smollm2 --corpus "$W/corpus" -o "$W/cache" 2>&1 | tail -3
echo "data ready after $(( $(date +%s) - start )) s"
python -m stages.cli sweep --preset h200-smollm2 --cache "$W/cache" -o "$W/sweep" \
  --grid lr=3e-4,6e-4,1.2e-3,2.4e-3 --set train.max_steps=118 --set train.eval_every=40 \
  --set train.save_every=1000 --set train.keep_last=1 2>&1 | tail -12
echo "done after $(( $(date +%s) - start )) s"
cp "$W/sweep/sweep.json" "$OUT/lr_sweep.json"
for run in "$W"/sweep/lr=*; do cp "$run/metrics.jsonl" "$OUT/lr_sweep_$(basename "$run")_metrics.jsonl"; done
