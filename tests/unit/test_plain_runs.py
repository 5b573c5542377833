"""Runs of plain steps: where every request of a step decodes plain, the router lets the target run several
tokens in one call (Orchestrator.lengthen_plain_steps), and the worker's run gives the tokens of as many single
steps (tests/engine/test_llamacpp_backend.py checks that on a real model)."""
import pytest

from calid.decoding.modes import DecodeParams
from calid.generation import GenerationRequest, SamplingParams
from calid.orchestrator import MAX_RUN_STEPS, Orchestrator
from calid.workers.messages import VerifyResult

EOS = 2


class _Tokenizer:
    def decode(self, ids, **kw):
        return " ".join(map(str, ids))


def _orchestrator(step_s: float = 0.040, max_position: int = 512, has_draft: bool = False) -> Orchestrator:
    orch = Orchestrator(_Tokenizer(), frozenset({EOS}), max_position=max_position, has_draft=has_draft)
    for size in (1, 2, 4):
        orch.observe_verify(size, step_s * (1 + 0.1 * (size - 1)))
    return orch


def _start(orch, rid, mode="ar", max_new_tokens=64, prompt=(5, 6, 7), decoded=True, **params):
    s = orch.start(
        orch.validate(
            GenerationRequest(
                list(prompt),
                SamplingParams(max_new_tokens=max_new_tokens, **params),
                request_id=rid,
                decode=DecodeParams(mode=mode),
            )
        )
    )
    if decoded:  # past its prefill: the target has answered it once
        orch.after_verify([VerifyResult(rid, [9], 0, 0, False)])
    return s


def _tasks(orch, states):
    events, tasks = orch.after_draft(states, [])
    assert not events
    return tasks


def test_plain_decode_steps_run_as_many_forwards_as_fit_the_budget():
    orch = _orchestrator(step_s=0.040)
    states = [_start(orch, "a"), _start(orch, "b")]
    tasks = _tasks(orch, states)
    assert orch.lengthen_plain_steps(tasks, 0.150) == 3  # 0.150 s / 0.044 s per 2-request step
    assert [t.steps for t in tasks] == [3, 3]
    assert all(t.stop_ids == {EOS} for t in tasks)
    tasks = _tasks(orch, states)
    assert orch.lengthen_plain_steps(tasks, 10.0) == MAX_RUN_STEPS


def test_a_run_ends_with_the_fewest_tokens_or_context_any_request_has_left_and_ignore_eos_drops_the_stop():
    """A request that ends within a run would hear its last tokens only when the others' steps are done."""
    orch = _orchestrator(step_s=0.010, max_position=16)
    free = _start(orch, "free", ignore_eos=True)
    tasks = _tasks(orch, [free, _start(orch, "long")])
    assert orch.lengthen_plain_steps(tasks, 0.150) == MAX_RUN_STEPS
    assert tasks[0].stop_ids == frozenset() and tasks[1].stop_ids == {EOS}
    for other in (_start(orch, "short", max_new_tokens=4),  # 1 produced, 3 left
                  _start(orch, "near", prompt=tuple(range(10, 22)))):  # 13 ids of 16 positions: 3 left
        tasks = _tasks(orch, [free, other])
        assert orch.lengthen_plain_steps(tasks, 0.150) == 3
        assert [t.steps for t in tasks] == [3, 3]
        orch.finish(other.req.request_id)


@pytest.mark.parametrize("case", ["draft mode", "prefilling", "first call", "no costs", "no budget", "slow step"])
def test_steps_stay_single_unless_every_request_decodes_plain_past_its_prefill(case):
    orch = _orchestrator(step_s=0.200 if case == "slow step" else 0.040)
    if case == "no costs":
        orch = Orchestrator(_Tokenizer(), frozenset({EOS}), max_position=512, has_draft=False)
    other = _start(orch, "b", decoded=case != "first call")
    if case == "prefilling":
        other.prefilling = True
    states = [_start(orch, "a"), other]
    tasks = _tasks(orch, states)
    if case == "draft mode":
        tasks[1].draft = [4, 4]
    assert orch.lengthen_plain_steps(tasks, 0 if case == "no budget" else 0.150) == 1
    assert [t.steps for t in tasks] == [1, 1]


def test_a_runs_tokens_are_appended_until_the_request_ends_and_count_as_target_forwards():
    orch = _orchestrator()
    s = _start(orch, "a", max_new_tokens=64, stop=("7 8",))
    events = orch.after_verify([VerifyResult("a", [4, 7, 8, 5], 0, 0, False, forwards=4)])
    assert [t for e in events for t in e.token_ids] == [
        4,
        7,
        8,
    ]  # the stop string ends it; the run's last token is dropped
    assert s.output == [9, 4, 7, 8]
    assert s.finish_reason == "stop"
    assert s.stats.target_calls == 1 + 4


def test_an_auto_request_runs_at_most_the_steps_it_made_since_it_last_drafted():
    """A run cannot take an n-gram copy that turns up meanwhile: auto requests that drafted lately run short."""
    orch = _orchestrator(step_s=0.010)
    plain, auto = _start(orch, "ar"), _start(orch, "auto", mode="auto")
    for i in range(9):  # 10 tokens out, none repeating: no n-gram copy, so the planner plans it plain
        orch.after_verify([VerifyResult("auto", [100 + i], 0, 0, False)])

    def run(states):
        orch.draft_tasks(states)  # the planner's step
        return orch.lengthen_plain_steps(_tasks(orch, states), 10.0)

    assert run([plain, auto]) == MAX_RUN_STEPS
    orch._drafted_at["auto"] = len(auto.output) - 3  # as _plan records a drafting choice, 3 tokens ago
    assert run([plain, auto]) == 3
    assert run([plain]) == MAX_RUN_STEPS


def test_a_sliced_targets_mixed_chains_are_padded_to_the_steps_level_past_their_prefill():
    """Where the target splits a batch into slices (llama.cpp), a step of chains of 1, 5 and 3 tokens is sent
    with level 5 on every task when one slice of 3 x 5 is cheaper than three (the worker pads the shorter ones);
    not where the target is not sliced, not in exact mode (padding off), not while a request still prefills."""
    from calid.workers.messages import DraftResult

    def step(sliced=True, padding=True, decoded=True):
        orch = _orchestrator(has_draft=True)
        for size, secs in ((3, 0.06), (5, 0.07), (15, 0.10)):  # a slice of more tokens costs little more
            orch.observe_verify(size, secs)
        orch.sliced, orch.padding = sliced, padding
        states = [_start(orch, r, mode="speculative", decoded=decoded or r != "c") for r in "abc"]
        drafts = [DraftResult(r, list(range(10, 10 + g)), None, True, probs=[0.9] * g)
                  for r, g in zip("abc", (0, 4, 2))]
        return [t.level for t in orch.after_draft(states, drafts)[1]]

    assert step() == [5, 5, 5]
    assert step(sliced=False) == step(padding=False) == step(decoded=False) == [0, 0, 0]
