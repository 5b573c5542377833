"""``calid bench quality``: what lossy decoding costs in quality, on whole benchmarks, and the agreement
calibration that ``min_agreement`` requests are served by.

Tasks (real data, from pinned data-set wheels): HumanEval (164 problems, pass@1 by running each problem's own
tests in a subprocess), ASDiv grade-school math (exact match of the final number) and MT-bench first turns
(agreement and NLL only: no reference answer). Configurations: ar (the target alone), the draft alone, filter
at several thresholds, rollback at several NLL bounds, and ``min_agreement`` budgets.

Measured per configuration and task kind:
  pass@1 / exact match     task quality;
  token match rate         share of output tokens equal to the target's top-1 given the same prefix (what
                           min_agreement promises; the target scores each output teacher-forced);
  prefix agreement         share of the target's greedy output reproduced before the first difference;
  target NLL               mean NLL per output token under the target;
  filtered fraction        output tokens from the draft.

The agreement calibration (calid.decoding.budget) is measured teacher-forced: the draft reads the target's
own greedy outputs of the calibration half (even-numbered items of each task) and records, per confidence
bin, how often its top-1 is the target's token. Budgets are then run on the other half only, so their
agreement is measured on prompts the calibration never saw.

Every finished request is appended to ``results.jsonl`` at once; a rerun resumes where the last stopped
(``--fresh`` starts over). Requests run batched (``--batch``, llama.cpp batched forwards): this bench
measures quality, not speed.
"""
from __future__ import annotations

import json
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from calid.bench.quality import passes_humaneval, prefix_agreement
from calid.bench.report import parse_numbers, resume_meta, write_report
from calid.decoding.modes import DecodeParams
from calid.errors import CalidError
from calid.generation import GenerationRequest, SamplingParams
from calid.progress import progress
from calid.workers.target import teacher_forced

POINTS = 2.0  # the operating point: pass@1 within this many points of ar
DRAFT_ONLY = "draft only"  # run as the draft model alone (ar on it), not through the target's engine
FORWARD_TOKENS = (
    256  # SARATHI budget per forward, a served app's default: a batch of new prompts is prefilled in chunks
)


@dataclass(frozen=True)
class Item:
    kind: str  # humaneval | math | mtbench
    key: str  # unique: kind/index
    prompt: str
    max_new: int
    reference: object = None  # humaneval: the problem; math: the answer's number
    held_out: bool = False  # odd-numbered: budgets run here, the calibration never reads it


def add_parser(sub) -> None:
    from calid.bench.baselines import add_backend_args
    from calid.models.presets import DEFAULT_DRAFT, DEFAULT_TARGET

    p = sub.add_parser("quality", help="quality vs filtered fraction on full HumanEval, ASDiv math and MT-bench; "
                                      "writes the agreement calibration min_agreement uses")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument("--limit", type=int, default=None, help="HumanEval problems (default: all 164)")
    p.add_argument("--math", type=int, default=100, help="ASDiv problems (default 100 of 2305)")
    p.add_argument("--mtbench", type=int, default=20, help="MT-bench first turns (default 20 of 80)")
    p.add_argument("--max-new-tokens", type=int, default=320, help="HumanEval and MT-bench cap; math gets 160")
    p.add_argument("--filter-thresholds", default="0.9,0.8,0.6,0.4,0.2", help="top-1 probabilities")
    p.add_argument("--rollback-nlls", default="1,2,4", help="target NLL bounds (rollback drafts with threshold 0.4)")
    p.add_argument("--budgets", default="0.95,0.98,0.99", help="min_agreement budgets (held-out half)")
    p.add_argument("--only", default=None, help="comma-separated configuration names to run (default: all, in order)")
    p.add_argument("--batch", type=int, default=8, help="requests decoded together (default 8)")
    p.add_argument("--out", default="bench_results")
    p.add_argument("--fresh", action="store_true", help="discard earlier partial results of this pair")
    p.add_argument("--calibration", default=None, help="where to write the agreement calibration (default: where "
                   "serving reads it for this pair, under CALID_HOME/calibration)")
    p.add_argument("--no-score", action="store_true", help="generate only; score and report in a later run "
                   "(scoring runs the target over every output: ~2.5 s each for the Qwen pair on 2 cores)")
    p.add_argument("--report-only", action="store_true", help="generate nothing: score and report what earlier "
                   "(possibly stopped) runs left (with --no-score: report without scoring; token match and NLL "
                   "only where scored)")
    add_backend_args(p)
    p.set_defaults(func=run)


# ---- tasks -------------------------------------------------------------------------------

def items(limit: int | None, n_math: int, n_mt: int, max_new: int) -> list[Item]:
    from calid.bench.data import humaneval, humaneval_prompts, math_problems, mtbench_questions

    problems = humaneval()[:limit]
    out = [Item("humaneval", f"humaneval/{i}", text, max_new, p, i % 2 == 1)
           for i, (text, p) in enumerate(zip(humaneval_prompts(len(problems)), problems))]
    out += [Item("math", f"math/{i}", q, min(max_new, 160), answer, i % 2 == 1)
            for i, (q, answer) in enumerate(math_problems(n_math))]
    out += [Item("mtbench", f"mtbench/{i}", q["turns"][0], max_new, None, i % 2 == 1)
            for i, q in enumerate(mtbench_questions()[:n_mt])]
    return out


def last_number(text: str) -> float | None:
    found = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def solved(item: Item, text: str) -> bool | None:
    """Task quality of one output (None: the task has no reference)."""
    if item.kind == "humaneval":
        return passes_humaneval(text, item.reference)
    if item.kind == "math":
        got = last_number(text)
        return got is not None and math.isclose(got, item.reference, rel_tol=1e-6, abs_tol=1e-6)
    return None


# ---- configurations ----------------------------------------------------------------------

def configs(args) -> list[tuple[str, DecodeParams]]:
    out = [("ar", DecodeParams(mode="ar")), (DRAFT_ONLY, DecodeParams(mode="filter", gamma=8, threshold=0.0))]
    out += [(f"filter t={t:g}", DecodeParams(mode="filter", gamma=8, threshold=t))
            for t in parse_numbers(args.filter_thresholds)]
    out += [(f"rollback nll>{r:g}", DecodeParams(mode="rollback", gamma=8, threshold=0.4, rollback_nll=r))
            for r in parse_numbers(args.rollback_nlls)]
    out += [(f"min_agreement {b:g}", DecodeParams(mode="filter", gamma=8, min_agreement=b))
            for b in parse_numbers(args.budgets)]
    for name, d in out:
        d.validate()
    if args.only:
        wanted = [x.strip() for x in args.only.split(",") if x.strip()]
        unknown = [w for w in wanted if w not in dict(out)]
        if unknown:
            raise CalidError(f"--only: unknown configuration(s) {unknown}; known: {', '.join(n for n, _ in out)}")
        out = [c for c in out if c[0] in wanted or c[0] == "ar"]  # ar is every comparison's reference
    return out


# ---- the results file (resume) -----------------------------------------------------------

class Store:
    """results.jsonl: one line per finished (configuration, item); meta.json: what they were run with."""

    def __init__(self, folder: Path, meta: dict, fresh: bool):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.path, meta_path = folder / "results.jsonl", folder / "meta.json"
        if fresh:
            self.path.unlink(missing_ok=True)
        resume_meta(meta_path, meta, self.path.exists())
        self.rows: dict[tuple[str, str], dict] = {}
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # a line cut short when the last run was stopped
                    continue
                self.rows[(row["config"], row["key"])] = row

    def add(self, row: dict) -> None:
        self.rows[(row["config"], row["key"])] = row
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def get(self, config: str, key: str) -> dict | None:
        return self.rows.get((config, key))


# ---- teacher-forced scoring --------------------------------------------------------------

@torch.inference_mode()
def score(runner, key: str, prompt: list[int], output: list[int]) -> tuple[list[float], list[int], list[float]]:
    """Under ``runner``, for each output token: its log-probability, the model's top-1 there and the top-1's
    probability. The sequence is cached under ``key`` (a prompt scored again is not recomputed)."""
    logp_out, top_ids, top_p = [], [], []
    for lp, chosen in teacher_forced(runner, key, prompt + output, len(prompt)):
        logp_out += chosen
        best, best_id = lp.max(-1)
        top_ids += best_id.tolist()
        top_p += best.exp().tolist()
    return logp_out, top_ids, top_p


def calibrate(store: Store, work: list[Item], prompt_ids: dict[str, list[int]], draft_runner, target: str,
              draft: str, path: Path) -> dict:
    """The draft, teacher-forced on the target's greedy outputs of the calibration half: per confidence bin,
    positions and matches; written where serving reads it."""
    from calid.decoding.budget import BINS, AgreementTable, bin_of

    positions, matches = [0.0] * BINS, [0.0] * BINS
    calib = [it for it in work if not it.held_out and store.get("ar", it.key)]
    with progress(len(calib), "calibrating the draft's confidence", "prompt") as bar:
        for it in calib:
            out = store.get("ar", it.key)["output_ids"]
            _, top_ids, top_p = score(draft_runner, "__calibrate__", prompt_ids[it.key], out)
            for token, best, p in zip(out, top_ids, top_p):
                b = bin_of(p)
                positions[b] += 1
                matches[b] += best == token
            bar.update(1)
    draft_runner.release("__calibrate__")
    table = AgreementTable([max(n, 0.0) for n in positions], matches) if sum(positions) else None
    if table is None:
        raise CalidError("no ar outputs of the calibration half yet: run the ar configuration first")
    data = table.to_json(target=target, draft=draft, prompts=len(calib), tokens=int(sum(positions)),
                         measured="the draft teacher-forced on the target's greedy outputs (calid bench quality)")
    path.write_text(json.dumps(data, indent=2) + "\n")
    return data


def _calibrated(path: Path, store: Store, work: list[Item]) -> bool:
    """The calibration file covers every ar output of the calibration half there is."""
    have = sum(1 for it in work if not it.held_out and store.get("ar", it.key))
    try:
        return json.loads(path.read_text()).get("prompts", -1) >= have
    except (OSError, json.JSONDecodeError):
        return False


# ---- the run -----------------------------------------------------------------------------

def run(args) -> int:
    from calid.backends import cpu_summary, open_model
    from calid.backends import build_engine
    from calid.decoding.budget import AgreementTable, calibration_path
    from calid.engine import Engine
    from calid.text import encode_prompt

    if args.batch < 1 or args.max_new_tokens < 1 or (args.limit is not None and args.limit < 0):
        raise CalidError("--batch and --max-new-tokens must be >= 1, --limit >= 0")
    cfgs = configs(args)
    work = items(args.limit, args.math, args.mtbench, args.max_new_tokens)
    target = open_model(args.target, args.backend, args.dtype, invariant=False)
    engine = build_engine(target, args.draft, args.backend, args.dtype, max_batch=args.batch, invariant=False,
                          max_forward_tokens=FORWARD_TOKENS)
    tok = target.tokenizer
    meta = {"target": args.target, "draft": args.draft, "max_new_tokens": args.max_new_tokens, "sampling": "greedy",
            "gamma": 8}
    folder = Path(args.out) / f"quality-{_safe(args.target)}--{_safe(args.draft)}"
    store = Store(folder, meta, args.fresh)
    prompt_ids = {it.key: encode_prompt(tok, it.prompt) for it in work}
    print(f"bench quality: target {target.describe()}, draft {args.draft}; "
          f"{sum(it.kind == 'humaneval' for it in work)} HumanEval + {sum(it.kind == 'math' for it in work)} ASDiv + "
          f"{sum(it.kind == 'mtbench' for it in work)} MT-bench prompts, greedy, batch {args.batch}; "
          f"{len(cfgs)} configurations; results in {folder} (resumable)", file=sys.stderr)
    print(cpu_summary(), file=sys.stderr)

    cal_path = Path(args.calibration) if args.calibration else calibration_path(args.target, args.draft)
    for name, decode in [] if args.report_only else cfgs:
        todo = [it for it in work if store.get(name, it.key) is None and (decode.min_agreement is None or it.held_out)]
        if not todo:
            continue
        if decode.min_agreement is not None:
            if not _calibrated(cal_path, store, work):
                calibrate(store, work, prompt_ids, engine.draft, args.target, args.draft, cal_path)
            engine.orchestrator.agreement = AgreementTable.load(cal_path)
        if name == DRAFT_ONLY:  # the draft model decoding alone (filter at 0 would let the target decode the
            # first token of a request whose prompt the draft is still prefilling in chunks)
            alone = Engine(engine.draft, tok, target.eos_ids, max_batch=args.batch, max_forward_tokens=FORWARD_TOKENS)
            _generate(alone, store, name, DecodeParams(mode="ar"), todo, prompt_ids, tok, from_draft=True)
        else:
            _generate(engine, store, name, decode, todo, prompt_ids, tok)
    if not args.report_only and any(store.get("ar", it.key) for it in work) and not _calibrated(cal_path, store, work):
        calibrate(store, work, prompt_ids, engine.draft, args.target, args.draft, cal_path)
    if args.no_score and not args.report_only:
        return 0
    if not args.no_score:
        _score_all(engine.target, store, cfgs, work, prompt_ids)
    rows = summarize(cfgs, work, store)
    _report(args, folder, target, rows, work, cal_path)
    return 0


def _generate(engine, store: Store, name: str, decode: DecodeParams, todo: list[Item], prompt_ids, tok,
              from_draft: bool = False) -> None:
    """Run ``todo`` through ``engine`` and store each result as it finishes (``from_draft``: the engine's model
    is the draft: every token counts as drafted)."""
    by_id = {}
    reqs = []
    for it in todo:
        r = GenerationRequest(prompt_ids[it.key], SamplingParams(max_new_tokens=it.max_new), decode=decode,
                              request_id=f"{name}|{it.key}")
        by_id[r.request_id] = it
        reqs.append(r)
    start, tokens = time.perf_counter(), 0
    with progress(len(reqs), f"{name}", "prompt") as bar:
        for event in engine.stream(reqs):
            res = event.result
            if res is None:
                continue
            it = by_id[event.request_id]
            text = tok.decode(res.output_ids, skip_special_tokens=True)
            tokens += len(res.output_ids)
            store.add({"config": name, "key": it.key, "output_ids": res.output_ids, "text": text,
                       "draft_tokens": len(res.output_ids) if from_draft else res.stats.draft_tokens,
                       "target_calls": 0 if from_draft else res.stats.target_calls,
                       "solved": solved(it, text)})
            bar.update(1)
            bar.set_postfix_str(f"{tokens / (time.perf_counter() - start):.1f} tok/s")


def _score_all(target_runner, store: Store, cfgs, work: list[Item], prompt_ids) -> None:
    """Each output's token match rate and NLL under the target (teacher-forced), once (kept in the store)."""
    pending = [(name, it) for it in work for name, _ in cfgs
               if (row := store.get(name, it.key)) is not None and "match" not in row]
    with progress(len(pending), "scoring outputs under the target", "output") as bar:
        for name, it in pending:  # item by item: the prompt stays cached across configurations
            row = store.get(name, it.key)
            out = row["output_ids"]
            logp, top_ids, _ = score(target_runner, "__score__", prompt_ids[it.key], out) if out else ([], [], [])
            row["match"] = sum(a == b for a, b in zip(out, top_ids))
            row["nll_sum"] = -sum(logp)
            store.add(row)
            bar.update(1)
    target_runner.release("__score__")


def summarize(cfgs, work: list[Item], store: Store) -> list[dict]:
    rows = []
    for name, decode in cfgs:
        for kind in ("humaneval", "math", "mtbench", "all"):
            its = [it for it in work if (kind == "all" or it.kind == kind)
                   and (decode.min_agreement is None or it.held_out)]
            done = [(it, store.get(name, it.key)) for it in its if store.get(name, it.key)]
            if not done:
                continue
            tokens = sum(len(r["output_ids"]) for _, r in done)
            graded = [r["solved"] for _, r in done if r["solved"] is not None]
            refs = [(r, store.get("ar", it.key)) for it, r in done]
            scored = [r for _, r in done if "match" in r]
            ref_graded = [store.get("ar", it.key)["solved"] for it, r in done
                          if r["solved"] is not None and store.get("ar", it.key)]
            rows.append(
                {
                    "config": name,
                    "task": kind,
                    "done": f"{len(done)}/{len(its)}",
                    "quality": sum(graded) / len(graded) if graded else "-",
                    "ar_quality_same_items": sum(ref_graded) / len(ref_graded)
                    if len(ref_graded) == len(graded) and graded
                    else "-",
                    "filtered_fraction": sum(r["draft_tokens"] for _, r in done) / tokens if tokens else 0.0,
                    "token_match": (
                        sum(r["match"] for r in scored) / sum(len(r["output_ids"]) for r in scored)
                        if scored and sum(len(r["output_ids"]) for r in scored)
                        else "-"
                    ),
                    "prefix_agreement": (
                        sum(prefix_agreement(r["output_ids"], a["output_ids"]) for r, a in refs if a)
                        / sum(1 for _, a in refs if a)
                        if any(a for _, a in refs)
                        else "-"
                    ),
                    "target_nll": (
                        sum(r["nll_sum"] for r in scored) / sum(len(r["output_ids"]) for r in scored)
                        if scored and sum(len(r["output_ids"]) for r in scored)
                        else "-"
                    ),
                    "tokens": tokens,
                }
            )
    return rows


def operating_point(rows: list[dict]) -> dict | None:
    """The lossy HumanEval row with the largest filtered fraction whose pass@1 is within POINTS of ar's."""
    he = [r for r in rows if r["task"] == "humaneval" and isinstance(r["quality"], float)]
    ar = next((r for r in he if r["config"] == "ar"), None)
    if ar is None:
        return None
    ok = [r for r in he if r["config"] != "ar" and r["quality"] >= ar["quality"] - POINTS / 100
          and r["done"].split("/")[0] == r["done"].split("/")[1]]
    return max(ok, key=lambda r: r["filtered_fraction"], default=None)


def _report(args, folder: Path, target, rows: list[dict], work: list[Item], cal_path: Path) -> None:
    from calid.backends import cpu_summary
    from calid.bench.plot import quality_curve

    columns = ["config", "task", "done", "quality", "ar_quality_same_items", "filtered_fraction", "token_match",
               "prefix_agreement", "target_nll", "tokens"]
    notes = ["quality: HumanEval pass@1 (each problem's tests, subprocess) / ASDiv exact match of the final number; "
             "MT-bench has none",
             "token_match: output tokens equal to the target's top-1 given the same prefix (what min_agreement "
             "budgets); prefix_agreement: share of ar's output reproduced before the first difference",
             "min_agreement rows run on the held-out half only (odd-numbered items), ar_quality_same_items is ar "
             "on those items; the calibration read the even-numbered half",
             f"agreement calibration: {cal_path}", cpu_summary()]
    point = operating_point(rows)
    if point:
        notes.insert(0, f"operating point (HumanEval pass@1 within {POINTS:g} points of ar, most drafted): "
                        f"{point['config']}: pass@1 {point['quality']:.3f}, filtered fraction "
                        f"{point['filtered_fraction']:.2f}")
    meta = {"target": target.describe(), "draft": args.draft, "max_new_tokens": args.max_new_tokens,
            "sampling": "greedy", "items": len(work), "cpu": cpu_summary()}
    js, md = write_report(folder, "quality", "Quality of lossy decoding vs filtered fraction", meta, rows, columns,
                          notes)
    png = quality_curve(rows, folder / "quality.png")
    from calid.bench.report import markdown_table

    print(markdown_table(rows, columns))
    for n in notes:
        print(f"- {n}")
    print(f"wrote {js}, {md}, {png}", file=sys.stderr)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)
