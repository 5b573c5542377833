"""serve_app.router.metrics.Recorder: metric updates noted on the step loop reach Ray's metrics from a thread of
their own, with nothing lost or reordered that Ray would keep."""
from __future__ import annotations

import time

from serve_app.router.metrics import Recorder


class Seen:
    """A metric that lists the calls it gets (ray.util.metrics' setter signatures)."""

    def __init__(self, fail: bool = False):
        self.calls, self.fail = [], fail

    def _got(self, kind, value, tags):
        if self.fail:
            raise ValueError("refused")
        self.calls.append((kind, value, tags))

    def set(self, value, tags=None):
        self._got("set", value, tags)

    def inc(self, value=1.0, tags=None):
        self._got("inc", value, tags)

    def observe(self, value, tags=None):
        self._got("observe", value, tags)


def test_noted_updates_reach_the_metrics_at_flush_as_ray_would_hold_them():
    rec = Recorder(start=False)
    g, c, h = Seen(), Seen(), Seen()
    gauge, counter, hist = rec.noted(g), rec.noted(c), rec.noted(h)
    for v in (3, 5, 4):
        gauge.set(v)
    gauge.set(7, tags={"role": "draft"})
    counter.inc(2, tags={"where": "edge"})
    counter.inc(tags={"where": "edge"})
    counter.inc(5, tags={"where": "cluster"})
    for v in (1, 8, 1):
        hist.observe(v, tags={"mode": "auto"})
    assert g.calls == c.calls == h.calls == []  # nothing recorded on the caller's side
    rec.flush()
    assert sorted(g.calls, key=str) == sorted([("set", 4, None), ("set", 7, {"role": "draft"})], key=str)
    assert sorted(c.calls, key=str) == sorted([("inc", 3.0, {"where": "edge"}), ("inc", 5, {"where": "cluster"})],
                                              key=str)
    assert h.calls == [("observe", v, {"mode": "auto"}) for v in (1, 8, 1)]
    rec.flush()  # a flush records only what came since the last
    assert len(g.calls) == 2 and len(c.calls) == 2 and len(h.calls) == 3


def test_an_update_a_metric_refuses_loses_no_other():
    rec = Recorder(start=False)
    bad, good = Seen(fail=True), Seen()
    rec.noted(bad).set(1)
    rec.noted(good).observe(2)
    rec.flush()
    assert good.calls == [("observe", 2, None)]


def test_the_recorder_thread_flushes_on_its_own():
    rec = Recorder(every_s=0.01)
    h = Seen()
    rec.noted(h).observe(5)
    deadline = time.monotonic() + 10
    while not h.calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert h.calls == [("observe", 5, None)]
