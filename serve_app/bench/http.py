"""``calid bench http``: the same streams through the OpenAI HTTP API and through gRPC, side by side.

One server, one run. Separate rounds: C concurrent streams (same prompts, greedy, fixed length with EOS
ignored) all on one front-end, alternating which goes first; they count the HTTP path's CPU too, and the
machine's noise. Paired rounds: C/2 prompts, each sent on both front-ends at once, so the two copies of a
prompt share every step; the median over pairs of HTTP TPOT - gRPC TPOT is the HTTP path's delivery cost
per token (target: < 2 ms at 8 streams). A paired row's tok_s is that front-end's share of the round.
Greedy texts must be identical on both paths.
"""
from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path

COLUMNS = ["frontend", "streams", "tokens", "tok_s", "ttft_ms_p50", "tpot_ms_p50", "tpot_ms_p99", "limit_tok_s"]


def add_parser(sub) -> None:
    p = sub.add_parser("http", help="OpenAI HTTP API vs gRPC: the same streams side by side (per-token overhead)")
    p.add_argument("--qwen", action="store_true", help="the Qwen 1.5B target instead of SmolLM2-135M")
    p.add_argument("--mode", default="ar")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4, help="rounds per front-end, separate and paired (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--port", type=int, default=50071)
    p.add_argument("--http-port", type=int, default=8071)
    p.add_argument("--out", default="bench_results")
    p.set_defaults(func=run)


async def _grpc_stream(client, prompt: str, new: int, mode: str):
    start, first, text, n = time.perf_counter(), None, "", 0
    async for chunk in client.stream(prompt, max_new_tokens=new, ignore_eos=True, mode=mode):
        if chunk.token_ids and first is None:
            first = time.perf_counter()
        n += len(chunk.token_ids)
        text += chunk.text
    return text, n, first - start, (time.perf_counter() - first) / max(1, n - 1)


async def _http_stream(client, model: str, prompt: str, new: int, mode: str):
    start, first, text, n = time.perf_counter(), None, "", 0
    stream = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=new, temperature=0, stream=True,
                                                  stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True, "mode": mode})
    async for chunk in stream:
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text += chunk.choices[0].delta.content
    return text, n, first - start, (time.perf_counter() - first) / max(1, n - 1)


def run(args) -> int:
    from calid.backends import cpu_summary, open_model
    from calid.bench.data import humaneval_prompts
    from calid.bench.hardware import decode_limit_tok_s, memory_bandwidth_gbs
    from calid.bench.report import write_report
    from calid.errors import CalidError
    from calid.models.source import served_name
    from serve_app.cluster.config import AppConfig
    from serve_app.cluster.local import serve_app, shutdown

    if args.concurrency < 1 or args.rounds < 1 or args.max_new_tokens < 2:
        raise CalidError("--concurrency and --rounds must be >= 1, --max-new-tokens >= 2")
    # both front-ends run the same prompts: no prompt cache, or the second path would skip its prefills
    over = dict(grpc_port=args.port, http_port=args.http_port, draft=None, max_active=args.concurrency,
                prompt_cache=False)
    cfg = AppConfig(**over) if args.qwen else AppConfig.small(**over)
    model = served_name(cfg.target)
    c, new = args.concurrency, args.max_new_tokens
    prompts = humaneval_prompts(c)
    bandwidth = memory_bandwidth_gbs()
    limit = c * decode_limit_tok_s(bandwidth, open_model(cfg.target, cfg.target_backend, cfg.dtype).decode_read_bytes)
    print(f"bench http: {model}, mode {args.mode}, {c} concurrent streams x {args.rounds} rounds per front-end, "
          f"{new} tokens each (EOS ignored), greedy; {cpu_summary()}", file=sys.stderr)
    serve_app(cfg, dashboard=False)
    try:
        times, texts = asyncio.run(_measure(cfg, model, prompts, new, args.mode, args.rounds))
    finally:
        shutdown()
    rows = _rows(times, limit)
    grpc_row, http_row = rows[:2]
    added = http_row["tpot_ms_p50"] - grpc_row["tpot_ms_p50"]
    # the same prompt on both front-ends in the same round: per pair, HTTP TPOT - gRPC TPOT
    added_paired = statistics.median((h[3] - g[3]) * 1000 for (_, gs), (_, hs) in
                                     zip(times["grpc paired"], times["http paired"]) for g, h in zip(gs, hs))
    same = sum(texts["grpc"][i] == texts["http"][i] for i in texts["grpc"])
    meta = {"model": model, "mode": args.mode, "concurrency": c, "new_tokens": new, "cpu": cpu_summary(),
            "bandwidth_GBps": round(bandwidth, 1), "http_added_ms_per_token": round(added, 2),
            "http_added_ms_per_token_paired": round(added_paired, 2),
            "throughput_ratio_http_over_grpc": round(http_row["tok_s"] / grpc_row["tok_s"], 3),
            "same_greedy_text": f"{same}/{len(texts['grpc'])}"}
    notes = [f"paired (each of {len(times['grpc paired'][0][1])} prompts sent on both front-ends at once, so both "
             f"copies share every step): HTTP adds {added_paired:+.2f} ms per streamed token over gRPC (median "
             "over pairs of the TPOT difference; target < 2 ms)",
             f"separate rounds (all {c} streams on one front-end, alternating which goes first): HTTP adds "
             f"{added:+.2f} ms per token, throughput HTTP / gRPC = {meta['throughput_ratio_http_over_grpc']}; this "
             "also counts the HTTP path's CPU (proxy, JSON, the openai client here) taken from the 2 cores the "
             "model runs on, and round-to-round noise on a shared machine",
             f"same greedy text on both front-ends: {meta['same_greedy_text']}",
             f"limit_tok_s = {c} x bandwidth {bandwidth:.1f} GB/s / target weight bytes per step (a batch step "
             "reads the weights once for all streams)"]
    js, md = write_report(Path(args.out), f"http-{'qwen' if args.qwen else 'small'}",
                          "OpenAI HTTP API vs gRPC, same streams", meta, rows, COLUMNS, notes)
    print(md.read_text())
    print(f"wrote {js} and {md}", file=sys.stderr)
    return 0 if same == len(texts["grpc"]) else 1


async def _measure(cfg, model: str, prompts: list[str], new: int, mode: str, rounds: int) -> tuple[dict, dict]:
    """Every round's streams on each front-end (alternating which goes first), then paired rounds (each prompt
    on both at once): (wall time and per-stream results by front-end, each prompt's text by front-end)."""
    import openai

    from calid.client import AsyncClient
    from serve_app.cluster.app import base_url

    times = {"grpc": [], "http": [], "grpc paired": [], "http paired": []}
    texts = {"grpc": {}, "http": {}}
    async with AsyncClient(f"127.0.0.1:{cfg.grpc_port}", app=cfg.app_name, timeout=1800) as g, \
            openai.AsyncOpenAI(base_url=base_url(cfg), api_key="x", max_retries=0, timeout=1800) as h:
        runs = {"grpc": lambda p: _grpc_stream(g, p, new, mode),
                "http": lambda p: _http_stream(h, model, p, new, mode)}
        await asyncio.gather(runs["grpc"](prompts[0]), runs["http"](prompts[0]))  # warm-up
        for rnd in range(rounds):
            for fe in (("grpc", "http") if rnd % 2 == 0 else ("http", "grpc")):
                t = time.perf_counter()
                out = await asyncio.gather(*[runs[fe](p) for p in prompts])
                times[fe].append((time.perf_counter() - t, out))
                for i, (text, *_rest) in enumerate(out):
                    texts[fe][i] = text
                print(f"  round {rnd + 1} {fe}: {sum(o[1] for o in out) / times[fe][-1][0]:.1f} tok/s",
                      file=sys.stderr)
        pairs = prompts[:max(1, len(prompts) // 2)]
        for rnd in range(rounds):  # paired: each prompt on both front-ends in the same batches
            t = time.perf_counter()
            out = await asyncio.gather(*[runs[fe](p) for p in pairs for fe in ("grpc", "http")])
            wall = time.perf_counter() - t
            for k, fe in enumerate(("grpc", "http")):
                times[f"{fe} paired"].append((wall, out[k::2]))
            print(f"  round {rnd + 1} paired: {sum(o[1] for o in out) / wall:.1f} tok/s", file=sys.stderr)
    return times, texts


def _rows(times: dict, limit: float) -> list[dict]:
    """One row per front-end and pairing (grpc, http, grpc paired, http paired)."""
    from calid.placement.traffic import percentile

    rows = []
    for fe, runs in times.items():
        per = [o for _, out in runs for o in out]
        wall = sum(t for t, _ in runs)
        rows.append({"frontend": fe, "streams": len(per), "tokens": sum(o[1] for o in per),
                     "tok_s": sum(o[1] for o in per) / wall, "ttft_ms_p50": statistics.median(o[2] for o in per) * 1000,
                     "tpot_ms_p50": statistics.median(o[3] for o in per) * 1000,
                     "tpot_ms_p99": percentile([o[3] for o in per], 99) * 1000, "limit_tok_s": limit})
    return rows
