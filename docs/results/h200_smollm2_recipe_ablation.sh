#!/usr/bin/env bash
# Recipe ablations of the h200-smollm2 preset on one NVIDIA H200, one variable at a time on the same data
# (docs/training.md, "Recipe ablations"):
#   base      the preset's recipe (decayed CE, cosine lr), trained by `run` on a smaller regenerated corpus whose
#             cache also holds the target's final normed hidden state (extract.final_tap)
#   wsd       optim.schedule=wsd (warmup, constant, linear decay over the last 20%)
#   constant  optim.schedule=constant
#   kl        + forward KL to the target's next-token distribution (drafter.distill=kl, weight 1)
#   tv        DSpark-style: CE weight 0.1 + total variation (drafter.distill=tv, weight 1)
#   fp8       the same corpus extracted with storage_dtype=fp8 (per-token scale), base recipe
# Every variant trains the same epochs on the same rows and is evaluated tau-only (no references) on the same
# held-out prompts (the prompt set's held-out stdlib files) and on numpy-questions, a set of another kind.
# Variants run three at a time on the one GPU: their timings are not throughput figures.
# Rerunning with the same ROOT resumes (finished steps skipped, training from its last checkpoint); every step stops
# by SIGTERM (checkpoint saved) before SECONDS have passed, then what there is is copied to OUT.
#
# usage: bash docs/results/h200_smollm2_recipe_ablation.sh ROOT SECONDS OUT [tiny]
#   tiny: CPU-sized settings, to check the logic without a GPU.
set -uo pipefail
ROOT=${1:?ROOT}; GIVEN=${2:?SECONDS}; OUT=${3:?OUT}; MODE=${4:-h200}
CLI="${PY:-python} -m stages.cli"
export PYTHONUNBUFFERED=1 COLUMNS=${COLUMNS:-120}
START=$(date +%s)
L=$ROOT/logs
mkdir -p "$ROOT/runs" "$L" "$OUT"
left() { echo $(( START + GIVEN - $(date +%s) - 25 )); }
stamp() { echo "## $(date -u +%FT%TZ) $*" | tee -a "$OUT/log.txt"; }

EPOCHS=${EPOCHS:-2}
DATA=(--set generate.default_prompts.max_prompts=${PROMPTS:-6144} --set generate.default_prompts.package_prompts=${PACKAGE_PROMPTS:-2048})
EVAL=(--set evaluate.references=false --set evaluate.num_prompts=${EVAL_PROMPTS:-32})
SMALL=()
SMALL_TRAIN=()
SMALL_EVAL=()
if [ "$MODE" = tiny ]; then
  DATA=(--set generate.default_prompts.max_prompts=16 --set generate.default_prompts.packages=[] --set generate.default_prompts.package_prompts=null
        --set generate.max_new_tokens=16 --set generate.batch_size=8 --set generate.part_size=8
        --set generate.target_gpus=null --set generate.target_processes=1)
  SMALL=(--set extract.target_gpus=null --set extract.target_processes=1 --set extract.num_taps=1
         --set extract.shard_size=4096)
  SMALL_TRAIN=(--set train.device=cpu --set train.drafter.num_draft_layers=1 --set train.drafter.block_size=4
               --set train.data.token_budget=1024 --set train.drafter.max_anchors_per_document=16
               --set train.data.validation_fraction=0.0 --set train.save_every=1 --set train.max_steps=2
               --set train.data.num_read_workers=1)
  SMALL_EVAL=(--set evaluate.num_prompts=1 --set evaluate.max_new_tokens=8 --set evaluate.prompt_tokens=32
              --set evaluate.device=cpu --set evaluate.cpu_threads=1 --set evaluate.dtype=float32)
fi

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$OUT/log.txt" 2>&1

# 1. base: generate -> extract (with the final tap) -> train -> tau, through `run` (it resumes by itself)
if [ ! -e "$ROOT/base.done" ]; then
  stamp "base: run --preset h200-smollm2 (left $(left) s)"
  timeout -s TERM -k 30 "$(left)" $CLI run --preset h200-smollm2 --workdir "$ROOT/base" "${DATA[@]}" "${SMALL[@]}" \
    "${SMALL_TRAIN[@]}" "${SMALL_EVAL[@]}" --set extract.final_tap=true --set train.epochs=$EPOCHS \
    --set evaluate.per_epoch=false "${EVAL[@]}" >>"$L/base.log" 2>&1 && touch "$ROOT/base.done"
  stamp "base: exit $? ($(tail -1 "$L/base.log" | cut -c1-200))"
fi

copy_out() {
  cp "$ROOT/base/pipeline.json" "$L/base_pipeline.json" 2>/dev/null
  for run in "$ROOT"/runs/*; do
    [ -d "$run" ] || continue
    name=$(basename "$run")
    [ -e "$run/eval.json" ] && cp "$run/eval.json" "$L/${name}_eval.json"
    [ -e "$run/metrics.jsonl" ] && cp "$run/metrics.jsonl" "$L/${name}_metrics.jsonl"
  done
  for f in "$ROOT"/base/eval/*.json; do [ -e "$f" ] && cp "$f" "$L/pipeline_eval_$(basename "$f")"; done
  cp "$OUT/log.txt" "$L/" 2>/dev/null
  tar czf "$OUT/ablation.tgz" -C "$ROOT" logs
}
copy_out
[ -e "$ROOT/base.done" ] || exit 1
ln -sfn ../base/run "$ROOT/runs/base" && touch "$ROOT/runs/base.trained"  # evaluated below like every variant

# 2. the fp8 cache of the same corpus
if [ ! -e "$ROOT/fp8.done" ]; then
  stamp "fp8 cache: extract (left $(left) s)"
  timeout -s TERM -k 30 "$(left)" $CLI extract --preset h200-smollm2 "${SMALL[@]}" --corpus "$ROOT/base/corpus" \
    --output "$ROOT/cache-fp8" --set extract.storage_dtype=fp8 >>"$L/fp8_extract.log" 2>&1 && touch "$ROOT/fp8.done"
  stamp "fp8 cache: exit $?"
fi

# 3. the variants: train (resuming) then evaluate, three at a time
variant() {
  local name=$1 cache=$2; shift 2
  local run=$ROOT/runs/$name log=$L/$name.log
  if [ ! -e "$run.trained" ]; then
    local resume=()
    [ -e "$run/run.json" ] && resume=(--resume)
    timeout -s TERM -k 30 "$(left)" $CLI train --preset h200-smollm2 --cache "$cache" --output "$run" "${resume[@]}" \
      "${SMALL_TRAIN[@]}" --set train.epochs=$EPOCHS "$@" >>"$log" 2>&1 && touch "$run.trained"
  fi
  if [ -e "$run.trained" ] && [ ! -e "$run/eval.json" ]; then
    timeout -s TERM -k 30 "$(left)" $CLI evaluate --preset h200-smollm2 --drafter "$run" \
      --prompts "$ROOT/base/corpus/heldout_prompts.jsonl" --extra-prompts numpy-questions "${EVAL[@]}" "${SMALL_EVAL[@]}" \
      --json-file "$run/eval.json.tmp" >>"$log" 2>&1 && mv "$run/eval.json.tmp" "$run/eval.json"
  fi
  stamp "$name: $( [ -e "$run/eval.json" ] && echo evaluated || echo unfinished)"
}
C=$ROOT/base/cache
stamp "wave 1 (left $(left) s)"
variant base "$C" &
variant wsd "$C" --set train.optim.schedule=wsd &
variant kl "$C" --set train.drafter.distill=kl &
variant tv "$C" --set train.drafter.distill=tv --set train.drafter.ce_weight=0.1 &
wait
stamp "wave 2 (left $(left) s)"
variant constant "$C" --set train.optim.schedule=constant &
[ -e "$ROOT/fp8.done" ] && variant fp8 "$ROOT/cache-fp8" &
wait
copy_out
stamp "done (left $(left) s)"
