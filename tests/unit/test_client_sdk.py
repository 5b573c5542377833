"""The client SDK against a small in-process gRPC server: retries, typed errors, deadlines, streams."""
from __future__ import annotations

import asyncio
import time
from concurrent import futures

import grpc
import pytest

from calid.client import AsyncClient, Client, DeadlineExceeded, InvalidArgument, Unavailable
from calid.v1 import calid_pb2 as pb
from calid.v1 import calid_pb2_grpc as pb_grpc


class _Servicer(pb_grpc.CalidServicer):
    def __init__(self):
        self.failures_left = 0
        self.calls = 0
        self.metadata = []

    def Generate(self, request, context):
        self.calls += 1
        self.metadata.append(dict(context.invocation_metadata()))
        if self.failures_left:
            self.failures_left -= 1
            context.abort(grpc.StatusCode.UNAVAILABLE, "no replica")
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
