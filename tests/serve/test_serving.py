"""The Serve app over real gRPC on a real local Ray: outputs, batching, status codes, cancellation."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from calid.client import Client, DeadlineExceeded, InvalidArgument, ResourceExhausted
from calid.decoding.modes import MODES, DecodeParams
from calid.generation import GenerationRequest, SamplingParams
from calid.text import encode_prompt
from serve_helpers import deploy, handle, wait_until
from serve_app.cluster.config import AppConfig

pytestmark = [pytest.mark.ray, pytest.mark.model]

PROMPTS = ["Write a Python function that checks whether a number is prime.",
           "What is the capital of France? Answer in one sentence.",
           "List three colors of the rainbow.",
           "Explain what a hash map is."]


@pytest.fixture(scope="module")
def local_engine():
    """The in-process engine with the same models and backends as the served app (AppConfig.small: the
    target on the machine's default backend, llama.cpp here; its first 16 layers as the draft, on torch fp32)."""
    from calid.backends import open_draft, open_model
    from calid.engine import Engine

    cfg = AppConfig.small(dtype="fp32")  # as the served app (conftest): fp32, so draft confidences match exactly
    target = open_model(cfg.target, cfg.target_backend, cfg.dtype, log=lambda line: None)
    draft = open_draft(cfg.draft, target, cfg.draft_backend, cfg.dtype, log=lambda line: None)
    return Engine(target.runner, target.tokenizer, target.eos_ids, draft=draft.runner, max_batch=16)


def _local(engine, tokenizer, prompts, mode, max_new_tokens):
    reqs = [GenerationRequest(encode_prompt(tokenizer, p), SamplingParams(max_new_tokens=max_new_tokens),
                              decode=DecodeParams(mode=mode)) for p in prompts]
    return engine.generate(reqs)


@pytest.mark.parametrize("mode", MODES)
def test_greedy_over_grpc_equals_in_process(client, local_engine, smol, mode):
    want = _local(local_engine, smol.tokenizer, PROMPTS[:2], mode, 24)
    for prompt, w in zip(PROMPTS[:2], want):
        got = client.generate(prompt, max_new_tokens=24, mode=mode)
        assert got.token_ids == w.output_ids, f"{mode}: {got.text!r} != {w.text!r}"
        assert got.text == w.text and got.finish_reason == w.finish_reason
        assert got.stats["mode"] == mode and got.stats["output_tokens"] == len(w.output_ids)
        if mode == "auto":
            # auto's per-step choice follows measured costs and the server's running n-gram estimate, so
            # which steps were drafted can differ between two engines; the tokens may not (checked above)
            assert 0.0 <= got.stats["filtered_fraction"] <= 1.0
            assert 1 <= got.stats["target_calls"] <= len(w.output_ids) + 1
            continue
        assert got.stats["filtered_fraction"] == pytest.approx(w.stats.filtered_fraction)
        assert got.stats["target_calls"] == w.stats.target_calls


def test_auto_calibration_prices_a_call_like_live_steps(client, small_app):
    """Calibrated forward costs are timed inside the worker; live steps are timed as whole calls. The router
    measures a no-op call's round trip to each worker and adds it to every calibrated size, so a plain step
    timed live and a verification known from calibration only are priced alike."""
    client.generate(PROMPTS[3], max_new_tokens=4, mode="auto")
    stats = handle(small_app.app_name, "router").stats.remote().result()
    trips = stats["call_overhead_ms"]
    assert set(trips) == {"target", "draft"}
    assert 0.0 < trips["target"] < 1000.0 and 0.0 < trips["draft"] < 1000.0


def test_stream_chunks_add_up_to_the_whole_output(client):
    whole = client.generate(PROMPTS[2], max_new_tokens=20, mode="speculative")
    chunks = list(client.stream(PROMPTS[2], max_new_tokens=20, mode="speculative", request_id="mine-1"))
    assert "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    assert all(c.request_id == "mine-1" for c in chunks)
    assert chunks[-1].finish_reason and chunks[-1].stats["output_tokens"] == len(whole.token_ids)
    assert not any(c.finish_reason for c in chunks[:-1])


def test_the_sdk_returns_each_tokens_logprob_and_alternatives(client):
    whole = client.generate(PROMPTS[1], max_new_tokens=8, logprobs=2)
    assert len(whole.logprobs) == len(whole.token_ids) > 0
    for token, lp in zip(whole.token_ids, whole.logprobs):  # greedy: each token is the target's top choice
        assert lp.token_id == token and lp.top[0][0] == token and lp.top[0][1] == pytest.approx(lp.logprob, abs=1e-4)
        assert len(lp.top) == 2 and lp.top[1][1] <= lp.top[0][1]
    chunks = list(client.stream(PROMPTS[1], max_new_tokens=8, logprobs=2))
    assert [lp.token_id for c in chunks for lp in c.logprobs] == whole.token_ids
    assert client.generate(PROMPTS[1], max_new_tokens=4).logprobs == []  # none asked for, none sent


def test_plain_decoding_runs_several_target_steps_a_call_with_the_same_tokens(client, local_engine, smol):
    """ar past its prefill: the router has the target run several steps a call (plain_run_ms), so the round trip
    is paid once per run; the stream carries exactly the tokens of one step a call (the in-process engine's), a
    chunk per call at most (a run's tokens go out together, not a message per token)."""
    want = _local(local_engine, smol.tokenizer, PROMPTS[:1], "ar", 40)[0]
    before = handle("calid", "target").stats.remote().result()
    chunks = list(client.stream(PROMPTS[0], max_new_tokens=40, mode="ar"))
    calls = handle("calid", "target").stats.remote().result()["batches"] - before["batches"]
    assert [t for c in chunks for t in c.token_ids] == want.output_ids
    assert "".join(c.text for c in chunks) == want.text and chunks[-1].finish_reason == want.finish_reason
    assert chunks[-1].stats["target_calls"] == want.stats.target_calls  # forwards, however many a call ran
    assert 2 <= calls <= len(want.output_ids) // 2
    assert len(chunks) <= calls


def test_a_request_arriving_during_a_run_of_plain_steps_cuts_the_run(client, local_engine, smol):
    """A request that arrives while the target runs a run of plain steps ends the run after its current
    forward (the router's cut_runs), so it starts with the next forward instead of waiting out the run; both
    streams carry the tokens of single steps. The arrival has to land inside a run: tried up to 5 times."""
    want = _local(local_engine, smol.tokenizer, PROMPTS[:2], "ar", 40)
    target = handle("calid", "target")
    before = target.stats.remote().result()["runs_cut"]
    for _ in range(5):
        stream = client.stream(PROMPTS[0], max_new_tokens=40, mode="ar")
        first = [next(stream) for _ in range(3)]  # past its prefill: its steps now go in runs
        second = client.generate(PROMPTS[1], max_new_tokens=40, mode="ar")
        assert [t for c in first + list(stream) for t in c.token_ids] == want[0].output_ids
        assert second.token_ids == want[1].output_ids
        if target.stats.remote().result()["runs_cut"] > before:
            break
    assert target.stats.remote().result()["runs_cut"] > before


def test_sixteen_concurrent_streams_are_correct_and_batched(small_app, local_engine, smol):
    from calid.client import AsyncClient

    prompts = [PROMPTS[i % 4] for i in range(16)]
    want = _local(local_engine, smol.tokenizer, PROMPTS, "speculative", 20)
    before = handle("calid", "target").stats.remote().result()

    async def one(c, p):
        return [t for chunk in [x async for x in c.stream(p, max_new_tokens=20, mode="speculative")]
                for t in chunk.token_ids]

    async def main():
        async with AsyncClient(f"127.0.0.1:{small_app.grpc_port}", app="calid", timeout=300) as c:
            return await asyncio.gather(*[one(c, p) for p in prompts])

    outs = asyncio.run(main())
    for i, out in enumerate(outs):
        assert out == want[i % 4].output_ids, f"stream {i}"
    router = handle("calid", "router").stats.remote().result()
    target = handle("calid", "target").stats.remote().result()
    assert router["max_escalation_batch"] > 1  # one router step sent many requests' escalations together
    assert (
        target["max_batch"] > 1 and target["batches"] > before["batches"]
    )  # ...and the target ran them in one forward
    assert router["target_fanout"] == 1  # one replica: one target call per step, whatever the requests
    assert target["batches"] - before["batches"] <= router["target_calls"]
    forwards = target["forwards"] - before["forwards"]  # llama.cpp (SmolLM2's GGUF): each forward, one or more ubatches
    assert 0 < forwards <= target["ubatches"] - before["ubatches"]


@pytest.mark.parametrize("kw, field", [
    ({"temperature": -1.0}, "temperature"),
    ({"mode": "warp"}, "mode"),
    ({"prompt": ""}, "prompt"),
    ({"gamma": 99}, "gamma"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": 2**32 - 1}, "max_new_tokens must be at most 4096"),
    ({"prompt": "word " * 300_000}, "over the server's limit"),
])
def test_bad_input_is_invalid_argument_and_the_server_keeps_serving(client, kw, field):
    prompt = kw.pop("prompt", "Say hello.")
    with pytest.raises(InvalidArgument, match=field):
        client.generate(prompt, **kw)
    with pytest.raises(InvalidArgument, match=field):
        list(client.stream(prompt, **kw))
    assert client.generate("Say hello.", max_new_tokens=4).finish_reason in ("length", "eos")


def test_health_and_models(client):
    h = client.health()
    assert h.serving and h.queue_capacity == 64
    models = client.list_models()
    assert [m.role for m in models.models] == ["target", "draft"]
    assert set(models.modes) == set(MODES) and models.default_mode == "auto"


def _router_idle(app: str) -> bool:
    s = handle(app, "router").stats.remote().result()
    return s["requests"] == 0 and s["active"] == 0 and s["waiting"] == 0


def _workers_empty(app: str, roles=("target", "draft")) -> bool:
    return all(handle(app, r).stats.remote().result()["cached"] == 0 for r in roles)


def test_client_cancellation_frees_router_and_worker_state(client):
    stream = client.stream(PROMPTS[0], max_new_tokens=200, ignore_eos=True, mode="speculative")
    first = [next(stream), next(stream)]
    assert all(not c.finish_reason for c in first)
    assert not _router_idle("calid")
    stream.close()  # the client goes away mid-stream
    assert wait_until(lambda: _router_idle("calid"), 20)
    assert wait_until(lambda: _workers_empty("calid"), 20)


def test_deadline_exceeded_frees_state(client):
    with pytest.raises(DeadlineExceeded):
        client.generate(PROMPTS[0], max_new_tokens=300, ignore_eos=True, timeout=1.0)
    assert wait_until(lambda: _router_idle("calid"), 20)
    assert wait_until(lambda: _workers_empty("calid"), 20)


def test_full_admission_queue_is_resource_exhausted(serve_port):
    cfg = deploy(AppConfig.small(app_name="tight", grpc_port=serve_port, draft=None, max_active=1, queue_capacity=0))
    with Client(f"127.0.0.1:{serve_port}", app="tight", timeout=120) as c:
        busy = c.stream(PROMPTS[0], max_new_tokens=300, ignore_eos=True)
        next(busy)
        with pytest.raises(ResourceExhausted, match="queue is full"):
            c.generate("Say hello.", max_new_tokens=4)
        busy.close()
        assert wait_until(lambda: _router_idle("tight"), 20), handle("tight", "router").stats.remote().result()
        assert c.generate("Say hello.", max_new_tokens=4).token_ids  # served again once there is room
    assert cfg.draft is None


def test_unknown_application_is_not_found(small_app):
    from calid.client.errors import CalidAPIError

    with Client(f"127.0.0.1:{small_app.grpc_port}", app="nope", timeout=30, retries=0) as c:
        with pytest.raises(CalidAPIError) as e:
            c.generate("hi")
    assert e.value.code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE)


def test_calid_client_cli(small_app, capsys):
    from serve_app.main import main

    address = f"127.0.0.1:{small_app.grpc_port}"
    assert main(["client", "Say hello.", "--address", address, "--max-new-tokens", "6", "--mode", "filter"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "[filter: " in err and "from draft" in err
    assert main(["client", "--models", "--address", address]) == 0
    assert "target  smollm2-135m-instruct" in capsys.readouterr().out
    assert main(["client", "Say hello.", "--address", address, "--temperature", "-2"]) == 2
    assert "temperature must be >= 0" in capsys.readouterr().err
