#!/usr/bin/env bash
# The prefill/decode figures of docs/disaggregation.md (~20 min; split it to keep one quiet run short):
#   WHO=pd /work/bin/quiet bash benchmarks/pd_all.sh
set -e
cd "$(dirname "$0")"
PY=../.venv/bin/python
export GLOG_minloglevel=2        # Mooncake's own INFO lines
$PY pd_exactness.py f32 f32-reverse bf16 int8 fp8
$PY pd_transfer.py 7 local tcp mooncake local:int8 local:fp8_e4m3 tcp:int8 tcp:fp8_e4m3
$PY pd_interference.py --seconds 70 --every 8
