"""The placement planner's pieces: latency tables, arrivals, the simulator against queueing theory, and
AlpaServe's search on hand-built cases whose answers are known."""
from __future__ import annotations

import random

import pytest

from calid.placement.traffic import Slo, TraceRequest
from calid.placement import planner
from calid.placement.profile import Config, Latency, ModelProfile, ParallelCosts, from_json, scaled, to_json
from calid.placement.simulator import Group, Placement, simulate
from calid.placement.workload import Request, cv_of, gamma_gaps, workload

GB = 1 << 30
ONE = Config(1, 1)


def flat(step_s: float, prefill: float = 0.0, batch_cost: float = 0.0) -> Latency:
    """Step time step_s at batch 1, growing by batch_cost x step_s per extra request."""
    return Latency((1, 16), (step_s, step_s * (1 + 15 * batch_cost)), prefill)


def model(name: str, weight_gb: float, step_s: float, configs=(ONE,), tp_eff: float = 1.0) -> ModelProfile:
    costs = ParallelCosts(tp_eff, 0.0)
    base = ModelProfile(name, int(weight_gb * GB), {ONE: flat(step_s, batch_cost=0.1)})
    return scaled({name: base}, costs, list(configs))[name]


# ---- profiles ------------------------------------------------------------------------------------------


def test_config_text_round_trips_and_bad_text_is_a_clear_error():
    assert Config.parse(str(Config(4, 2))) == Config(4, 2)
    with pytest.raises(ValueError, match="not a parallel config"):
        Config.parse("4x2")


def test_step_time_interpolates_between_and_beyond_measured_batches():
    lat = Latency((1, 2, 4), (0.010, 0.012, 0.016), 0.001)
    assert lat.step(1) == 0.010 and lat.step(4) == 0.016
    assert lat.step(3) == pytest.approx(0.014)
    assert lat.step(8) == pytest.approx(0.024)  # the last segment's slope, extended
    with pytest.raises(ValueError):
        Latency((2, 1), (0.1, 0.2), 0.0)


def test_scaled_profiles_apply_the_measured_split_costs_and_survive_json():
    base = {"m": ModelProfile("m", GB, {ONE: flat(0.1)})}
    out = scaled(
        base,
        ParallelCosts(tp_efficiency=0.8, pp_overhead=0.1),
        [ONE, Config(2, 1), Config(4, 1), Config(1, 2)],
        copies=2,
    )
    assert set(out) == {"m#1", "m#2"}
    p = out["m#1"]
    assert p.latency[Config(2, 1)].step(1) == pytest.approx(0.1 / (2 * 0.8))
    assert p.latency[Config(4, 1)].step(1) == pytest.approx(0.1 / (4 * 0.8 ** 2))
    assert p.latency[Config(1, 2)].step(1) == pytest.approx(0.1 * 1.1)
    assert p.stage_s(Config(1, 2), 1) == pytest.approx(0.1 * 1.1 / 2)
    assert from_json(to_json(out))["m#2"].latency == p.latency


# ---- arrivals ------------------------------------------------------------------------------------------


def test_gamma_arrivals_have_the_asked_rate_and_burstiness():
    rng = random.Random(1)
    for cv in (0.5, 1.0, 4.0):
        gaps = gamma_gaps(2.0, cv, 200_000, rng)
        assert sum(gaps) / len(gaps) == pytest.approx(0.5, rel=0.05)
        assert cv_of(gaps) == pytest.approx(cv, rel=0.1)


def test_workload_gives_each_model_its_rate_and_the_trace_lengths():
    lengths = [TraceRequest(i * 0.5, 100 + i, 10 + i % 7) for i in range(50)]
    reqs = workload({"a": 4.0, "b": 1.0}, 500.0, lengths, cv=2.0, seed=3, max_output=12)
    count = {m: sum(r.model == m for r in reqs) for m in "ab"}
    assert count["a"] / 500 == pytest.approx(4.0, rel=0.15) and count["b"] / 500 == pytest.approx(1.0, rel=0.25)
    assert all(1 <= r.output_tokens <= 12 for r in reqs)
    assert [r.at_s for r in reqs] == sorted(r.at_s for r in reqs)
    traced = workload({"a": 2.0}, 100.0, lengths, cv=None)
    assert cv_of([b.at_s - a.at_s for a, b in zip(traced, traced[1:])]) < 0.01  # the trace's even gaps, kept


# ---- the simulator -------------------------------------------------------------------------------------


def _poisson(rate: float, n: int, tokens, seed: int = 0) -> list[Request]:
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(Request(t, "m", 0, tokens(rng)))
    return out


def _geometric(rng: random.Random, p: float) -> int:
    k = 1
    while rng.random() > p:
        k += 1
    return k


@pytest.mark.parametrize("service", ["deterministic", "geometric"])
def test_one_group_one_request_at_a_time_is_an_m_g_1_queue(service):
    """Batch 1, Poisson arrivals: the mean time in system is Pollaczek-Khinchine's S + lambda E[S^2] / (2 (1 - rho))."""
    step, rate, mean_tokens = 0.04, 4.0, 5
    profiles = {"m": ModelProfile("m", GB, {ONE: Latency((1,), (step,), 0.0)})}
    if service == "deterministic":
        tokens, es, es2 = (lambda rng: mean_tokens), mean_tokens * step, (mean_tokens * step) ** 2
    else:
        p = 1 / mean_tokens
        tokens, es, es2 = (lambda rng: _geometric(rng, p)), step / p, step ** 2 * (2 - p) / p ** 2
    reqs = _poisson(rate, 20_000, tokens)
    outs = simulate(Placement((Group(ONE, ("m",)),)), profiles, reqs, max_batch=1)
    rho = rate * es
    assert rho == pytest.approx(0.8)
    want = es + rate * es2 / (2 * (1 - rho))
    got = sum(o.last_s - o.sent_s for o in outs) / len(outs)
    assert got == pytest.approx(want, rel=0.08)


def test_a_batch_runs_in_lock_step_and_prefill_is_part_of_its_first_step():
    profiles = {"m": ModelProfile("m", GB, {ONE: Latency((1, 4), (0.010, 0.016), 0.001)})}
    reqs = [Request(0.0, "m", 10, 5) for _ in range(4)]
    outs = simulate(Placement((Group(ONE, ("m",)),)), profiles, reqs)
    first = 0.016 + 4 * 10 * 0.001
    for o in outs:
        assert o.first_s == pytest.approx(first)
        assert o.last_s == pytest.approx(first + 4 * 0.016)
        assert o.tokens == 5


def test_a_pipeline_overlaps_two_models_steps_but_not_one_models():
    """pp=2, one request per model: each step holds each stage half its time. Two models alternate through
    the stages, so their steps overlap; one model alone waits for its last step before the next."""
    lat = Latency((1,), (0.02,), 0.0)
    two = {m: ModelProfile(m, GB, {Config(1, 2): lat}) for m in "ab"}
    group = Placement((Group(Config(1, 2), ("a", "b")),))
    alone = simulate(group, two, [Request(0.0, "a", 0, 10)])
    assert alone[0].last_s == pytest.approx(10 * 0.02)
    both = simulate(group, two, [Request(0.0, "a", 0, 10), Request(0.0, "b", 0, 10)])
    assert max(o.last_s for o in both) == pytest.approx(10 * 0.02 + 0.01)


def test_a_group_is_woken_once_per_step_however_many_requests_arrive_while_it_works():
    """Requests that arrive while a step runs each ask for a wake-up; only the earliest pending one may run:
    before, every stale wake-up queued another for the next step's end, and they multiplied over a run (90% of
    the events and half of the planner's time on the 16-device benchmark)."""
    from calid.placement import simulator

    profiles = {m: model(m, 1, 0.05) for m in "ab"}
    rng = random.Random(3)
    requests = sorted((Request(rng.uniform(0, 5), rng.choice("ab"), 16, 40) for _ in range(60)), key=lambda r: r.at_s)
    run = simulator._Simulation(Placement((Group(ONE, ("a", "b")),)), profiles, requests, 16, False, 1.0)
    calls = []  # the group's turns: one per wake-up, finished step or arrival
    run.start_steps = lambda gi, now, inner=run.start_steps: (calls.append(now), inner(gi, now))[1]
    outcomes = run.run()
    assert all(o.tokens == 40 and o.error is None for o in outcomes)
    steps_at_most = max(o.last_s for o in outcomes) / 0.05  # steps of at least one batch-1 step's time
    assert len(calls) <= 3 * (len(requests) + steps_at_most)  # a few per step, not growing (it was 9750 here)


def test_a_pipelined_step_of_several_requests_runs_as_micro_batches():
    """4 requests on 2 stages: two micro-batches of 2, each 0.02 / 2 per stage, the second one stage behind:
    the step ends at 0.03, where one device would take step(4) = 0.04."""
    lat = Latency((1, 4), (0.01, 0.04), 0.0)
    profiles = {"m": ModelProfile("m", GB, {Config(1, 2): lat})}
    outs = simulate(Placement((Group(Config(1, 2), ("m",)),)), profiles, [Request(0.0, "m", 0, 1)] * 4)
    assert [o.last_s for o in outs] == pytest.approx([0.03] * 4)


def test_the_overlap_what_if_lets_one_models_steps_share_the_pipeline():
    """Two tokens each: calid's step-at-a-time pipeline takes 2 x 0.03; with two steps of 2 requests each in
    the pipeline at once, the second token of each half follows its first at once: done at 0.05."""
    lat = Latency((1, 4), (0.01, 0.04), 0.0)
    profiles = {"m": ModelProfile("m", GB, {Config(1, 2): lat})}
    place, reqs = Placement((Group(Config(1, 2), ("m",)),)), [Request(0.0, "m", 0, 2)] * 4
    assert max(o.last_s for o in simulate(place, profiles, reqs)) == pytest.approx(0.06)
    assert max(o.last_s for o in simulate(place, profiles, reqs, overlap=True)) == pytest.approx(0.05)


def test_a_step_is_slowed_by_the_other_devices_busy_when_it_starts():
    """Two one-device groups, corun 1.5 (a step with the other device busy takes 1.5x). Alone, a model's
    steps take their profiled time; with both busy, every step after the first starts beside the other's
    and takes 1.5x: a: 0.01, 0.025, 0.04; b (its first step already beside a's): 0.015, 0.03, 0.045."""
    lat = Latency((1,), (0.01,), 0.0)
    profiles = {m: ModelProfile(m, GB, {ONE: lat}) for m in "ab"}
    place = Placement((Group(ONE, ("a",)), Group(ONE, ("b",))))
    alone = simulate(place, profiles, [Request(0.0, "a", 0, 3)], corun=1.5)
    assert alone[0].last_s == pytest.approx(0.03)
    both = simulate(place, profiles, [Request(0.0, "a", 0, 3), Request(0.0, "b", 0, 3)], corun=1.5)
    assert [o.last_s for o in both] == pytest.approx([0.04, 0.045])
    independent = simulate(place, profiles, [Request(0.0, "a", 0, 3), Request(0.0, "b", 0, 3)])
    assert [o.last_s for o in independent] == pytest.approx([0.03, 0.03])
    with pytest.raises(ValueError, match="slowdown"):
        simulate(place, profiles, [Request(0.0, "a", 0, 3)], corun=0.5)


def test_a_model_no_group_hosts_is_reported_not_dropped():
    profiles = {"m": ModelProfile("m", GB, {ONE: flat(0.01)}), "x": ModelProfile("x", GB, {ONE: flat(0.01)})}
    outs = simulate(Placement((Group(ONE, ("m",)),)), profiles, [Request(0.0, "x", 0, 3), Request(0.0, "m", 0, 3)])
    assert "not placed" in outs[0].error and outs[1].tokens == 3


# ---- the planner ---------------------------------------------------------------------------------------


def _problem(profiles, devices, memory_gb, rates, cv, slo_scale=5.0, duration=120.0, seed=0, tokens=16):
    lengths = [TraceRequest(0.0, 32, tokens)]
    reqs = workload(rates, duration, lengths, cv=cv, seed=seed)
    slos = {}
    for m, p in profiles.items():
        ttft, tpot = p.alone_s(32)
        slos[m] = Slo(ttft * slo_scale, tpot * slo_scale)
    return planner.Problem(profiles, devices, memory_gb * GB, reqs, slos)


def test_a_model_too_big_for_one_device_is_split():
    configs = [ONE, Config(2, 1), Config(1, 2)]
    profiles = {"big": model("big", 1.5, 0.02, configs)}
    problem = _problem(profiles, 4, 1.0, {"big": 2.0}, cv=1.0)
    plan = planner.alpaserve(problem)
    assert plan.attainment > 0.9
    assert all(g.config.devices >= 2 for g in plan.placement.groups if g.models)
    assert planner.replication(problem).attainment == 0.0  # whole models only: it fits nowhere
    assert all(g.config.devices >= 2 for g in planner.dedicated(problem).placement.groups)


def test_two_light_bursty_models_share_one_split_group():
    """Memory for one whole model per device. Replication puts one model on each device; splitting both
    models over both devices lets a burst of either use both, which a tight SLO rewards."""
    configs = [ONE, Config(2, 1)]
    profiles = {m: model(m, 1.0, 0.02, configs) for m in ("a", "b")}
    problem = _problem(profiles, 2, 1.0, {"a": 1.5, "b": 1.5}, cv=4.0, slo_scale=3.0)
    plan = planner.alpaserve(problem)
    (group,) = [g for g in plan.placement.groups if g.models]
    assert group.config == Config(2, 1) and group.models == ("a", "b")
    assert plan.attainment > planner.replication(problem).attainment + 0.05


def test_a_steady_heavy_model_gets_a_group_of_its_own():
    """A heavy model with steady traffic keeps its group busy; sharing it would make the light models'
    requests wait behind its steps, so the search gives it devices no other model uses."""
    configs = [ONE, Config(2, 1)]
    profiles = {"heavy": model("heavy", 1.0, 0.03, configs), "l1": model("l1", 0.3, 0.01, configs),
                "l2": model("l2", 0.3, 0.01, configs)}
    problem = _problem(profiles, 4, 2.0, {"heavy": 3.0, "l1": 0.5, "l2": 0.5}, cv=0.5, slo_scale=3.0)
    plan = planner.alpaserve(problem)
    heavy = [g for g in plan.placement.groups if "heavy" in g.models]
    assert heavy and any(g.models == ("heavy",) for g in heavy), str(plan.placement)
    assert plan.attainment > 0.9


def test_every_model_gets_a_replica_even_where_attainment_alone_would_leave_it_out():
    """One device, memory for both models together, and a rare, slow model whose steps would make the busy
    model's requests miss: attainment alone is highest with the rare model left out (its few requests miss,
    the busy model's all meet), but a model the app serves must be reachable, so both share the device."""
    profiles = {"busy": model("busy", 0.4, 0.01), "rare": model("rare", 0.4, 0.2)}
    problem = _problem(profiles, 1, 1.0, {"busy": 8.0, "rare": 0.05}, cv=1.0, slo_scale=2.0, duration=60.0)
    without_rare = planner.attainment(problem, Placement((Group(ONE, ("busy",)),)))[0]
    with_both = planner.attainment(problem, Placement((Group(ONE, ("busy", "rare")),)))[0]
    assert without_rare > with_both  # the case this test is about: the objective prefers leaving it out
    for plan in (planner.alpaserve(problem), planner.replication(problem)):
        assert planner.unplaced(problem, plan.placement) == [], str(plan.placement)
        assert plan.attainment == pytest.approx(with_both)


def test_a_rare_model_is_placed_before_the_busy_ones_fill_the_memory():
    """Two devices, each with room for both busy models or for one of them and the rare one. Replicating the
    busy models first (each gains from a second replica) fills both devices and leaves no room for the rare
    one; it must be placed first."""
    profiles = {"b1": model("b1", 0.5, 0.02), "b2": model("b2", 0.5, 0.02), "rare": model("rare", 0.6, 0.02)}
    problem = _problem(profiles, 2, 1.15, {"b1": 20.0, "b2": 20.0, "rare": 0.05}, cv=1.0, slo_scale=3.0,
                       duration=10.0)
    for plan in (planner.alpaserve(problem), planner.replication(problem)):
        assert planner.unplaced(problem, plan.placement) == [], str(plan.placement)
        groups = [Group(ONE), Group(ONE)]
        seeded = planner._greedy(problem, groups, lambda p: planner.attainment(problem, p), 2, seed=True)
        assert plan.attainment >= seeded[1]  # the better of placing first and placing the left-out last


def test_a_model_that_fits_nowhere_stays_unplaced_and_the_rest_are_still_planned():
    profiles = {"small": model("small", 0.5, 0.01), "huge": model("huge", 3.0, 0.01)}
    problem = _problem(profiles, 2, 1.0, {"small": 2.0, "huge": 0.5}, cv=1.0)
    plan = planner.replication(problem)
    assert planner.unplaced(problem, plan.placement) == ["huge"] and plan.per_model["small"] > 0.9


def test_the_search_never_does_worse_than_replication_and_reports_its_cost():
    configs = [ONE, Config(2, 1), Config(1, 2)]
    profiles = {m: model(m, 0.6, s, configs, tp_eff=0.8) for m, s in (("a", 0.02), ("b", 0.01), ("c", 0.005))}
    problem = _problem(profiles, 4, 1.0, {"a": 1.0, "b": 2.0, "c": 3.0}, cv=2.0, duration=60.0)
    best = planner.alpaserve(problem)
    assert best.attainment >= planner.replication(problem).attainment
    assert best.simulations > 0 and best.seconds > 0 and len(best.tried) == 3  # 4x tp1, 2x tp2, 2x pp2


def test_a_problem_with_requests_for_an_unknown_model_is_refused():
    profiles = {"a": model("a", 0.5, 0.01)}
    with pytest.raises(ValueError, match="no profile: zzz"):
        planner.Problem(profiles, 2, GB, [Request(0.0, "zzz", 1, 1)], {"a": Slo(1, 1)})


def test_the_latency_slo_is_met_by_a_request_alone_and_missed_when_it_must_share():
    p = ModelProfile("m", GB, {ONE: Latency((1, 2), (0.01, 0.015), 0.001)})
    slo = planner.LatencySlo(1.0001, p)
    one = [Request(0.0, "m", 20, 8)]
    (alone,) = simulate(Placement((Group(ONE, ("m",)),)), {"m": p}, one)
    assert alone.last_s == pytest.approx(20 * 0.001 + 8 * 0.01)
    assert slo.met(one[0], alone)
    two = one * 2
    assert not any(slo.met(r, o) for r, o in zip(two, simulate(Placement((Group(ONE, ("m",)),)), {"m": p}, two)))
    assert planner.LatencySlo(1.6, p).met(two[0], simulate(Placement((Group(ONE, ("m",)),)), {"m": p}, two)[0])


# ---- the bench's command line ----------------------------------------------------------------------------


def test_bench_placement_without_a_profile_says_what_to_do(tmp_path, capsys):
    from serve_app.main import main

    for live in ([], ["--simulate"]):
        assert main(["bench", "placement", *live, "--profile-file", str(tmp_path / "none.json")]) != 0
        assert "measure one first with calid bench placement --profile" in capsys.readouterr().err


def test_a_plan_becomes_models_pinned_to_its_groups_cores():
    from calid.errors import CalidError
    from serve_app.bench.placement_live import plan_to_models

    profiles = {"big": None, "small": None, "tiny": None}
    plan = Placement((Group(ONE, ("big", "small")), Group(ONE, ("small",))))
    assert plan_to_models(plan, profiles, [4, 5, 6], 16) == [
        {"name": "big", "target": "big", "draft": None, "default_mode": "ar", "placement": [[4]], "max_active": 16},
        {"name": "small", "target": "small", "draft": None, "default_mode": "ar", "placement": [[4], [5]],
         "max_active": 16}]  # tiny is on no group: its requests are refused, as the simulator drops them
    with pytest.raises(CalidError, match="uses 2 devices and this machine has 1"):
        plan_to_models(plan, profiles, [0], 16)
    with pytest.raises(CalidError, match="one-device groups only"):
        plan_to_models(Placement((Group(Config(2, 1), ("big",)),)), profiles, [0, 1], 16)


def test_bench_placement_simulate_prints_each_planners_attainment_as_json(tmp_path, capsys):
    import json

    from serve_app.main import main
    from calid.placement.profile import save

    profiles = {"big": ModelProfile("big", 2 * GB, {ONE: Latency((1, 8), (0.05, 0.3), 0.01)}),
                "small": ModelProfile("small", GB // 4, {ONE: Latency((1, 8), (0.01, 0.06), 0.002)})}
    path = tmp_path / "profile.json"
    save(path, profiles, {"tp_efficiency": 0.8, "pp_overhead": 0.1, "cpu": "test"})
    trace = tmp_path / "trace.csv"  # the Azure trace's columns, lengths like its own
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:15:{10 + i:02d}.0000000,{100 + 37 * i % 400},{5 + 13 * i % 60}\n" for i in range(40)))
    assert main(["bench", "placement", "--simulate", "--profile-file", str(path), "--trace", str(trace),
                 "--devices", "4", "--copies", "2", "--duration", "20", "--json", "--out", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out["slo_attainment"]) == {"alpaserve", "replication", "dedicated"}
    assert all(0.0 <= v <= 1.0 for v in out["slo_attainment"].values())
    assert out["slo_attainment"]["alpaserve"] >= out["slo_attainment"]["replication"]
    assert (tmp_path / "placement.md").exists()


def test_a_serving_overhead_lengthens_every_step_and_lowers_predicted_attainment():
    from calid.placement.profile import with_overhead

    p = ModelProfile("m", GB, {ONE: Latency((1, 8), (0.01, 0.04), 0.001)})
    served = with_overhead({"m": p}, {"m": 0.005})["m"]
    assert served.latency[ONE].step_s == (0.015, 0.045) and served.latency[ONE].prefill_s_per_token == 0.001
    reqs = [Request(0.5 * i, "m", 10, 20) for i in range(10)]  # alone: 0.21 s each, no queueing
    problem = planner.Problem({"m": p}, 1, 2 * GB, reqs, {"m": planner.LatencySlo(1.3, p)})
    placement = Placement((Group(ONE, ("m",)),))
    from dataclasses import replace

    slower = replace(problem, profiles={"m": served})  # the SLO still judges against the profile as measured
    assert planner.attainment(problem, placement)[0] == 1.0 and planner.attainment(slower, placement)[0] == 0.0


def test_a_request_goes_to_the_replica_whose_cores_are_least_busy_over_every_model_on_them():
    from calid.placement.dispatch import least_loaded

    # routers: 0 = model A on core 0, 1 = model A on core 1, 2 = model B on core 0, 3 = model C anywhere
    cores = [frozenset({0}), frozenset({1}), frozenset({0}), frozenset()]
    assert least_loaded([0, 1], [1, 2, 3, 9], cores) == 1  # core 0 carries 1 + 3, core 1 only 2
    assert least_loaded([0, 1], [1, 2, 1, 9], cores) == 0  # cores tie at 2: the fewest of A's own
    assert least_loaded([0, 1], [2, 2, 0, 9], cores) == 0  # a tie on both: the lowest index
    assert least_loaded([3, 1], [0, 1, 0, 0], cores) == 3  # no cores listed: its own in-flight only


def test_scoring_a_placement_part_by_part_is_simulating_it_whole():
    """The search's scorer simulates each connected part of a placement apart and keeps the parts it has seen;
    on random placements (parts joined by shared models, groups alike, a model left out) its attainment is
    exactly the whole simulation's."""
    configs = [ONE, Config(2, 1)]
    profiles = {m: model(m, 0.3, s, configs) for m, s in (("a", 0.02), ("b", 0.01), ("c", 0.005), ("d", 0.03))}
    problem = _problem(profiles, 6, 1.0, {"a": 2.0, "b": 3.0, "c": 4.0, "d": 1.0}, cv=2.0, duration=20.0)
    rng = random.Random(3)
    score = planner._Scorer(problem)
    for _ in range(40):
        groups = tuple(Group(rng.choice(configs), tuple(sorted(rng.sample(sorted(profiles), rng.randint(0, 2)))))
                       for _ in range(rng.randint(1, 5)))
        placement = Placement(groups)
        assert score(placement) == planner.attainment(problem, placement), str(placement)
    seen = len(score._parts)
    assert score(placement) == planner.attainment(problem, placement) and len(score._parts) == seen  # cached
    fresh = planner._Scorer(planner.Problem(problem.profiles, problem.devices, problem.device_memory,
                                            problem.requests, problem.slos))  # an empty cache
    batch = [Placement((Group(ONE, (m,)), Group(ONE, (m, n)))) for m in profiles for n in profiles if n != m]
    assert fresh.many(batch) == [planner.attainment(problem, b) for b in batch]  # 12 new parts: on the cores


def test_a_lone_steady_batch_leaps_to_its_next_event_with_the_same_outcomes():
    """The simulator runs the repeated decode steps of a group's only busy model as one event until a request
    ends or one may arrive; every request's first and last token times and tokens are those of simulating
    each step."""
    from calid.placement import simulator

    configs = [ONE, Config(1, 2)]
    profiles = {m: model(m, 0.3, s, configs) for m, s in (("a", 0.02), ("b", 0.01), ("c", 0.005))}
    problem = _problem(profiles, 4, 1.0, {"a": 1.0, "b": 2.0, "c": 0.5}, cv=3.0, duration=30.0)
    placement = Placement((Group(ONE, ("a",)), Group(ONE, ("a", "b")), Group(Config(1, 2), ("c",))))

    def run(jumps: bool):
        sim = simulator._Simulation(placement, profiles, problem.requests, 16, False, 1.0)
        sim.jumps = jumps
        return sim.run(), sim.order

    (stepped, events), (leapt, fewer) = run(False), run(True)
    assert fewer < events / 2  # it leapt
    for s, o in zip(stepped, leapt):
        assert (o.tokens, o.error) == (s.tokens, s.error)
        assert o.first_s == pytest.approx(s.first_s, abs=1e-9) and o.last_s == pytest.approx(s.last_s, abs=1e-9)
