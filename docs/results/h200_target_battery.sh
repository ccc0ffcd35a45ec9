#!/usr/bin/env bash
# The measurements issues 40 and 41 still need from one NVIDIA H200, in device calls of at most ~10 minutes each.
# Every step writes its raw output to DEST as it finishes (a lost host costs that step, not the call) and is skipped
# when its output is already there (rerun the same call to go on). PART picks a call:
#   random  random-weight targets, real shapes (carry .offline/whl, offline-install, model.sha256; ~9 min):
#           the GPU tests of the decode loops (run these first: generate's and evaluate's graphs), evaluate's
#           loops per KV cache (the static cache first, each loop profiled: device-busy vs wall ms per step), and
#           the static loops in bfloat16 (is a 16-token float32 verify what makes a cycle cost 2 plain steps?),
#           and a Qwen3-8B-shaped target at 2,048-token prompts: the drafter's kept context vs its whole context
#   throughput  (same carry; ~10 min) generate continuous vs batches, the online producer grouped vs a task per
#           planned batch, the device-to-host copies of a batch into each kind of host memory (ring_copy_probe.py),
#           the producer against extract's loop: caching-allocator counters, forwards_in_flight 2 (extract's
#           bound) vs every forward queued, one task and extract's loop over its documents profiled side by side
#   extract the extract forward's profile and compiled parts (random SmolLM2 shape; ~4 min)
#   short   what one call of ~9 min can say when device time is short (no model halves; same carry as random): the
#           producer against extract's loop (online_profile, as in throughput); the static loops at SmolLM2's shape
#           in float32 (evaluate's dtype) with the drafter's context kept vs whole, profiled; the Qwen3-8B shape at
#           2,048-token prompts, kept vs whole
#   real    the real SmolLM2 (carry .offline/model-a in a first call, model-b in the next; ~8 min): evaluate's
#           loops per KV cache and generate's token agreement with one-prompt-at-a-time greedy decoding
# Run from the checkout root after `bash .offline/offline-install && export PYTHONPATH=/root/site:$PWD`.
# usage: bash docs/results/h200_target_battery.sh DEST PART
set -uo pipefail
DEST=${1:?dest}; PART=${2:?part}
mkdir -p "$DEST"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$DEST/gpu.txt" 2>&1
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" >>"$DEST/gpu.txt"

step() {  # step NAME SECONDS COMMAND...: run unless DEST/NAME.txt exists, output and command kept
  local name=$1 seconds=$2; shift 2
  [ -s "$DEST/$name.txt" ] && { echo "skip $name (done)"; return; }
  echo "\$ $*" >"$DEST/$name.partial"
  timeout "$seconds" "$@" >>"$DEST/$name.partial" 2>&1
  echo "exit $?" >>"$DEST/$name.partial"
  mv "$DEST/$name.partial" "$DEST/$name.txt"
  tail -4 "$DEST/$name.txt"
}

case $PART in
  random)
    step gpu_tests 360 python -m pytest -q -m gpu tests/test_static_decode.py tests/test_static_target.py \
      tests/test_drafter_fused.py
    step drafter_cache_torch_of_the_host 120 python -m pytest -q tests/test_drafter_cache.py
    step speculative_loop_random 240 python benchmarks/speculative_loop.py --target smollm2-random --dtype float32 \
      --repeats 3 --profile --json "$DEST/speculative_loop_random.json"
    step speculative_loop_random_bf16 120 python benchmarks/speculative_loop.py --target smollm2-random \
      --dtype bfloat16 --kv-cache static --repeats 3 --profile --json "$DEST/speculative_loop_random_bf16.json"
    step speculative_loop_8b_context 240 python benchmarks/speculative_loop.py --target qwen3-8b-random \
      --dtype bfloat16 --kv-cache static --prompts 2 --prompt-tokens 2048 --max-new-tokens 64 --repeats 3 \
      --drafter-context kept whole --json "$DEST/speculative_loop_8b_context.json"
    ;;
  throughput)
    step generate_continuous 240 python benchmarks/generate.py --target smollm2-random --prompts 4096 \
      --batch-size 1024 2048 --varied-limits --batching continuous batches --repeats 3 \
      --json "$DEST/generate_continuous.json"
    step online_groups 150 python benchmarks/online.py --device cuda --target smollm2-random --forward-tokens 32768 \
      --repeats 3 --steps 8 --compare-producer-group-tokens 0 --json-out "$DEST/online_groups.json"
    step ring_copy_probe 60 python docs/results/ring_copy_probe.py
    step online_profile 200 python benchmarks/online.py --device cuda --target smollm2-random --forward-tokens 32768 \
      --repeats 3 --steps 8 --compare-producer-forwards-in-flight 2 --profile --json-out "$DEST/online_profile.json"
    ;;
  short)
    step online_profile 200 python benchmarks/online.py --device cuda --target smollm2-random --forward-tokens 32768 \
      --repeats 3 --steps 8 --compare-producer-forwards-in-flight 2 --profile --json-out "$DEST/online_profile.json"
    step speculative_loop_context 170 python benchmarks/speculative_loop.py --target smollm2-random --dtype float32 \
      --kv-cache static --repeats 3 --drafter-context kept whole --profile --json "$DEST/speculative_loop_context.json"
    step speculative_loop_8b_context 170 python benchmarks/speculative_loop.py --target qwen3-8b-random \
      --dtype bfloat16 --kv-cache static --prompts 2 --prompt-tokens 2048 --max-new-tokens 64 --repeats 3 \
      --drafter-context kept whole --json "$DEST/speculative_loop_8b_context.json"
    ;;
  extract)
    step extract_compile_parts 240 python benchmarks/extract.py --target smollm2-random --tokens 262144 \
      --compare-compile-parts --profile 15 --json "$DEST/extract_compile_parts.json"
    ;;
  real)
    step speculative_loop_real 150 python benchmarks/speculative_loop.py --dtype float32 --repeats 3 --kv-cache static \
      --profile --json "$DEST/speculative_loop_real.json"
    step generate_real 300 python benchmarks/generate.py --prompts 4096 --batch-size 1024 2048 \
      --batching continuous batches --repeats 3 --agreement 64 --json "$DEST/generate_real.json"
    ;;
  *) echo "PART: random, throughput, short, extract or real" >&2; exit 2 ;;
esac
