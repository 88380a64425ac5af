#!/usr/bin/env bash
# Fills .whl/ (git-ignored through .git/info/exclude) with what the GPU machine lacks for
# bench/gpu_checks.sh: its image has torch, triton, transformers, numpy, aiohttp, pytest
# and grpcio 1.84; every test in tests/gpu needs these besides. Run here,
# in the repository root, before a device session; then `run` with carry [".whl"].
# (~47 MB: libucx is stripped of its static libraries and perftests to fit the 64 MiB.)
set -euo pipefail
mkdir -p .git/info .whl/deb
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  ucxx-cu12 "libucxx-cu12==0.52.*" "librmm-cu12==26.10.*" rapids-logger \
  "libucx-cu12<1.22,>=1.19" grpcio==1.85.1 grpcio-health-checking redis \
  xgrammar apache-tvm-ffi \
  openai httpx2 httpcore2 truststore pydantic pydantic-core annotated-types \
  typing-inspection jiter distro sniffio \
  jsonschema jsonschema-specifications referencing rpds-py mypy-extensions
# libucx: 42 MB as published; without *.a, ucx_perftest, io_demo and the perftest
# CUDA module ~11 MB (GPU.md)
w=$(ls .whl/libucx_cu12-*.whl)
tmp=$(mktemp -d)
(cd "$tmp" && unzip -q "$OLDPWD/$w" && find . -name "*.a" -delete \
  && find . \( -path "*bin/ucx_perftest" -o -path "*bin/io_demo" \
               -o -name "libucx_perftest_cuda*" \) -delete \
  && rm "$OLDPWD/$w" && zip -qr "$OLDPWD/$w" .)
rm -rf "$tmp"
# redis-server for the cluster tests (unpacked there into /tmp/r by gpu_checks.sh)
(cd .whl/deb && apt-get download redis-server redis-tools liblzf1 libjemalloc2 2>/dev/null)
du -sh .whl
