"""Collaborative edge drafting over real gRPC on a real local Ray: the SDK (sync and asyncio) and the CLI
draft with a local model and the served router filters and verifies; a raw client that breaks the
protocol ends only its own request.

Two local drafts: ``self:16`` (the first 16 layers of the server's SmolLM2 target, a weak draft that
writes text of its own) and the target's own GGUF on llama.cpp (a draft that agrees with the target, so
nearly every draft token is accepted)."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from calid.client import AsyncClient, Client
from calid.v1 import calid_pb2 as pb
from calid.v1 import calid_pb2_grpc as pb_grpc
from serve_helpers import handle, wait_until

pytestmark = [pytest.mark.ray, pytest.mark.model]

PROMPT = "Write a Python function that checks whether a number is prime."
N = 32


@pytest.fixture(scope="module")
def edge(small_app):
    with Client(f"127.0.0.1:{small_app.grpc_port}", app=small_app.app_name, timeout=300,
                local_draft="self:16") as c:
        yield c


@pytest.fixture(scope="module")
def twin(small_app):
    with Client(f"127.0.0.1:{small_app.grpc_port}", app=small_app.app_name, timeout=300,
                local_draft=small_app.target) as c:
        yield c


def _idle() -> bool:
    router = handle("calid", "router").stats.remote().result()
    target = handle("calid", "target").stats.remote().result()
    return router["requests"] == 0 and router["active"] == 0 and target["cached"] == 0


def test_edge_speculative_is_the_targets_output_and_filter_spans_draft_to_target(client, edge, twin):
    ar = client.generate(PROMPT, mode="ar", max_new_tokens=N, ignore_eos=True)
    for c in (edge, twin):
        spec = c.generate(PROMPT, mode="speculative", max_new_tokens=N, ignore_eos=True)
        assert spec.token_ids == ar.token_ids and spec.text == ar.text
        assert spec.stats["draft_forwards"] == 0  # drafted here, not in the cluster
    assert spec.stats["draft_tokens"] > N // 2 and spec.stats["target_calls"] < N // 2  # the twin's drafts

    zero = edge.generate(PROMPT, mode="filter", threshold=0.0, max_new_tokens=N, ignore_eos=True)
    assert zero.stats["target_calls"] == 0 and zero.stats["filtered_fraction"] == 1.0
    assert zero.token_ids != ar.token_ids  # the draft alone writes something else
    one = edge.generate(PROMPT, mode="filter", threshold=1.0, max_new_tokens=N, ignore_eos=True)
    assert one.token_ids == ar.token_ids and one.stats["draft_tokens"] == 0
    # a quality budget the app's table vouches for no threshold at (conftest.QUALITY_POINTS): at the edge, filter at
    # 1.0 (the client drafts; in the cluster the same budget runs as auto, tests/serve/test_quality_budget.py)
    budget = edge.generate(PROMPT, max_quality_loss=0.5, max_new_tokens=N, ignore_eos=True)
    assert budget.token_ids == ar.token_ids and budget.stats["mode"] == "filter" and budget.stats["draft_tokens"] == 0

    chunks = list(edge.stream(PROMPT, max_new_tokens=N, ignore_eos=True))  # a local draft defaults to speculative
    assert [t for c in chunks for t in c.token_ids] == ar.token_ids
    assert chunks[-1].finish_reason == "length" and chunks[-1].stats["mode"] == "speculative"
    assert wait_until(_idle, 20)


def test_async_edge_sampled_speculative_is_reproducible(small_app):
    async def go():
        async with AsyncClient(f"127.0.0.1:{small_app.grpc_port}", timeout=300, local_draft=small_app.target) as c:
            kw = dict(mode="speculative", temperature=0.8, seed=11, max_new_tokens=N, ignore_eos=True)
            return await asyncio.gather(c.generate(PROMPT, **kw), c.generate(PROMPT, **kw))

    a, b = asyncio.run(go())
    assert a.token_ids == b.token_ids and len(a.token_ids) == N
    assert a.stats["draft_tokens"] > N // 2  # the draft samples as the target does: most are accepted
    assert wait_until(_idle, 20)


def _raw(port: int):
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    return channel, pb_grpc.CalidStub(channel)


def test_a_hostile_round_is_invalid_argument_and_the_server_goes_on(small_app, edge):
    channel, stub = _raw(small_app.grpc_port)
    opening = pb.CollaborateRequest(open=pb.GenerateRequest(prompt=PROMPT, max_new_tokens=N, mode="filter"))
    bad = pb.CollaborateRequest(round=pb.DraftRound(round=1, tokens=[10**6], confidence=[0.9]))
    with channel:
        call = stub.Collaborate(iter([opening, bad]), metadata=(("application", "calid"),), timeout=60)
        with pytest.raises(grpc.RpcError) as e:
            list(call)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "outside the vocabulary" in e.value.details()
    assert wait_until(_idle, 20)
    assert edge.generate(PROMPT, mode="filter", max_new_tokens=4).token_ids  # others are served as before


def test_a_client_that_hangs_up_mid_request_leaves_nothing_behind(small_app):
    import queue

    channel, stub = _raw(small_app.grpc_port)
    outbox = queue.SimpleQueue()
    outbox.put(pb.CollaborateRequest(open=pb.GenerateRequest(prompt=PROMPT, max_new_tokens=N, mode="filter")))
    with channel:
        call = stub.Collaborate(iter(outbox.get, None), metadata=(("application", "calid"),), timeout=60)
        opening = next(call)
        assert opening.round == 0 and opening.prompt_ids and opening.max_draft == 8
        assert opening.threshold == pytest.approx(small_app.filter_point)  # the app's filter default
        outbox.put(pb.CollaborateRequest(round=pb.DraftRound(round=1, tokens=[28], confidence=[0.0])))
        assert len(next(call).token_ids) == 1  # the target replaced the unconfident token
        assert not _idle()
        call.cancel()  # gone mid-request, without a word
    assert wait_until(_idle, 30)


def test_calid_client_cli_with_a_local_draft(small_app, capsys):
    from serve_app.main import main

    address = f"127.0.0.1:{small_app.grpc_port}"
    assert main(["client", "Say hello.", "--address", address, "--max-new-tokens", "8", "--mode", "filter",
                 "--local-draft", "self:16"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "[filter at the edge: " in err
    assert main(["client", "Say hello.", "--address", address, "--local-draft", "no-such-model"]) == 2
    assert "no-such-model" in capsys.readouterr().err
