"""Helpers for the multinode tests: the cluster's Serve config with test models, and where actors run."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import yaml

from calid.models.presets import TEST_MODEL
from serve_app.cluster.config import AppConfig
from serve_app.cluster.local_cluster import scale_app

ROOT = Path(__file__).resolve().parents[2]
CPU_SCALE = 1 / 8  # node CPU counts and the app's CPU asks, scaled alike
WORKERS = {"draft_cpu": 2, "target_gpu": 2}  # worker nodes by type: one of each to lose, one to carry on


def cluster_app(name: str, **overrides) -> AppConfig:
    """serve_app/cluster/calid_cluster.yaml's app, as `serve deploy` reads it, with SmolLM2 (its first 16 layers the
    draft) for the Qwen pair, fp32 on CPU for cuda, and CPU asks scaled as the nodes were; resource asks
    (target_num_gpus, target_resources, draft_resources, router_resources) are the file's own. Forwards are
    batch-invariant (except in TP x PP groups, which are not built for it), so that a request's greedy output is
    the same token for token whatever its mode, batch or replica (a stream recovered on another replica
    recomputes its prefix in one forward)."""
    doc = yaml.safe_load((ROOT / "serve_app/cluster/calid_cluster.yaml").read_text())
    (app,) = doc["applications"]
    args = scale_app(app["args"], CPU_SCALE)
    args.update(target=TEST_MODEL, draft="self:16", dtype="fp32", target_device="cpu", draft_device="cpu",
                kv_budget_mb=512, worker_threads=1, app_name=name,
                batch_invariant=overrides.get("target_tp", 1) * overrides.get("target_pp", 1) == 1)
    args.update(overrides)
    return AppConfig(**args)


def reference(cfg: AppConfig, prompts: list[str], tokens: int, smol=None) -> dict[str, list[int]]:
    """Each prompt's greedy ar output in process: on the model as the app's target replicas open it, or, for a
    TP x PP group (whose shards load their layers as load_model does), on ``smol`` (the smol fixture)."""
    from calid.backends import open_model
    from calid.decoding.modes import DecodeParams
    from calid.engine import Engine
    from calid.generation import GenerationRequest, SamplingParams
    from calid.runtime.runner import ModelRunner
    from calid.text import encode_prompt

    if smol is not None:
        runner, tokenizer, eos_ids = ModelRunner(smol.model), smol.tokenizer, smol.eos_ids
    else:
        lm = open_model(cfg.target, cfg.target_backend, cfg.dtype, log=lambda line: None,
                        invariant=cfg.batch_invariant)
        runner, tokenizer, eos_ids = lm.runner, lm.tokenizer, lm.eos_ids
    out = Engine(runner, tokenizer, eos_ids).generate([
        GenerationRequest(encode_prompt(tokenizer, p), SamplingParams(max_new_tokens=tokens, ignore_eos=True),
                          decode=DecodeParams(mode="ar")) for p in prompts])
    return {p: r.output_ids for p, r in zip(prompts, out)}


def deploy(cfg: AppConfig) -> AppConfig:
    from ray import serve

    from serve_app.cluster.app import build_app

    serve.run(build_app(cfg), name=cfg.app_name, route_prefix=f"/{cfg.app_name}")
    return cfg


def actors(class_prefix: str) -> list:
    """Live actors whose class name starts with ``class_prefix``, from Ray's state API."""
    from ray.util.state import list_actors

    return [a for a in list_actors(filters=[("state", "=", "ALIVE")], limit=10_000)
            if a.class_name.startswith(class_prefix)]


def replicas(app: str, deployment: str) -> list:
    return actors(f"ServeReplica:{app}:{deployment}")


def wait_for(predicate, timeout_s: float, every_s: float = 0.5):
    end = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > end:
            return value
        time.sleep(every_s)


class Streams:
    """``n`` greedy streams over gRPC in threads, each recording its tokens, status and the longest gap
    between two chunks (the latency spike a fault causes); stream i takes prompt and mode i (cycling)."""

    def __init__(self, port: int, app: str, prompts: list[str], n: int, tokens: int, mode: str | list[str],
                 timeout_s=300):
        modes = [mode] if isinstance(mode, str) else mode
        self.results: list[dict] = [{} for _ in range(n)]
        self._n = n
        self._started = threading.Semaphore(0)  # released once per stream: at its first token, or when it ends
        self._threads = [threading.Thread(target=self._run, args=(i, port, app, prompts[i % len(prompts)], tokens,
                                                                    modes[i % len(modes)], timeout_s), daemon=True)
                         for i in range(n)]
        for t in self._threads:
            t.start()

    def _run(self, i, port, app, prompt, tokens, mode, timeout_s):
        from calid.client import Client
        from calid.client.errors import CalidAPIError

        out = self.results[i]
        out.update(prompt=prompt, mode=mode, tokens=[], code="OK", max_gap_s=0.0)
        first = True
        try:
            with Client(f"127.0.0.1:{port}", app=app, timeout=timeout_s) as c:
                last = None
                for chunk in c.stream(prompt, max_new_tokens=tokens, ignore_eos=True, mode=mode):
                    now = time.monotonic()
                    if last is not None:
                        out["max_gap_s"] = max(out["max_gap_s"], now - last)
                    last = now
                    out["tokens"] += list(chunk.token_ids)
                    if first:
                        first = False
                        self._started.release()
        except CalidAPIError as e:
            out["code"] = e.code.name
            out["message"] = e.details
        finally:
            if first:
                self._started.release()

    def wait_started(self, timeout_s: float = 300) -> None:
        """Every stream has its first token (or has ended)."""
        end = time.monotonic() + timeout_s
        for _ in range(self._n):
            if not self._started.acquire(timeout=max(0.0, end - time.monotonic())):
                raise TimeoutError(f"not every stream started within {timeout_s:g} s")

    def join(self, timeout_s: float = 600) -> list[dict]:
        for t in self._threads:
            t.join(timeout_s)
        return self.results
