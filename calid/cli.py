"""The ``calid`` command line: models, generate, serve, client, demo, bench.

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

    from calid.client.cli import add_parser as add_client_parser

    add_client_parser(sub)
    for name, help_text in (("serve", "start an embedded local Ray and serve the calid app over gRPC"),
                            ("demo", "start the server, stream real prompts in several modes through the SDK, stop")):
        p = sub.add_parser(name, help=help_text)
        _server_cli().add_server_args(p)
        if name == "demo":
            p.add_argument("--max-new-tokens", type=int, default=64)
        p.set_defaults(func=lambda args, n=name: getattr(_server_cli(), f"cmd_{n}")(args))

    bench = sub.add_parser("bench", help="side-by-side benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    from calid.bench import ar as bench_ar
    from calid.bench import decode as bench_decode
    from calid.bench import trees as bench_trees

    bench_ar.add_parser(bsub)
    bench_decode.add_parser(bsub)
    from calid.bench import quality_curve as bench_quality

    bench_quality.add_parser(bsub)
    bench_trees.add_parsers(bsub)
    from calid.bench import sarathi as bench_sarathi

    bench_sarathi.add_parser(bsub)
    from calid.bench import parallel as bench_parallel

    bench_parallel.add_parser(bsub)
    from calid.bench import dtype as bench_dtype

    bench_dtype.add_parser(bsub)
    from calid.bench import step as bench_step

    bench_step.add_parser(bsub)
    from calid.bench import invariance as bench_invariance

    bench_invariance.add_parser(bsub)
    from calid.bench import gpu as bench_gpu

    bench_gpu.add_parser(bsub)
    from calid.bench import placement as bench_placement

    bench_placement.add_parser(bsub)
    _server_cli_module("serve_app.bench").add_parser(bsub)
    _server_cli_module("serve_app.hostile").add_parser(bsub)
    _server_cli_module("serve_app.edge_bench").add_parser(bsub)
    _server_cli_module("serve_app.load_bench").add_parser(bsub)
    _server_cli_module("serve_app.http_bench").add_parser(bsub)
    _server_cli_module("serve_app.modes_bench").add_parser(bsub)
    _server_cli_module("serve_app.peers_bench").add_parser(bsub)
    return parser


def _server_cli():
    """The serving commands live with the Ray code (serve_app); calid itself never imports ray."""
    return _server_cli_module("serve_app.cli")


def _server_cli_module(name: str):
    import importlib

    return importlib.import_module(name)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def add_decode_args(p: argparse.ArgumentParser) -> None:
    from calid.decoding.modes import MODES
    from calid.models.presets import DEFAULT_DRAFT

    p.add_argument("--mode", default="ar", choices=MODES, help="decoding mode (default ar: target only)")
    p.add_argument("--draft", default=DEFAULT_DRAFT,
                   help=f"draft model for non-ar modes: preset, folder, .gguf, or self:N for the target's "
                        f"first N layers (default {DEFAULT_DRAFT})")
    p.add_argument("--gamma", type=int, default=8, help="most draft tokens per target call (default 8)")
    p.add_argument("--threshold", type=float, default=None,
                   help="draft confidence (top-1 probability) in [0, 1]; default 0.7 for filter, "
                        "0.4 for speculative/rollback (stop drafting below it)")
    p.add_argument("--min-agreement", type=float, default=None,
                   help="filter: a quality budget instead of --threshold: the share of output tokens in (0, 1] that "
                        "must equal the target's top-1; the threshold follows from the pair's calibration "
                        "(calid bench quality) and moves to hold it (implies --mode filter)")
    p.add_argument(
        "--rollback-nll", type=float, default=2.0, help="rollback: target NLL above which a draft token is undone"
    )
    p.add_argument("--adaptive", action="store_true", help="LLMCad-style self-adaptive threshold")
    p.add_argument("--tree-width", type=int, default=3, help="tree: tokens tried where the draft is unsure")
    p.add_argument("--tree-chains", type=int, default=1, help="tree: draft chains merged by common prefix (SpecInfer)")
    p.add_argument("--extra-draft", action="append", default=[],
                   help="tree: another drafter (model spec or self:N) whose greedy chain is merged into each tree "
                        "(repeatable)")


def decode_params(args):
    from calid.decoding.modes import DecodeParams

    budget = getattr(args, "min_agreement", None)
    if budget is not None:
        if args.threshold is not None:
            raise CalidError("set --threshold or --min-agreement, not both (the budget chooses the threshold)")
        if args.mode == "ar":  # the flag's default: the budget says filter
            args.mode = "filter"
    threshold = args.threshold if args.threshold is not None else (0.7 if args.mode == "filter" else 0.4)
    return DecodeParams(mode=args.mode, gamma=args.gamma, threshold=threshold, rollback_nll=args.rollback_nll,
                        adaptive=args.adaptive, tree_width=args.tree_width,
                        tree_chains=args.tree_chains, min_agreement=budget).validate()


def build_engine(target, draft_spec: str | None, backend: str = "auto", dtype: str = "auto", device: str = "cpu",
                 max_batch: int = 8, extra_specs: list[str] | tuple = (), draft_backend: str | None = None,
                 invariant: bool | None = None, max_forward_tokens: int | None = None, draft_weights: str = "auto"):
    """Engine over an opened target (calid.backends.OpenModel), an optional draft and extra tree drafters
    (model specs, or self:N). ``draft_backend`` defaults to ``backend``; ``max_forward_tokens``: SARATHI's
    budget per forward (needed when many prompts start together: llama.cpp refuses a forward over its batch);
    ``draft_weights``: calid.models.draft_weights."""
    from calid.backends import open_draft
    from calid.engine import Engine

    if extra_specs and not draft_spec:
        raise CalidError("--extra-draft needs a main --draft")

    def runner(spec: str):
        return open_draft(spec, target, draft_backend or backend, dtype, device, invariant=invariant,
                          weights=draft_weights).runner

    return Engine(target.runner, target.tokenizer, target.eos_ids,
                  draft=runner(draft_spec) if draft_spec else None, max_batch=max_batch,
                  extra_drafts=[runner(s) for s in extra_specs], max_forward_tokens=max_forward_tokens)


def add_runtime_args(p: argparse.ArgumentParser) -> None:
    from calid.backends import BACKENDS, DTYPE_CHOICES
    from calid.models.draft_weights import CHOICES as DRAFT_WEIGHTS

    p.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="auto (default): llama.cpp on CPU for GGUF models, torch on CUDA and for model folders")
    p.add_argument("--draft-backend", default=None, choices=BACKENDS, help="the draft's backend (default: --backend)")
    p.add_argument("--draft-weights", default="auto", choices=DRAFT_WEIGHTS,
                   help="a llama.cpp draft's weights: as-is, q4_0 (a Q4_0 copy, made once), or auto (default): "
                        "the faster of the two on this machine, timed once")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="torch dtype; auto (default): bf16 on CUDA and on CPUs with native bf16, else fp32")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--batch-invariant", action="store_true", default=None,
                   help="batch-invariant forwards (greedy speculative/tree/lookahead equal ar token for token, in bf16 "
                        "too; slower: calid bench invariance). llama.cpp runs exact here by default")


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


def sampling_params(args):
    from calid.generation import SamplingParams

    return SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, stop=tuple(args.stop),
    ).validate()


def cmd_generate(args) -> int:
    from calid.backends import open_model, pick_backend
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


if __name__ == "__main__":
    sys.exit(main())
