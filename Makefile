# kvflow — the two commands a newcomer needs: `make up` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
NIXL   := nixl-cu12==1.5.1 nixl==1.5.1
ARGS   ?=

.PHONY: up test install bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[test]'
	# NIXL's wheels pin CUDA packages it does not need on CPU: install them without deps.
	$(BIN)/pip install -q --no-deps $(NIXL)
	touch $@

install: $(STAMP)

## Run the whole stack locally: simulated vLLM pods, router and gateway on 127.0.0.1:8080.
up: $(STAMP)
	$(BIN)/kvflow up $(ARGS)

## Run the test suite (conformance against real vLLM too with KVFLOW_REAL_VLLM=1).
test: $(STAMP)
	$(BIN)/python -m pytest $(ARGS)

bench: $(STAMP)
	$(BIN)/kvflow bench all

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache bench/out
