#!/usr/bin/env bash
# The prefill/decode figures of docs/disaggregation.md, in one quiet run (~10 min):
#   WHO=pd /work/bin/quiet bash benchmarks/pd_all.sh
set -e
cd "$(dirname "$0")"
PY=../.venv/bin/python
export GLOG_minloglevel=2        # Mooncake's own INFO lines
$PY pd_exactness.py
$PY pd_transfer.py 7
$PY pd_interference.py --seconds 70 --every 8
