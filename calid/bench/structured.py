"""``calid bench structured``: what a JSON schema costs each decoding mode, in one process, side by side.

A JSON-extraction workload (short texts to turn into an object of a given schema, through the chat template,
greedy, to EOS) runs in each mode with the schema and without it, at each concurrency, the conditions
interleaved and their order turned each round. Per row: tok/s, the ratio to ``ar`` under the same condition,
the share of answers that parse and validate against the schema, the draft's share of tokens, and the grammar's
own time (moving each request's cursor, computing and applying the mask) per output token and per masked row.
The question it answers: does speculation still pay under a grammar? (It should: a schema makes the output
more predictable, and extraction copies its input.)
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from calid.backends import cpu_summary
from calid.bench.report import write_report
from calid.progress import progress

COLUMNS = ["mode", "schema", "concurrency", "tokens", "seconds", "tok_s", "vs_ar", "valid", "draft_share",
           "grammar_ms_per_token", "grammar_ms_per_row"]
MODES = "ar,auto,speculative,tree,lookahead,filter"

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}, "occupation": {"type": "string"}},
          "required": ["name", "age", "city", "occupation"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {"item": {"type": "string"}, "quantity": {"type": "integer"},
                                          "unit_price": {"type": "number"}, "currency": {"enum": ["EUR", "USD", "GBP"]},
                                          "express": {"type": "boolean"}},
         "required": ["item", "quantity", "unit_price", "currency", "express"], "additionalProperties": False}
EVENT = {"type": "object", "properties": {"title": {"type": "string"}, "date": {"type": "string"},
                                          "location": {"type": "string"},
                                          "speakers": {"type": "array", "items": {"type": "string"}}},
         "required": ["title", "date", "location", "speakers"], "additionalProperties": False}
TEXTS = [
    (PERSON, "Maria Lopez is a 34-year-old structural engineer who lives in Valencia and designs bridges."),
    (PERSON, "At 71, retired teacher Henrik Olsen still walks his dog every morning through the parks of Aarhus."),
    (PERSON, "Our new hire, Priya Raman (28), joins the Toronto office as a data analyst next week."),
    (PERSON, "Tomasz Nowak, a 45-year-old baker from Krakow, opens his shop at four in the morning."),
    (ORDER, "Please send 12 ceramic mugs at 4.50 euros each; no rush, standard shipping is fine."),
    (ORDER, "I'd like 3 mechanical keyboards, 89.99 USD apiece, shipped express please."),
    (ORDER, "Order: 250 envelopes (C5), 0.08 GBP per envelope, express delivery to the London office."),
    (ORDER, "We need 40 folding chairs for the hall at 17 dollars per chair, ordinary delivery."),
    (EVENT, "The Rust Systems Meetup takes place on 14 March 2027 at the Kulturbrauerei in Berlin, with talks by "
            "Anna Schmidt and Luca Bianchi."),
    (EVENT, "Join us for Data Days, 2 June 2027, Lisbon Congress Centre. Speakers: Joao Silva, Mei Chen, Omar Haddad."),
    (EVENT, "PyCon Nordic is on 9 September 2027 in the Oslo Spektrum; keynote by Ingrid Berg."),
    (EVENT, "The annual astronomy night, 21 October 2027, Griffith Observatory, Los Angeles, hosted by Dr. Sam Lee."),
]


def workload(n: int) -> list[tuple[dict, str]]:
    """``n`` (schema, chat prompt) pairs: each text with the instruction to extract it into its schema."""
    out = []
    for i in range(n):
        schema, text = TEXTS[i % len(TEXTS)]
        fields = ", ".join(schema["properties"])
        out.append((schema, f"Extract the {fields} from this text as a JSON object.\n\nText: {text}"))
    return out


def add_parser(sub) -> None:
    from calid.bench.baselines import add_backend_args
    from calid.models.presets import DEFAULT_DRAFT, DEFAULT_TARGET

    p = sub.add_parser("structured", help="each mode with and without a JSON schema: tok/s, validity, mask cost")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    add_workload_args(p)
    add_backend_args(p)
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=run)


def add_workload_args(p) -> None:
    """The flags this bench and its served twin (serve_app.bench.structured_served) share."""
    p.add_argument("--small", action="store_true", help="SmolLM2-135M with its first 16 layers as the draft")
    p.add_argument("--modes", default=MODES, help=f"comma-separated (default {MODES})")
    p.add_argument("--concurrency", default="1,4", help="requests decoded together (default 1,4)")
    p.add_argument("--prompts", type=int, default=len(TEXTS), help=f"requests per condition (default {len(TEXTS)})")
    p.add_argument("--rounds", type=int, default=1, help="rounds, each in the opposite order (default 1)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--out", default="bench_results")


def checked(args) -> tuple[list[str], list[int]]:
    """(modes, concurrency levels) of ``args``, or a one-line error."""
    from calid.decoding.modes import MODES as KNOWN
    from calid.errors import CalidError

    modes = [m for m in args.modes.split(",") if m]
    levels = [int(c) for c in args.concurrency.split(",") if c.strip().isdigit()]
    if not modes or any(m not in KNOWN for m in modes) or "ar" not in modes:
        raise CalidError(f"--modes must include ar and name modes of {', '.join(KNOWN)}, got {args.modes!r}")
    if not levels or min(levels) < 1 or args.prompts < 1 or args.rounds < 1 or args.max_new_tokens < 1:
        raise CalidError("--concurrency, --prompts, --rounds and --max-new-tokens must be >= 1")
    return modes, levels


def run(args) -> int:
    import jsonschema

    from calid.backends import build_engine, open_model
    from calid.decoding.grammar import Grammar
    from calid.decoding.modes import DecodeParams
    from calid.generation import GenerationRequest, SamplingParams
    from calid.models.presets import TEST_MODEL
    from calid.text import encode_prompt

    modes, levels = checked(args)
    target_spec, draft_spec = (TEST_MODEL, "self:16") if args.small else (args.target, args.draft)
    target = open_model(target_spec, args.backend, args.dtype, args.device)
    engine = build_engine(target, draft_spec, args.backend, args.dtype, args.device, max_batch=max(levels),
                          max_forward_tokens=512)
    tok = target.tokenizer
    items = workload(args.prompts)
    prompts = [encode_prompt(tok, text) for _, text in items]
    grammars = {json.dumps(s): Grammar.compile("json_schema", json.dumps(s)) for s, _ in items}
    masks = [w.grammar for w in (engine.verifier, engine.drafter) if w is not None and w.grammar is not None]

    def requests(mode: str, schema: bool) -> list[GenerationRequest]:
        return [GenerationRequest(list(ids), SamplingParams(max_new_tokens=args.max_new_tokens,
                                                            grammar=grammars[json.dumps(s)] if schema else None),
                                  decode=DecodeParams(mode=mode)) for ids, (s, _) in zip(prompts, items)]

    print(f"bench structured: {target.describe()}; draft {draft_spec}; {len(items)} JSON-extraction requests per "
          f"condition, chat template, greedy, to EOS (<= {args.max_new_tokens} tokens); modes {', '.join(modes)}; "
          f"concurrency {args.concurrency}; {args.rounds} round(s)", file=sys.stderr)
    print(cpu_summary(), file=sys.stderr)
    engine.generate(requests("ar", True)[:1] + requests("speculative", True)[:1])  # warm-up: the grammar tokenizer
    step_ms = _step_ms(engine, prompts[0])

    conditions = conditions_of(modes, levels)
    acc = {k: new_tally() for k in conditions}
    with progress(len(conditions) * args.rounds, "bench structured", "condition") as bar:
        for r in range(args.rounds):
            for key in conditions if r % 2 == 0 else conditions[::-1]:
                mode, schema, c = key
                reqs, a = requests(mode, schema), acc[key]
                rows0, mask0 = sum(m.rows for m in masks), sum(m.seconds for m in masks)
                for i in range(0, len(reqs), c):
                    start = time.perf_counter()
                    res = engine.generate(reqs[i: i + c])
                    a["seconds"] += time.perf_counter() - start
                    for req_out, (s, _) in zip(res, items[i: i + c]):
                        a["tokens"] += len(req_out.output_ids)
                        a["draft"] += req_out.stats.draft_tokens
                        a["n"] += 1
                        a["valid"] += valid(req_out.text, s, jsonschema)
                a["rows"] += sum(m.rows for m in masks) - rows0
                a["mask_s"] += sum(m.seconds for m in masks) - mask0
                bar.update(1)

    rows, notes = table(acc, modes, levels, step_ms)
    meta = {"target": target.name, "draft": draft_spec, "backend": target.backend, "cpu": cpu_summary(),
            "requests_per_condition": len(items), "max_new_tokens": args.max_new_tokens, "rounds": args.rounds,
            "target_step_ms": round(step_ms, 1)}
    js, md = write_report(Path(args.out), f"structured-{target.name}", "Each mode with and without a JSON schema",
                          meta, rows, COLUMNS, notes)
    print(md.read_text())
    print(f"wrote {js} and {md}", file=sys.stderr)
    return 0


def conditions_of(modes: list[str], levels: list[int]) -> list[tuple[str, bool, int]]:
    """(mode, with the schema, concurrency) in the order a round runs them."""
    return [(m, s, c) for c in levels for m in modes for s in (False, True)]


def new_tally() -> dict:
    return {"tokens": 0, "seconds": 0.0, "valid": 0, "n": 0, "draft": 0, "rows": 0, "mask_s": 0.0}


def table(acc: dict, modes: list[str], levels: list[int], step_ms: float) -> tuple[list[dict], list[str]]:
    """The report's rows and notes from each condition's tally (``new_tally``)."""
    rows = []
    for mode, schema, c in conditions_of(modes, levels):
        a, ar = acc[(mode, schema, c)], acc[("ar", schema, c)]
        tok_s = a["tokens"] / a["seconds"]
        rows.append({"mode": mode, "schema": "yes" if schema else "no", "concurrency": c, "tokens": a["tokens"],
                     "seconds": round(a["seconds"], 2), "tok_s": round(tok_s, 2),
                     "vs_ar": round(tok_s / (ar["tokens"] / ar["seconds"]), 3),
                     "valid": f"{a['valid']}/{a['n']}", "draft_share": round(a["draft"] / max(1, a["tokens"]), 3),
                     "grammar_ms_per_token": round(a["mask_s"] * 1000 / max(1, a["tokens"]), 3) if schema else "-",
                     "grammar_ms_per_row": round(a["mask_s"] * 1000 / max(1, a["rows"]), 3) if schema else "-"})
    notes = [f"target plain step (ar, one request, the runner's forward time per forward): {step_ms:.1f} ms",
             "vs_ar: tok/s over ar's in the same schema condition and concurrency; a mode that pays under a grammar "
             "keeps vs_ar with the schema >= without it",
             "valid: answers that parse as JSON and validate against the request's schema",
             "grammar ms: the workers' cursor moves, mask computations and applications (llguidance), per output "
             "token and per masked row (draft and target rows)",
             cpu_summary()]
    for mode in modes:
        for c in levels:
            off, on = (next(r for r in rows if r["mode"] == mode and r["concurrency"] == c and r["schema"] == s)
                       for s in ("no", "yes"))
            if mode != "ar":
                notes.append(f"{mode} at {c}: {off['vs_ar']:.2f}x ar without the schema, {on['vs_ar']:.2f}x with it")
    return rows, notes


def _step_ms(engine, ids: list[int], steps: int = 32) -> float:
    """The target's plain decode step in ms: the forward time of ``steps`` more tokens of one request, less its
    prefill (llama.cpp's own timing of llama_decode, or the torch model's call)."""
    from calid.decoding.modes import DecodeParams
    from calid.generation import GenerationRequest, SamplingParams

    def forward_s(n: int) -> float:
        before = engine.forward_s()
        engine.generate([GenerationRequest(list(ids), SamplingParams(max_new_tokens=n, ignore_eos=True),
                                           decode=DecodeParams(mode="ar"))])
        return engine.forward_s() - before

    return (forward_s(1 + steps) - forward_s(1)) / steps * 1000


def valid(text: str, schema: dict, jsonschema) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False
