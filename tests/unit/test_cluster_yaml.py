"""cluster.yaml passes Ray's own autoscaler schema; its Serve config places roles on its node types."""
from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_cluster_yaml_is_a_valid_ray_cluster_config():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    validate_config(prepare_config(config))  # what `ray up` does first; raises on any schema violation
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    assert types["target_gpu"]["resources"] == {"CPU": 48, "GPU": 4, "target_node": 1}  # g5.12xlarge: 4 A10G
    assert types["draft_cpu"]["resources"] == {"CPU": 16, "draft_node": 1}
    assert types["head"]["resources"] == {"CPU": 8, "head_node": 1}
    assert all(t["min_workers"] <= t["max_workers"] for name, t in types.items() if name != "head")


def test_cluster_serve_config_targets_the_node_types():
    from ray.serve.schema import ServeDeploySchema

    from serve_app.cluster.config import check_resources, load_config

    doc = yaml.safe_load((ROOT / "serve_app/cluster/calid_cluster.yaml").read_text())
    (app,) = ServeDeploySchema(**doc).applications
    cfg = load_config(app.args)
    assert set(cfg.target_resources) == {"target_node"} and set(cfg.draft_resources) == {"draft_node"}
    assert set(cfg.router_resources) == {"head_node"}
    assert (cfg.target_on, cfg.draft_on) == ("cuda", "cpu")  # the draft_cpu nodes have no GPU
    # the minimum cluster of cluster.yaml (head + one node of each type) holds the minimum replicas
    check_resources(cfg, {"CPU": 8 + 16 + 48, "GPU": 4, "target_node": 1, "draft_node": 1, "head_node": 1})


def test_the_schema_check_catches_a_broken_config():
    import copy

    import jsonschema
    import pytest
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    broken = copy.deepcopy(config)
    broken["available_node_types"]["target_gpu"]["min_wokers"] = 1  # a typo Ray must refuse
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(broken))


def test_the_dashboard_listens_on_the_heads_loopback_only():
    """The dashboard can submit jobs: `ray dashboard cluster.yaml` forwards it over SSH instead."""
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    (start,) = [c for c in config["head_start_ray_commands"] if "ray start" in c]
    assert "--dashboard-host=127.0.0.1" in start and "0.0.0.0" not in start


def test_node_types_scale_cpus_and_keep_what_places_replicas():
    from serve_app.cluster.local_cluster import ClusterYamlError, node_types, scale_app

    head, types = node_types(ROOT / "cluster.yaml")
    assert head == "head"
    assert types["target_gpu"].node_args(1 / 8) == {"num_cpus": 6, "num_gpus": 4, "resources": {"target_node": 1}}
    assert types["head"].node_args(1 / 64) == {"num_cpus": 1, "num_gpus": 0, "resources": {"head_node": 1}}
    assert scale_app({"draft_num_cpus": 4, "target_num_gpus": 1}, 1 / 8) == {
        "draft_num_cpus": 0.5,
        "target_num_gpus": 1,
    }
    import tempfile

    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    del config["available_node_types"]["draft_cpu"]["resources"]["CPU"]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        yaml.safe_dump(config, f)
        f.flush()
        import pytest

        with pytest.raises(ClusterYamlError, match="draft_cpu does not state its CPUs"):
            node_types(f.name)
