#!/usr/bin/env bash
# Set up .venv (first run: a few minutes), lint with ruff, and run the tests.
#   bash scripts/test.sh          the whole suite, as CI runs it (slow tests deselected: -m slow runs them)
#   bash scripts/test.sh fast     the fast loop: every test that needs no Ray and no model (under 3 minutes)
# Other arguments go to pytest, e.g. `bash scripts/test.sh -m slow` or `bash scripts/test.sh tests/unit -k tree`.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ROOT"
export RAY_AUTH_MODE=disabled
# malloc on transparent huge pages for the models the tests load in this process too (calid/hugepages.py)
[ "${CALID_HUGEPAGES:-1}" = 0 ] || export GLIBC_TUNABLES="${GLIBC_TUNABLES:+$GLIBC_TUNABLES:}glibc.malloc.hugetlb=1"
echo "[test] ruff check (pyproject.toml [tool.ruff])"
ruff check --quiet . || { echo "[test] ruff found problems (above); 'ruff check --fix .' mends some" >&2; exit 1; }
if [ "${1:-}" = "fast" ]; then
    shift
    export HYPOTHESIS_PROFILE=fast
    exec python -m pytest -m "not slow and not ray and not model and not multinode and not gpu" "$@"
fi
exec python -m pytest "$@"
