#!/usr/bin/env bash
# The pipeline figures of docs/pipeline-parallel.md but the uneven-split sweep, in one quiet run (~10 min):
#   WHO=pp /work/bin/quiet bash benchmarks/pp_all.sh
# The sweep is a quiet run of its own (~12 min):
#   WHO=pp /work/bin/quiet .venv/bin/python benchmarks/pp_uneven.py --input-len 128 --output-len 32
# The planner against the best split and pp against dp in ABAB rounds, one quiet run (~6 min):
#   WHO=pp /work/bin/quiet .venv/bin/python benchmarks/pp_planner_efficiency.py --rounds 3
set -e
cd "$(dirname "$0")"
PY=../.venv/bin/python
$PY pp_exactness.py
$PY pp_fits.py
$PY pp_efficiency.py
