"""Draft/target decoding on real SmolLM2-135M with a self-draft (its first 10 of 30 layers)."""
import pytest

from calid.decoding.modes import DecodeParams
from calid.engine import Engine
from calid.generation import GenerationRequest, SamplingParams
from calid.models.self_draft import self_draft
from calid.runtime.runner import ModelRunner
from calid.text import encode_prompt

pytestmark = pytest.mark.model
N = 32


def make_engine(smol, draft_layers=10):
    draft = ModelRunner(self_draft(smol.model, draft_layers)) if draft_layers else None
    return Engine(ModelRunner(smol.model), smol.tokenizer, smol.eos_ids, draft=draft)


def run(smol, prompts, decode, draft_layers=10, **params):
    reqs = [
        GenerationRequest(encode_prompt(smol.tokenizer, p), SamplingParams(max_new_tokens=N, **params), decode=decode)
        for p in prompts
    ]
    return make_engine(smol, draft_layers).generate(reqs)


@pytest.fixture(scope="module")
def target_greedy(smol, prompts):
    return [r.output_ids for r in run(smol, prompts, DecodeParams(mode="ar"), draft_layers=0)]


@pytest.mark.parametrize("decode", [
    DecodeParams(mode="speculative", gamma=4, threshold=0.0),
    DecodeParams(mode="speculative", gamma=6, threshold=0.4),  # dynamic draft length
])
def test_greedy_speculative_is_identical_to_target(smol, prompts, target_greedy, decode):
    res = run(smol, prompts, decode)
    assert [r.output_ids for r in res] == target_greedy
    assert sum(r.stats.draft_tokens for r in res) > 0  # the draft really contributed
    assert all(r.stats.target_calls < len(r.output_ids) for r in res if r.stats.draft_tokens)


def test_full_depth_self_draft_accepts_everything(smol, prompts, target_greedy):
    res = run(
        smol, prompts, DecodeParams(mode="speculative", gamma=4, threshold=0.0), draft_layers=smol.config.num_layers
    )
    assert [r.output_ids for r in res] == target_greedy
    assert all(a == 1.0 for r in res for a in r.stats.acceptance_by_position)


def test_filter_extremes(smol, prompts, target_greedy):
    draft_only = Engine(ModelRunner(self_draft(smol.model, 10)), smol.tokenizer, smol.eos_ids)
    reqs = lambda d: [GenerationRequest(encode_prompt(smol.tokenizer, p), SamplingParams(max_new_tokens=N), decode=d)
                      for p in prompts]
    expected_draft = [r.output_ids for r in draft_only.generate(reqs(DecodeParams(mode="ar")))]
    zero = run(smol, prompts, DecodeParams(mode="filter", threshold=0.0, gamma=8))
    assert [r.output_ids for r in zero] == expected_draft
    assert all(r.stats.filtered_fraction == 1.0 for r in zero)
    one = run(smol, prompts, DecodeParams(mode="filter", threshold=1.0))
    assert [r.output_ids for r in one] == target_greedy
    assert all(r.stats.filtered_fraction == 0.0 for r in one)


def test_filter_decides_each_unsure_token_by_the_target_and_several_per_target_call(smol, prompts):
    """Filter drafts on past a token it is unsure of; the target's call decides every such token of the chain.
    Checked against both models run over the whole output at once (near-ties between the two numerics skipped)."""
    from calid.runtime.runner import SeqInput

    threshold, layers = 0.9, 24  # a deep self-draft: most of its unsure tokens are above STOP_THRESHOLD
    res = run(smol, prompts, DecodeParams(mode="filter", threshold=threshold, gamma=8), draft_layers=layers)
    target, draft = ModelRunner(smol.model), ModelRunner(self_draft(smol.model, layers))
    unsure = checked = 0
    for k, (r, p) in enumerate(zip(res, prompts)):
        prompt = encode_prompt(smol.tokenizer, p)
        ids, n = prompt + r.output_ids, len(r.output_ids)
        rows = [m.forward([SeqInput(("check", k), ids, logits_at=list(range(len(prompt) - 1, len(ids) - 1)))])[0]
                .float().softmax(-1) for m in (target, draft)]
        for i, token in enumerate(r.output_ids):
            t2, d1 = rows[0][i].topk(2), rows[1][i].max()
            if abs(float(d1) - threshold) < 1e-3 or float(t2.values[0] - t2.values[1]) < 1e-3:
                continue
            if float(d1) < threshold:
                unsure += 1
                checked += token == int(t2.indices[0])
        assert n == N or r.output_ids[-1] in smol.eos_ids
    assert unsure > 5 and checked == unsure, (unsure, checked)
    assert sum(r.stats.target_calls for r in res) < unsure + len(res)  # one call decided several (prefills: 1 each)


def test_rollback_zero_tolerance_is_target_and_lenient_is_mixed(smol, prompts, target_greedy):
    strict = run(smol, prompts, DecodeParams(mode="rollback", gamma=4, threshold=0.0, rollback_nll=0.0))
    assert [r.output_ids for r in strict] == target_greedy
    lenient = run(smol, prompts, DecodeParams(mode="rollback", gamma=4, threshold=0.0, rollback_nll=20.0))
    assert all(r.stats.filtered_fraction > 0.5 for r in lenient)


def test_sampled_speculative_is_seed_reproducible(smol, prompts):
    d = DecodeParams(mode="speculative", gamma=4, threshold=0.0)
    a = run(smol, prompts[:2], d, temperature=0.7, top_p=0.9, seed=3)
    b = run(smol, prompts[:2], d, temperature=0.7, top_p=0.9, seed=3)
    assert [r.output_ids for r in a] == [r.output_ids for r in b]


@pytest.mark.parametrize("decode", [
    DecodeParams(mode="tree", gamma=4, threshold=0.6, tree_width=3),
    DecodeParams(mode="tree", gamma=4, threshold=0.6, tree_width=1, tree_chains=3),
    DecodeParams(mode="lookahead", gamma=8),
])
def test_greedy_tree_and_lookahead_are_identical_to_target(smol, prompts, target_greedy, decode):
    res = run(smol, prompts, decode)
    assert [r.output_ids for r in res] == target_greedy


def test_lookahead_on_a_summarization_style_prompt_accepts_copied_spans(smol):
    text = ("The committee approved the new budget on Tuesday. The new budget increases funding for public "
            "schools and road repairs. Critics said the new budget does not do enough for housing.")
    prompt = encode_prompt(smol.tokenizer, f"Repeat this text exactly:\n{text}")
    reqs = lambda m: [GenerationRequest(prompt, SamplingParams(max_new_tokens=40), decode=DecodeParams(mode=m))]
    eng = make_engine(smol, draft_layers=0)
    ar = eng.generate(reqs("ar"))[0]
    la = eng.generate(reqs("lookahead"))[0]
    assert la.output_ids == ar.output_ids
    assert la.stats.mean_accepted >= 1.0  # effective decoding length >= 2 tokens per target forward


def test_trees_merged_from_two_drafters_are_lossless_and_use_both(smol, prompts, target_greedy):
    """SpecInfer with several drafters: self:10 (main, with its top-k branches) and self:20 chains merged."""
    from calid.workers.messages import DraftTask

    main, extra = ModelRunner(self_draft(smol.model, 10)), ModelRunner(self_draft(smol.model, 20))
    engine = Engine(ModelRunner(smol.model), smol.tokenizer, smol.eos_ids, draft=main, extra_drafts=[extra])
    decode = DecodeParams(mode="tree", gamma=6, threshold=0.6, tree_width=2)
    reqs = [GenerationRequest(encode_prompt(smol.tokenizer, p), SamplingParams(max_new_tokens=N), decode=decode)
            for p in prompts]
    assert [r.output_ids for r in engine.generate(reqs)] == target_greedy
    assert len(extra.caches) == 0 and len(main.caches) == 0  # every drafter's lanes were freed

    ids = encode_prompt(smol.tokenizer, prompts[0])
    task = DraftTask("probe", ids, decode, SamplingParams().warp, 0.51, budget=6)
    merged = engine.drafter.draft([task])[0].tree
    alone = Engine(ModelRunner(smol.model), smol.tokenizer, smol.eos_ids, draft=main).drafter.draft([task])[0].tree
    assert merged.tokens[: len(alone)] == alone.tokens  # the main drafter's tree, plus...
    from calid.workers import DraftWorker

    first = DraftWorker(ModelRunner(self_draft(smol.model, 20)), smol.eos_ids).draft(
        [DraftTask("p2", ids, DecodeParams(mode="speculative", gamma=1, threshold=0.0), SamplingParams().warp,
                   float("inf"), budget=1)])[0].tokens[0]
    assert first in [merged.tokens[i] for i in merged.children(-1)]  # ...the extra drafter's own first token


@pytest.mark.parametrize("mode", ["ar", "speculative", "lookahead", "tree"])
def test_chunked_prefill_output_is_identical_to_unchunked(smol, prompts, mode):
    """SARATHI: a long prompt prefilled in 48-token chunks beside two running short requests."""
    long_prompt = " ".join(f"Item {i}: the value of item {i} is {i * i}." for i in range(40)) + " What is item 7?"
    texts = [long_prompt] + list(prompts[:2])
    draft = ModelRunner(self_draft(smol.model, 10))

    def generate(budget):
        engine = Engine(ModelRunner(smol.model), smol.tokenizer, smol.eos_ids, draft=draft,
                        max_forward_tokens=budget)
        reqs = [GenerationRequest(encode_prompt(smol.tokenizer, t), SamplingParams(max_new_tokens=16),
                                  decode=DecodeParams(mode=mode)) for t in texts]
        return engine.generate(reqs)

    whole = generate(None)
    sizes, forward = [], draft.forward
    draft.forward = lambda inputs: sizes.append(sum(len(i.tokens) for i in inputs)) or forward(inputs)
    chunked = generate(48)
    assert len(encode_prompt(smol.tokenizer, long_prompt)) > 400
    if mode in ("speculative", "tree"):  # the draft prefills in chunks too, never one forward over the whole prompt
        assert sizes and max(sizes) <= 48
    assert [r.output_ids for r in chunked] == [r.output_ids for r in whole]
    assert chunked[0].stats.prefill_chunks >= 8 and whole[0].stats.prefill_chunks == 0
    # the short requests decode while the long prompt is still being prefilled
    assert max(chunked[1].ttft_s, chunked[2].ttft_s) < chunked[0].ttft_s
