"""The benchmarks' user-like workloads (calid.bench.data.workload_prompts), from the pinned data wheels."""
from __future__ import annotations

import pytest

from calid.bench.data import WORKLOADS, chat_prompts, grounded_prompts, humaneval_prompts, workload_prompts


def test_mix_takes_code_edits_and_chat_in_turn():
    mix = workload_prompts("mix", 7)
    assert mix[0::3] == humaneval_prompts(3)
    assert mix[1::3] == grounded_prompts(3)[:2]
    assert mix[2::3] == chat_prompts(3)[:2]
    assert len(set(mix)) == 7


def test_chat_is_mtbench_first_turns_repeated_past_eighty():
    chat = chat_prompts(82)
    assert chat[80:] == chat[:2] and len(set(chat[:80])) == 80


@pytest.mark.parametrize("workload", WORKLOADS)
def test_every_workload_gives_the_count_asked(workload):
    prompts = workload_prompts(workload, 5)
    assert len(prompts) == 5 and all(isinstance(p, str) and p.strip() for p in prompts)
