"""Quality of lossy outputs, measured against the target.

* prefix agreement: share of the target's greedy output reproduced before the first difference;
* target NLL: mean negative log-likelihood the target assigns to the output tokens;
* HumanEval pass@1: the completion is run against the problem's own tests in a
  subprocess with a timeout (model-written code never runs in this process).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import torch

from calid.runtime.runner import ModelRunner, SeqInput

EXEC_TIMEOUT_S = 10.0


def prefix_agreement(output: list[int], reference: list[int]) -> float:
    n = 0
    for a, b in zip(output, reference):
        if a != b:
            break
        n += 1
    return n / len(reference) if reference else 1.0


@torch.inference_mode()
def target_nll(target: ModelRunner, prompt: list[int], output: list[int]) -> float:
    """Mean NLL per output token under the target (plain softmax)."""
    if not output:
        return 0.0
    ids = prompt + output
    rows = list(range(len(prompt) - 1, len(ids) - 1))
    logits = target.forward([SeqInput("__nll__", ids, logits_at=rows)])[0]
    target.release("__nll__")
    logp = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(output)[:, None])
    return float(-logp.mean())


def extract_code(response: str, problem: dict) -> str:
    """The program to test: fenced code from the reply if any, else the reply appended to the prompt."""
    blocks = re.findall(r"```(?:python|py)?\n(.*?)(?:```|$)", response, flags=re.S)
    code = max(blocks, key=len) if blocks else response
    if f"def {problem['entry_point']}" not in code:
        code = problem["prompt"] + code
    return code


def passes_humaneval(response: str, problem: dict) -> bool:
    program = "\n".join([extract_code(response, problem), "", problem["test"], f"check({problem['entry_point']})", ""])
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "candidate.py")
        with open(path, "w") as f:
            f.write(program)
        try:
            done = subprocess.run([sys.executable, path], cwd=tmp, capture_output=True, timeout=EXEC_TIMEOUT_S,
                                  env={"PATH": os.environ.get("PATH", ""), "PYTHONHASHSEED": "0"})
        except subprocess.TimeoutExpired:
            return False
    return done.returncode == 0
