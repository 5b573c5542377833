"""``calid bench parallel``: tensor/pipeline-parallel decoding vs one process, and the communication they pay.

Every configuration decodes the same greedy requests, side by side in one run:
  batch 1      single process, TP x tp, PP x pp, TP x tp * PP x pp;
  batch B      single process, then PP x pp with one micro-batch (stages take
               turns) and with pp micro-batches (stages overlap).
Each group is ``tp * pp`` local processes (gloo on loopback, or NCCL with
--device cuda), each loading only its slice of the checkpoint
(calid.parallel.shard). Then the same groups time their collectives: the
all-reduce of one token's hidden state (TP, twice per layer per step), the
hidden-state hand-off between stages and the logits broadcast (PP, per step).

On a 2-core CPU the shards also share the cores, so model parallelism is
expected to be slower here: it pays where each shard has its own cores or GPU.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

COLUMNS = ["system", "processes", "batch", "micro_batches", "tok_s", "ratio_vs_single", "weight_mb_per_rank",
           "comm_ms_per_step", "same_tokens"]
PROMPTS = ["Write a haiku about caches.", "Explain what a hash map is.", "Name three prime numbers.",
           "What does a compiler do?"]


def add_parser(sub) -> None:
    from calid.models.presets import TEST_MODEL

    p = sub.add_parser("parallel", help="tensor/pipeline-parallel decoding vs single process, and their communication")
    p.add_argument("--model", default=TEST_MODEL)
    p.add_argument("--tp", type=int, default=3, help="tensor-parallel ranks (must divide heads, KV heads, MLP width)")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (at most the model's layers)")
    p.add_argument("--tokens", type=int, default=32, help="new tokens per request")
    p.add_argument("--batch", type=int, default=4, help="requests decoded together in the micro-batch rows")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default="bench_results")
    p.set_defaults(func=run)


def _decode(runner, path: Path, tokens: int, batch: int) -> tuple[float, list]:
    """Greedy-decode ``batch`` requests together; tokens/s (after a warm-up) and the output ids."""
    from calid.engine import Engine
    from calid.generation import GenerationRequest, SamplingParams
    from calid.models.loader import eos_token_ids, load_tokenizer
    from calid.text import encode_prompt

    tok = load_tokenizer(path)
    engine = Engine(runner, tok, eos_token_ids(path, tok), max_batch=batch)
    ids = [encode_prompt(tok, PROMPTS[i % len(PROMPTS)]) for i in range(batch)]
    engine.generate([GenerationRequest(ids[0], SamplingParams(max_new_tokens=2))])  # warm-up
    start = time.perf_counter()
    out = engine.generate([GenerationRequest(i, SamplingParams(max_new_tokens=tokens, ignore_eos=True)) for i in ids])
    return batch * tokens / (time.perf_counter() - start), [r.output_ids for r in out]


def _time(fn, n: int = 100) -> float:
    """Seconds per call of ``fn`` (a collective: every rank calls it), after a warm-up, ranks aligned."""
    import torch.distributed as dist

    for _ in range(10):
        fn()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    dist.barrier()
    return (time.perf_counter() - start) / n


def _comm_ms_per_step(layout, cfg, batch: int, device: str) -> dict:
    """Collectives of one decode step of ``batch`` tokens, timed on this group (ms)."""
    import torch
    import torch.distributed as dist

    rank, out = dist.get_rank(), {}
    hidden = torch.randn(batch, cfg.hidden_size, device=device)
    if layout.tp > 1 and layout.pp == 1:
        out["allreduce_ms"] = _time(lambda: dist.all_reduce(hidden)) * 1000
        out["step_ms"] = out["allreduce_ms"] * 2 * cfg.num_layers
    if layout.pp > 1 and layout.tp == 1:
        def hand_off():  # every boundary passes the hidden states on, as in a forward
            if rank > 0:
                dist.recv(hidden, rank - 1)
            if rank < layout.pp - 1:
                dist.send(hidden, rank + 1)
        logits = torch.empty(batch, cfg.vocab_size, device=device)
        out["handoff_ms"] = _time(hand_off) * 1000
        out["broadcast_ms"] = _time(lambda: dist.broadcast(logits, layout.pp - 1)) * 1000
        out["step_ms"] = out["handoff_ms"] + out["broadcast_ms"]
    return out


def group_job(path: str, tp: int, pp: int, micro_batches: int, device: str, tokens: int, batch: int) -> dict:
    """One rank of a bench group: decode, then time the group's collectives."""
    from calid.parallel.layout import Layout
    from calid.parallel.shard import build_shard

    layout = Layout(tp, pp, micro_batches)
    shard = build_shard(Path(path), layout, device=device)
    tok_s, ids = _decode(shard.runner(), Path(path), tokens, batch)
    return {"tok_s": tok_s, "ids": ids, "weight_bytes": shard.weight_bytes,
            **_comm_ms_per_step(layout, shard.full_config, batch, device)}


def _row(system: str, processes: int, batch: int, mb, tok_s: float, single: float, weight_bytes: float,
         comm_ms, same) -> dict:
    return {"system": system, "processes": processes, "batch": batch, "micro_batches": mb, "tok_s": tok_s,
            "ratio_vs_single": tok_s / single, "weight_mb_per_rank": weight_bytes / 2**20,
            "comm_ms_per_step": comm_ms, "same_tokens": same}


def run(args) -> int:
    from calid.bench.hardware import decode_limit_tok_s, memory_bandwidth_gbs
    from calid.bench.report import write_report
    from calid.errors import CalidError
    from calid.models.config import ModelConfig
    from calid.models.loader import load_weights, weight_footprint
    from calid.models.source import resolve
    from calid.parallel.layout import check_layout
    from calid.parallel.local_group import run_ranks
    from calid.runtime.runner import ModelRunner

    path = resolve(args.model).path
    cfg = ModelConfig.from_dir(path)
    check_layout(cfg, args.tp, args.pp)  # a clear error before any work
    tp, pp, b = args.tp, args.pp, args.batch
    configs = []  # (label, tp, pp, micro-batches, batch)
    if tp > 1:
        configs.append((f"tensor parallel x{tp}", tp, 1, 1, 1))
    if pp > 1:
        configs += [(f"pipeline parallel x{pp}", 1, pp, 1, 1),
                    (f"pipeline parallel x{pp}, stages take turns", 1, pp, 1, b),
                    (f"pipeline parallel x{pp}, micro-batches overlap", 1, pp, pp, b)]
    if tp > 1 and pp > 1:
        configs.insert(2, (f"TP x{tp} * PP x{pp}", tp, pp, pp, 1))
    if not configs:
        raise CalidError("nothing to compare: give --tp or --pp greater than 1")
    print(f"bench parallel: {args.model} on {args.device}; {args.tokens} greedy tokens per request; "
          f"single process vs {len(configs)} parallel groups", file=sys.stderr)
    full = load_weights(path, device=args.device)
    full_bytes, read_bytes = weight_footprint(full)
    single = {n: _decode(ModelRunner(full), path, args.tokens, n) for n in sorted({1, b})}
    del full
    rows = [_row("single process", 1, n, "-", single[n][0], single[n][0], full_bytes, "-", "-") for n in sorted(single)]
    comm: dict = {}
    for i, (label, t, p, mb, n) in enumerate(configs, 1):
        print(f"[{i}/{len(configs)}] {label}, batch {n}: {t * p} processes", file=sys.stderr)
        ranks = run_ranks(t * p, group_job, str(path), t, p, mb, args.device, args.tokens, n, device=args.device)
        r0 = ranks[0]
        rows.append(_row(label, t * p, n, mb if p > 1 else "-", r0["tok_s"], single[n][0],
                         max(r["weight_bytes"] for r in ranks), r0.get("step_ms", "-"), str(r0["ids"] == single[n][1])))
        if n == 1:
            comm.update({k: v for k, v in r0.items() if k in ("allreduce_ms", "handoff_ms", "broadcast_ms")})
    notes = []
    if "allreduce_ms" in comm:
        ms = comm["allreduce_ms"]
        notes.append(f"all-reduce of one hidden state ({cfg.hidden_size} floats) {ms * 1000:.0f} us, x2 per layer x "
                     f"{cfg.num_layers} layers = {ms * 2 * cfg.num_layers:.1f} ms per decode step (TP x{tp})")
    if "handoff_ms" in comm:
        notes.append(f"PP x{pp} per decode step at batch 1: hidden-state hand-off through {pp - 1} stage boundary(ies) "
                     f"{comm['handoff_ms']:.2f} ms, logits broadcast ({cfg.vocab_size} floats) "
                     f"{comm['broadcast_ms']:.2f} ms")
        notes.append("a pipeline does not shorten one token's path (batch 1 is at best 1.0x); with micro-batches, "
                     f"stages work on different sequences at once, so throughput can approach {pp}x when each stage "
                     "has its own cores")
    if args.device == "cpu":
        bandwidth = memory_bandwidth_gbs()
        notes.append(f"physical limit at batch 1: {bandwidth:.1f} GB/s memory bandwidth / {read_bytes / 1e9:.2f} GB "
                     f"read per step = {decode_limit_tok_s(bandwidth, read_bytes):.1f} tok/s for the whole machine, "
                     "however the model is split (every rank shares the same memory here)")
    notes += [
        f"weight per rank: the largest shard's bytes; the single process holds {full_bytes / 2**20:.0f} MB. "
        "A stage holds its layers plus the embedding (first) or the head (last; a tied head is a second copy of the "
        "embedding); TP ranks replicate both",
        f"{os.cpu_count()} CPU cores shared by every process of a group (torch threads per rank: cores / "
        "processes); model parallelism pays where each shard has its own cores or GPU",
    ]
    js, md = write_report(Path(args.out), f"parallel-tp{tp}-pp{pp}", "Tensor/pipeline parallel vs single process",
                          {"model": args.model, "device": args.device, "tokens": args.tokens, "batch": b}, rows,
                          COLUMNS, notes)
    print(md.read_text())
    print(f"wrote {js} and {md}", file=sys.stderr)
    return 0
