"""A whole worker node lost while 16 greedy streams run (its raylet, object store and every worker killed at
once), then a node of its type rejoining: what each stream saw (status, output, the longest gap between two
of its chunks) is printed, and every stream must finish with the exact output of an undisturbed run."""
from __future__ import annotations

import time

import pytest
from mn_helpers import Streams, cluster_app, deploy, reference, replicas, wait_for

from calid.client import Client

# slow: ~7 minutes, and the TP-stage case is not yet reliable (see its docstring); run: pytest -m multinode
pytestmark = [pytest.mark.multinode, pytest.mark.slow, pytest.mark.ray, pytest.mark.model]
PROMPTS = ["Write a Python function that checks whether a number is prime.", "List three colors of the rainbow.",
           "What is the capital of France?", "Explain recursion in one sentence."]
STREAMS, TOKENS = 16, 40


def _node_of(cluster, actor):
    for nodes in cluster.nodes.values():
        for n in nodes:
            if n.node_id == actor.node_id:
                return n
    raise AssertionError(f"actor {actor.class_name} is on no worker node (on {cluster.type_of(actor.node_id)})")


def _report(what: str, results: list[dict], lost_at: float) -> None:
    codes = sorted({r["code"] for r in results})
    gaps = sorted(r["max_gap_s"] for r in results)
    print(f"\n[{what}] {len(results)} streams: codes {codes}; longest gap between chunks: "
          f"median {gaps[len(gaps) // 2]:.2f} s, max {gaps[-1]:.2f} s (node killed at t={lost_at:.1f} s)")


def _check(results: list[dict], want: dict[str, list[int]]) -> None:
    for r in results:
        assert r["code"] == "OK", r
        assert r["tokens"] == want[r["prompt"]], r["prompt"]


def _lose_mid_stream(cluster, cfg, victim, modes, want: dict[str, list[int]], what: str) -> None:
    """Kill ``victim`` once all STREAMS streams have their first token; every stream must end OK and exact."""
    start = time.monotonic()
    streams = Streams(cluster.grpc_port, cfg.app_name, PROMPTS, STREAMS, TOKENS, mode=modes)
    streams.wait_started()
    lost_at = time.monotonic() - start
    cluster.remove(victim)
    results = streams.join()
    _report(what, results, lost_at)
    _check(results, want)


def test_losing_the_draft_node_keeps_every_stream_and_a_new_draft_replica_starts_on_the_other(cluster):
    cfg = deploy(cluster_app("draftloss", max_replicas_per_node=1,
                             draft_scaling={"min_replicas": 1, "max_replicas": 1},
                             target_scaling={"min_replicas": 1, "max_replicas": 1}))
    want = reference(cfg, PROMPTS, TOKENS)
    (draft,) = replicas(cfg.app_name, "draft")
    victim = _node_of(cluster, draft)
    # prompts cycle every 4 streams and modes every 3, so each prompt runs in both modes
    _lose_mid_stream(cluster, cfg, victim, ["speculative", "auto", "auto"], want, "draft node lost")
    from ray import serve

    router = serve.get_deployment_handle("router", cfg.app_name).stats.remote().result(timeout_s=60)
    # 0 when no draft call failed: Serve's handle held the call until the replacement replica was up
    print(f"[draft node lost] the router went target-only {router['draft_lost']} time(s)")
    # Serve replaces the lost replica on the other draft node; the router drafts again once it answers
    new = wait_for(lambda: replicas(cfg.app_name, "draft"), timeout_s=120)
    assert [cluster.type_of(a.node_id) for a in new] == ["draft_cpu"] and new[0].node_id != victim.node_id
    with Client(f"127.0.0.1:{cluster.grpc_port}", app=cfg.app_name, timeout=300) as c:
        done = c.generate(PROMPTS[0], max_new_tokens=TOKENS, ignore_eos=True, mode="speculative")
        assert done.token_ids == want[PROMPTS[0]]
        assert wait_for(lambda: c.generate(PROMPTS[1], max_new_tokens=8, mode="speculative").stats["draft_tokens"] > 0,
                        timeout_s=60)  # drafting resumed
    cluster.add("draft_cpu")  # the lost node rejoins: two draft nodes again for the tests after this one


def test_losing_a_target_node_moves_its_streams_to_the_other_replica_and_a_rejoined_node_restores_capacity(cluster):
    cfg = deploy(cluster_app("targetloss", draft=None, max_replicas_per_node=1,
                             target_scaling={"min_replicas": 2, "max_replicas": 2}))
    want = reference(cfg, PROMPTS, TOKENS)
    targets = replicas(cfg.app_name, "target")
    assert len({a.node_id for a in targets}) == 2  # one replica per target node
    _lose_mid_stream(cluster, cfg, _node_of(cluster, targets[0]), "ar", want, "target node lost (one of two replicas)")
    # the replacement replica cannot start (one replica per node, one target node left) until a node rejoins;
    # the lost one leaves the state API once Ray has declared its node dead
    assert wait_for(lambda: len(replicas(cfg.app_name, "target")) == 1, timeout_s=90)
    time.sleep(5)
    assert len(replicas(cfg.app_name, "target")) == 1
    joined = cluster.add("target_gpu")
    back = wait_for(lambda: [a for a in replicas(cfg.app_name, "target") if a.node_id == joined.node_id],
                    timeout_s=180)
    assert back, "no target replica started on the rejoined node"
    streams = Streams(cluster.grpc_port, cfg.app_name, PROMPTS, 8, 8, mode="ar")
    results = streams.join()
    assert all(r["code"] == "OK" for r in results)


def test_losing_a_node_holding_one_stage_of_a_tp_group_rebuilds_the_group_when_a_node_rejoins(cluster, smol):
    """TP 3 x PP 2 over the two target nodes. The node holding the stage away from the replica that drives
    the group is lost: the group is torn down and rebuilt (not moved: the app has one target replica), which
    waits for room for its second stage. Meanwhile a request with a short deadline ends DEADLINE_EXCEEDED
    at its deadline, and the running stream resumes once a target node rejoins, with identical output.

    While no node has room, each target call waits for the group's placement at most a quarter of
    worker_call_timeout_s and fails GroupFailed (retried by the router), so the replica's health check never
    takes a rebuild for a hung forward."""
    from ray.util.state import list_actors

    cfg = deploy(cluster_app("tploss", draft=None, target_tp=3, target_pp=2))
    want = reference(cfg, PROMPTS, TOKENS, smol)
    (driver,) = replicas(cfg.app_name, "target")
    shards = [a for a in list_actors(filters=[("state", "=", "ALIVE")], limit=10_000) if a.class_name == "TargetShard"]
    away = {a.node_id for a in shards} - {driver.node_id}
    assert len(away) == 1
    victim = next(n for n in cluster.nodes["target_gpu"] if n.node_id in away)
    start = time.monotonic()
    streams = Streams(cluster.grpc_port, cfg.app_name, PROMPTS[:2], 2, TOKENS, mode="ar")
    streams.wait_started()
    lost_at = time.monotonic() - start
    cluster.remove(victim)
    time.sleep(2)
    with Client(f"127.0.0.1:{cluster.grpc_port}", app=cfg.app_name, timeout=300) as c:
        from calid.client.errors import DeadlineExceeded

        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            c.generate(PROMPTS[2], max_new_tokens=8, timeout=5)
        waited = time.monotonic() - t0
    assert waited < 15, waited
    cluster.add("target_gpu")
    results = streams.join()
    _report("TP group: node of one stage lost, a node rejoins", results, lost_at)
    for r in results:
        assert r["code"] == "OK", r
        assert r["tokens"] == want[r["prompt"]]
    rebuilt = [a for a in list_actors(filters=[("state", "=", "ALIVE")], limit=10_000) if a.class_name == "TargetShard"]
    assert len(rebuilt) == 6 and len({a.node_id for a in rebuilt}) == 2
