"""``calid serve`` and ``calid demo``: the Serve app on an embedded, loopback-only Ray."""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import threading
import time

from pydantic import ValidationError

from calid.errors import CalidError
from calid.models.source import served_name
from serve_app.cluster.config import AppConfig, ConfigError, add_topology_arg, reasons
from serve_app.cluster.config_file import changes, describe, read_config_file, refused_in_place


def add_parsers(sub) -> None:
    for name, help_text, run in (
            ("serve", "start an embedded local Ray and serve the calid app over gRPC", cmd_serve),
            ("demo", "start the server, stream real prompts in several modes through the SDK, stop", cmd_demo)):
        p = sub.add_parser(name, help=help_text)
        add_server_args(p)
        if name == "demo":
            p.add_argument("--max-new-tokens", type=int, default=64)
        p.set_defaults(func=run)


def add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--small", action="store_true",
                   help="SmolLM2-135M target with its first 16 layers as draft (fast to load)")
    p.add_argument("--target", default=None, help="target model spec (default: the Qwen 1.5B preset)")
    p.add_argument("--draft", default=None, help="draft model spec, self:N, or none")
    p.add_argument("--config", default=None, metavar="APP.YAML",
                   help="the app's settings from a file (AppConfig fields, or a Serve config with one calid app; "
                        "docs/serving.md); flags given as well override it. calid serve re-reads it on SIGHUP and "
                        "applies what changed in place")
    # None: not given, so that a --config file's value stands (the defaults are AppConfig's)
    p.add_argument("--port", type=int, default=None, help="gRPC port on 127.0.0.1 (default 50051)")
    p.add_argument("--http-port", type=int, default=None,
                   help="OpenAI-compatible HTTP API on 127.0.0.1 (default 8000; 0 turns it off)")
    p.add_argument("--max-active", type=int, default=None, help="requests decoded at once (default 16)")
    p.add_argument("--queue-capacity", type=int, default=None,
                   help="waiting requests before RESOURCE_EXHAUSTED (default 64)")
    p.add_argument("--no-dashboard", action="store_true", help="do not start the Ray dashboard")
    p.add_argument("--address", default=None,
                   help="join this running Ray cluster (its GCS host:port, or 'auto' for the one `ray start` "
                        "recorded) instead of starting an embedded loopback Ray; RAY_ADDRESS does the same")
    p.add_argument("--backend", default=None, choices=["auto", "torch", "llamacpp"],
                   help="both models' backend (default auto: llama.cpp on CPU for GGUF models)")
    p.add_argument("--dtype", default=None, choices=["auto", "fp32", "bf16"], help="torch dtype (default auto)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="batch-invariant forwards on both backends (llama.cpp: exact calls of at most 3 rows; torch: "
                        "fixed-shape kernels): a request's greedy output does not depend on what shares its batch, "
                        "at 2-2.5x less throughput under load (docs/decoding.md: lossless and deterministic)")
    p.add_argument("--api-keys-file", default=None,
                   help="require API keys: a file with one accepted key per line (clients: --api-key)")
    p.add_argument("--tls-cert", default=None, help="PEM certificate: serve gRPC over TLS (with --tls-key)")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--models", default=None, metavar="[NAME=]TARGET[+DRAFT],...",
                   help="serve several models from one app (AlpaServe), each with its own router, draft and "
                        "target replicas; requests name theirs (proto/SDK `model`). E.g. "
                        "'qwen2.5-coder-1.5b-instruct+qwen2.5-coder-0.5b-instruct,qwen2.5-coder-0.5b-instruct,"
                        "smol=smollm2-135m-instruct+self:16' (overrides --target/--draft)")
    add_topology_arg(p)
    p.set_defaults(topology=None)  # engine unless the flag or a --config file says otherwise
    p.add_argument("--drain-grace-s", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, how long requests in flight may run before shutdown (default 30)")


def config_from_args(args) -> AppConfig:
    """The app's config: AppConfig's defaults (topology engine), then the --config file's fields, then the flags
    given."""
    path = getattr(args, "config", None)
    fields = read_config_file(path) if path else {}
    fields.setdefault("topology", "engine")
    fields.update(flag_fields(args))
    try:
        return AppConfig.small(**fields) if args.small else AppConfig(**fields)
    except ValidationError as e:
        raise ConfigError(f"invalid server options{f' (--config {path})' if path else ''}: {reasons(e)}") from None


def flag_fields(args) -> dict:
    """The AppConfig fields the command line sets (those win over a --config file)."""
    fields = {k: v for k, v in (("grpc_port", args.port), ("http_port", args.http_port),
                                ("max_active", args.max_active), ("queue_capacity", args.queue_capacity),
                                ("topology", getattr(args, "topology", None))) if v is not None}
    if args.target:
        fields["target"] = args.target
    if args.draft:
        fields["draft"] = None if args.draft == "none" else args.draft
    if args.backend:
        fields["target_backend"] = fields["draft_backend"] = args.backend
    if args.dtype:
        fields["dtype"] = args.dtype
    if getattr(args, "batch_invariant", False):
        fields["batch_invariant"] = True
    if getattr(args, "api_keys_file", None):
        fields["api_keys_file"] = args.api_keys_file
    if getattr(args, "tls_cert", None) or getattr(args, "tls_key", None):
        fields["tls_cert_file"], fields["tls_key_file"] = args.tls_cert, args.tls_key
    if getattr(args, "models", None):
        fields["models"] = parse_models(args.models)
    return fields


def parse_models(text: str) -> list[dict]:
    """``--models``: comma-separated ``[NAME=]TARGET[+DRAFT]``; NAME defaults to the target's served name."""
    models = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        name, _, spec = item.rpartition("=")
        target, _, draft = spec.partition("+")
        if not target:
            raise ConfigError(f"--models: {item!r} names no target model ([NAME=]TARGET[+DRAFT])")
        models.append({"name": name or served_name(target), "target": target, "draft": draft or None})
    if not models:
        raise ConfigError("--models: no model given ([NAME=]TARGET[+DRAFT],...)")
    return models


def cmd_serve(args) -> int:
    """Serve until SIGTERM or SIGINT, then drain: admit nothing new, let the requests in flight finish
    (at most --drain-grace-s), shut Ray down (no process left behind) and exit 0. A signal while starting (Ray,
    the models, the app) stops at once, unless the app's proxies already took requests (they answer before the
    start returns): those drain as above. A second signal while draining stops at once (StopNow). Exit 0 (130 for
    Ctrl-C where it stops at once); every stop says in one line what it dropped."""
    cfg = config_from_args(args)
    stop, starting, reload = threading.Event(), threading.Event(), threading.Event()
    serving = (", ".join(f"{m.name} (target {m.target}, draft {m.draft})" for m in cfg.models) if cfg.models
               else f"target {cfg.target}, draft {cfg.draft}")
    print(f"[calid] starting Ray and the calid app ({serving}) ...", file=sys.stderr)
    _on_signals(stop, starting, reload)
    try:
        try:
            url = _start(cfg, args, starting)
        except StoppedWhileStarting as e:
            _exit_if_ray_gone()
            left = _in_flight(cfg.app_name)  # the proxies answer before the start returns: requests may be in
            if not left:
                print(f"[calid] {e.name} while starting: no request had been admitted, none dropped", file=sys.stderr)
                return 130 if e.name == "SIGINT" else 0
            print(f"[calid] {e.name} while starting, with {left} request{'s' if left != 1 else ''} already in "
                  "flight: draining", file=sys.stderr, flush=True)
            stop.set()
            _on_signals(stop, starting, reload)
        else:
            _on_signals(stop, starting, reload)  # in case Ray or Serve replaced ours while starting
            _say_serving(cfg, args, url)
            while not stop.wait(0.5):
                if reload.is_set():
                    reload.clear()
                    cfg = apply_config_file(args, cfg)
        _exit_if_ray_gone()
        drain(cfg.app_name, args.drain_grace_s)
    except StopNow as e:
        for sig in (signal.SIGTERM, signal.SIGINT):  # stopping already: a third signal changes nothing
            signal.signal(sig, lambda *_: print("[calid] already stopping", file=sys.stderr, flush=True))
        _exit_if_ray_gone()
        left = _in_flight(cfg.app_name)
        print(f"[calid] a second {e.name}: stopping now; "
              + ("requests in flight, if any, end UNAVAILABLE" if left is None else
                 f"{left} request{'s' if left != 1 else ''} in flight end{'s' if left == 1 else ''} UNAVAILABLE"),
              file=sys.stderr, flush=True)
        return 130 if e.name == "SIGINT" else 0
    finally:
        _exit_if_ray_gone()
        print("[calid] shutting down Ray", file=sys.stderr)
        _shutdown_bounded()
    return 0


def _start(cfg: AppConfig, args, starting: threading.Event) -> str | None:
    """Start Ray, Serve and the app (the dashboard URL); a signal meanwhile raises StoppedWhileStarting."""
    from serve_app.cluster.local import serve_app

    starting.set()
    try:
        return serve_app(cfg, dashboard=not args.no_dashboard, address=args.address)
    except (CalidError, StoppedWhileStarting):
        raise
    except SystemExit as e:  # Ray's own SIGTERM handler, in place while ray.init runs: sys.exit(signum)
        if e.code == signal.SIGTERM:
            raise StoppedWhileStarting("SIGTERM") from None
        raise
    except Exception as e:  # Ray or Serve could not start (a busy port, a proxy that died, ...)
        raise CalidError(f"could not start the calid app: {_one_line(e)}") from None
    finally:
        starting.clear()


def _say_serving(cfg: AppConfig, args, url: str | None) -> None:
    tls = " over TLS" if cfg.tls_cert_file else ""
    print(f"[calid] serving gRPC{tls} on 127.0.0.1:{cfg.grpc_port} (app {cfg.app_name})", file=sys.stderr)
    _print_http(cfg, "[calid]", sys.stderr)
    if url:
        print(f"[calid] Ray dashboard: {url}  (Serve tab: replicas; Metrics tab: calid panels)", file=sys.stderr)
    print(f'[calid] try: calid client "Write a haiku about caches" --address 127.0.0.1:{cfg.grpc_port}; '
          "Ctrl-C or SIGTERM stops (after draining)", file=sys.stderr)
    if args.config:
        print(f"[calid] pid {os.getpid()}: after editing {args.config}, `kill -HUP {os.getpid()}` applies it in "
              "place (requests in flight finish)", file=sys.stderr, flush=True)


def _exit_if_ray_gone() -> None:
    """Exit 0 at once, saying so, if Ray's own processes are gone: every call into Ray would wait a minute for its
    GCS and end with Ray's "The program will terminate"."""
    from serve_app.cluster.local import abandon_ray, ray_lost

    time.sleep(0.5)  # a signal to the whole process group reaches Ray's processes too: let them go first
    if ray_lost():
        print("[calid] the signal ended Ray's own processes too (sent to the whole process group): requests in "
              "flight, if any, were dropped; exiting", file=sys.stderr)
        abandon_ray()


class StopNow(BaseException):
    """A second SIGTERM or SIGINT while draining: stop without waiting for the requests in flight."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


def _in_flight(app: str, timeout_s: float = 10.0) -> int | None:
    """Requests the router holds (None: it cannot say within ``timeout_s``: a Serve stopped half-way through its
    start may never answer, and a stop must not wait for it)."""
    from ray import serve

    answer: list[int] = []

    def ask():
        try:
            answer.append(serve.get_deployment_handle("router", app).stats.remote().result(timeout_s=5)["requests"])
        except Exception:
            pass

    asking = threading.Thread(target=ask, name="calid-in-flight", daemon=True)
    asking.start()
    asking.join(timeout_s)
    return answer[0] if answer else None


SHUTDOWN_S = 60.0  # Ray's and Serve's own shutdown, at most; past it calid ends Ray's processes itself


def _shutdown_bounded() -> None:
    """Shut Serve and Ray down; if they have not within SHUTDOWN_S, end the Ray processes calid started
    (abandon_ray) and exit 0: a stop never hangs and leaves nothing behind. (Once, in a full test run, a SIGTERM
    during start-up left ``calid serve`` running past 120 s; where it waited was not caught, and 12 tries at
    other moments of the start stopped in 11-17 s.)"""
    from serve_app.cluster.local import abandon_ray, shutdown

    def give_up():
        print(f"[calid] Ray did not shut down within {SHUTDOWN_S:g} s; ending its processes", file=sys.stderr,
              flush=True)
        abandon_ray()

    watchdog = threading.Timer(SHUTDOWN_S, give_up)
    watchdog.daemon = True
    watchdog.start()
    try:
        shutdown()
    finally:
        watchdog.cancel()


class StoppedWhileStarting(BaseException):
    """A SIGTERM or SIGINT arrived before the app was serving (a BaseException: no ``except Exception`` on the
    way out of Ray's or Serve's start-up swallows it)."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


def _print_http(cfg, tag: str, out) -> None:
    from serve_app.cluster.app import base_url

    url = base_url(cfg)
    if cfg.models:
        print(f"{tag} models: {', '.join(m.name for m in cfg.models)} (requests name theirs); gRPC: calid client "
              f"\"Say hi\" --model {cfg.models[0].name} --address 127.0.0.1:{cfg.grpc_port}", file=out, flush=True)
    if url is None:
        print(f"{tag} HTTP API off (--http-port 0)", file=out, flush=True)
        return
    model = cfg.models[0].name if cfg.models else served_name(cfg.target)
    print(f"{tag} OpenAI-compatible API: {url}  (model {model!r}{' and the others' if cfg.models else ''}; any "
          f"openai/LangChain client with base_url={url})", file=out, flush=True)
    print(f"{tag} try: curl -s {url}/chat/completions -H 'Content-Type: application/json' -d "
          f"'{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Say hi\"}}], "
          f"\"max_tokens\": 16}}'", file=out, flush=True)


def _on_signals(stop: threading.Event, starting: threading.Event | None = None,
                reload: threading.Event | None = None) -> None:
    """SIGTERM/SIGINT: while ``starting`` is set, abort the start (StoppedWhileStarting); after, set ``stop``
    (drain); a second signal stops draining (StopNow). SIGHUP sets ``reload`` (re-read --config)."""
    def handler(signum, frame):
        name = signal.Signals(signum).name
        _quiet_ray_threads()
        if starting is not None and starting.is_set():
            raise StoppedWhileStarting(name)
        if stop.is_set():  # a second signal: stop draining
            raise StopNow(name)
        print(f"[calid] {name}: draining", file=sys.stderr)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    if reload is not None:
        signal.signal(signal.SIGHUP, lambda signum, frame: reload.set())


def _quiet_ray_threads() -> None:
    """From the first stop signal on, an exception in one of Ray's own driver threads (named ray_*: the one that
    prints the workers' logs, the one that reads their errors) is not printed: a signal sent to the whole process
    group ends Ray's processes too, and those threads then fail to reach its GCS with a traceback that says less
    than the stop's own line (seen once in the suite: ray_print_logs, RpcError, after "SIGTERM while starting").
    Any other thread's exception is printed as before."""
    if getattr(threading.excepthook, "calid_quiet", False):
        return
    printed = threading.excepthook

    def hook(args):
        if args.thread is None or not args.thread.name.startswith("ray_"):
            printed(args)
    hook.calid_quiet = True
    threading.excepthook = hook


def apply_config_file(args, cfg: AppConfig) -> AppConfig:
    """SIGHUP: re-read --config and apply what changed to the running app (Serve's in-place update: a router
    replica that is replaced stops taking requests and finishes those it holds; requests that arrive meanwhile
    wait for the new one). Returns the config now served; a file that cannot be applied is said in one line and
    the server goes on as it was."""
    from serve_app.cluster.local import redeploy

    if not args.config:
        print("[calid] SIGHUP: no --config file to re-read; nothing changed", file=sys.stderr, flush=True)
        return cfg
    try:
        new = config_from_args(args)
    except CalidError as e:
        print(f"[calid] {args.config} not applied: {e}", file=sys.stderr, flush=True)
        return cfg
    diff = changes(cfg, new)
    why = refused_in_place(cfg, diff)
    if why:
        print(f"[calid] {args.config} not applied: {why}", file=sys.stderr, flush=True)
        return cfg
    if not diff:
        shadowed = sorted(set(read_config_file(args.config)) & set(flag_fields(args)))
        print(f"[calid] {args.config} unchanged; nothing to apply"
              + (f" ({', '.join(shadowed)}: set by flags, which win over the file)" if shadowed else ""),
              file=sys.stderr, flush=True)
        return cfg
    print(f"[calid] applying {args.config}: {describe(diff)} (requests in flight finish on the replica that "
          "holds them)", file=sys.stderr, flush=True)
    start = time.monotonic()
    try:
        redeploy(new)
    except CalidError as e:
        print(f"[calid] {args.config} not applied: {e}", file=sys.stderr, flush=True)
        return cfg
    except Exception as e:
        print(f"[calid] {args.config} not applied: {_one_line(e)}", file=sys.stderr, flush=True)
        return cfg
    print(f"[calid] applied {args.config} in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    return new


def drain(app: str, grace_s: float) -> int:
    """Stop the router admitting and wait for its requests in flight; returns how many were left."""
    from ray import serve

    router = serve.get_deployment_handle("router", app)
    left = router.drain.remote(grace_s).result(timeout_s=10)["requests"]
    end = time.monotonic() + grace_s
    print(f"[calid] admitting no new requests; {left} in flight, waiting up to {grace_s:g} s", file=sys.stderr)
    while left and time.monotonic() < end:
        time.sleep(0.5)
        left = router.stats.remote().result(timeout_s=10)["requests"]
    if left:
        print(f"[calid] {left} requests still in flight after {grace_s:g} s; they end UNAVAILABLE", file=sys.stderr)
    return left


def _one_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"


EDGE = "@edge"  # a demo mode with this suffix drafts in the demo's own process (Collaborate)
DEMO_REQUESTS = [
    ("ar", "Write a Python function that returns the n-th Fibonacci number."),
    ("speculative", "Write a Python function that returns the n-th Fibonacci number."),
    ("filter", "Explain in two sentences what a KV cache is in a transformer."),
    ("lookahead", "Rewrite this sentence in plural: The cat sat on the mat and the cat slept."),
    ("tree", "List three uses of a hash map."),
    ("speculative" + EDGE, "Write a Python function that checks whether a string is a palindrome."),
]


async def _demo_requests(address: str, app: str, max_new_tokens: int, local_draft: str | None
                         ) -> list[tuple[str, str, dict]]:
    from calid.client import AsyncClient

    async def one(c, i, label, prompt):
        mode = label.removesuffix(EDGE)
        text, line, stats = [], "", {}
        # filter at the server's default threshold, the pair's operating point: what a user should start from
        async for chunk in c.stream(prompt, mode=mode, max_new_tokens=max_new_tokens):
            text.append(chunk.text)
            line += chunk.text
            while "\n" in line:
                head, line = line.split("\n", 1)
                print(f"  [{i}:{label:16}] {head}", flush=True)
            stats = chunk.stats or stats
        if line:
            print(f"  [{i}:{label:16}] {line}", flush=True)
        return label, "".join(text), stats

    requests = [(m, p) for m, p in DEMO_REQUESTS if local_draft or not m.endswith(EDGE)]
    async with AsyncClient(address, app=app, timeout=1800) as c, \
            AsyncClient(address, app=app, timeout=1800, local_draft=local_draft) as edge:
        return await asyncio.gather(*[one(edge if m.endswith(EDGE) else c, i, m, p)
                                      for i, (m, p) in enumerate(requests)])


def cmd_demo(args) -> int:
    """Start the server, send real prompts in several modes concurrently, print streams and stats, shut down."""
    from serve_app.cluster.local import serve_app

    cfg = config_from_args(args)
    start = time.perf_counter()
    print(f"[demo] starting an embedded Ray + calid (target {cfg.target}, draft {cfg.draft}) ...", flush=True)
    try:
        url = serve_app(cfg, dashboard=not args.no_dashboard, address=args.address)
        print(f"[demo] ready in {time.perf_counter() - start:.0f} s: gRPC 127.0.0.1:{cfg.grpc_port}"
              + (f", Ray dashboard {url}" if url else ""), flush=True)
        _print_http(cfg, "[demo]", sys.stdout)
        edge = f"; {'speculative' + EDGE} drafts here, with a local {cfg.draft} (Collaborate)" if cfg.draft else ""
        print(f"[demo] concurrent streams through the SDK, one per mode (filter at its default threshold "
              f"{cfg.filter_point:g}, {cfg.filter_default[1]}){edge}:", flush=True)
        t0 = time.perf_counter()
        results = asyncio.run(_demo_requests(f"127.0.0.1:{cfg.grpc_port}", cfg.app_name, args.max_new_tokens,
                                             cfg.draft))
        wall = time.perf_counter() - t0
        print(f"\n[demo] per-request stats ({wall:.1f} s wall for all {len(results)} together):")
        print(f"  {'mode':16} {'tokens':>6} {'tok/s':>6} {'TTFT ms':>8} {'from draft':>10} {'target calls':>12} "
              f"{'mean accepted':>13}")
        for mode, _, s in results:
            print(f"  {mode:16} {s.get('output_tokens', 0):>6} {s.get('tokens_per_s', 0):>6.2f} "
                  f"{s.get('ttft_ms', 0):>8.0f} {s.get('filtered_fraction', 0):>10.0%} {s.get('target_calls', 0):>12} "
                  f"{s.get('mean_accepted', 0):>13.2f}")
        if url:
            print(f"[demo] the dashboard ({url}) shows the replicas under Serve; the calid metrics "
                  "(docs/serving.md: Dashboard and metrics) under Metrics")
    finally:
        print("[demo] shutting down", flush=True)
        _shutdown_bounded()
    return 0
