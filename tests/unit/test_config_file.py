"""``calid serve --config``: the file's settings, the flags that override them, a Serve config read the same way,
one line for a file that cannot be used, and which changes a running server can take."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from serve_app.cluster.config import ConfigError
from serve_app.cluster.config_file import changes, describe, read_config_file, refused_in_place
from serve_app.cluster.serve_commands import add_server_args, config_from_args

REPO = Path(__file__).resolve().parents[2]


def _args(*argv: str):
    p = argparse.ArgumentParser()
    add_server_args(p)
    return p.parse_args(list(argv))


def test_the_file_sets_fields_and_flags_given_override_them(tmp_path):
    app = tmp_path / "app.yaml"
    app.write_text("max_active: 8\nqueue_capacity: 5\ntopology: split\ngrpc_port: 6000\ndefault_mode: ar\n")
    cfg = config_from_args(_args("--small", "--config", str(app)))
    assert (cfg.max_active, cfg.queue_capacity, cfg.topology, cfg.grpc_port, cfg.default_mode) == (8, 5, "split",
                                                                                                  6000, "ar")
    cfg = config_from_args(_args("--small", "--config", str(app), "--max-active", "3", "--topology", "engine"))
    assert (cfg.max_active, cfg.queue_capacity, cfg.topology) == (3, 5, "engine")


def test_without_a_file_the_defaults_are_the_commands():
    cfg = config_from_args(_args("--small"))
    assert (cfg.grpc_port, cfg.http_port, cfg.max_active, cfg.queue_capacity, cfg.topology) == (50051, 8000, 16, 64,
                                                                                                "engine")


def test_a_serve_config_is_read_for_its_calid_application():
    fields = read_config_file(REPO / "serve_app/cluster/calid.yaml")
    assert fields["target"] == "qwen2.5-coder-1.5b-instruct" and fields["app_name"] == "calid"
    assert (fields["grpc_port"], fields["http_port"], fields["route_prefix"]) == (50051, 8000, "/calid")


@pytest.mark.parametrize("text, message", [
    ("max_active: [\n", "not valid YAML at line 2"),
    ("- a list\n", "expected a mapping of calid settings"),
    ("max_actve: 3\n", "max_actve: Extra inputs are not permitted"),
    ("max_active: 0\n", "max_active: Input should be greater than or equal to 1"),
    ("applications: []\n", "a Serve config with 0 calid applications"),
])
def test_a_file_that_cannot_be_used_is_one_line_naming_it(tmp_path, text, message):
    app = tmp_path / "app.yaml"
    app.write_text(text)
    with pytest.raises(ConfigError, match=message) as e:
        config_from_args(_args("--small", "--config", str(app)))
    assert str(app) in str(e.value) and "\n" not in str(e.value)


def test_a_missing_file_is_one_line():
    with pytest.raises(ConfigError, match="no-such.yaml: No such file"):
        config_from_args(_args("--config", "no-such.yaml"))


def test_which_changes_a_running_server_takes():
    base = config_from_args(_args("--small"))
    tighter = base.model_copy(update={"max_active": 4, "max_new_tokens_limit": 100})
    diff = changes(base, tighter)
    assert diff == {"max_active": (16, 4), "max_new_tokens_limit": (4096, 100)}
    assert refused_in_place(base, diff) is None
    assert describe(diff) == "max_active 16 -> 4, max_new_tokens_limit 4096 -> 100"
    moved = changes(base, base.model_copy(update={"grpc_port": 6000}))
    assert refused_in_place(base, moved) == "grpc_port change only on a restart of calid serve"
    # engine: a router replica holds its own models, so another model is an update like any other
    assert refused_in_place(base, changes(base, base.model_copy(update={"draft": None}))) is None
    split = base.model_copy(update={"topology": "split"})
    assert "topology split" in refused_in_place(split, changes(split, split.model_copy(update={"draft": None})))
