"""Command-line flags the library's commands and the engine benchmarks share: sampling, decoding mode, runtime.

Each ``add_*`` adds a group of flags to a parser; ``sampling_params`` and ``decode_params`` turn parsed flags into
the engine's request types, refusing bad combinations with a CalidError (one line at the CLI).
"""
from __future__ import annotations

import argparse

from calid.errors import CalidError


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def add_decode_args(p: argparse.ArgumentParser) -> None:
    from calid.decoding.modes import FILTER_THRESHOLD, MODES, STOP_THRESHOLD
    from calid.models.presets import DEFAULT_DRAFT

    p.add_argument("--mode", default="ar", choices=MODES, help="decoding mode (default ar: target only)")
    p.add_argument("--draft", default=DEFAULT_DRAFT,
                   help=f"draft model for non-ar modes: preset, folder, .gguf, or self:N for the target's "
                        f"first N layers (default {DEFAULT_DRAFT})")
    p.add_argument("--gamma", type=int, default=8, help="most draft tokens per target call (default 8)")
    p.add_argument("--threshold", type=float, default=None,
                   help=f"draft confidence (top-1 probability) in [0, 1]; default {FILTER_THRESHOLD:g} for filter "
                        f"(the default pair's operating point: HumanEval pass@1 within 2 points of ar), "
                        f"{STOP_THRESHOLD:g} for speculative/rollback (stop drafting below it)")
    p.add_argument("--min-agreement", type=float, default=None,
                   help="filter: a token-agreement budget instead of --threshold: the share of output tokens in (0, 1] "
                        "that must equal the target's top-1 (tokens, not task quality); the threshold follows "
                        "from the pair's calibration (calid bench quality) and moves to hold it (implies --mode "
                        "filter)")
    p.add_argument("--max-quality-loss", type=float, default=None,
                   help="filter: a budget in the task's own metric instead of --threshold: the points of task quality "
                        "(HumanEval pass@1 for the default pair) filter may lose against ar, in expectation over "
                        "items like the pair's calibration (calid bench pareto), with 90%% confidence (implies "
                        "--mode filter)")
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
    loss = getattr(args, "max_quality_loss", None)
    threshold = args.threshold
    if budget is not None or loss is not None:
        if (args.threshold is not None) + (budget is not None) + (loss is not None) > 1:
            raise CalidError("set one of --threshold, --min-agreement and --max-quality-loss (a budget chooses the "
                             "threshold)")
        if args.mode == "ar":  # the flag's default: the budget says filter
            args.mode = "filter"
    mode = args.mode
    if loss is not None:
        from calid.decoding.quality_budget import budget_decoding, table_for

        if args.mode != "filter":
            raise CalidError(f"--max-quality-loss is a budget for --mode filter, not {args.mode}")
        try:
            table = table_for(args.model, args.draft)
        except ValueError as e:
            raise CalidError(str(e)) from None
        mode, threshold = budget_decoding(loss, *table)
    return DecodeParams(mode=mode, gamma=args.gamma, threshold=threshold, rollback_nll=args.rollback_nll,
                        adaptive=args.adaptive, tree_width=args.tree_width, tree_chains=args.tree_chains,
                        min_agreement=budget, max_quality_loss=loss).validate()


def sampling_params(args):
    from calid.generation import SamplingParams

    return SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, stop=tuple(args.stop),
    ).validate()


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
