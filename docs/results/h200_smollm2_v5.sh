#!/usr/bin/env bash
# Issue 13 (v5): the h200-smollm2 preset with extra --set options (e.g. --set train.drafter.init=target), on one
# NVIDIA H200 through the device tool, in calls of at most ~10 minutes: each call runs the same command under
# `timeout -s TERM` (training saves a checkpoint on SIGTERM; a rerun skips the finished stages and resumes), then
# copies what there is (pipeline.json, metrics.jsonl, run.json, per-epoch evaluations, cache info) to OUT.
# Run from the checkout root after `bash .offline/offline-install && export PYTHONPATH=/root/site:$PWD`.
# usage: [PRESET=name] bash docs/results/h200_smollm2_v5.sh WORKDIR SECONDS OUT [--set section.field=value ...]
# (PRESET: another preset than h200-smollm2, e.g. h200-smollm2-online)
set -uo pipefail
W=${1:?workdir}; S=${2:?seconds}; OUT=${3:?out}; shift 3
PRESET=${PRESET:-h200-smollm2}
mkdir -p "$W" "$OUT"
export PYTHONUNBUFFERED=1 COLUMNS=120
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/log.txt"
echo "## $(date -u +%FT%TZ) python -m stages.cli run --preset $PRESET --workdir $W $*" | tee -a "$OUT/log.txt"
timeout -s TERM -k 30 "$S" python -m stages.cli run --preset "$PRESET" --workdir "$W" "$@" >>"$OUT/log.txt" 2>&1
echo "## $(date -u +%FT%TZ) exit $?" | tee -a "$OUT/log.txt"
cp "$W/pipeline.json" "$OUT/pipeline.json" 2>/dev/null
cp "$W/run/metrics.jsonl" "$W/run/run.json" "$OUT/" 2>/dev/null
for f in "$W"/eval/*.json; do [ -e "$f" ] && cp "$f" "$OUT/eval_$(basename "$f")"; done
[ -d "$W/cache" ] && python -m stages.cli cache info "$W/cache" >"$OUT/cache_info.txt" 2>&1
grep -v -e "Converting" -e "clean_up_tokenization" "$OUT/log.txt" | grep -E "tau|took|epoch|generate:|extract|codec|error|Error|interrupted" | tail -40
