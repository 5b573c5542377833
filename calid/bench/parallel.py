"""``calid bench parallel``: tensor-parallel decoding vs one process, and the all-reduce it pays.

One process decodes ``tokens`` greedy tokens at batch 1; then ``tp`` processes
(gloo on loopback, or NCCL with --device cuda) decode the same request with
the model sharded (calid.parallel.tp); then the same group times a bare
all-reduce of one token's hidden state, the collective TP runs twice per layer
per step. On a 2-core CPU the shards also share the cores, so TP is expected
to be slower here: it pays off where each shard has its own cores or GPU.
"""
from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

COLUMNS = ["system", "processes", "tok_s", "ratio_vs_single", "allreduce_us", "allreduce_ms_per_step",
           "same_tokens"]


def add_parser(sub) -> None:
    from calid.models.presets import TEST_MODEL

    p = sub.add_parser("parallel", help="tensor-parallel decoding vs single process, and all-reduce cost")
    p.add_argument("--model", default=TEST_MODEL)
    p.add_argument("--tp", type=int, default=3, help="shards (must divide heads, KV heads, MLP width; default 3)")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default="bench_results")
    p.set_defaults(func=run)


def _decode(model_spec: str, device: str, tokens: int, shard=None):
    from calid.engine import Engine
    from calid.generation import GenerationRequest, SamplingParams
    from calid.models.loader import load_model
    from calid.runtime.runner import ModelRunner
    from calid.text import encode_prompt

    lm = load_model(model_spec, device=device, show_progress=False)
    model = shard(lm.model) if shard else lm.model
    engine = Engine(ModelRunner(model), lm.tokenizer, lm.eos_ids)
    req = lambda: GenerationRequest(encode_prompt(lm.tokenizer, "Write a haiku about caches."),  # noqa: E731
                                    SamplingParams(max_new_tokens=tokens, ignore_eos=True))
    engine.generate([GenerationRequest(req().prompt_ids, SamplingParams(max_new_tokens=2))])  # warm-up
    start = time.perf_counter()
    out = engine.generate([req()])[0]
    return tokens / (time.perf_counter() - start), out.output_ids, lm.config


def _rank(rank: int, world: int, port: int, model_spec: str, device: str, tokens: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from calid.parallel.tp import apply_tensor_parallel

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    if device == "cuda":
        torch.cuda.set_device(rank)
    tok_s, ids, cfg = _decode(model_spec, device, tokens, lambda m: apply_tensor_parallel(m, rank, world))
    x = torch.randn(1, cfg.hidden_size, device=device)
    for _ in range(20):
        dist.all_reduce(x)
    n = 200
    dist.barrier()
    start = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(x)
    if device == "cuda":
        torch.cuda.synchronize()
    allreduce_s = (time.perf_counter() - start) / n
    if rank == 0:
        torch.save({"tok_s": tok_s, "ids": ids, "allreduce_s": allreduce_s, "layers": cfg.num_layers},
                   os.path.join(out_dir, "tp.pt"))
    dist.destroy_process_group()


def run(args) -> int:
    import tempfile

    import torch
    import torch.multiprocessing as mp

    from calid.bench.report import write_report
    from calid.models.config import ModelConfig
    from calid.models.source import resolve
    from calid.parallel.tp import check_tensor_parallel

    check_tensor_parallel(ModelConfig.from_dir(resolve(args.model).path), args.tp)  # a clear error before any work
    print(f"bench parallel: {args.model} on {args.device}; {args.tokens} greedy tokens at batch 1; "
          f"single process vs tensor parallel x{args.tp}", file=sys.stderr)
    single, single_ids, _ = _decode(args.model, args.device, args.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_rank, args=(args.tp, port, args.model, args.device, args.tokens, tmp), nprocs=args.tp,
                           join=True, start_method="spawn")
        tp = torch.load(os.path.join(tmp, "tp.pt"))
    per_step_ms = tp["allreduce_s"] * 2 * tp["layers"] * 1000
    rows = [{"system": "single process", "processes": 1, "tok_s": single, "ratio_vs_single": 1.0,
             "allreduce_us": "-", "allreduce_ms_per_step": "-", "same_tokens": "-"},
            {"system": f"tensor parallel x{args.tp}", "processes": args.tp, "tok_s": tp["tok_s"],
             "ratio_vs_single": tp["tok_s"] / single, "allreduce_us": tp["allreduce_s"] * 1e6,
             "allreduce_ms_per_step": per_step_ms, "same_tokens": str(tp["ids"] == single_ids)}]
    notes = [f"TP x{args.tp} / single: {rows[1]['ratio_vs_single']:.2f}x; all-reduce of one hidden state "
             f"{tp['allreduce_s'] * 1e6:.0f} us, x2 per layer x {tp['layers']} layers = {per_step_ms:.1f} ms per decode step",
             f"{os.cpu_count()} CPU cores shared by all {args.tp} shards (each gets {max(1, (os.cpu_count() or 1) // args.tp)} "
             "thread); TP pays where each shard has its own cores or GPU"]
    js, md = write_report(Path(args.out), f"parallel-tp{args.tp}", "Tensor parallel vs single process",
                          {"model": args.model, "device": args.device, "tokens": args.tokens}, rows, COLUMNS, notes)
    print(md.read_text())
    print(f"wrote {js} and {md}", file=sys.stderr)
    return 0
