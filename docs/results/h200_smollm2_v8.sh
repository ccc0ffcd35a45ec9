#!/usr/bin/env bash
# Issue 13 (v8): the h200-smollm2 preset end to end on one NVIDIA H200 through the device tool, in calls of at most
# ~10 minutes (each call reruns the same command; finished stages are skipped, training resumes from its latest
# checkpoint, which SIGTERM saves). Logs accumulate in KEEP across calls while the host stays warm; each call packs
# KEEP into DEST/v8_<label>.tgz (the device tool returns at most 8 files).
# Run from the checkout root after `bash .offline/offline-install && export PYTHONPATH=/root/site:$PWD`.
# usage: [PRESET=name] bash docs/results/h200_smollm2_v8.sh WORKDIR SECONDS KEEP DEST LABEL [--set section.field=value ...]
set -uo pipefail
W=${1:?workdir}; S=${2:?seconds}; KEEP=${3:?keep}; DEST=${4:?dest}; LABEL=${5:?label}; shift 5
bash docs/results/h200_smollm2_v5.sh "$W" "$S" "$KEEP" "$@"
df -h "$W" >"$KEEP/disk.txt" 2>&1
tar czf "$DEST/v8_$LABEL.tgz" -C "$KEEP" .
