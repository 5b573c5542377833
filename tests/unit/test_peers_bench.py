"""calid bench peers' scoring: every run against one SLO from calid ar's lowest load, ratios per load."""
from __future__ import annotations

import argparse

import pytest

from calid.placement.traffic import Outcome
from calid.errors import CalidError
from serve_app.bench.peers import MIN_REQUESTS, _points, _replay_plan, _rows


def outcomes(n: int, ttft: float, tpot: float, tokens: int = 11) -> list[Outcome]:
    """``n`` requests sent one second apart, each with this TTFT and TPOT."""
    return [Outcome(i, i + ttft, i + ttft + tpot * (tokens - 1), tokens) for i in range(n)]


def test_rows_score_every_run_against_calid_ar_at_the_lowest_load():
    runs = [("calid", "ar", "c1", outcomes(4, 0.5, 0.1), 0), ("calid", "ar", "c4", outcomes(4, 1.0, 0.2), 0),
            ("calid", "ar", "trace", outcomes(4, 0.5, 0.1), 0),
            ("llama-server", "ar", "c4", outcomes(4, 3.0, 0.2), 0),  # TTFT beyond 5 x 0.5 s: misses the SLO
            ("llama-server", "ar", "trace", outcomes(4, 0.5, 0.6), 0)]  # TPOT beyond 5 x 0.1 s
    rows, slo = _rows(runs, 5.0, limit=10.0)
    assert (slo.ttft_s, slo.tpot_s) == pytest.approx((2.5, 0.5))
    by = {(r["server"], r["load"]): r for r in rows}
    assert by["calid", "c4"]["slo_met"] == 1.0 and by["llama-server", "c4"]["slo_met"] == 0.0
    assert by["llama-server", "trace"]["slo_met"] == 0.0 and by["calid", "trace"]["tok_s_vs_calid_ar"] == 1.0
    # the same 44 tokens, last one at 3 + 1.0 + 2.0 = 6 s from calid vs 3 + 3.0 + 2.0 = 8 s from the peer
    c4 = by["llama-server", "c4"]
    assert c4["tok_s_vs_calid_ar"] == pytest.approx(6 / 8)
    assert by["calid", "c4"]["limit_tok_s"] == 40.0
    assert by["calid", "trace"]["limit_tok_s"] == "-"


def test_rounds_give_the_median_rate_and_the_median_of_ratios_paired_within_each_round():
    # calid ar drifts slower over three rounds; the peer is 0.5x, 0.9x and 0.6x of calid ar in its own round
    ar = [outcomes(2, 1.0, 0.1), outcomes(2, 1.0, 0.2), outcomes(2, 1.0, 0.4)]
    # a point of 2 requests sent 1 s apart lasts 1 + TTFT + 10 x TPOT: calid ar's 2 + 10 t, the peer's that / ratio
    peer = [outcomes(2, (2 + 10 * t) / k - 1 - 10 * t, t) for t, k in ((0.1, 0.5), (0.2, 0.9), (0.4, 0.6))]
    runs = [(s, "ar", "c1", outs, rnd) for rnd in range(3) for s, outs in
            (("calid", ar[rnd]), ("llama-cpp-python", peer[rnd]))]
    rows, slo = _rows(runs, 5.0, limit=10.0)
    by = {r["server"]: r for r in rows}
    assert len(rows) == 2 and by["calid"]["requests"] == 6  # every round's requests pooled
    assert by["llama-cpp-python"]["rounds_vs_calid_ar"] == "0.50 0.90 0.60"
    # the median of the paired ratios, 0.6; a ratio of the median rates would give 0.67 (3.67 / 5.5 tok/s)
    assert by["llama-cpp-python"]["tok_s_vs_calid_ar"] == pytest.approx(0.6)
    assert by["calid"]["tok_s"] == pytest.approx(22 / 4)  # round 1's: 22 tokens in 1 + 1 + 2 s
    # the SLO comes from calid ar's requests of all rounds: TPOT p50 of 0.1, 0.1, 0.2, 0.2, 0.4, 0.4 s
    assert slo.tpot_s == pytest.approx(5 * 0.2)


def test_a_replay_without_its_trace_or_with_a_bad_rate_says_what_to_pass(tmp_path):
    args = argparse.Namespace(trace=str(tmp_path / "none.csv"), trace_rate=0.5, trace_requests=8,
                              max_prompt_tokens=64, max_new_tokens=8)
    with pytest.raises(CalidError, match="--trace '' to skip the replay"):
        _replay_plan(args, "smollm2-135m-instruct", [])
    (tmp_path / "t.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    args.trace, args.trace_rate = str(tmp_path / "t.csv"), 0
    with pytest.raises(CalidError, match="--trace-rate must be > 0"):
        _replay_plan(args, "smollm2-135m-instruct", [])


class _Words:
    """A word-level tokenizer with a chat template: enough for the n-gram share."""

    chat_template = "user: {content}"

    def __init__(self):
        self.ids: dict[str, int] = {}

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        return " ".join(f"user: {m['content']}" for m in messages) + " assistant:"

    def __call__(self, text, add_special_tokens=False):
        return argparse.Namespace(input_ids=[self.ids.setdefault(w, len(self.ids)) for w in text.split()])


def test_every_row_has_the_ngram_copyable_share_of_its_outputs():
    """An answer that repeats its prompt is mostly copyable; one with new words is not; rows without text
    (the trace replay's raw completions) say "-"."""
    copying = Outcome(0, 0.5, 1.0, 12, prompt="fix the typo: the quick brwn fox jumps over the lazy dog and runs away",
                      text="the quick brown fox jumps over the lazy dog and runs away")
    fresh = Outcome(0, 0.5, 1.0, 9, prompt="say something", text="alpha beta gamma delta epsilon zeta eta theta")
    runs = [("calid", "ar", "c1", [copying], 0), ("llama-server", "ar", "c1", [fresh], 0),
            ("calid", "ar", "trace", outcomes(2, 0.5, 0.1), 0)]
    rows, _ = _rows(runs, 5.0, limit=10.0, tokenizer=_Words())
    by = {(r["server"], r["load"]): r["ngram_share"] for r in rows}
    assert by["calid", "c1"] >= 0.5 and by["llama-server", "c1"] == 0.0 and by["calid", "trace"] == "-"
    assert _rows(runs, 5.0, limit=10.0)[0][0]["ngram_share"] == "-"  # no tokenizer: not computed


def test_llama_server_configurations_become_its_speculation_flags(tmp_path):
    from serve_app.bench.peer_servers import PeerServer, PeerUnavailable, check_spec_configs, spec_args

    draft = tmp_path / "draft.q4_0.gguf"
    assert spec_args("plain", draft) == []
    assert spec_args("draft", draft) == ["-md", str(draft), "--spec-type", "draft-simple"]
    assert spec_args("draft-n6", draft)[-2:] == ["--spec-draft-n-max", "6"]
    assert spec_args("ngram-mod+draft", draft) == ["-md", str(draft), "--spec-type", "ngram-mod,draft-simple"]
    assert spec_args("ngram-simple", None) == ["--spec-type", "ngram-simple"]  # needs no draft model
    with pytest.raises(PeerUnavailable, match="no draft model of its own"):
        spec_args("draft", None)
    for bad in ("eagle", "draft-n0", "draft-n", "draft-n99"):
        with pytest.raises(CalidError, match="unknown llama-server configuration"):
            check_spec_configs([bad])
    binary = tmp_path / "llama-server"
    binary.write_text("")
    cmd = PeerServer("llama-server", "/t.gguf", 2, 8093, 4, str(binary), "m", spec="draft-n4", draft=draft).cmd
    assert cmd[cmd.index("-np") + 1] == "4" and "--metrics" in cmd and cmd[-2:] == ["--spec-draft-n-max", "4"]


def test_peers_start_without_calids_huge_page_tunable_unless_asked(tmp_path, monkeypatch):
    from calid.hugepages import TUNABLE, TUNABLES_ENV
    from serve_app.bench.peer_servers import PeerServer

    binary = tmp_path / "llama-server"
    binary.write_text("")
    monkeypatch.setenv(TUNABLES_ENV, f"glibc.malloc.arena_max=2:{TUNABLE}")
    as_users = PeerServer("llama-server", "/t.gguf", 2, 8093, 4, str(binary), "m").env
    assert as_users[TUNABLES_ENV] == "glibc.malloc.arena_max=2"
    same = PeerServer("llama-server", "/t.gguf", 2, 8093, 4, str(binary), "m", hugepages=True).env
    assert same[TUNABLES_ENV] == f"glibc.malloc.arena_max=2:{TUNABLE}"


def test_llama_server_speculation_counters_are_read_from_its_prometheus_text():
    from serve_app.bench.peer_servers import spec_counters

    text = ("# HELP llamacpp:spec_decode_num_drafts_total drafts\n"
            "# TYPE llamacpp:spec_decode_num_drafts_total counter\n"
            "llamacpp:spec_decode_num_drafts_total 12\nllamacpp:spec_decode_num_draft_tokens_total 36\n"
            "llamacpp:spec_decode_num_accepted_tokens_total 20\n"
            'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 9\n'
            "llamacpp:tokens_predicted_total 99\n")
    assert spec_counters(text) == {"drafts": 12.0, "drafted": 36.0, "accepted": 20.0}
    assert spec_counters("llamacpp:tokens_predicted_total 5\n") == {"drafts": 0.0, "drafted": 0.0, "accepted": 0.0}


def test_rows_say_how_much_came_from_drafts_for_calid_and_for_llama_server():
    calid = [Outcome(0, 0.5, 1.5, 11, drafted=8), Outcome(1, 1.5, 2.5, 11, drafted=3)]
    runs = [("calid", "ar", "c1", outcomes(2, 0.5, 0.1), 0, {}), ("calid", "auto", "c1", calid, 0, {}),
            ("llama-server", "ngram-mod", "c1", outcomes(2, 0.5, 0.1), 0,  # the counters of the point's server
             {"drafts": 4.0, "drafted": 40.0, "accepted": 10.0}),
            ("llama-server", "plain", "c1", outcomes(2, 0.5, 0.1), 0, {"drafts": 0.0, "drafted": 0.0, "accepted": 0.0})]
    rows, _ = _rows(runs, 5.0, limit=10.0)
    by = {(r["server"], r["mode"]): r for r in rows}
    auto = by["calid", "auto"]
    assert auto["draft_share"] == pytest.approx(11 / 22) and auto["spec_acceptance"] == "-"
    assert by["llama-server", "ngram-mod"]["draft_share"] == pytest.approx(10 / 22)
    assert by["llama-server", "ngram-mod"]["spec_acceptance"] == pytest.approx(0.25)
    assert by["llama-server", "plain"]["draft_share"] == 0.0
    assert by["calid", "ar"]["draft_share"] == "-"  # no stats in these answers: not known
    assert by["calid", "ar"]["tpot_ms_p99"] == pytest.approx(100.0)


def test_a_point_with_failed_requests_says_why_each_failed(capsys):
    """A row's error count alone (one llama-server ngram-simple request at c1, 2026-12-03) leaves nothing to
    look into: the bench prints every distinct error with how often it came."""
    from serve_app.bench.peers import _say

    ok = Outcome(0.0, 0.5, 2.0, 40)
    outs = [ok, Outcome(0.0, None, None, 0, error="the stream ended with no tokens"),
            Outcome(0.0, None, None, 0, error="APIConnectionError: Connection error."),
            Outcome(0.0, None, None, 0, error="the stream ended with no tokens")]
    _say("llama-server", "ngram-simple", "c1", outs)
    err = capsys.readouterr().err
    assert "3 errors" in err
    assert "2 x the stream ended with no tokens" in err and "1 x APIConnectionError: Connection error." in err


class _Flaky:
    """A stand-in for AsyncOpenAI's chat API: each create() raises the next failure in ``failures`` (None: streams
    ``tokens`` chunks of text, then fails with ``then`` if given)."""

    def __init__(self, failures: list, tokens: int = 3, then: Exception | None = None):
        import types

        self.failures, self.tokens, self.then, self.calls = list(failures), tokens, then, 0
        self.chat = types.SimpleNamespace(completions=types.SimpleNamespace(create=self.create))

    async def create(self, **kw):
        self.calls += 1
        failure = self.failures.pop(0) if self.failures else None
        if failure is not None:
            raise failure
        return self._stream()

    async def _stream(self):
        import types

        for _ in range(self.tokens):
            delta = types.SimpleNamespace(content="x")
            yield types.SimpleNamespace(usage=None, model_extra={}, choices=[types.SimpleNamespace(delta=delta)])
        if self.then is not None:
            raise self.then


def _lost_connection():
    import httpx
    import openai

    return openai.APIConnectionError(request=httpx.Request("POST", "http://127.0.0.1:1/v1/chat/completions"))


def test_a_request_whose_connection_failed_before_an_answer_is_sent_again_as_the_openai_sdk_does(capsys):
    """llama-server dropped one c1 request's connection in most runs (2026-12-03 to 2026-12-06): the bench's
    client, retries off so that no error is hidden, counted it as an error where a user's SDK client (two retries
    by default) would have sent it again."""
    import asyncio

    from serve_app.bench.peers import CONNECT_RETRIES, _one, _say

    once = _Flaky([_lost_connection()])
    out = asyncio.run(_one(once, "m", "llama-server", "plain", 8, [{"role": "user", "content": "hi"}]))
    assert once.calls == 2 and out.error is None and out.tokens == 3 and out.retries == 1
    always = _Flaky([_lost_connection()] * (CONNECT_RETRIES + 1))
    lost = asyncio.run(_one(always, "m", "llama-server", "plain", 8, [{"role": "user", "content": "hi"}]))
    assert always.calls == CONNECT_RETRIES + 1 and lost.error.startswith("APIConnectionError")
    _say("llama-server", "plain", "c1", [out, lost])
    assert "1 errors, 2 requests sent again after a lost connection" in capsys.readouterr().err


def test_a_stream_cut_once_it_began_is_an_error_not_a_retry():
    """The SDK sends a request again only where no answer came; the server may already be generating this one."""
    import asyncio

    from serve_app.bench.peers import _one

    cut = _Flaky([], tokens=2, then=_lost_connection())
    out = asyncio.run(_one(cut, "m", "calid", "ar", 8, [{"role": "user", "content": "hi"}]))
    assert cut.calls == 1 and out.error == "APIConnectionError: Connection error. (after 2 tokens)"
    assert out.first_s is not None and out.retries == 0
    silent = _Flaky([], tokens=0, then=_lost_connection())  # cut before its first token, after the answer began
    out = asyncio.run(_one(silent, "m", "calid", "ar", 8, [{"role": "user", "content": "hi"}]))
    assert silent.calls == 1 and out.error == "APIConnectionError: Connection error." and out.first_s is None


def test_every_point_draws_at_least_min_requests_fresh_prompts_unless_told():
    prompts = [f"p{i}" for i in range(200)]
    points = _points([1, 4, 16], prompts, argparse.Namespace(requests=0))
    assert [(c, len(ps)) for c, ps in points] == [(1, MIN_REQUESTS), (4, MIN_REQUESTS), (16, 32)]
    sent = [p for _, ps in points for p in ps]
    assert len(set(sent)) == len(sent) and prompts[0] not in sent  # none twice; prompts[0] warms a server up
    assert [len(ps) for _, ps in _points([1, 4], prompts, argparse.Namespace(requests=3))] == [3, 3]
