"""``calid bench peers``: calid against the servers a user would run instead, through one OpenAI client.

One load client (the openai SDK's async client, streaming chat completions, greedy, the same HumanEval
prompts, ``ignore_eos`` asked of every server) runs a closed-loop concurrency sweep against, one after the
other on the same machine and GGUF:
  calid               ``calid serve``'s OpenAI HTTP API, in each of --modes (ar, auto, filter);
  llama-cpp-python    its own OpenAI server (``python -m llama_cpp.server``) over the same llama-cpp-python
                      build calid uses (it needs the server's web packages: ``pip install 'calid[peers]'``);
  llama-server        llama.cpp's C++ server with continuous batching (``-np`` slots), when --llama-server
                      names its binary (see README: how to build it from the llama-cpp-python sources).
Per server, mode and concurrency: output tokens/s, TTFT p50/p99, TPOT p50, and each one's ratio to calid
ar at the same concurrency; a PNG of throughput vs concurrency; the CPU flags and the bandwidth limit.
A server that cannot start is reported with the reason, and the others still run.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

COLUMNS = ["server", "mode", "concurrency", "requests", "errors", "tokens", "tok_s", "tok_s_vs_calid_ar",
           "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "limit_tok_s"]
PEERS = ("llama-cpp-python", "llama-server")


def add_parser(sub) -> None:
    p = sub.add_parser("peers", help="calid vs llama-cpp-python's server vs llama-server, one OpenAI load client")
    p.add_argument("--small", action="store_true", help="SmolLM2-135M (self:16 draft) instead of the Qwen pair")
    p.add_argument("--modes", default="ar,auto,filter", help="calid modes to run (comma-separated)")
    p.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated among {', '.join(PEERS)}")
    p.add_argument("--concurrency", default="1,4,8,16", help="closed-loop client counts")
    p.add_argument("--requests", type=int, default=0, help="requests per point (default: 2 x concurrency, >= 4)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="llama.cpp threads of every server (default: all cores)")
    p.add_argument("--llama-server", default=shutil.which("llama-server"), help="llama-server binary (default: on PATH)")
    p.add_argument("--port", type=int, default=8093, help="HTTP port each server takes in turn")
    p.add_argument("--out", default="bench_results")
    p.set_defaults(func=run)


def run(args) -> int:
    from calid.backends import cpu_summary, gguf_file, open_model
    from calid.bench.data import humaneval_prompts
    from calid.bench.hardware import decode_limit_tok_s, memory_bandwidth_gbs
    from calid.bench.report import parse_numbers, write_report
    from calid.decoding.modes import MODES
    from calid.errors import CalidError
    from serve_app.config import AppConfig

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    sweep = sorted(set(parse_numbers(args.concurrency, int)))
    if any(m not in MODES for m in modes) or any(p not in PEERS for p in peers) or not sweep or min(sweep) < 1:
        raise CalidError(f"--modes among {', '.join(MODES)}, --peers among {', '.join(PEERS)}, --concurrency >= 1")
    modes = ["ar"] + [m for m in modes if m != "ar"]
    threads = args.threads or os.cpu_count() or 1
    cfg = (AppConfig.small if args.small else AppConfig)(grpc_port=_free_port(), http_port=args.port,
                                                         max_active=max(16, max(sweep)), worker_threads=threads)
    gguf = str(gguf_file(cfg.target, False))
    weight_bytes = open_model(cfg.target, log=lambda line: None, show_progress=False).decode_read_bytes
    bandwidth = memory_bandwidth_gbs()
    limit = decode_limit_tok_s(bandwidth, weight_bytes)
    prompts = humaneval_prompts(max(2 * max(sweep), 8))
    print(f"bench peers: {cfg.target} ({Path(gguf).name}), {threads} threads; calid modes {modes}; peers {peers}; "
          f"concurrency {sweep}; {args.max_new_tokens} new tokens, greedy; {cpu_summary()}; decode limit "
          f"{limit:.1f} tok/s at batch 1 ({bandwidth:.1f} GB/s / {weight_bytes / 1e9:.2f} GB)", file=sys.stderr)
    rows, skipped = [], []
    url = f"http://127.0.0.1:{args.port}/v1"
    with _calid(cfg):
        for mode in modes:
            rows += _sweep(url, cfg.target, "calid", mode, sweep, prompts, args)
    for peer in peers:
        try:
            with _peer(peer, gguf, threads, args.port, max(sweep), args.llama_server, cfg.target):
                rows += _sweep(url, cfg.target, peer, "ar", sweep, prompts, args)
        except PeerUnavailable as e:
            skipped.append(f"{peer}: {e}")
            print(f"bench peers: {peer} not run: {e}", file=sys.stderr)
    base = {r["concurrency"]: r["tok_s"] for r in rows if r["server"] == "calid" and r["mode"] == "ar"}
    for r in rows:
        r["tok_s_vs_calid_ar"] = r["tok_s"] / base[r["concurrency"]] if base.get(r["concurrency"]) else float("nan")
        r["limit_tok_s"] = limit * r["concurrency"]
    meta = {"model": cfg.target, "gguf": Path(gguf).name, "threads": threads, "cpu": cpu_summary(),
            "bandwidth_GBps": round(bandwidth, 1), "new_tokens": args.max_new_tokens}
    notes = ["tok_s: output tokens of all requests / wall time of the point (closed loop, each client sends its next "
             "request when the last one ends); tok_s_vs_calid_ar: ratio to calid ar at the same concurrency",
             "TTFT: send to first streamed token; TPOT: (last - first token) / (tokens - 1), per request",
             f"limit_tok_s: bandwidth / weight bytes per decode step x concurrency (a batch reads the weights once)"]
    notes += [f"not run: {s}" for s in skipped]
    name = f"peers-{'small' if args.small else 'qwen'}"
    js, md = write_report(Path(args.out), name, "calid vs the servers a user would pick instead (one OpenAI client)",
                          meta, rows, COLUMNS, notes)
    png = _plot(rows, Path(args.out) / f"{name}.png")
    print(md.read_text())
    print(f"wrote {js}, {md} and {png}", file=sys.stderr)
    return 0


class PeerUnavailable(Exception):
    """A peer server cannot run here (not installed, not built, did not start)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _calid:
    def __init__(self, cfg):
        self.cfg = cfg

    def __enter__(self):
        from serve_app.local import serve_app

        serve_app(self.cfg, dashboard=False)
        return self

    def __exit__(self, *exc):
        from serve_app.local import shutdown

        shutdown()


class _peer:
    """A peer server in a subprocess on 127.0.0.1:port, up until the block ends (its log in a temp file)."""

    def __init__(self, peer: str, gguf: str, threads: int, port: int, slots: int, llama_server: str | None,
                 name: str):
        if peer == "llama-cpp-python":
            try:
                import fastapi, sse_starlette, starlette_context, uvicorn  # noqa: F401, E401
            except ImportError as e:
                raise PeerUnavailable(f"llama_cpp.server needs its web packages ({e.name} missing): "
                                      "pip install 'calid[peers]'") from None
            self.cmd = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--model_alias", name,
                        "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", "4096",
                        "--host", "127.0.0.1", "--port", str(port)]
        else:
            if not llama_server or not Path(llama_server).is_file():
                raise PeerUnavailable("no llama-server binary (--llama-server PATH; README: building it)")
            self.cmd = [llama_server, "-m", gguf, "-a", name, "-t", str(threads), "-tb", str(threads),
                        "-np", str(slots), "-c", str(2048 * slots), "-cb", "--host", "127.0.0.1", "--port", str(port)]
        self.port, self.peer = port, peer

    def __enter__(self):
        import urllib.request

        self.log = open(f"/tmp/calid-bench-{self.peer}.log", "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PeerUnavailable(f"exited with {self.proc.returncode} (log: {self.log.name})")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=2):
                    return self
            except OSError:
                time.sleep(1)
        self.__exit__()
        raise PeerUnavailable(f"not ready within 300 s (log: {self.log.name})")

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def _sweep(url: str, model: str, server: str, mode: str, sweep: list[int], prompts: list[str], args) -> list[dict]:
    from calid.bench.load import percentile

    rows = []
    asyncio.run(_closed_loop(url, model, mode, server, 1, 1, prompts, 8))  # warm the path (first-call costs)
    for c in sweep:
        n = args.requests or max(4, 2 * c)
        t = time.perf_counter()
        outs = asyncio.run(_closed_loop(url, model, mode, server, c, n, prompts, args.max_new_tokens))
        wall = time.perf_counter() - t
        ok = [o for o in outs if o.error is None]
        tokens = sum(o.tokens for o in ok)
        ttft = [o.ttft_s * 1000 for o in ok if o.ttft_s is not None]
        tpot = [o.tpot_s * 1000 for o in ok if o.tpot_s is not None]
        rows.append({"server": server, "mode": mode, "concurrency": c, "requests": n, "errors": len(outs) - len(ok),
                     "tokens": tokens, "tok_s": tokens / wall, "ttft_ms_p50": percentile(ttft, 50),
                     "ttft_ms_p99": percentile(ttft, 99), "tpot_ms_p50": percentile(tpot, 50)})
        print(f"  {server} {mode} c{c}: {tokens / wall:.2f} tok/s, {len(outs) - len(ok)} errors", file=sys.stderr)
        if outs and not ok:
            print(f"    first error: {outs[0].error}", file=sys.stderr)
    return rows


async def _closed_loop(url: str, model: str, mode: str, server: str, clients: int, n: int, prompts: list[str],
                       max_new: int) -> list:
    from openai import AsyncOpenAI

    from calid.bench.load import Outcome

    extra = {"ignore_eos": True, **({"mode": mode} if server == "calid" else {})}
    todo, out = list(range(n)), []
    async with AsyncOpenAI(base_url=url, api_key="none", timeout=1800, max_retries=0) as client:
        async def one(prompt: str) -> Outcome:
            sent, first, last, tokens = time.perf_counter(), None, None, 0
            try:
                stream = await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_new, temperature=0,
                    stream=True, extra_body=extra)
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        last = time.perf_counter()
                        first = first or last
                        tokens += 1
            except Exception as e:  # noqa: BLE001 - counted in the row's errors
                return Outcome(sent, first, last, tokens, error=f"{type(e).__name__}: {e}")
            # llama_cpp.server under concurrent requests ends some streams with no content and no error
            return Outcome(sent, first, last, tokens, error=None if tokens else "the stream ended with no tokens")

        async def worker():
            while todo:
                out.append(await one(prompts[todo.pop() % len(prompts)]))

        await asyncio.gather(*(worker() for _ in range(clients)))
    return out


def _plot(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in sorted({(r["server"], r["mode"]) for r in rows}):
        pts = sorted((r["concurrency"], r["tok_s"]) for r in rows if (r["server"], r["mode"]) == key)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=" ".join(key))
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput vs concurrency, one OpenAI client")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
