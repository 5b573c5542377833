"""Prometheus metrics of the calid app (ray.serve.metrics), exported as ``ray_calid_*``.

Serve adds deployment/replica/application tags itself. The Grafana dashboard
in serve_app/cluster/grafana/calid_dashboard.json plots every series defined here.
"""
from __future__ import annotations

import logging
import threading
import time

from ray.serve import metrics as ray_metrics

from calid.generation import GenerationResult

LATENCY_MS = [5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000]
COUNTS = [1, 2, 4, 8, 16, 32, 64]
FLUSH_S = 0.25  # how often the recorder thread hands what the step loop noted to Ray

log = logging.getLogger(__name__)


class Recorder:
    """Metric updates noted on the step loop and handed to Ray by a thread of their own every FLUSH_S.

    A Ray metric's record releases the GIL for its C++ part and must take it back; in a Serve replica, where
    Ray's own threads want it too, that wait stalled the step loop: 0.2 s in 60 of one request's HumanEval
    answers (py-spy on the router replica, ``pthread_cond_timedwait`` under ``record``), beside ~0.6 s of all its
    other work between forwards. Noting an update is a dict or list write under an uncontended lock; the thread
    records them mostly while the loop waits in a forward (which releases the GIL anyway). Gauges keep their
    last value and counters their sum per tag set, as Ray would hold them; every histogram observation is kept.
    """

    def __init__(self, every_s: float = FLUSH_S, start: bool = True):
        self._lock = threading.Lock()
        self._gauges: dict[tuple, tuple] = {}  # (metric, tags) -> (metric, value, tags)
        self._counts: dict[tuple, list] = {}  # (metric, tags) -> [metric, sum, tags]
        self._observed: list[tuple] = []  # (metric, value, tags), in order
        self._every_s = every_s
        if start:
            threading.Thread(target=self._run, name="calid-metrics", daemon=True).start()

    def noted(self, metric) -> "_Noted":
        """``metric`` (a Ray Counter, Gauge or Histogram) with its setters noted here."""
        return _Noted(self, metric)

    def note(self, kind: str, metric, value: float, tags: dict | None) -> None:
        key = (id(metric), tuple(sorted(tags.items())) if tags else ())
        with self._lock:
            if kind == "set":
                self._gauges[key] = (metric, value, tags)
            elif kind == "inc":
                if key in self._counts:
                    self._counts[key][1] += value
                else:
                    self._counts[key] = [metric, value, tags]
            else:
                self._observed.append((metric, value, tags))

    def flush(self) -> None:
        """Record everything noted so far (in this thread)."""
        with self._lock:
            gauges, counts, observed = self._gauges, self._counts, self._observed
            self._gauges, self._counts, self._observed = {}, {}, []
        records = ([(m.set, v, t) for m, v, t in gauges.values()] + [(m.inc, v, t) for m, v, t in counts.values()]
                   + [(m.observe, v, t) for m, v, t in observed])
        for record, value, tags in records:
            try:
                record(value, tags=tags)
            except Exception as e:  # one bad update (a tag Ray refuses) must not lose the others or the thread
                log.warning("calid metrics: %s not recorded: %r", getattr(record, "__qualname__", record), e)

    def _run(self) -> None:
        while True:
            time.sleep(self._every_s)
            self.flush()


class _Noted:
    """A Ray metric's setters (set, inc, observe), noted by the Recorder instead of recorded on the spot."""

    def __init__(self, recorder: Recorder, metric):
        self._recorder, self.metric = recorder, metric

    def set(self, value: float, tags: dict | None = None) -> None:
        self._recorder.note("set", self.metric, value, tags)

    def inc(self, value: float = 1.0, tags: dict | None = None) -> None:
        self._recorder.note("inc", self.metric, value, tags)

    def observe(self, value: float, tags: dict | None = None) -> None:
        self._recorder.note("observe", self.metric, value, tags)


_recorder: Recorder | None = None
_recorder_lock = threading.Lock()


def recorder() -> Recorder:
    """This process's Recorder, its thread started on first use."""
    global _recorder
    with _recorder_lock:
        if _recorder is None:
            _recorder = Recorder()
        return _recorder


class _Deferred:
    """Ray metric constructors whose metrics this process's Recorder records."""

    def __init__(self):
        self._rec = recorder()

    def Counter(self, *args, **kwargs) -> _Noted:  # noqa: N802 (ray.serve.metrics' names)
        return self._rec.noted(ray_metrics.Counter(*args, **kwargs))

    def Gauge(self, *args, **kwargs) -> _Noted:  # noqa: N802
        return self._rec.noted(ray_metrics.Gauge(*args, **kwargs))

    def Histogram(self, *args, **kwargs) -> _Noted:  # noqa: N802
        return self._rec.noted(ray_metrics.Histogram(*args, **kwargs))


class RouterMetrics:
    def __init__(self):
        metrics = _Deferred()
        self.requests = metrics.Counter("calid_requests", "requests finished, by mode, outcome (gRPC code) and "
                                        "front-end (grpc, edge, http)", tag_keys=("mode", "code", "frontend"))
        self.tokens = metrics.Counter("calid_tokens", "output tokens by source (draft or target)",
                                      tag_keys=("mode", "source"))
        self.drafted = metrics.Counter("calid_drafted_tokens", "output tokens that came from a draft, by where it "
                                       "ran: edge (the client's own draft, Collaborate) or cluster",
                                       tag_keys=("where",))
        self.filtered_fraction = metrics.Gauge("calid_filtered_fraction",
                                               "output tokens from the draft / all output tokens (last 10 s)")
        self.acceptance = metrics.Histogram("calid_acceptance_length", "draft tokens accepted per verification",
                                            boundaries=[0.5, 1, 2, 3, 4, 6, 8, 12, 16], tag_keys=("mode",))
        self.queue_depth = metrics.Gauge("calid_queue_depth", "requests admitted and waiting for a decoding slot")
        self.active = metrics.Gauge("calid_active_requests", "requests decoding")
        self.forward_cost = metrics.Gauge("calid_forward_cost_ms", "the router's cost model (the auto planner's "
                                          "input): a target forward of <size> tokens, a draft step of <size> "
                                          "sequences; calibrated at start, refreshed from live timings; "
                                          "target_replica: the target replica it times (all: pooled)",
                                          tag_keys=("role", "size", "target_replica"))
        self.ttft = metrics.Histogram("calid_ttft_ms", "time to first token at the router",
                                      boundaries=LATENCY_MS, tag_keys=("mode",))
        self.tpot = metrics.Histogram("calid_tpot_ms", "time per output token after the first",
                                      boundaries=LATENCY_MS, tag_keys=("mode",))
        self.draft_lost = metrics.Counter("calid_draft_lost", "times the router could not reach the draft workers "
                                          "and went on without them (target-only steps until a draft answers)")
        self.draft_available = metrics.Gauge("calid_draft_available", "1 while the router drafts, 0 while its "
                                             "draft workers are unreachable and every step is target-only")
        self.filter_agreement = metrics.Gauge("calid_filter_agreement", "audited filter requests (every one with "
                                              "min_agreement, one in agreement_audit_every of the rest): share of "
                                              "their output tokens that equal the target's top-1 (since start)")
        self.draft_top1_match = metrics.Gauge("calid_draft_match_rate", "the agreement table (min_agreement's "
                                              "threshold choice): how often the draft's top-1 is the target's, "
                                              "calibration plus what the target has seen")
        self.slo = metrics.Counter("calid_slo_requests", "finished requests of a model with an SLO "
                                   "(slo_ttft_ms / slo_tpot_ms), by whether they met it: attainment = met=yes / all",
                                   tag_keys=("met",))
        self.escalation_batch = metrics.Histogram("calid_escalation_batch_size",
                                                  "requests per router step that needed the target",
                                                  boundaries=COUNTS)

    def finished(self, result: GenerationResult, mode: str, frontend: str = "grpc") -> None:
        tags = {"mode": mode}
        self.requests.inc(tags={"mode": mode, "code": "OK", "frontend": frontend})
        for source, n in (("draft", result.stats.draft_tokens), ("target", result.stats.target_tokens)):
            if n > 0:  # Counter.inc refuses 0
                self.tokens.inc(n, tags={"mode": mode, "source": source})
        if result.stats.verifications:
            self.acceptance.observe(result.stats.mean_accepted, tags=tags)
        self.ttft.observe(result.ttft_s * 1000, tags=tags)
        if len(result.output_ids) > 1:
            self.tpot.observe((result.total_s - result.ttft_s) * 1000 / (len(result.output_ids) - 1), tags=tags)

    def attainment(self, met: bool | None) -> None:
        if met is not None:
            self.slo.inc(tags={"met": "yes" if met else "no"})

    def costs(self, verify, draft, replicas: dict | None = None) -> None:
        """Export the cost model (calid.planning.CostTable of each role, and of each target replica) at a few
        sizes."""
        tables = [("target", "all", verify, (1, 4, 16, 64)), ("draft", "all", draft, (1, 8, 32))]
        tables += [("target", str(r), t, (1, 4, 16, 64)) for r, t in (replicas or {}).items()]
        for role, replica, table, sizes in tables:
            if table.known:
                for n in sizes:
                    self.forward_cost.set(table(n) * 1000,
                                          tags={"role": role, "size": str(n), "target_replica": replica})

    def agreement(self, audited: list[int], table) -> None:
        if audited[1]:
            self.filter_agreement.set(audited[0] / audited[1])
            self.draft_top1_match.set(table.agreement_rate)

    def failed(self, mode: str, code: str, frontend: str = "grpc") -> None:
        self.requests.inc(tags={"mode": mode, "code": code, "frontend": frontend})


class WorkerMetrics:
    def __init__(self, role: str):
        metrics = _Deferred()
        self.batch = metrics.Histogram(f"calid_{role}_batch_size", f"requests per {role} worker batch "
                                       "(all router calls merged into one model pass)", boundaries=COUNTS)
        self.latency = metrics.Histogram(f"calid_{role}_call_ms", f"{role} worker batch latency", boundaries=LATENCY_MS)


def meets_slo(result: GenerationResult, ttft_ms: float | None, tpot_ms: float | None) -> bool | None:
    """Whether a finished request met its model's SLO (None: the model has none). TPOT is the mean time per
    output token after the first."""
    if ttft_ms is None and tpot_ms is None:
        return None
    if ttft_ms is not None and result.ttft_s * 1000 > ttft_ms:
        return False
    n = len(result.output_ids)
    return tpot_ms is None or n < 2 or (result.total_s - result.ttft_s) * 1000 / (n - 1) <= tpot_ms
