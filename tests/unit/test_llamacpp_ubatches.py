"""How llama.cpp splits a batch over per-sequence KV streams into ubatches (calid.runtime.llamacpp.ubatches)."""
from calid.runtime.llamacpp import ubatches


def test_one_token_on_each_of_adjacent_slots_is_one_ubatch_and_a_gap_makes_two():
    assert ubatches(list(range(12))) == [(12, 1)]
    assert ubatches([0, 1, 2, 3, 4, 5, 20, 21, 22, 23, 24, 25]) == [(6, 1), (6, 1)]


def test_longer_sequences_run_as_more_slices_over_runs_of_adjacent_slots():
    one_long = [0] * 17 + list(range(1, 12))  # 1 x 17 + 11 x 1: 12 x 1, then 1 x 16
    assert ubatches(one_long) == [(12, 1), (1, 16)]
    side_by_side = [s for s in range(12) for _ in range(5 if s < 6 else 1)]  # 6 x 5 on slots 0..5, 6 x 1
    assert ubatches(side_by_side) == [(12, 1), (6, 4)]
    alternate = [s for s in range(12) for _ in range(5 if s % 2 == 0 else 1)]  # 6 x 5 on even slots
    assert ubatches(alternate) == [(12, 1)] + [(1, 4)] * 6


def test_a_ubatch_holds_at_most_n_ubatch_tokens():
    assert ubatches([0] * 1000, n_ubatch=512) == [(1, 512), (1, 488)]
    assert ubatches([0] * 300 + [1] * 300, n_ubatch=512) == [(2, 256), (2, 44)]
    assert ubatches([]) == []
