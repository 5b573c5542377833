"""``calid serve --config app.yaml``: an app's settings from a file, and which changes apply to a running server.

The file is a mapping of AppConfig fields (docs/serving.md), or a Serve config of the kind
``serve deploy`` takes (its one calid application's ``args``, name, route prefix and the proxies' ports).
"""
from __future__ import annotations

from pathlib import Path

import yaml

from serve_app.cluster.config import AppConfig, ConfigError

IMPORT_PATH = "serve_app.cluster.app:build_app"

# what the running proxies and the app's identity are made of: a change needs a restart
RESTART_FIELDS = ("grpc_port", "http_port", "http_host", "route_prefix", "app_name", "tls_cert_file", "tls_key_file")
# split topology: a router replica in flight keeps calling the worker deployments by name, and after an update
# those are the new replicas; they must hold the same models (a cache miss there re-sends the ids, nothing more)
SPLIT_MODEL_FIELDS = ("target", "draft", "models", "topology", "target_backend", "draft_backend", "dtype",
                      "draft_weights", "target_tp", "target_pp", "batch_invariant", "device", "target_device",
                      "draft_device")


def read_config_file(path: str | Path) -> dict:
    """The AppConfig fields ``path`` sets (not yet validated: flags may still override some)."""
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"--config {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise ConfigError(f"--config {path}: not valid YAML{at} ({getattr(e, 'problem', None) or e})") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"--config {path}: expected a mapping of calid settings (docs/serving.md), "
                          f"got a {type(doc).__name__}")
    if "applications" in doc:
        return _from_serve_config(path, doc)
    return doc


def _from_serve_config(path, doc: dict) -> dict:
    apps = [a for a in doc.get("applications") or [] if isinstance(a, dict) and a.get("import_path") == IMPORT_PATH]
    if len(apps) != 1:
        raise ConfigError(f"--config {path}: a Serve config with {len(apps)} calid applications (import_path "
                          f"{IMPORT_PATH}); calid serve runs exactly one")
    app = apps[0]
    fields = dict(app.get("args") or {})
    for key, field in (("name", "app_name"), ("route_prefix", "route_prefix")):
        if key in app:
            fields.setdefault(field, app[key])
    for section, key, field in (("grpc_options", "port", "grpc_port"), ("http_options", "port", "http_port"),
                                ("http_options", "host", "http_host")):
        value = (doc.get(section) or {}).get(key)
        if value is not None:
            fields.setdefault(field, value)
    return fields


def changes(old: AppConfig, new: AppConfig) -> dict[str, tuple]:
    """Field -> (old value, new value) for every field that differs."""
    a, b = old.model_dump(), new.model_dump()
    return {k: (a[k], b[k]) for k in a if a[k] != b[k]}


def refused_in_place(old: AppConfig, diff: dict[str, tuple]) -> str | None:
    """Why ``diff`` cannot be applied to a running server (None: it can)."""
    restart = [k for k in RESTART_FIELDS if k in diff]
    if restart:
        return f"{', '.join(restart)} change only on a restart of calid serve"
    if old.topology == "split":
        models = [k for k in SPLIT_MODEL_FIELDS if k in diff]
        if models:
            return (f"{', '.join(models)}: with topology split, requests in flight would reach the new worker "
                    "replicas; change models on a restart, or serve with topology engine")
    return None


def describe(diff: dict[str, tuple], limit: int = 6) -> str:
    """``max_active 16 -> 8, draft ... -> none`` (at most ``limit`` fields, then how many more)."""
    def show(v):
        return "none" if v is None else str(v)

    items = [f"{k} {show(a)} -> {show(b)}" for k, (a, b) in diff.items()]
    more = f", and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more
