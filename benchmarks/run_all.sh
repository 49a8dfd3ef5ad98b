#!/usr/bin/env bash
# The figures in docs/bench: bench peers (800/128 at 16, all engines), the seeds' workload
# (800/512 at 16, polychip vs the roofline), then one bench serving sweep against polychip serve.
set -u
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${OUT:-docs/bench}
mkdir -p "$OUT"
$PY -m polychip.cli bench peers --input-len 800 --output-len 128 --concurrency 16 \
    --json "$OUT/peers-800in-128out-c16.json" 2>"$OUT/peers-800in-128out-c16.log"
$PY -m polychip.cli bench peers --input-len 800 --output-len 512 --concurrency 16 --engines polychip,hf-static \
    --shared-prefix-len 0 --json "$OUT/peers-800in-512out-c16.json" 2>"$OUT/peers-800in-512out-c16.log"
# issue 17: bfloat16 KV against the honest rooflines, and single-stream decode against llama.cpp in rounds
$PY -m polychip.cli bench peers --input-len 800 --output-len 128 --concurrency 16 \
    --engines polychip,polychip-int8,hf-static,llama.cpp --kv-cache-dtype bfloat16 --shared-prefix-len 0 \
    --json "$OUT/peers-800in-128out-c16-bf16kv.json" 2>"$OUT/peers-800in-128out-c16-bf16kv.log"
PYTHONPATH=$PWD $PY benchmarks/single_stream_rounds.py --rounds 3 >"$OUT/single-stream-rounds.txt"
PORT=${PORT:-30555}
$PY -m polychip.cli serve --port "$PORT" --enable-metrics --max-running-requests 16 >"$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null' EXIT
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null && break; sleep 1; done
$PY -m polychip.cli bench serving --base-url "http://127.0.0.1:$PORT" --concurrency 1,2,4,8,16 \
    --input-len 800 --output-len 512 --label polychip --out-dir "$OUT" --name serving-800in-512out-polychip \
    --no-progress 2>"$OUT/serving.log"
