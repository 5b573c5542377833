"""The OpenAI HTTP API of a multi-model app: the front (serve_app.ingress.multi_model) reads a request's body,
picks the model the body's ``model`` names (no name: the first model) and replays the request on that model's
router, which serves it as a single-model app does (keys, limits, admission, streaming, logprobs, draining).

    GET  /v1/models   every served model, in the config's order (each router's own entry)
    GET  /health      200 while every model's router serves; 503 otherwise, with each model's status
    POST the rest     forwarded whole to the named model's router; an unknown name: 404 naming the served ones

A streamed answer is relayed part by part as the router sends it; a client that goes away cancels the
forwarded call, and the router frees the request.
"""
from __future__ import annotations

import asyncio
import json

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from serve_app.ingress import openai_http
from serve_app.ingress import openai_wire as wire

DROPPED_HEADERS = (b"content-length",)  # set again for the body relayed
EACH_TIMEOUT_S = 10.0  # a router that has not answered /health or /v1/models by then counts as not serving


async def handle(front, request) -> Response:
    path = openai_http.route(request.scope)
    try:
        if request.method == "GET" and path in ("/health", "/v1/health"):
            return await _health(front, request, path)
        if request.method == "GET" and path == "/v1/models":
            return await _models(front, request, path)
        body = await openai_http.read_body(front.cfg.max_request_bytes * openai_http.JSON_OVERHEAD, request)
        return await _forward(front, front.pick(_named_model(body)), request, path, body)
    except wire.WireError as e:
        return openai_http.error_response(e)


def _named_model(body: bytes) -> str:
    """The body's ``model`` ('' when there is none or the body is not a JSON object: the default model's router
    then says what is wrong with it)."""
    try:
        parsed = json.loads(body) if body else {}
    except ValueError:
        return ""
    model = parsed.get("model") if isinstance(parsed, dict) else None
    return model if isinstance(model, str) else ""


async def _forward(front, i: int, request, path: str, body: bytes) -> Response:
    """Replay the request on router ``i``: its status and headers, then its body, relayed as they come."""
    front.in_flight[i] += 1
    stream = front.routers[i].options(stream=True).http_forwarded.remote(
        request.method, path, list(request.headers.raw), body)
    relayed = False
    try:
        status, headers = await stream.__anext__()
        headers = [(k, v) for k, v in headers if k.lower() not in DROPPED_HEADERS]
        if not any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers):
            return _response(b"".join([part async for part in stream]), status, headers)
        relayed = True  # from here _relay counts it and cancels it
        return StreamingResponse(_relay(front, i, stream), status_code=status,
                                 headers={k.decode("latin-1"): v.decode("latin-1") for k, v in headers})
    except BaseException:
        stream.cancel()
        raise
    finally:
        if not relayed:
            front.in_flight[i] -= 1


async def _relay(front, i: int, stream):
    try:
        async for part in stream:
            yield part
    finally:  # the end, or the client went away: the router's generator is cancelled and frees the request
        stream.cancel()
        front.in_flight[i] -= 1


def _response(body: bytes, status: int, headers: list) -> Response:
    response = Response(body, status_code=status)
    response.raw_headers = headers + [(b"content-length", str(len(body)).encode())]
    return response


async def _each(front, request, path: str) -> list[tuple[int, dict]]:
    """A GET replayed on the first router of every model: (status, JSON body) per model, in order."""
    async def one(i):
        try:
            stream = front.routers[i].options(stream=True).http_forwarded.remote(
                "GET", path, list(request.headers.raw), b"")
            status, _ = await asyncio.wait_for(stream.__anext__(), EACH_TIMEOUT_S)
            return status, json.loads(b"".join([part async for part in stream]) or b"{}")
        except Exception as e:  # a router that cannot answer (being replaced, dead): not serving
            return 503, {"status": "unreachable", "error": type(e).__name__}

    return await asyncio.gather(*[one(group[0]) for group in front.models.values()])


async def _models(front, request, path: str) -> Response:
    replies = await _each(front, request, path)
    for status, body in replies:
        if status != 200:  # refused (a key missing or wrong): the first refusal, as a single-model app says it
            return JSONResponse(body, status_code=status)
    return JSONResponse({"object": "list", "data": [m for _, body in replies for m in body.get("data", [])]})


async def _health(front, request, path: str) -> Response:
    replies = await _each(front, request, path)
    serving = all(status == 200 for status, _ in replies)
    return JSONResponse({"status": "ok" if serving else "draining",
                         "models": {name: body for name, (_, body) in zip(front.models, replies)}},
                        status_code=200 if serving else 503)


def replayed(method: str, path: str, headers: list, body: bytes) -> Request:
    """A request as the front received it, its body already read: what a model's router serves."""
    sent = False

    async def receive():
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": method, "path": path, "root_path": "", "headers": headers,
             "query_string": b"", "http_version": "1.1", "scheme": "http"}
    return Request(scope, receive)
