"""``calid bench gpu``: the torch runtime on a GPU, random weights of real shapes, beside HF ``generate``.

Needs only torch and transformers (no Ray, no model download): from a plain
checkout, ``python -m calid.bench.gpu``. The target has Qwen2.5-7B's shape, the
draft Qwen2.5-0.5B's (bf16, seeded random weights); prompts are random ids.
Every mode decodes the same prompts at batch 1, 8 and 32 with EOS ignored:

* ``ar``, ``speculative`` (the draft's chains) and ``tree`` through calid's
  engine, greedy; a mode with ``+graphs`` (default: ``ar+graphs``) runs the
  same with decode steps replayed from CUDA graphs (``--graphs cuda``);
* HF transformers ``generate`` on the very same weight tensors (an HF twin that
  shares their memory), greedy, batch for batch.

Columns: tokens/s, the ratio to HF at the same batch, the HBM limit (measured
copy bandwidth / weight bytes one step reads, times the batch) and the share
of it reached, and whether greedy output equals ``ar``'s. With random weights
a draft is rarely accepted, so speculative and tree rows measure the runtime's
overhead of drafting and verifying, not a real speed-up.

``--check`` runs the correctness checks on the device instead: every mode's
greedy output equals ``ar``'s, and sampled speculative decoding follows the
target's distribution (total variation of the first token over many seeds).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from calid.models.config import ModelConfig

SHAPES = {  # name: (vocab, hidden, intermediate, layers, heads, kv heads, head dim, rope theta, tied)
    "qwen2.5-7b": (152064, 3584, 18944, 28, 28, 4, 128, 1e6, False),
    "qwen2.5-0.5b": (151936, 896, 4864, 24, 14, 2, 64, 1e6, True),
    "tiny": (512, 64, 128, 4, 4, 2, 16, 1e4, False),
    "tiny-draft": (512, 64, 128, 1, 4, 2, 16, 1e4, True),
}
PAIRS = {"qwen2.5": ("qwen2.5-7b", "qwen2.5-0.5b"), "tiny": ("tiny", "tiny-draft")}
GRAPHS = "+graphs"
COLUMNS = ["mode", "batch", "tokens", "seconds", "tok_s", "ratio_vs_hf", "limit_tok_s", "pct_of_limit",
           "same_as_ar", "accepted_per_call"]


class IdTokenizer:
    """Random-id prompts need no vocabulary: text is the ids."""

    def decode(self, ids, **kw):
        return " ".join(map(str, ids))


def shape_config(name: str, max_position: int = 4096) -> ModelConfig:
    vocab, hidden, inter, layers, heads, kv, dim, theta, tied = SHAPES[name]
    return ModelConfig(model_type="qwen2", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=dim, rms_norm_eps=1e-6,
                       rope_theta=theta, max_position=max_position, tie_word_embeddings=tied, qkv_bias=True)


@torch.no_grad()
def random_model(cfg: ModelConfig, dtype, device, seed: int = 0, std: float = 0.02):
    """A decoder of ``cfg``'s shape with seeded N(0, std) weights, built directly on ``device`` in ``dtype``."""
    from calid.models.llama import LlamaModel

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaModel(cfg)
    finally:
        torch.set_default_dtype(previous)
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.copy_(torch.randn(p.shape, generator=generator, device=device, dtype=torch.float32) * std)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    return model.eval()


def hf_twin(model):
    """HF transformers' Qwen2 on the same weight tensors (shared memory, no copy)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from calid.models.hf_export import hf_config, hf_state_dict

    with torch.device("meta"):
        hf = Qwen2ForCausalLM(Qwen2Config(**hf_config(model), torch_dtype=model.dtype))
    hf.load_state_dict(hf_state_dict(model), strict=False, assign=True)
    if model.cfg.tie_word_embeddings:
        hf.tie_weights()
    with torch.device(model.device):  # the rotary tables are buffers, not weights: build them off the meta device
        hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hf.config)
    return hf.eval()


def copy_bandwidth_gbs(device, megabytes: int = 1024) -> float:
    """Device memory bandwidth from timed copies: bytes read + written per second."""
    n = megabytes * 2**20 // 4
    src, dst = torch.empty(n, device=device), torch.empty(n, device=device)
    dst.copy_(src)
    _sync(device)
    t, reps = time.perf_counter(), 10
    for _ in range(reps):
        dst.copy_(src)
    _sync(device)
    return 2 * 4 * n * reps / (time.perf_counter() - t) / 1e9


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def weight_read_bytes(model) -> int:
    """Bytes one decode step reads: every weight, the embedding only as one row unless tied to the head."""
    embed = model.embed.weight
    tied = model.lm_head.weight is embed
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total if tied else total - embed.numel() * embed.element_size()


def decode(engine, prompts, mode: str, new_tokens: int, device):
    from calid.decoding.modes import DecodeParams
    from calid.generation import GenerationRequest, SamplingParams

    reqs = [GenerationRequest(list(p), SamplingParams(max_new_tokens=new_tokens, ignore_eos=True),
                              decode=DecodeParams(mode=mode, threshold=0.0)) for p in prompts]
    _sync(device)
    t = time.perf_counter()
    results = engine.generate(reqs)
    _sync(device)
    return results, time.perf_counter() - t


def hf_decode(hf, prompts, new_tokens: int, device):
    ids = torch.tensor(prompts, device=device)
    _sync(device)
    t = time.perf_counter()
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                      do_sample=False, pad_token_id=0)
    _sync(device)
    return out[:, ids.shape[1]:].tolist(), time.perf_counter() - t


def bench(args) -> list[dict]:
    from calid.engine import Engine
    from calid.runtime.runner import ModelRunner

    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    target_name, draft_name = PAIRS[args.pair]
    target = random_model(shape_config(target_name), dtype, device, seed=0)
    draft = random_model(shape_config(draft_name), dtype, device, seed=1)
    hf = hf_twin(target)
    bandwidth = copy_bandwidth_gbs(device)
    limit_b1 = bandwidth * 1e9 / weight_read_bytes(target)
    print(f"bench gpu: {target_name} target, {draft_name} draft, {args.dtype} on {_device_name(device)}; "
          f"copy bandwidth {bandwidth:.0f} GB/s, batch-1 limit {limit_b1:.1f} tok/s", file=sys.stderr)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in args.batches:
        prompts = torch.randint(10, target.cfg.vocab_size, (batch, args.prompt_len), generator=gen).tolist()
        engines = {graphs: Engine(ModelRunner(target, graphs=graphs), IdTokenizer(), frozenset(),
                                  draft=ModelRunner(draft, graphs=graphs), max_batch=batch)
                   for graphs in {"off", *(args.graphs for m in args.modes if m.endswith(GRAPHS))}}
        run = lambda mode, n: decode(engines[args.graphs if mode.endswith(GRAPHS) else "off"], prompts,  # noqa: E731
                                     mode.removesuffix(GRAPHS), n, device)
        for mode in args.modes:  # warm-up: kernels, the block pool, graph capture, the planner's calibration
            run(mode, 4)
        hf_decode(hf, prompts, 4, device)
        hf_out, hf_s = hf_decode(hf, prompts, args.new_tokens, device)
        tokens = batch * args.new_tokens
        outputs = {}
        for mode in args.modes:
            results, seconds = run(mode, args.new_tokens)
            outputs[mode] = [r.output_ids for r in results]
            calls = sum(r.stats.target_calls for r in results) or 1
            rows.append(_row(mode, batch, tokens, seconds, hf_s, limit_b1, outputs,
                             sum(r.stats.accepted_total for r in results) / calls))
            print(f"  batch {batch} {mode}: {tokens / seconds:.1f} tok/s", file=sys.stderr)
        outputs["hf"] = hf_out
        rows.append(_row("hf generate", batch, tokens, hf_s, hf_s, limit_b1, outputs, None))
    return rows


def _row(mode, batch, tokens, seconds, hf_seconds, limit_b1, outputs, accepted) -> dict:
    tok_s, limit = tokens / seconds, limit_b1 * batch
    key = "hf" if mode == "hf generate" else mode
    same = outputs[key] == outputs["ar"] if "ar" in outputs else None
    return {"mode": mode, "batch": batch, "tokens": tokens, "seconds": seconds, "tok_s": tok_s,
            "ratio_vs_hf": hf_seconds / seconds, "limit_tok_s": limit, "pct_of_limit": 100 * tok_s / limit,
            "same_as_ar": same, "accepted_per_call": accepted}


def _device_name(device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def check_greedy_modes(device, dtype=torch.float32) -> dict[str, bool]:
    """Greedy output of every mode equals ar's on ``device`` (a small random model, peaked logits); so does
    every lossless mode with decode steps replayed from graphs (captured on CUDA, the static step elsewhere)."""
    from calid.decoding.modes import MODES, DecodeParams
    from calid.engine import Engine
    from calid.generation import GenerationRequest, SamplingParams
    from calid.models.self_draft import self_draft
    from calid.runtime.runner import ModelRunner

    model = random_model(shape_config("tiny"), dtype, device, seed=0, std=0.2)
    graphs = "cuda" if torch.device(device).type == "cuda" else "static"
    outputs = {}
    for suffix, how in (("", "off"), (GRAPHS, graphs)):
        engine = Engine(ModelRunner(model, graphs=how), IdTokenizer(), frozenset(),
                        draft=ModelRunner(self_draft(model, 1), graphs=how))
        for mode in MODES:
            reqs = [GenerationRequest([3, 1, 4, 1, 5 + i] * 3, SamplingParams(max_new_tokens=16, ignore_eos=True),
                                      decode=DecodeParams(mode=mode)) for i in range(4)]
            outputs[mode + suffix] = [r.output_ids for r in engine.generate(reqs)]
    lossless = [m + suffix for m in MODES if m not in ("filter", "rollback") for suffix in ("", GRAPHS)]
    return {m: outputs[m] == outputs["ar"] for m in lossless if m != "ar"}


def sampled_tv(device, mode: str = "speculative", n: int = 2000) -> tuple[float, float]:
    """(TV to the target, TV to the draft) of the first sampled token of ``n`` seeded requests in ``mode``."""
    from calid.decoding.modes import DecodeParams
    from calid.decoding.sampling import Warp, warp
    from calid.engine import Engine
    from calid.generation import GenerationRequest, SamplingParams
    from calid.models.self_draft import self_draft
    from calid.runtime.runner import ModelRunner, SeqInput

    model = random_model(shape_config("tiny"), torch.float32, device, seed=0, std=0.2)
    draft = self_draft(model, 1)
    prompt, w = [5, 17, 3], Warp(temperature=0.5, top_k=8)
    engine = Engine(ModelRunner(model), IdTokenizer(), frozenset(), draft=ModelRunner(draft), max_batch=512)
    decode = DecodeParams(mode=mode, gamma=2, threshold=0.0)
    reqs = [GenerationRequest(list(prompt), SamplingParams(max_new_tokens=2, temperature=w.temperature,
                                                           top_k=w.top_k, seed=i), decode=decode) for i in range(n)]
    first = torch.tensor([r.output_ids[0] for r in engine.generate(reqs)])
    empirical = torch.bincount(first, minlength=model.cfg.vocab_size).float() / n
    with torch.inference_mode():
        p, q = (warp(ModelRunner(m).forward([SeqInput("x", prompt)])[0], w)[0].cpu() for m in (model, draft))
    return float(0.5 * (empirical - p).abs().sum()), float(0.5 * (empirical - q).abs().sum())


def add_parser(sub) -> None:
    p = sub.add_parser("gpu", help="random-weight Qwen2.5 7B/0.5B shapes on a GPU: ar/speculative/tree vs HF generate")
    _arguments(p)
    p.set_defaults(func=run)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pair", choices=sorted(PAIRS), default="qwen2.5", help="target/draft shapes (tiny: a smoke run)")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--modes", default="ar,ar+graphs,speculative,tree",
                   help="modes; a mode ending in +graphs replays decode steps from graphs (--graphs)")
    p.add_argument("--graphs", choices=["cuda", "static"], default=None,
                   help="what +graphs modes use: captured CUDA graphs (default on CUDA), or their static step "
                        "uncaptured (default elsewhere)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--check", action="store_true", help="run the correctness checks on the device instead")
    p.add_argument("--out", default="bench_results")


def run(args) -> int:
    from calid.bench.report import parse_numbers, write_report
    from calid.errors import CalidError

    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        raise CalidError("no CUDA device here: calid bench gpu needs one (--device cpu --pair tiny for a smoke run)")
    if args.check:
        greedy = check_greedy_modes(args.device)
        tv_target, tv_draft = sampled_tv(args.device)
        print(f"greedy equal to ar: {greedy}\nsampled speculative first token: TV to target {tv_target:.3f}, "
              f"to draft {tv_draft:.3f}")
        return 0 if all(greedy.values()) and tv_target < 0.05 else 1
    args.batches = parse_numbers(args.batches, int)
    args.modes = [m for m in args.modes.split(",") if m]
    args.graphs = args.graphs or ("cuda" if torch.device(args.device).type == "cuda" else "static")
    if not args.batches or min(args.batches) < 1 or args.new_tokens < 1 or args.prompt_len < 1:
        raise CalidError("--batches, --new-tokens and --prompt-len must be >= 1")
    if "ar" not in args.modes:
        args.modes.insert(0, "ar")
    rows = bench(args)
    notes = ["limit_tok_s: measured device copy bandwidth / weight bytes one decode step reads x batch",
             "ratio_vs_hf: HF generate seconds / this row's seconds, same batch, same weights",
             "random weights: drafts are rarely accepted, so speculative/tree rows show the overhead of drafting"]
    js, md = write_report(Path(args.out), f"gpu-{args.pair}", "calid torch runtime on GPU vs HF generate",
                          {"pair": args.pair, "dtype": args.dtype, "device": _device_name(torch.device(args.device)),
                           "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}, rows, COLUMNS, notes)
    print(md.read_text())
    print(f"wrote {js} and {md}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    from calid.errors import CalidError

    parser = argparse.ArgumentParser(prog="python -m calid.bench.gpu", description=__doc__.splitlines()[0])
    _arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except CalidError as exc:
        print(f"calid bench gpu: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
