"""Several models in one app (AppConfig.models) on the session's real Ray, over real gRPC and the OpenAI HTTP API
(the openai SDK): requests reach the model they name, an unknown name is NOT_FOUND (404), every model is listed,
and one model's full queue refuses its own requests only."""
from __future__ import annotations

import os
import threading

import grpc
import httpx
import openai
import pytest

from calid.client import Client, NotFound, ResourceExhausted
from calid.models.presets import TEST_MODEL
from serve_app.cluster.config import AppConfig
from serve_helpers import deploy, handle, wait_until

pytestmark = [pytest.mark.ray, pytest.mark.model]

APP = "multi"
HI = [{"role": "user", "content": "hi"}]
COLOR = [{"role": "user", "content": "Name a color."}]
CORE = min(os.sched_getaffinity(0))
OTHER = max(os.sched_getaffinity(0))  # CORE again on a one-core machine


@pytest.fixture(scope="module")
def multi_app(serve_port):
    cfg = AppConfig(app_name=APP, grpc_port=serve_port, kv_budget_mb=256, dtype="fp32", draft=None, models=[
        {"name": "smol", "target": TEST_MODEL, "draft": "self:16", "default_mode": "speculative"},
        {"name": "plain", "target": TEST_MODEL, "slo_ttft_ms": 600_000, "slo_tpot_ms": 60_000,
         "placement": [[CORE], [OTHER]]},  # two groups
        {"name": "busy", "target": TEST_MODEL, "max_active": 1, "queue_capacity": 0, "placement": [[CORE]]},
    ])
    return deploy(cfg)


@pytest.fixture()
def oai(multi_app, http_port):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/{APP}/v1", api_key="unused", max_retries=0,
                         timeout=300)


@pytest.fixture()
def mclient(multi_app):
    with Client(f"127.0.0.1:{multi_app.grpc_port}", app=APP, timeout=300, retries=0) as c:
        yield c


def _stats(model: str) -> dict:
    if model == "plain":  # its two routers together
        both = [handle(APP, f"router-plain@{i}").stats.remote().result() for i in (0, 1)]
        return {"steps": sum(s["steps"] for s in both), "model": both[0]["model"],
                "slo": {k: sum(s["slo"][k] for s in both) for k in ("met", "missed")}}
    return handle(APP, f"router-{model}@0" if model == "busy" else f"router-{model}").stats.remote().result()


def test_each_request_reaches_the_model_it_names(mclient):
    listed = mclient.list_models()
    targets = {m.served_as: m for m in listed.models if m.role == "target"}
    assert set(targets) == {"smol", "plain", "busy"}
    assert targets["smol"].default_mode == "speculative" and "speculative" in targets["smol"].modes
    assert targets["plain"].default_mode == "ar" and "speculative" not in targets["plain"].modes
    assert [m.role for m in listed.models].count("draft") == 1
    before = {m: _stats(m)["steps"] for m in ("smol", "plain")}
    out = mclient.generate("Name a color.", model="smol", max_new_tokens=8)
    assert out.stats["mode"] == "speculative" and len(out.token_ids) > 0
    streamed = list(mclient.stream("Name a color.", model="plain", max_new_tokens=8))
    assert streamed[-1].stats["mode"] == "ar" and "".join(c.text for c in streamed)
    after = {m: _stats(m) for m in ("smol", "plain")}
    assert all(after[m]["steps"] > before[m] for m in before)
    assert after["plain"]["slo"]["met"] >= 1 and after["plain"]["model"] == "plain"
    assert after["smol"]["slo"] == {"met": 0, "missed": 0}  # no SLO set for it
    default = mclient.generate("Name a color.", max_new_tokens=4)  # no model named: the first listed
    assert default.stats["mode"] == "speculative"


def test_an_unknown_model_is_not_found(mclient):
    with pytest.raises(NotFound, match="nope.*served: smol, plain, busy"):
        mclient.generate("hi", model="nope", max_new_tokens=4)
    with pytest.raises(NotFound):
        list(mclient.stream("hi", model="nope", max_new_tokens=4))


def test_invalid_requests_keep_their_status_through_the_front(mclient):
    from calid.client import InvalidArgument

    with pytest.raises(InvalidArgument, match="needs a draft model"):
        mclient.generate("hi", model="plain", max_new_tokens=4, min_agreement=0.9)  # plain has no draft
    with pytest.raises(InvalidArgument, match="needs a draft model"):
        mclient.generate("hi", model="plain", max_new_tokens=4, max_quality_loss=2)


def test_one_models_full_queue_refuses_only_its_own_requests(mclient, oai):
    done = {}
    long = threading.Thread(target=lambda: done.setdefault(
        "out", mclient.generate("Count from one to one hundred.", model="busy", max_new_tokens=160,
                                ignore_eos=True)))
    long.start()
    try:
        assert wait_until(lambda: _stats("busy")["active"] == 1, timeout_s=60)
        with pytest.raises(ResourceExhausted, match="admission queue is full"):
            mclient.generate("hi", model="busy", max_new_tokens=4)
        with pytest.raises(openai.RateLimitError):  # over HTTP as well
            oai.chat.completions.create(model="busy", messages=HI, max_tokens=4)
        other = mclient.generate("Name a color.", model="plain", max_new_tokens=6)  # another model still serves
        assert len(other.token_ids) > 0
        assert oai.chat.completions.create(model="plain", messages=HI, max_tokens=4).choices[0].message.content
    finally:
        long.join(timeout=300)
    assert len(done["out"].token_ids) == 160


def test_health_sums_the_models(mclient, http_port):
    h = mclient.health()
    assert h.serving and h.queue_capacity == 64 + 2 * 64 + 0  # smol, plain's two routers, busy
    r = httpx.get(f"http://127.0.0.1:{http_port}/{APP}/health", timeout=30)
    assert r.status_code == 200 and set(r.json()["models"]) == {"smol", "plain", "busy"}


def test_every_model_is_listed_and_answered_by_name_over_the_openai_api(oai, mclient, http_port):
    assert [m.id for m in oai.models.list().data] == ["smol", "plain", "busy"]
    for model in ("smol", "plain", "busy"):  # greedy: the same answer as the same request over gRPC
        r = oai.chat.completions.create(model=model, messages=COLOR, max_tokens=6, temperature=0)
        want = mclient.generate(COLOR[0]["content"], model=model, max_new_tokens=6)
        assert r.model == model and r.choices[0].message.content == want.text
        assert r.usage.completion_tokens == len(want.token_ids)
    chunks = list(oai.chat.completions.create(model="smol", messages=COLOR, max_tokens=6, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == mclient.generate(COLOR[0]["content"], model="smol", max_new_tokens=6).text
    assert chunks[-1].usage.completion_tokens > 0
    r = oai.completions.create(model="plain", prompt="1, 2, 3,", max_tokens=4, logprobs=1, temperature=0)
    assert len(r.choices[0].logprobs.tokens) == r.usage.completion_tokens
    tok = httpx.post(f"http://127.0.0.1:{http_port}/{APP}/tokenize", json={"model": "busy", "prompt": "hi"},
                     timeout=30).json()
    assert tok["count"] == len(tok["tokens"]) > 0


def test_an_unknown_model_over_http_is_a_404_naming_the_served_ones(oai, http_port):
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="nope", messages=HI, max_tokens=4)
    assert "served: smol, plain, busy" in e.value.body["message"] and e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError):  # the model named, its router says what is wrong
        oai.chat.completions.create(model="plain", messages=[], max_tokens=4)
    r = httpx.post(f"http://127.0.0.1:{http_port}/{APP}/v1/chat/completions", content=b'{"model": ',
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"]


def test_collaborate_reaches_the_model_it_names(multi_app, mclient):
    """Edge drafting through the multi-model front: each message relayed to the named model's router replica
    (serve_app.ingress.edge_relay); greedy speculative from a local draft is that model's ar output."""
    from calid.v1 import calid_pb2 as pb, calid_pb2_grpc

    prompt, n = "Write a Python function that reverses a string.", 16
    with Client(f"127.0.0.1:{multi_app.grpc_port}", app=APP, timeout=300, retries=0, local_draft=TEST_MODEL) as edge:
        for model in ("smol", "plain"):
            ar = mclient.generate(prompt, model=model, mode="ar", max_new_tokens=n, ignore_eos=True)
            spec = edge.generate(prompt, model=model, mode="speculative", max_new_tokens=n, ignore_eos=True)
            assert spec.token_ids == ar.token_ids, model
            assert spec.stats["draft_tokens"] > n // 2 and spec.stats["draft_forwards"] == 0  # drafted here
        chunks = list(edge.stream(prompt, model="plain", mode="filter", threshold=1.0, max_new_tokens=n,
                                  ignore_eos=True))
        assert [t for c in chunks for t in c.token_ids] == ar.token_ids
        with pytest.raises(NotFound, match="served: smol, plain, busy"):
            edge.generate(prompt, model="nope", mode="speculative", max_new_tokens=4)
    with grpc.insecure_channel(f"127.0.0.1:{multi_app.grpc_port}") as ch:
        stub = calid_pb2_grpc.CalidStub(ch)
        opening = pb.CollaborateRequest(open=pb.GenerateRequest(prompt=prompt, model="smol", mode="speculative",
                                                                max_new_tokens=n))
        replies = list(stub.Collaborate(iter([opening]), metadata=(("application", APP),), timeout=60))
        assert replies[0].round == 0 and replies[0].prompt_ids  # then the client closed its side: the end
        with pytest.raises(grpc.RpcError) as e:  # a round before open is the router's to refuse
            list(stub.Collaborate(iter([pb.CollaborateRequest(open=pb.GenerateRequest(prompt=prompt, model="smol",
                                                                                      mode="ar"))]),
                                  metadata=(("application", APP),), timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "mode" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Collaborate(iter([pb.CollaborateRequest(round=pb.DraftRound(round=1, tokens=[1]))]),
                                  metadata=(("application", APP),), timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "must be open" in e.value.details()
    assert wait_until(lambda: _stats("smol")["requests"] == 0 and _stats("smol")["active"] == 0, 30)


def test_a_model_on_two_groups_spreads_its_requests_and_each_target_is_pinned(mclient):
    before = [handle(APP, f"router-plain@{i}").stats.remote().result()["steps"] for i in (0, 1)]
    threads = [threading.Thread(target=mclient.generate, args=("Count to ten.",),
                                kwargs={"model": "plain", "max_new_tokens": 24, "ignore_eos": True}) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    after = [handle(APP, f"router-plain@{i}").stats.remote().result()["steps"] for i in (0, 1)]
    assert all(a > b for a, b in zip(after, before)), f"steps before {before}, after {after}"
    for i, core in enumerate((CORE, OTHER)):
        assert handle(APP, f"target-plain@{i}").stats.remote().result()["cores"] == [core]


@pytest.mark.skipif(CORE == OTHER, reason="needs two cores")
def test_a_request_goes_to_the_replica_whose_core_no_other_model_is_busy_on(mclient):
    """plain@0 shares its core with busy; while busy decodes there, plain's request goes to plain@1, though
    both of plain's routers have nothing in flight (AlpaServe's dispatch: calid.placement.dispatch)."""
    steps = lambda: [handle(APP, f"router-plain@{i}").stats.remote().result()["steps"] for i in (0, 1)]  # noqa: E731
    long = threading.Thread(target=mclient.generate, args=("Count from one to one hundred.",),
                            kwargs={"model": "busy", "max_new_tokens": 96, "ignore_eos": True})
    long.start()
    try:
        assert wait_until(lambda: _stats("busy")["active"] == 1, timeout_s=60)
        before = steps()
        mclient.generate("Name a color.", model="plain", max_new_tokens=6, ignore_eos=True)
        after = steps()
    finally:
        long.join(timeout=300)
    assert after[0] == before[0] and after[1] > before[1], f"steps before {before}, after {after}"


def test_draining_the_front_drains_every_model(mclient, http_port):  # last: the app admits nothing afterwards
    from calid.client import Unavailable

    front = handle(APP, "router")
    assert front.drain.remote().result()["requests"] == 0
    assert front.stats.remote().result()["requests"] == 0
    for model in ("smol", "plain"):
        with pytest.raises(Unavailable, match="shutting down"):
            mclient.generate("hi", model=model, max_new_tokens=2)
    assert not mclient.health().serving
    assert httpx.get(f"http://127.0.0.1:{http_port}/{APP}/health", timeout=30).status_code == 503
