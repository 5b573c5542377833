"""serve_app/cluster/calid.yaml is a valid Serve config whose app args are a valid AppConfig."""
from __future__ import annotations

from pathlib import Path

import yaml

from serve_app.cluster.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def test_serve_yaml_matches_ray_schema_and_our_config():
    from ray.serve.schema import ServeDeploySchema

    doc = yaml.safe_load((ROOT / "serve_app/cluster/calid.yaml").read_text())
    schema = ServeDeploySchema(**doc)
    (app,) = schema.applications
    assert app.import_path == "serve_app.cluster.app:build_app"
    assert "calid.v1.calid_pb2_grpc.add_CalidServicer_to_server" in schema.grpc_options.grpc_servicer_functions
    cfg = load_config(app.args)
    assert cfg.target_scaling.max_replicas >= cfg.target_scaling.min_replicas
