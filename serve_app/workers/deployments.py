"""Draft and target deployments: one model each, behind calid.workers, with soft-state KV caches.

Every call carries a list of tasks (one router step's requests on this
replica) and answers with a ``Reply`` (serve_app.router.calls): the replica's id, the
results, and the requests whose token-id delta it could not expand. The router
pins a request to the replica that holds its caches (serve_app.router.replica_routing steers
its calls there); any replica still serves any request correctly, recomputing
on a cache miss. Calls that arrive while a forward runs are merged into the
next forward (continuous batching across routers); a call to an idle replica
starts at once. Model work runs on one executor thread, off the event loop.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from ray import serve

from calid.backends import open_draft, open_model, pick_dtype
from calid.decoding.grammar import GrammarTokens
from calid.workers import DraftWorker, TargetWorker
from serve_app.router.autoscaling import DEMAND, PENDING, QUEUE
from serve_app.router.calls import Reply, expand_all
from serve_app.cluster.config import ConfigError, load_config
from serve_app.router.metrics import WorkerMetrics

logger = logging.getLogger("ray.serve")
REPORT_TTL_S = 5.0  # a busy router reports with every call; one that stopped calling stops counting
MAX_BATCH_CALLS = 64
REBUILD_WAIT_SHARE = 0.25  # a TP/PP group rebuild waits for room this share of worker_call_timeout_s per call


def _log(line: str) -> None:
    logger.info(line)


class _Batcher:
    """One forward at a time over every call that is waiting: a call to an idle replica starts at once, and
    the calls that arrive while a forward runs (from any router) go together into the next one, at most
    MAX_BATCH_CALLS of them. ``run(calls)`` maps a list of calls' task lists to their result lists."""

    def __init__(self, run):
        self._run = run
        self._waiting: list[tuple[list, asyncio.Future]] = []
        self._busy = False
        self.inline = False  # the forwards run on the caller's thread (run_inline): an idle replica's call runs now

    @property
    def busy(self) -> bool:
        """A forward is running (a call submitted now waits for the next one)."""
        return self._busy

    async def submit(self, tasks: list) -> list:
        loop = asyncio.get_running_loop()
        if self.inline and not self._busy:  # in the caller's own task: no task, no future, no loop iteration
            self._busy = True
            try:
                return (await self._run([tasks]))[0]
            finally:
                self._busy = bool(self._waiting)
                if self._busy:  # calls that came while this one ran (none can, while a forward holds the loop)
                    loop.create_task(self._drain())
        done = loop.create_future()
        self._waiting.append((tasks, done))
        if not self._busy:
            self._busy = True
            loop.create_task(self._drain())
        return await done

    async def _drain(self) -> None:
        try:
            while self._waiting:
                batch, self._waiting = self._waiting[:MAX_BATCH_CALLS], self._waiting[MAX_BATCH_CALLS:]
                batch = [(tasks, done) for tasks, done in batch if not done.done()]  # callers that gave up
                if not batch:
                    continue
                try:
                    outs = await self._run([tasks for tasks, _ in batch])
                except Exception as e:  # every call of the forward hears it (the router isolates the culprit)
                    outs = [e] * len(batch)
                for (_, done), out in zip(batch, outs):
                    if not done.done():
                        done.set_exception(out) if isinstance(out, Exception) else done.set_result(out)
        finally:
            self._busy = False


def pin_process(cores: list[int]) -> None:
    """Run every thread of this process (and those it starts later) on ``cores`` only: a placement's device
    on CPU. Cores this node does not have: ConfigError."""
    have = os.sched_getaffinity(0)
    if not set(cores) <= have:
        raise ConfigError(f"cpu_affinity {sorted(cores)}: this node's cores are {sorted(have)}")
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), set(cores))
        except (ProcessLookupError, PermissionError):  # a thread that just ended
            pass


class _WorkerBase:
    role = ""

    def _setup(self, config) -> None:
        self.cfg = load_config(config)
        if self.role == "target" and self.cfg.cpu_affinity:
            pin_process(self.cfg.cpu_affinity)
        torch.set_num_threads(self.cfg.worker_threads or os.cpu_count() or 1)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"calid-{self.role}")
        self._reports: dict[str, tuple[float, float, float]] = {}  # router -> (time, demand, queued requests)
        self._pending = 0
        self._batches = 0
        self._busy_s = 0.0  # time in forwards (the rest of a call's time is transport and waiting)
        self._max_batch = 0
        self._metrics = WorkerMetrics(self.role)
        self._touched: dict = {}  # request id -> when a call last carried it (what this replica may hold)
        self._ids: dict = {}  # request id -> the full token ids its last call carried (to expand deltas)
        self._batch_started: float | None = None
        self._batcher = _Batcher(self._forward)
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # constructed outside a Serve replica (in-process tests)
            self.replica_id = f"local-{os.getpid()}-{id(self):x}"

    def run_inline(self) -> None:
        """Run this worker's model work on the calling event loop's own thread, with no executor (the engine
        topology: both models in the router's process). A step then makes no thread hop: on a 2-core VM an
        asyncio -> thread -> asyncio round trip costs 0.2-0.3 ms, a call's wake-up through the loop's self-pipe.
        One thread also calls llama.cpp for both models, as it must: its OpenMP team belongs to the thread that
        calls it, and once a second thread has run a forward, libgomp counts more threads than cores and from
        then on sleeps its threads at every barrier rather than spinning (Qwen 1.5B, one token, 2-core Xeon:
        72 ms a step, 97 ms after one draft forward on another thread). The loop waits while a forward runs:
        nothing else in this process could use the cores meanwhile."""
        self._executor.shutdown(wait=True)
        self._executor = None
        self._batcher.inline = True

    async def _on_model_thread(self, fn, *args):
        """``fn(*args)`` where this worker's model work runs: its executor thread, or inline (run_inline)."""
        if self._executor is None:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    @property
    def _kv_budget(self) -> int | None:
        return None if self.cfg.kv_budget_mb is None else self.cfg.kv_budget_mb * 2**20

    async def whoami(self) -> str:
        """This replica's id (the router broadcasts this to learn the running replicas)."""
        return self.replica_id

    async def _enter(self, report: dict | None) -> None:
        if report:
            self._reports[report["router"]] = (time.monotonic(), report[f"{self.role}_demand"], report["queued"])
            gone = [rid for rid in report.get("released", ()) if rid in self._touched]
            if gone:  # released by its router while this replica was not the one told
                await self.release(gone)

    async def _run_batch(self, fn, calls: list[list]) -> list[list]:
        """Run ``fn`` once over the tasks of several calls; split its results back per call.

        A request in several calls (a retry meeting the orphan it replaced) runs once, as its newest call
        says; the other call gets the same result, which nobody reads.
        """
        newest = {t.request_id: t for call in calls for t in call}
        flat = list(newest.values())
        start = time.perf_counter()
        now = time.monotonic()
        self._touched.update((t.request_id, now) for t in flat)
        await self._forget_idle(now)
        self._batch_started = now
        try:
            results = await self._on_model_thread(fn, flat)
        finally:
            self._batch_started = None
        self._batches += 1
        self._busy_s += time.perf_counter() - start
        self._max_batch = max(self._max_batch, len(flat))
        self._metrics.batch.observe(len(flat))
        self._metrics.latency.observe((time.perf_counter() - start) * 1000)
        by_id = {r.request_id: r for r in results}
        return [[by_id[t.request_id] for t in call if t.request_id in by_id] for call in calls]

    async def release(self, request_ids: list, final_ids: dict | None = None, replica: str | None = None) -> None:
        for rid in request_ids:
            self._touched.pop(rid, None)
            self._ids.pop(rid, None)
        await self._on_model_thread(self._release, request_ids, final_ids)

    async def _forget_idle(self, now: float) -> None:
        """Free caches no call has touched for cache_idle_s: their release never reached this replica."""
        idle = [rid for rid, at in self._touched.items() if now - at > self.cfg.cache_idle_s]
        if idle:
            logger.info("calid %s: freeing %d idle caches", self.role, len(idle))
            await self.release(idle)

    async def check_health(self) -> None:
        """Serve's health check: a forward running longer than worker_call_timeout_s means a hung replica,
        which Serve then replaces (the router has already retried its calls elsewhere)."""
        started = self._batch_started
        if started is not None and time.monotonic() - started > self.cfg.worker_call_timeout_s:
            raise RuntimeError(f"calid {self.role}: a forward has run for {time.monotonic() - started:.0f} s "
                               f"(worker_call_timeout_s={self.cfg.worker_call_timeout_s:g}); replica is hung")

    async def record_autoscaling_stats(self) -> dict[str, float]:
        now = time.monotonic()
        stats = {PENDING: float(self._pending)}
        for router, (at, demand, queued) in list(self._reports.items()):
            if now - at > REPORT_TTL_S:
                del self._reports[router]
                continue
            stats[DEMAND + router] = demand
            stats[QUEUE + router] = queued
        return stats

    async def costs(self) -> dict:
        """Measured forward costs of this replica's model (seconds by size), for the router's planner; a draft's
        also has ``prefill_s``: seconds per token of catching up on a request's ids."""
        if not hasattr(self, "_costs"):
            from calid import calibration

            def measure(runner) -> dict:
                if self.role == "target":
                    return calibration.verify_costs(runner).as_dict()
                return {**calibration.draft_costs(runner).as_dict(), "prefill_s": calibration.prefill_cost(runner)}

            runner = getattr(self, "_runner", None)
            self._costs = (
                await self._on_model_thread(measure, runner) if runner else {}
            )
        return self._costs

    async def stats(self) -> dict:
        """Counters for tests, the demo and benches: batches run, the largest batch, live KV caches, and the
        runner's tokens fed and, of those, ids its cache did not hold (``recomputed_tokens``: new prompts and
        caches lost to eviction), prompt ids taken over from other sequences' caches (``reused_tokens``: live
        sequences and llama.cpp's prompt cache), sequences whose prefill was another's, forked after it
        (``forked_sequences``: the n choices of a prompt; calid.runtime.twins), its forwards and, on
        llama.cpp, the ubatches they ran as (each reads every weight: more than one a forward means sequences
        of unequal length, or live sequences on scattered slots; calid.runtime.llamacpp.ubatches); sharded
        replicas report none of these. ``forward_thread``: the thread its forwards run on (run_inline)."""
        cached, thread = await self._on_model_thread(lambda: (self._cached(), threading.get_ident()))
        runner = getattr(getattr(self, "_runner", None), "stats", None)
        grammar = getattr(getattr(self, "worker", None), "grammar", None)  # rows masked, seconds (structured output)
        return {"batches": self._batches, "max_batch": self._max_batch, "cached": cached, "pending": self._pending,
                "busy_s": self._busy_s, "pid": os.getpid(), "forward_thread": thread,
                "cores": sorted(os.sched_getaffinity(0)),
                **({"tokens": runner.tokens, "recomputed_tokens": runner.recomputed_tokens,
                     "reused_tokens": runner.reused_tokens, "forked_sequences": runner.forked_sequences,
                     "forwards": runner.forwards,
                     "ubatches": runner.ubatches, "forward_s": runner.forward_s} if runner else {}),
                **({"grammar_rows": grammar.rows, "grammar_s": grammar.seconds} if grammar is not None else {})}

    def _cached(self) -> int:
        return self._runner.cached_count()

    async def _call(self, tasks: list, report: dict | None) -> Reply:
        """Expand the tasks' token-id deltas from what this replica holds, run them in the next forward, and
        answer with the requests whose delta could not be expanded (the router resends those in full)."""
        await self._enter(report)
        full, missing = expand_all(tasks, self._ids)
        self._pending += 1
        try:
            results = await self._batcher.submit(full) if full else []
        finally:
            self._pending -= 1
        for t in full:
            if t.request_id in self._touched:  # not released while it ran
                self._ids[t.request_id] = t.token_ids
        return Reply(self.replica_id, results, missing)

    async def _forward(self, calls: list[list]) -> list[list]:
        """One model pass over several calls' tasks (each deployment names its worker's method)."""
        raise NotImplementedError


@serve.deployment(name="draft", max_ongoing_requests=256)
class DraftDeployment(_WorkerBase):
    role = "draft"

    def __init__(self, config):
        self._setup(config)
        cfg = self.cfg
        lm = open_draft(cfg.draft, cfg.target, cfg.draft_backend, cfg.dtype, cfg.draft_on, self._kv_budget,
                        cfg.worker_threads, show_progress=False, log=_log, invariant=cfg.batch_invariant,
                        prompt_cache=cfg.prompt_cache, weights=cfg.draft_weights, prefill_weights=cfg.prefill_weights)
        self._runner = lm.runner
        self.worker = DraftWorker(self._runner, lm.eos_ids, max_forward_tokens=cfg.max_forward_tokens,
                                  grammar=GrammarTokens(lm.tokenizer, self._runner.vocab_size, lm.eos_ids).masks())

    async def draft(self, tasks: list, report: dict | None = None, replica: str | None = None) -> Reply:
        """``replica``: the replica the router meant this call for (serve_app.router.replica_routing); any replica
        serves it."""
        return await self._call(tasks, report)

    async def _forward(self, calls: list[list]) -> list[list]:
        return await self._run_batch(self.worker.draft, calls)

    def _release(self, request_ids, final_ids) -> None:
        self.worker.release(request_ids)


@serve.deployment(name="target", max_ongoing_requests=256)
class TargetDeployment(_WorkerBase):
    role = "target"

    def __init__(self, config):
        self._setup(config)
        cfg = self.cfg
        if cfg.sharded:  # the model lives in tp x pp shard actors; this replica drives them
            from actors.group import TargetGroup

            dtype = pick_dtype(cfg.dtype, cfg.target_on)
            self.worker = TargetGroup(
                cfg.target,
                cfg.target_tp,
                dtype,
                cfg.target_on,
                cfg.target_num_cpus,
                cfg.target_num_gpus,
                self._kv_budget,
                cfg.max_forward_tokens,
                cfg.worker_threads,
                pp=cfg.target_pp,
                micro_batches=cfg.target_micro_batches,
                resources=cfg.target_resources,
                build_wait_s=cfg.worker_call_timeout_s * REBUILD_WAIT_SHARE,
            )
            self.worker.start()  # build the group now, so the replica is ready when Serve says so
            return
        lm = open_model(cfg.target, cfg.target_backend, cfg.dtype, cfg.target_on, self._kv_budget, cfg.worker_threads,
                        show_progress=False, log=_log, graphs="cuda" if cfg.cuda_graphs else "off",
                        invariant=cfg.batch_invariant, prompt_cache=cfg.prompt_cache,
                        prefill_weights=cfg.prefill_weights)
        self._runner = lm.runner
        self.worker = TargetWorker(self._runner, max_forward_tokens=cfg.max_forward_tokens,
                                   grammar=GrammarTokens(lm.tokenizer, self._runner.vocab_size, lm.eos_ids).masks())

    def _cached(self) -> int:
        return self.worker.cached() if self.cfg.sharded else self._runner.cached_count()

    async def stats(self) -> dict:
        out = await super().stats()
        if self.cfg.sharded:  # what each shard holds: stage, tensor rank, layers, weight bytes
            out["shards"] = self.worker.holdings
        else:  # runs of plain steps ended early by an arriving request (cut_runs)
            out["runs_cut"] = self.worker.runs_cut
        return out

    async def shard_pids(self) -> list[int]:
        """Process ids of this replica's shards by rank (empty when unsharded)."""
        if not self.cfg.sharded:
            return []
        return await self._on_model_thread(self.worker.pids)

    async def verify(self, tasks: list, report: dict | None = None, replica: str | None = None) -> Reply:
        """``replica``: as in ``draft``. A call that finds a forward running (another router's) ends that
        forward's runs of plain steps after their current step, so that it joins the next forward at once."""
        if self._batcher.busy:
            self._cut_runs()
        return await self._call(tasks, report)

    async def cut_runs(self, replica: str | None = None) -> None:
        """End the runs of plain steps this replica is running after their current step (the router asks this
        when a request arrives during a run; calid.workers.TargetWorker.cut_runs). A sharded replica's shards
        run theirs to the end. ``replica``: as in ``draft``."""
        self._cut_runs()

    def _cut_runs(self) -> None:
        if not self.cfg.sharded:
            self.worker.cut_runs()

    async def _forward(self, calls: list[list]) -> list[list]:
        return await self._run_batch(self.worker.verify, calls)

    async def score(self, tasks: list, replica: str | None = None) -> list:
        """Log-probabilities of the tasks' ids (calid.workers.ScoreTask), between this replica's forwards.
        ``replica``: as in ``draft`` (the one holding the request's cache, whose prefix the score reuses)."""
        return await self._on_model_thread(self.worker.score, tasks)

    def _release(self, request_ids, final_ids) -> None:
        self.worker.release(request_ids, final_ids)
