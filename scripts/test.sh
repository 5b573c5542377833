#!/usr/bin/env bash
# Set up .venv (first run: a few minutes) and run the test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m slow`.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ROOT"
export RAY_AUTH_MODE=disabled
exec python -m pytest "$@"
