"""RequestState.extend: a step's tokens appended as one event, as appending them one at a time would leave the
request (output, text, counts, why it finished), on a byte-level tokenizer whose characters span tokens."""
import pytest

from calid.generation import GenerationRequest, RequestState, SamplingParams

EOS = 0


class ByteTokenizer:
    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return bytes(i for i in ids if i != EOS).decode("utf-8", errors="replace")


def _state(max_new: int = 64, stop=(), ignore_eos=False) -> RequestState:
    req = GenerationRequest([65, 66], SamplingParams(max_new_tokens=max_new, stop=stop, ignore_eos=ignore_eos))
    return RequestState(req, ByteTokenizer(), frozenset({EOS}), start=0.0)


def _one_by_one(s: RequestState, tokens, from_draft, decided, max_position):
    events = []
    for i, t in enumerate(tokens):
        events.append(s.append(t, 1.0, i < from_draft and i not in decided, max_position))
        if s.finish_reason:
            break
    return "".join(e.text for e in events), [t for e in events for t in e.token_ids], events[-1].result


def _facts(s: RequestState):
    return s.output, s.token_ids, s.stream.text, s.stats.draft_tokens, s.stats.target_tokens, s.finish_reason


STEPS = [list("héllo".encode()), list(" wörld 🙂".encode()), [33, 33]]


@pytest.mark.parametrize("case, finish", [
    (dict(), None),  # no end in sight
    (dict(max_new=9), "length"),  # cut by max_new_tokens inside the second step
    (dict(eos_at=(1, 3)), "eos"),  # EOS inside the second step
    (dict(eos_at=(1, 3), ignore_eos=True), None),
    (dict(stop=("wö",)), "stop"),  # a stop string: token by token, cut where it starts
    (dict(max_position=12), "length"),  # the context's end
])
def test_a_steps_tokens_appended_at_once_leave_the_request_as_one_by_one(case, finish):
    steps = [list(s) for s in STEPS]
    if "eos_at" in case:
        k, i = case["eos_at"]
        steps[k][i] = EOS
    kw = dict(max_new=case.get("max_new", 64), stop=case.get("stop", ()), ignore_eos=case.get("ignore_eos", False))
    one, many, max_position = _state(**kw), _state(**kw), case.get("max_position", 1000)
    for tokens in steps:
        if one.finish_reason:
            break
        text, ids, result = _one_by_one(one, tokens, from_draft=3, decided=(1,), max_position=max_position)
        event = many.extend(tokens, 1.0, from_draft=3, decided=(1,), max_position=max_position)
        assert (event.text, event.token_ids) == (text, ids)
        assert (event.result is None) == (result is None)
        assert _facts(many) == _facts(one)
    assert many.finish_reason == finish
