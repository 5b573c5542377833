"""An embedded, loopback-only Ray + Serve for ``calid serve``, the demo and the tests."""
from __future__ import annotations

import os

SERVE_GRPC_ENV = "RAY_SERVE_USE_GRPC_BY_DEFAULT"
MAX_WIRE_BYTES = 64 << 20
LOOPBACK_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # otherwise Ray binds the machine's external address
    "RAY_USAGE_STATS_ENABLED": "0",
    "GLOO_SOCKET_IFNAME": "lo",
    "RAY_AUTH_MODE": "disabled",
    # no implicit ray.init(): a Serve handle's background thread that outlives ray.shutdown() would otherwise
    # attach this process to whatever cluster is still up (seen in the tests: the next suite then found a
    # Ray "already running" on a cluster that was being torn down)
    "RAY_ENABLE_AUTO_CONNECT": "0",
    # autoscaling metrics every 2 s instead of 10 s, so that replicas follow load on a demo timescale
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "2",
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "2",
    # Serve's controller loop every 0.5 s instead of 0.1 s: on 2 cores its polling competes with the model's
    # threads; measured at one request in flight (Qwen 1.5B ar, 128 tokens), the controller's CPU fell from
    # 0.71 s to 0.22 s and the GCS's from 0.34 s to 0.11 s; autoscaling still decides 4 times per metrics push
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    # Serve's own metrics (request counts, queue lengths) pushed to Ray's metrics every 1 s instead of 0.1 s,
    # still well inside a dashboard's scrape interval: measured here with the Qwen pair served and idle, every
    # replica's and the proxy's CPU fell by a quarter to a half, Ray's processes in all from 2.52 s to 1.99 s
    # of CPU per 20 s (on 2 cores, background CPU is time stolen from the model's threads)
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
    # calls between deployments over Serve's direct gRPC channel instead of Ray actor calls: measured here,
    # a router -> target call's transport (call time - forward time) fell from 6.5 ms to 3.1 ms
    SERVE_GRPC_ENV: "1",
    # messages between the gRPC proxy and the router replica: gRPC's 4 MiB default made a large request fail
    # INTERNAL on that hop; up to this size the router refuses it by its own limit (INVALID_ARGUMENT), over
    # it the proxy does (RESOURCE_EXHAUSTED)
    "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": str(MAX_WIRE_BYTES),
    "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(MAX_WIRE_BYTES),
}


def loopback_env() -> None:
    """Must run before ``ray`` is first imported: Ray reads these once, at import."""
    for k, v in LOOPBACK_ENV.items():
        os.environ.setdefault(k, v)


def start_ray(num_cpus: int | None = None, dashboard: bool = True) -> str | None:
    """Start a local Ray on 127.0.0.1 (or reuse the running one); returns the dashboard URL if any."""
    loopback_env()
    import ray

    global _owned
    if not ray.is_initialized():
        _owned = True
        ctx = ray.init(num_cpus=num_cpus or max(4, os.cpu_count() or 1), include_dashboard=dashboard,
                       dashboard_host="127.0.0.1", _node_ip_address="127.0.0.1", log_to_driver=False,
                       configure_logging=True, logging_level="warning")
        url = getattr(ctx, "dashboard_url", None)
        return f"http://{url}" if url else None
    return None


_fronts: list = []  # TLS fronts started by serve_app, stopped by shutdown
_owned = False  # this process started the running Ray (start_ray), so shutdown ends it whole


def serve_app(cfg, num_cpus: int | None = None, dashboard: bool = True) -> str | None:
    """Start Ray (if needed), Serve's gRPC proxy on cfg.grpc_port, and the calid app; returns the dashboard URL.

    With TLS configured, a TLS front (serve_app.tls_front) takes cfg.grpc_port and Serve's proxy a free
    loopback port behind it.
    """
    loopback_env()  # before serve_app.app imports ray
    from serve_app.app import start

    if cfg.tls_cert_file is not None:
        from serve_app.config import ConfigError
        from serve_app.tls_front import TlsFront

        internal = free_port()
        try:
            front = TlsFront(f"127.0.0.1:{cfg.grpc_port}", f"127.0.0.1:{internal}", cfg.tls_cert_file, cfg.tls_key_file)
        except OSError as e:
            raise ConfigError(f"TLS: cannot read {e.filename}: {e.strerror}") from None
        url = start_ray(num_cpus, dashboard)
        start(cfg.model_copy(update={"grpc_port": internal}))
        front.start()
        _fronts.append(front)
        return url
    url = start_ray(num_cpus, dashboard)
    start(cfg)
    return url


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shutdown() -> None:
    """Stop the app and Ray. On a Ray this process started, every application is deleted (its replicas stop
    gracefully) and Ray's shutdown then ends Serve's controller and proxies with the rest of the cluster:
    ``serve.shutdown()`` there leaves its own call to the controller in flight while the controller kills
    itself, and Ray prints that as a failed task ("ServeController.graceful_shutdown failed ... killed by
    ray.kill") at the end of every demo and benchmark. On a Ray started elsewhere, Serve is shut down in it."""
    global _owned
    import ray
    from ray import serve
    from ray.serve.exceptions import RayServeException

    while _fronts:
        _fronts.pop().stop()
    try:
        if _owned and ray.is_initialized():
            try:
                apps = list(serve.status().applications)
            except RayServeException:  # Serve never started here
                apps = []
            for name in apps:
                serve.delete(name)
        else:
            serve.shutdown()
    finally:  # whatever the deletion met, Ray ends
        _owned = False
        ray.shutdown()
