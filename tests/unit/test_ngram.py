"""N-gram (prompt lookup) drafts: exact proposals on hand-built sequences."""
import pytest

from calid.decoding.ngram import NgramConfig, NgramIndex


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


# ---- CopyRecord: what proposals would have yielded, read from the committed tokens -------------------------

def test_a_proposal_is_settled_once_the_committed_tokens_decide_it():
    from calid.decoding.ngram import CopyRecord

    rec = CopyRecord(longest=4, decay=1.0, prior=0.5)
    rec.propose(3, [7, 8, 9])  # proposed for positions 3, 4, 5
    rec.resolve([1, 2, 3, 7, 8])  # 7, 8 hold so far, 9 not known yet: still pending
    assert rec.trials[1] == 0
    rec.resolve([1, 2, 3, 7, 8, 5])  # position 5 is 5, not 9: held 2, failed at the third token
    assert rec.trials[1:] == [1, 1, 1, 0] and rec.fails[1:] == [0, 0, 1, 0]
    rec.propose(6, [4, 4])
    rec.resolve([1, 2, 3, 7, 8, 5, 4, 4])  # held whole: reached 1 and 2, failed nowhere
    assert rec.trials[1:] == [2, 2, 1, 0] and rec.fails[1:] == [0, 0, 1, 0]
    rec.propose(8, [])  # no proposal: nothing to learn
    rec.propose(8, [6])
    rec.resolve([1, 2, 3])  # cut back before it: dropped, says nothing
    assert rec.trials[1:] == [2, 2, 1, 0]


def test_survival_is_read_position_by_position_from_the_prior_up():
    from calid.decoding.ngram import CopyRecord

    rec = CopyRecord(longest=4, decay=1.0, prior=0.5)
    assert rec.survival(3) == pytest.approx([0.5, 0.25, 0.125])  # nothing seen: a coin at each position
    for k in range(10):  # ten copies of 3 that held, then broke at their 4th token
        rec.propose(4 * k, [1, 1, 1, 2])
        rec.resolve([0] * (4 * k) + [1, 1, 1, 3])
    later = 10.5 / 31  # breaks past the first token: 10 of 30 positions reached (plus the prior's half of one)
    s1, s2 = 1 - 0.5 / 11, 1 - later / 11
    assert rec.survival(4) == pytest.approx([s1, s1 * s2, s1 * s2 * s2, s1 * s2 * s2 * (1 - (10 + later) / 11)])
    assert len(rec.survival(9)) == 4  # never past the longest chain


def test_old_outcomes_are_forgotten():
    from calid.decoding.ngram import CopyRecord

    rec = CopyRecord(longest=2, decay=0.8, prior=0.5)
    for k in range(20):  # copies that fail at once, then copies that hold: the record follows the change
        rec.propose(k, [-1])
        rec.resolve(list(range(k + 1)))
    assert rec.survival(1)[0] < 0.2
    for k in range(20, 40):
        rec.propose(k, [k])
        rec.resolve(list(range(k + 1)))
    assert rec.survival(1)[0] > 0.8
