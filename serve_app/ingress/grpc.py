"""The gRPC and HTTP entry points of a model's router: what Serve's proxies call, turned into the router's one
request path (``open`` / ``events`` via serve_app.ingress.outputs / ``close``; ``authorize``, ``refuse``).

``GrpcFront`` holds the calid.v1 service methods (Generate, GenerateStream, Health, ListModels, Cancel,
Collaborate), the calls a multi-model front forwards, and ``__call__`` for Serve's HTTP proxy (the OpenAI API,
serve_app.ingress.openai_http). The Router deployment inherits it; nothing here reaches a private member.
"""
from __future__ import annotations

from calid.v1 import calid_pb2 as pb
from serve_app.ingress import openai_http
from serve_app.ingress.collaborate import collaborate
from serve_app.ingress.frontdoor import FORWARDED, ForwardedContext, Refused, grpc_caller, set_grpc_status
from serve_app.ingress.outputs import outputs
from serve_app.router.calls import Failure, RequestRefused


class GrpcFront:
    """calid.v1's service on the router (Serve's gRPC proxy calls these by name)."""

    async def Generate(self, request: pb.GenerateRequest, grpc_context=None) -> pb.GenerateResponse:
        try:
            r = await self.open(request, grpc_caller(grpc_context))
        except Refused as e:
            set_grpc_status(grpc_context, e)
            return pb.GenerateResponse()
        try:
            async for out in outputs(self, r, stream=False):
                if isinstance(out, Failure):
                    return self._fail(grpc_context, r, out)
                return out.response(r.client_id, r.mode)
        finally:
            self.close(r)

    async def GenerateStream(self, request: pb.GenerateRequest, grpc_context=None):
        try:
            r = await self.open(request, grpc_caller(grpc_context))
        except Refused as e:  # Serve sends the status set on the context when a stream raises
            set_grpc_status(grpc_context, e)
            raise RequestRefused(e.message) from None
        try:
            async for out in outputs(self, r, stream=True):
                if isinstance(out, Failure):
                    self._fail(grpc_context, r, out)
                    raise RequestRefused(out.message)
                yield out.chunk(r.client_id, r.mode)
        finally:
            self.close(r)

    async def Health(self, request: pb.HealthRequest, grpc_context=None) -> pb.HealthResponse:
        """Open to every caller (load balancers probe it); false while draining or with a dead step loop."""
        return pb.HealthResponse(**self.health())

    async def ListModels(self, request: pb.ListModelsRequest, grpc_context=None) -> pb.ListModelsResponse:
        try:
            self.authorize(grpc_caller(grpc_context), "models")
        except Refused as e:
            set_grpc_status(grpc_context, e)
            return pb.ListModelsResponse()
        models = [pb.ModelInfo(role="target", name=self.cfg.target, vocab_size=self.vocab_size,
                               max_position=self.max_position, served_as=self.model_id, modes=self.modes(),
                               default_mode=self.orch.default_decode.mode)]
        if self.draft is not None:
            models.append(pb.ModelInfo(role="draft", name=self.cfg.draft, vocab_size=self.vocab_size,
                                       max_position=self.max_position))
        return pb.ListModelsResponse(models=models, modes=self.modes(), default_mode=self.orch.default_decode.mode)

    async def Cancel(self, request: pb.CancelRequest, grpc_context=None) -> pb.CancelResponse:
        """Free the caller's request ``request_id`` now (the SDK sends this when it abandons a stream)."""
        caller = grpc_caller(grpc_context)
        try:
            self.authorize(caller, "cancel")
        except Refused as e:
            set_grpc_status(grpc_context, e)
            return pb.CancelResponse()
        return pb.CancelResponse(cancelled=self.cancel(request.request_id, caller))

    # ---- calls a multi-model front forwards (serve_app.ingress.multi_model) ----------------------

    async def forwarded(self, method: str, request, metadata: tuple) -> tuple:
        """Generate, ListModels, Health or Cancel as the front received it (``metadata``: the caller's gRPC
        metadata): (reply, status code or None, details)."""
        if method not in FORWARDED:
            raise ValueError(f"not a forwarded method: {method}")
        ctx = ForwardedContext(metadata)
        reply = await getattr(self, method)(request, ctx)
        return reply, ctx.code, ctx.details

    async def forwarded_stream(self, request: pb.GenerateRequest, metadata: tuple):
        """GenerateStream as the front received it: its chunks, then a (status code, details) pair if the
        stream ends refused or failed."""
        ctx = ForwardedContext(metadata)
        try:
            async for chunk in self.GenerateStream(request, ctx):
                yield chunk
        except RequestRefused:
            yield ctx.code, ctx.details

    async def edge_relayed(self, session: str, message: pb.CollaborateRequest | None, metadata: tuple,
                           first: bool = False, replica: str | None = None) -> tuple:
        """One client message of a Collaborate stream a multi-model front relays (None: the client closed its
        side; ``first``: the stream's first; serve_app.ingress.edge_relay), run on the replica holding the
        session (``replica``, read by Serve's request router): (this replica's id, what the message produced)."""
        from ray import serve

        from serve_app.ingress.edge_relay import EdgeSessions

        if getattr(self, "edge_sessions", None) is None:
            self.edge_sessions = EdgeSessions(self, keep_s=self.cfg.edge_round_timeout_s)
        relayed = await self.edge_sessions.relay(session, message, metadata, first)
        return serve.get_replica_context().replica_id.unique_id, relayed

    async def http_forwarded(self, method: str, path: str, headers: list, body: bytes):
        """An HTTP request as the multi-model front received it, its body read: the response's (status,
        headers) first, then its body in parts as this router sends them (each SSE event as it comes)."""
        from starlette.responses import StreamingResponse

        from serve_app.ingress.multi_model_http import replayed

        response = await self.__call__(replayed(method, path, headers, body))
        yield response.status_code, list(response.raw_headers)
        if not isinstance(response, StreamingResponse):
            yield response.body
            return
        try:
            async for part in response.body_iterator:
                yield part if isinstance(part, bytes) else part.encode()
        finally:  # the front cancelled (its client went away): the stream frees its requests now, not at GC
            aclose = getattr(response.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()

    # ---- the OpenAI-compatible HTTP front-end (Serve's HTTP proxy calls this) ---------------------

    async def __call__(self, request):
        if not self.cfg.http_port:
            return openai_http.off()
        return await openai_http.handle(self, request)

    async def Collaborate(self, request_stream, grpc_context=None):
        """Edge drafting (calid.v1 Collaborate): the client drafts, this router filters and verifies."""
        async for reply in collaborate(self, request_stream, grpc_context):
            yield reply

    def _fail(self, grpc_context, r, failure: Failure):
        set_grpc_status(grpc_context, self.refuse(r.mode, failure.code, failure.message, r.frontend))
        return pb.GenerateResponse(request_id=r.client_id)
