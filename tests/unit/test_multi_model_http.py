"""The multi-model front's HTTP pieces apart from Serve: which model a body names, and a replayed request that
the model's router reads as the one the front received."""
from __future__ import annotations

import asyncio

import pytest

from serve_app.ingress import openai_http
from serve_app.ingress import openai_wire as wire
from serve_app.ingress.multi_model_http import _named_model, replayed


@pytest.mark.parametrize("body, model", [
    (b'{"model": "smol", "messages": []}', "smol"),
    (b'{"messages": []}', ""),  # none named: the first model
    (b'{"model": 7}', ""),  # not a name: the first model's router says what is wrong
    (b'[1, 2]', ""),
    (b'{"model": ', ""),  # not JSON: likewise
    (b"", ""),
])
def test_the_model_a_body_names(body, model):
    assert _named_model(body) == model


def test_a_replayed_request_reads_as_the_one_received():
    body = b'{"model": "smol", "prompt": "hi"}'
    request = replayed("POST", "/v1/completions", [(b"authorization", b"Bearer k"),
                                                   (b"content-length", str(len(body)).encode())], body)
    assert openai_http.route(request.scope) == "/v1/completions" and request.method == "POST"
    assert request.headers["authorization"] == "Bearer k"
    assert asyncio.run(openai_http.read_body(1 << 20, request)) == body
    with pytest.raises(wire.WireError, match="over the server's limit"):  # the router's limit holds as well
        asyncio.run(openai_http.read_body(8, replayed("POST", "/v1/completions", [], body)))
