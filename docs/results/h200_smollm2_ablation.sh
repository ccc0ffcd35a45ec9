#!/usr/bin/env bash
# Issue 13, drafter quality, on one NVIDIA H200 (device tool `run`), two pipelines at once on the same GPU:
#   A: the h200-smollm2 recipe trained on RAW stdlib text (the prompt set's training-side files; its held-out files
#      removed) for the same number of training tokens as the regenerated 708-step run (tokens_seen 11,405,673,
#      docs/results/h200_smollm2_generated_v2_metrics.jsonl), evaluated on the same held-out prompts
#      (the prompt set's heldout_prompts.jsonl of this host's stdlib); helper: h200_smollm2_ablation.py.
#   B: the h200-smollm2 preset on its regenerated corpus with train.epochs=6 (tau after every epoch).
# Since v8 (2026-12-04) A matches the v8 preset run instead (docs/results/h200_smollm2_v8_*): the raw text of
# v8's training-side stdlib files, then of the torch and transformers files of the package prompts in the prompt
# set's order, until v8's corpus size, 11,780,514 tokens (RAW_MAX_TOKENS), trained for v8's tokens_seen, 34,742,330
# (TARGET_TOKENS). The token cap stops at the first ~1,600 package files, where v8's prompts span ~4,900 files: A
# holds fewer distinct files than v8 (a confound in v8's favour). Run it alone (4th argument A): B is the v8 run.
# The 2026-12-01 run (h200_smollm2_raw_ablation.md) used TARGET_TOKENS=11405673 RAW_PACKAGES= A_SETS= (stdlib only,
# full evaluations).
# Both resume when rerun with the same ROOT (finished stages skipped, train from its last checkpoint); each stops
# by SIGTERM (checkpoint saved) SECONDS after the start, then what there is goes to $OUT/ablation.tgz.
# Timings of these concurrent runs are not throughput figures.
#
# usage: bash docs/results/h200_smollm2_ablation.sh ROOT SECONDS [tiny] [A|B|AB]
#   tiny: CPU-sized settings to test the logic (no GPU).  Default pipelines: AB.
#   A_SETS (environment): extra settings of A, default "--set evaluate.references=false" (tau only: the
#   speedups against the target alone are v8's business), e.g. A_SETS="" for the full evaluation.
#   B_SETS (environment): B's settings, default "--set train.epochs=6" (e.g. the data-volume run:
#   B_SETS="--set generate.max_prompts=16384 --set train.epochs=3").
set -uo pipefail
ROOT=${1:?ROOT}
SECONDS_GIVEN=${2:?SECONDS}
MODE=${3:-h200}
WHICH=${4:-AB}
PY=${PY:-python}
HERE=$(cd "$(dirname "$0")" && pwd)
HELPER="$PY $HERE/h200_smollm2_ablation.py"
CLI="$PY -m stages.cli"
export PYTHONUNBUFFERED=1 COLUMNS=${COLUMNS:-120}
START=$(date +%s)
mkdir -p "$ROOT/logs"

TARGET_TOKENS=${TARGET_TOKENS:-34742330}   # tokens_seen at the end of v8 (h200_smollm2_v8_metrics.jsonl, step 2157)
read -r -a RAW_PACKAGES <<<"${RAW_PACKAGES-torch transformers}"   # v8's generate.default_prompts.packages
RAW_MAX_TOKENS=${RAW_MAX_TOKENS:-11780514}   # v8's corpus tokens (h200_smollm2_v8_pipeline.json, generate num_tokens)
read -r -a A_EXTRA <<<"${A_SETS---set evaluate.references=false}"
PREP_MAX_LENGTH=2048
MAX_FILES=()
COMMON=()
B_ONLY=()
if [ "$MODE" = tiny ]; then
  TARGET_TOKENS=1500
  RAW_MAX_TOKENS=8000
  PREP_MAX_LENGTH=256
  MAX_FILES=(--max-files 6)
  COMMON=(--set extract.target_gpus=null --set extract.target_processes=1 --set extract.num_taps=1
          --set extract.forward_tokens=2048 --set extract.shard_size=4096
          --set train.device=cpu --set train.drafter.num_draft_layers=1 --set train.drafter.block_size=4 --set train.data.token_budget=1024
          --set train.drafter.max_anchors_per_document=16 --set train.data.validation_fraction=0.0 --set train.save_every=1
          --set evaluate.num_prompts=1 --set evaluate.max_new_tokens=8 --set evaluate.prompt_tokens=32
          --set evaluate.device=cpu --set evaluate.cpu_threads=1)
  B_ONLY=(--set generate.max_prompts=8 --set generate.max_new_tokens=8 --set generate.max_length=256
          --set generate.batch_size=8 --set generate.part_size=4 --set generate.target_gpus=null
          --set generate.target_processes=1 --set train.max_steps=2)
fi

left() { echo $(( START + SECONDS_GIVEN - $(date +%s) - 25 )); }
stamp() { echo "## $(date -u +%FT%TZ) $*"; }

run_A() {
  local log=$ROOT/logs/A.log
  {
    stamp "A: call start (left $(left) s)"
    if [ ! -e "$ROOT/A_setup.done" ]; then
      local packages=() inputs=("$ROOT/raw/stdlib" "$ROOT/raw/placeholder")
      if [ ${#RAW_PACKAGES[@]} -gt 0 ]; then
        packages=(--packages "${RAW_PACKAGES[@]}" --max-tokens "$RAW_MAX_TOKENS")
        inputs+=("$ROOT/raw/packages")
      fi
      $HELPER raw-folder "$ROOT/raw" "${MAX_FILES[@]}" "${packages[@]}" || return 1
      $HELPER heldout-prompts "$ROOT/heldout_prompts.jsonl" || return 1
      stamp "A: prepare (raw training-side files + the split placeholder)"
      timeout -s TERM -k 20 "$(left)" $CLI prepare "${inputs[@]}" -o "$ROOT/A_pre" \
        --max-length "$PREP_MAX_LENGTH" --length-policy split --overwrite || return 1
      $HELPER plan "$ROOT/A_pre" --preset h200-smollm2 --out "$ROOT/A_preset.json" --target-tokens "$TARGET_TOKENS" \
        --scratch "$ROOT/A_plan" "${COMMON[@]}" "${A_EXTRA[@]}" || return 1
      rm -rf "$ROOT/A_plan"
      touch "$ROOT/A_setup.done"
    fi
    stamp "A: pipeline (left $(left) s)"
    echo "# $HELPER run-pipeline --prompts $ROOT/heldout_prompts.jsonl -- --preset $ROOT/A_preset.json --workdir $ROOT/wA"
    timeout -s TERM -k 30 "$(left)" $HELPER run-pipeline --prompts "$ROOT/heldout_prompts.jsonl" -- \
      --preset "$ROOT/A_preset.json" --workdir "$ROOT/wA"
    stamp "A: exit $?"
  } >>"$log" 2>&1
}

run_B() {
  local log=$ROOT/logs/B.log
  {
    stamp "B: call start (left $(left) s)"
    local sets
    read -r -a sets <<<"${B_SETS:---set train.epochs=6}"
    echo "# $CLI run --preset h200-smollm2 --workdir $ROOT/wB ${sets[*]} ${COMMON[*]} ${B_ONLY[*]}"
    timeout -s TERM -k 30 "$(left)" $CLI run --preset h200-smollm2 --workdir "$ROOT/wB" "${sets[@]}" \
      "${COMMON[@]}" "${B_ONLY[@]}"
    stamp "B: exit $?"
  } >>"$log" 2>&1
}

case $WHICH in *B*) run_B & pid_b=$! ;; esac
case $WHICH in *A*) run_A & pid_a=$! ;; esac
(  # progress to stdout while waiting
  while sleep 60; do
    echo "[$(( $(date +%s) - START )) s] A: $(grep -a 'epoch [0-9]*: tau\|took\|## ' "$ROOT/logs/A.log" 2>/dev/null | tail -1)"
    echo "[$(( $(date +%s) - START )) s] B: $(grep -a 'epoch [0-9]*: tau\|took\|## ' "$ROOT/logs/B.log" 2>/dev/null | tail -1)"
  done
) & pid_watch=$!
wait ${pid_a:-} ${pid_b:-} 2>/dev/null
kill "$pid_watch" 2>/dev/null

# ---- collect (small files only: no corpus, cache or checkpoint)
pack=$ROOT/pack
rm -rf "$pack"; mkdir -p "$pack"
for w in A B; do
  wd=$ROOT/w$w
  [ -d "$wd" ] || continue
  mkdir -p "$pack/$w"
  cp "$wd/pipeline.json" "$pack/$w/" 2>/dev/null
  cp "$wd"/eval/*.json "$pack/$w/" 2>/dev/null
  cp "$wd/run/metrics.jsonl" "$pack/$w/" 2>/dev/null
  cp "$wd/corpus/corpus.json" "$pack/$w/corpus.json" 2>/dev/null
  [ -f "$wd/pipeline.json" ] && $HELPER summary "$wd" "$pack/$w/summary.json" >"$pack/$w/summary.txt" 2>&1
  # progress-bar redraws and the repeated hyperparameter/bucket tables removed
  grep -av '━━\|^\s*$' "$ROOT/logs/$w.log" | tail -c 700000 >"$pack/$w/log.txt"
done
cp "$ROOT/A_preset.json" "$ROOT/A_preset.plan.json" "$ROOT/raw/manifest.json" "$pack/" 2>/dev/null
if [ -f "$ROOT/heldout_prompts.jsonl" ] && [ -f "$ROOT/wB/corpus/heldout_prompts.jsonl" ]; then
  cmp "$ROOT/heldout_prompts.jsonl" "$ROOT/wB/corpus/heldout_prompts.jsonl" >"$pack/heldout_cmp.txt" 2>&1 \
    && echo "identical: A's heldout_prompts.jsonl (helper) == B's (generate)" >>"$pack/heldout_cmp.txt"
fi
[ -f "$ROOT/heldout_prompts.jsonl" ] && { wc -l "$ROOT/heldout_prompts.jsonl"; sha256sum "$ROOT/heldout_prompts.jsonl"; } >"$pack/heldout_prompts.txt"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null; $PY -c 'import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)'; } >"$pack/host.txt" 2>&1
du -sh "$ROOT"/w* 2>/dev/null >>"$pack/host.txt"
if [ -n "${OUT:-}" ]; then
  tar -C "$pack" -czf "$OUT/ablation.tgz" .
  ls -la "$OUT"
fi
for w in A B; do [ -f "$pack/$w/summary.txt" ] && { echo "== $w"; cat "$pack/$w/summary.txt"; }; done
echo "ablation script done after $(( $(date +%s) - START )) s"
