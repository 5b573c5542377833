"""``build_app(config)``: the calid Serve application (router -> draft, target).

    serve run serve_app.cluster.app:build_app target=... draft=...
    serve deploy serve_app/cluster/calid.yaml      (import_path: serve_app.cluster.app:build_app)

The config is validated here, at the edge: fields (AppConfig), the model pair
(shared vocabulary) and, when Ray is up, the cluster's resources.
"""
from __future__ import annotations

from ray import serve
from ray.serve.config import gRPCOptions

from serve_app.router.autoscaling import autoscaling_config
from serve_app.router.replica_routing import request_router_config
from serve_app.cluster.config import AppConfig, check_auth, check_models, check_resources, load_config
from serve_app.ingress.multi_model import ModelFront
from serve_app.router.router import Router
from serve_app.workers.deployments import DraftDeployment, TargetDeployment

SERVICER = "calid.v1.calid_pb2_grpc.add_CalidServicer_to_server"
HEALTH_CHECK_PERIOD_S = 5.0  # workers' check_health: a hung forward is noticed within this
CALIBRATION_WAIT_S = 300.0  # how long serve_app waits for the routers' forward timings before calling the app ready
# a worker gets a call per decoding step: an access-log line each would cost more than the call's routing
WORKER_LOGGING = {"enable_access_log": False}


def build_app(args: dict | AppConfig | None = None, check_cluster: bool = True):
    cfg = load_config(args)
    per_model = cfg.model_configs
    for model_cfg in per_model.values():
        check_models(model_cfg)
    check_auth(cfg)
    if check_cluster:
        import ray

        if ray.is_initialized():
            check_resources(cfg, ray.cluster_resources(),
                            [n["Resources"] for n in ray.nodes() if n["Alive"]])
    if not cfg.models:
        return _model_app(cfg)
    routers: dict[str, list] = {}  # served name -> its routers (one per group of its placement)
    cores: dict[str, list] = {}  # served name -> the cores of each of those groups ([]: any)
    for key, c in per_model.items():
        routers.setdefault(c.served_model, []).append(_model_app(c, suffix=_suffix(key)))
        cores.setdefault(c.served_model, []).append(c.cpu_affinity or [])
    return ModelFront.options(ray_actor_options={"num_cpus": cfg.router_num_cpus, "resources": cfg.router_resources},
                              graceful_shutdown_timeout_s=cfg.request_timeout_s,  # its streams, as a router's
                              ).bind(cfg.model_dump(), routers, cores)


def _suffix(key: str) -> str:
    """The deployment-name suffix of one model (replica group) of a multi-model app (AppConfig.model_configs)."""
    return f"-{key}"


def router_name(suffix: str) -> str:
    """The router deployment's name (``suffix``: its model's in a multi-model app, else empty)."""
    return "router" + suffix


def _model_app(cfg: AppConfig, suffix: str = ""):
    """One model's router, draft and target deployments (``suffix``: their names' in a multi-model app); with
    ``topology: engine``, one router deployment that holds both models (serve_app.workers.colocated).

    A router replica that Serve stops (an in-place update, a downscale) finishes the streams it holds first: its
    graceful stop may take request_timeout_s. A stop of the whole app ends them sooner (Router.drain's grace)."""
    config = cfg.model_dump()
    # a multi-model front relays a Collaborate stream to one router replica (serve_app.ingress.edge_relay)
    pinning = {"request_router_config": request_router_config()} if suffix else {}
    if cfg.topology == "engine":
        cpus = cfg.router_num_cpus + cfg.target_num_cpus + (cfg.draft_num_cpus if cfg.draft is not None else 0.0)
        return Router.options(name=router_name(suffix), graceful_shutdown_timeout_s=cfg.request_timeout_s, **pinning,
                              ray_actor_options={"num_cpus": cpus, "num_gpus": cfg.target_num_gpus,
                                                 "resources": {**cfg.router_resources, **cfg.target_resources}},
                              ).bind(config, None, None)
    sharded = cfg.sharded  # the shards hold the model (and the GPUs); the replica only drives them
    spread = {"max_replicas_per_node": cfg.max_replicas_per_node} if cfg.max_replicas_per_node else {}
    target = TargetDeployment.options(
        name="target" + suffix, **spread, health_check_period_s=HEALTH_CHECK_PERIOD_S, logging_config=WORKER_LOGGING,
        request_router_config=request_router_config(),
        ray_actor_options={"num_cpus": cfg.target_num_cpus, "num_gpus": 0.0 if sharded else cfg.target_num_gpus,
                           "resources": cfg.target_resources},
        autoscaling_config=autoscaling_config(cfg.target_scaling),
    ).bind(config)
    draft = None
    if cfg.draft is not None:
        draft = DraftDeployment.options(
            name="draft" + suffix, **spread, health_check_period_s=HEALTH_CHECK_PERIOD_S,
            logging_config=WORKER_LOGGING, request_router_config=request_router_config(),
            ray_actor_options={"num_cpus": cfg.draft_num_cpus, "resources": cfg.draft_resources},
            autoscaling_config=autoscaling_config(cfg.draft_scaling),
        ).bind(config)
    routers = cfg.router_scaling
    return Router.options(name=router_name(suffix), graceful_shutdown_timeout_s=cfg.request_timeout_s, **pinning,
                          ray_actor_options={"num_cpus": cfg.router_num_cpus, "resources": cfg.router_resources},
                          autoscaling_config={
        "min_replicas": routers.min_replicas, "max_replicas": routers.max_replicas,
        "initial_replicas": routers.min_replicas,
        "target_ongoing_requests": routers.target_ongoing_requests or cfg.max_active,
    }).bind(config, draft, target)


def grpc_options(port: int) -> gRPCOptions:
    return gRPCOptions(port=port, grpc_servicer_functions=[SERVICER])


def http_options(cfg: AppConfig) -> dict:
    """Serve's HTTP proxy: the OpenAI API on cfg.http_port (0: off, the proxy then takes a free loopback port)."""
    return {"host": cfg.http_host if cfg.http_port else "127.0.0.1", "port": cfg.http_port}


def base_url(cfg: AppConfig) -> str | None:
    """The OpenAI base URL of an app started with ``start`` (None: HTTP off)."""
    return f"http://{cfg.http_host}:{cfg.http_port}{cfg.route_prefix.rstrip('/')}/v1" if cfg.http_port else None


def start(cfg: AppConfig, blocking: bool = False):
    """Start Serve's gRPC proxy on ``cfg.grpc_port`` and HTTP proxy on ``cfg.http_port`` (loopback Ray assumed up)
    and run the app."""
    serve.start(grpc_options=grpc_options(cfg.grpc_port), http_options=http_options(cfg))
    return deploy(cfg, blocking)


def deploy(cfg: AppConfig, blocking: bool = False):
    """Run the app under cfg.app_name on the running Serve: a first deployment, or an in-place update of one
    (Serve replaces only the deployments whose settings changed)."""
    return serve.run(build_app(cfg), name=cfg.app_name, route_prefix=cfg.route_prefix, blocking=blocking)


def wait_calibrated(cfg: AppConfig, timeout_s: float = CALIBRATION_WAIT_S) -> bool:
    """Wait until a router of each of the app's models has timed its workers' forwards (Router.calibrated,
    started as the router starts), so that the first auto request is served at full speed; other router
    replicas calibrate in the background. False: one took longer than ``timeout_s`` (it goes on meanwhile)."""
    from ray.exceptions import GetTimeoutError

    names = [router_name("")] if not cfg.models else [router_name(_suffix(key)) for key in cfg.model_configs]
    try:
        for name in names:
            serve.get_deployment_handle(name, cfg.app_name).calibrated.remote().result(timeout_s=timeout_s)
    except (TimeoutError, GetTimeoutError):
        return False
    return True
