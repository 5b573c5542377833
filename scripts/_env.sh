# Sourced by scripts/demo.sh and scripts/test.sh: create or refresh .venv.
# Re-installs only when pyproject.toml changed since the last install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating virtual environment in .venv ($("$PY" --version))"
    "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.calid-installed"
WANT="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/_llamacpp.sh" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
    echo "[setup] installing calid and its dependencies (log: .venv/install.log)"
    if ! "$VENV/bin/python" -m pip install -q -e "$ROOT[test,bench]" >"$VENV/install.log" 2>&1; then
        grep -v "is ignored: it is neither a file nor a directory" "$VENV/install.log" | tail -30
        echo "[setup] install failed; full log in .venv/install.log" >&2
        exit 1
    fi
    # llama.cpp (the CPU backend) is compiled for this machine's CPU: see scripts/_llamacpp.sh
    bash "$ROOT/scripts/_llamacpp.sh" "$VENV/bin/python"
    echo "$WANT" >"$STAMP"
fi
export PATH="$VENV/bin:$PATH"
# Ray stays on loopback and quiet (see DESIGN.md).
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0 GLOO_SOCKET_IFNAME=lo
