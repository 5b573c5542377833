"""The ``calid`` command line: models, generate, bench.

Errors a user can fix print one line (``calid: error: ...``) and exit 2.
"""
from __future__ import annotations

import argparse
import sys

from calid.errors import CalidError


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except CalidError as exc:
        print(f"calid: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("calid: interrupted", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    from calid.models.presets import DEFAULT_TARGET

    parser = argparse.ArgumentParser(prog="calid", description="Serve LLMs faster with draft models.")
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="list and pull model presets")
    msub = models.add_subparsers(dest="models_command", required=True)
    msub.add_parser("list", help="list presets and whether they are pulled").set_defaults(func=cmd_models_list)
    pull = msub.add_parser("pull", help="download, verify and convert a preset")
    pull.add_argument("name", nargs="+")
    pull.set_defaults(func=cmd_models_pull)

    gen = sub.add_parser("generate", help="generate text, streaming to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=DEFAULT_TARGET, help=f"preset, model folder, .gguf or hub id (default {DEFAULT_TARGET})")
    add_sampling_args(gen)
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    add_runtime_args(gen)
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="side-by-side benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    from calid.bench import ar as bench_ar

    bench_ar.add_parser(bsub)
    return parser


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def add_runtime_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--device", default="cpu", help="cpu or cuda")


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
    from calid.models.presets import PRESETS
    from calid.models.source import resolve

    for name in args.name:
        if name not in PRESETS:
            raise CalidError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
    for name in args.name:
        source = resolve(name)
        print(f"{name}: ready at {source.path}")
    return 0


def sampling_params(args):
    from calid.generation import SamplingParams

    return SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, stop=tuple(args.stop),
    ).validate()


def cmd_generate(args) -> int:
    from calid.engine import Engine
    from calid.generation import GenerationRequest
    from calid.models.loader import load_model
    from calid.runtime.runner import ModelRunner
    from calid.text import encode_prompt

    if not args.prompt.strip():
        raise CalidError("prompt is empty")
    params = sampling_params(args)  # fail on bad flags before loading anything
    lm = load_model(args.model, args.dtype, args.device)
    generator = Engine(ModelRunner(lm.model), lm.tokenizer, lm.eos_ids)
    request = GenerationRequest(encode_prompt(lm.tokenizer, args.prompt, chat=not args.raw), params)
    for event in generator.stream([request]):
        sys.stdout.write(event.text)
        sys.stdout.flush()
        if event.result:
            r = event.result
            print(
                f"\n[{lm.name}: {len(r.output_ids)} tokens in {r.total_s:.2f} s, {r.tokens_per_s:.2f} tok/s, "
                f"first token {r.ttft_s:.2f} s, prompt {r.prompt_tokens} tokens, finish: {r.finish_reason}]",
                file=sys.stderr,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
