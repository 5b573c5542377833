"""Property-based fuzzing of the OpenAI HTTP API (hypothesis): any body, well-formed or not, gets a result or a
clear 4xx in OpenAI's error shape, never a 500 or a hang, and the server keeps serving.

In process, many bodies through the translation and the router's admission path; over real HTTP on the
local Ray, fewer through the whole stack (including raw bytes: truncated JSON, non-UTF-8)."""
from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from serve_helpers import forget_admitted, workerless_router

from serve_app.ingress import openai_wire as wire
from serve_app.cluster.config import AppConfig
from serve_app.ingress.frontdoor import Caller, Refused

pytestmark = [pytest.mark.model]

FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
          "stop", "n", "logprobs", "top_logprobs", "echo", "ignore_eos", "user", "stream", "stream_options", "mode",
          "threshold", "gamma", "top_k", "tools", "response_format", "presence_penalty"]
_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_plausible = {
    "model": st.sampled_from(["smollm2-135m-instruct", "", "gpt-4"]),
    "messages": st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                "content": st.text(max_size=40) | st.none(),
            }
        ),
        max_size=3,
    ),
    "prompt": st.text(max_size=40)
    | st.lists(st.integers(-5, 70000), max_size=6)
    | st.lists(st.text(max_size=10), max_size=3),
    "max_tokens": st.integers(-1, 6) | st.sampled_from([2**32, 10**20, 4097]),
    "temperature": st.floats(-1, 3) | st.none(),
    "top_p": st.floats(-0.5, 1.5),
    "seed": st.integers(-3, 2**65),
    "logprobs": st.booleans() | st.integers(-1, 25),
    "top_logprobs": st.integers(-1, 25),
    "mode": st.sampled_from(["ar", "filter", "speculative", "tree", "lookahead", "auto", "nope", ""]),
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=3),
    "echo": st.booleans(),
    "n": st.integers(-1, 20),
}


@st.composite
def bodies(draw):
    body = {}
    for name in draw(st.lists(st.sampled_from(FIELDS) | st.text(max_size=6), max_size=8, unique=True)):
        body[name] = draw(_plausible[name] if name in _plausible and draw(st.booleans()) else _json)
    if draw(st.booleans()):
        body["max_tokens"] = draw(st.integers(0, 3))
    return body


@pytest.fixture(scope="module")
def router():
    return workerless_router(AppConfig.small())


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies(), chat=st.booleans())
def test_any_body_is_admitted_or_refused_with_a_4xx(router, body, chat):
    async def translate_and_open():
        if chat:
            msg, opts = wire.chat_request(body)
            msgs = [msg]
        else:
            msgs, opts = wire.completion_requests(body)
        msgs = wire.choices(msgs, opts.n)
        opened = [await router.open(m, Caller(frontend="http")) for m in msgs]
        forget_admitted(router)
        return opened

    try:
        opened = asyncio.run(translate_and_open())
    except wire.WireError as e:
        assert 400 <= e.status < 500 and e.message and e.body()["error"]["type"]
        return
    except Refused as e:
        assert e.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                          grpc.StatusCode.NOT_FOUND), (e.code, e.message)
        assert 400 <= wire.from_status(e.code, e.message).status < 500
        return
    assert all(r.req.prompt_ids and r.req.params.max_new_tokens <= 4096 for r in opened)


def _quick(body: dict) -> bytes:
    """A body as JSON that, if served, asks for at most 3 tokens (over the limit stays over it: refused)."""
    for name in ("max_tokens", "max_completion_tokens"):
        v = body.get(name)
        if not isinstance(v, bool) and isinstance(v, (int, float)) and 3 < v <= 4096:
            body[name] = 3
    if not any(isinstance(body.get(n), (int, float)) for n in ("max_tokens", "max_completion_tokens")):
        body["max_tokens"] = 3
    return json.dumps(body).encode()


_raw = st.one_of(bodies().map(_quick),
                 bodies().map(_quick).flatmap(
                     lambda raw: st.integers(0, max(0, len(raw) - 1)).map(lambda n: raw[:n])),  # truncated
                 st.binary(max_size=64))


@pytest.mark.ray
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=_raw, path=st.sampled_from(["chat/completions", "completions"]))
def test_fuzzed_bodies_over_http_get_a_result_or_a_4xx_and_the_server_keeps_serving(base_url, raw, path):
    with httpx.Client(timeout=120) as h:
        r = h.post(f"{base_url}/{path}", content=raw, headers={"content-type": "application/json"})
        assert r.status_code in (200, 400, 404, 413), (r.status_code, r.text[:300])
        if r.status_code != 200:
            assert r.json()["error"]["message"]
        elif r.headers["content-type"].startswith("text/event-stream"):
            assert r.text.rstrip().endswith("data: [DONE]")
        assert h.get(base_url.removesuffix("/v1") + "/health").status_code == 200
