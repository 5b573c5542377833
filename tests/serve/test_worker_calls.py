"""The router's worker calls against scripted replicas (no model, no Ray): one call per replica and step,
new requests spread over the running replicas, pinned requests staying put, token ids sent as deltas, a
replica that lost a request's ids getting them in full within the same step, and releases reaching the
replica that holds the request."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from serve_helpers import Call

from calid.workers.messages import VerifyTask
from serve_app.router.calls import Reply, WorkerCalls, expand_all
from serve_app.cluster.config import AppConfig


@dataclass
class _Replica:
    """A worker replica that expands deltas as serve_app.workers.deployments does, and echoes each task's full ids."""

    name: str
    held: dict = field(default_factory=dict)
    calls: list = field(default_factory=list)  # the tasks of each call, as sent
    released: list = field(default_factory=list)

    async def verify(self, tasks, report=None, replica=None):
        self.calls.append(tasks)
        full, missing = expand_all(tasks, self.held)
        self.held.update((t.request_id, t.token_ids) for t in full)
        return Reply(self.name, [(t.request_id, list(t.token_ids)) for t in full], missing)


class _Handle:
    """Serve's handle over named replicas: a call goes where ``replica`` says (Serve's choice, the first
    replica, when it names none or a gone one); broadcast reaches every running replica."""

    def __init__(self, replicas):
        self.replicas = {r.name: r for r in replicas}

    def __getattr__(self, method):
        handle = self

        class _M:
            def remote(self, *args, replica=None):
                r = handle.replicas.get(replica) or next(iter(handle.replicas.values()))
                if method == "release":
                    r.released += args[0]
                    return Call(asyncio.sleep(0))
                return Call(getattr(r, method)(*args))

        return _M()

    def broadcast(self, method):
        names = list(self.replicas)

        class _B:
            async def results_async(self, **kw):
                return names

        return _B()


def _task(rid, ids):
    return VerifyTask(rid, list(ids), 2, None, None, 0, [])


def _calls(handle):
    return WorkerCalls(AppConfig.small(draft=None), None, handle, "router", lambda: {"queued": 0.0})


async def _learn(calls):
    calls._refresh_live("target")
    await asyncio.sleep(0.01)  # the broadcast answers


def test_new_requests_spread_over_the_running_replicas_one_call_per_replica():
    replicas = [_Replica(n) for n in "abc"]

    async def run():
        calls = _calls(_Handle(replicas))
        await _learn(calls)
        tasks = [_task(f"r{i}", [1, 2, i]) for i in range(6)]
        results, failed = await calls.call("target", tasks)
        return results, failed, calls

    results, failed, calls = asyncio.run(run())
    assert not failed and sorted(results) == sorted((f"r{i}", [1, 2, i]) for i in range(6))
    assert [len(r.calls) for r in replicas] == [1, 1, 1]  # one call each...
    assert [len(r.calls[0]) for r in replicas] == [2, 2, 2]  # ...of two requests each
    assert calls.sent["target"] == 3
    # each replica's call is timed on its own, with its own tasks: the planner's cost model per replica
    timed = sorted((replica, sorted(t.request_id for t in group)) for replica, group, _, _ in calls.timed["target"])
    assert timed == [(r.name, sorted(t.request_id for t in r.calls[0])) for r in replicas]
    assert all(seconds >= 0 for *_, seconds in calls.timed["target"])
    assert all(calls.replica_of("target", f"r{i}") in "abc" for i in range(6))


def test_ids_travel_as_a_delta_and_a_replica_that_lost_them_gets_them_in_full():
    a = _Replica("a")

    async def run():
        calls = _calls(_Handle([a]))
        await _learn(calls)
        first = await calls.call("target", [_task("r", [1, 2, 3])])
        second = await calls.call("target", [_task("r", [1, 2, 3, 4, 5])])
        a.held.clear()  # the replica restarted
        third = await calls.call("target", [_task("r", [1, 2, 3, 4, 5, 6])])
        return first, second, third

    first, second, third = asyncio.run(run())
    assert [c[0].token_ids for c in a.calls] == [[1, 2, 3], [4, 5], [6], [1, 2, 3, 4, 5, 6]]
    assert [c[0].ids_from for c in a.calls] == [0, 3, 5, 0]
    assert first[0] == [("r", [1, 2, 3])] and second[0] == [("r", [1, 2, 3, 4, 5])]
    assert third == ([("r", [1, 2, 3, 4, 5, 6])], {})  # the step still completes, with the full ids


def test_a_request_stays_on_its_replica_when_one_is_added_and_moves_when_its_replica_is_gone():
    a, b = _Replica("a"), _Replica("b")
    handle = _Handle([a])

    async def run():
        calls = _calls(handle)
        await _learn(calls)
        await calls.call("target", [_task("old", [1, 2])])
        handle.replicas["b"] = b  # scale-out
        calls._live_at["target"] = -1e9
        await _learn(calls)
        await calls.call("target", [_task("old", [1, 2, 3]), _task("new", [7, 8])])
        del handle.replicas["a"]  # a is gone
        calls._live_at["target"] = -1e9
        await _learn(calls)
        out = await calls.call("target", [_task("old", [1, 2, 3, 4])])
        return calls, out

    calls, out = asyncio.run(run())
    assert [[t.request_id for t in c] for c in a.calls] == [["old"], ["old"]]  # stayed on a while a ran
    assert [[t.request_id for t in c] for c in b.calls] == [["new"], ["old"]]  # the new one went to idle b
    assert b.calls[1][0].ids_from == 0 and out == ([("old", [1, 2, 3, 4])], {})  # moved: full ids
    assert calls._pins["target"]["old"] == "b"


def test_a_release_reaches_the_replica_holding_the_request_and_forgets_what_it_held():
    from types import SimpleNamespace

    a, b = _Replica("a"), _Replica("b")

    async def run():
        calls = _calls(_Handle([a, b]))
        await _learn(calls)
        await calls.call("target", [_task("x", [1]), _task("y", [2])])
        where = dict(calls._pins["target"])
        calls.release([SimpleNamespace(req=SimpleNamespace(request_id="x"), token_ids=[1, 9])])
        await asyncio.sleep(0.01)
        return calls, where

    calls, where = asyncio.run(run())
    holder = {"a": a, "b": b}[where["x"]]
    assert holder.released == ["x"] and not ({"a": a, "b": b}[where["y"]]).released
    assert "x" not in calls._pins["target"] and "x" not in calls._held["target"]
    assert "x" in calls.report()["released"]  # and the echo carries it to every other replica


def test_a_worker_in_this_process_gets_full_ids_and_no_release_echo():
    """The engine topology's one replica per role (LocalHandle): nothing is serialised, so a task keeps its full
    ids (no delta to build there and expand again), and releases reach it directly, so calls carry no echo."""
    from types import SimpleNamespace

    from serve_app.workers.colocated import LocalHandle

    local = _Replica("local-1")
    reports = []

    async def verify(tasks, report=None, replica=None):
        reports.append(report)
        return await local.verify(tasks, report, replica)

    local_handle = LocalHandle(SimpleNamespace(verify=verify, release=lambda *a, **k: asyncio.sleep(0),
                                               whoami=lambda: asyncio.sleep(0, "local-1")))

    async def run():
        calls = _calls(local_handle)
        await calls.call("target", [_task("x", [1, 2, 3])])
        calls.release([SimpleNamespace(req=SimpleNamespace(request_id="gone"), token_ids=[5])])
        await calls.call("target", [_task("x", [1, 2, 3, 4])])
        return calls

    calls = asyncio.run(run())
    sent = [[(t.token_ids, t.ids_from) for t in call] for call in local.calls]
    assert sent == [[([1, 2, 3], 0)], [([1, 2, 3, 4], 0)]]
    assert [r["released"] for r in reports] == [[], []]
    assert "gone" in calls.report()["released"]  # a Serve replica's report still carries it
