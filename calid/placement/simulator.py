"""A discrete-event simulator of models served on groups of devices, as calid serves them.

Terms:
  group       devices running one parallel config (calid.placement.profile.Config) and hosting one or more
              models (each split over all of the group's devices, as AlpaServe multiplexes them)
  placement   the groups; a model on several groups has that many replicas
  dispatch    a request goes, on arrival, to the group hosting its model with the fewest requests waiting or
              running there over all its models, then with the fewest of its model's (calid.placement.dispatch:
              the multi-model front does the same live)
  step        calid batches each model's running requests into one forward per step (continuous batching):
              requests waiting join at the next step (up to max_batch running), their prompts' prefill is
              part of that step, and each running request gets one token when the step leaves the last stage
  pipeline    a group's pp stages each run one micro-batch at a time. As calid's pipelined forward does, a
              step of b requests is cut into min(pp, b) micro-batches that follow each other through the
              stages, each holding a stage stage_s(b / micro-batches) long; the first stage is free again
              once the last micro-batch has left it, so another model's step can follow while this one
              drains; one model's steps run one after another (the next token needs the last)
  turn        when the first stage is free, the model that has waited longest for a step (a request arrived
              or its last step ended) goes next
  co-run      devices of one machine are not always independent: cores share memory bandwidth and caches,
              and a VM's vCPUs may share physical cores. ``corun`` is how much longer a device's step takes
              when every other device is busy too (measured by ``calid bench placement --profile``; 1.0 for
              independent devices such as GPUs); a step starting while a share f of the other devices is
              busy takes 1 + (corun - 1) x f times its profiled time

It returns one calid.placement.traffic.Outcome per request (arrival, first and last token), scored against the
SLO exactly as live runs are.
"""
from __future__ import annotations

import bisect
import heapq
from collections import deque
from dataclasses import dataclass

from calid.placement.traffic import Outcome
from calid.placement.profile import Config, ModelProfile
from calid.placement.workload import Request

DEFAULT_MAX_BATCH = 16


@dataclass(frozen=True)
class Group:
    config: Config
    models: tuple[str, ...] = ()

    def with_model(self, name: str) -> "Group":
        return Group(self.config, tuple(sorted(self.models + (name,))))

    def fits(self, profiles: dict[str, ModelProfile], device_memory: float) -> bool:
        """Every model supports the config and their shares fit each device's memory."""
        return (all(profiles[m].supports(self.config) for m in self.models)
                and sum(profiles[m].memory_per_device(self.config) for m in self.models) <= device_memory)

    def __str__(self) -> str:
        return f"{self.config}[{', '.join(self.models) or '-'}]"


@dataclass(frozen=True)
class Placement:
    groups: tuple[Group, ...]

    def replaced(self, i: int, group: Group) -> "Placement":
        return Placement(self.groups[:i] + (group,) + self.groups[i + 1:])

    def __str__(self) -> str:
        return " ".join(str(g) for g in self.groups)


class _Lane:
    """One model on one group: its waiting requests, and its running ones (idle: between steps)."""

    def __init__(self, name: str, steps: int):
        self.name = name
        self.waiting: deque[int] = deque()
        self.idle: list[int] = []
        self.running = 0  # admitted and not finished: idle or in a step
        self.in_flight = 0  # its steps in the pipeline
        self.steps = steps  # at most this many at once
        self.ready_since = 0.0

    def load(self) -> int:
        return len(self.waiting) + self.running

    def has_work(self) -> bool:
        return self.in_flight < self.steps and bool(self.waiting or self.idle)


class _GroupState:
    def __init__(self, group: Group, overlap: bool):
        self.config = group.config
        self.lanes = {m: _Lane(m, group.config.pp if overlap else 1) for m in group.models}
        self.stage_free = [0.0] * group.config.pp
        self.load = 0  # requests waiting or running
        self.wake_at: float | None = None  # a pending wake-up for the first stage


def simulate(placement: Placement, profiles: dict[str, ModelProfile], requests: list[Request],
             max_batch: int = DEFAULT_MAX_BATCH, overlap: bool = False, corun: float = 1.0) -> list[Outcome]:
    """Outcomes in the order of ``requests`` (which must be sorted by arrival); a request whose model no
    group hosts ends with an error.

    ``overlap``: a what-if, not what calid does: up to pp steps of one model in the pipeline at once, each
    over its own share of the running requests (vLLM's virtual engines), instead of one step cut into
    micro-batches. ``corun``: a device's step time with every other device busy, over its time alone."""
    if corun < 1.0:
        raise ValueError(f"corun is a slowdown (>= 1.0), got {corun}")
    return _Simulation(placement, profiles, requests, max_batch, overlap, corun).run()


STEP_DONE, WAKE = 1, 2  # the heap's event kinds (arrivals, kept apart, go first at the same instant)


class _Simulation:
    """One replay: an event heap of arrivals, finished steps and wake-ups over the placement's groups."""

    def __init__(self, placement: Placement, profiles: dict[str, ModelProfile], requests: list[Request],
                 max_batch: int, overlap: bool, corun: float):
        self.profiles, self.requests, self.max_batch, self.corun = profiles, requests, max_batch, corun
        self.groups = [_GroupState(g, overlap) for g in placement.groups]
        self.others = max(1, sum(g.config.devices for g in placement.groups) - 1)
        self.hosts: dict[str, list[int]] = {}
        for i, g in enumerate(placement.groups):
            for m in g.models:
                self.hosts.setdefault(m, []).append(i)
        self.outcomes = [Outcome(r.at_s, None, None, 0) for r in requests]
        self.done_tokens = [0] * len(requests)
        # each group's arrivals to come (of the models it hosts), so a lone steady batch can leap to the next
        self.arrivals = [sorted(r.at_s for r in requests if r.model in g.models) for g in placement.groups]
        self.jumps = corun == 1.0  # contention makes a step's length depend on the others' steps
        self._decode_s: dict = {}
        self.events: list[tuple[float, int, int, object]] = []  # (time, order, kind, payload)
        self.order = 0

    def run(self) -> list[Outcome]:
        requests, events, rid = self.requests, self.events, 0  # arrivals come in order, beside the heap
        while rid < len(requests) or events:
            if rid < len(requests) and (not events or requests[rid].at_s <= events[0][0]):
                self.arrive(rid, requests[rid].at_s)  # before any other event of the same instant
                rid += 1
                continue
            now, _, kind, payload = heapq.heappop(events)
            if kind == STEP_DONE:
                gi, name, batch, steps, first_end = payload
                self.step_done(gi, name, batch, now, steps, first_end)
            elif self.groups[payload].wake_at == now:  # else a stale wake-up: one for an earlier time served it
                self.groups[payload].wake_at = None
                self.start_steps(payload, now)
        return self.outcomes

    def push(self, t: float, kind: int, payload) -> None:
        self.order += 1
        heapq.heappush(self.events, (t, self.order, kind, payload))

    def stage_s(self, name: str, config: Config, batch: int, prefill_tokens: float) -> float:
        """The profile's stage time, its decode part looked up once per (model, config, batch)."""
        key = (name, config, batch)
        decode = self._decode_s.get(key)
        if decode is None:
            decode = self._decode_s[key] = self.profiles[name].stage_s(config, batch)
        if not prefill_tokens:
            return decode
        return decode + self.profiles[name].latency[config].prefill_s_per_token * prefill_tokens / config.pp

    def contention(self, gi: int, now: float) -> float:
        """How much longer group ``gi``'s step takes for the other devices busy at ``now``."""
        if self.corun == 1.0:
            return 1.0
        busy = sum(g.config.tp * sum(free > now for free in g.stage_free)
                   for j, g in enumerate(self.groups) if j != gi)
        return 1.0 + (self.corun - 1.0) * busy / self.others

    def arrive(self, rid: int, now: float) -> None:
        r = self.requests[rid]
        where = self.hosts.get(r.model)
        if not where:
            self.outcomes[rid].error = f"model {r.model} is not placed"
            return
        groups = self.groups
        gi = min(where, key=lambda i: (groups[i].load, groups[i].lanes[r.model].load(), i))  # as dispatch.py
        g = groups[gi]
        lane = g.lanes[r.model]
        if not lane.in_flight and not lane.waiting and not lane.running:
            lane.ready_since = now
        lane.waiting.append(rid)
        g.load += 1
        if g.wake_at is None or g.wake_at > now:  # after every arrival of this instant: they batch together
            g.wake_at = now
            self.push(now, WAKE, gi)

    def step_done(self, gi: int, name: str, batch: list[int], now: float, steps: int = 1,
                  first_end: float | None = None) -> None:
        """``steps`` steps of ``batch`` ended (a leap: see _leap), the first at ``first_end``."""
        g = self.groups[gi]
        lane = g.lanes[name]
        for rid in batch:
            o = self.outcomes[rid]
            self.done_tokens[rid] += steps
            o.tokens = self.done_tokens[rid]
            o.first_s = (now if first_end is None else first_end) if o.first_s is None else o.first_s
            o.last_s = now
            if self.done_tokens[rid] >= self.requests[rid].output_tokens:
                lane.running -= 1
                g.load -= 1
            else:
                lane.idle.append(rid)
        lane.in_flight -= 1
        lane.ready_since = now
        self.start_steps(gi, now)

    def start_steps(self, gi: int, now: float) -> None:
        g = self.groups[gi]
        while True:
            if g.stage_free[0] > now:
                if g.wake_at is None or g.wake_at > g.stage_free[0]:
                    g.wake_at = g.stage_free[0]
                    self.push(g.stage_free[0], WAKE, gi)
                return
            ready = [lane for lane in g.lanes.values() if lane.has_work()]
            if not ready:
                return
            lane = min(ready, key=lambda ln: (ln.ready_since, ln.name))
            batch, micro, joined = self._take_batch(g, lane)
            stage = self.stage_s(lane.name, g.config, -(-len(batch) // micro), joined / micro)
            stage *= self.contention(gi, now)
            leap = self._leap(g, gi, lane, batch, joined, stage, now)
            if leap > 1:
                g.stage_free[0] = last = now + leap * stage
                lane.in_flight += 1
                self.push(last, STEP_DONE, (gi, lane.name, batch, leap, now + stage))
                continue
            last = now
            for _ in range(micro):
                end = now
                for k in range(g.config.pp):
                    begin = max(end, g.stage_free[k])
                    end = begin + stage
                    g.stage_free[k] = end
                last = end
            lane.in_flight += 1
            self.push(last, STEP_DONE, (gi, lane.name, batch, 1, None))

    def _leap(self, g: _GroupState, gi: int, lane: _Lane, batch: list[int], joined: int, stage: float,
              now: float) -> int:
        """How many steps of ``batch`` to run as one event: a group on one stage whose only busy lane decodes
        (no prompt joining) repeats the same step until a request of the batch ends or a request for the
        group may arrive; those steps are simulated as one, with the same outcomes. 1: no leap."""
        if not self.jumps or g.config.pp != 1 or joined or lane.steps != 1 or lane.waiting or stage <= 0:
            return 1
        if any(other is not lane and other.has_work() for other in g.lanes.values()):
            return 1
        left = min(self.requests[r].output_tokens - self.done_tokens[r] for r in batch)
        arrivals = self.arrivals[gi]
        nxt = bisect.bisect_right(arrivals, now)
        if nxt < len(arrivals):
            left = min(left, int((arrivals[nxt] - now) / stage))
        return left

    def _take_batch(self, g, lane) -> tuple[list[int], int, int]:
        """Admit waiting requests up to max_batch; (the step's requests, micro-batches, prompt tokens joining)."""
        joined = 0
        while lane.waiting and lane.running < self.max_batch:
            rid = lane.waiting.popleft()
            lane.idle.append(rid)
            lane.running += 1
            joined += self.requests[rid].prompt_tokens
        if lane.steps == 1:  # one step of every running request, cut into micro-batches
            batch, lane.idle = lane.idle, []
            return batch, min(g.config.pp, len(batch)), joined
        take = -(-lane.running // lane.steps)  # this step takes its share of the running requests
        batch, lane.idle = lane.idle[:take], lane.idle[take:]
        return batch, 1, sum(self.requests[r].prompt_tokens for r in batch if self.done_tokens[r] == 0)
