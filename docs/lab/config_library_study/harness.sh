#!/bin/bash
# usage: harness.sh NAME CFGFLAG OVERRIDE_PREFIX PRINTFLAG...   runs the error cases for one prototype
NAME=$1; CFG=$2; OV=$3; shift 3; PRINT=("$@")
cd /tmp/cfgstudy/cases
P=/tmp/cfgstudy/venv/bin/python
run(){ echo "\$ python p_$NAME.py $*"; timeout 60 $P /tmp/cfgstudy/proto/p_$NAME.py "$@" 2>&1; echo "[exit $?]"; echo; }
echo "### misspelt field in file"; run $CFG misspelt.toml "${PRINT[@]}"; run $CFG misspelt.yaml "${PRINT[@]}"
echo "### wrong type in file"; run $CFG wrongtype.toml "${PRINT[@]}"; run $CFG wrongtype.yaml "${PRINT[@]}"
echo "### unknown section"; run $CFG badsection.toml "${PRINT[@]}"
echo "### TOML syntax error"; run $CFG syntax.toml "${PRINT[@]}"
echo "### missing file"; run $CFG missing.toml "${PRINT[@]}"
echo "### misspelt dotted override"; run $CFG good.toml ${OV}shard_sise 5 "${PRINT[@]}"
echo "### wrong-typed dotted override"; run $CFG good.toml ${OV}shard_size big "${PRINT[@]}"
echo "### wrong Literal override"; run $CFG good.toml ${OV}packed_attention foo "${PRINT[@]}"
