#!/usr/bin/env bash
# Install llama-cpp-python (pinned) built from source for this CPU, into the venv of $1.
#
# llama.cpp is compiled with -march=native, so a wheel built on an AVX-512
# machine must never reach an AVX2-only one: built wheels are cached under
# $CALID_HOME/wheels/<version>-<hash of the CPU flags>/, never in pip's cache.
# The first build takes about 5 minutes on 2 cores; later installs on the same
# kind of CPU take seconds.
set -euo pipefail
PY="$1"
VERSION="0.3.36"
HOME_DIR="${CALID_HOME:-$HOME/.cache/calid}"
CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
# ggml's AMX kernels (compiled in by -march=native on CPUs with AMX, e.g. Sapphire Rapids) crash in
# ggml_backend_amx_mul_mat on the Q4_K_M models here (SIGSEGV in the first forward): build without them.
# An explicit -mno-amx-* wins over -march=native whatever the order; AVX-512/VNNI/BF16 stay on.
if grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | grep -qw amx_tile; then
    CMAKE_ARGS="$CMAKE_ARGS -DCMAKE_C_FLAGS=-mno-amx-tile\ -mno-amx-int8\ -mno-amx-bf16 -DCMAKE_CXX_FLAGS=-mno-amx-tile\ -mno-amx-int8\ -mno-amx-bf16"
fi
# the cache key is the CPU's flags and the build's options: a wheel built another way is never reused
FLAGS_HASH="$( (grep -m1 '^flags' /proc/cpuinfo 2>/dev/null; echo "$CMAKE_ARGS") | sha256sum | cut -c1-12)"
WHEELS="$HOME_DIR/wheels/llama-cpp-python-$VERSION-$FLAGS_HASH"
BUILT="$(dirname "$PY")/../.llamacpp-build"  # which cached build this venv holds
if [ "$(cat "$BUILT" 2>/dev/null)" = "$FLAGS_HASH" ] && \
    "$PY" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$VERSION')" 2>/dev/null; then
    exit 0
fi
if ! ls "$WHEELS"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    echo "[setup] building llama-cpp-python $VERSION for this CPU (first time only, ~5 min; log: .venv/llamacpp-build.log)"
    TMP="$WHEELS.partial"
    rm -rf "$TMP" && mkdir -p "$TMP"
    if ! CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
        CMAKE_ARGS="$CMAKE_ARGS" \
        "$PY" -m pip wheel --no-deps --no-cache-dir --no-binary llama-cpp-python -w "$TMP" \
        "llama-cpp-python==$VERSION" >"$(dirname "$PY")/../llamacpp-build.log" 2>&1; then
        tail -20 "$(dirname "$PY")/../llamacpp-build.log"
        echo "[setup] llama-cpp-python build failed (needs cmake and a C++ compiler); full log in .venv/llamacpp-build.log" >&2
        exit 1
    fi
    rm -rf "$WHEELS" && mv "$TMP" "$WHEELS"
fi
"$PY" -m pip install -q --no-deps --force-reinstall "$WHEELS"/llama_cpp_python-*.whl
echo "$FLAGS_HASH" >"$BUILT"
