"""Deployment config checks at the edge."""
from __future__ import annotations

import pytest

from serve_app.cluster.config import AppConfig, ConfigError, check_resources, load_config


@pytest.mark.parametrize("args, message", [
    ({"dtype": "fp8"}, "dtype"),
    ({"device": "tpu"}, "device"),
    ({"device": "cuda"}, "target_num_gpus"),
    ({"target_device": "cuda"}, "target_num_gpus"),
    ({"draft_device": "cuda"}, "draft_device must be cpu"),
    ({"cuda_graphs": True}, "cuda_graphs needs an unsharded target on cuda"),
    ({"cuda_graphs": True, "device": "cuda", "target_num_gpus": 1, "target_tp": 2}, "cuda_graphs needs"),
    ({"default_mode": "fast"}, "default_mode"),
    ({"draft": None, "default_mode": "speculative"}, "needs a draft"),
    ({"draft": "self:x"}, "self:N"),
    ({"max_active": 0}, "max_active"),
    ({"target_scaling": {"min_replicas": 3, "max_replicas": 2}}, "max_replicas"),
    ({"no_such_field": 1}, "no_such_field"),
    ({"filter_threshold": 1.5}, "filter_threshold"),
])
def test_bad_config_is_refused_with_the_field(args, message):
    with pytest.raises(ConfigError, match=message):
        load_config(args)


def test_resources_must_fit_the_cluster():
    cfg = AppConfig(target_num_gpus=1, device="cuda", target_scaling={"min_replicas": 2, "max_replicas": 2})
    with pytest.raises(ConfigError, match="GPU: need 2, cluster has 1"):
        check_resources(cfg, {"CPU": 16.0, "GPU": 1.0})
    check_resources(AppConfig(), {"CPU": 2.0})  # defaults fit this 2-core machine
    with pytest.raises(ConfigError, match="draft_node"):
        check_resources(AppConfig(draft_resources={"draft_node": 1}), {"CPU": 8.0})


def test_a_sharded_target_counts_its_shards():
    cfg = AppConfig(target_tp=2, target_num_cpus=1.0, draft=None)
    check_resources(cfg, {"CPU": 3.1})  # the replica and 2 shards, 1 CPU each, plus the router
    with pytest.raises(ConfigError, match="CPU: need 3.1, cluster has 2"):
        check_resources(cfg, {"CPU": 2.0})


def test_a_pipelined_target_counts_every_stage():
    cfg = AppConfig(target_tp=2, target_pp=3, target_num_cpus=1.0, target_num_gpus=1, device="cuda", draft=None)
    assert cfg.sharded and not AppConfig(draft=None).sharded
    with pytest.raises(ConfigError, match="GPU: need 6, cluster has 4"):  # 2 x 3 shards, one GPU each
        check_resources(cfg, {"CPU": 16.0, "GPU": 4.0})
    check_resources(cfg, {"CPU": 7.1, "GPU": 6.0})


def test_each_role_has_its_device():
    """A cuda target does not drag its draft onto a GPU it was never given (the cluster config's draft
    replicas run on CPU-only nodes)."""
    cfg = AppConfig(target_device="cuda", target_num_gpus=1)
    assert (cfg.target_on, cfg.draft_on) == ("cuda", "cpu")
    assert AppConfig(device="cuda", target_num_gpus=1).draft_on == "cpu"
    assert (AppConfig().target_on, AppConfig().draft_on) == ("cpu", "cpu")


def test_a_pipeline_stage_must_fit_on_one_node_and_shards_carry_the_targets_resources():
    cfg = AppConfig(target_tp=3, target_pp=2, target_num_cpus=1.0, target_num_gpus=1, device="cuda", draft=None,
                    target_resources={"target_node": 0.01}, router_resources={"head_node": 0.01})
    total = {"CPU": 20.0, "GPU": 8.0, "target_node": 2.0, "head_node": 1.0}
    check_resources(cfg, total, [{"CPU": 8.0, "GPU": 4.0, "target_node": 1.0}] * 2)  # a stage per node
    with pytest.raises(ConfigError, match=r"no node can hold a pipeline stage .*GPU: 3"):
        check_resources(cfg, total, [{"CPU": 8.0, "GPU": 2.0, "target_node": 1.0}] * 4)  # 8 GPUs, 2 per node
    with pytest.raises(ConfigError, match="target_node"):  # a stage's GPUs on a node of another type
        check_resources(cfg, total, [{"CPU": 8.0, "GPU": 4.0}] * 2)
    with pytest.raises(ConfigError, match="head_node: need 0.01, cluster has 0"):
        check_resources(cfg, {k: v for k, v in total.items() if k != "head_node"})
    with pytest.raises(ConfigError, match="target_node: need 0.07"):  # the replica and its 6 shards ask for it
        check_resources(cfg, {**total, "target_node": 0.05})


# ---- several models in one app ------------------------------------------------------------

MODELS = [{"name": "big", "target": "qwen2.5-coder-1.5b-instruct", "draft": "qwen2.5-coder-0.5b-instruct",
           "slo_ttft_ms": 2000, "target_num_cpus": 1.0},
          {"name": "small", "target": "smollm2-135m-instruct", "default_mode": "lookahead", "max_active": 4}]


def test_each_model_gets_the_apps_settings_under_its_own():
    cfg = AppConfig(models=MODELS, max_active=8, kv_budget_mb=1024)
    per = cfg.model_configs
    assert list(per) == ["big", "small"]
    big, small = per["big"], per["small"]
    assert (big.target, big.draft, big.served_model, big.slo_ttft_ms, big.target_num_cpus, big.max_active) == \
        ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "big", 2000, 1.0, 8)
    assert (small.draft, small.default_mode, small.max_active, small.kv_budget_mb) == (None, "lookahead", 4, 1024)
    assert not big.models and not small.models
    single = AppConfig(target="smollm2-135m-instruct").model_configs  # a single-model app: its served name
    assert list(single) == ["smollm2-135m-instruct"]


def test_filters_default_threshold_is_the_pairs_operating_point():
    from calid.decoding.modes import FILTER_THRESHOLD

    assert AppConfig().filter_point == 0.97  # the default pair's, measured (calid.models.presets)
    assert AppConfig.small().filter_point == FILTER_THRESHOLD  # a pair never calibrated
    assert AppConfig.small(filter_threshold=0.7).filter_point == 0.7  # the operator's own
    cfg = AppConfig(filter_threshold=0.8, models=[MODELS[0], {**MODELS[1], "filter_threshold": 0.6}])
    assert {name: c.filter_point for name, c in cfg.model_configs.items()} == {"big": 0.8, "small": 0.6}
    # the demo's header says which of these it runs at
    assert [c.filter_default[1] for c in (AppConfig(), AppConfig.small(), AppConfig.small(filter_threshold=0.7))] == \
        ["the pair's measured operating point", "not calibrated for this pair: calid bench pareto measures one",
         "set in the app config"]


@pytest.mark.parametrize("models, message", [
    ([MODELS[0], {**MODELS[1], "name": "big"}], "names must be unique"),
    ([{"name": "a b", "target": "x"}], "letters, digits"),
    ([{"name": "a", "target": "smollm2-135m-instruct", "default_mode": "filter"}], "model 'a'.*needs a draft"),
    ([{"name": "a", "target": "x", "target_tp": 0}], "target_tp"),
    ([{"name": "a", "target": "x", "slo": 3}], "slo"),
])
def test_a_bad_model_is_refused_naming_it(models, message):
    with pytest.raises(ConfigError, match=message):
        load_config({"models": models})


def test_the_cluster_must_hold_every_models_replicas_together():
    cfg = AppConfig(models=MODELS)  # front 0.1 + big (router 0.1, target 1.0, draft 0.5) + small (0.1 + 0.5)
    check_resources(cfg, {"CPU": 2.3})
    with pytest.raises(ConfigError, match="CPU: need 2.3, cluster has 2.2"):
        check_resources(cfg, {"CPU": 2.2})


def test_serve_models_flag():
    from serve_app.cluster.serve_commands import parse_models

    assert parse_models("qwen2.5-coder-1.5b-instruct+qwen2.5-coder-0.5b-instruct, smol=smollm2-135m-instruct+self:16,"
                        "/m/tiny.gguf") == [
        {"name": "qwen2.5-coder-1.5b-instruct", "target": "qwen2.5-coder-1.5b-instruct",
         "draft": "qwen2.5-coder-0.5b-instruct"},
        {"name": "smol", "target": "smollm2-135m-instruct", "draft": "self:16"},
        {"name": "tiny", "target": "/m/tiny.gguf", "draft": None}]
    for bad in ("", " , ", "x=+self:4"):
        with pytest.raises(ConfigError, match="--models"):
            parse_models(bad)


def test_slo_attainment_of_a_finished_request():
    from calid.generation import GenerationResult
    from serve_app.router.metrics import meets_slo

    def result(ttft_s, total_s, n):
        r = GenerationResult.__new__(GenerationResult)
        r.ttft_s, r.total_s, r.output_ids = ttft_s, total_s, list(range(n))
        return r

    fast = result(0.5, 2.5, 21)  # TTFT 500 ms, then 100 ms per token
    assert meets_slo(fast, None, None) is None
    assert meets_slo(fast, 500, 100) and not meets_slo(fast, 499, None) and not meets_slo(fast, None, 99)
    assert meets_slo(result(0.5, 0.5, 1), 600, 1)  # one token: no TPOT to miss


def test_a_forwarded_call_carries_the_callers_key_and_brings_back_its_status():
    import grpc

    from serve_app.ingress.frontdoor import ForwardedContext, grpc_caller

    ctx = ForwardedContext((("authorization", "Bearer k1"), ("application", "calid")))
    assert grpc_caller(ctx).key == "k1"
    ctx.set_code(grpc.StatusCode.NOT_FOUND)
    ctx.set_details("no such model")
    assert (ctx.code, ctx.details) == (grpc.StatusCode.NOT_FOUND, "no such model")


def test_a_model_placed_on_several_groups_gets_a_pinned_replica_group_each():
    cfg = AppConfig(models=[{**MODELS[1], "placement": [[0], [1, 2]]}, MODELS[0]])
    per = cfg.model_configs
    assert list(per) == ["small@0", "small@1", "big"]
    assert [(c.served_model, c.cpu_affinity, c.worker_threads) for c in per.values()] == \
        [("small", [0], 1), ("small", [1, 2], 2), ("big", None, None)]
    for bad in ([], [[]], [[-1]]):
        with pytest.raises(ConfigError, match="placement takes one or more"):
            load_config({"models": [{**MODELS[1], "placement": bad}]})
