"""auto with n-gram drafts on a real model (SmolLM2-135M's GGUF on llama.cpp): copies of a request's own
tokens are verified like a draft chain, so greedy output stays ar's token for token, and on work that copies
its input most tokens come from them."""
from __future__ import annotations

import pytest

from calid.backends import open_model
from calid.bench.data import grounded_prompts
from calid.decoding.modes import DecodeParams
from calid.decoding.ngram import SHARE_CLASSES, Copy
from calid.engine import Engine
from calid.generation import GenerationRequest, SamplingParams
from calid.models.presets import TEST_MODEL
from calid.planning import CostTable
from calid.text import encode_prompt

pytestmark = pytest.mark.model
N = 40


def one_thread():
    """One thread: these prompts run past position 256, where llama.cpp's flash attention with 2 threads rounds
    a row by what shares its call and by its slot (the known limit in README, "Lossless and deterministic")."""
    return open_model(TEST_MODEL, backend="llamacpp", threads=1, log=lambda line: None, show_progress=False)


@pytest.fixture(scope="module")
def ll():
    return one_thread()


def cheap_verify() -> CostTable:
    """Verification nearly free (a GPU's shape), so the planner drafts whenever a copy is likely right."""
    t = CostTable()
    for size, secs in {1: 0.020, 9: 0.022, 64: 0.040}.items():
        t.observe(size, secs)
    return t


def run(engine, ids, mode, **params):
    params.setdefault("max_new_tokens", N)
    reqs = [GenerationRequest(list(i), SamplingParams(**params), decode=DecodeParams(mode=mode)) for i in ids]
    return engine.generate(reqs)


def test_auto_copies_grounded_answers_and_keeps_ar_output(ll):
    ids = [encode_prompt(ll.tokenizer, p) for p in grounded_prompts(4)]
    ar = [r.output_ids for r in run(Engine(ll.runner, ll.tokenizer, ll.eos_ids, max_batch=4), ids, "ar")]
    engine = Engine(ll.runner, ll.tokenizer, ll.eos_ids, max_batch=4)  # no draft model: ar, Lookahead or n-gram
    engine.set_costs(cheap_verify(), CostTable())
    res = run(engine, ids, "auto")
    assert [r.output_ids for r in res] == ar
    copied = sum(r.stats.draft_tokens for r in res)
    assert copied > 0.3 * sum(len(r.output_ids) for r in res), copied  # the refactors copy their input
    assert ll.runner.cached_count() == 0


def test_chains_padded_to_the_steps_level_keep_ar_output():
    """Outside exact mode a step's shorter chains are padded to its level (one slice of equal lengths, see
    calid.planning.batch_level); greedy output is still ar's (one thread, as ``one_thread`` says)."""
    batched = open_model(TEST_MODEL, backend="llamacpp", threads=1, invariant=False, log=lambda line: None,
                         show_progress=False)
    ids = [encode_prompt(batched.tokenizer, p) for p in grounded_prompts(4)]
    ar = [r.output_ids for r in run(Engine(batched.runner, batched.tokenizer, batched.eos_ids, max_batch=4), ids, "ar")]
    engine = Engine(batched.runner, batched.tokenizer, batched.eos_ids, max_batch=4)
    engine.set_costs(cheap_verify(), CostTable())
    res = run(engine, ids, "auto")
    assert batched.runner.stats.padded_tokens > 0
    assert [r.output_ids for r in res] == ar
    batched.runner.close()


def test_a_copy_that_holds_runs_past_gamma_in_one_target_call(ll):
    """The model repeats a 46-token line: once the copy has agreed for a while, a step verifies
    far more copied tokens than gamma (a draft model's chain length), and the output is still ar's."""
    ids = [ll.tokenizer.encode("values = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]\n" * 4)]
    new = 64
    ar = run(Engine(ll.runner, ll.tokenizer, ll.eos_ids), ids, "ar", max_new_tokens=new)[0]
    engine = Engine(ll.runner, ll.tokenizer, ll.eos_ids)
    engine.set_costs(cheap_verify(), CostTable())
    auto = run(engine, ids, "auto", max_new_tokens=new)[0]
    assert auto.output_ids == ar.output_ids and len(ar.output_ids) == new
    gamma = DecodeParams(mode="auto").gamma
    assert len(auto.stats.accepted_at) > 2 * gamma and auto.stats.accepted_at[2 * gamma] > 0, auto.stats.accepted_at
    assert auto.stats.draft_tokens > new / 2 and auto.stats.target_calls < new / 4
    # its verified copies taught the server how copies like them hold: some run is priced above Laplace's rule now
    hazard, probes = engine.orchestrator.copy_hazard, [Copy([0] * 16, agreed=a) for a in range(2, 260, 4)]
    assert any(hazard.survival(p, share)[-1] > p.survival()[-1] + 0.01 for p in probes for share in SHARE_CLASSES)


def test_sampled_auto_requests_take_ngram_drafts_too(ll):
    """Sampled requests verify n-gram chains as one-hot drafts (the rule's statistical test is in
    tests/unit/test_acceptance.py). Their text for a seed depends on the plan, which follows live timings."""
    ids = [encode_prompt(ll.tokenizer, p) for p in grounded_prompts(2)]
    engine = Engine(ll.runner, ll.tokenizer, ll.eos_ids, max_batch=2)
    engine.set_costs(cheap_verify(), CostTable())
    res = run(engine, ids, "auto", temperature=0.3, seed=3)
    assert all(len(r.output_ids) == N or r.finish_reason == "stop" for r in res)
    assert sum(r.stats.draft_tokens for r in res) > 0 and ll.runner.cached_count() == 0


def test_the_planner_replay_copies_what_the_engine_copies_on_the_same_outputs(ll):
    """calid.bench.plan_replay decodes ar's greedy outputs again as the planner chooses n-gram copies, with no
    model: at the same pinned costs it copies about as many tokens as the engine's auto did (the engine may also
    take Lookahead steps and its StepGuard may overrule a plan, which the replay leaves out), and where verifying
    costs what plain steps do it copies nothing."""
    from calid.bench.plan_replay import replay_burst

    ids = [encode_prompt(ll.tokenizer, p) for p in grounded_prompts(4)]
    ar = [r.output_ids for r in run(Engine(ll.runner, ll.tokenizer, ll.eos_ids, max_batch=4), ids, "ar")]
    engine = Engine(ll.runner, ll.tokenizer, ll.eos_ids, max_batch=4)
    engine.set_costs(cheap_verify(), CostTable())
    copied = sum(r.stats.draft_tokens for r in run(engine, ids, "auto"))
    replay = replay_burst(ids, ar, cheap_verify(), max_new_tokens=N, sliced=engine.orchestrator.sliced)
    assert replay.tokens == sum(len(o) - 1 for o in ar)
    assert abs(replay.copied - copied) <= 0.25 * copied, (replay.copied, copied)
    print(f"replay copied {replay.copied}, the engine {copied}; {replay.describe()}")
    assert replay.ratio > 1.2 and replay.steps < replay.ar_steps  # a third of the tokens copied, nearly free
    proportional = CostTable()
    for size in (1, 8, 64):
        proportional.observe(size, 0.02 * size)
    assert replay_burst(ids, ar, proportional, max_new_tokens=N).copied == 0
