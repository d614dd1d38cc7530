# kvflow — the two commands a newcomer needs: `make up` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
NIXL   := nixl-cu12==1.5.1 nixl==1.5.1
ARGS   ?=

.PHONY: up test lint install bench clean image push chromium buildah

$(STAMP): pyproject.toml setup.py kvflow/_native.c Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[test]'
	# NIXL's wheels pin CUDA packages it does not need on CPU: install them without deps.
	$(BIN)/pip install -q --no-deps $(NIXL)
	touch $@

install: $(STAMP)

## Run the whole stack locally: simulated vLLM pods, router and gateway on 127.0.0.1:8080.
up: $(STAMP)
	$(BIN)/kvflow up $(ARGS)

## Run the linters, then the test suite (conformance against real vLLM too with KVFLOW_REAL_VLLM=1).
test: lint chromium buildah
	$(BIN)/python -m pytest $(ARGS)

## Debian's headless Chromium, which tests/stack/test_dashboard_browser.py drives with Playwright.
chromium:
	@command -v chromium >/dev/null || { SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -q && $$SUDO apt-get install -y -q chromium; }

## buildah and mmdebstrap, with which tests/image builds the image (`make image`) and runs its roles.
buildah:
	@command -v buildah >/dev/null && command -v mmdebstrap >/dev/null || { SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -q && $$SUDO apt-get install -y -q buildah mmdebstrap; }

## ruff, mypy (strict on the modules pyproject lists) and the import-linter contracts. mypy and
## import-linter read build/pkgview: the installed layout (kvflow.router, ...) linked to the sources.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m kvflow.local.pkgview build/pkgview
	$(BIN)/mypy
	cd build/pkgview && ../../$(BIN)/lint-imports --config ../../pyproject.toml --no-cache

## Build the container image (localhost/kvflow:dev, and -nixl) with buildah from a local Debian
## base; export build/kvflow-image.oci.tar. Installs buildah and mmdebstrap if missing.
image:
	scripts/image.sh build

## Push the built image: make push IMAGE=ghcr.io/you/kvflow:0.1.0
push:
	scripts/image.sh push $(IMAGE)

bench: $(STAMP)
	$(BIN)/kvflow bench all

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache bench/out
