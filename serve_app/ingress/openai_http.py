"""The OpenAI-compatible HTTP front-end: the router's ``__call__`` (Serve's HTTP proxy) lands in ``handle``.

    GET  /v1/models            the served model ids
    POST /v1/chat/completions  chat (the model's template); stream: true -> Server-Sent Events
    POST /v1/completions       raw prompts (strings or token ids), logprobs + echo (log-likelihood)
    GET  /health               200 while serving, 503 while draining (open to every caller)
    POST /tokenize, /detokenize  the server's own tokenizer (vLLM's shape)

It only translates (serve_app.ingress.openai_wire): keys, limits, validation, admission and its bound, deadlines,
metrics and stats are the router's one request path (``Router.open``), the same as gRPC's. A body over
max_request_bytes is refused from its Content-Length (or while it is read), before it is held whole.
A client that disconnects mid-stream cancels the handler; the request's state is freed at once.
"""
from __future__ import annotations

import asyncio
import logging

import grpc
from starlette.responses import JSONResponse, Response, StreamingResponse

from calid.errors import CalidError
from calid.text import encode_prompt
from serve_app.ingress import openai_wire as wire
from serve_app.router.calls import Failure
from serve_app.ingress.frontdoor import Caller, Refused
from serve_app.ingress.outputs import IDLE, outputs

log = logging.getLogger("ray.serve")
KEEPALIVE_S = 15.0  # an SSE comment line after this long without a token, so proxies keep the stream open
JSON_OVERHEAD = 4  # a JSON body may be this many times the request's protobuf size limit (escapes, names)


async def handle(router, request) -> Response:
    path = route(request.scope)
    try:
        if path in ("/health", "/v1/health") and request.method == "GET":
            h = router.health()
            return JSONResponse({"status": "ok" if h["serving"] else "draining", **h},
                                status_code=200 if h["serving"] else 503)
        endpoint = ROUTES.get(path)
        if endpoint is None:
            raise wire.WireError(404, f"no route {path}; see /v1/models, /v1/chat/completions, /v1/completions")
        method, fn = endpoint
        if request.method != method:
            raise wire.WireError(405, f"{path} takes {method}, not {request.method}")
        caller = Caller(_bearer(request.headers.get("authorization")), "http")
        router.authorize(caller, "default")  # before the body is read
        return await fn(router, request, caller)
    except wire.WireError as e:
        return error_response(e)
    except Refused as e:
        return error_response(wire.from_status(e.code, e.message, e.retry_after_s))
    except Exception:  # a bug: say so without details, log them
        log.exception("calid http: %s %s failed", request.method, path)
        return error_response(wire.WireError(500, "internal error (logged by the server)"))


def off() -> Response:
    return error_response(wire.WireError(404, "the HTTP API is off on this server (http_port: 0); use gRPC"))


def route(scope) -> str:
    path, root = scope.get("path", "/"), scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):]
    return path.rstrip("/") or "/"


def _bearer(header: str | None) -> str | None:
    scheme, _, key = (header or "").partition(" ")
    return key.strip() if scheme.lower() == "bearer" and key.strip() else None


def error_response(e: wire.WireError) -> JSONResponse:
    headers = {"Retry-After": str(max(1, round(e.retry_after_s)))} if e.retry_after_s else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def _body(router, request) -> dict:
    return wire.parse_json(await read_body(router.cfg.max_request_bytes * JSON_OVERHEAD, request))


async def read_body(limit: int, request) -> bytes:
    """The body, refused with 413 when it is over ``limit`` bytes: by Content-Length before reading, else
    while reading (never held whole)."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise wire.WireError(413, f"request body is {declared} bytes, over the server's limit of {limit}")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise wire.WireError(413, f"request body is over the server's limit of {limit} bytes")
        parts.append(part)
    return b"".join(parts)


# ---- endpoints ---------------------------------------------------------------------------------

async def _models(router, request, caller) -> Response:
    return JSONResponse({"object": "list", "data": [{
        "id": router.model_id, "object": "model", "created": int(router.started), "owned_by": "calid",
        "max_model_len": router.max_position, "modes": router.modes(),
        "default_mode": router.orch.default_decode.mode}]})


async def _chat(router, request, caller) -> Response:
    msg, opts = wire.chat_request(await _body(router, request))
    return await _generate(router, "chat", wire.choices([msg], opts.n), opts, caller)


async def _completions(router, request, caller) -> Response:
    msgs, opts = wire.completion_requests(await _body(router, request))
    return await _generate(router, "completion", wire.choices(msgs, opts.n), opts, caller)


async def _generate(router, kind: str, msgs: list, opts: wire.Options, caller: Caller) -> Response:
    rs = await router.open_all(msgs, caller)  # every prompt and choice admitted together, or the call refused
    reply = wire.Reply(kind, opts, router.model_id, router.tokenizer.decode, [r.mode for r in rs])
    if opts.stream:
        return StreamingResponse(_stream(router, rs, reply), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        results = await asyncio.gather(*[_whole(router, r) for r in rs])
    finally:
        for r in rs:
            router.close(r)
    for r, out in zip(rs, results):
        if isinstance(out, Failure):
            raise _failed(router, r, out)
    return JSONResponse(reply.whole(results))


async def _whole(router, r):
    async for out in outputs(router, r, stream=False):
        return out


def _failed(router, r, failure: Failure) -> wire.WireError:
    refused = router.refuse(r.mode, failure.code, failure.message, "http")
    return wire.from_status(refused.code, refused.message)


async def _stream(router, rs: list, reply: wire.Reply):
    """SSE: each choice's Outputs as chunks (several prompts interleave, tagged by index), a usage chunk
    when asked, then [DONE]; an error after the first byte is an ``{"error": ...}`` event, then [DONE]."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, r):
        try:
            async for out in outputs(router, r, stream=True, idle_s=KEEPALIVE_S):
                await queue.put((i, out))
        except Exception as e:  # reported on the stream, not lost
            log.exception("calid http: stream failed")
            await queue.put((i, Failure(grpc.StatusCode.INTERNAL, f"internal error: {e!r}")))
        await queue.put((i, None))

    tasks = [asyncio.get_running_loop().create_task(pump(i, r)) for i, r in enumerate(rs)]
    first, open_ = set(range(len(rs))), len(rs)
    prompt_tokens = completion_tokens = 0
    try:
        while open_:
            i, out = await queue.get()
            if out is None:
                open_ -= 1
            elif out == IDLE:
                yield wire.SSE_KEEPALIVE
            elif isinstance(out, Failure):
                yield wire.sse(_failed(router, rs[i], out).body())
                yield wire.SSE_DONE
                return
            else:
                yield wire.sse(reply.chunk(i, out, i in first))
                first.discard(i)
                if out.result is not None:
                    prompt_tokens += out.result.prompt_tokens if i % reply.opts.n == 0 else 0  # a prompt once
                    completion_tokens += len(out.result.output_ids)
        if reply.opts.include_usage:
            yield wire.sse(reply.usage_chunk(prompt_tokens, completion_tokens))
        yield wire.SSE_DONE
    finally:  # finished, failed, or the client went away (Serve cancels this generator)
        for t in tasks:
            t.cancel()
        for r in rs:
            router.close(r)


async def _tokenize(router, request, caller) -> Response:
    body = await _body(router, request)
    if isinstance(body.get("prompt"), str) and "messages" not in body:
        text, chat = body["prompt"], False
    elif isinstance(body.get("messages"), list):
        msg, _ = wire.chat_request({"messages": body["messages"]})
        text, chat = [{"role": m.role, "content": m.content} for m in msg.messages], True
    else:
        raise wire.WireError(400, "tokenize takes prompt (a string) or messages", "prompt")
    limit = router.cfg.max_request_bytes
    if len(str(text)) > limit:
        raise wire.WireError(413, f"text is over the server's limit of {limit} characters")
    try:
        ids = await asyncio.get_running_loop().run_in_executor(router.tokenizer_pool, encode_prompt,
                                                               router.tokenizer, text, chat)
    except CalidError as e:
        raise wire.WireError(400, str(e)) from None
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": router.max_position})


async def _detokenize(router, request, caller) -> Response:
    tokens = (await _body(router, request)).get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                               and 0 <= t < router.vocab_size for t in tokens):
        raise wire.WireError(400, f"tokens must be a list of token ids below {router.vocab_size}", "tokens")
    return JSONResponse({"prompt": router.tokenizer.decode(tokens)})


ROUTES = {
    "/v1/models": ("GET", _models),
    "/v1/chat/completions": ("POST", _chat),
    "/v1/completions": ("POST", _completions),
    "/tokenize": ("POST", _tokenize),
    "/detokenize": ("POST", _detokenize),
}
