"""Run one function in every rank of a torch.distributed group of local processes (gloo on loopback, or NCCL).

For ``calid bench parallel`` and the distributed tests; served groups are Ray
actors instead (actors/group.py). ``job`` must be importable by module name
(spawned processes import it), and returns something torch.save can write.
"""
from __future__ import annotations

import datetime
import os
import socket
import tempfile
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world: int, job, *args, device: str = "cpu", threads: int | None = None) -> list:
    """``job(*args)`` in ``world`` spawned processes of one group; returns each rank's result, by rank.

    ``threads``: torch threads per rank (default: the machine's cores shared out evenly).
    """
    import torch
    import torch.multiprocessing as mp

    threads = threads or max(1, (os.cpu_count() or 1) // world)
    with tempfile.TemporaryDirectory(prefix="calid-group-") as out_dir:
        mp.start_processes(_rank_main, args=(world, free_port(), out_dir, device, threads, job, args), nprocs=world,
                           join=True, start_method="spawn")
        return [torch.load(Path(out_dir) / f"rank{rank}.pt", weights_only=False) for rank in range(world)]


def _rank_main(rank: int, world: int, port: int, out_dir: str, device: str, threads: int, job, args) -> None:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(threads)
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        torch.save(job(*args), os.path.join(out_dir, f"rank{rank}.pt"))
        # every rank done before any tears its group down: a rank that destroyed its group and exited while another
        # still held a gloo connection to it aborted that one ("terminate called without an active exception"),
        # about one run in ten of the tiny pipeline test
        dist.barrier()
    finally:
        dist.destroy_process_group()
