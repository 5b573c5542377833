#!/usr/bin/env bash
# Set up .venv (first run: a few minutes), pull the default models
# (Qwen2.5-Coder 1.5B target + 0.5B draft, ~1.6 GB download, converted once
# into $CALID_HOME, default ~/.cache/calid) and stream the same prompt twice:
# target only, then lossless speculative decoding with the draft.
# Extra arguments replace the prompt, e.g. `bash scripts/demo.sh "Explain TCP"`.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ROOT"
PROMPT="${1:-Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.}"
TARGET=qwen2.5-coder-1.5b-instruct
DRAFT=qwen2.5-coder-0.5b-instruct
echo "[demo] model cache: ${CALID_HOME:-$HOME/.cache/calid}"
calid models pull "$TARGET" "$DRAFT"
echo "[demo] prompt: $PROMPT"
echo
echo "[demo] 1/2 target only ($TARGET, greedy, CPU fp32):"
calid generate --model "$TARGET" --max-new-tokens 128 "$PROMPT"
echo
echo "[demo] 2/2 speculative decoding: $DRAFT drafts, $TARGET verifies (same greedy output, fewer target passes):"
calid generate --model "$TARGET" --mode speculative --draft "$DRAFT" --max-new-tokens 128 "$PROMPT"
echo
echo "[demo] done. More modes: calid generate --help; benchmarks: calid bench --help"
