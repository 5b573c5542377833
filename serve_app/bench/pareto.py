"""``calid bench pareto``: every lossy setting's speed against its quality, served, at several loads.

It starts one app (an embedded Ray on loopback) serving the pair and, as a second model of the same app, the
draft alone ("draft only"), then runs every configuration (ar; draft only; filter at --filter-thresholds;
rollback at --rollback-nlls; min_agreement at --budgets) at every --concurrency c: each task item (HumanEval's
problems, --math ASDiv problems) through the OpenAI chat endpoint (the openai SDK), c clients in a closed loop,
greedy, each answer to its EOS. Per configuration, concurrency and task: quality (pass@1 by each problem's own
tests / exact match of the final number), served throughput and its ratio to ar at the same c, the filtered
fraction (calid's per-answer stats), answers identical to ar's. min_agreement budgets answer the odd-numbered
(held-out) items only: the agreement calibration (``calid bench quality``) reads the even-numbered ones.

The pair's quality table (calid.decoding.quality_budget: filter's loss against ar per threshold on the
even-numbered HumanEval problems) is written where serving reads it for ``max_quality_loss`` requests, and each
--loss-budgets budget's threshold is checked on the odd-numbered problems, which the choice never read.

Resumable: every answer is appended to answers.jsonl as it arrives, every finished segment (one configuration
at one c, uninterrupted) to segments.jsonl; a rerun does only what is missing (``--fresh`` starts over). A
stopped segment's answers count for quality, not for speed (calid.bench.pareto_report). Each segment prints its
wall time; the report prints the operating point (HumanEval pass@1 within 2 points of ar, most drafted) per c.
Writes pareto.json, pareto.md and pareto.png (x = speed-up, y = HumanEval quality, one line per concurrency).
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from serve_app.cluster.config import add_topology_arg

DRAFT_ALONE = "draft-alone"  # the served name of the draft model in the bench's app


def add_parser(sub) -> None:
    p = sub.add_parser("pareto", help="served speed against quality of every lossy setting, at several loads "
                                      "(HumanEval + ASDiv; resumable)")
    p.add_argument("--small", action="store_true", help="SmolLM2-135M with self:16 (no draft-only row: the draft "
                   "is the target's own layers)")
    p.add_argument("--limit", type=int, default=None, help="HumanEval problems (default: all 164)")
    p.add_argument("--math", type=int, default=100, help="ASDiv problems (default 100)")
    p.add_argument("--concurrency", default="1,4,8", help="closed-loop client counts (default 1,4,8)")
    p.add_argument("--filter-thresholds", default="0.97,0.95,0.9,0.8,0.6,0.4",
                   help="filter's top-1 probabilities (the default pair's operating point first)")
    p.add_argument("--rollback-nlls", default="1,2,4", help="rollback's target-NLL bounds")
    p.add_argument("--budgets", default="0.95,0.98,0.99", help="min_agreement budgets (held-out half)")
    p.add_argument("--loss-budgets", default="1,2,5", help="max_quality_loss budgets (points of HumanEval pass@1) "
                   "to choose thresholds for on the calibration half and check on the held-out half")
    p.add_argument("--quality-table", default=None, help="where to write the pair's quality table, which "
                   "max_quality_loss requests are served by (default: where serving reads it, under "
                   "CALID_HOME/calibration; 'none': do not write)")
    p.add_argument("--only", default=None, help="comma-separated configuration names (ar always runs)")
    p.add_argument("--max-new-tokens", type=int, default=320, help="HumanEval cap; math gets 160")
    p.add_argument("--port", type=int, default=8094, help="the app's HTTP port")
    add_topology_arg(p)
    p.add_argument("--out", default="bench_results")
    p.add_argument("--fresh", action="store_true", help="discard earlier answers of this pair")
    p.add_argument("--report-only", action="store_true", help="run nothing: report what earlier runs stored")
    p.set_defaults(func=run)


def configurations(args) -> list[tuple[str, dict]]:
    """(name, what its requests add to the OpenAI body), ar first; "draft only" names the draft's model."""
    from calid.bench.report import parse_numbers
    from calid.errors import CalidError

    out = [("ar", {"mode": "ar"}), ("draft only", {"mode": "ar", "model": DRAFT_ALONE})]
    out += [(f"filter t={t:g}", {"mode": "filter", "threshold": t}) for t in parse_numbers(args.filter_thresholds)]
    out += [(f"rollback nll>{r:g}", {"mode": "rollback", "rollback_nll": r}) for r in parse_numbers(args.rollback_nlls)]
    out += [(f"min_agreement {b:g}", {"min_agreement": b}) for b in parse_numbers(args.budgets)]
    if args.small:
        out = [c for c in out if c[0] != "draft only"]
    if args.only:
        wanted = [x.strip() for x in args.only.split(",") if x.strip()]
        unknown = [w for w in wanted if w not in dict(out)]
        if unknown:
            raise CalidError(f"--only: unknown configuration(s) {unknown}; known: {', '.join(n for n, _ in out)}")
        out = [c for c in out if c[0] in wanted or c[0] == "ar"]
    return out


class Results:
    """answers.jsonl (one line per answer; a later line for the same key wins: scoring adds ``solved``) and
    segments.jsonl (one line per finished segment), under ``folder``, checked against meta.json."""

    def __init__(self, folder: Path, meta: dict, fresh: bool):
        from calid.bench.report import resume_meta

        folder.mkdir(parents=True, exist_ok=True)
        self.answers_path, self.segments_path = folder / "answers.jsonl", folder / "segments.jsonl"
        meta_path = folder / "meta.json"
        if fresh:
            self.answers_path.unlink(missing_ok=True)
            self.segments_path.unlink(missing_ok=True)
        # results stored before the bench recorded its topology ran on split (AppConfig's default)
        resume_meta(meta_path, meta, self.answers_path.exists(), before={"topology": "split"})
        self.meta = meta
        self.answers: dict[tuple[str, int], dict[str, dict]] = {}
        for row in _lines(self.answers_path):
            self.answers.setdefault((row["config"], row["c"]), {})[row["key"]] = row
        self.segments = list(_lines(self.segments_path))

    def add(self, row: dict) -> None:
        self.answers.setdefault((row["config"], row["c"]), {})[row["key"]] = row
        with self.answers_path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def finished(self, segment: dict) -> None:
        self.segments.append(segment)
        with self.segments_path.open("a") as f:
            f.write(json.dumps(segment) + "\n")


def _lines(path: Path):
    if not path.exists():
        return
    for line in path.read_text().splitlines():
        try:
            yield json.loads(line)
        except json.JSONDecodeError:  # a line cut short when a run was stopped
            continue


def run(args) -> int:
    from calid.backends import cpu_summary
    from calid.bench.quality_curve import items
    from calid.bench.report import parse_numbers
    from calid.errors import CalidError
    from serve_app.bench.peers import _free_port

    sweep = sorted(set(parse_numbers(args.concurrency, int)))
    if not sweep or min(sweep) < 1 or args.max_new_tokens < 1 or (args.limit is not None and args.limit < 0):
        raise CalidError("--concurrency takes counts >= 1, --max-new-tokens >= 1, --limit >= 0")
    cfgs = configurations(args)
    work = items(args.limit, args.math, 0, args.max_new_tokens)
    cfg = app_config(args, max(sweep), _free_port())
    folder = Path(args.out) / f"pareto-{'small' if args.small else 'qwen'}"
    results = Results(folder, {"target": cfg.target, "draft": cfg.draft, "max_new_tokens": args.max_new_tokens,
                               "sampling": "greedy", "chat": True, "topology": cfg.topology}, args.fresh)
    todo = {(name, c): [it for it in work if it.key not in results.answers.get((name, c), {})
                        and ("min_agreement" not in body or it.held_out)]
            for c in sweep for name, body in cfgs}
    pending = {k: v for k, v in todo.items() if v} if not args.report_only else {}
    print(f"bench pareto: target {cfg.target}, draft {cfg.draft}; {sum(it.kind == 'humaneval' for it in work)} "
          f"HumanEval + {sum(it.kind == 'math' for it in work)} ASDiv items; {len(cfgs)} configurations at "
          f"concurrency {sweep}; greedy, chat template, to EOS; topology {cfg.topology}; {cpu_summary()}; results in "
          f"{folder} (resumable: {len(pending)} of {len(todo)} segments to run)", file=sys.stderr)
    if pending:
        _serve_all(cfg, args, cfgs, sweep, pending, results)
    return _report(args, folder, cfgs, sweep, work, results)


def app_config(args, most: int, grpc_port: int):
    """The bench's app: the pair (and, as a second model, the draft alone) in ``args.topology``, as ``calid serve``
    would run it, taking ``most`` requests at once."""
    from serve_app.cluster.config import AppConfig, ModelSpec

    base = AppConfig.small() if args.small else AppConfig()
    models = [] if args.small else [ModelSpec(name=_served(base), target=base.target, draft=base.draft),
                                    ModelSpec(name=DRAFT_ALONE, target=base.draft, draft=None, default_mode="ar")]
    return base.model_copy(update={"http_port": args.port, "grpc_port": grpc_port, "models": models,
                                   "max_active": max(16, most), "topology": args.topology})


def _serve_all(cfg, args, cfgs, sweep: list[int], pending: dict, results: Results) -> None:
    """Every pending segment, concurrency by concurrency, ar first at each (its ratio's reference)."""
    from serve_app.cluster.local import serve_app, shutdown

    run_id = time.strftime("%Y-%m-%dT%H:%M:%S")
    serve_app(cfg, dashboard=False)
    try:
        url = f"http://127.0.0.1:{cfg.http_port}/v1"
        for name, body in cfgs:  # no segment pays a first call's costs (calibration, caches)
            if any(key[0] == name for key in pending):
                asyncio.run(_segment(url, cfg, name, body, 1, [], None, warm=True))
        for c in sweep:
            for name, body in cfgs:
                its = pending.get((name, c))
                if its:
                    _run_segment(url, cfg, name, body, c, its, results, run_id)
    finally:
        shutdown()


def _run_segment(url: str, cfg, name: str, body: dict, c: int, its: list, results: Results, run_id: str) -> None:
    from calid.bench.quality_curve import solved

    t0 = time.perf_counter()
    rows = asyncio.run(_segment(url, cfg, name, body, c, its, results))
    seconds = time.perf_counter() - t0
    results.finished({"config": name, "c": c, "run": run_id, "seconds": seconds, "keys": [r["key"] for r in rows]})
    by_key = {it.key: it for it in its}
    for row in rows:  # scored after the segment: running tests must not share the cores with timed serving
        results.add({**row, "solved": solved(by_key[row["key"]], row["text"])})
    print(f"bench pareto: {name} at c={c}: {len(rows)} answers, {sum(r['tokens'] for r in rows)} tokens in "
          f"{seconds:.0f} s", file=sys.stderr)


async def _segment(url: str, cfg, name: str, body: dict, c: int, its: list, results: Results | None,
                   warm: bool = False) -> list[dict]:
    """``its`` through the chat endpoint by ``c`` clients in a closed loop; each answer stored as it arrives."""
    from openai import APIError, AsyncOpenAI

    from calid.errors import CalidError
    from calid.progress import progress

    model = body.get("model", _served(cfg))
    extra = {k: v for k, v in body.items() if k != "model"}
    queue, rows = list(reversed(its)), []
    async with AsyncOpenAI(base_url=url, api_key="none", timeout=3600, max_retries=2) as client:
        if warm:
            await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=4, temperature=0, extra_body=extra)
            return []
        with progress(len(its), f"{name} c={c}", "answer") as bar:
            async def worker():
                while queue:
                    it = queue.pop()
                    try:
                        r = await client.chat.completions.create(
                            model=model, messages=[{"role": "user", "content": it.prompt}], max_tokens=it.max_new,
                            temperature=0, extra_body=extra)
                    except APIError as e:  # what was answered is kept: a rerun resumes from there
                        raise CalidError(f"{name} at c={c}, {it.key}: {type(e).__name__}: {e}") from None
                    stats = (r.model_extra or {}).get("calid") or {}
                    text = r.choices[0].message.content or ""
                    tokens = r.usage.completion_tokens if r.usage else 0
                    drafted = tokens if model == DRAFT_ALONE else int(stats.get("draft_tokens", 0))
                    row = {"config": name, "c": c, "key": it.key, "text": text, "tokens": tokens, "drafted": drafted}
                    results.add(row)
                    rows.append(row)
                    bar.update(1)

            await asyncio.gather(*(worker() for _ in range(c)))
    return rows


def _report(args, folder: Path, cfgs, sweep: list[int], work: list, results: Results) -> int:
    from calid.backends import cpu_summary
    from calid.bench.pareto_report import POINTS, Segment, app_setting, operating_point, plot, summarize
    from calid.bench.report import write_report

    segments = [Segment(s["config"], s["c"], s["run"], s["seconds"], tuple(s["keys"])) for s in results.segments]
    names = [n for n, _ in cfgs]
    budgeted = {n for n, body in cfgs if "min_agreement" in body}
    rows = summarize(names, sweep, {it.key: it.kind for it in work}, results.answers, segments,
                     {it.key for it in work if it.held_out}, budgeted)
    columns = ["config", "c", "task", "done", "quality", "ar_quality_same_items", "speedup_vs_ar", "tok_s",
               "filtered_fraction", "identical_to_ar", "ratio_across_runs"]
    notes = [f"served through the OpenAI chat endpoint, greedy, each answer to its EOS (HumanEval <= "
             f"{args.max_new_tokens} tokens, ASDiv <= {min(args.max_new_tokens, 160)}); c clients in a closed loop",
             "quality: HumanEval pass@1 (each problem's tests) / ASDiv exact match of the final number; "
             "ar_quality_same_items: ar on the same items (min_agreement rows: the held-out half)",
             "speedup_vs_ar: output tokens / s of the configuration's finished segments over ar's at the same c; "
             "ratio_across_runs: yes where the two were measured by different invocations (resumed runs)",
             "identical_to_ar: answers whose text equals ar's at the same c", cpu_summary()]
    for c in reversed(sweep):  # each put first: they read in the sweep's order
        point = operating_point(rows, c)
        if point:
            setting = app_setting(point["config"])
            notes.insert(0, f"operating point at c={c} (HumanEval pass@1 within {POINTS:g} points of ar, most "
                            f"drafted): {point['config']}: pass@1 {point['quality']:.3f} (ar "
                            f"{point['ar_quality_same_items']:.3f}), {_x(point['speedup_vs_ar'])} ar, filtered "
                            f"fraction {point['filtered_fraction']:.2f}"
                            + (f"; to make it filter's default for this pair, put `{setting}` in the app config "
                               f"(calid serve --config app.yaml)" if setting else ""))
    notes += _quality_budgets(args, results, sweep, work)
    seconds = {(s.config, s.c): s.seconds for s in segments}
    notes.append("segment wall times (s): " + ", ".join(f"{n} c{c} {seconds[n, c]:.0f}" for c in sweep for n in names
                                                         if (n, c) in seconds))
    meta = {**results.meta, "cpu": cpu_summary()}
    js, md = write_report(folder, "pareto", "Served speed against quality (calid bench pareto)", meta, rows, columns,
                          notes)
    png = plot(rows, "humaneval", folder / "pareto.png")
    print(md.read_text())
    print(f"wrote {js}, {md} and {png}", file=sys.stderr)
    return 0


def _quality_budgets(args, results: Results, sweep: list[int], work: list) -> list[str]:
    """The quality table at the highest concurrency that has one (written where serving reads it), and each
    --loss-budgets budget's threshold checked on the held-out half: report lines."""
    from calid.bench.pareto_report import budget_rows, quality_table
    from calid.bench.report import parse_numbers
    from calid.decoding.quality_budget import CONFIDENCE, quality_path

    kinds, held = {it.key: it.kind for it in work}, {it.key for it in work if it.held_out}
    for c in reversed(sweep):
        table = quality_table(results.answers, c, kinds, held, f"calid bench pareto at {c} concurrent requests, "
                              f"{time.strftime('%Y-%m-%d')}")
        if table is not None:
            break
    else:
        return ["max_quality_loss: no filter threshold answered every calibration item (even-numbered HumanEval "
                "problems) beside ar yet: no quality table"]
    lines = [f"quality table at c={c} (HumanEval's even-numbered problems; loss = ar pass@1 - filter's, points): "
             + ", ".join(f"t={p.threshold:g} {p.loss_points:+.1f} +- {p.se_points:.1f}" for p in table.points)]
    for r in budget_rows(table, parse_numbers(args.loss_budgets), results.answers, c, kinds, held):
        filtered = r["held_out_filtered"]
        lines.append(f"max_quality_loss {r['budget_points']:g} (at {CONFIDENCE:.0%} confidence) -> threshold "
                     f"{r['threshold']:g}: calibration loss {r['calibration_loss']}; held-out loss "
                     f"{r['held_out_loss']}" + (f", filtered fraction {filtered:.2f}" if filtered != "-" else "")
                     + f"; within budget on the held-out half: {r['holds']}")
    if (args.quality_table or "").lower() != "none":
        path = Path(args.quality_table) if args.quality_table else quality_path(results.meta["target"],
                                                                               results.meta["draft"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(table.to_json(), indent=1) + "\n")
        lines.append(f"wrote the quality table max_quality_loss requests are served by to {path}")
    return lines


def _x(ratio) -> str:
    return f"{ratio:.2f}x" if isinstance(ratio, float) else "(speed not measured) x"


def _served(cfg) -> str:
    from calid.models.source import served_name

    return cfg.served_model or served_name(cfg.target)
