"""Wire request -> GenerationRequest: defaults, and one clear error naming each bad field."""
from __future__ import annotations

import pytest

from calid.client.sdk import build_request
from calid.decoding.modes import DecodeParams
from calid.errors import InvalidRequestError
from serve_app.ingress import protocol


class _Tok:
    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        class R:
            input_ids = [ord(c) % 50 for c in text]
        return R()


DEFAULT = DecodeParams(mode="speculative", gamma=8, threshold=0.4)


def test_defaults_fill_unset_fields():
    req = protocol.to_request(build_request("hi there"), _Tok(), DEFAULT)
    assert req.params.max_new_tokens == 128 and req.params.temperature == 0.0 and req.params.seed is None
    assert req.decode == DEFAULT
    req = protocol.to_request(build_request("hi", mode="filter", threshold=0.9, gamma=3, seed=7, top_k=5), _Tok(),
                              DEFAULT)
    assert (req.decode.mode, req.decode.threshold, req.decode.gamma) == ("filter", pytest.approx(0.9), 3)
    assert (req.params.seed, req.params.top_k) == (7, 5)
    req = protocol.to_request(build_request("hi", mode="rollback", rollback_nll=4.0), _Tok(), DEFAULT)
    assert (req.decode.mode, req.decode.rollback_nll) == ("rollback", 4.0)
    assert protocol.to_request(build_request("hi", mode="rollback"), _Tok(), DEFAULT).decode.rollback_nll == \
        DEFAULT.rollback_nll  # unset: the server's default bound


def test_a_request_without_a_threshold_gets_its_modes_default():
    """filter's default is the app's operating point (a high threshold: quality kept); the speculative modes'
    is where they stop drafting; a threshold the request names wins in every mode."""
    from calid.decoding.modes import STOP_THRESHOLD

    app = DecodeParams(mode="auto", filter_threshold=0.9)
    for mode, want in (("filter", 0.9), ("speculative", STOP_THRESHOLD), ("rollback", STOP_THRESHOLD)):
        decode = protocol.to_request(build_request("hi", mode=mode), _Tok(), app).decode
        assert decode.top1 == pytest.approx(want), mode
        assert protocol.to_request(build_request("hi", mode=mode, threshold=0.3), _Tok(), app).decode.top1 == \
            pytest.approx(0.3)


def test_a_quality_budget_is_resolved_into_filters_threshold_from_the_pairs_table():
    from calid.decoding.quality_budget import LossPoint, QualityTable
    from calid.errors import UncalibratedError

    table = (QualityTable((LossPoint(0.97, 0.0, 0.5, 82), LossPoint(0.8, 4.0, 1.0, 82))), "test table")
    decode = protocol.to_request(build_request("hi", max_quality_loss=2), _Tok(), DEFAULT, quality=table).decode
    assert (decode.mode, decode.threshold, decode.max_quality_loss) == ("filter", 0.97, 2.0)
    assert protocol.to_request(build_request("hi", max_quality_loss=10), _Tok(), DEFAULT,
                               quality=table).decode.threshold == 0.8
    # a budget the table vouches for no threshold at is served lossless by auto, not by filter at 1.0 (the draft's
    # cost for the target's tokens); an edge client's stream keeps filter (its draft runs on the client)
    strict = protocol.to_request(build_request("hi", max_quality_loss=0.5), _Tok(), DEFAULT, quality=table).decode
    assert (strict.mode, strict.threshold, strict.max_quality_loss, strict.uses_draft) == ("auto", 1.0, 0.5, False)
    edge = protocol.to_request(build_request("hi", max_quality_loss=0.5), _Tok(), DEFAULT, quality=table, edge=True)
    assert (edge.decode.mode, edge.decode.threshold) == ("filter", 1.0)
    with pytest.raises(UncalibratedError, match="no calibration here"):
        protocol.to_request(build_request("hi", max_quality_loss=2), _Tok(), DEFAULT, quality=(None, "no calibration "
                                                                                                   "here"))
    with pytest.raises(InvalidRequestError, match="needs a draft model"):
        protocol.to_request(build_request("hi", max_quality_loss=2), _Tok(), DEFAULT, quality=None)
    for kw, message in ((dict(threshold=0.5), "set one of"), (dict(min_agreement=0.9), "set one of"),
                        (dict(mode="auto"), "budget for mode filter, not 'auto'"),
                        (dict(max_quality_loss=float("nan")), "finite"), (dict(max_quality_loss=-1), r"\[0, 100\]")):
        with pytest.raises(InvalidRequestError, match=message):
            protocol.to_request(build_request("hi", **({"max_quality_loss": 2} | kw)), _Tok(), DEFAULT, quality=table)


@pytest.mark.parametrize("kw, field", [
    ({"prompt": ""}, "prompt"),
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"mode": "warp-speed"}, "mode"),
    ({"gamma": 0}, "gamma"),
    ({"threshold": 1.5}, "threshold"),
    ({"mode": "rollback", "rollback_nll": -1.0}, "rollback_nll must be >= 0"),
    ({"mode": "rollback", "rollback_nll": float("inf")}, "rollback_nll must be a finite number"),
    ({"mode": "filter", "rollback_nll": 1.0}, "rollback_nll is a bound for mode rollback, not 'filter'"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}], "prompt": "y"}, "one of prompt, messages or prompt_token_ids"),
    ({"stop": ["s"] * 17}, "stop"),
])
def test_bad_fields_are_named(kw, field):
    kw.setdefault("prompt", "hello" if "messages" not in kw else None)
    with pytest.raises(InvalidRequestError, match=field.replace("[", r"\[").replace("]", r"\]")):
        protocol.to_request(build_request(**kw), _Tok(), DEFAULT)


@pytest.mark.parametrize("kw, message", [
    ({"prompt": "x" * 5000}, "request is 50[0-9][0-9] bytes, over the server's limit of 4096"),
    ({"max_new_tokens": 2**32 - 1}, "max_new_tokens must be at most 512"),
    ({"stop": ["s"] * 5}, "stop takes at most 4 strings"),
    ({"stop": ["x" * 40]}, "at most 32 characters"),
    ({"prompt": None, "messages": [{"role": "user", "content": "x"}] * 3}, "messages takes at most 2 entries"),
])
def test_limits_refuse_before_any_tokenizing(kw, message):
    class NeverTokenize(_Tok):
        def __call__(self, *a, **k):
            raise AssertionError("tokenized an over-limit request")

    limits = protocol.Limits(max_request_bytes=4096, max_new_tokens=512, max_stop=4, max_stop_chars=32, max_messages=2)
    kw.setdefault("prompt", "hello")
    with pytest.raises(InvalidRequestError, match=message):
        protocol.to_request(build_request(**kw), NeverTokenize(), DEFAULT, limits)
