"""The OpenAI-compatible HTTP API with real clients (openai SDK sync and async, langchain-openai, raw httpx)
against the session's real local Ray and Serve HTTP proxy; every answer is checked against the gRPC path."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from serve_app.cluster.config import AppConfig
from serve_helpers import deploy, handle, wait_until

pytestmark = [pytest.mark.model, pytest.mark.ray]
MODEL = "smollm2-135m-instruct"
PROMPT = "Name three colours."


@pytest.fixture(scope="module")
def oai(base_url):
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300) as c:
        yield c


def test_models_lists_the_served_model(oai):
    models = oai.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_chat_greedy_equals_grpc(oai, client):
    for mode in ("ar", "speculative", "filter"):
        r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=24,
                                        temperature=0, extra_body={"mode": mode})
        g = client.generate(PROMPT, mode=mode, max_new_tokens=24)
        assert r.choices[0].message.content == g.text, mode
        assert r.choices[0].finish_reason == {"eos": "stop", "stop": "stop", "length": "length"}[g.finish_reason]
        assert r.usage.completion_tokens == len(g.token_ids)
        stats = r.model_extra["calid"]
        assert stats["mode"] == mode and stats["output_tokens"] == len(g.token_ids)
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=24,
                                    temperature=0, extra_body={"mode": "rollback", "rollback_nll": 4.0})
    assert r.choices[0].message.content == client.generate(PROMPT, mode="rollback", rollback_nll=4.0,
                                                           max_new_tokens=24).text


def test_chat_stream_with_usage(oai):
    whole = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=20)
    chunks = list(oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                              max_tokens=20, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == whole.choices[0].finish_reason


def test_n_choices_each_sampled_on_its_own_and_the_prompt_counted_once(oai):
    msgs = [{"role": "user", "content": "Write a short poem about the sea."}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=24, temperature=1.0, seed=5,
              extra_body={"mode": "ar"})  # llama.cpp's rows here are the same batched or alone
    one = oai.chat.completions.create(n=1, **kw)
    three = oai.chat.completions.create(n=3, **kw)
    texts = [c.message.content for c in sorted(three.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(three.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert texts[0] == one.choices[0].message.content  # choice 0 has the request's own seed
    assert len(set(texts)) > 1  # the others their own seeds
    assert [c.message.content for c in sorted(oai.chat.completions.create(n=3, **kw).choices,
                                             key=lambda c: c.index)] == texts  # seeded: reproducible
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    per_choice = three.model_extra["calid"]  # calid's stats, one per choice
    assert len(per_choice) == 3 and three.usage.completion_tokens == sum(s["output_tokens"] for s in per_choice)
    chunks = list(oai.chat.completions.create(n=2, stream=True, stream_options={"include_usage": True}, **kw))
    streamed = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert [streamed[0], streamed[1]] == texts[:2] and chunks[-1].usage.prompt_tokens == one.usage.prompt_tokens


@pytest.mark.parametrize("mode", ["ar", "speculative"])
def test_n_choices_share_one_prefill(oai, small_app, mode):
    """The n choices of a prompt are prefilled once on each model and forked (calid.runtime.twins): the
    workers' counters show n - 1 forks and the prompt computed once."""
    workers = handle(small_app.app_name, "router").worker_stats
    before = workers.remote().result()
    r = oai.chat.completions.create(model=MODEL, n=3, max_tokens=8, temperature=1.0, seed=11,
                                    extra_body={"mode": mode}, messages=[{"role": "user", "content":
                                    f"In {mode} mode, list four rivers of Europe and one fact about each."}])
    after = workers.remote().result()
    assert len(r.choices) == 3
    for role in ("target", "draft") if mode == "speculative" else ("target",):
        grew = {k: after[role][k] - before[role][k] for k in ("forked_sequences", "reused_tokens")}
        assert grew["forked_sequences"] == 2, role
        assert grew["reused_tokens"] >= 2 * (r.usage.prompt_tokens - 1), role


def test_async_client_streams_concurrently(base_url):
    async def run():
        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as c:
            async def one(i):
                text = ""
                async for chunk in await c.completions.create(model=MODEL, prompt=f"{i} + {i} =", max_tokens=8,
                                                              stream=True):
                    text += chunk.choices[0].text
                whole = await c.completions.create(model=MODEL, prompt=f"{i} + {i} =", max_tokens=8)
                return text, whole.choices[0].text

            return await asyncio.gather(*[one(i) for i in range(4)])

    for streamed, whole in asyncio.run(run()):
        assert streamed == whole and streamed


def test_completions_logprobs_and_echo_match_the_target(oai, client):
    """What lm-eval's log-likelihood tasks send: token-id prompts, echo, logprobs, max_tokens 0."""
    text = "The capital of France is Paris"
    r = oai.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True, logprobs=2, temperature=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == text and lp.token_logprobs[0] is None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.prompt_tokens
    assert all(x < 0 or x == pytest.approx(0, abs=1e-3) for x in lp.token_logprobs[1:])
    assert all(len(t) <= 2 for t in lp.top_logprobs[1:])
    # greedy generation with logprobs: each output token is the target's argmax, so its logprob is its top-1
    g = oai.completions.create(model=MODEL, prompt=text, max_tokens=6, logprobs=1, temperature=0)
    glp = g.choices[0].logprobs
    assert len(glp.tokens) == g.usage.completion_tokens
    for token, logprob, top in zip(glp.tokens, glp.token_logprobs, glp.top_logprobs):
        assert max(top.values()) == pytest.approx(logprob, abs=1e-4)
    # token-id prompt, as lm-eval sends it, scores the same
    tok = httpx.post(str(oai.base_url).removesuffix("/v1/") + "/tokenize", json={"prompt": text}).json()["tokens"]
    r2 = oai.completions.create(model=MODEL, prompt=tok, max_tokens=0, echo=True, logprobs=0)
    got = r2.choices[0].logprobs.token_logprobs
    assert got[0] is None and got[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)


def test_errors_map_to_the_sdk_exceptions(oai):
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-9", messages=msgs)
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=msgs, top_p=0)
    assert e.value.body["param"] == "top_p"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=msgs, n=17)  # n is served up to 16
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10**6)
    assert "max_tokens" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # rollback's bound, sent with another mode
        oai.chat.completions.create(model=MODEL, messages=msgs, extra_body={"mode": "filter", "rollback_nll": 2})
    assert e.value.body["param"] == "rollback_nll"


def test_langchain_invoke_and_stream(base_url, oai):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=base_url, api_key="x", model=MODEL, temperature=0, max_tokens=16, max_retries=0)
    said = llm.invoke(PROMPT).content
    direct = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=16,
                                        temperature=0).choices[0].message.content
    assert said == direct and said
    assert "".join(chunk.content for chunk in llm.stream(PROMPT)) == said


def _router_stats(app: str) -> dict:
    return handle(app, "router").stats.remote().result()


def test_a_client_that_disconnects_mid_stream_frees_its_slot(base_url, small_app):
    body = {"model": MODEL, "prompt": "Count to one hundred:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as h:
        with h.stream("POST", f"{base_url}/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data: ")).startswith("data: {")
            assert _router_stats(small_app.app_name)["requests"] >= 1
        # leaving the block closes the connection mid-stream
    assert wait_until(lambda: _router_stats(small_app.app_name)["requests"] == 0, 20), _router_stats(small_app.app_name)


def test_oversized_bodies_are_refused_cleanly_on_http_and_grpc(base_url, client):
    from calid.client.errors import InvalidArgument

    big = "x" * (20 << 20)
    r = httpx.post(f"{base_url}/completions", content=json.dumps({"model": MODEL, "prompt": big}),
                   headers={"content-type": "application/json"}, timeout=120)
    assert r.status_code == 413 and r.json()["error"]["message"]
    for size in (2 << 20, 20 << 20):  # the same clean code whatever the size (20 MB was INTERNAL on the proxy hop)
        with pytest.raises(InvalidArgument, match="over the server's limit"):
            client.generate("x" * size, max_new_tokens=1)
    assert client.generate(PROMPT, max_new_tokens=2).token_ids  # still serving


@pytest.fixture(scope="module")
def guarded(serve_port, http_port, tmp_path_factory):
    """An app with one decoding slot, no queue and API keys: overload, keys and draining over HTTP."""
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text("k-live\n")
    cfg = deploy(AppConfig.small(app_name="guarded", grpc_port=serve_port, draft=None, max_active=1,
                                 queue_capacity=0, api_keys_file=str(keys)))
    return cfg, f"http://127.0.0.1:{http_port}/guarded/v1"


def test_keys_overload_and_draining_over_http_as_over_grpc(guarded):
    from calid.client import Client
    from calid.client.errors import ResourceExhausted, Unavailable

    cfg, url = guarded
    msgs = [{"role": "user", "content": "hi"}]
    with openai.OpenAI(base_url=url, api_key="k-wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    assert httpx.get(url.removesuffix("/v1") + "/health").status_code == 200  # open to probes
    good = openai.OpenAI(base_url=url, api_key="k-live", max_retries=0, timeout=120)
    busy = good.completions.create(model=MODEL, prompt="Count:", max_tokens=300, stream=True,
                                     extra_body={"ignore_eos": True})
    next(iter(busy))
    with pytest.raises(openai.RateLimitError) as e:
        good.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    assert e.value.response.headers["retry-after"] == "1" and "queue is full" in e.value.message
    with Client(f"127.0.0.1:{cfg.grpc_port}", app=cfg.app_name, api_key="k-live", retries=0) as g:
        with pytest.raises(ResourceExhausted, match="queue is full"):  # the same bound, whichever front-end
            g.generate("hi", max_new_tokens=2)
    busy.close()
    assert wait_until(lambda: _router_stats(cfg.app_name)["requests"] == 0, 20)
    assert good.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2).usage.completion_tokens
    handle(cfg.app_name, "router").drain.remote().result()  # what calid serve does on SIGTERM
    with pytest.raises(openai.InternalServerError) as e:
        good.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    assert e.value.status_code == 503 and "shutting down" in e.value.message
    assert httpx.get(url.removesuffix("/v1") + "/health").status_code == 503
    with Client(f"127.0.0.1:{cfg.grpc_port}", app=cfg.app_name, api_key="k-live", retries=0) as g:
        with pytest.raises(Unavailable):
            g.generate("hi", max_new_tokens=2)
    good.close()
