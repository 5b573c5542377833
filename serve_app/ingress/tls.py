"""TLS for the gRPC API: a small front that terminates TLS and forwards to Serve's plaintext proxy.

Ray Serve 2.60's gRPC proxy listens without TLS (it has no certificate
options), so ``calid serve --tls-cert ... --tls-key ...`` puts this front on the
public port and moves Serve's proxy to a loopback port behind it. Every
calid.v1.Calid method is forwarded as raw bytes, with the caller's metadata
(application, authorization, request_id), deadline, status and cancellation.
On a cluster, terminate TLS in the load balancer in front of the head node
instead (docs/serving.md: Security).
"""
from __future__ import annotations

import asyncio
import threading

import grpc

from calid.v1 import calid_pb2 as pb

SERVICE = "calid.v1.Calid"


def _metadata(context) -> tuple:
    return tuple((k, v) for k, v in context.invocation_metadata() if not k.startswith((":", "grpc-")))


class TlsFront:
    def __init__(self, listen: str, upstream: str, cert_file: str, key_file: str):
        with open(cert_file, "rb") as c, open(key_file, "rb") as k:
            self._creds = grpc.ssl_server_credentials([(k.read(), c.read())])
        self.listen, self.upstream = listen, upstream
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="calid-tls-front", daemon=True)
        self._server = None
        self._channel = None

    def start(self) -> int:
        """Start serving in a background thread; returns the bound port."""
        self._thread.start()
        return asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)

    def stop(self, grace_s: float = 1.0) -> None:
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._stop(grace_s), self._loop).result(grace_s + 10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _start(self) -> int:
        self._channel = grpc.aio.insecure_channel(self.upstream)
        self._server = grpc.aio.server()
        handlers = {}
        for m in pb.DESCRIPTOR.services_by_name["Calid"].methods:
            path = f"/{SERVICE}/{m.name}"
            if m.client_streaming and m.server_streaming:
                handlers[m.name] = grpc.stream_stream_rpc_method_handler(
                    self._streaming(self._channel.stream_stream(path)))
            elif m.server_streaming:
                handlers[m.name] = grpc.unary_stream_rpc_method_handler(
                    self._streaming(self._channel.unary_stream(path)))
            else:
                handlers[m.name] = grpc.unary_unary_rpc_method_handler(self._unary(path))
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        port = self._server.add_secure_port(self.listen, self._creds)
        await self._server.start()
        return port

    async def _stop(self, grace_s: float) -> None:
        await self._server.stop(grace_s)
        await self._channel.close()

    def _unary(self, path: str):
        async def forward(request: bytes, context):
            call = self._channel.unary_unary(path)(request, metadata=_metadata(context),
                                                   timeout=context.time_remaining())
            try:
                return await call
            except grpc.aio.AioRpcError as e:
                await context.abort(e.code(), e.details() or "")

        return forward

    def _streaming(self, multicallable):
        """Forward a call with a stream of responses (a request or a stream of them in: the client's
        request iterator is handed upstream as it is)."""
        async def forward(request, context):
            call = multicallable(request, metadata=_metadata(context), timeout=context.time_remaining())
            try:
                async for message in call:
                    yield message
            except grpc.aio.AioRpcError as e:
                await context.abort(e.code(), e.details() or "")
            finally:
                call.cancel()  # the client went away: so does the upstream call, and the request with it

        return forward
