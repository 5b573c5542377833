"""min_agreement: the agreement table, the threshold it picks, and the online estimate on a scripted pair; and on
the same pair, filter's chains that draft on past their unsure tokens."""
from __future__ import annotations

import hashlib
import math
import random

import pytest
import torch

from calid.decoding.budget import BINS, AgreementTable, BudgetController, bin_of, calibration_path, starting_table
from calid.decoding.modes import DecodeParams
from calid.engine import Engine
from calid.errors import InvalidRequestError
from calid.generation import GenerationRequest, SamplingParams

V = 64


def _random_table(rng: random.Random) -> AgreementTable:
    positions = [rng.uniform(0.5, 50) for _ in range(BINS)]
    return AgreementTable(positions, [n * rng.random() for n in positions])


def test_predict_is_the_closed_form():
    t = AgreementTable([0.0] * (BINS - 2) + [10.0, 30.0], [0.0] * (BINS - 2) + [5.0, 27.0])
    assert t.predict(0.0) == pytest.approx((1 - (5 + 3) / 40, 1.0))
    assert t.predict(0.95) == pytest.approx((1 - 3 / 40, 0.75))  # only the top bin is accepted
    assert t.predict(1.0) == pytest.approx((1.0, 0.0))
    assert t.threshold_for(0.9) == 0.95 and t.threshold_for(0.8) == 0.0 and t.threshold_for(1.0) == 1.0


@pytest.mark.parametrize("seed", range(5))
def test_the_threshold_for_a_budget_is_monotone_and_holds_it(seed):
    table = _random_table(random.Random(seed))
    budgets = [i / 100 for i in range(40, 101)]
    thresholds = [table.threshold_for(b) for b in budgets]
    assert thresholds == sorted(thresholds)
    for b, t in zip(budgets, thresholds):
        agreement, _ = table.predict(t)
        assert agreement >= b - 1e-9
        if t > 0:  # the next lower edge would break the budget: the filtered fraction is as large as it may be
            assert table.predict(t - 1 / BINS)[0] < b


def test_the_controller_tightens_after_a_shortfall_and_loosens_after_a_surplus():
    table = AgreementTable()
    c = BudgetController(0.9)
    assert c.target() == 0.9
    c.record(70, 100)
    assert c.target() > 0.9 and c.threshold(table) >= table.threshold_for(0.9)
    good = BudgetController(0.9)
    good.record(100, 100)
    assert good.target() < 0.9 and good.threshold(table) <= table.threshold_for(0.9)


def test_a_calibration_file_round_trips_and_a_bad_one_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("CALID_HOME", str(tmp_path))
    measured = AgreementTable([float(b + 1) for b in range(BINS)], [b / 2 + 0.5 for b in range(BINS)])
    path = calibration_path("qwen-target", "self:16")
    assert starting_table("qwen-target", "self:16") == (AgreementTable(), None)  # nothing written: the prior
    import json
    path.write_text(json.dumps(measured.to_json()))
    table, source = starting_table("qwen-target", "self:16")
    assert source == path and "self_16" in path.name
    for b in range(BINS):  # rates kept, weights scaled down to a prior's
        assert table.matches[b] / table.positions[b] == pytest.approx(measured.matches[b] / measured.positions[b])
    assert sum(table.positions) == pytest.approx(4.0 * BINS)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="calid bench quality"):
        starting_table("qwen-target", "self:16")


def test_min_agreement_is_validated():
    DecodeParams(mode="filter", min_agreement=0.9).validate()
    for bad in (0.0, 1.5, float("nan"), -1):
        with pytest.raises(InvalidRequestError, match="min_agreement"):
            DecodeParams(mode="filter", min_agreement=bad).validate()
    with pytest.raises(InvalidRequestError, match="mode filter"):
        DecodeParams(mode="speculative", min_agreement=0.9).validate()


# ---- a scripted pair: the draft's confidence and whether its top-1 is the target's are known per position ----

LEVELS = (0.375, 0.575, 0.775, 0.975)  # the draft's top-1 probability at a position (mid-bin): one of these
MATCH = {0.375: 0.3, 0.575: 0.6, 0.775: 0.8, 0.975: 0.97}  # ...and how often its top-1 is then the target's


def _mix(*xs: int) -> int:
    return int.from_bytes(hashlib.blake2b(repr(xs).encode(), digest_size=8).digest(), "little")


class ScriptedRunner:
    """Logits from the ids so far only (no weights): the target's top-1 is a hash of the context; the draft
    puts probability ``LEVELS[k]`` on a token that is the target's with probability ``MATCH`` of it."""

    device = torch.device("cpu")
    vocab_size = V
    max_sequences = None  # no slot limit
    max_position = 4096

    def __init__(self, is_draft: bool):
        from calid.runtime.runner import RunnerStats

        self.is_draft = is_draft
        self.cache: dict = {}
        self.stats = RunnerStats()

    def target_token(self, ids: list[int]) -> int:
        return _mix(len(ids), *ids[-3:]) % V

    def row(self, ids: list[int]) -> torch.Tensor:
        best = self.target_token(ids)
        if not self.is_draft:
            row = torch.zeros(V)
            row[best] = 5.0
            return row
        h = _mix(7, len(ids), *ids[-3:])
        p = LEVELS[h % len(LEVELS)]
        if (h >> 8) % 10_000 >= MATCH[p] * 10_000:
            best = (best + 1 + (h >> 24) % (V - 1)) % V
        row = torch.zeros(V)
        row[best] = math.log(p * (V - 1) / (1 - p))
        return row

    def cached_prefix(self, seq, ids):
        have = self.cache.get(seq, [])
        n = 0
        while n < min(len(have), len(ids)) and have[n] == ids[n]:
            n += 1
        return n

    def sync(self, seq, ids, keep_at_most=None):
        cap = len(ids) - 1 if keep_at_most is None else min(keep_at_most, len(ids) - 1)
        keep = min(self.cached_prefix(seq, ids), cap)
        self.cache[seq] = list(ids[:keep])
        return ids[keep:]

    def forward(self, inputs):
        out = []
        for inp in inputs:
            ids = self.cache.setdefault(inp.seq_id, [])
            ids += inp.tokens
            self.stats.tokens += len(inp.tokens)
            start = len(ids) - len(inp.tokens)
            rows = inp.logits_at if inp.logits_at is not None else [len(inp.tokens) - 1]
            out.append(torch.stack([self.row(ids[: start + r + 1]) for r in rows]))
        return out

    def release(self, seq):
        self.cache.pop(seq, None)


class Tok:
    def decode(self, ids, **kw):
        return " ".join(map(str, ids))


def _engine() -> Engine:
    return Engine(ScriptedRunner(False), Tok(), frozenset(), draft=ScriptedRunner(True), max_batch=8)


def _requests(n: int, budget: float | None, seed: int, threshold: float = 0.4) -> list[GenerationRequest]:
    rng = random.Random(seed)
    decode = DecodeParams(mode="filter", gamma=8, threshold=threshold, min_agreement=budget)
    return [GenerationRequest([rng.randrange(V) for _ in range(5)], SamplingParams(max_new_tokens=64), decode=decode)
            for _ in range(n)]


def _true_agreement(results, runner: ScriptedRunner, prompts) -> float:
    """Share of output tokens equal to the target's top-1 given the same prefix (the scripted truth)."""
    agree = total = 0
    for r, prompt in zip(results, prompts):
        ids = list(prompt)
        for t in r.output_ids:
            agree += t == runner.target_token(ids)
            total += 1
            ids.append(t)
    return agree / total


def test_the_online_estimate_converges_to_the_scripted_truth():
    eng = _engine()
    reqs = _requests(24, 0.8, seed=1)
    eng.generate(reqs)
    table = eng.orchestrator.agreement
    for p, rate in MATCH.items():
        b = bin_of(p)
        assert table.positions[b] > 60, f"bin of {p} barely observed"
        assert table.matches[b] / table.positions[b] == pytest.approx(rate, abs=0.08)
    # the threshold it now picks is the one the true rates call for
    rate_of = {bin_of(p): MATCH[p] for p in LEVELS}  # the levels are equally likely
    true = AgreementTable([1.0 if b in rate_of else 0.0 for b in range(BINS)],
                          [rate_of.get(b, 0.0) for b in range(BINS)])
    for budget in (0.7, 0.85, 0.95):
        assert table.threshold_for(budget) == pytest.approx(true.threshold_for(budget), abs=0.25)


@pytest.mark.parametrize("budget", [0.75, 0.9, 0.97])
def test_requests_hold_their_budget_and_draft_as_the_budget_allows(budget):
    eng = _engine()
    eng.generate(_requests(16, budget, seed=2))  # warm the table on other prompts
    reqs = _requests(16, budget, seed=3)
    results = eng.generate(reqs)
    agreement = _true_agreement(results, ScriptedRunner(True), [r.prompt_ids for r in reqs])
    filtered = sum(r.stats.draft_tokens for r in results) / sum(len(r.output_ids) for r in results)
    assert agreement >= budget - 0.03, f"budget {budget}: agreement {agreement:.3f}"
    assert filtered > 0.1  # a budget below 1 still drafts: the top level alone agrees 97%
    # and it drafts more than a threshold that the truth says is needlessly strict
    strict = eng.generate(_requests(16, None, seed=3, threshold=0.99))
    assert filtered > sum(r.stats.draft_tokens for r in strict) / sum(len(r.output_ids) for r in strict)


def test_auditing_a_filter_request_observes_it_without_changing_its_output():
    eng = _engine()
    plain = eng.generate(_requests(4, None, seed=4, threshold=0.5))  # runs of early acceptance between target calls
    assert eng.orchestrator.audited == [0, 0] and eng.orchestrator.agreement == AgreementTable()
    eng.orchestrator.audit_every = 1
    audited = eng.generate(_requests(4, None, seed=4, threshold=0.5))
    assert [r.output_ids for r in audited] == [r.output_ids for r in plain]
    assert [r.stats.target_calls for r in audited] == [r.stats.target_calls for r in plain]
    agreed, counted = eng.orchestrator.audited
    assert counted > 100 and 0.3 < agreed / counted < 1.0


# ---- filter's chain past unsure tokens, on the same scripted pair ------------------------------------------------

def _draft_view(ids: list[int]) -> tuple[float, int]:
    """The scripted draft's top-1 probability and top-1 after ``ids``."""
    row = ScriptedRunner(True).row(ids)
    return float(torch.softmax(row, -1).max()), int(row.argmax())


def test_a_filter_chain_drafts_on_past_its_unsure_tokens_to_its_budget():
    """...or to the first token the draft is less sure of than STOP_THRESHOLD (0.4; the 0.375 level here)."""
    from calid.decoding.confidence import Threshold
    from calid.decoding.sampling import Warp
    from calid.workers.draft import DraftWorker
    from calid.workers.messages import DraftTask

    worker = DraftWorker(ScriptedRunner(True), frozenset())
    rng = random.Random(6)
    prompts = [[rng.randrange(V) for _ in range(5)] for _ in range(12)]
    results = worker.draft([DraftTask(i, p, DecodeParams(mode="filter", gamma=8, threshold=0.7), Warp(),
                                      Threshold.from_prob(0.7).nll, budget=8) for i, p in enumerate(prompts)])
    went_on = 0
    for d, prompt in zip(results, prompts):
        ids, unsure = list(prompt), []
        for i, token in enumerate(d.tokens):
            prob, top = _draft_view(ids)
            assert token == top and d.probs[i] == pytest.approx(prob)
            unsure += [i] if prob < 0.7 else []
            assert prob >= 0.4 or i == len(d.tokens) - 1  # only the last may be below the stop
            ids.append(token)
        assert len(d.tokens) == 8 or d.probs[-1] < 0.4
        assert d.unsure == unsure and d.needs_target == bool(unsure) and d.forwards == len(d.tokens)
        went_on += bool(unsure) and unsure[0] < len(d.tokens) - 1
    assert went_on >= 3  # chains that drafted on after an unsure token


@pytest.mark.parametrize("max_batch", [1, 8])
def test_filter_keeps_the_targets_token_wherever_the_draft_was_unsure(max_batch):
    """Each output token is the target's top-1 where the draft was unsure, and the draft's or the target's top-1
    where it was sure; one target call decides several unsure tokens (the chain went on past the first)."""
    eng = Engine(ScriptedRunner(False), Tok(), frozenset(), draft=ScriptedRunner(True), max_batch=max_batch)
    reqs = _requests(16, None, seed=5, threshold=0.7)
    results = eng.generate(reqs)
    target = ScriptedRunner(False)
    unsure = kept_lossy = 0
    for r, req in zip(results, reqs):
        ids = list(req.prompt_ids)
        for token in r.output_ids:
            prob, top = _draft_view(ids)
            if prob < 0.7:
                assert token == target.target_token(ids)
                unsure += 1
            else:
                assert token in (top, target.target_token(ids))
                kept_lossy += token == top != target.target_token(ids)
            ids.append(token)
    assert kept_lossy > 0  # filter is lossy: a sure draft token stands though the target would differ
    assert sum(r.stats.target_calls for r in results) < unsure
