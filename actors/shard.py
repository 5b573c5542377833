"""One tensor-parallel shard of the target: a process in a gloo/NCCL group holding 1/tp of each layer.

Every shard runs the same TargetWorker over the same tasks: the row-parallel
all-reduces inside each forward keep the shards in lockstep, and because the
tasks carry the token ids and RNG state, every shard reaches the same verdict.
Rank 0's answer is the group's answer.
"""
from __future__ import annotations

import datetime
import os
import socket

import ray


@ray.remote
class TargetShard:
    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def address(self) -> tuple[str, int]:
        """Rendezvous address on this node (rank 0 is asked; the others connect to it)."""
        host = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((host, 0))
            return host, s.getsockname()[1]

    def setup(self, host: str, port: int, target: str, dtype: str, device: str, kv_budget_bytes: int | None,
              max_forward_tokens: int | None, threads: int | None) -> int:
        import torch
        import torch.distributed as dist

        from calid.models.loader import load_model
        from calid.parallel.tp import apply_tensor_parallel
        from calid.runtime.runner import ModelRunner
        from calid.workers import TargetWorker

        if threads:
            torch.set_num_threads(threads)
        backend = "nccl" if device == "cuda" else "gloo"
        if host in ("127.0.0.1", "localhost"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        # a short timeout: a shard stuck in a collective because a peer died must fail, not hang for 30 min
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=self.rank, world_size=self.world,
                                timeout=datetime.timedelta(seconds=120))
        lm = load_model(target, dtype, device, show_progress=False)
        model = apply_tensor_parallel(lm.model, self.rank, self.world)
        self.runner = ModelRunner(model, kv_budget_bytes)
        self.worker = TargetWorker(self.runner, max_forward_tokens=max_forward_tokens)
        return self.rank

    def verify(self, tasks: list) -> list:
        return self.worker.verify(tasks)

    def release(self, request_ids: list, final_ids: dict | None = None) -> None:
        self.worker.release(request_ids, final_ids)

    def cached(self) -> int:
        return len(self.runner.caches)

    def pid(self) -> int:
        return os.getpid()
