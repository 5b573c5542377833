"""What a model costs per parallel configuration: the latency tables the placement planner scores with.

Terms:
  device     one unit of the pool a placement splits (a GPU on a real cluster; here one CPU core, a Ray
             custom resource in the live app)
  config     (tp, pp): a group of tp x pp devices; a model on it is split tp ways inside each of pp stages
  step_s(b)  seconds of one decode step of b requests through the whole group, all stages and their
             communication included (a table over b = 1, 2, 4, ...; linear between and beyond its points)
  prefill    seconds per prompt token of the prompt's forward on the group
  stage_s(b) step_s(b) / pp: how long each stage is busy per step (stages are balanced); a pipeline takes
             a new step every stage_s, so pp models' steps can be in flight on one group at once
  memory     bytes each device of the group holds for the model: weights / (tp x pp) + a fixed overhead

Profiles are measured on this machine (``calid bench placement --profile``) for the configs it can run
and derived for the rest by ``scaled`` (a cluster of 16-64 devices): see there how.
"""
from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True, order=True)
class Config:
    tp: int = 1
    pp: int = 1

    def __post_init__(self):
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"tp and pp must be >= 1, got tp={self.tp} pp={self.pp}")

    @property
    def devices(self) -> int:
        return self.tp * self.pp

    def __str__(self) -> str:
        return f"tp{self.tp}xpp{self.pp}"

    @classmethod
    def parse(cls, text: str) -> "Config":
        """``tp2xpp1`` (as str() writes it)."""
        try:
            tp, pp = text.removeprefix("tp").split("xpp")
            return cls(int(tp), int(pp))
        except ValueError:
            raise ValueError(f"not a parallel config: {text!r} (expected e.g. tp2xpp1)") from None


@dataclass(frozen=True)
class Latency:
    """One config's costs: decode step seconds at batch sizes ``batches`` and prefill seconds per token."""

    batches: tuple[int, ...]
    step_s: tuple[float, ...]
    prefill_s_per_token: float

    def __post_init__(self):
        if not self.batches or len(self.batches) != len(self.step_s) or list(self.batches) != sorted(set(self.batches)):
            raise ValueError(f"batch sizes must be distinct and ascending, one step time each: {self}")
        if min(self.step_s) <= 0 or self.prefill_s_per_token < 0:
            raise ValueError(f"latencies must be positive: {self}")

    def step(self, batch: int) -> float:
        """Step seconds at ``batch``, linear between measured sizes and beyond the last two."""
        bs, ts = self.batches, self.step_s
        if batch <= bs[0] or len(bs) == 1:
            return ts[0] * max(1.0, batch / bs[0])
        i = min(bisect.bisect_left(bs, batch), len(bs) - 1)
        slope = (ts[i] - ts[i - 1]) / (bs[i] - bs[i - 1])
        return max(ts[i - 1] + slope * (batch - bs[i - 1]), ts[0])

    def scaled(self, factor: float) -> "Latency":
        return Latency(self.batches, tuple(t * factor for t in self.step_s), self.prefill_s_per_token * factor)

    def plus(self, step_overhead_s: float) -> "Latency":
        """Every step costs ``step_overhead_s`` more (a serving path's per-step cost on top of the model's)."""
        return Latency(self.batches, tuple(t + step_overhead_s for t in self.step_s), self.prefill_s_per_token)


@dataclass(frozen=True)
class ModelProfile:
    name: str
    weight_bytes: int
    latency: dict[Config, Latency] = field(hash=False)
    overhead_bytes: int = 0  # per device: runtime, KV cache reserve

    def memory_per_device(self, cfg: Config) -> float:
        return self.weight_bytes / cfg.devices + self.overhead_bytes

    def supports(self, cfg: Config) -> bool:
        return cfg in self.latency

    def stage_s(self, cfg: Config, batch: int, prefill_tokens: int = 0) -> float:
        lat = self.latency[cfg]
        return (lat.step(batch) + lat.prefill_s_per_token * prefill_tokens) / cfg.pp

    def alone_s(self, prompt_tokens: int) -> tuple[float, float]:
        """(TTFT, TPOT) of one request alone on the smallest config: what an SLO scale multiplies."""
        cfg = min(self.latency, key=lambda c: (c.devices, c))
        lat = self.latency[cfg]
        return lat.prefill_s_per_token * prompt_tokens + lat.step(1), lat.step(1)

    def alone_latency_s(self, prompt_tokens: int, output_tokens: int) -> float:
        """End-to-end seconds of one request alone on the smallest config."""
        ttft, tpot = self.alone_s(prompt_tokens)
        return ttft + tpot * (output_tokens - 1)


def to_json(profiles: dict[str, ModelProfile], meta: dict | None = None) -> dict:
    return {"meta": meta or {}, "models": {
        p.name: {"weight_bytes": p.weight_bytes, "overhead_bytes": p.overhead_bytes,
                 "configs": {str(c): {"batches": list(lat.batches), "step_s": list(lat.step_s),
                                      "prefill_s_per_token": lat.prefill_s_per_token}
                             for c, lat in sorted(p.latency.items())}}
        for p in profiles.values()}}


def from_json(doc: dict) -> dict[str, ModelProfile]:
    try:
        return {name: ModelProfile(name, int(m["weight_bytes"]),
                                   {Config.parse(c): Latency(tuple(v["batches"]), tuple(v["step_s"]),
                                                             float(v["prefill_s_per_token"]))
                                    for c, v in m["configs"].items()},
                                   int(m.get("overhead_bytes", 0)))
                for name, m in doc["models"].items()}
    except (KeyError, TypeError) as e:
        raise ValueError(f"not a placement profile file: missing or malformed {e}") from None


def save(path: Path, profiles: dict[str, ModelProfile], meta: dict | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_json(profiles, meta), indent=1))


def load(path: Path) -> tuple[dict[str, ModelProfile], dict]:
    doc = json.loads(Path(path).read_text())
    return from_json(doc), doc.get("meta", {})


@dataclass(frozen=True)
class ParallelCosts:
    """How splitting a model changes its step time, from measurements (``calid bench placement --profile``
    runs the model split 2 ways each way and compares with one process).

    tp_efficiency  speed-up of a 2-way tensor split over one device, divided by 2 (1.0: perfect); each
                   further doubling is assumed to lose the same share again (its all-reduces double)
    pp_overhead    extra whole-step time per added stage, as a share of the one-device step (the hand-off
                   of one hidden state per stage and step)
    """

    tp_efficiency: float
    pp_overhead: float

    def step_factor(self, cfg: Config) -> float:
        """A config's whole-group step time over one device's."""
        tp = 1.0 / (cfg.tp * self.tp_efficiency ** math.log2(cfg.tp)) if cfg.tp > 1 else 1.0
        return tp * (1.0 + self.pp_overhead * (cfg.pp - 1))


def scaled(base: dict[str, ModelProfile], costs: ParallelCosts, configs: list[Config],
           copies: int = 1) -> dict[str, ModelProfile]:
    """Profiles for a larger cluster, derived from one-device measurements.

    Each model's one-device table (tp1xpp1) is kept as measured; every other config's table is that table
    times ``costs.step_factor(config)`` (the measured TP/PP effect, extended by doubling). ``copies`` > 1
    serves that many independent copies of each model (``name#1``, ...: fine-tunes of one architecture with
    their own traffic), as a cluster of 16-64 devices would host more models than this machine's three.
    """
    one = Config(1, 1)
    out: dict[str, ModelProfile] = {}
    for p in base.values():
        if one not in p.latency:
            raise ValueError(f"{p.name}: no one-device (tp1xpp1) measurement to scale from")
        table = {c: p.latency[one].scaled(costs.step_factor(c)) for c in configs}
        for k in range(copies):
            name = p.name if copies == 1 else f"{p.name}#{k + 1}"
            out[name] = ModelProfile(name, p.weight_bytes, table, p.overhead_bytes)
    return out


def with_overhead(profiles: dict[str, ModelProfile], step_overhead_s: dict[str, float]) -> dict[str, ModelProfile]:
    """``profiles`` with each model's steps (every config) longer by its measured serving overhead."""
    return {name: ModelProfile(p.name, p.weight_bytes,
                               {c: lat.plus(step_overhead_s.get(name, 0.0)) for c, lat in p.latency.items()},
                               p.overhead_bytes)
            for name, p in profiles.items()}
