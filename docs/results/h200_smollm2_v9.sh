#!/usr/bin/env bash
# Issue 13 (v9): the h200-smollm2 preset with 14,336 package prompts from ten packages' sources (30,720 prompts in
# all, 3 epochs; docs/lab/h200-runs.md "v9"), on one NVIDIA H200 through the device tool: each call reruns the same
# command for at most SECONDS (finished stages are skipped, training resumes from its latest checkpoint) and packs
# its logs into DEST/v8_<label>.tgz (docs/results/h200_smollm2_v8.sh). ~19 minutes of wall time in all: two calls
# of SECONDS=555 and a short third, each issued as soon as the previous one returns (the host's disk is lost ~30 s
# after a call).
# Run from the checkout root after `bash .offline/offline-install && export PYTHONPATH=/root/site:$PWD`.
# usage: bash docs/results/h200_smollm2_v9.sh WORKDIR SECONDS KEEP DEST LABEL [--set section.field=value ...]
set -uo pipefail
bash "$(dirname "$0")/h200_smollm2_v8.sh" "$@" \
  --set 'generate.default_prompts.packages=["torch","transformers","sympy","numpy","networkx","dask","distributed","zarr","rich","jinja2"]' \
  --set generate.default_prompts.package_prompts=14336
