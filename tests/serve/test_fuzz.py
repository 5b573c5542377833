"""Property-based fuzzing of the gRPC API (hypothesis): whatever a client puts in a GenerateRequest, the
server answers with a result or a clear status, and keeps serving.

In process, many examples against the router's admission path (limits, template, tokenizer, request
checks); over real gRPC on the local Ray, fewer examples through the whole stack.
"""
from __future__ import annotations

import asyncio

import grpc
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from serve_helpers import forget_admitted, workerless_router

from calid.decoding.modes import MODES
from calid.v1 import calid_pb2 as pb
from serve_app.cluster.config import AppConfig
from serve_app.ingress.frontdoor import Caller, Refused

pytestmark = [pytest.mark.model]

_float = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, 0.5, 1.0]))
_text = st.text(max_size=200)
_u32 = st.one_of(st.integers(0, 2**32 - 1), st.integers(0, 8))


@st.composite
def requests(draw, max_tokens=_u32):
    msg = pb.GenerateRequest(request_id=draw(st.text(max_size=40)), raw_prompt=draw(st.booleans()),
                             ignore_eos=draw(st.booleans()),
                             mode=draw(st.one_of(st.sampled_from(("",) + MODES), st.text(max_size=12))))
    if draw(st.booleans()):
        msg.prompt = draw(_text)
    for _ in range(draw(st.integers(0, 3))):
        msg.messages.add(role=draw(st.one_of(st.sampled_from(["system", "user", "assistant"]), st.text(max_size=8))),
                         content=draw(_text))
    for name, strategy in (("max_new_tokens", max_tokens), ("temperature", _float), ("top_p", _float),
                           ("top_k", _u32), ("seed", st.integers(0, 2**64 - 1)), ("threshold", _float),
                           ("gamma", _u32)):
        if draw(st.booleans()):
            setattr(msg, name, draw(strategy))
    msg.stop.extend(draw(st.lists(st.text(max_size=300), max_size=20)))
    return msg


@pytest.fixture(scope="module")
def router():
    return workerless_router(AppConfig.small())


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(msg=requests())
def test_any_request_is_admitted_or_refused_with_a_clear_status(router, msg):
    async def open_and_close():
        try:
            r = await router.open(msg, Caller())
        except Refused as e:
            return None, e
        forget_admitted(router)
        return r, None

    r, refused = asyncio.run(open_and_close())
    if r is None:
        assert refused.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), refused.code
        assert refused.message and "\n" not in refused.message and len(refused.message) < 400
    else:
        assert r.req.prompt_ids and r.req.params.max_new_tokens <= 4096


@pytest.mark.ray
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(msg=requests(max_tokens=st.integers(0, 3)))
def test_fuzzed_requests_over_grpc_get_a_result_or_a_status_and_the_server_keeps_serving(small_app, msg):
    from calid.v1 import calid_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"127.0.0.1:{small_app.grpc_port}") as channel:
        stub = pb_grpc.CalidStub(channel)
        md = (("application", small_app.app_name),)
        if not msg.HasField("max_new_tokens"):
            msg.max_new_tokens = 2
        try:
            resp = stub.Generate(msg, metadata=md, timeout=120)
            assert resp.finish_reason in ("eos", "stop", "length")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
        assert stub.Health(pb.HealthRequest(), metadata=md, timeout=30).serving
