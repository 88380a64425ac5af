# splitserve — `make run` (the main job) and `make test` (the suite) work on a fresh machine.
SHELL := /bin/bash
# The interpreter the venv is made from: Debian's python3.11 where it is whole (venv and
# the headers mypyc builds against), else python3. Debian builds it with PGO and LTO into
# one executable; on a plain build (pyenv's: no PGO, libpython shared) the simulator
# takes 12-25 % longer (docs/results.md, "sim").
PY ?= $(shell test -f /usr/include/python3.11/Python.h && \
	/usr/bin/python3.11 -c "import ensurepip, venv" 2>/dev/null && echo /usr/bin/python3.11 || echo python3)
VENV := .venv
BIN := $(VENV)/bin
# Reinstalls when the dependencies, these install steps or the interpreter change.
STAMP := $(VENV)/.installed-$(shell (cat pyproject.toml Makefile; echo "$(PY)") | sha1sum | cut -c1-12)

.PHONY: run test lint bench-engine bench-transfer deps sysdeps clean

$(STAMP): pyproject.toml Makefile
	@if [ -x $(BIN)/python ] && [ "$$($(BIN)/python -c 'import sys; print(sys.base_prefix)')" != \
	  "$$($(PY) -c 'import sys; print(sys.base_prefix)')" ]; then \
	  echo "$(VENV) was made from another interpreter: making it again from $(PY)"; \
	  rm -rf $(VENV) build; fi  # (build: mypyc's objects, built against the old headers)
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first: on this kind of machine torch==2.13.0 is a local CPU build; elsewhere any >=2.4 works
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0 || $(BIN)/python -m pip install -q "torch>=2.4"
	$(BIN)/python -m pip install -q -e ".[test,lmcache]"
	# LMCache without its metadata's pins (protobuf<7, numpy<=2.2.6, CUDA wheels): they
	# conflict with ours and its CPU paths need none of them (see pyproject's lmcache extra)
	$(BIN)/python -m pip install -q --no-deps "lmcache>=0.5,<0.6"
	@rm -f $(VENV)/.installed-*; touch $@

# The engine's block pool compiled with mypyc (the same source, without the interpreter:
# ~2-3x less per-block work; engine/__init__.py refuses a build older than the .py).
# Where it cannot be built (no C compiler) the source runs as it is.
COMPILED := engine/.compiled-block_pool
$(COMPILED): engine/block_pool.py $(STAMP)
	@rm -f engine/block_pool.*.so engine/block_pool__mypyc.*.so
	@# (touched: the build copies its cached .so with the cache's time)
	@if $(BIN)/mypyc engine/block_pool.py >.mypyc.log 2>&1; then touch engine/block_pool.*.so; \
	  echo "compiled engine/block_pool.py (mypyc)"; \
	  else echo "mypyc failed (.mypyc.log): engine/block_pool.py runs interpreted"; rm -f engine/block_pool.*.so; fi
	@touch $@

# The simulator's huge-page arenas (sim/arenas.py): a small C extension. Without a C
# compiler the simulator runs on the default arenas.
ARENAS := sim/.compiled-arenas
$(ARENAS): sim/_arenas.c $(STAMP)
	@rm -f sim/_arenas.*.so
	@if cc -O2 -shared -fPIC -Wall -Werror \
	    -I"$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
	    sim/_arenas.c -o sim/_arenas$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))') \
	    >.arenas.log 2>&1; then echo "compiled sim/_arenas.c"; \
	  else echo "cc failed (.arenas.log): the simulator runs on the default arenas"; fi
	@touch $@

# The simulator's hot modules compiled with mypyc (sim/native.py; sim/__init__.py
# refuses a build older than its source). Without a C compiler they run as they are.
SIM_NATIVE := sim/.compiled-native
SIM_NATIVE_MODULES := segments index workload window latency worker cluster
SIM_NATIVE_BUILDS := $(foreach m,$(SIM_NATIVE_MODULES),sim/$(m).*.so sim/$(m)__mypyc.*.so)
$(SIM_NATIVE): $(SIM_NATIVE_MODULES:%=sim/%.py) sim/native.py $(STAMP)
	@rm -f $(SIM_NATIVE_BUILDS)
	@if $(BIN)/python -m sim.native $(SIM_NATIVE_MODULES) >.mypyc-sim.log 2>&1; then \
	  echo "compiled sim/{$$(echo $(SIM_NATIVE_MODULES) | tr ' ' ,)}.py (mypyc)"; \
	  else echo "mypyc failed (.mypyc-sim.log): the simulator runs interpreted"; \
	  rm -f $(SIM_NATIVE_BUILDS); fi
	@touch $@

deps: $(STAMP) $(COMPILED) $(ARENAS) $(SIM_NATIVE)

# Debian packages later issues need (redis-server; iproute2 for the multi-host test's
# network namespaces; TCMalloc, which `splitserve sim` runs on: sim/arenas.py);
# installed only when missing.
sysdeps:
	@/sbin/ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal.so.4 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 >/dev/null; \
	  else sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 >/dev/null; fi; } \
	  || echo "libtcmalloc-minimal4 not installed: splitserve sim runs on the system's malloc"
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
	  else sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; fi; }
	@command -v ip >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null; \
	  else sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null; fi; }

run: deps sysdeps
	$(BIN)/splitserve up --demo-request

test: deps sysdeps
	$(BIN)/python -m pytest -q tests

lint: deps
	$(BIN)/ruff check engine kvtransfer cluster bench protos decode prefill worker gateway sim tests
	$(BIN)/mypy

bench-engine: deps
	$(BIN)/splitserve bench engine --json bench-engine.json

bench-transfer: deps
	$(BIN)/splitserve bench transfer --json bench-transfer.json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build .mypyc.log .arenas.log $(COMPILED) engine/*.so \
	  $(ARENAS) sim/*.so .mypyc-sim.log $(SIM_NATIVE)
