"""The planner's cost model per target replica: requests are planned with the costs of the replica that holds
them, and a replica's table starts from the pooled one and then follows that replica's own timings."""
from calid.decoding.modes import DecodeParams
from calid.generation import GenerationRequest, SamplingParams
from calid.orchestrator import Orchestrator


class _Tokenizer:
    def decode(self, ids, **kw):
        return " ".join(map(str, ids))


def _orchestrator(placement: dict) -> Orchestrator:
    orch = Orchestrator(_Tokenizer(), frozenset(), max_position=512, has_draft=True)
    orch.replica_of = placement.get
    for lanes, secs in ((1, 0.002), (16, 0.004)):
        orch.observe_draft(lanes, 1, secs)
    return orch


def _active(orch: Orchestrator, ids: list[str]):
    states = []
    for rid in ids:
        s = orch.start(orch.validate(GenerationRequest([5, 6, 7], SamplingParams(max_new_tokens=32), request_id=rid,
                                                       decode=DecodeParams(mode="auto", gamma=6))))
        s.stats.target_calls = 1  # past the prefill
        states.append(s)
    return states


def test_requests_are_planned_with_the_costs_of_the_replica_that_holds_them():
    orch = _orchestrator({"a": "gpu", "b": "gpu", "c": "cpu", "d": "cpu"})
    for _ in range(3):  # the GPU replica verifies 9 tokens in about one decode, the CPU one in about 5 decodes
        for tokens, gpu, cpu in ((1, 0.020, 0.036), (4, 0.0205, 0.095), (8, 0.021, 0.173), (16, 0.022, 0.219)):
            orch.observe_verify(tokens, gpu, "gpu")
            orch.observe_verify(tokens, cpu, "cpu")
    states = _active(orch, ["a", "b", "c", "d"])
    drafted = {t.request_id for t in orch.draft_tasks(states)}
    assert drafted == {"a", "b"}
    assert {orch.decode_of(s).mode for s in states[2:]} == {"ar"}


def test_a_replica_table_starts_from_the_pooled_one_and_follows_its_own_timings():
    orch = _orchestrator({})
    orch.observe_verify(1, 0.030)
    orch.observe_verify(16, 0.060)
    assert orch.verify_cost_of("new") is orch.verify_cost  # not timed yet: the pooled table
    orch.observe_verify(16, 0.010, "fast")
    fast = orch.verify_cost_of("fast")
    assert fast(1) == 0.030  # seeded from the pool
    assert 0.010 < fast(16) < 0.060  # moved towards its own timing
    for _ in range(30):
        orch.observe_verify(16, 0.010, "fast")
    assert abs(fast(16) - 0.010) < 1e-4
    for _ in range(5):
        orch.observe_verify(16, 0.200, "slow")
    assert abs(fast(16) - 0.010) < 1e-4  # one replica's timings leave another's table alone
    assert orch.verify_cost_of("slow")(16) > 0.15 and orch.verify_cost(16) > 0.15  # the pool hears every replica


def test_a_replica_timed_before_the_calibration_still_gets_its_sizes():
    """A served app's first requests may be plain (ar) steps timed on their replica before any auto request has
    the router calibrate: that replica's table then knew one size, priced every verification as that many
    one-token steps, and auto never drafted at one request in flight (found on the Qwen pair at c=1)."""
    orch = _orchestrator({"a": "r0"})
    orch.observe_verify(1, 0.070, "r0")  # a warm-up request's plain step
    for tokens, secs in ((1, 0.068), (4, 0.110), (8, 0.184), (16, 0.208)):  # the calibration, later
        orch.observe_verify(tokens, secs)
    table = orch.verify_cost_of("r0")
    assert table.sizes == [1, 4, 8, 16] and table(1) == 0.070  # its own timing of size 1 stays
    assert table(8) == 0.184
    states = _active(orch, ["a"])
    assert [t.request_id for t in orch.draft_tasks(states)] == ["a"]  # verifying a chain now pays: it drafts


def test_pinned_cost_tables_ignore_timings_and_the_guard():
    """Engine.set_costs pins the tables: a test or an operator that gives them gets its plans as priced (timings
    fed back into a pinned table made a real-model test's plan follow the machine's load)."""
    from calid.planning import CostTable

    orch = _orchestrator({})
    verify, draft = CostTable(), CostTable()
    for size, secs in ((1, 0.020), (8, 0.022)):
        verify.observe(size, secs)
    draft.observe(1, 0.001)
    orch.pin_costs(verify, draft)
    orch.observe_verify(8, 0.500)
    orch.observe_draft(1, 1, 0.300)
    assert (orch.verify_cost(8), orch.draft_cost(1)) == (0.022, 0.001) and orch.guard is None
