"""``calid bench structured-served``: what a JSON schema costs each decoding mode, served over the OpenAI API.

The workload and the table of ``calid bench structured`` (calid.bench.structured), sent by the openai SDK to a
calid app started here (the default config: the Qwen pair, engine topology; ``--small``: SmolLM2), each request
with ``response_format: json_schema`` (strict) and without it, ``c`` requests at a time. The grammar's time is
the workers' own (their stats' ``grammar_s`` / ``grammar_rows``), the draft's share the ``calid`` stats of each
answer. Conditions interleave, and each round runs them in the opposite order of the last.
"""
from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from calid.bench.structured import (COLUMNS, add_workload_args, checked, conditions_of, new_tally, table, valid,
                                    workload)


def add_parser(sub) -> None:
    from serve_app.cluster.config import TOPOLOGY_HELP

    p = sub.add_parser("structured-served", help="bench structured through the served OpenAI API: each mode with "
                                                 "and without a JSON schema")
    add_workload_args(p)
    p.add_argument("--port", type=int, default=8093, help="HTTP port of the app served (loopback)")
    p.add_argument("--topology", choices=("engine", "split"), default="engine", help=TOPOLOGY_HELP)
    p.set_defaults(func=run)


def run(args) -> int:
    from calid.backends import cpu_summary
    from calid.bench.report import write_report
    from calid.models.source import served_name
    from serve_app.bench.peers import _free_port
    from serve_app.cluster.config import AppConfig
    from serve_app.cluster.local import serve_app, shutdown

    modes, levels = checked(args)
    cfg = (AppConfig.small if args.small else AppConfig)(grpc_port=_free_port(), http_port=args.port,
                                                         max_active=max(16, max(levels)), prompt_cache=False,
                                                         topology=args.topology)
    model = served_name(cfg.target)
    print(f"bench structured-served: {model} served ({cfg.topology} topology), draft {cfg.draft}; {args.prompts} "
          f"JSON-extraction requests per condition over HTTP (openai SDK), chat template, greedy, to EOS "
          f"(<= {args.max_new_tokens} tokens); modes {', '.join(modes)}; concurrency {args.concurrency}; "
          f"{args.rounds} round(s)", file=sys.stderr)
    print(cpu_summary(), file=sys.stderr)
    serve_app(cfg, dashboard=False)
    try:
        acc, step_ms = asyncio.run(_drive(args, cfg, model, modes, levels))
    finally:
        shutdown()
    rows, notes = table(acc, modes, levels, step_ms)
    notes.insert(1, "served: every request through the OpenAI HTTP API of the app started here (openai SDK)")
    meta = {"target": model, "draft": cfg.draft, "topology": cfg.topology, "cpu": cpu_summary(),
            "requests_per_condition": args.prompts, "max_new_tokens": args.max_new_tokens, "rounds": args.rounds,
            "target_step_ms": round(step_ms, 1)}
    js, md = write_report(Path(args.out), f"structured-served-{model}",
                          "Each mode with and without a JSON schema, served", meta, rows, COLUMNS, notes)
    print(md.read_text())
    print(f"wrote {js} and {md}", file=sys.stderr)
    return 0


async def _drive(args, cfg, model: str, modes: list[str], levels: list[int]) -> tuple[dict, float]:
    import jsonschema
    from openai import AsyncOpenAI
    from ray import serve

    from calid.progress import progress

    workers = serve.get_deployment_handle("router", cfg.app_name).worker_stats
    items = workload(args.prompts)

    async def grammar() -> tuple[int, float]:  # rows masked and seconds, over every worker
        stats = (await workers.remote()).values()
        return sum(s.get("grammar_rows", 0) for s in stats), sum(s.get("grammar_s", 0.0) for s in stats)

    from serve_app.cluster.app import base_url

    async with AsyncOpenAI(base_url=base_url(cfg), api_key="none", timeout=1800, max_retries=0) as client:
        async def ask(mode: str, schema: dict | None, text: str, max_tokens: int = args.max_new_tokens, **extra):
            fmt = {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                                              "strict": True}}} if schema else {}
            r = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens,
                temperature=0, extra_body={"mode": mode, **extra}, **fmt)
            return r.choices[0].message.content or "", r.usage.completion_tokens, r.model_extra["calid"]

        async def forward_s() -> float:
            return (await workers.remote())["target"]["forward_s"]

        async def step_ms(steps: int = 32) -> float:  # the target's plain decode step, from its own forward time
            spent = []
            for n in (1, 1 + steps):
                before = await forward_s()
                await ask("ar", None, items[0][1], ignore_eos=True, max_tokens=n)
                spent.append(await forward_s() - before)
            return (spent[1] - spent[0]) / steps * 1000

        await ask("ar", items[0][0], items[0][1])  # warm-up: the grammar's tokenizer is built on first use
        step = await step_ms()
        conditions = conditions_of(modes, levels)
        acc = {k: new_tally() for k in conditions}
        with progress(len(conditions) * args.rounds, "bench structured-served", "condition") as bar:
            for rnd in range(args.rounds):
                for key in conditions if rnd % 2 == 0 else conditions[::-1]:
                    mode, schema, c = key
                    a = acc[key]
                    rows0, mask0 = await grammar()
                    for i in range(0, len(items), c):
                        wave = items[i: i + c]
                        start = time.perf_counter()
                        answers = await asyncio.gather(*[ask(mode, s if schema else None, text) for s, text in wave])
                        a["seconds"] += time.perf_counter() - start
                        for (text, tokens, stats), (s, _) in zip(answers, wave):
                            a["tokens"] += tokens
                            a["draft"] += stats.get("draft_tokens", 0)
                            a["n"] += 1
                            a["valid"] += valid(text, s, jsonschema)
                    rows1, mask1 = await grammar()
                    a["rows"] += rows1 - rows0
                    a["mask_s"] += mask1 - mask0
                    bar.update(1)
    return acc, step
