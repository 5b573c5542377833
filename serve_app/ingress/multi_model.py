"""The front of a multi-model app (AppConfig.models): the one deployment Serve's gRPC and HTTP proxies call,
which hands each call to the router of the model it names (HTTP: serve_app.ingress.multi_model_http).

Every model is a whole single-model calid app inside the Serve application (its own router, draft and
target deployments: ``router-<name>``, ``draft-<name>``, ``target-<name>``), so queues, autoscaling, metrics
(Serve tags them by deployment) and failures stay per model: one model's overload fills its own queue and
is refused there, never another's. The front checks nothing itself but the model name; the model's router
authenticates and validates the call with the caller's metadata, and the status it sets is passed back.

    client --gRPC--> proxy --> router (this front) --handle--> router-<model> --> draft-<model>, target-<model>
"""
from __future__ import annotations

import asyncio
import uuid

import grpc
from ray import serve

from calid.placement.dispatch import least_loaded
from calid.v1 import calid_pb2 as pb
from serve_app.router.calls import RequestRefused
from serve_app.cluster.config import load_config
from serve_app.ingress.frontdoor import Refused, set_grpc_status

HEALTH_TIMEOUT_S = 5.0


def _metadata(grpc_context) -> tuple:
    """The caller's metadata as plain pairs (they cross a process boundary)."""
    if grpc_context is None:
        return ()
    return tuple((str(k), v if isinstance(v, bytes) else str(v)) for k, v in grpc_context.invocation_metadata())


@serve.deployment(name="router", max_ongoing_requests=4096)
class ModelFront:
    def __init__(self, config, routers: dict, cores: dict):
        """``routers``: served name -> its routers, one per group of its placement; ``cores``: the same shape,
        each group's cores."""
        self.cfg = load_config(config)
        self.routers = [r for group in routers.values() for r in group]  # every router once
        # served id -> its routers' indexes (one per group of its placement), in the config's order
        sizes = [len(group) for group in routers.values()]
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        self.models = {name: list(range(a, a + n)) for name, a, n in zip(routers, starts, sizes)}
        self.default = next(iter(routers))
        self.in_flight = [0] * len(self.routers)  # calls (gRPC and HTTP) at each router now
        self._cores = [frozenset(group) for name in routers for group in cores[name]]  # each router's, in order

    def _router(self, model: str, grpc_context) -> int | None:
        """The named model's router whose cores have the fewest calls in flight over every model on them
        (calid.placement.dispatch; empty name: the first model), by its index; None, with NOT_FOUND set on
        the context, for a model not served here."""
        group = self.models.get(model or self.default)
        if group is None:
            set_grpc_status(grpc_context, Refused(grpc.StatusCode.NOT_FOUND, self._unknown(model)))
            return None
        return least_loaded(group, self.in_flight, self._cores)

    def pick(self, model: str) -> int:
        """As _router for an HTTP request: the router's index, or a 404 naming the served models."""
        from serve_app.ingress.openai_wire import WireError

        i = self._router(model, None)
        if i is None:
            raise WireError(404, self._unknown(model), "model")
        return i

    def _unknown(self, model: str) -> str:
        return f"model {model!r} is not served here (served: {', '.join(self.models)})"

    async def _forward(self, router, method: str, request, grpc_context, empty):
        reply, code, details = await router.forwarded.remote(method, request, _metadata(grpc_context))
        if code is not None:
            set_grpc_status(grpc_context, Refused(code, details))
            return empty
        return reply

    # ---- gRPC methods -------------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, grpc_context=None) -> pb.GenerateResponse:
        i = self._router(request.model, grpc_context)
        if i is None:
            return pb.GenerateResponse()
        self.in_flight[i] += 1
        try:
            return await self._forward(self.routers[i], "Generate", request, grpc_context, pb.GenerateResponse())
        finally:
            self.in_flight[i] -= 1

    async def GenerateStream(self, request: pb.GenerateRequest, grpc_context=None):
        i = self._router(request.model, grpc_context)
        if i is None:
            raise RequestRefused(f"model {request.model!r} is not served here")
        self.in_flight[i] += 1
        try:
            stream = self.routers[i].options(stream=True).forwarded_stream.remote(request, _metadata(grpc_context))
            async for item in stream:
                if isinstance(item, tuple):  # the stream ended refused or failed: (code, details)
                    set_grpc_status(grpc_context, Refused(*item))
                    raise RequestRefused(item[1])
                yield item
        finally:
            self.in_flight[i] -= 1

    async def ListModels(self, request: pb.ListModelsRequest, grpc_context=None) -> pb.ListModelsResponse:
        """Every model's target (served_as: the name requests use) and draft, the first model's modes at the
        top (the model a request without a name gets)."""
        replies = await asyncio.gather(*[self._forward(self.routers[group[0]], "ListModels", request, grpc_context,
                                                       None) for group in self.models.values()])
        if any(r is None for r in replies):  # refused (e.g. no API key): the status is set
            return pb.ListModelsResponse()
        return pb.ListModelsResponse(models=[m for r in replies for m in r.models], modes=replies[0].modes,
                                     default_mode=replies[0].default_mode)

    async def Health(self, request: pb.HealthRequest, grpc_context=None) -> pb.HealthResponse:
        """Serving while every model's router is; requests and capacity summed over the models."""
        async def one(router):
            try:
                reply, _, _ = await asyncio.wait_for(router.forwarded.remote("Health", request, ()), HEALTH_TIMEOUT_S)
                return reply
            except Exception:  # a router that cannot answer is not serving
                return pb.HealthResponse(serving=False)

        replies = await asyncio.gather(*[one(r) for r in self.routers])
        return pb.HealthResponse(serving=all(r.serving for r in replies),
                                 active_requests=sum(r.active_requests for r in replies),
                                 queued_requests=sum(r.queued_requests for r in replies),
                                 queue_capacity=sum(r.queue_capacity for r in replies))

    async def Cancel(self, request: pb.CancelRequest, grpc_context=None) -> pb.CancelResponse:
        """The request id is the client's: ask every model's router (only the owner's request is freed)."""
        replies = await asyncio.gather(*[self._forward(r, "Cancel", request, grpc_context, None)
                                         for r in self.routers])
        return pb.CancelResponse(cancelled=any(r is not None and r.cancelled for r in replies))

    async def Collaborate(self, request_stream, grpc_context=None):
        """Edge drafting on the model the open message names: each client message is relayed to that model's
        router in a call of its own, every call after the first pinned to the replica holding the session
        (serve_app.ingress.edge_relay)."""
        message = await anext(request_stream, None)
        if message is None:
            return
        model = message.open.model if message.WhichOneof("kind") == "open" else ""  # else the router refuses it
        i = self._router(model, grpc_context)
        if i is None:
            raise RequestRefused(self._unknown(model))
        router, session, replica, ended = self.routers[i], uuid.uuid4().hex, None, False
        metadata = _metadata(grpc_context)
        self.in_flight[i] += 1
        try:
            while True:
                replica, out = await router.edge_relayed.remote(session, message, metadata, first=replica is None,
                                                                replica=replica)
                for reply in out.replies:
                    yield reply
                if out.ended:
                    ended = True
                    if out.code is not None:
                        set_grpc_status(grpc_context, Refused(out.code, out.details))
                        raise RequestRefused(out.details)
                    return
                message = await anext(request_stream, None)  # None: the client closed its side
        finally:
            self.in_flight[i] -= 1
            if not ended:  # the client went away: the session ends now, not at its round timeout
                router.edge_relayed.remote(session, None, metadata, replica=replica)

    # ---- what serve_app.cluster.serve_commands and the tests ask of "router" --------------------------------

    async def __call__(self, request):
        """The OpenAI HTTP API of every model (serve_app.ingress.multi_model_http)."""
        from serve_app.ingress import multi_model_http, openai_http

        if not self.cfg.http_port:
            return openai_http.off()
        return await multi_model_http.handle(self, request)

    async def stats(self) -> dict:
        """Every router's stats, and the request count summed (serve_app.cluster.serve_commands.drain polls it)."""
        per = await asyncio.gather(*[r.stats.remote() for r in self.routers])
        return {"requests": sum(s["requests"] for s in per), "routers": per}

    async def drain(self, grace_s: float | None = None) -> dict:
        per = await asyncio.gather(*[r.drain.remote(grace_s) for r in self.routers])
        return {"requests": sum(d["requests"] for d in per)}
