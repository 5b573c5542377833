"""topology: engine on a real local Ray over real gRPC: one router deployment holds the draft and the target
and calls them in process; every mode's greedy output equals the split app's and the in-process engine's."""
from __future__ import annotations

import pytest

from calid import hugepages
from calid.client import Client
from calid.decoding.modes import MODES
from serve_app.cluster.config import AppConfig, ConfigError, load_config
from serve_helpers import deploy, handle

pytestmark = [pytest.mark.ray, pytest.mark.model]

PROMPTS = ["Write a Python function that checks whether a number is prime.",
           "List three colors of the rainbow."]


@pytest.fixture(scope="module")
def engine_app(serve_port):
    return deploy(AppConfig.small(app_name="engine", grpc_port=serve_port, dtype="fp32", topology="engine"))


@pytest.fixture(scope="module")
def engine_client(engine_app):
    with Client(f"127.0.0.1:{engine_app.grpc_port}", app=engine_app.app_name, timeout=300) as c:
        yield c


def test_the_router_times_its_workers_as_it_starts_before_any_request(engine_app):
    """auto's costs are measured as the router starts (Router.calibrated, which deploy waits on as serve_app
    does), not by the first auto request, which used to wait 10-19 s for them on the Qwen pair."""
    stats = handle(engine_app.app_name, "router").stats.remote().result()
    assert stats["steps"] == 0, "run this module's tests in file order: this one needs a router that served nothing"
    assert set(stats["call_overhead_ms"]) == {"target", "draft"}
    assert stats["costs_known"]


def test_the_app_is_one_router_deployment_holding_both_models(engine_app):
    from ray import serve

    deployments = serve.status().applications[engine_app.app_name].deployments
    assert set(deployments) == {"router"}
    workers = handle(engine_app.app_name, "router").worker_stats.remote().result()
    assert set(workers) == {"draft", "target"}


@pytest.mark.skipif(hugepages.why_not() is not None, reason=f"no huge pages here: {hugepages.why_not()}")
def test_the_replica_holding_the_models_keeps_them_on_huge_pages(engine_app):
    """calid.hugepages: the embedded Ray's processes start with malloc's huge-page tunable, so the weights and KV
    the router replica allocates sit on 2 MiB pages (a decode step 12% faster on a 2-core VM)."""
    stats = handle(engine_app.app_name, "router").stats.remote().result()
    assert stats["pages"].startswith("huge pages"), stats["pages"]
    with open(f"/proc/{stats['pid']}/smaps_rollup") as f:
        huge_kb = next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages"))
    assert huge_kb >= 64 << 10, f"{huge_kb} kB on huge pages"


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_gives_the_split_apps_tokens(engine_client, client, mode):
    for prompt in PROMPTS[:1]:
        got = engine_client.generate(prompt, max_new_tokens=20, mode=mode)
        want = client.generate(prompt, max_new_tokens=20, mode=mode)
        assert got.token_ids == want.token_ids, f"{mode}: {got.text!r} != {want.text!r}"
        assert got.stats["mode"] == mode
        if mode in ("filter", "rollback"):
            assert got.stats["filtered_fraction"] == pytest.approx(want.stats["filtered_fraction"])


def test_workers_run_in_the_routers_process_and_count_their_forwards(engine_app, engine_client):
    router = handle(engine_app.app_name, "router")
    before = router.worker_stats.remote().result()
    engine_client.generate(PROMPTS[0], max_new_tokens=8, mode="speculative")
    after = router.worker_stats.remote().result()
    stats = router.stats.remote().result()
    assert after["target"]["busy_s"] > before["target"]["busy_s"]
    assert after["draft"]["busy_s"] > before["draft"]["busy_s"]
    assert after["target"]["pid"] == after["draft"]["pid"] == stats["pid"]
    # and on one thread: llama.cpp called from a second one slows every later forward (run_inline)
    assert after["target"]["forward_thread"] == after["draft"]["forward_thread"]
    # a no-op call to a worker costs microseconds here, not a process hop: the planner prices it so
    assert max(stats["call_overhead_ms"].values(), default=0.0) < 5.0


def test_openai_streaming_and_logprobs_work_through_the_in_process_target(engine_app, http_port):
    import openai

    from calid.models.source import served_name

    oai = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/{engine_app.app_name}/v1", api_key="x",
                        max_retries=0)
    model = served_name(engine_app.target)
    kw = dict(model=model, prompt=PROMPTS[1], max_tokens=8, temperature=0, extra_body={"mode": "lookahead"})
    streamed = "".join(c.choices[0].text for c in oai.completions.create(stream=True, **kw) if c.choices)
    whole = oai.completions.create(logprobs=2, **kw)
    assert streamed == whole.choices[0].text
    lp = whole.choices[0].logprobs  # scored by the target worker inside the router's process
    assert len(lp.token_logprobs) == whole.usage.completion_tokens
    assert all(x <= 1e-3 for x in lp.token_logprobs) and all(1 <= len(t) <= 2 for t in lp.top_logprobs)


def test_a_model_parallel_target_needs_the_split_topology():
    with pytest.raises(ConfigError, match="topology split"):
        load_config(AppConfig.small(topology="split").model_dump() | {"topology": "engine", "target_tp": 2})
