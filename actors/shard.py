"""One shard of a TP x PP target group: a process holding one stage's layers, or its 1/tp slice of them.

Every shard runs the same TargetWorker over the same tasks. Inside each
forward, the tensor-parallel all-reduces and the pipeline's hidden-state
transfers and logits broadcast (calid.parallel) keep the shards in lockstep;
because the tasks carry the token ids and RNG state and every shard sees the
same logits, every shard reaches the same verdict and makes the same cache
edits. Rank 0's answer is the group's answer.
"""
from __future__ import annotations

import datetime
import os
import socket

import ray


@ray.remote
class TargetShard:
    def __init__(self, rank: int, tp: int, pp: int = 1):
        self.rank, self.tp, self.pp = rank, tp, pp

    def address(self) -> tuple[str, int]:
        """Rendezvous address on this node (rank 0 is asked; the others connect to it)."""
        host = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((host, 0))
            return host, s.getsockname()[1]

    def setup(self, host: str, port: int, target: str, dtype: str, device: str, kv_budget_bytes: int | None,
              max_forward_tokens: int | None, threads: int | None, micro_batches: int | None = None) -> dict:
        import torch
        import torch.distributed as dist

        from calid.models.source import resolve
        from calid.parallel.layout import Layout
        from calid.parallel.shard import build_shard
        from calid.workers import TargetWorker

        if threads:
            torch.set_num_threads(threads)
        backend = "nccl" if device == "cuda" else "gloo"
        if device == "cuda":
            torch.cuda.set_device(0)  # Ray gives each shard actor its own GPU (CUDA_VISIBLE_DEVICES)
        if host in ("127.0.0.1", "localhost"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        # a short timeout: a shard stuck in a collective because a peer died must fail, not hang for 30 min
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=self.rank,
                                world_size=self.tp * self.pp, timeout=datetime.timedelta(seconds=120))
        shard = build_shard(resolve(target, show_progress=False).path, Layout(self.tp, self.pp, micro_batches),
                            dtype, device)
        self.runner = shard.runner(kv_budget_bytes)
        self.worker = TargetWorker(self.runner, max_forward_tokens=max_forward_tokens)
        return {"rank": self.rank, "stage": shard.spec.stage, "tp_rank": shard.spec.tp_rank,
                "layers": shard.model.cfg.num_layers, "weight_bytes": shard.weight_bytes}

    def verify(self, tasks: list) -> list:
        return self.worker.verify(tasks)

    def score(self, tasks: list) -> list:
        return self.worker.score(tasks)

    def release(self, request_ids: list, final_ids: dict | None = None) -> None:
        self.worker.release(request_ids, final_ids)

    def cached(self) -> int:
        return len(self.runner.caches)

    def pid(self) -> int:
        return os.getpid()
