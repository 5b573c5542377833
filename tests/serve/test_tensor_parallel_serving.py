"""A target replica backed by a TP x PP group of shard actors: 3 tensor ranks (SmolLM2: 9 query / 3 KV heads)
in each of 2 pipeline stages (15 of its 30 layers each)."""
from __future__ import annotations

import os
import signal

import pytest
from serve_helpers import deploy, handle

from calid.client import Client
from calid.decoding.modes import DecodeParams
from calid.engine import Engine
from calid.generation import GenerationRequest, SamplingParams
from calid.runtime.runner import ModelRunner
from calid.text import encode_prompt
from serve_app.cluster.config import AppConfig, ConfigError

pytestmark = [pytest.mark.ray, pytest.mark.model]
PROMPTS = ["Write a Python function that checks whether a number is prime.", "List three colors of the rainbow."]


def _shard_pids() -> list[int]:
    return handle("tp", "target").shard_pids.remote().result()


def test_layouts_the_model_cannot_take_are_refused_at_the_edge(serve_port):
    from serve_app.cluster.app import build_app

    with pytest.raises(ConfigError, match="target_tp=2 x target_pp=1 does not fit .* 9 query heads"):
        build_app(AppConfig.small(app_name="tp2", draft=None, target_tp=2))
    with pytest.raises(ConfigError, match="target_pp=31 does not fit .* exceeds the model's 30 layers"):
        build_app(AppConfig.small(app_name="pp31", draft=None, target_pp=31))


def test_served_tp3_x_pp2_group_equals_the_unsharded_model_and_survives_a_dead_shard(serve_port, smol):
    from ray import serve

    deploy(AppConfig.small(app_name="tp", grpc_port=serve_port, draft=None, target_tp=3, target_pp=2,
                           target_num_cpus=0.25, dtype="fp32"))
    assert len(_shard_pids()) == 6
    shards = handle("tp", "target").stats.remote().result()["shards"]
    assert [(s["stage"], s["tp_rank"], s["layers"]) for s in shards] == [(st, r, 15) for st in (0, 1) for r in range(3)]
    engine = Engine(ModelRunner(smol.model), smol.tokenizer, smol.eos_ids)
    with Client(f"127.0.0.1:{serve_port}", app="tp", timeout=300) as c:
        for mode in ("ar", "lookahead"):
            want = engine.generate([GenerationRequest(encode_prompt(smol.tokenizer, p),
                                                      SamplingParams(max_new_tokens=24), decode=DecodeParams(mode=mode))
                                    for p in PROMPTS])
            for p, w in zip(PROMPTS, want):
                assert c.generate(p, max_new_tokens=24, mode=mode).token_ids == w.output_ids, mode

        want = c.generate(PROMPTS[0], max_new_tokens=40, ignore_eos=True).token_ids
        stream = c.stream(PROMPTS[0], max_new_tokens=40, ignore_eos=True)
        got = list(next(stream).token_ids)
        victim = _shard_pids()[4]
        os.kill(victim, signal.SIGKILL)  # a shard of the second stage dies: the group is rebuilt, the router retries
        for chunk in stream:
            got += chunk.token_ids
    assert got == want
    pids = _shard_pids()
    assert len(pids) == 6 and victim not in pids
    assert handle("tp", "target").stats.remote().result()["cached"] == 0
    serve.delete("tp")  # frees the six shard actors for the rest of the suite
