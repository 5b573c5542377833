#!/usr/bin/env bash
# Set up .venv (first run: a few minutes), pull the default target model
# (Qwen2.5-Coder-1.5B-Instruct, ~1 GB download, converted once into
# $CALID_HOME, default ~/.cache/calid) and stream a real generation.
# Extra arguments replace the prompt, e.g. `bash scripts/demo.sh "Explain TCP"`.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ROOT"
PROMPT="${1:-Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.}"
echo "[demo] model cache: ${CALID_HOME:-$HOME/.cache/calid}"
calid models pull qwen2.5-coder-1.5b-instruct
echo "[demo] prompt: $PROMPT"
echo "[demo] streaming from qwen2.5-coder-1.5b-instruct (greedy, CPU, fp32):"
echo
exec calid generate --model qwen2.5-coder-1.5b-instruct --max-new-tokens 160 "$PROMPT"
