"""The client SDK against a small in-process gRPC server: retries, typed errors, deadlines, streams."""
from __future__ import annotations

import asyncio
import time
from concurrent import futures

import grpc
import pytest

from calid.client import AsyncClient, CalidAPIError, Client, DeadlineExceeded, InvalidArgument, Unavailable
from calid.v1 import calid_pb2 as pb
from calid.v1 import calid_pb2_grpc as pb_grpc


EDGE_PROMPT = [5, 17, 3]


class _Servicer(pb_grpc.CalidServicer):
    def __init__(self):
        self.failures_left = 0
        self.failure = (grpc.StatusCode.UNAVAILABLE, "no replica")
        self.calls = 0
        self.metadata = []
        self.cancelled = []

    def Generate(self, request, context):
        self.calls += 1
        self.metadata.append(dict(context.invocation_metadata()))
        if self.failures_left:
            self.failures_left -= 1
            context.abort(*self.failure)
        if request.temperature < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "temperature must be >= 0")
        if request.prompt == "slow":
            time.sleep(2)
        return pb.GenerateResponse(request_id=request.request_id, text=request.prompt.upper(), token_ids=[1, 2],
                                   finish_reason="length", stats=pb.RequestStats(output_tokens=2, mode=request.mode))

    def GenerateStream(self, request, context):
        self.calls += 1
        if self.failures_left:
            self.failures_left -= 1
            context.abort(grpc.StatusCode.UNAVAILABLE, "no replica")
        for i, word in enumerate(request.prompt.split()):
            yield pb.GenerateChunk(request_id=request.request_id, text=word, token_ids=[i])
        yield pb.GenerateChunk(request_id=request.request_id, finish_reason="eos",
                               stats=pb.RequestStats(output_tokens=len(request.prompt.split())))

    def Collaborate(self, requests, context):
        """A scripted gateway: keeps the first draft token of every round and adds token 42; a prompt
        "bad" gets INVALID_ARGUMENT at round 1."""
        self.calls += 1
        self.metadata.append(dict(context.invocation_metadata()))
        if self.failures_left:
            self.failures_left -= 1
            context.abort(grpc.StatusCode.UNAVAILABLE, "no replica")
        msg = next(requests).open
        self.rounds = []
        yield pb.CollaborateReply(request_id=msg.request_id, round=0, prompt_ids=EDGE_PROMPT, max_draft=3,
                                  threshold=0.5)
        produced = 0
        for m in requests:
            self.rounds.append(m.round)
            if msg.prompt == "bad":
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "round 1: draft token 7 is outside the vocabulary")
            keep = list(m.round.tokens[:1]) + [42]
            produced += len(keep)
            done = produced >= msg.max_new_tokens
            yield pb.CollaborateReply(request_id=msg.request_id, round=m.round.round, accepted=len(keep) - 1,
                                      token_ids=keep, text=" ".join(map(str, keep)) + " ", max_draft=3,
                                      finish_reason="length" if done else "",
                                      stats=pb.RequestStats(output_tokens=produced) if done else None)
            if done:
                return

    def Cancel(self, request, context):
        self.cancelled.append(request.request_id)
        return pb.CancelResponse(cancelled=True)


@pytest.fixture()
def server():
    servicer = _Servicer()
    srv = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_CalidServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield servicer, f"127.0.0.1:{port}"
    srv.stop(0)


def test_unavailable_is_retried_with_backoff_then_succeeds(server):
    servicer, address = server
    servicer.failures_left = 2
    with Client(address, backoff_s=0.01) as c:
        r = c.generate("hi", mode="filter", request_id="abc")
    assert r.text == "HI" and r.request_id == "abc" and r.stats["mode"] == "filter" and servicer.calls == 3
    assert servicer.metadata[-1]["application"] == "calid" and servicer.metadata[-1]["request_id"] == "abc"


def test_retries_give_up_with_unavailable(server):
    servicer, address = server
    servicer.failures_left = 10
    with Client(address, retries=2, backoff_s=0.01) as c, pytest.raises(Unavailable):
        c.generate("hi")
    assert servicer.calls == 3


def test_invalid_argument_is_typed_and_not_retried(server):
    servicer, address = server
    with Client(address, backoff_s=0.01) as c, pytest.raises(InvalidArgument, match="temperature"):
        c.generate("hi", temperature=-1.0)
    assert servicer.calls == 1


def test_deadline(server):
    _, address = server
    with Client(address) as c, pytest.raises(DeadlineExceeded):
        c.generate("slow", timeout=0.2)


def test_stream_retried_before_its_first_chunk(server):
    servicer, address = server
    servicer.failures_left = 1
    with Client(address, backoff_s=0.01) as c:
        chunks = list(c.stream("one two three"))
    assert [ch.text for ch in chunks[:-1]] == ["one", "two", "three"]
    assert chunks[-1].finish_reason == "eos" and chunks[-1].stats["output_tokens"] == 3


def test_async_client(server):
    servicer, address = server
    servicer.failures_left = 1

    async def main():
        async with AsyncClient(address, backoff_s=0.01) as c:
            whole = await c.generate("abc")
            chunks = [ch async for ch in c.stream("x y")]
            return whole, chunks

    whole, chunks = asyncio.run(main())
    assert whole.text == "ABC" and [ch.text for ch in chunks] == ["x", "y", ""]


def test_a_replica_that_died_mid_call_counts_as_unavailable_and_is_retried(server):
    """Ray Serve's proxy answers INTERNAL when the replica serving a call dies; the SDK retries it."""
    servicer, address = server
    servicer.failures_left = 1
    servicer.failure = (grpc.StatusCode.INTERNAL, "The actor died unexpectedly before finishing this task.")
    with Client(address, backoff_s=0.01) as c:
        assert c.generate("hi").text == "HI"
    assert servicer.calls == 2
    servicer.failures_left, servicer.failure = 1, (grpc.StatusCode.INTERNAL, "division by zero")
    with Client(address, backoff_s=0.01) as c, pytest.raises(CalidAPIError, match="INTERNAL: division by zero"):
        c.generate("hi")  # any other INTERNAL is not retried
    assert servicer.calls == 3


def test_the_blocking_client_shows_its_settings_and_closes_its_loop(server):
    _, address = server
    c = Client(address, timeout=7.0, retries=1, api_key="k-3")
    assert (c.address, c.timeout, c.retries, c.api_key) == (address, 7.0, 1, "k-3")
    assert c.generate("hello").text
    c.close()
    c.close()  # twice is fine
    assert not c._thread.is_alive()
    with pytest.raises(AttributeError):
        c.no_such_setting


def test_api_key_goes_out_as_bearer_metadata(server, monkeypatch):
    servicer, address = server
    with Client(address, api_key="k-1") as c:
        c.generate("hi")
    monkeypatch.setenv("CALID_API_KEY", "k-env")
    with Client(address) as c:
        c.generate("hi")
    monkeypatch.delenv("CALID_API_KEY")
    with Client(address) as c:
        c.generate("hi")
    assert [m.get("authorization") for m in servicer.metadata] == ["Bearer k-1", "Bearer k-env", None]


def test_tls_channel_with_a_ca_file(tmp_path, self_signed):
    """A TLS server with a self-signed certificate: the client trusts it through tls=<CA file>."""
    cert, key = self_signed
    servicer = _Servicer()
    srv = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_CalidServicer_to_server(servicer, srv)
    creds = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
    port = srv.add_secure_port("127.0.0.1:0", creds)
    srv.start()
    try:
        with Client(f"localhost:{port}", tls=str(cert), retries=0) as c:
            assert c.generate("hi").text == "HI"
        with Client(f"localhost:{port}", retries=0, timeout=5) as c, pytest.raises(CalidAPIError):
            c.generate("hi")  # plaintext against a TLS port fails
    finally:
        srv.stop(0)
    with pytest.raises(ValueError, match="cannot read the CA certificate"):
        Client("localhost:1", tls=str(tmp_path / "missing.pem"))


def test_tls_front_forwards_calls_metadata_and_status(server, self_signed):
    """serve_app.ingress.tls before a plaintext server: unary and streaming calls, the caller's metadata,
    and the upstream's status codes all pass through."""
    from serve_app.ingress.tls import TlsFront

    servicer, upstream = server
    cert, key = self_signed
    front = TlsFront("localhost:0", upstream, str(cert), str(key))
    port = front.start()
    try:
        with Client(f"localhost:{port}", tls=str(cert), api_key="k-9", backoff_s=0.01, retries=0) as c:
            assert c.generate("hi", request_id="r-1").text == "HI"
            assert [ch.text for ch in c.stream("one two")][:2] == ["one", "two"]
            with pytest.raises(InvalidArgument, match="temperature must be >= 0"):
                c.generate("hi", temperature=-1.0)
        md = servicer.metadata[0]
        assert (md["authorization"], md["application"], md["request_id"]) == ("Bearer k-9", "calid", "r-1")
    finally:
        front.stop()


def test_a_stream_closed_early_is_cancelled_by_a_call_of_its_own(server):
    """Ray Serve's proxy can miss a client's cancellation; the SDK then tells the router itself."""
    servicer, address = server
    with Client(address) as c:
        stream = c.stream("one two three", request_id="early")
        next(stream)
        stream.close()
        assert list(c.stream("all of it", request_id="whole"))[-1].finish_reason == "eos"

    async def main():
        async with AsyncClient(address) as ac:
            stream = ac.stream("one two three", request_id="early-async")
            await stream.__anext__()
            await stream.aclose()

    asyncio.run(main())
    assert servicer.cancelled == ["early", "early-async"]  # a stream read to its end sends none


# ---- collaborative edge drafting: the SDK drives Collaborate with a local draft -----------------


@pytest.fixture()
def local_draft(tiny_model):
    from calid.client.edge import LocalDraft
    from calid.edge import EdgeDrafter
    from calid.runtime.runner import ModelRunner

    return LocalDraft("tiny", drafter=EdgeDrafter(ModelRunner(tiny_model), frozenset()))


def _greedy(model, ids, n):
    from calid.runtime.runner import ModelRunner, SeqInput

    runner, ids = ModelRunner(model), list(ids)
    for _ in range(n):
        ids.append(int(runner.forward([SeqInput("g", runner.sync("g", ids))])[0][-1].argmax()))
    return ids[-n:]


def _check_rounds(servicer, tiny_model):
    """Every round is numbered in order, within max_draft, and drafted after exactly the ids the server
    kept (the client rolled back the rest of its previous draft)."""
    kept = list(EDGE_PROMPT)
    for k, r in enumerate(servicer.rounds, start=1):
        assert r.round == k and 1 <= len(r.tokens) <= 3 and len(r.confidence) == len(r.tokens)
        assert list(r.tokens) == _greedy(tiny_model, kept, len(r.tokens))
        kept += [r.tokens[0], 42]


def test_a_local_draft_drives_collaborate(server, local_draft, tiny_model):
    servicer, address = server
    servicer.failures_left = 1  # UNAVAILABLE before the first reply: retried
    with Client(address, local_draft=local_draft, backoff_s=0.01) as c:
        out = c.generate("hi", mode="filter", max_new_tokens=6)
    assert servicer.calls == 2 and len(servicer.rounds) == 3 and out.finish_reason == "length"
    assert out.token_ids[1::2] == [42, 42, 42] and out.stats["output_tokens"] == 6
    assert out.text == " ".join(map(str, out.token_ids)) + " "
    _check_rounds(servicer, tiny_model)
    assert local_draft.drafter().runner.cached_count() == 0  # the local cache is freed after the call


def test_an_async_local_draft_drives_collaborate_and_errors_are_typed(server, local_draft, tiny_model):
    servicer, address = server

    async def main():
        async with AsyncClient(address, local_draft=local_draft, retries=0) as c:
            chunks = [ch async for ch in c.stream("hi", max_new_tokens=4)]  # speculative by default
            with pytest.raises(InvalidArgument, match="outside the vocabulary"):
                await c.generate("bad", mode="filter", max_new_tokens=4)
            plain = await c.generate("upper", mode="ar")  # not an edge mode: the usual Generate
        return chunks, plain

    chunks, plain = asyncio.run(main())
    assert [t for ch in chunks for t in ch.token_ids][1::2] == [42, 42] and chunks[-1].finish_reason == "length"
    assert plain.text == "UPPER"
    assert local_draft.drafter().runner.cached_count() == 0


def test_tls_front_forwards_collaborate(server, self_signed, local_draft):
    from serve_app.ingress.tls import TlsFront

    servicer, upstream = server
    cert, key = self_signed
    front = TlsFront("localhost:0", upstream, str(cert), str(key))
    port = front.start()
    try:
        with Client(f"localhost:{port}", tls=str(cert), api_key="k-2", retries=0, local_draft=local_draft) as c:
            out = c.generate("hi", mode="speculative", max_new_tokens=4)
            with pytest.raises(InvalidArgument, match="outside the vocabulary"):
                c.generate("bad", mode="filter", max_new_tokens=4)
        assert out.token_ids[1::2] == [42, 42] and servicer.metadata[0]["authorization"] == "Bearer k-2"
    finally:
        front.stop()
