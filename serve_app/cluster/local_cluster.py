"""cluster.yaml's node types started as real Ray nodes on one machine: a rehearsal of ``ray up cluster.yaml``.

``node_types`` reads the YAML's ``available_node_types``: what each type carries (CPU, GPU and the custom
resources deployments ask for) and how many workers it may have. ``LocalCluster`` starts a head and worker
nodes of those types here, each a real raylet with its own object store and worker processes, as Ray's own
multi-node tests do (``ray.cluster_utils.Cluster``). Two things are scaled down to fit a small machine: CPU
counts (by ``cpu_scale``; the app's CPU asks are scaled by the same factor with ``scale_app``), and GPUs,
which stay Ray resources with no device behind them (replicas asking for them run on the CPU). Everything
else (custom resources, GPU counts per node, so which bundle fits where) is the YAML's own.

Every node listens on 127.0.0.1 (they share this machine's loopback); ``remove`` kills a node's raylet and
all its workers at once, as a lost machine would.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

CPU_FIELDS = ("router_num_cpus", "draft_num_cpus", "target_num_cpus")


@dataclass(frozen=True)
class NodeType:
    name: str
    resources: dict[str, float]  # CPU, GPU and custom resources, as the YAML gives them
    min_workers: int = 0
    max_workers: int = 0

    def node_args(self, cpu_scale: float) -> dict:
        """Ray node arguments for one node of this type, CPU scaled (at least one CPU)."""
        custom = {k: v for k, v in self.resources.items() if k not in ("CPU", "GPU")}
        return {"num_cpus": max(1, round(self.resources.get("CPU", 1) * cpu_scale)),
                "num_gpus": int(self.resources.get("GPU", 0)), "resources": custom}


class ClusterYamlError(ValueError):
    """cluster.yaml does not say what a node type carries."""


def node_types(path: str | Path) -> tuple[str, dict[str, NodeType]]:
    """(head type name, node types by name) from a Ray cluster YAML; every type must state its CPUs."""
    doc = yaml.safe_load(Path(path).read_text())
    types = {}
    for name, spec in doc["available_node_types"].items():
        resources = dict(spec.get("resources") or {})
        if "CPU" not in resources:
            raise ClusterYamlError(f"{path}: node type {name} does not state its CPUs (resources: CPU)")
        types[name] = NodeType(name, resources, spec.get("min_workers", 0), spec.get("max_workers", 0))
    head = doc["head_node_type"]
    if head not in types:
        raise ClusterYamlError(f"{path}: head_node_type {head} is not one of {sorted(types)}")
    return head, types


def scale_app(args: dict, cpu_scale: float) -> dict:
    """An app config's CPU asks scaled as the nodes were (GPU and custom resource asks unchanged)."""
    return {**args, **{k: args[k] * cpu_scale for k in CPU_FIELDS if k in args}}


class LocalCluster:
    """A head and worker nodes of the YAML's types on this machine; the driver connects to the head."""

    def __init__(self, yaml_path: str | Path, cpu_scale: float = 1 / 8, object_store_mb: int = 100,
                 dashboard: bool = True):
        self.head_type, self.types = node_types(yaml_path)
        self.cpu_scale, self.object_store = cpu_scale, object_store_mb << 20
        self.dashboard = dashboard
        self.cluster = None
        self.nodes: dict[str, list] = {}  # node type -> live worker nodes (ray._private.node.Node)

    def _args(self, type_name: str) -> dict:
        return {**self.types[type_name].node_args(self.cpu_scale), "node_ip_address": "127.0.0.1",
                "object_store_memory": self.object_store}

    def start(self, workers: dict[str, int] | None = None) -> "LocalCluster":
        """Start the head and ``workers`` nodes by type (default: each type's min_workers), and connect."""
        from serve_app.cluster.local import loopback_env

        loopback_env()
        import ray
        from ray.cluster_utils import Cluster

        head_args = {**self._args(self.head_type), "include_dashboard": self.dashboard,
                     "dashboard_host": "127.0.0.1"}
        self.cluster = Cluster(initialize_head=True, head_node_args=head_args)
        for name, count in (workers or {n: t.min_workers for n, t in self.types.items()}).items():
            for _ in range(count):
                self.add(name)
        ray.init(address=self.cluster.address, _node_ip_address="127.0.0.1", log_to_driver=False,
                 logging_level="warning")
        return self

    def add(self, type_name: str):
        """Start one more node of ``type_name`` (a node joining); returns it."""
        if type_name not in self.types:
            raise ClusterYamlError(f"no node type {type_name!r} (cluster.yaml has {', '.join(self.types)})")
        node = self.cluster.add_node(**self._args(type_name))
        self.nodes.setdefault(type_name, []).append(node)
        return node

    def remove(self, node) -> None:
        """Lose ``node``: its raylet, object store and every worker on it are killed at once."""
        self.cluster.remove_node(node, allow_graceful=False)
        for nodes in self.nodes.values():
            if node in nodes:
                nodes.remove(node)

    def type_of(self, node_id: str) -> str | None:
        """The node type of a live node by its Ray node id (the head's type for the head)."""
        if self.cluster.head_node.node_id == node_id:
            return self.head_type
        for name, nodes in self.nodes.items():
            if any(n.node_id == node_id for n in nodes):
                return name
        return None

    def shutdown(self) -> None:
        import ray

        ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None
