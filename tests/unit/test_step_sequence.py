"""Orchestrator.step: the one step sequence calid.Engine and the Serve router both drive. It asks for a draft
call, then a verify call, and hands out events; a request the driver failed drops out of the step; a caller's
own drafts (an edge client's round) replace the draft call for their requests."""
from calid.decoding.modes import DecodeParams
from calid.generation import GenerationRequest, SamplingParams
from calid.orchestrator import Deliver, DraftCall, Orchestrator, VerifyCall, advance
from calid.workers.messages import DraftResult, VerifyResult

EOS = 2


class _Tokenizer:
    def decode(self, ids, **kw):
        return " ".join(map(str, ids))


def _start(orch, rid, mode):
    s = orch.start(orch.validate(GenerationRequest([5, 6, 7], SamplingParams(max_new_tokens=8), request_id=rid,
                                                   decode=DecodeParams(mode=mode, gamma=2))))
    orch.after_verify([VerifyResult(rid, [9], 0, 0, False)])  # past its prefill
    return s


def _drive(orch, states, draft, verify, own=()):
    """Run one step; ``draft``/``verify`` answer the calls. Returns the calls made and the events delivered."""
    calls, events = [], []
    step = orch.step(states, list(own))
    io = advance(step)
    while io is not None:
        calls.append(io)
        if isinstance(io, DraftCall):
            io = advance(step, draft(io.tasks))
        elif isinstance(io, VerifyCall):
            io = advance(step, verify(io.tasks))
        else:
            assert isinstance(io, Deliver)
            events += io.events
            io = advance(step)
    return calls, events


def _accept_all(tasks):
    return [VerifyResult(t.request_id, [*t.draft, 4], len(t.draft), len(t.draft), True) for t in tasks]


def test_a_step_drafts_then_verifies_then_delivers_what_was_accepted():
    orch = Orchestrator(_Tokenizer(), frozenset({EOS}), max_position=256, has_draft=True)
    states = [_start(orch, "a", "speculative"), _start(orch, "b", "ar")]
    calls, events = _drive(orch, states, lambda tasks: [DraftResult(t.request_id, [11, 12], None, True, forwards=2)
                                                         for t in tasks], _accept_all)
    kinds = [type(c).__name__ for c in calls]
    assert kinds == ["DraftCall", "VerifyCall", "Deliver"]
    assert [t.request_id for t in calls[0].tasks] == ["a"]  # ar asks nothing of the draft
    assert {t.request_id: t.draft for t in calls[1].tasks} == {"a": [11, 12], "b": []}
    assert states[0].output == [9, 11, 12, 4] and states[1].output == [9, 4]
    assert {e.request_id for e in events} == {"a", "b"}


def test_a_request_the_driver_failed_during_the_draft_call_drops_out_of_the_step():
    orch = Orchestrator(_Tokenizer(), frozenset({EOS}), max_position=256, has_draft=True)
    states = [_start(orch, "a", "speculative"), _start(orch, "b", "speculative")]

    def draft(tasks):
        orch.finish("a")  # the driver could not reach a's worker: it failed a
        return [DraftResult("b", [11], None, True, forwards=1)]

    calls, events = _drive(orch, states, draft, _accept_all)
    assert [t.request_id for t in calls[1].tasks] == ["b"]
    assert {e.request_id for e in events} == {"b"}


def test_own_drafts_are_not_drafted_again_and_a_confident_filter_draft_needs_no_target():
    orch = Orchestrator(_Tokenizer(), frozenset({EOS}), max_position=256, has_draft=True)
    states = [_start(orch, "edge", "filter"), _start(orch, "here", "speculative")]
    own = [DraftResult("edge", [21, 22], None, needs_target=False, forwards=0)]
    calls, events = _drive(orch, states, lambda tasks: [DraftResult(t.request_id, [31], None, True, forwards=1)
                                                         for t in tasks], _accept_all, own)
    assert [t.request_id for t in calls[0].tasks] == ["here"]
    assert [t.request_id for t in calls[2].tasks] == ["here"]  # after the Deliver of the edge's early acceptance
    assert isinstance(calls[1], Deliver) and {e.request_id for e in calls[1].events} == {"edge"}
    assert states[0].output == [9, 21, 22]


def test_a_step_with_nothing_to_verify_asks_for_no_target_call():
    orch = Orchestrator(_Tokenizer(), frozenset({EOS}), max_position=256, has_draft=True)
    states = [_start(orch, "a", "filter")]
    calls, _ = _drive(orch, states, lambda tasks: [DraftResult("a", [11], None, needs_target=False, forwards=1)],
                      _accept_all)
    assert [type(c).__name__ for c in calls] == ["DraftCall", "Deliver"]


def test_a_confident_filter_chain_is_verified_beside_a_step_that_calls_the_target_anyway():
    """Lockstep: its catch-up then runs in the same forward as the others' (equal lengths: one slice); alone, or
    drafted by an edge client (no confidences), it is accepted early."""
    orch = Orchestrator(_Tokenizer(), frozenset({EOS}), max_position=256, has_draft=True)
    states = [_start(orch, "sure", "filter"), _start(orch, "unsure", "filter"), _start(orch, "edge", "filter")]
    drafts = {"sure": DraftResult("sure", [11, 12], None, False, forwards=2, probs=[0.99, 0.98], unsure=[]),
              "unsure": DraftResult("unsure", [21, 22], None, True, forwards=2, probs=[0.5, 0.99], unsure=[0])}
    own = [DraftResult("edge", [31, 32], None, needs_target=False)]
    calls, _ = _drive(orch, states, lambda tasks: [drafts[t.request_id] for t in tasks], _accept_all, own)
    verify = next(c for c in calls if isinstance(c, VerifyCall))
    assert {t.request_id: (t.draft, t.unsure) for t in verify.tasks} == {"unsure": ([21, 22], (0,)),
                                                                        "sure": ([11, 12], ())}
    assert [s.output for s in states] == [[9, 11, 12, 4], [9, 21, 22, 4], [9, 31, 32]]
    alone, _ = _drive(orch, states[:1], lambda tasks: [drafts["sure"]], _accept_all)
    assert not any(isinstance(c, VerifyCall) for c in alone) and states[0].output[-2:] == [11, 12]
