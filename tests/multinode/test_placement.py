"""`ray up cluster.yaml` + `serve deploy serve_app/calid_cluster.yaml`, rehearsed on real Ray nodes: every role
lands on the node type the YAML names, checked from Ray's state API, and serves over gRPC."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from mn_helpers import actors, cluster_app, deploy, replicas

from calid.client import Client
from calid.decoding.modes import DecodeParams
from calid.engine import Engine
from calid.generation import GenerationRequest, SamplingParams
from calid.runtime.runner import ModelRunner
from calid.text import encode_prompt
from serve_app.config import ConfigError

pytestmark = [pytest.mark.multinode, pytest.mark.ray, pytest.mark.model]
PROMPTS = ["Write a Python function that checks whether a number is prime.", "List three colors of the rainbow."]


def _types(cluster, found) -> list[str]:
    return sorted(cluster.type_of(a.node_id) for a in found)


def _reference(cfg, prompts, tokens, lm=None) -> list[list[int]]:
    """Greedy ar in process, on the model as the app's target replicas open it (``lm``: as given)."""
    from calid.backends import open_model

    lm = lm or open_model(cfg.target, cfg.target_backend, cfg.dtype, log=lambda line: None,
                          invariant=cfg.batch_invariant)
    engine = Engine(lm.runner, lm.tokenizer, lm.eos_ids)
    reqs = [GenerationRequest(encode_prompt(lm.tokenizer, p), SamplingParams(max_new_tokens=tokens, ignore_eos=True),
                              decode=DecodeParams(mode="ar")) for p in prompts]
    return [r.output_ids for r in engine.generate(reqs)]


def test_each_role_runs_on_the_node_type_the_yaml_names(cluster):
    cfg = deploy(cluster_app("placed", draft_scaling={"min_replicas": 1, "max_replicas": 1},
                             target_scaling={"min_replicas": 2, "max_replicas": 2}))
    assert _types(cluster, replicas("placed", "draft")) == ["draft_cpu"]
    assert _types(cluster, replicas("placed", "target")) == ["target_gpu", "target_gpu"]
    assert _types(cluster, replicas("placed", "router")) == ["head"]
    assert _types(cluster, actors("ServeController")) == ["head"]
    assert set(_types(cluster, actors("ProxyActor"))) == {"head"}  # proxy_location: HeadOnly
    want = _reference(cfg, PROMPTS, 16)
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
    # shards load their layers as load_model does (the smol fixture), not through open_model's kernels choice
    assert got == _reference(cfg, PROMPTS, 16, SimpleNamespace(runner=ModelRunner(smol.model), tokenizer=smol.tokenizer,
                                                               eos_ids=smol.eos_ids))


def test_a_stage_no_node_can_hold_is_refused_before_any_replica_starts(cluster):
    from serve_app.app import build_app

    with pytest.raises(ConfigError, match="no node can hold a pipeline stage .* GPU: 6"):
        build_app(cluster_app("too_wide", draft=None, target_tp=3, target_num_gpus=2))
