# splitserve — `make run` (the main job) and `make test` (the suite) work on a fresh machine.
SHELL := /bin/bash
# Debian's python3.11 where it has venv (built with PGO and LTO: the simulator runs faster
# on it than on a plain build), else python3.
PY ?= $(shell /usr/bin/python3.11 -c "import ensurepip, venv" 2>/dev/null && echo /usr/bin/python3.11 || echo python3)
VENV := .venv
BIN := $(VENV)/bin
# Reinstalls when the dependencies, these install steps or the interpreter change.
STAMP := $(VENV)/.installed-$(shell (cat pyproject.toml Makefile; echo "$(PY)") | sha1sum | cut -c1-12)
# apt-get install, as root or through sudo
APT = $(if $(filter 0,$(shell id -u)),,sudo) env DEBIAN_FRONTEND=noninteractive apt-get

.PHONY: run test lint deps sysdeps clean bench-engine bench-transfer sim-bench

$(STAMP): pyproject.toml Makefile
	@if [ -x $(BIN)/python ] && [ "$$($(BIN)/python -c 'import sys; print(sys.base_prefix)')" != \
	  "$$($(PY) -c 'import sys; print(sys.base_prefix)')" ]; then \
	  echo "$(VENV) was made from another interpreter: making it again from $(PY)"; rm -rf $(VENV); fi
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first: on this kind of machine torch==2.13.0 is a local CPU build; elsewhere any >=2.4 works
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0 || $(BIN)/python -m pip install -q "torch>=2.4"
	$(BIN)/python -m pip install -q -e ".[test,bench,lmcache]"
	# LMCache without its metadata's pins (protobuf<7, numpy<=2.2.6, CUDA wheels): they
	# conflict with ours and its CPU paths need none of them (see pyproject's lmcache extra)
	$(BIN)/python -m pip install -q --no-deps "lmcache>=0.5,<0.6"
	@rm -f $(VENV)/.installed-*; touch $@

deps: $(STAMP)

# Debian packages the tests need (redis-server; iproute2 for the multi-host test), if missing
sysdeps:
	@command -v redis-server >/dev/null 2>&1 || { $(APT) update -qq && $(APT) install -y -qq redis-server >/dev/null; }
	@command -v ip >/dev/null 2>&1 || { $(APT) update -qq && $(APT) install -y -qq iproute2 >/dev/null; }

run: deps sysdeps
	$(BIN)/splitserve up --demo-request

# files over JOBS processes, long integration ones first; then the serial ones alone
JOBS ?= 2
test: deps sysdeps
	$(BIN)/python -m pytest -q -n $(JOBS) --dist loadfile --no-loadscope-reorder -m "not serial" tests
	$(BIN)/python -m pytest -q -m serial tests

lint: deps
	$(BIN)/ruff check engine kvtransfer cluster bench protos worker gateway sim tests
	$(BIN)/mypy

bench-engine: deps
	$(BIN)/splitserve bench engine --json bench-engine.json

bench-transfer: deps
	$(BIN)/splitserve bench transfer --json bench-transfer.json

# the simulator's own speed: 512 workers at the trace's 512-token blocks
sim-bench: deps
	$(BIN)/splitserve sim bench --workers 512 --requests 100000 --json bench-sim.json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build
