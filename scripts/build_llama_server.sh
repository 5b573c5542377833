#!/usr/bin/env bash
# Build llama.cpp's C++ OpenAI server (llama-server) for `calid bench peers`, from the same pinned
# llama-cpp-python source distribution the project builds (its vendor/llama.cpp), with the same CPU
# options (native, no AMX kernels: see scripts/_llamacpp.sh). About 10 minutes on 2 cores the first time;
# the binary is cached under $CALID_HOME/bin/ and its path printed. Not part of the set-up: a benchmark peer.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="$(grep -o 'VERSION="[0-9.]*"' "$ROOT/scripts/_llamacpp.sh" | cut -d'"' -f2)"
HOME_DIR="${CALID_HOME:-$HOME/.cache/calid}"
FLAGS=""
if grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | grep -qw amx_tile; then
    FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
KEY="$( (grep -m1 '^flags' /proc/cpuinfo 2>/dev/null; echo "$VERSION $FLAGS") | sha256sum | cut -c1-12)"
OUT="$HOME_DIR/bin/llama-server-$VERSION-$KEY"
if [ -x "$OUT" ]; then echo "$OUT"; exit 0; fi
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
PY="${PYTHON:-$ROOT/.venv/bin/python}"
echo "[build] llama-server from llama-cpp-python $VERSION's sources (log: $WORK/build.log)" >&2
"$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK" >&2
tar xzf "$WORK"/llama_cpp_python-"$VERSION".tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
if ! { cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF \
        -DCMAKE_C_FLAGS="$FLAGS" -DCMAKE_CXX_FLAGS="$FLAGS" &&
       cmake --build "$WORK/build" --target llama-server -j "$(nproc)"; } >"$WORK/build.log" 2>&1; then
    tail -30 "$WORK/build.log" >&2
    echo "[build] llama-server build failed" >&2
    exit 1
fi
mkdir -p "$(dirname "$OUT")"
cp "$WORK/build/bin/llama-server" "$OUT"
echo "$OUT"
