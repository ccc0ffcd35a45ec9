#!/bin/bash
# usage: features.sh NAME CFGFLAG OV PRINT...
NAME=$1; CFG=$2; OV=$3; shift 3; PRINT=("$@")
cd /tmp/cfgstudy/cases
P=/tmp/cfgstudy/venv/bin/python
run(){ echo "\$ python p_$NAME.py $*"; timeout 60 $P /tmp/cfgstudy/proto/p_$NAME.py "$@" > /tmp/cfgstudy/cases/_o 2>&1; rc=$?; grep -v '^  File \|^    ' _o | tail -${TAILN:-6}; echo "[exit $rc]"; echo; }
echo "### lax: string '5' for int in file"; TAILN=3 run $CFG lax_strint.toml "${PRINT[@]}"; grep shard_size _o
echo "### lax: 'yes' for bool in file"; TAILN=3 run $CFG lax_bool.toml "${PRINT[@]}"; grep packing _o
echo "### bad Literal in file"; run $CFG bad_literal.toml "${PRINT[@]}"
echo "### nested wrong type in file"; run $CFG nested_bad.toml "${PRINT[@]}"
echo "### nested misspelt key in file"; run $CFG nested_misspelt.toml "${PRINT[@]}"
