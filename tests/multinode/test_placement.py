"""`ray up cluster.yaml` + `serve deploy serve_app/cluster/calid_cluster.yaml`, rehearsed on real Ray nodes: every role
lands on the node type the YAML names, checked from Ray's state API, and serves over gRPC."""
from __future__ import annotations

import pytest
from mn_helpers import actors, cluster_app, deploy, reference, replicas

from calid.client import Client
from serve_app.cluster.config import ConfigError

pytestmark = [pytest.mark.multinode, pytest.mark.ray, pytest.mark.model]
PROMPTS = ["Write a Python function that checks whether a number is prime.", "List three colors of the rainbow."]


def _types(cluster, found) -> list[str]:
    return sorted(cluster.type_of(a.node_id) for a in found)


def test_each_role_runs_on_the_node_type_the_yaml_names(cluster):
    cfg = deploy(cluster_app("placed", draft_scaling={"min_replicas": 1, "max_replicas": 1},
                             target_scaling={"min_replicas": 2, "max_replicas": 2}))
    assert _types(cluster, replicas("placed", "draft")) == ["draft_cpu"]
    assert _types(cluster, replicas("placed", "target")) == ["target_gpu", "target_gpu"]
    assert _types(cluster, replicas("placed", "router")) == ["head"]
    assert _types(cluster, actors("ServeController")) == ["head"]
    assert set(_types(cluster, actors("ProxyActor"))) == {"head"}  # proxy_location: HeadOnly
    want = list(reference(cfg, PROMPTS, 16).values())
    with Client(f"127.0.0.1:{cluster.grpc_port}", app=cfg.app_name, timeout=300) as c:
        for mode in ("speculative", "ar"):
            assert [c.generate(p, max_new_tokens=16, ignore_eos=True, mode=mode).token_ids for p in PROMPTS] == want


def test_a_tensor_parallel_group_spans_two_target_nodes_and_equals_the_unsharded_model(cluster, smol):
    """TP 3 x PP 2, one GPU per shard: a stage (3 GPUs) fits a 4-GPU target node, two stages do not, so the
    stages sit on the two target nodes and the pipeline's transfers and logits broadcast cross between them
    over gloo."""
    cfg = deploy(cluster_app("tp", draft=None, target_tp=3, target_pp=2))
    shards = actors("TargetShard")
    assert len(shards) == 6 and _types(cluster, shards) == ["target_gpu"] * 6
    assert len({a.node_id for a in shards}) == 2
    with Client(f"127.0.0.1:{cluster.grpc_port}", app=cfg.app_name, timeout=300) as c:
        got = [c.generate(p, max_new_tokens=16, ignore_eos=True, mode="ar").token_ids for p in PROMPTS]
    assert got == list(reference(cfg, PROMPTS, 16, smol).values())


def test_a_stage_no_node_can_hold_is_refused_before_any_replica_starts(cluster):
    from serve_app.cluster.app import build_app

    with pytest.raises(ConfigError, match="no node can hold a pipeline stage .* GPU: 6"):
        build_app(cluster_app("too_wide", draft=None, target_tp=3, target_num_gpus=2))


def test_under_load_the_target_scales_out_onto_the_idle_target_node(cluster):
    """One target replica per node (max_replicas_per_node: 1), one running: the queue-driven policy asks for
    a second, which can only go on the other target node, already up and idle (no cluster autoscaler)."""
    import threading
    import time

    from mn_helpers import Streams, wait_for
    from ray import serve

    scaling = {"min_replicas": 1, "max_replicas": 2, "tokens_per_replica": 2.0, "upscale_delay_s": 0.0,
               "downscale_delay_s": 600.0, "look_back_period_s": 2.0}
    cfg = deploy(cluster_app("scaleout", draft=None, max_replicas_per_node=1, target_scaling=scaling))
    (first,) = replicas(cfg.app_name, "target")
    stop, errors = threading.Event(), []

    def load():
        with Client(f"127.0.0.1:{cluster.grpc_port}", app=cfg.app_name, timeout=300) as c:
            while not stop.is_set():
                try:
                    c.generate(PROMPTS[1], max_new_tokens=24, ignore_eos=True)
                except Exception as e:  # noqa: BLE001 - reported below
                    errors.append(e)
                    return

    threads = [threading.Thread(target=load, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    def running() -> int:  # replicas Serve routes to: an actor is alive before its model has loaded
        return serve.status().applications[cfg.app_name].deployments["target"].replica_states.get("RUNNING", 0)

    try:
        scaled = wait_for(lambda: running() == 2, timeout_s=180, every_s=1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(300)
    assert scaled and not errors, errors
    nodes = {a.node_id for a in replicas(cfg.app_name, "target")}
    assert len(nodes) == 2 and first.node_id in nodes
    assert _types(cluster, replicas(cfg.app_name, "target")) == ["target_gpu", "target_gpu"]
    target = serve.get_deployment_handle("target", cfg.app_name)
    for _ in range(4):  # the router learns the new replica within REPLICAS_REFRESH_S of its first call
        streams = Streams(cluster.grpc_port, cfg.app_name, PROMPTS, 8, 8, mode="ar").join()
        assert all(r["code"] == "OK" for r in streams) and len({tuple(r["tokens"]) for r in streams}) == len(PROMPTS)
        stats = wait_for(
            lambda: (lambda got: got if len(got) == 2 else None)(target.broadcast("stats").results(timeout_s=60)),
            timeout_s=30,
        )  # a new handle learns the replicas in the background
        if stats and all(s["batches"] > 0 for s in stats):
            break
        time.sleep(2.5)
    assert stats and all(s["batches"] > 0 for s in stats), stats  # the new replica serves too
