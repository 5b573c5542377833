"""The client side of collaborative edge drafting (calid.v1 Collaborate): the draft runs here.

``LocalDraft`` loads the draft model once per client, on the fastest CPU backend the machine has
(llama.cpp for a GGUF preset; calid.backends decides) and is shared by the client's calls, one
draft forward at a time. ``EdgeSession`` is one request's side of the protocol, transport-free:
the sync and asyncio clients move its messages.
"""
from __future__ import annotations

import logging
import threading
import time

from calid.v1 import calid_pb2 as pb

log = logging.getLogger("calid.client")


class LocalDraft:
    """``spec``: a model spec (preset, .gguf, folder) or ``self:N`` (the first N layers of the server's
    target, which the client then loads itself). Loaded at the first call."""

    def __init__(self, spec: str, threads: int | None = None, drafter=None):
        self.spec, self.threads = spec, threads
        self._drafter = drafter  # an EdgeDrafter already loaded (tests, benchmarks)
        self._lock = threading.Lock()  # one forward at a time: a runner is not thread-safe
        self.draft_s = 0.0  # seconds spent drafting so far, all calls together

    @property
    def needs_target_name(self) -> bool:
        """Loading still needs the server's target name (a self:N draft not loaded yet)."""
        return self._drafter is None and self.spec.startswith("self:")

    def drafter(self, target_name: str | None = None):
        with self._lock:
            if self._drafter is None:
                from calid.backends import open_draft
                from calid.edge import EdgeDrafter

                model = open_draft(self.spec, target_name or self.spec, threads=self.threads, log=log.info)
                self._drafter = EdgeDrafter(model.runner, model.eos_ids)
                log.info("calid: local draft %s", model.describe())
            return self._drafter

    def draft(self, drafter, *args, **kw):
        with self._lock:
            start = time.perf_counter()
            try:
                return drafter.draft(*args, **kw)
            finally:
                self.draft_s += time.perf_counter() - start

    def release(self, drafter, request_id: str) -> None:
        with self._lock:
            drafter.release(request_id)


class EdgeSession:
    """One request's side of Collaborate: ``opening()`` first, then ``advance(reply)`` for every reply
    gives the next message (None after the last reply) and ``chunk(reply)`` what to show the caller."""

    def __init__(self, local: LocalDraft, drafter, msg: pb.GenerateRequest):
        from calid.decoding.sampling import Warp, make_generator

        self.local, self.drafter, self.msg = local, drafter, msg
        self.warp = Warp(msg.temperature if msg.HasField("temperature") else 0.0,
                         msg.top_k if msg.HasField("top_k") else 0, msg.top_p if msg.HasField("top_p") else 1.0)
        self.generator = make_generator(msg.seed if msg.HasField("seed") else None)
        self.ids: list[int] = []
        self.threshold = 0.0

    def opening(self) -> pb.CollaborateRequest:
        return pb.CollaborateRequest(open=self.msg)

    def advance(self, reply: pb.CollaborateReply) -> pb.CollaborateRequest | None:
        """Keep what the server committed (the rest of the last draft is rolled back by the next draft's
        prefix match) and draft the next round."""
        if reply.round == 0:
            self.ids, self.threshold = list(reply.prompt_ids), reply.threshold
        self.ids += reply.token_ids
        if reply.finish_reason:
            return None
        d = self.local.draft(self.drafter, self.msg.request_id, self.ids, mode=self.msg.mode,
                             max_draft=reply.max_draft, threshold=self.threshold, warp_params=self.warp,
                             generator=self.generator)
        out = pb.DraftRound(round=reply.round + 1, tokens=d.tokens)
        if self.msg.mode == "filter":
            out.confidence.extend(d.confidence)
        elif not self.warp.greedy:
            for ids, probs in d.rows:
                out.rows.add(ids=ids, probs=probs)
        return pb.CollaborateRequest(round=out)

    def close(self) -> None:
        try:
            self.local.release(self.drafter, self.msg.request_id)
        except Exception:  # freeing a local cache must not hide the call's own outcome
            log.exception("calid: freeing the local draft cache failed")
