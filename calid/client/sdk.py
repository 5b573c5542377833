"""The clients: AsyncClient over grpc.aio, and Client, the same calls blocking (it runs an AsyncClient)."""
from __future__ import annotations

import asyncio
import json
import os
import threading
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator

import grpc
from google.protobuf.json_format import MessageToDict

from calid.client.errors import CalidAPIError, from_rpc_error, status_of
from calid.v1 import calid_pb2 as pb
from calid.v1 import calid_pb2_grpc as pb_grpc

RETRY_CODES = (grpc.StatusCode.UNAVAILABLE,)
CANCEL_TIMEOUT_S = 5.0


@dataclass
class Logprob:
    """One output token's log-probability under the target and, most likely first, its top alternatives
    (token id, logprob): what a request with ``logprobs=N`` gets for each token."""
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: dict = field(default_factory=dict)
    logprobs: list[Logprob] = field(default_factory=list)  # with logprobs=N: one per token_ids entry


@dataclass
class Chunk:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str = ""  # set on the last chunk
    stats: dict = field(default_factory=dict)  # set on the last chunk
    logprobs: list[Logprob] = field(default_factory=list)  # with logprobs=N: one per token_ids entry


def _stats(msg) -> dict:
    return MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def build_request(prompt: str | None = None, messages: list[dict] | None = None, *, request_id: str | None = None,
                  max_new_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
                  top_k: int | None = None, seed: int | None = None, stop: list[str] | None = None,
                  mode: str = "", threshold: float | None = None, gamma: int | None = None,
                  raw_prompt: bool = False, ignore_eos: bool = False, model: str = "", logprobs: int | None = None,
                  echo: bool = False, min_agreement: float | None = None, rollback_nll: float | None = None,
                  max_quality_loss: float | None = None, json_schema: dict | str | None = None,
                  json_object: bool = False, regex: str | None = None, grammar: str | None = None,
                  tools: list[dict] | None = None, tool_choice: str = "") -> pb.GenerateRequest:
    """One request; at most one of ``json_schema`` (a dict or JSON text), ``json_object``, ``regex`` and ``grammar``
    (Lark) constrains the output (structured output). ``tools`` (OpenAI function definitions) and ``tool_choice``
    (auto, none, required or a function's name): the calls come back in the text as the model's template writes
    them (``calid.tool_calls.split_calls`` reads them)."""
    msg = pb.GenerateRequest(request_id=request_id or uuid.uuid4().hex, prompt=prompt or "", mode=mode,
                             raw_prompt=raw_prompt, ignore_eos=ignore_eos, stop=list(stop or []), model=model,
                             echo=echo, tools=json.dumps(tools) if tools else "", tool_choice=tool_choice)
    for m in messages or []:
        msg.messages.add(role=m["role"], content=m.get("content") or "", tool_call_id=m.get("tool_call_id") or "",
                         tool_calls=json.dumps(m["tool_calls"]) if m.get("tool_calls") else "")
    for name, value in (("max_new_tokens", max_new_tokens), ("temperature", temperature), ("top_p", top_p),
                        ("top_k", top_k), ("seed", seed), ("threshold", threshold), ("gamma", gamma),
                        ("logprobs", logprobs), ("min_agreement", min_agreement), ("rollback_nll", rollback_nll),
                        ("max_quality_loss", max_quality_loss)):
        if value is not None:
            setattr(msg, name, value)
    given = {k: v for k, v in (("json_schema", json_schema), ("regex", regex), ("lark", grammar)) if v is not None}
    if json_object:
        given["json_object"] = True
    if len(given) > 1:
        raise ValueError(f"give one of json_schema, json_object, regex, grammar, not {', '.join(given)}")
    for kind, value in given.items():
        setattr(msg.grammar, kind, json.dumps(value) if kind == "json_schema" and not isinstance(value, str) else value)
    return msg


def _logprobs(entries) -> list[Logprob]:
    return [Logprob(e.token_id, e.logprob, [(a.token_id, a.logprob) for a in e.top]) for e in entries]


def _completion(resp: pb.GenerateResponse) -> Completion:
    return Completion(resp.request_id, resp.text, list(resp.token_ids), resp.finish_reason, _stats(resp.stats),
                      _logprobs(resp.logprobs))


def _chunk(c: pb.GenerateChunk) -> Chunk:
    return Chunk(c.request_id, c.text, list(c.token_ids), c.finish_reason,
                 _stats(c.stats) if c.finish_reason else {}, _logprobs(c.logprobs))


def _edge_chunk(reply: pb.CollaborateReply) -> Chunk | None:
    """What the caller sees of a Collaborate reply (nothing of an opening one without tokens)."""
    if reply.round == 0 and not reply.token_ids and not reply.finish_reason:
        return None
    return Chunk(reply.request_id, reply.text, list(reply.token_ids), reply.finish_reason,
                 _stats(reply.stats) if reply.finish_reason else {})


def _collect(chunks) -> Completion:
    parts, ids, logprobs, last = [], [], [], None
    for last in chunks:
        parts.append(last.text)
        ids += last.token_ids
        logprobs += last.logprobs
    return Completion(last.request_id, "".join(parts), ids, last.finish_reason, last.stats, logprobs)


def _ended_early(request_id: str) -> CalidAPIError:
    return CalidAPIError("the server ended the Collaborate call before its last reply", request_id,
                         grpc.StatusCode.UNKNOWN)


def _credentials(tls: bool | str) -> grpc.ChannelCredentials | None:
    """None for a plaintext channel; ``tls=True`` trusts the system roots, a path trusts that PEM file."""
    if not tls:
        return None
    if tls is True:
        return grpc.ssl_channel_credentials()
    try:
        with open(os.path.expanduser(tls), "rb") as f:
            return grpc.ssl_channel_credentials(root_certificates=f.read())
    except OSError as e:
        raise ValueError(f"tls: cannot read the CA certificate {tls}: {e.strerror}") from None


class AsyncClient:
    """asyncio client (grpc.aio); create it inside a running event loop (Client is its blocking form).

    ``api_key`` (default: $CALID_API_KEY) goes out as ``authorization: Bearer <key>``; ``tls`` is False
    (plaintext), True (TLS, system roots) or the path of a PEM CA certificate to trust.

    ``local_draft`` (a model spec, e.g. "qwen2.5-coder-0.5b-instruct", or "self:N" for the first N layers
    of the server's target, or a calid.client.edge.LocalDraft to share one) runs the draft on this machine:
    requests in mode filter or speculative (the
    default with a local draft) then go through Collaborate, and the server only filters and verifies.
    Other modes are served as usual. ``draft_threads``: CPU threads of the local draft (default: all).
    """

    def __init__(self, address: str = "127.0.0.1:50051", app: str = "calid", timeout: float | None = 600.0,
                 retries: int = 3, backoff_s: float = 0.2, api_key: str | None = None, tls: bool | str = False,
                 local_draft=None, draft_threads: int | None = None):
        self.address, self.app = address, app
        self.timeout, self.retries, self.backoff_s = timeout, retries, backoff_s
        self.api_key = api_key if api_key is not None else os.environ.get("CALID_API_KEY") or None
        self._creds = _credentials(tls)
        self._local = None
        if local_draft:
            from calid.client.edge import LocalDraft

            self._local = (local_draft if isinstance(local_draft, LocalDraft)
                           else LocalDraft(local_draft, draft_threads))
        self._channel = (grpc.aio.secure_channel(address, self._creds) if self._creds
                         else grpc.aio.insecure_channel(address))
        self._cancels: set[asyncio.Task] = set()
        self._stub = pb_grpc.CalidStub(self._channel)

    def _at_edge(self, kw: dict) -> bool:
        """Whether this request is drafted here (fills in the mode a local draft defaults to)."""
        if self._local is None:
            return False
        from calid.edge import EDGE_MODES

        kw["mode"] = kw.get("mode") or ("filter" if kw.get("max_quality_loss") is not None else "speculative")
        return kw["mode"] in EDGE_MODES

    @staticmethod
    def _target_of(models: pb.ListModelsResponse) -> str:
        return next(m.name for m in models.models if m.role == "target")

    def _metadata(self, request_id: str | None = None) -> tuple:
        md = (("application", self.app),)
        if self.api_key:
            md += (("authorization", f"Bearer {self.api_key}"),)
        return md + ((("request_id", request_id),) if request_id else ())

    def _deadline(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def _call_args(self, timeout: float | None, request_id: str | None) -> dict:
        return {"timeout": self._deadline(timeout), "metadata": self._metadata(request_id)}

    def _backoff(self, e: grpc.RpcError, attempt: int, request_id: str | None, started: bool = False) -> float:
        """Seconds to wait before retrying ``e``; raises the typed error when it must not be retried."""
        if started or status_of(e) not in RETRY_CODES or attempt == self.retries:
            raise from_rpc_error(e, request_id) from None
        return self.backoff_s * 2**attempt


    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self) -> None:
        if self._cancels:
            await asyncio.gather(*self._cancels, return_exceptions=True)
        await self._channel.close()

    async def _unary(self, method, msg, timeout: float | None, request_id: str | None = None):
        for attempt in range(self.retries + 1):
            try:
                return await method(msg, **self._call_args(timeout, request_id))
            except grpc.RpcError as e:
                await asyncio.sleep(self._backoff(e, attempt, request_id))

    async def generate(self, prompt: str | None = None, *, timeout: float | None = None, **kw) -> Completion:
        if self._at_edge(kw):
            return _collect([c async for c in self._collaborate(build_request(prompt, **kw), timeout)])
        msg = build_request(prompt, **kw)
        return _completion(await self._unary(self._stub.Generate, msg, timeout, msg.request_id))

    async def stream(self, prompt: str | None = None, *, timeout: float | None = None, **kw) -> AsyncIterator[Chunk]:
        if self._at_edge(kw):
            async for chunk in self._collaborate(build_request(prompt, **kw), timeout):
                yield chunk
            return
        msg = build_request(prompt, **kw)
        for attempt in range(self.retries + 1):
            call = self._stub.GenerateStream(msg, **self._call_args(timeout, msg.request_id))
            started = finished = ended = False
            try:
                async for c in call:
                    started, finished = True, bool(c.finish_reason)
                    yield _chunk(c)
                return
            except grpc.RpcError as e:
                ended = True
                await asyncio.sleep(self._backoff(e, attempt, msg.request_id, started))
            finally:
                call.cancel()
                if not (finished or ended):  # in the background: this may run while being cancelled
                    task = asyncio.ensure_future(self._cancel(msg.request_id))
                    self._cancels.add(task)
                    task.add_done_callback(self._cancels.discard)

    async def _collaborate(self, msg: pb.GenerateRequest, timeout: float | None) -> AsyncIterator[Chunk]:
        """As Client._collaborate; the local draft runs on a worker thread, off the event loop."""
        from calid.client.edge import EdgeSession

        loop = asyncio.get_running_loop()
        name = self._target_of(await self.list_models()) if self._local.needs_target_name else None
        drafter = await loop.run_in_executor(None, self._local.drafter, name)
        for attempt in range(self.retries + 1):
            session = EdgeSession(self._local, drafter, msg)
            call = self._stub.Collaborate(**self._call_args(timeout, msg.request_id))
            started = False
            try:
                await _write(call, session.opening())
                while (reply := await call.read()) is not grpc.aio.EOF:
                    started = True
                    chunk = _edge_chunk(reply)
                    if chunk is not None:
                        yield chunk
                    following = await loop.run_in_executor(None, session.advance, reply)
                    if following is None:
                        return
                    await _write(call, following)
                raise _ended_early(msg.request_id)
            except grpc.RpcError as e:
                await asyncio.sleep(self._backoff(e, attempt, msg.request_id, started))
            finally:
                call.cancel()
                session.close()

    async def _cancel(self, request_id: str) -> None:
        try:
            await self._stub.Cancel(pb.CancelRequest(request_id=request_id),
                                    **self._call_args(CANCEL_TIMEOUT_S, request_id))
        except grpc.RpcError:
            pass

    async def health(self, timeout: float | None = 10.0) -> pb.HealthResponse:
        return await self._unary(self._stub.Health, pb.HealthRequest(), timeout)

    async def list_models(self, timeout: float | None = 10.0) -> pb.ListModelsResponse:
        return await self._unary(self._stub.ListModels, pb.ListModelsRequest(), timeout)


class Client:
    """Blocking client. It takes AsyncClient's arguments and runs an AsyncClient on an event loop of its own, on
    one thread, so that blocking and asyncio callers share one code path: requests, retries, streams,
    Collaborate. Safe to share between threads; its settings (``address``, ``timeout``, ...) are the
    AsyncClient's."""

    SETTINGS = ("address", "app", "timeout", "retries", "backoff_s", "api_key")

    def __init__(self, address: str = "127.0.0.1:50051", **kw):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="calid-client", daemon=True)
        self._thread.start()
        try:
            self._async = self._run(_open_async(address, kw))  # grpc.aio wants its channel made on its loop
        except BaseException:
            self._stop()
            raise

    def __getattr__(self, name: str):
        if name in Client.SETTINGS:
            return getattr(self._async, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._run(self._async.close())
        finally:
            self._stop()

    def _stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def _run(self, coro):
        """Run ``coro`` on the client's loop and wait for it; an interrupt here cancels it there."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def generate(self, prompt: str | None = None, *, timeout: float | None = None, **kw) -> Completion:
        return self._run(self._async.generate(prompt, timeout=timeout, **kw))

    def stream(self, prompt: str | None = None, *, timeout: float | None = None, **kw) -> Iterator[Chunk]:
        chunks = self._async.stream(prompt, timeout=timeout, **kw)
        try:
            while True:
                try:
                    chunk = self._run(anext(chunks))
                except StopAsyncIteration:
                    return
                yield chunk
        finally:  # a consumer that stops early: the async stream's own close tells the server to free it
            if not self._loop.is_closed():
                self._run(chunks.aclose())

    def health(self, timeout: float | None = 10.0) -> pb.HealthResponse:
        return self._run(self._async.health(timeout))

    def list_models(self, timeout: float | None = 10.0) -> pb.ListModelsResponse:
        return self._run(self._async.list_models(timeout))


async def _open_async(address: str, kw: dict) -> "AsyncClient":
    return AsyncClient(address, **kw)


async def _write(call, message) -> None:
    """Send ``message`` on a bidirectional call. A call the server already ended (an abort racing the write) makes
    gRPC report only INTERNAL "Internal error from Core"; the call's own status says why it ended (UNAVAILABLE is
    retried), so that is what is raised, and UNAVAILABLE where the call holds only that same local error."""
    try:
        await call.write(message)
    except grpc.RpcError as e:
        code, details = await call.code(), await call.details()
        if code in (None, grpc.StatusCode.OK):
            raise
        if code == grpc.StatusCode.INTERNAL and details == e.details():  # the call took the failed send's own
            # status: the server's never arrived (it ended the call first: 2 runs in 9 of a test that aborts)
            code, details = grpc.StatusCode.UNAVAILABLE, f"the server ended the call under a write ({details})"
        raise grpc.aio.AioRpcError(code, await call.initial_metadata(), await call.trailing_metadata(),
                                   details, e.debug_error_string()) from None
