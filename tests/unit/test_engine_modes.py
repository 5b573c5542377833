"""The unified loop on a tiny random model, self-drafting from its first layer: fast logic checks."""
import pytest

from calid.decoding.modes import DecodeParams
from calid.engine import Engine, EngineConfigError
from calid.errors import InvalidRequestError
from calid.generation import GenerationRequest, SamplingParams
from calid.models.self_draft import self_draft
from calid.runtime.runner import ModelRunner


class IdTokenizer:
    def decode(self, ids, **kw):
        return " ".join(map(str, ids))


PROMPTS = [[5, 17, 3], [88, 41, 9, 60, 2], [7]]


def engine(model, draft_layers=1, **kw):
    draft = ModelRunner(self_draft(model, draft_layers)) if draft_layers else None
    return Engine(ModelRunner(model), IdTokenizer(), frozenset(), draft=draft, **kw)


def run(eng, decode, n=24, **params):
    reqs = [GenerationRequest(list(p), SamplingParams(max_new_tokens=n, **params), decode=decode) for p in PROMPTS]
    return eng.generate(reqs)


@pytest.fixture(scope="module")
def target_only(tiny_model):
    return [r.output_ids for r in run(engine(tiny_model, 0), DecodeParams(mode="ar"))]


@pytest.mark.parametrize("gamma", [1, 3, 6])
@pytest.mark.parametrize("threshold", [0.0, 0.3])
def test_greedy_speculative_equals_target_only(tiny_model, target_only, gamma, threshold):
    res = run(engine(tiny_model), DecodeParams(mode="speculative", gamma=gamma, threshold=threshold))
    assert [r.output_ids for r in res] == target_only
    assert all(len(r.output_ids) == 24 for r in res)


def test_draft_equal_to_target_accepts_everything(tiny_model, target_only):
    eng = engine(tiny_model, draft_layers=tiny_model.cfg.num_layers)
    res = run(eng, DecodeParams(mode="speculative", gamma=4, threshold=0.0))
    assert [r.output_ids for r in res] == target_only
    for r in res:
        assert r.stats.acceptance_by_position and all(a == 1.0 for a in r.stats.acceptance_by_position)
        assert r.stats.mean_accepted > 3


def test_filter_threshold_zero_is_draft_only(tiny_model):
    draft_only = run(
        Engine(ModelRunner(self_draft(tiny_model, 1)), IdTokenizer(), frozenset()), DecodeParams(mode="ar")
    )
    res = run(engine(tiny_model), DecodeParams(mode="filter", threshold=0.0, gamma=8))
    assert [r.output_ids for r in res] == [r.output_ids for r in draft_only]
    assert all(r.stats.filtered_fraction == 1.0 and r.stats.target_calls == 0 for r in res)


def test_filter_threshold_one_is_target_only(tiny_model, target_only):
    res = run(engine(tiny_model), DecodeParams(mode="filter", threshold=1.0))
    assert [r.output_ids for r in res] == target_only
    assert all(r.stats.filtered_fraction == 0.0 for r in res)


def test_filter_at_the_median_confidence_mixes_sources(tiny_model):
    from calid.decoding.confidence import top1
    from calid.runtime.runner import SeqInput

    draft = ModelRunner(self_draft(tiny_model, 1))
    logits = draft.forward([SeqInput("probe", list(range(1, 40)), logits_at=list(range(39)))])[0]
    median_prob = float(top1(logits)[1].neg().exp().median())
    res = run(engine(tiny_model), DecodeParams(mode="filter", threshold=median_prob, gamma=4))
    fractions = [r.stats.filtered_fraction for r in res]
    assert any(0.0 < f < 1.0 for f in fractions)
    for r in res:
        assert r.stats.draft_tokens + r.stats.target_tokens == len(r.output_ids)


def test_rollback_with_zero_tolerance_is_target_only(tiny_model, target_only):
    res = run(engine(tiny_model), DecodeParams(mode="rollback", rollback_nll=0.0, gamma=3))
    assert [r.output_ids for r in res] == target_only


def test_sampled_speculative_is_reproducible_per_seed(tiny_model):
    decode = DecodeParams(mode="speculative", gamma=3)
    a = run(engine(tiny_model), decode, temperature=0.8, seed=11)
    b = run(engine(tiny_model), decode, temperature=0.8, seed=11)
    assert [r.output_ids for r in a] == [r.output_ids for r in b]


def test_adaptive_threshold_moves(tiny_model):
    res = run(engine(tiny_model), DecodeParams(mode="speculative", gamma=4, threshold=0.2, adaptive=True))
    assert [r.output_ids for r in res]  # runs; adaptation is exercised on every verification
    assert sum(r.stats.verifications for r in res) > 0


def test_different_vocabularies_are_refused(tiny_model, tiny_cfg):
    from dataclasses import replace

    from calid.models.llama import LlamaModel

    other = LlamaModel(replace(tiny_cfg, vocab_size=tiny_cfg.vocab_size + 1)).eval()
    with pytest.raises(EngineConfigError, match="different vocabularies"):
        Engine(ModelRunner(tiny_model), IdTokenizer(), frozenset(), draft=ModelRunner(other))


def test_draft_modes_need_a_draft(tiny_model):
    with pytest.raises(EngineConfigError, match="needs a draft model"):
        run(engine(tiny_model, 0), DecodeParams(mode="speculative"))


@pytest.mark.parametrize("decode, message", [
    (DecodeParams(mode="beam"), "mode must be one of"),
    (DecodeParams(gamma=0), "gamma must be an integer"),
    (DecodeParams(threshold=1.5), "threshold must be a probability"),
])
def test_bad_decode_params(tiny_model, decode, message):
    with pytest.raises(InvalidRequestError, match=message):
        run(engine(tiny_model), decode)


def test_caches_are_freed_when_requests_finish_or_the_consumer_stops(tiny_model):
    eng = engine(tiny_model)
    run(eng, DecodeParams(mode="speculative"))
    assert len(eng.target.caches) == 0 and len(eng.draft.caches) == 0
    stream = eng.stream([GenerationRequest([1, 2, 3], SamplingParams(max_new_tokens=50), decode=DecodeParams())])
    next(stream)
    stream.close()  # client went away
    assert len(eng.target.caches) == 0 and len(eng.draft.caches) == 0


@pytest.mark.parametrize("decode", [
    DecodeParams(mode="tree", gamma=4, threshold=0.5, tree_width=3),
    DecodeParams(mode="tree", gamma=2, threshold=1.0, tree_width=2),
    DecodeParams(mode="lookahead", gamma=8),
])
def test_greedy_tree_modes_equal_target_only(tiny_model, target_only, decode):
    res = run(engine(tiny_model), decode)
    assert [r.output_ids for r in res] == target_only
    assert all(r.stats.target_calls <= len(r.output_ids) for r in res)


def test_tree_with_full_depth_draft_accepts_the_main_branch(tiny_model, target_only):
    eng = engine(tiny_model, draft_layers=tiny_model.cfg.num_layers)
    res = run(eng, DecodeParams(mode="tree", gamma=4, threshold=0.0, tree_width=2))
    assert [r.output_ids for r in res] == target_only
    assert all(r.stats.mean_accepted > 3 for r in res)


def test_lookahead_accepts_repeated_text(tiny_model):
    """A prompt that repeats what the model will say lets lookahead accept several tokens per step."""
    eng = engine(tiny_model, draft_layers=0)
    first = eng.generate(
        [GenerationRequest([3, 1, 4, 1, 5], SamplingParams(max_new_tokens=30), decode=DecodeParams(mode="ar"))]
    )[0]
    prompt = [3, 1, 4, 1, 5] + first.output_ids + [3, 1, 4, 1, 5]  # the continuation is in the prompt
    ar = eng.generate([GenerationRequest(prompt, SamplingParams(max_new_tokens=24), decode=DecodeParams(mode="ar"))])[0]
    la = eng.generate(
        [GenerationRequest(prompt, SamplingParams(max_new_tokens=24), decode=DecodeParams(mode="lookahead"))]
    )[0]
    assert la.output_ids == ar.output_ids
    assert la.stats.target_calls < len(la.output_ids) / 2
    assert len(eng.verifier._global._prompts) == 0  # the finished prompt was eliminated from the trie


@pytest.mark.parametrize("chains, width", [(3, 1), (2, 2)])
def test_multi_chain_trees_are_lossless_and_free_every_chain_cache(tiny_model, target_only, chains, width):
    eng = engine(tiny_model, draft_layers=1)
    res = run(eng, DecodeParams(mode="tree", gamma=3, threshold=0.5, tree_width=width, tree_chains=chains))
    assert [r.output_ids for r in res] == target_only
    assert len(eng.draft.caches) == 0 and len(eng.target.caches) == 0


def test_stochastic_trees_sample_the_target_distribution(tiny_model):
    """Sampled tree mode with several i.i.d. draft chains (SpecInfer + VerifyStochastic) is lossless.

    The first output token of many seeded requests must follow the target's
    softmax at the prompt, not the draft's, although most come from accepted
    draft children.
    """
    import torch

    from calid.decoding.sampling import Warp, warp

    prompt, n, w = [5, 17, 3], 2000, Warp(temperature=0.5, top_k=8)  # a peaked p: sampling noise TV ~0.024
    eng = engine(tiny_model, max_batch=512)
    decode = DecodeParams(mode="tree", gamma=2, threshold=0.0, tree_chains=3)
    reqs = [GenerationRequest(list(prompt), SamplingParams(max_new_tokens=3, temperature=w.temperature, top_k=w.top_k,
                                                           seed=i), decode=decode) for i in range(n)]
    res = eng.generate(reqs)
    counts = torch.bincount(torch.tensor([r.output_ids[0] for r in res]), minlength=tiny_model.cfg.vocab_size)
    empirical = counts.float() / n
    with torch.inference_mode():
        p = warp(ModelRunner(tiny_model).forward([SeqInput_("p", prompt)])[0], w)[0]
        q = warp(ModelRunner(self_draft(tiny_model, 1)).forward([SeqInput_("q", prompt)])[0], w)[0]
    tv_p, tv_q = 0.5 * (empirical - p).abs().sum(), 0.5 * (empirical - q).abs().sum()
    assert tv_p < 0.05, f"TV to target {tv_p:.3f}"
    assert 0.5 * (p - q).abs().sum() > 0.3 and tv_q > 0.25  # the check tells target and draft apart
    accepted = sum(r.stats.accepted_total for r in res)
    assert accepted > n // 4  # the draft's children were really accepted, not just recovered tokens


def SeqInput_(seq_id, tokens):
    from calid.runtime.runner import SeqInput

    return SeqInput(seq_id, list(tokens))


def _pinned_costs(eng, verify: dict, draft: dict):
    """Hand-built cost tables, pinned: calibration and live timings leave them as they are."""
    from calid.planning import CostTable

    tables = []
    for points in (verify, draft):
        t = CostTable()
        for size, secs in points.items():
            t.observe(size, secs)
        tables.append(t)
    eng.set_costs(*tables)


def test_auto_is_lossless_and_the_default_with_a_draft(tiny_model, target_only):
    eng = engine(tiny_model, draft_layers=tiny_model.cfg.num_layers)  # a perfect draft
    assert eng.default_decode.mode == "auto"
    res = run(eng, None)
    assert [r.output_ids for r in res] == target_only
    assert engine(tiny_model, draft_layers=0).default_decode.mode == "ar"


def test_auto_drafts_long_for_an_idle_target_and_nothing_for_a_compute_bound_one(tiny_model, target_only):
    idle = engine(tiny_model, draft_layers=tiny_model.cfg.num_layers)
    _pinned_costs(idle, verify={1: 0.02, 32: 0.025}, draft={1: 0.001, 8: 0.002})
    res = run(idle, DecodeParams(mode="auto", gamma=6, threshold=0.0))
    assert [r.output_ids for r in res] == target_only
    assert all(r.stats.target_calls <= 24 / 4 for r in res)  # perfect draft, long drafts: few target calls

    busy = engine(tiny_model, draft_layers=tiny_model.cfg.num_layers)
    _pinned_costs(busy, verify={1: 0.02, 2: 0.04, 16: 0.32}, draft={1: 0.015, 8: 0.1})
    res = run(busy, DecodeParams(mode="auto", gamma=6, threshold=0.0))
    assert [r.output_ids for r in res] == target_only
    assert all(r.stats.draft_tokens == 0 and r.stats.target_calls == 24 for r in res)


def test_auto_without_a_draft_takes_lookahead_steps_where_they_pay_and_stays_lossless(tiny_model):
    """No draft model: auto's options are ar and Lookahead. With verification nearly free and the continuation
    in the prompt, it decodes in lookahead steps (few target calls); with verification costing a decode per
    token, it runs plain ar steps. Greedy output equals ar either way."""
    eng = engine(tiny_model, draft_layers=0)
    first = eng.generate(
        [GenerationRequest([3, 1, 4, 1, 5], SamplingParams(max_new_tokens=30), decode=DecodeParams(mode="ar"))]
    )[0]
    prompt = [3, 1, 4, 1, 5] + first.output_ids + [3, 1, 4, 1, 5]
    ar = eng.generate([GenerationRequest(prompt, SamplingParams(max_new_tokens=24), decode=DecodeParams(mode="ar"))])[0]

    def auto(verify):
        e = engine(tiny_model, draft_layers=0)
        _pinned_costs(e, verify=verify, draft={})
        return e.generate([GenerationRequest(prompt, SamplingParams(max_new_tokens=24),
                                             decode=DecodeParams(mode="auto", gamma=8))])[0]

    cheap = auto({1: 0.02, 32: 0.021})
    assert cheap.output_ids == ar.output_ids and cheap.stats.target_calls < len(ar.output_ids) / 2
    dear = auto({1: 0.02, 2: 0.04, 16: 0.32})
    assert dear.output_ids == ar.output_ids and dear.stats.target_calls == len(ar.output_ids)


def test_auto_grows_token_trees_where_they_verify_nearly_free_and_stays_lossless(tiny_model, target_only):
    """A one-layer draft of the tiny model is often unsure; with verification nearly free, auto tries token
    trees (its options: ar, chains, trees) and keeps them where they are accepted. Greedy output equals ar."""
    eng = engine(tiny_model, draft_layers=1)
    _pinned_costs(eng, verify={1: 0.02, 64: 0.021}, draft={1: 0.001, 8: 0.0011})
    orch, chosen = eng.orchestrator, []
    plan = orch._plan

    def recording(states):
        plan(states)
        chosen.extend(orch.decode_of(s).mode for s in states if s.req.decode.mode == "auto")

    orch._plan = recording
    res = run(eng, DecodeParams(mode="auto", gamma=6))
    assert [r.output_ids for r in res] == target_only
    assert "tree" in chosen and set(chosen) <= {"ar", "speculative", "tree", "lookahead"}

    chosen.clear()
    sampled = run(eng, DecodeParams(mode="auto", gamma=6), temperature=0.8, seed=7)
    assert "tree" in chosen and all(len(r.output_ids) == 24 for r in sampled)
    again = engine(tiny_model, draft_layers=1)
    _pinned_costs(again, verify={1: 0.02, 64: 0.021}, draft={1: 0.001, 8: 0.0011})
    assert [r.output_ids for r in run(again, DecodeParams(mode="auto", gamma=6), temperature=0.8, seed=7)] == \
        [r.output_ids for r in sampled]  # per-request plans and acceptance estimates: the same seed, the same text


def test_filter_waits_for_its_draft_to_prefill_a_long_prompt_instead_of_having_the_target_prefill_it(tiny_model):
    """SARATHI on the draft: a prompt over the forward budget is fed to the draft a chunk per step. A lossless
    request has the target decode meanwhile (it needs the prompt anyway); a filter request waits, because the
    target would otherwise prefill a prompt its confident draft never needs it for."""
    long_prompt = [(7 * i + 3) % 90 + 1 for i in range(120)]

    def go(decode, budget):
        eng = engine(tiny_model, max_forward_tokens=budget)
        req = GenerationRequest(list(long_prompt), SamplingParams(max_new_tokens=12), decode=decode)
        return eng, eng.generate([req])[0]

    eng, chunked = go(DecodeParams(mode="filter", threshold=0.0, gamma=4), 32)
    assert eng.target.stats.tokens == 0 and chunked.stats.target_calls == 0
    assert chunked.stats.draft_calls >= 4  # the prompt went to the draft in chunks
    _, whole = go(DecodeParams(mode="filter", threshold=0.0, gamma=4), None)
    assert chunked.output_ids == whole.output_ids
    eng, lossless = go(DecodeParams(mode="speculative", gamma=4), 32)
    assert lossless.stats.target_calls > 0 and eng.target.stats.tokens >= len(long_prompt)


def test_filter_cap_is_the_target_step_over_the_draft_step_and_the_catch_up_and_leaves_no_sequences(tiny_model):
    from calid.calibration import filter_cap

    target, draft = ModelRunner(tiny_model), ModelRunner(self_draft(tiny_model, 1))
    cap = filter_cap(target, draft, batch=3, gamma=4)
    assert cap["ar_s"] > 0 and cap["draft_s"] > 0 and cap["catch_up_s"] > 0
    assert 0 < cap["read_s"] <= cap["catch_up_s"]  # the cheaper of a gamma catch-up and a prefill, a token
    assert cap["cap"] == pytest.approx(cap["ar_s"] / (cap["draft_s"] + cap["read_s"]))
    assert cap["prefill_ratio"] > 0  # the one-layer self-draft prefills in less time than the whole model
    assert target.cached_count() == 0 and draft.cached_count() == 0


def test_filter_on_whole_requests_keeps_the_prefill_and_adds_the_drafts():
    from calid.calibration import whole_request_cap

    # half of ar's time prefilling; decoding 3x as fast; the draft prefills in 0.4 of the target's time
    assert whole_request_cap(3.0, 0.5, 0.4) == pytest.approx(1 / (0.5 * 1.4 + 0.5 / 3))
    assert whole_request_cap(3.0, 0.0, 0.4) == pytest.approx(3.0)  # no prefill: the decoding cap
    assert whole_request_cap(1.5, 0.3, 0.5) < 1.5


@pytest.mark.parametrize("budget", [None, 40])
@pytest.mark.parametrize("mode", ["ar", "speculative", "tree", "lookahead", "filter", "rollback"])
def test_n_sampled_choices_of_one_prompt_prefill_once(tiny_model, mode, budget):
    """Three seeded choices of one prompt (what an OpenAI request with n=3 becomes), with and without
    SARATHI's budget (which would chunk the second and third apart): one prefill on each model
    (calid.runtime.twins; a tree's prompt too), and each choice's tokens are those it gets alone. (auto's
    sampled tokens hang on its timed plans, alone too.)"""
    prompt = list(range(3, 43))

    def run_seeds(seeds):
        eng = engine(tiny_model, max_forward_tokens=budget)
        reqs = [GenerationRequest(list(prompt), SamplingParams(max_new_tokens=6, temperature=1.0, seed=s),
                                  decode=DecodeParams(mode=mode)) for s in seeds]
        return [r.output_ids for r in eng.generate(reqs)], eng

    together, eng = run_seeds([11, 12, 13])
    assert eng.target.stats.forked_sequences == 2
    assert eng.draft.stats.forked_sequences == (0 if mode in ("ar", "lookahead") else 2)
    assert together == [run_seeds([s])[0][0] for s in (11, 12, 13)]
    assert len({tuple(t) for t in together}) > 1  # sampled on their own
