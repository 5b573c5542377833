"""The library's own commands: ``calid models list|pull`` and ``calid generate`` (no Ray, no server).

The ``calid`` command itself (serve_app/main.py) adds these next to the serving commands and the benchmarks.
"""
from __future__ import annotations

import sys

from calid.backends import build_engine
from calid.cli_args import (add_decode_args, add_runtime_args, add_sampling_args, decode_params,
                            sampling_params)
from calid.errors import CalidError


def add_parsers(sub) -> None:
    from calid.models.presets import DEFAULT_TARGET

    models = sub.add_parser("models", help="list and pull model presets")
    msub = models.add_subparsers(dest="models_command", required=True)
    msub.add_parser("list", help="list presets and whether they are pulled").set_defaults(func=cmd_models_list)
    pull = msub.add_parser("pull", help="download and verify a preset; prepare it for its backend")
    pull.add_argument("name", nargs="+")
    pull.add_argument("--backend", default="auto", choices=["auto", "torch", "llamacpp"],
                      help="llama.cpp reads the GGUF as is (auto on CPU); torch needs it converted to safetensors")
    pull.set_defaults(func=cmd_models_pull)

    gen = sub.add_parser("generate", help="generate text, streaming to the terminal")
    gen.add_argument("prompt")
    gen.add_argument(
        "--model", default=DEFAULT_TARGET, help=f"preset, model folder, .gguf or hub id (default {DEFAULT_TARGET})"
    )
    add_sampling_args(gen)
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    add_decode_args(gen)
    add_runtime_args(gen)
    gen.set_defaults(func=cmd_generate)


def cmd_models_list(args) -> int:
    from calid.models.presets import PRESETS
    from calid.models.source import preset_status
    from calid.paths import calid_home

    print(f"model cache: {calid_home()}")
    print(f"{'preset':32} {'role':7} {'GGUF':>9}  {'status':11} description")
    for p in PRESETS.values():
        print(f"{p.name:32} {p.role:7} {p.gguf_size / 2**20:7.0f}MB  {preset_status(p.name):11} {p.description}")
    return 0


def cmd_models_pull(args) -> int:
    from calid.backends import model_facts
    from calid.models.presets import PRESETS

    for name in args.name:
        if name not in PRESETS:
            raise CalidError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
    for name in args.name:
        backend, folder = model_facts(name, args.backend)
        print(f"{name}: ready for {backend} ({folder})")
    return 0


def cmd_generate(args) -> int:
    from calid.backends import open_model, pick_backend
    from calid.decoding.quality_budget import table_for
    from calid.generation import GenerationRequest
    from calid.text import encode_prompt

    if not args.prompt.strip():
        raise CalidError("prompt is empty")
    params, decode = sampling_params(args), decode_params(args)  # fail on bad flags before loading anything
    pick_backend(args.backend, args.model, args.device)
    lm = open_model(args.model, args.backend, args.dtype, args.device, invariant=args.batch_invariant)
    engine = build_engine(lm, args.draft if decode.uses_draft else None, args.backend, args.dtype, args.device,
                          extra_specs=args.extra_draft if decode.mode == "tree" else (),
                          draft_backend=args.draft_backend, invariant=args.batch_invariant,
                          draft_weights=args.draft_weights)
    if decode.min_agreement is not None:
        from calid.decoding.budget import starting_table

        engine.orchestrator.agreement, source = starting_table(args.model, args.draft)
        print(f"[min_agreement {decode.min_agreement:g}: agreement table from "
              f"{source or 'no calibration (run calid bench quality): the draft assumed calibrated'}]", file=sys.stderr)
    if decode.max_quality_loss is not None:
        chosen = (f"threshold {decode.threshold:g}" if decode.mode == "filter" else
                  "no threshold vouched for, so mode auto (the target's own tokens)")
        print(f"[max_quality_loss {decode.max_quality_loss:g} points: {chosen}, from "
              f"{table_for(args.model, args.draft)[1]}]", file=sys.stderr)
    request = GenerationRequest(encode_prompt(lm.tokenizer, args.prompt, chat=not args.raw), params, decode=decode)
    for event in engine.stream([request]):
        sys.stdout.write(event.text)
        sys.stdout.flush()
        if event.result:
            print("\n" + describe_result(lm.name, decode.mode, event.result), file=sys.stderr)
    return 0


def describe_result(model: str, mode: str, r) -> str:
    line = (f"[{model} {mode}: {len(r.output_ids)} tokens in {r.total_s:.2f} s, {r.tokens_per_s:.2f} tok/s, "
            f"first token {r.ttft_s:.2f} s, prompt {r.prompt_tokens} tokens, finish: {r.finish_reason}")
    if mode != "ar":
        s = r.stats
        line += (f"; from draft {s.filtered_fraction:.0%}, target calls {s.target_calls}"
                 + (f", mean accepted {s.mean_accepted:.2f}" if s.verifications else ""))
    return line + "]"
