#!/usr/bin/env bash
# Issue 13 item 6 (warmup, token budget, target-layer init), one NVIDIA H200, on the cache of the v5 run
# (`bash docs/results/h200_smollm2_v5.sh /root/v5 545 OUT --set train.drafter.init=target` made /root/v5/cache).
# The commands as run on 2026-12-02 (three device calls after v5's first; the GPU time ran out before the
# 8,192-budget run finished and before its evaluation, whose output is lost). Run from the checkout root after
# `bash .offline/offline-install && export PYTHONPATH=/root/site:$PWD`.
# usage: bash docs/results/h200_smollm2_study.sh CACHE OUT [HELDOUT_PROMPTS]
set -uo pipefail
C=${1:?cache}; OUT=${2:?out}; PROMPTS=${3:-$(dirname "$C")/corpus/heldout_prompts.jsonl}
mkdir -p "$OUT"
export COLUMNS=120 PYTHONUNBUFFERED=1
F=(--set train.max_steps=236 --set train.eval_every=59 --set train.save_every=1000 --set train.keep_last=1)
s=$(date +%s)
timeout -s TERM 250 python -m stages.cli sweep --preset h200-smollm2 --cache "$C" -o /root/swA \
  --grid warmup_ratio=0,0.04,0.1 "${F[@]}" >"$OUT/swA.log" 2>&1; echo "A $? $(( $(date +%s) - s )) s"
timeout -s TERM 175 python -m stages.cli sweep --preset h200-smollm2 --cache "$C" -o /root/swB \
  --set train.drafter.init=target --grid 'init_target_layers=[[0,1,2,3,4],[5,11,17,23,29]]' "${F[@]}" \
  >"$OUT/swB.log" 2>&1; echo "B $? $(( $(date +%s) - s )) s"
timeout -s TERM 210 python -m stages.cli sweep --preset h200-smollm2 --cache "$C" -o /root/swC \
  --grid token_budget=8192 --set train.max_steps=472 --set train.eval_every=118 --set train.save_every=1000 \
  --set train.keep_last=1 >"$OUT/swC.log" 2>&1; echo "C $? $(( $(date +%s) - s )) s"
for d in swA swB swC; do
  cp "/root/$d/sweep.json" "$OUT/$d.json" 2>/dev/null
  for r in /root/$d/*/; do [ -f "$r/metrics.jsonl" ] && cp "$r/metrics.jsonl" "$OUT/${d}_$(basename "$r" | tr '=[],:' '______')_metrics.jsonl"; done
done
# The preset's 3 epochs at a token budget of 8,192 (2,841 steps), then held-out decoding.
timeout -s TERM 300 python -m stages.cli train --preset h200-smollm2 --cache "$C" -o /root/tb8k \
  --set train.data.token_budget=8192 --set train.save_every=200 >"$OUT/tb8k_train.log" 2>&1; echo "train $?"
cp /root/tb8k/metrics.jsonl "$OUT/tb8k_metrics.jsonl"
python -m stages.cli evaluate --preset h200-smollm2 --drafter /root/tb8k --prompts "$PROMPTS" \
  --json-file "$OUT/tb8k_eval.json" >"$OUT/tb8k_eval.log" 2>&1; echo "evaluate $?"
