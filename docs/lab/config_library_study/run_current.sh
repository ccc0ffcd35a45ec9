#!/bin/bash
cd /tmp/cfgstudy/cases
DS=/work/main/.venv/bin/dflash-stages
run(){ echo "\$ dflash-stages extract $*"; timeout 120 $DS extract "$@" 2>&1; echo "[exit $?]"; echo; }
run --config misspelt.toml --print-config
run --config wrongtype.toml --print-config
run --config wrongtype.yaml --print-config
run --config badsection.toml --print-config
run --config syntax.toml --print-config
run --config missing.toml --print-config
run --config good.toml --set extract.shard_sise=5 --print-config
run --config good.toml --set extract.shard_size=big --print-config
run --config good.toml --set extract.packed_attention=foo --print-config
run --config good.yaml --print-config --shard-size 7 --set extract.num_taps=3
