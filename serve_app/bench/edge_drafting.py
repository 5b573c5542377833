"""``calid bench edge``: clients that draft on their own machine vs the cluster drafting for them, vs ar.

One server (``calid serve``'s app, embedded), N client processes, one request each, all started together
(a barrier), side by side in one run:
  ar        the target alone;
  cluster   mode filter / speculative with the server's own draft model;
  edge      the same modes through Collaborate, each client drafting with a local copy of the draft.
Per run: target forwards per output token (the target worker's batched forward passes), server CPU
seconds per output token (every process of the embedded Ray, the client processes excluded), and per
client tokens/s and time to first token, each as a ratio to ar. Every client process drafts with
``--draft-threads`` CPU threads: on a machine that hosts server and clients together they compete for
the same cores, which a real deployment (clients on their own devices) does not.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

COLUMNS = ["mode", "drafted", "clients", "tokens", "target_fwd_per_tok", "fwd_vs_ar", "server_cpu_ms_per_tok",
           "cpu_vs_ar", "client_tok_s_p50", "tok_s_vs_ar", "ttft_ms_p50", "ttft_ms_p99", "client_drafting",
           "from_draft"]
TARGETS = {"filter": 0.3, "speculative": 0.5}  # most target work per output token vs ar, at the edge
TOK_S_TARGET = 1.5


def add_parser(sub) -> None:
    p = sub.add_parser("edge", help="clients drafting at the edge (Collaborate) vs in the cluster vs ar")
    p.add_argument("--small", action="store_true", help="SmolLM2-135M with self:16 instead of the Qwen pair")
    p.add_argument("--clients", type=int, default=8, help="client processes, one request each (default 8)")
    p.add_argument("--modes", default="filter,speculative", help="draft modes to compare (default both)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--threshold", type=float, default=None, help="confidence threshold (default: the server's)")
    p.add_argument("--draft-threads", type=int, default=1, help="CPU threads of each client's draft (default 1)")
    p.add_argument("--port", type=int, default=50062)
    p.add_argument("--out", default="bench_results")
    p.set_defaults(func=run)


def run(args) -> int:
    from calid.bench.data import humaneval_prompts
    from calid.bench.hardware import decode_limit_tok_s, memory_bandwidth_gbs
    from calid.bench.report import write_report
    from calid.backends import cpu_summary, open_model
    from calid.edge import EDGE_MODES
    from calid.errors import CalidError
    from calid.progress import progress
    from serve_app.cluster.config import AppConfig
    from serve_app.cluster.local import serve_app, shutdown

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in EDGE_MODES for m in modes):
        raise CalidError(f"--modes must be a comma-separated subset of {', '.join(EDGE_MODES)}, got {args.modes!r}")
    if args.clients < 1 or args.max_new_tokens < 1 or args.draft_threads < 1:
        raise CalidError("--clients, --max-new-tokens and --draft-threads must be >= 1")
    base = AppConfig.small if args.small else AppConfig
    # every run sends the same prompts: no prompt cache, or a run after the first would skip its prefills
    cfg = base(grpc_port=args.port, http_port=0, max_active=max(16, args.clients), queue_capacity=max(64, args.clients),
               prompt_cache=False)
    target_bytes = open_model(cfg.target, cfg.target_backend, cfg.dtype, log=lambda line: None).decode_read_bytes
    prompts = humaneval_prompts(args.clients)
    runs = [("ar", None)] + [(m, where) for m in modes for where in ("cluster", "edge")]
    print(f"bench edge: target {cfg.target}, draft {cfg.draft}; {args.clients} client processes, one request "
          f"each, {args.max_new_tokens} new tokens (EOS ignored), greedy; {cpu_summary()}", file=sys.stderr)
    bandwidth = memory_bandwidth_gbs()
    serve_app(cfg, dashboard=False)
    rows = []
    try:
        with progress(len(runs), "bench edge", "run") as bar:
            for mode, where in runs:
                rows.append(_measure(cfg, args, prompts, mode, where))
                bar.update(1)
    finally:
        shutdown()
    ar = rows[0]
    for r in rows:
        r["fwd_vs_ar"] = r["target_fwd_per_tok"] / ar["target_fwd_per_tok"]
        r["cpu_vs_ar"] = r["server_cpu_ms_per_tok"] / ar["server_cpu_ms_per_tok"]
        r["tok_s_vs_ar"] = r["client_tok_s_p50"] / ar["client_tok_s_p50"]
    limit = decode_limit_tok_s(bandwidth, target_bytes)
    meta = {"target": cfg.target, "draft": cfg.draft, "clients": args.clients, "new_tokens": args.max_new_tokens,
            "cpu": cpu_summary(), "cores": os.cpu_count(), "bandwidth_GBps": round(bandwidth, 1),
            "target_weight_bytes_per_step": target_bytes, "decode_limit_tok_s": round(limit, 1)}
    notes = [
        "target_fwd_per_tok = the target worker's forward passes / output tokens of all clients (fwd_vs_ar: "
        "as a ratio to ar; targets at the edge: filter <= 0.3, speculative <= 0.5)",
        "server_cpu_ms_per_tok = CPU time of every server process (Ray, Serve proxy, router, workers) / output "
        "tokens; client processes are not counted",
        f"client_tok_s = one client's output tokens / its request's wall time (target: >= {TOK_S_TARGET}x ar); "
        f"ttft from the client's call to its first token",
        "client_drafting = the share of a client's wall time spent running its local draft (p50)",
        f"limit: bandwidth {bandwidth:.1f} GB/s / target weight bytes per step {target_bytes / 1e9:.2f} GB = "
        f"{limit:.1f} target steps/s, shared by every client of one batch",
        f"the clients run on this machine's {os.cpu_count()} cores beside the server; each drafts with "
        f"{args.draft_threads} thread(s)",
    ]
    js, md = write_report(Path(args.out), f"edge-{'small' if args.small else 'qwen'}",
                          "edge drafting (Collaborate) vs cluster drafting vs ar", meta, rows, COLUMNS, notes)
    print(md.read_text())
    print(_verdict(rows), file=sys.stderr)
    print(f"wrote {js} and {md}", file=sys.stderr)
    return 0


def _verdict(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        if r["drafted"] != "edge":
            continue
        goal = TARGETS[r["mode"]]
        lines.append(f"{r['mode']} at the edge: target work {r['fwd_vs_ar']:.2f}x ar (target <= {goal}: "
                     f"{'met' if r['fwd_vs_ar'] <= goal else 'missed'}), client tok/s {r['tok_s_vs_ar']:.2f}x ar "
                     f"(target >= {TOK_S_TARGET}: {'met' if r['tok_s_vs_ar'] >= TOK_S_TARGET else 'missed'})")
    return "\n".join(lines)


def _measure(cfg, args, prompts: list[str], mode: str, where: str | None) -> dict:
    """One run: every client process warms up (loading its local draft), waits at the barrier, then sends
    its one request; returns the run's row (ratios to ar are added by the caller)."""
    from ray import serve

    from calid.errors import CalidError

    target = serve.get_deployment_handle("target", cfg.app_name)
    ctx = mp.get_context("spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    local = cfg.draft if where == "edge" else None
    job = (f"127.0.0.1:{cfg.grpc_port}", cfg.app_name, local, args.draft_threads, mode, args.max_new_tokens,
           args.threshold)
    procs = [ctx.Process(target=_client, args=(job, p, ready, go, results), daemon=True) for p in prompts]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            msg = ready.get(timeout=900)
            if msg != "ready":
                raise CalidError(f"a client could not start: {msg}")
        clients = {p.pid for p in procs}
        cpu, forwards = _server_cpu_s(clients), target.stats.remote().result()["batches"]
        go.set()
        out = [results.get(timeout=3600) for _ in procs]
        cpu, forwards = _server_cpu_s(clients) - cpu, target.stats.remote().result()["batches"] - forwards
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    failed = [o["error"] for o in out if "error" in o]
    if failed:
        raise CalidError(f"{len(failed)} of {len(out)} clients failed; the first: {failed[0]}")
    tokens = sum(o["tokens"] for o in out)
    tok_s = [o["tokens"] / o["total_s"] for o in out]
    ttft = sorted(o["ttft_s"] * 1000 for o in out)
    return {"mode": mode, "drafted": where or "-", "clients": len(out), "tokens": tokens,
            "target_fwd_per_tok": forwards / tokens, "server_cpu_ms_per_tok": cpu * 1000 / tokens,
            "client_tok_s_p50": statistics.median(tok_s), "ttft_ms_p50": statistics.median(ttft),
            "ttft_ms_p99": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "client_drafting": statistics.median(o["drafting_s"] / o["total_s"] for o in out),
            "from_draft": sum(o["draft_tokens"] for o in out) / tokens}


def _server_cpu_s(clients: set[int]) -> float:
    """CPU seconds so far of this process and all its descendants (the embedded Ray: GCS, raylet, Serve's
    proxy and controller, the replicas), without the client processes and theirs."""
    import psutil

    me = psutil.Process()
    skip = set(clients)
    for pid in clients:
        try:
            skip |= {c.pid for c in psutil.Process(pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
    total = 0.0
    for p in [me] + me.children(recursive=True):
        if p.pid in skip:
            continue
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def _client(job: tuple, prompt: str, ready, go, results) -> None:
    """A client process: its own SDK client (and local draft), one timed streaming request."""
    address, app, local_draft, threads, mode, new, threshold = job
    import torch

    from calid.client import Client
    from calid.client.edge import LocalDraft

    torch.set_num_threads(threads)
    kw = {"mode": mode, "threshold": threshold}
    local = LocalDraft(local_draft, threads) if local_draft else None
    try:
        client = Client(address, app=app, timeout=3600, local_draft=local)
        client.generate("Say hi.", max_new_tokens=2, **kw)  # loads the local draft; warms every path
    except Exception as e:  # noqa: BLE001 - reported to the parent, which stops the run with it
        ready.put(f"{type(e).__name__}: {e}")
        return
    ready.put("ready")
    go.wait()
    drafted_before = local.draft_s if local else 0.0
    start, first, tokens, stats = time.perf_counter(), None, 0, {}
    try:
        for chunk in client.stream(prompt, max_new_tokens=new, ignore_eos=True, **kw):
            first = first or time.perf_counter()
            tokens += len(chunk.token_ids)
            stats = chunk.stats or stats
        end = time.perf_counter()
        results.put({"tokens": tokens, "total_s": end - start, "ttft_s": (first or end) - start,
                     "draft_tokens": int(stats.get("draft_tokens", 0)),
                     "drafting_s": (local.draft_s if local else 0.0) - drafted_before})
    except Exception as e:  # noqa: BLE001
        results.put({"error": f"{type(e).__name__}: {e}"})
    finally:
        client.close()
