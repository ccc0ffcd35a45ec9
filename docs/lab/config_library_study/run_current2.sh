#!/bin/bash
cd /tmp/cfgstudy/cases
DS=/work/main/.venv/bin/dflash-stages
run(){ echo "\$ dflash-stages extract $*"; timeout 120 $DS extract "$@" > _c 2>&1; rc=$?; grep -E '^error|shard_size|packing|storage_dtype|"seed"|Error|No such|Usage|Try' _c | head -8; echo "[exit $rc]"; echo; }
run --config lax_strint.toml --print-config
run --config lax_bool.toml --print-config
run --config bad_literal.toml --print-config
run --config nested_misspelt.toml --print-config
run --shard-size 7 --config good.toml --print-config
run --config good.toml --shard-sise 7 --print-config
run --config good.toml --shard-size big --print-config
echo '$ dflash-stages extract --help'; COLUMNS=120 timeout 120 $DS extract --help 2>&1 | head -60
