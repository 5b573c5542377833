#!/usr/bin/env bash
# The main job: set up .venv (first run: a few minutes), pull the default
# models (Qwen2.5-Coder 1.5B target + 0.5B draft, ~1.6 GB download, converted
# once into $CALID_HOME, default ~/.cache/calid), start an embedded loopback
# Ray with the calid Serve app (router, draft and target deployments, gRPC on
# 127.0.0.1:50051), send real prompts through the client SDK in five modes
# concurrently, print the streams, per-request stats and the dashboard
# address, and shut down. Extra arguments go to `calid demo`
# (e.g. --small for SmolLM2-135M, --max-new-tokens 128, --port 50052).
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ROOT"
echo "[demo] model cache: ${CALID_HOME:-$HOME/.cache/calid}"
if [[ " $* " != *" --small "* ]]; then
    calid models pull qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct
fi
calid demo "$@"
echo "[demo] done. Serve it yourself: calid serve (then: calid client \"your prompt\"); more: README.md"
