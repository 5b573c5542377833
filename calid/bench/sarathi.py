"""``calid bench sarathi``: decode latency while long prompts arrive, with and without chunked prefill.

The same arrival schedule is replayed twice, alternating, on the same target:
``decoders`` short requests decode continuously while ``arrivals`` long
prompts arrive at fixed steps. Without a token budget each long prompt is
prefilled in one forward, and every running decode waits for it; with a
budget (SARATHI) the prompt is split into chunks that ride along with the
decodes. Prints TPOT (time between a decoding request's tokens) p50/p99, the
long prompts' time to first token, and the total time.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

COLUMNS = ["config", "tpot_ms_p50", "tpot_ms_p99", "tpot_ms_max", "long_ttft_s_mean", "total_s", "same_tokens"]


def add_parser(sub) -> None:
    from calid.models.presets import TEST_MODEL

    p = sub.add_parser("sarathi", help="decode TPOT with and without chunked prefill while long prompts arrive")
    p.add_argument(
        "--model", default=TEST_MODEL, help=f"target (default {TEST_MODEL}: long prefills stay short on CPU)"
    )
    p.add_argument("--decoders", type=int, default=4, help="short requests decoding throughout (default 4)")
    p.add_argument("--arrivals", type=int, default=3, help="long prompts arriving during the run (default 3)")
    p.add_argument("--prompt-tokens", type=int, default=1500, help="length of each long prompt (default 1500)")
    p.add_argument("--budget", type=int, default=128, help="SARATHI token budget per forward (default 128)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=2, help="replays of each configuration, alternating (default 2)")
    p.add_argument("--out", default="bench_results")
    p.set_defaults(func=run)


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _replay(engine, short_ids, long_ids, arrive_at, params_short, params_long):
    from calid.generation import GenerationRequest

    last, gaps, ttft, outputs = {}, [], [], {}
    for i, ids in enumerate(short_ids):
        engine.submit(GenerationRequest(ids, params_short, request_id=f"short-{i}"))
    start, step, pending = time.perf_counter(), 0, dict(zip(arrive_at, long_ids))
    while engine.orchestrator.active or pending:
        if step in pending:
            engine.submit(GenerationRequest(pending.pop(step), params_long, request_id=f"long-{step}"))
        for e in engine.step():
            now = time.perf_counter()
            if e.request_id.startswith("short"):
                if e.request_id in last:
                    gaps.append((now - last[e.request_id]) * 1000 / len(e.token_ids))
                last[e.request_id] = now
            if e.result is not None:
                outputs[e.request_id] = e.result.output_ids
                if e.request_id.startswith("long"):
                    ttft.append(e.result.ttft_s)
        step += 1
    return gaps, ttft, time.perf_counter() - start, outputs


def run(args) -> int:
    from calid.bench.data import humaneval_prompts
    from calid.bench.report import write_report
    from calid.engine import Engine
    from calid.errors import CalidError
    from calid.generation import SamplingParams
    from calid.models.loader import load_model
    from calid.progress import progress
    from calid.runtime.runner import ModelRunner
    from calid.text import encode_prompt

    if min(args.decoders, args.arrivals, args.prompt_tokens, args.budget, args.max_new_tokens, args.repeats) < 1:
        raise CalidError("--decoders, --arrivals, --prompt-tokens, --budget, --max-new-tokens, --repeats must be >= 1")
    lm = load_model(args.model)
    tok = lm.tokenizer
    texts = humaneval_prompts(args.decoders + args.arrivals * 6)
    short_ids = [encode_prompt(tok, t) for t in texts[: args.decoders]]
    corpus = tok("\n".join(texts[args.decoders:]), add_special_tokens=False).input_ids
    if len(corpus) < args.prompt_tokens:
        corpus = corpus * (args.prompt_tokens // max(1, len(corpus)) + 1)
    long_ids = [corpus[i * 7: i * 7 + args.prompt_tokens] for i in range(args.arrivals)]
    arrive_at = [4 + i * max(4, args.max_new_tokens // (args.arrivals + 1)) for i in range(args.arrivals)]
    short_params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    long_params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    configs = [("whole prefill", None), (f"chunked prefill, budget {args.budget}", args.budget)]
    print(f"bench sarathi: {lm.name}; {args.decoders} decoding requests x {args.max_new_tokens} tokens; "
          f"{args.arrivals} prompts of {args.prompt_tokens} tokens arriving at steps {arrive_at}; "
          f"{args.repeats} replays each, alternating", file=sys.stderr)
    results = {name: ([], [], 0.0, []) for name, _ in configs}
    with progress(args.repeats * len(configs), "bench sarathi", "replay") as bar:
        for r in range(args.repeats):
            for name, budget in configs if r % 2 == 0 else configs[::-1]:
                engine = Engine(ModelRunner(lm.model), tok, lm.eos_ids, max_batch=args.decoders + args.arrivals,
                                max_forward_tokens=budget)
                gaps, ttft, total, outputs = _replay(engine, short_ids, long_ids, arrive_at, short_params, long_params)
                acc = results[name]
                results[name] = (acc[0] + gaps, acc[1] + ttft, acc[2] + total, acc[3] + [outputs])
                bar.update(1)
    base = results[configs[0][0]][3]
    rows = []
    for name, _ in configs:
        gaps, ttft, total, outs = results[name]
        rows.append(
            {
                "config": name,
                "tpot_ms_p50": statistics.median(gaps),
                "tpot_ms_p99": _percentile(gaps, 0.99),
                "tpot_ms_max": max(gaps),
                "long_ttft_s_mean": statistics.mean(ttft),
                "total_s": total / args.repeats,
                "same_tokens": f"{sum(o == b for o, b in zip(outs, base))}/{len(outs)}",
            }
        )
    notes = [f"TPOT p99 whole / chunked: {rows[0]['tpot_ms_p99'] / rows[1]['tpot_ms_p99']:.2f}x; "
             f"p50 whole / chunked: {rows[0]['tpot_ms_p50'] / rows[1]['tpot_ms_p50']:.2f}x",
             "TPOT: gaps between consecutive tokens of the continuously decoding requests",
             "same_tokens: replays whose every output equals the first whole-prefill replay (greedy)"]
    js, md = write_report(Path(args.out), f"sarathi-{lm.name}", "SARATHI chunked prefill vs whole prefill",
                          {"model": lm.name, "decoders": args.decoders, "arrivals": args.arrivals,
                           "prompt_tokens": args.prompt_tokens, "budget": args.budget}, rows, COLUMNS, notes)
    print(md.read_text())
    print(f"wrote {js} and {md}", file=sys.stderr)
    return 0
