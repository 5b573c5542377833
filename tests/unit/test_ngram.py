"""N-gram (prompt lookup) drafts: exact proposals on hand-built sequences."""
import random

import pytest

from calid.decoding.ngram import Copy, CopyHazard, CopyShare, NgramConfig, NgramIndex


def index(ids, **cfg) -> NgramIndex:
    ix = NgramIndex(NgramConfig(**cfg))
    ix.extend(ids)
    return ix


def test_the_continuation_of_the_longest_earlier_match_is_proposed():
    #        0  1  2  3  4  5  6  7  8  9
    ids = [5, 6, 7, 8, 9, 1, 2, 6, 7, 8]
    # suffix (6, 7, 8) occurred at 1..3; what followed: 9, 1, 2, ...
    assert index(ids).propose(3) == [9, 1, 2]
    assert index(ids).propose(10) == [9, 1, 2, 6, 7, 8]  # never past the sequence's end


def test_the_most_recent_occurrence_wins_and_a_suffix_never_matches_itself():
    ids = [1, 2, 3, 1, 2, 4, 1, 2]
    assert index(ids).propose(1) == [4]  # (1, 2) last seen before the suffix at 3..4, followed by 4
    assert index([1, 2, 3, 4]).propose(4) == []  # nothing repeats


def test_a_copy_follows_the_occurrence_the_sequence_agrees_with_longest():
    """A docstring restated: the passage 5 6 7 8 1 2 3 4 9 9, then a short repeat 0 1 2 3 4 7, then the passage
    again up to 1 2 3 4. The most recent occurrence of (1, 2, 3, 4) agrees for 4 tokens and proposes 7; the older
    one agrees for 8 and proposes 9 9, which the copy takes. Among equally long agreements the most recent wins,
    and only the last CANDIDATES occurrences are kept."""
    from calid.decoding.ngram import CANDIDATES

    ids = [5, 6, 7, 8, 1, 2, 3, 4, 9, 9] + [0, 1, 2, 3, 4, 7] + [5, 6, 7, 8, 1, 2, 3, 4]
    assert index(ids).propose(2) == [7, 5]  # the most recent occurrence, without the walk
    assert index(ids).copy(2) == Copy([9, 9], 8)
    equal = [1, 2, 3, 4, 8, 20, 21, 22, 23, 24, 25, 1, 2, 3, 4, 9, 30, 31, 32, 33, 34, 35, 1, 2, 3, 4]
    assert index(equal).copy(1) == Copy([9], 4)
    repeats = [t for k in range(CANDIDATES) for t in [50 + 10 * k + q for q in range(6)] + [1, 2, 3, 4]]
    older = [5, 6, 7, 8, 1, 2, 3, 4, 9, 9] + repeats + [5, 6, 7, 8, 1, 2, 3, 4]
    assert index(older).copy(2) == Copy([5, 6], 4)  # the long-agreeing occurrence is no longer a candidate


def test_shorter_suffixes_are_tried_down_to_min_n():
    ids = [9, 3, 4, 5, 8, 4, 5]  # (8, 4, 5) never seen, (4, 5) seen at 2..3 -> 8
    assert index(ids).propose(2) == [8, 4]
    assert index(ids, min_n=3).propose(2) == []
    assert index([7, 1, 7], min_n=1, max_n=2).propose(1) == [1]


def test_appending_token_by_token_equals_indexing_at_once():
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5, 1, 4, 1, 5]
    grown = NgramIndex()
    for end in range(1, len(ids) + 1):
        grown.extend(ids[:end])
        assert grown.propose(5) == index(ids[:end]).propose(5), end


def test_a_different_sequence_rebuilds_the_index():
    ix = index([1, 2, 3, 1, 2])
    assert ix.propose(1) == [3]
    ix.extend([4, 5, 6, 4])
    assert ix.ids == [4, 5, 6, 4] and ix.propose(2) == []
    assert index([1, 2]).propose(0) == []


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="min_n"):
        NgramConfig(min_n=3, max_n=2)


# ---- Copy: how far the sequence agrees with the copied text, and what a chain of it is worth -----------------

def test_agreement_counts_back_from_the_match_to_the_first_difference():
    # ... 5 [1 2 3] 9 ... 4 [1 2 3]: the suffix 1 2 3 matches; before it, 5 and 4 differ: agreed 3
    assert index([5, 1, 2, 3, 9, 8, 4, 1, 2, 3]).copy(2) == Copy([9, 8], 3)
    # 6 5 1 2 3 | 9 ... 6 5 1 2 3: the match is the last 4 tokens (max_n), the agreement runs back 5
    copy = index([6, 5, 1, 2, 3, 9, 7, 6, 5, 1, 2, 3]).copy(3)
    assert copy.tokens == [9, 7, 6] and copy.agreed == 5
    # the walk back stops at the start of the sequence and at the limit it is given
    assert index([1, 2, 9, 1, 2]).copy(1).agreed == 2
    assert index([6, 5, 1, 2, 3, 9, 7, 6, 5, 1, 2, 3]).copy(3, longest_agreement=4).agreed == 4
    assert index([1, 2, 3, 4]).copy(4) == Copy([], 0) and index([1, 2, 1, 2]).copy(0) == Copy([], 0)


def test_a_long_agreement_is_counted_to_the_token_whatever_the_walks_chunks():
    """Copies longer than the walk's chunks (RUN_CHUNK): the count stops at the first difference, at the limit,
    and at the sequence's start, token-exact on either side of a chunk's edge."""
    from calid.decoding.ngram import RUN_CHUNK, agreement

    body = list(range(100, 100 + 3 * RUN_CHUNK + 5))
    for differ_at in (1, RUN_CHUNK - 1, RUN_CHUNK, RUN_CHUNK + 1, 2 * RUN_CHUNK + 3):
        # the copy's last differ_at - 1 tokens are the source's, the ones before them all differ (no edit to skip)
        copy = [5000 + t for t in body[: len(body) - differ_at + 1]] + body[len(body) - differ_at + 1:]
        ids = [1] + body + [2] + copy
        assert agreement(ids, 1 + len(body), len(ids)) == differ_at - 1
    ids = body + [2] + body  # agrees back to the sequence's start
    assert agreement(ids, len(body), len(ids)) == len(body)
    for longest in (RUN_CHUNK - 1, RUN_CHUNK, 2 * RUN_CHUNK + 1):
        assert agreement(ids, len(body), len(ids), longest=longest) == longest


def test_agreement_runs_on_through_small_edits():
    """A renamed function: the copy breaks where the new name has an extra token, then agrees again."""
    from calid.decoding.ngram import EDITS, agreement

    src = [10, 11, 12, 13, 14, 15, 16, 17, 18]
    edited = [10, 11, 12, 13, 99, 14, 15, 16]  # one token inserted after 13 (a rename's "_v2")
    ids = src + [50] + edited
    at, end = 7, len(ids)  # the source's ... 14 15 16 ends before 17; the sequence ends ... 14 15 16
    assert agreement(ids, at, end) == 3 + 4  # 14 15 16, skip 99, then 10 11 12 13
    assert agreement(ids, at, end, longest=5) == 5
    # a replaced token (deleted in the copy, inserted in its place) and a deleted one
    assert agreement(src + [50] + [10, 11, 12, 13, 77, 15, 16], 7, 17) == 2 + 4
    assert agreement(src + [50] + [10, 11, 12, 13, 15, 16], 7, 16) == 2 + 4
    # what agrees again must be RESYNC tokens long: one token after an edit does not count
    assert agreement([4, 5, 1, 2, 3, 8, 9, 50, 6, 5, 7, 3, 8, 9], 7, 14) == 3
    # edits pass at most EDITS times; six tokens inserted is not a small edit
    many = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    copy = [1, 2, 3, 4, 90, 5, 6, 7, 8, 91, 9, 10, 11, 12, 92, 13, 14, 15, 16]
    assert agreement(many + [60] + copy, 16, 40) == 4 + 4 + 4 + (4 if EDITS >= 3 else 0)
    assert agreement(many + [60] + [1, 2, 3, 4, 90, 91, 92, 93, 94, 95, 5, 6, 7], 7, 34) == 3
    # a periodic sequence agrees back to its start
    assert agreement([1, 2, 1, 2, 1, 2], 4, 6) == 4


def test_a_copy_is_worth_more_the_longer_it_has_agreed():
    assert Copy([1, 2, 3], agreed=2).survival() == pytest.approx([1 / 2, 1 / 3, 1 / 4])  # a fresh 2-gram match
    # 10 tokens beyond the shortest match: Laplace's rule of succession, S(j) = 11 / (11 + j)
    assert Copy([0] * 4, agreed=12).survival() == pytest.approx([11 / 12, 11 / 13, 11 / 14, 11 / 15])
    assert Copy([0] * 3, agreed=12, min_n=3).survival()[0] == pytest.approx(10 / 11)
    assert Copy([], agreed=30).survival() == []
    # the product of the per-token chances: each next token holds with (A+1+i) / (A+2+i)
    s = Copy([0] * 16, agreed=7).survival()
    assert s[-1] == pytest.approx(6 / 22) and all(a > b for a, b in zip(s, s[1:]))


def test_an_untaught_hazard_prices_copies_by_laplaces_rule():
    for copy in (Copy([1, 2, 3], agreed=2), Copy([0] * 16, agreed=7), Copy([0] * 40, agreed=200), Copy([], agreed=9)):
        for share in (0.0, 0.5, 1.0):
            assert CopyHazard().survival(copy, share) == pytest.approx(copy.survival())


def test_copies_that_held_raise_the_price_of_the_next_and_broken_ones_lower_it():
    probe = Copy([0] * 12, agreed=2 + 10)  # a copy that has run 10 tokens past its match
    held, broke = CopyHazard(), CopyHazard()
    for _ in range(20):  # copies verified from run 10 on, in requests whose copies foresaw 90% of their output
        held.observe(probe, 0.9, verified=12, held=12)  # all 12 tokens held
        broke.observe(probe, 0.9, verified=12, held=0)  # the first broke
    laplace = probe.survival()
    assert all(h > s for h, s in zip(held.survival(probe, 0.9), laplace))
    assert broke.survival(probe, 0.9)[0] < laplace[0] / 2
    assert held.survival(probe, 0.9)[-1] > 0.8
    # only the run lengths it saw move: a fresh match is still priced by Laplace's rule
    fresh = Copy([5, 6], agreed=2)
    assert held.survival(fresh, 0.9)[0] == pytest.approx(fresh.survival()[0])
    # nor does a request whose copies foresaw little of its output (a chat answer) inherit code's long copies
    assert held.survival(probe, 0.1) == pytest.approx(laplace)
    # a break counts once, at the token that broke; tokens past it were never judged
    one = CopyHazard(decay=1.0)
    one.observe(Copy([0] * 8, agreed=2), 0.5, verified=8, held=3)
    assert sum(map(sum, one.held)) == 3 and sum(map(sum, one.broke)) == 1


def test_a_copy_across_run_buckets_takes_each_runs_own_hazard():
    """A long copy's runs cross several buckets: each token's hazard is its own run's bucket's counts beside
    Laplace's prior at that run."""
    hazard, rng = CopyHazard(), random.Random(3)
    for _ in range(60):
        run = rng.randrange(0, 200)
        verified = rng.randrange(1, 33)
        hazard.observe(Copy([0] * verified, agreed=2 + run), 0.9, verified=verified, held=rng.randrange(verified + 1))
    buckets = (0, 1, 2, 3, 5, 8, 12, 17, 24, 33, 48, 64, 96, 128, 192, 256)  # RUN_BUCKETS, spelt out
    for run in (0, 4, 30, 90, 250):
        copy, k = Copy([0] * 32, agreed=2 + run), 4  # share 0.9: the last class
        expected, s = [], 1.0
        for a in range(run, run + 32):
            b = max(i for i, edge in enumerate(buckets) if edge <= a)
            held, broke = hazard.held[k][b], hazard.broke[k][b]
            s *= 1 - (broke + hazard.prior / (a + 2)) / (held + broke + hazard.prior)
            expected.append(s)
        assert hazard.survival(copy, 0.9) == pytest.approx(expected)


def test_what_a_hazard_learned_fades_when_the_traffic_changes():
    probe = Copy([0] * 12, agreed=2 + 10)
    hazard = CopyHazard()
    for _ in range(50):
        hazard.observe(probe, 0.9, verified=12, held=12)
    bold = hazard.survival(probe, 0.9)[-1]
    for _ in range(50):  # the same kind of request now breaks its copies at once
        hazard.observe(probe, 0.9, verified=12, held=0)
    assert hazard.survival(probe, 0.9)[0] < probe.survival()[0] < bold


def test_a_requests_copy_share_counts_the_tokens_its_proposals_foresaw():
    share = CopyShare()
    assert share.value == 0.5  # nothing seen yet
    share.update([7, 8, 9], [7, 8, 4])  # two tokens continued the proposal, the third parted from it
    share.update([], [3])  # no proposal: nothing foreseen
    share.update([5, 6], [1])  # a plain step that did not take the proposal's first token
    assert (share.foreseen, share.produced) == (2, 5) and share.value == pytest.approx(3 / 7)
