"""Where each model runs: AlpaServe's placement search, and the two placements it is compared with.

Terms:
  attainment  the share of requests that meet their model's SLO (end-to-end latency within a scale of the
              request alone, LatencySlo; or TTFT and TPOT, calid.placement.traffic.Slo), over all requests of the
              workload, as the simulator predicts it
  partition   the device pool cut into groups of one size, each with one parallel config
  greedy      (AlpaServe, Algorithm 1) start with every group empty; repeatedly add the one model replica
              (a model onto a group whose devices still have the memory for it) that raises the simulated
              attainment most; stop when none fits or two rounds in a row raised nothing; keep the best
  alpaserve   (AlpaServe, Algorithm 2) the best greedy result over every partition into equal groups of
              1, 2, 4, ... devices and every config of that size the models support
  replication whole models without model parallelism: groups of one device (tp1xpp1), replicas chosen
              by the same greedy search (AlpaServe's "selective replication" baseline)
  dedicated   devices dedicated to each model: what it needs, plus a share of the rest by its load (its
              requests' seconds alone), run as replicas of the config that serves its own traffic best

Candidates that are the same move (the same model onto groups with the same config and models) are
simulated once, and only models that miss some SLO get candidates, which keeps the search's cost near
(models short of their SLO x distinct groups) simulations a round.
"""
from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass, field

from calid.placement.traffic import Slo
from calid.placement.profile import Config, ModelProfile
from calid.placement.simulator import DEFAULT_MAX_BATCH, Group, Placement, simulate
from calid.placement.workload import Request


@dataclass(frozen=True)
class LatencySlo:
    """AlpaServe's SLO: a request's end-to-end latency at most ``scale`` times what it takes alone on one
    device (its prefill plus its output tokens at batch 1, by the model's smallest config)."""

    scale: float
    profile: ModelProfile
    _limits: dict = field(default_factory=dict, repr=False, compare=False)  # (prompt, output) -> seconds

    def met(self, r: Request, o) -> bool:
        if o.error is not None or o.last_s is None or o.tokens < r.output_tokens:
            return False
        key = (r.prompt_tokens, r.output_tokens)
        limit = self._limits.get(key)
        if limit is None:  # a search scores each request thousands of times
            limit = self._limits[key] = self.scale * self.profile.alone_latency_s(*key)
        return o.last_s - o.sent_s <= limit


def _met(slo, r: Request, o) -> bool:
    """A TTFT/TPOT Slo judges the outcome alone; a LatencySlo needs the request's lengths too."""
    return slo.met(o) if isinstance(slo, Slo) else slo.met(r, o)


@dataclass(frozen=True)
class Problem:
    profiles: dict[str, ModelProfile]
    devices: int
    device_memory: float  # bytes per device
    requests: list[Request]
    slos: dict[str, Slo | LatencySlo]
    max_batch: int = DEFAULT_MAX_BATCH
    overlap: bool = False  # the simulator's what-if of pipelined steps of one model overlapping
    corun: float = 1.0  # a device's step time with every other device busy / alone (simulator.simulate)
    # the simulated parts of placements (_Scorer), shared by every planner of this problem
    simulated: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        missing = {r.model for r in self.requests} - set(self.profiles)
        if missing:
            raise ValueError(f"requests for models with no profile: {', '.join(sorted(missing))}")
        if self.devices < 1:
            raise ValueError(f"devices must be >= 1, got {self.devices}")


@dataclass
class Plan:
    name: str
    placement: Placement
    attainment: float
    per_model: dict[str, float]
    simulations: int = 0
    seconds: float = 0.0
    tried: list[tuple[str, float]] = field(default_factory=list)  # (partition, its attainment)


def attainment(problem: Problem, placement: Placement) -> tuple[float, dict[str, float]]:
    """The simulator's prediction for ``placement``: overall and per model."""
    return attainment_of(problem, simulate(placement, problem.profiles, problem.requests, problem.max_batch,
                                           problem.overlap, problem.corun))


def attainment_of(problem: Problem, outcomes: list) -> tuple[float, dict[str, float]]:
    """Attainment of ``outcomes`` (one per request of the problem, simulated or measured live)."""
    met: dict[str, list[bool]] = {m: [] for m in problem.profiles}
    for r, o in zip(problem.requests, outcomes):
        met[r.model].append(_met(problem.slos[r.model], r, o))
    per_model = {m: sum(v) / len(v) for m, v in met.items() if v}
    total = sum(len(v) for v in met.values())
    return (sum(sum(v) for v in met.values()) / total if total else 1.0), per_model


class _Scorer:
    """Simulates placements, counting how many, one connected part at a time.

    Groups that share no model (directly or through other groups) never touch each other's requests, so a
    placement's outcomes are those of its parts simulated apart (the same events in the same order), and a
    search that grows one group re-simulates only the part that group is in: the others come from a cache (the
    problem's, so that every planner of it shares it). ``many`` scores a search round's candidates, the parts
    none has simulated yet spread over this machine's cores. With ``corun`` > 1 every busy device slows the
    others, and whole placements are simulated."""

    def __init__(self, problem: Problem):
        self.problem, self.count = problem, 0
        self._parts: dict[tuple[Group, ...], tuple] = problem.simulated  # a part's groups -> (ids, outcomes)
        self._of_model: dict[str, list[int]] = {}  # a model's requests, by index
        for i, r in enumerate(problem.requests):
            self._of_model.setdefault(r.model, []).append(i)

    def __call__(self, placement: Placement) -> tuple[float, dict[str, float]]:
        return self.many([placement])[0]

    def many(self, placements: list[Placement]) -> list[tuple[float, dict[str, float]]]:
        self.count += len(placements)
        p = self.problem
        if p.corun != 1.0:
            return [attainment(p, placement) for placement in placements]
        split = [_parts(placement) for placement in placements]
        new = list(dict.fromkeys(part for parts in split for part in parts if part not in self._parts))
        ids = [self._ids(part) for part in new]
        for part, i, outcomes in zip(new, ids, _simulate_parts(p, new, ids)):
            self._parts[part] = (i, outcomes)
        return [self._score(parts) for parts in split]

    def _ids(self, part: tuple[Group, ...]) -> list[int]:
        return sorted(i for m in {m for g in part for m in g.models} for i in self._of_model.get(m, ()))

    def _score(self, parts: list[tuple[Group, ...]]) -> tuple[float, dict[str, float]]:
        p = self.problem
        outcomes: list = [None] * len(p.requests)
        hosted = set()
        for part in parts:
            hosted |= {m for g in part for m in g.models}
            for i, o in zip(*self._parts[part]):
                outcomes[i] = o
        left = sorted(i for m in set(self._of_model) - hosted for i in self._of_model[m])
        for i, o in zip(left, simulate(Placement(()), p.profiles, [p.requests[i] for i in left])):
            outcomes[i] = o  # no group hosts its model: an error
        return attainment_of(p, outcomes)


PARALLEL_PARTS = 8  # fewer new parts than this are simulated in this process (a worker's start costs more)
_worker_problem: Problem | None = None


def _simulate_parts(problem: Problem, parts: list[tuple[Group, ...]], ids: list[list[int]]) -> list[list]:
    """Each part's outcomes (its requests: ``ids``), over the machine's cores when there are enough."""
    workers = min(len(parts) // (PARALLEL_PARTS // 2), len(os.sched_getaffinity(0)))
    jobs = list(zip(parts, ids))
    if workers < 2:
        return [_simulate_part(problem, part, i) for part, i in jobs]
    global _worker_problem
    _worker_problem = problem  # the forked workers find it here, instead of receiving it with every job
    try:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            return list(pool.map(_simulate_job, jobs, chunksize=max(1, len(jobs) // (4 * workers))))
    finally:
        _worker_problem = None


def _simulate_job(job: tuple) -> list:
    return _simulate_part(_worker_problem, *job)


def _simulate_part(problem: Problem, part: tuple[Group, ...], ids: list[int]) -> list:
    return simulate(Placement(part), problem.profiles, [problem.requests[i] for i in ids], problem.max_batch,
                    problem.overlap, problem.corun)


def _parts(placement: Placement) -> list[tuple[Group, ...]]:
    """The groups of ``placement`` that host something, in connected parts (groups linked by a model they
    share), each part's groups in the placement's order."""
    groups = [g for g in placement.groups if g.models]
    part = list(range(len(groups)))  # union-find over the groups

    def root(i: int) -> int:
        while part[i] != i:
            part[i] = part[part[i]]
            i = part[i]
        return i

    first: dict[str, int] = {}
    for i, g in enumerate(groups):
        for m in g.models:
            if m in first:
                part[root(i)] = root(first[m])
            else:
                first[m] = i
    out: dict[int, list[Group]] = {}
    for i, g in enumerate(groups):
        out.setdefault(root(i), []).append(g)
    return [tuple(gs) for gs in out.values()]


def unplaced(problem: Problem, placement: Placement) -> list[str]:
    """The models the problem serves that no group of ``placement`` hosts."""
    hosted = {m for g in placement.groups for m in g.models}
    return sorted(m for m in problem.profiles if m not in hosted)


def _rank(problem: Problem, placement: Placement, attainment: float) -> tuple[bool, float]:
    """Placements that host every model first, then by attainment."""
    return not unplaced(problem, placement), attainment


def greedy(problem: Problem, groups: list[Group], score: Callable,
           patience: int = 2) -> tuple[Placement, float, dict[str, float]]:
    """AlpaServe's greedy search, made to host every model (see ``_greedy``): the better-ranked of a search
    that places each model first and AlpaServe's own search with the models it left out placed on top of
    its result (placing first is myopic: on this machine's live case it found 0.46 where the other found
    0.56)."""
    first = _greedy(problem, groups, score, patience, seed=True)
    plain = _greedy(problem, groups, score, patience, seed=False)
    if unplaced(problem, plain[0]):
        plain = _greedy(problem, list(plain[0].groups), score, patience, seed=True)
    return max((first, plain), key=lambda b: _rank(problem, b[0], b[1]))


def _greedy(problem: Problem, groups: list[Group], score: Callable, patience: int,
            seed: bool) -> tuple[Placement, float, dict[str, float]]:
    """AlpaServe's greedy model selection on fixed ``groups`` (they may already host models): add the best
    replica each round while one fits; stop after ``patience`` rounds in a row without a better attainment
    (a replica that does not help at once can, with the next one); return the best placement seen.

    A served model must be reachable: AlpaServe's objective alone may leave one out when its few requests
    are not worth a replica's memory (and once the others' replicas fill the memory, nothing can bring it
    back). With ``seed`` the search first gives each model no group hosts a replica where one fits, the best
    such move each round; a placement that hosts every model ranks above any that does not."""
    placement = Placement(tuple(groups))
    current, per_model = score(placement)
    best = (placement, current, per_model)
    stale = 0
    while True:
        # first a replica of each model no group hosts yet, while one fits somewhere (the best such move each
        # round); then replicas of the models short of their SLO (one that meets it gains nothing from more)
        candidates = seeding = _grown(problem, placement, unplaced(problem, placement)) if seed else []
        if not seeding:
            if stale >= patience:
                break
            candidates = _grown(problem, placement,
                                sorted(m for m in problem.profiles if per_model.get(m, 1.0) < 1.0))
        if not candidates:
            break
        scores = score.many(candidates) if hasattr(score, "many") else [score(c) for c in candidates]
        (current, per_model), placement = max(zip(scores, candidates), key=lambda s: (s[0][0], -_used(problem, s[1])))
        if _rank(problem, placement, current) > _rank(problem, *best[:2]):
            best, stale = (placement, current, per_model), 0
        elif not seeding:
            stale += 1
    return best


def _grown(problem: Problem, placement: Placement, models: list[str]) -> list[Placement]:
    """Every placement one replica larger: one of ``models`` onto a group that lacks it and has the memory
    (groups alike, with the same models, are tried once)."""
    seen: set[tuple[Group, str]] = set()
    out: list[Placement] = []
    for i, g in enumerate(placement.groups):
        for m in models:
            if m in g.models or (g, m) in seen:
                continue
            seen.add((g, m))
            grown = g.with_model(m)
            if grown.fits(problem.profiles, problem.device_memory):
                out.append(placement.replaced(i, grown))
    return out


def _used(problem: Problem, placement: Placement) -> float:
    return sum(problem.profiles[m].memory_per_device(g.config) * g.config.devices
               for g in placement.groups for m in g.models)


def configs_of(problem: Problem, size: int) -> list[Config]:
    """The configs of ``size`` devices that some model supports."""
    return sorted({c for p in problem.profiles.values() for c in p.latency if c.devices == size})


def alpaserve(problem: Problem) -> Plan:
    score, start = _Scorer(problem), time.perf_counter()
    best: Plan | None = None
    tried = []
    size = 1
    while size <= problem.devices:
        for cfg in configs_of(problem, size):
            groups = [Group(cfg) for _ in range(problem.devices // size)]
            placement, att, pm = greedy(problem, groups, score)
            tried.append((f"{problem.devices // size} x {cfg}", att))
            if best is None or _rank(problem, placement, att) > _rank(problem, best.placement, best.attainment):
                best = Plan("alpaserve", placement, att, pm)
        size *= 2
    if best is None:
        raise ValueError("no parallel config in the profiles fits the device pool")
    best.simulations, best.seconds, best.tried = score.count, time.perf_counter() - start, tried
    return best


def replication(problem: Problem) -> Plan:
    score, start = _Scorer(problem), time.perf_counter()
    placement, att, pm = greedy(problem, [Group(Config(1, 1)) for _ in range(problem.devices)], score)
    return Plan("replication", placement, att, pm, score.count, time.perf_counter() - start)


def _min_devices(problem: Problem, p: ModelProfile) -> int:
    fitting = [c.devices for c in p.latency if p.memory_per_device(c) <= problem.device_memory]
    if not fitting:
        raise ValueError(f"{p.name} fits no config's devices ({problem.device_memory / 2**30:.1f} GiB each)")
    return min(fitting)


def _apportion(total: int, need: dict[str, int], weight: dict[str, float]) -> dict[str, int]:
    """``total`` devices: each model its ``need``, the rest by ``weight`` (largest remainders)."""
    spare = total - sum(need.values())
    whole = sum(weight.values()) or 1.0
    exact = {m: spare * weight[m] / whole for m in need}
    out = {m: need[m] + int(exact[m]) for m in need}
    for m in sorted(need, key=lambda m: (int(exact[m]) - exact[m], m))[:total - sum(out.values())]:
        out[m] += 1
    return out


def dedicated(problem: Problem) -> Plan:
    score, start = _Scorer(problem), time.perf_counter()
    profiles = problem.profiles
    load = {m: 0.0 for m in profiles}
    for r in problem.requests:
        load[r.model] += profiles[r.model].alone_latency_s(r.prompt_tokens, r.output_tokens)
    need = {m: _min_devices(problem, profiles[m]) for m in profiles}
    if sum(need.values()) > problem.devices:
        raise ValueError(f"one group per model needs {sum(need.values())} devices, the pool has {problem.devices}")
    groups = []
    for m, size in sorted(_apportion(problem.devices, need, load).items()):
        alone = Problem({m: profiles[m]}, size, problem.device_memory,
                        [r for r in problem.requests if r.model == m], {m: problem.slos[m]}, problem.max_batch)
        options = [c for c in profiles[m].latency if c.devices <= size
                   and profiles[m].memory_per_device(c) <= problem.device_memory]
        best_cfg = max(options, key=lambda c: (attainment(alone, Placement(
            tuple(Group(c, (m,)) for _ in range(size // c.devices))))[0], -c.devices))
        groups += [Group(best_cfg, (m,)) for _ in range(size // best_cfg.devices)]
    placement = Placement(tuple(groups))
    att, pm = score(placement)
    return Plan("dedicated", placement, att, pm, score.count, time.perf_counter() - start)


PLANNERS = {"alpaserve": alpaserve, "replication": replication, "dedicated": dedicated}
