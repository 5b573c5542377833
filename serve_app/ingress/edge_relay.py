"""Collaborate through a multi-model front: a client's bidirectional stream relayed as one call per message.

A Serve handle carries calls and server streams, not a client's stream. So the front
(serve_app.ingress.multi_model) passes each client message of a Collaborate stream to the model's router
in a call of its own, pinned to the router replica that opened the session
(serve_app.router.replica_routing); that replica runs the same ``collaborate`` as a direct call, fed from
a queue, and answers each call with the replies made until the session next waits for the client (or
ends). The session is soft state: it ends when the client closes its side (a ``None`` message), when a
round is late (``edge_round_timeout_s``, as on a direct call) or with its request; a replica that is gone
answers UNAVAILABLE.

    client --stream--> front --relay(message)--> router replica: EdgeSession --> collaborate(router, queue)
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc

from calid.v1 import calid_pb2 as pb
from serve_app.ingress.collaborate import collaborate
from serve_app.ingress.frontdoor import ForwardedContext
from serve_app.router.calls import RequestRefused

_WAITING, _ENDED = object(), object()  # on the outbox: the session waits for the client's next message; it ended


@dataclass
class Relayed:
    """What one relayed message produced: the replies, whether the session ended, and its status if it ended
    refused or failed."""

    replies: list[pb.CollaborateReply] = field(default_factory=list)
    ended: bool = False
    code: grpc.StatusCode | None = None
    details: str = ""


class EdgeSession:
    def __init__(self, router, metadata: tuple, forget):
        """``forget``: called once the session has ended (its end may still be asked for)."""
        self.context = ForwardedContext(metadata)
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._lock = asyncio.Lock()  # one relayed message at a time
        self._task = asyncio.create_task(self._run(router))
        self._task.add_done_callback(lambda _: forget())

    async def _uplink(self):
        while True:
            if self._inbox.empty():
                self._outbox.put_nowait(_WAITING)
            message = await self._inbox.get()
            if message is None:  # the client closed its side
                return
            yield message

    async def _run(self, router) -> None:
        try:
            async for reply in collaborate(router, self._uplink(), self.context):
                self._outbox.put_nowait(reply)
        except RequestRefused:
            pass  # the status is on the context
        except Exception as e:  # noqa: BLE001 - the front must hear of it, not wait
            self.context.set_code(grpc.StatusCode.INTERNAL)
            self.context.set_details(f"edge session failed: {type(e).__name__}: {e}")
        finally:
            self._outbox.put_nowait(_ENDED)

    async def relay(self, message: pb.CollaborateRequest | None) -> Relayed:
        async with self._lock:
            out = Relayed()
            if self._task.done() and self._outbox.empty():
                out.ended = True
            else:
                self._inbox.put_nowait(message)
                while True:
                    item = await self._outbox.get()
                    if item is _WAITING:
                        break
                    if item is _ENDED:
                        out.ended = True
                        break
                    out.replies.append(item)
            if out.ended:
                out.code, out.details = self.context.code, self.context.details
            return out


class EdgeSessions:
    """A router replica's relayed Collaborate sessions, by the front's session id. A session that ended is
    kept ``keep_s`` for the front to hear how, then dropped (a front that went away never asks)."""

    def __init__(self, router, keep_s: float):
        self._router = router
        self._keep_s = keep_s
        self._sessions: dict[str, EdgeSession] = {}

    async def relay(self, session: str, message: pb.CollaborateRequest | None, metadata: tuple,
                    first: bool) -> Relayed:
        """``first``: the stream's first message, which opens the session (collaborate checks it is an open)."""
        s = self._sessions.get(session)
        if s is None:
            if message is None:
                return Relayed(ended=True)
            if not first:  # the replica that held it is gone
                return Relayed(ended=True, code=grpc.StatusCode.UNAVAILABLE,
                               details="the router replica holding this Collaborate session is gone; open a new one")
            s = self._sessions[session] = EdgeSession(self._router, metadata, lambda: self._forget(session))
        out = await s.relay(message)
        if out.ended:
            self._sessions.pop(session, None)
        return out

    def _forget(self, session: str) -> None:
        asyncio.get_running_loop().call_later(self._keep_s, self._sessions.pop, session, None)

    def __len__(self) -> int:
        return len(self._sessions)
