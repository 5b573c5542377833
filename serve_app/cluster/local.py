"""An embedded, loopback-only Ray + Serve for ``calid serve``, the demo and the tests."""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

from calid.hugepages import child_env
from calid.errors import CalidError

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
    """Must run before ``ray`` is first imported: Ray reads these once, at import. Also puts malloc's huge-page
    tunable in the environment the embedded Ray's processes (the model replicas) start with (calid.hugepages)."""
    for k, v in LOOPBACK_ENV.items():
        os.environ.setdefault(k, v)
    os.environ.update(child_env())


def start_ray(num_cpus: int | None = None, dashboard: bool = True, address: str | None = None) -> str | None:
    """Start an embedded Ray on 127.0.0.1, or join the cluster at ``address`` (else RAY_ADDRESS) when one is asked
    for; returns the dashboard URL of a Ray started here, if any.

    An embedded Ray never attaches to a cluster nobody asked for: Ray's own ``ray.init()`` would join whatever
    ``/tmp/ray/ray_current_cluster`` names, and after a Ray killed uncleanly that is a dead GCS it waits on for
    minutes. A stale record is said in one line and ignored; an asked-for cluster that does not answer is refused
    in one line (ClusterUnreachable) within seconds."""
    loopback_env()
    import ray

    global _owned
    if ray.is_initialized():
        return None
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is not None:
        check_cluster_answers(address)
        with _keep_sigterm_handler():
            ray.init(address=address, log_to_driver=False, configure_logging=True, logging_level="warning")
        return None
    stale = stale_cluster_record()
    if stale:
        print(f"[calid] ignoring {stale}; starting an embedded Ray", file=sys.stderr, flush=True)
    _owned = True
    with _keep_sigterm_handler():  # ray.init's own exits at once, with a native stack dump if mid-start
        ctx = ray.init(address="local", num_cpus=num_cpus or max(4, os.cpu_count() or 1),
                       include_dashboard=dashboard, dashboard_host="127.0.0.1", _node_ip_address="127.0.0.1",
                       log_to_driver=False, configure_logging=True, logging_level="warning")
    url = getattr(ctx, "dashboard_url", None)
    return f"http://{url}" if url else None


@contextlib.contextmanager
def _keep_sigterm_handler():
    """Put back the SIGTERM handler a caller installed before ray.init replaced it (main thread only)."""
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if main and before is not None:
            signal.signal(signal.SIGTERM, before)


class ClusterUnreachable(CalidError):
    """The Ray cluster asked for (--address / RAY_ADDRESS) does not answer."""


PROBE_TIMEOUT_S = 3.0


def check_cluster_answers(address: str) -> None:
    """Raise ClusterUnreachable unless something accepts connections at ``address`` (host:port, ray://host:port or
    "auto": the cluster Ray's record names) within PROBE_TIMEOUT_S."""
    where = address
    if address == "auto":
        recorded = _recorded_gcs()
        if recorded is None:
            raise ClusterUnreachable(f"RAY_ADDRESS/--address is 'auto' but {_record_path()} names no running Ray "
                                     "cluster; start one with `ray start --head`, or drop the address to run an "
                                     "embedded Ray")
        where = recorded
    host, _, port = where.split("://")[-1].rpartition(":")
    if not port.isdigit():
        raise ClusterUnreachable(f"Ray address {address!r} is not host:port")
    if not _answers(host or "127.0.0.1", int(port)):
        raise ClusterUnreachable(f"no Ray cluster answers at {where} (from --address or RAY_ADDRESS) within "
                                 f"{PROBE_TIMEOUT_S:g} s; start it, or drop the address to run an embedded Ray")


def ray_lost() -> bool:
    """Whether this process is connected to a Ray whose GCS no longer accepts connections. A signal sent to the
    whole process group (systemd's stop, ``kill -- -PGID``, a container's stop) ends Ray's own processes with
    calid's: every call into Ray would then wait a minute for a GCS that is gone."""
    import ray

    if not ray.is_initialized():
        return False
    host, _, port = ray.get_runtime_context().gcs_address.rpartition(":")
    return not _answers(host, int(port))


def abandon_ray() -> None:
    """Ray's processes are gone or going (ray_lost): end what is left of them, skip every call into
    Ray, and exit 0 now."""
    import psutil

    global _owned
    while _fronts:
        _fronts.pop().stop()
    if _owned:
        _end_processes(psutil.Process().children(recursive=True), grace_s=0.0)
    sys.stderr.flush()
    os._exit(0)


def stale_cluster_record() -> str | None:
    """If Ray's record of the last cluster names a GCS that does not answer (a Ray killed uncleanly), say so."""
    gcs = _recorded_gcs()
    if gcs is None:
        return None
    host, _, port = gcs.rpartition(":")
    if port.isdigit() and _answers(host, int(port)):
        return None
    return f"{_record_path()}: it names a Ray at {gcs} that no longer answers (a Ray killed uncleanly)"


def _record_path() -> Path:
    """Ray's record of the cluster ``ray start`` last started (ray._private.utils.read_ray_address reads it)."""
    return Path(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()) / "ray" / "ray_current_cluster"


def _recorded_gcs() -> str | None:
    try:
        text = _record_path().read_text().strip()
    except OSError:
        return None
    return text or None


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False


_fronts: list = []  # TLS fronts started by serve_app, stopped by shutdown
_apps: dict[str, object] = {}  # name -> config (AppConfig, as deployed) of the applications serve_app deployed here
_owned = False  # this process started the running Ray (start_ray), so shutdown ends it whole


def serve_app(cfg, num_cpus: int | None = None, dashboard: bool = True, address: str | None = None) -> str | None:
    """Start Ray (if needed; ``address``: join that cluster, see start_ray), Serve's gRPC proxy on cfg.grpc_port, and
    the calid app; returns the dashboard URL.

    With TLS configured, a TLS front (serve_app.ingress.tls) takes cfg.grpc_port and Serve's proxy a free
    loopback port behind it. Before a fresh start, a port already taken is refused in one line (PortInUse)
    instead of surfacing as a proxy that never comes up.
    """
    loopback_env()  # before serve_app.cluster.app imports ray
    import ray

    from serve_app.cluster.app import start

    # Serve's own INFO lines in this process ("Started Serve", "Connecting to existing Serve app ... will not be
    # applied", "Application ... is ready") repeat what calid says, and the second misleads; warnings stay
    logging.getLogger("ray.serve").setLevel(logging.WARNING)

    if not ray.is_initialized():
        check_ports_free(cfg)
    if cfg.tls_cert_file is not None:
        from serve_app.cluster.config import ConfigError
        from serve_app.ingress.tls import TlsFront

        internal = free_port()
        try:
            front = TlsFront(f"127.0.0.1:{cfg.grpc_port}", f"127.0.0.1:{internal}", cfg.tls_cert_file, cfg.tls_key_file)
        except OSError as e:
            raise ConfigError(f"TLS: cannot read {e.filename}: {e.strerror}") from None
        url = start_ray(num_cpus, dashboard, address)
        behind = cfg.model_copy(update={"grpc_port": internal})
        start(behind)
        _apps[cfg.app_name] = behind
        front.start()
        _fronts.append(front)
        _calibrated(behind)
        return url
    url = start_ray(num_cpus, dashboard, address)
    start(cfg)
    _apps[cfg.app_name] = cfg
    _calibrated(cfg)
    return url


def _calibrated(cfg) -> None:
    """Wait for the routers' timing of the models' forwards (auto mode's costs; seconds on a CPU), saying so."""
    from serve_app.cluster.app import CALIBRATION_WAIT_S, wait_calibrated

    start = time.perf_counter()
    print("[calid] timing the models' forwards for auto mode ...", file=sys.stderr, flush=True)
    if wait_calibrated(cfg):
        print(f"[calid] timed in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    else:
        print(f"[calid] still timing after {CALIBRATION_WAIT_S:.0f} s; serving meanwhile (auto requests wait for it)",
              file=sys.stderr, flush=True)


def redeploy(cfg) -> None:
    """Apply ``cfg`` to the application serve_app started under cfg.app_name (Serve's in-place update: only the
    deployments whose settings changed get new replicas); returns when the new version runs. The proxies stay:
    their ports (and TLS) are the running ones."""
    from serve_app.cluster.app import deploy

    running = _apps[cfg.app_name]
    if cfg.tls_cert_file is not None:  # Serve's proxy listens behind the TLS front
        cfg = cfg.model_copy(update={"grpc_port": running.grpc_port})
    deploy(cfg)
    _apps[cfg.app_name] = cfg


class PortInUse(CalidError):
    """A port calid is to listen on is taken; the message names it and the flag that changes it."""


def check_ports_free(cfg) -> None:
    """Raise PortInUse for the first of cfg's ports (gRPC, then HTTP unless off) that 127.0.0.1 cannot bind."""
    for port, what, flag in ((cfg.grpc_port, "gRPC", "--port"), (cfg.http_port, "HTTP", "--http-port")):
        if port and not _bindable(port):
            raise PortInUse(f"{what} port {port} on 127.0.0.1 is in use by another program; choose another with "
                            f"{flag}" + (" (0 turns HTTP off)" if flag == "--http-port" else ""))


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free to a server
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _end_requests(app: str) -> None:
    """End the requests still in flight on ``app``'s routers (UNAVAILABLE), so that deleting it does not wait
    out their graceful stop (request_timeout_s)."""
    from ray import serve

    try:  # "router" is the app's ingress: a model's router, or the multi-model front that drains every router
        if "router" in serve.status().applications[app].deployments:
            serve.get_deployment_handle("router", app).drain.remote(0.0).result(timeout_s=5)
    except Exception:  # an app that never came up, a router already gone: nothing of it to wait for
        pass


def shutdown() -> None:
    """Stop the app and Ray. On a Ray this process started, every application is deleted (its replicas stop
    gracefully) and Ray's shutdown then ends Serve's controller and proxies with the rest of the cluster:
    ``serve.shutdown()`` there leaves its own call to the controller in flight while the controller kills
    itself, and Ray prints that as a failed task ("ServeController.graceful_shutdown failed ... killed by
    ray.kill") at the end of every demo and benchmark. On a cluster joined (--address), only the applications
    deployed from here are deleted: Serve and the other applications there are not calid's to stop."""
    global _owned
    import ray
    from ray import serve
    from ray.serve.exceptions import RayServeException

    while _fronts:
        _fronts.pop().stop()
    try:
        if ray.is_initialized():
            try:
                apps = set(serve.status().applications)
            except RayServeException:  # Serve never started here
                apps = set()
            for name in apps if _owned else apps & set(_apps):
                _end_requests(name)
                try:
                    serve.delete(name)
                except TimeoutError:  # Serve waits 60 s at most; Ray's shutdown (owned) stops what is left
                    print(f"[calid] application {name!r} was not deleted within Serve's 60 s; "
                          + ("stopping Ray with it" if _owned else "it goes on stopping on the cluster"),
                          file=sys.stderr, flush=True)
    finally:  # whatever the deletion met, Ray ends (or, joined, this process leaves it)
        ours = _ray_processes() if _owned else []
        _owned = False
        _apps.clear()
        _close_handles()
        ray.shutdown()
        _end_processes(ours, grace_s=AGENT_EXIT_GRACE_S)


AGENT_EXIT_GRACE_S = 5.0  # Ray's agents notice their raylet is gone within about a second, unless still starting


def _ray_processes() -> list:
    """This process's descendants: the Ray it started (raylet, GCS, workers, the dashboard and runtime-env
    agents). Taken before ray.shutdown, which ends the raylet and GCS; an agent still starting up when that happens
    does not yet watch its raylet and would live on. Only children started from Ray's own package and their
    descendants: anything else this process started (a peer server a benchmark runs) is not Ray's."""
    import psutil
    import ray

    home = os.path.dirname(ray.__file__)
    found = []
    try:
        for child in psutil.Process().children():
            try:
                if any(home in arg for arg in child.cmdline()):
                    found += [child, *child.children(recursive=True)]
            except psutil.Error:
                pass
    except psutil.Error:
        pass
    return found


def _end_processes(procs: list, grace_s: float) -> None:
    """Wait up to ``grace_s`` for ``procs`` to exit on their own, then kill whatever is left."""
    import psutil

    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass


def _close_handles() -> None:
    """Stop this process's Serve handles while Ray is still up. A handle that has sent a request runs a metrics
    task on Serve's background loop; left running past ray.shutdown() it fails ("Ray has not been started yet")
    and logs that from its thread, which at interpreter exit ends as a ``--- Logging error ---`` traceback.
    serve.shutdown() does this first too, but it also stops the controller (see shutdown)."""
    try:
        from ray.serve import context

        client = context._global_client  # Serve keeps no public way to reach the handles it cached
        if client is not None:
            client.shutdown_cached_handles()
        context._set_global_client(None)
    except Exception:  # another Ray version's internals: at worst the old message at exit
        pass
