"""``calid bench serve``: the same prompts through gRPC + Ray Serve vs the in-process engine.

Side by side in one run, same models, same greedy settings, fixed output
length (EOS ignored):
  concurrency 1   one request at a time, alternating the two paths; per request
                  the serving overhead = gRPC latency - in-process latency, split
                  into ingress (client latency - the router's own request time:
                  gRPC proxy, admission, response) and worker calls (the rest,
                  spread over the request's decoding steps);
  concurrency C   C requests at once through the SDK vs one engine batch of C.
"""
from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path

COLUMNS = ["mode", "concurrency", "requests", "tokens", "grpc_tok_s", "inproc_tok_s", "ratio", "overhead_ms_p50",
           "ingress_ms_p50", "per_step_ms_p50", "serving_ms_per_step", "fwd_vs_inproc", "same_tokens", "limit_tok_s"]


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="gRPC + Ray Serve vs the in-process engine (overhead, throughput per mode)")
    p.add_argument("--qwen", action="store_true", help="the Qwen 1.5B/0.5B pair instead of SmolLM2 + self:16")
    p.add_argument("--modes", default="ar,speculative,filter", help="comma-separated modes")
    p.add_argument("--requests", type=int, default=6, help="requests per mode at concurrency 1 (default 6)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--full", action="store_true", help="20 requests per mode, 64 new tokens")
    p.add_argument("--port", type=int, default=50061)
    p.add_argument("--out", default="bench_results")
    p.set_defaults(func=run)


def _p50(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _server_times(cfg) -> tuple[float, int, float]:
    """(router step seconds, router steps, forward seconds of every worker) so far."""
    from ray import serve

    router = serve.get_deployment_handle("router", cfg.app_name)
    stats, workers = router.stats.remote().result(), router.worker_stats.remote().result()
    return stats["step_s"], stats["steps"], sum(w["busy_s"] for w in workers.values())


def _model_forward_s(cfg) -> tuple[float, float, int]:
    """(seconds every worker's model has spent inside its own forwards, the target's of them, the target's
    forwards) so far (RunnerStats; 0 for a worker that reports none, e.g. a sharded target)."""
    from ray import serve

    workers = serve.get_deployment_handle("router", cfg.app_name).worker_stats.remote().result()
    target = workers.get("target", {})
    return (sum(w.get("forward_s", 0.0) for w in workers.values()), target.get("forward_s", 0.0),
            target.get("forwards", 0))


def _serving_ms(cfg, before: tuple[float, int, float], inproc_s: float) -> tuple[float, float]:
    """(serving ms per router step, the workers' forward seconds / the in-process run's seconds)."""
    step_s, steps, forward = (b - a for a, b in zip(before, _server_times(cfg)))
    return ((step_s - forward) * 1000 / steps if steps else float("nan")), forward / inproc_s


def run(args) -> int:
    from calid.bench.data import humaneval_prompts
    from calid.bench.hardware import decode_limit_tok_s, memory_bandwidth_gbs
    from calid.bench.report import write_report
    from calid.client import Client
    from calid.decoding.modes import MODES
    from calid.engine import Engine
    from calid.errors import CalidError
    from calid.generation import GenerationRequest, SamplingParams
    from calid.backends import open_draft, open_model
    from calid.progress import progress
    from calid.text import encode_prompt
    from serve_app.cluster.config import AppConfig
    from serve_app.cluster.local import serve_app, shutdown

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise CalidError(f"--modes must be a comma-separated subset of {', '.join(MODES)}, got {args.modes!r}")
    n, new = (20, 64) if args.full else (args.requests, args.max_new_tokens)
    if n < 1 or new < 1 or args.concurrency < 1:
        raise CalidError("--requests, --max-new-tokens and --concurrency must be >= 1")
    # every mode runs the same prompts: no prompt cache, or a mode after the first would skip its prefills
    cfg = (AppConfig if args.qwen else AppConfig.small)(grpc_port=args.port, http_port=0, max_active=args.concurrency,
                                                       prompt_cache=False)
    target = open_model(cfg.target, cfg.target_backend, cfg.dtype, invariant=cfg.batch_invariant,
                        prompt_cache=cfg.prompt_cache, prefill_weights=cfg.prefill_weights)
    draft = open_draft(cfg.draft, target, cfg.draft_backend, cfg.dtype, invariant=cfg.batch_invariant,
                       prompt_cache=cfg.prompt_cache, weights=cfg.draft_weights, prefill_weights=cfg.prefill_weights)
    engine = Engine(target.runner, target.tokenizer, target.eos_ids, draft=draft.runner, max_batch=args.concurrency,
                    max_forward_tokens=cfg.max_forward_tokens)
    texts = humaneval_prompts(max(n, args.concurrency))
    ids = [encode_prompt(target.tokenizer, t) for t in texts]
    print(f"bench serve: target {cfg.target}, draft {cfg.draft}; modes {modes}; {n} requests at concurrency 1, "
          f"{args.concurrency} at once; {new} new tokens (EOS ignored), greedy", file=sys.stderr)
    bandwidth = memory_bandwidth_gbs()
    limit1 = decode_limit_tok_s(bandwidth, target.decode_read_bytes)
    serve_app(cfg, dashboard=False)
    rows = []
    try:
        address = f"127.0.0.1:{cfg.grpc_port}"
        with Client(address, app=cfg.app_name, timeout=1800) as c, \
                progress(len(modes) * (2 * n + 2), "bench serve", "run") as bar:
            c.generate(texts[0], max_new_tokens=4, raw_prompt=False)  # warm-up both paths
            engine.generate([GenerationRequest(ids[0], SamplingParams(max_new_tokens=4))])
            rtt = _health_rtt_ms(c)
            for mode in modes:
                run = _ModeRun(cfg, engine, c, address, mode, texts, ids, new, limit1)
                rows.append(run.one_at_a_time(n, bar))
                rows.append(run.burst(args.concurrency, bar))
    finally:
        shutdown()
    meta = {"target": cfg.target, "draft": cfg.draft, "new_tokens": new, "bandwidth_GBps": round(bandwidth, 1),
            "health_rtt_ms_p50": round(_p50(rtt), 1),
            "target_weight_bytes_per_step": target.decode_read_bytes}
    notes = _notes(bandwidth, _p50(rtt), target.decode_read_bytes)
    js, md = write_report(Path(args.out), f"serve-{'qwen' if args.qwen else 'small'}",
                          "calid over gRPC + Ray Serve vs in-process", meta, rows, COLUMNS, notes)
    print(md.read_text())
    print(f"wrote {js} and {md}", file=sys.stderr)
    return 0


def _health_rtt_ms(c) -> list[float]:
    """30 Health calls: the floor of any call (client -> Serve gRPC proxy -> router replica -> back), in ms."""
    rtt = []
    for _ in range(30):
        t = time.perf_counter()
        c.health()
        rtt.append((time.perf_counter() - t) * 1000)
    return rtt


def _notes(bandwidth: float, rtt_ms: float, weight_bytes: int) -> list[str]:
    return [
        "ratio = in-process time / gRPC time (1.0 = serving costs nothing; < 1 = serving is slower)",
        "overhead_ms_p50 = per-request gRPC latency - in-process latency (concurrency C: whole burst)",
        "ingress_ms_p50 = client latency - the router's own request time (gRPC proxy, admission, response); "
        f"a Health call (no work at all) takes {rtt_ms:.1f} ms p50 through the same proxy",
        "per_step_ms_p50 = (router time - in-process time) / decoding steps: the cost of the draft and target calls, "
        "and of the served forwards sharing the machine's cores with the client, proxy and router",
        "serving_ms_per_step = (the router's step time - the workers' forward time) / router steps, from the "
        "server's own counters: what serving adds to a decoding step (transport, router work), compute excluded "
        "(target: < 5 ms)",
        "fwd_vs_inproc = the workers' forward time serving these requests / the in-process run's whole time: above "
        "1, the served forwards themselves ran slower (on a small machine they share its cores with the client, "
        "the gRPC proxy and the router)",
        f"limit = bandwidth {bandwidth:.1f} GB/s / target weight bytes per step "
        f"{weight_bytes / 1e9:.2f} GB "
        "(x concurrency for a batch that reads the weights once per step)",
        "same_tokens counts greedy outputs identical token for token on both paths",
    ]


class _ModeRun:
    """One mode's two measurements, gRPC beside the in-process engine on the same prompts."""

    def __init__(self, cfg, engine, client, address: str, mode: str, texts: list[str], ids: list[list[int]],
                 new: int, limit1: float):
        from calid.decoding.modes import DecodeParams
        from calid.generation import SamplingParams

        self.cfg, self.engine, self.client, self.address, self.mode = cfg, engine, client, address, mode
        self.texts, self.ids, self.new, self.limit1 = texts, ids, new, limit1
        self.decode = DecodeParams(mode=mode)
        self.params = SamplingParams(max_new_tokens=new, ignore_eos=True)

    def _local(self, i: int):
        from calid.generation import GenerationRequest

        t = time.perf_counter()
        r = self.engine.generate([GenerationRequest(self.ids[i], self.params, decode=self.decode)])[0]
        return time.perf_counter() - t, r

    def _remote(self, i: int):
        t = time.perf_counter()
        r = self.client.generate(self.texts[i], max_new_tokens=self.new, ignore_eos=True, mode=self.mode)
        return time.perf_counter() - t, r

    def one_at_a_time(self, n: int, bar) -> dict:
        """``n`` requests one at a time, alternating which path goes first."""
        over, ingress, per_step, same, t_grpc, t_local = [], [], [], 0, 0.0, 0.0
        before = _server_times(self.cfg)
        for i in range(n):
            if i % 2:
                (lt, lr), (gt, gr) = self._local(i), self._remote(i)
            else:
                (gt, gr), (lt, lr) = self._remote(i), self._local(i)
            bar.update(2)
            t_grpc, t_local = t_grpc + gt, t_local + lt
            same += gr.token_ids == lr.output_ids
            steps = max(1, lr.stats.target_calls + (lr.stats.draft_tokens if self.mode == "filter" else 0))
            over.append((gt - lt) * 1000)
            ingress.append(gt * 1000 - gr.stats["total_ms"])
            per_step.append((gr.stats["total_ms"] - lt * 1000) / steps)
        new = self.new
        return {"mode": self.mode, "concurrency": 1, "requests": n, "tokens": n * new,
                "grpc_tok_s": n * new / t_grpc, "inproc_tok_s": n * new / t_local,
                "ratio": t_local / t_grpc, "overhead_ms_p50": _p50(over), "ingress_ms_p50": _p50(ingress),
                "per_step_ms_p50": _p50(per_step),
                **dict(zip(("serving_ms_per_step", "fwd_vs_inproc"), _serving_ms(self.cfg, before, t_local))),
                "same_tokens": f"{same}/{n}", "limit_tok_s": self.limit1}

    def burst(self, k: int, bar) -> dict:
        """``k`` requests at once: one engine batch, then ``k`` concurrent gRPC calls."""
        from calid.client import AsyncClient
        from calid.generation import GenerationRequest

        t = time.perf_counter()
        local_out = self.engine.generate([GenerationRequest(b, self.params, decode=self.decode)
                                          for b in self.ids[:k]])
        t_local = time.perf_counter() - t
        bar.update(1)

        async def calls():
            async with AsyncClient(self.address, app=self.cfg.app_name, timeout=1800) as ac:
                return await asyncio.gather(*[ac.generate(p, max_new_tokens=self.new, ignore_eos=True,
                                                          mode=self.mode) for p in self.texts[:k]])
        before = _server_times(self.cfg)
        t = time.perf_counter()
        remote_out = asyncio.run(calls())
        t_grpc = time.perf_counter() - t
        serving, fwd = _serving_ms(self.cfg, before, t_local)
        bar.update(1)
        return {"mode": self.mode, "concurrency": k, "requests": k, "tokens": k * self.new,
                "grpc_tok_s": k * self.new / t_grpc, "inproc_tok_s": k * self.new / t_local,
                "ratio": t_local / t_grpc, "overhead_ms_p50": (t_grpc - t_local) * 1000,
                "ingress_ms_p50": "-", "per_step_ms_p50": "-", "serving_ms_per_step": serving,
                "fwd_vs_inproc": fwd,
                "same_tokens": f"{sum(r.token_ids == o.output_ids for r, o in zip(remote_out, local_out))}/{k}",
                "limit_tok_s": k * self.limit1}
