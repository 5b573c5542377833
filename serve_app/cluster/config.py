"""Deployment configuration of the calid Serve application, validated at the edge.

``AppConfig`` is what ``build_app`` (and the Serve YAML's ``args``) takes.
Field checks run when it is built; ``check_models`` and ``check_resources``
are the cross-cutting checks (draft and target share a vocabulary; the
cluster can place the minimum replicas) that run once, before any replica
starts, so that a bad deployment fails with one clear message instead of
replicas crash-looping.
"""
from __future__ import annotations

import re

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from calid.decoding.modes import FILTER_THRESHOLD, MODES
from calid.errors import CalidError
from calid.models.draft_weights import CHOICES as DRAFT_WEIGHTS
from calid.runtime.prefill_weights import CHOICES as PREFILL_WEIGHTS
from calid.decoding.quality_budget import table_for
from calid.models.presets import DEFAULT_DRAFT, DEFAULT_TARGET, FILTER_OPERATING_POINTS, TEST_MODEL
from calid.models.self_draft import parse_self_draft


class ConfigError(CalidError):
    """The deployment configuration cannot work."""


class ScalingConfig(BaseModel):
    """Replica bounds and the load one replica is sized for (see serve_app.router.autoscaling)."""

    model_config = ConfigDict(extra="forbid")
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    tokens_per_replica: float = Field(8.0, gt=0, description="token demand (tokens/s) one replica absorbs")
    queue_per_replica: float = Field(4.0, gt=0, description="pending calls one replica may have queued")
    upscale_delay_s: float = Field(2.0, ge=0)
    downscale_delay_s: float = Field(20.0, ge=0)
    look_back_period_s: float = Field(12.0, gt=0)

    @model_validator(mode="after")
    def _bounds(self):
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) < min_replicas ({self.min_replicas})")
        return self


class RouterScaling(BaseModel):
    """Router replicas: Serve's own autoscaling on the gRPC calls each router holds. Each router decodes its
    requests in its own step loop; all of them share the worker replicas (whose forwards merge their calls)."""

    model_config = ConfigDict(extra="forbid")
    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float | None = Field(None, gt=0, description="calls one router is sized for "
                                                  "(None: max_active)")

    @model_validator(mode="after")
    def _bounds(self):
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) < min_replicas ({self.min_replicas})")
        return self


MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class ModelSpec(BaseModel):
    """One model of a multi-model app (AppConfig.models): what it serves under, its pair, its default mode,
    its SLO and how its target is split. Unset fields take the app's values."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="the id requests name it by (proto and OpenAI `model`)")
    target: str
    draft: str | None = None  # a model spec, "self:N", or None: target-only
    default_mode: str | None = None
    filter_threshold: float | None = Field(None, ge=0, le=1, description="as the app's, for this model's pair")
    quality_table: str | None = Field(None, description="as the app's, for this model's pair")
    slo_ttft_ms: float | None = Field(None, gt=0, description="time-to-first-token SLO")
    slo_tpot_ms: float | None = Field(None, gt=0, description="time-per-output-token SLO")
    target_tp: int | None = Field(None, ge=1, le=64)
    target_pp: int | None = Field(None, ge=1, le=256)
    target_num_cpus: float | None = Field(None, ge=0)
    draft_num_cpus: float | None = Field(None, ge=0)
    max_active: int | None = Field(None, ge=1)
    queue_capacity: int | None = Field(None, ge=0)
    placement: list[list[int]] | None = Field(None, description="the device groups hosting this model (a "
                                              "placement plan's groups; on CPU, lists of cores): one router and "
                                              "target per group, its target pinned to the group's cores; requests "
                                              "for the model go to the one with the fewest in flight. None: one, "
                                              "unpinned")

    @model_validator(mode="after")
    def _name(self):
        if not MODEL_NAME.match(self.name):
            raise ValueError(f"model name {self.name!r}: letters, digits, '.', '_' and '-' only (at most 64)")
        if self.placement is not None and (not self.placement or any(not g or min(g) < 0 for g in self.placement)):
            raise ValueError(f"model {self.name!r}: placement takes one or more non-empty lists of core ids >= 0")
        return self


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    target: str = DEFAULT_TARGET
    draft: str | None = DEFAULT_DRAFT  # a model spec, "self:N" (target's first N layers) or None
    dtype: str = "auto"  # torch dtype; auto: bf16 on CUDA and on CPUs with native bf16, else fp32
    device: str = "cpu"  # the target's device unless target_device says otherwise
    draft_device: str | None = Field(None, description="device of the draft replicas: cpu (draft replicas are given "
                                     "no GPU, so they run on CPU nodes beside GPU targets)")
    target_device: str | None = Field(None, description="device of the target replicas (default: device)")
    batch_invariant: bool = Field(False, description="batch-invariant forwards on both backends (a request's logits "
                                  "do not depend on what shares its batch nor on its mode's forward shapes: greedy "
                                  "speculative/tree/lookahead equal ar token for token). torch: fixed-shape kernels, "
                                  "8-60% slower on a 2-core CPU (calid bench invariance); llama.cpp: exact mode, every "
                                  "forward cut into calls of at most 3 rows, ~2.4x less throughput at 12 concurrent "
                                  "requests on K-quant GGUFs (calid bench modes). Off: one llama.cpp call per forward")
    prompt_cache: bool = Field(True, description="llama.cpp workers in batched mode keep a finished request's KV "
                               "until its slot is needed, and a new request sharing its prefix (a chat's system "
                               "prompt, a conversation's earlier turns) prefills only the rest. Its rows come from "
                               "another forward's shape, so near-tie greedy tokens may differ from a fresh "
                               "prefill's; batch_invariant turns it off")
    cuda_graphs: bool = Field(False, description="a CUDA target replays its decode steps from captured CUDA graphs "
                              "(batch buckets 1-32; calid.runtime.graphs); not for TP/PP groups")
    target_backend: str = Field("auto", description="auto: llama.cpp on CPU for GGUF models, torch on CUDA, "
                                "for TP/PP groups and for model folders; or torch / llamacpp")
    draft_backend: str = Field("auto", description="as target_backend, for the draft (self:N always runs on torch)")
    draft_weights: str = Field("auto", description="a llama.cpp draft's weights: as-is (the GGUF as shipped), q4_0 "
                               "(a Q4_0 copy, made once), or auto: the faster of the two on this machine, timed "
                               "once (calid.models.draft_weights)")
    prefill_weights: str = Field("auto", description="a batched llama.cpp model's prompts prefilled on its weights "
                                 "as llama.cpp repacks them, or on a second, plain copy (as much KV again) where "
                                 "that is faster: repacked, plain, or auto: timed once per machine "
                                 "(calid.runtime.plain_prefill)")
    default_mode: str | None = None  # None: speculative with a draft, ar without
    filter_threshold: float | None = Field(None, ge=0, le=1, description="filter's threshold for requests that set "
                                           "none (nor min_agreement). None: the pair's operating point where calid "
                                           "knows it (the default pair's keeps HumanEval pass@1 within 2 points of "
                                           f"ar), else {FILTER_THRESHOLD:g}; calid bench pareto measures a pair's")
    quality_table: str | None = Field(None, description="the quality table (a file calid bench pareto wrote) "
                                      "max_quality_loss requests of this pair are served by. None: the pair's "
                                      "calibration under CALID_HOME/calibration if written, else its preset, else "
                                      "such requests get FAILED_PRECONDITION")
    agreement_audit_every: int = Field(8, ge=0, description="filter requests without a token-agreement budget whose "
                                       "draft tokens the target compares with its own top-1 as it catches up (one in "
                                       "this many; 0: none): keeps the live agreement estimate "
                                       "(calid_filter_agreement) moving. Requests with min_agreement are always "
                                       "audited (a few extra logits rows per target call)")
    topology: Literal["split", "engine"] = Field("split", description="split: draft and target are deployments of "
                                                 "their own (scaled apart, on any node, TP/PP groups); engine: the "
                                                 "router replica holds both models and calls them in process, with "
                                                 "no process hop per step (one node; calid serve's default)")
    max_active: int = Field(16, ge=1, description="requests one router decodes at once")
    queue_capacity: int = Field(
        64, ge=0, description="admitted requests waiting for a slot; more -> RESOURCE_EXHAUSTED"
    )
    kv_budget_mb: int | None = Field(2048, ge=1)
    max_forward_tokens: int | None = Field(256, ge=1, description="SARATHI: token budget of one target forward; "
                                           "long prompts are prefilled in chunks beside the running decodes")
    plain_run_ms: float = Field(1000.0, ge=0, description="a step where every request decodes plain (ar, or auto "
                                "where drafting does not pay) runs as many target forwards in one call as fit in "
                                "this (at most 8): the router's round trip and its per-call work are paid once per "
                                "run, and tokens stream a run at a time; a request arriving meanwhile ends the run "
                                "after its current forward. 0: one token per call. With topology engine the steps "
                                "run one forward a call (no round trip to save) and only their tokens go out a run "
                                "at a time; a request arriving meanwhile starts at the next forward")
    request_timeout_s: float = Field(600.0, gt=0)
    worker_call_retries: int = Field(
        8,
        ge=0,
        description="retries of a failed draft/target call (backoff 0.2 s doubling, at most 2 s; ~11 "
                    "s in all, enough for a replica restart) before UNAVAILABLE",
    )
    router_num_cpus: float = Field(0.1, ge=0)
    draft_num_cpus: float = Field(0.5, ge=0)
    target_num_cpus: float = Field(0.5, ge=0)
    target_num_gpus: float = Field(0.0, ge=0)
    target_tp: int = Field(1, ge=1, le=64, description="tensor-parallel shards per pipeline stage of a target replica "
                           "(actors/group.py); each shard is an actor with target_num_cpus / target_num_gpus")
    target_pp: int = Field(1, ge=1, le=256, description="pipeline stages per target replica (consecutive layer ranges; "
                           "at most the model's layer count); a replica holds target_tp x target_pp shards")
    target_micro_batches: int | None = Field(None, ge=1, description="micro-batches per pipelined forward, so that "
                                             "stages overlap (None: one per stage)")
    worker_threads: int | None = Field(None, ge=1, description="torch threads per worker replica (None: all cores; "
                                       "Ray would otherwise limit a fractional-CPU replica to 1)")
    draft_resources: dict[str, float] = Field(
        default_factory=dict, description="custom resources, e.g. {draft_node: 0.01}"
    )
    target_resources: dict[str, float] = Field(default_factory=dict, description="custom resources of target "
                                                "replicas and of every shard of a TP x PP group")
    max_replicas_per_node: int | None = Field(None, ge=1, description="draft and target replicas of this app per "
                                              "node (None: no limit); 1 spreads them, so one lost node takes one "
                                              "replica of each")
    router_resources: dict[str, float] = Field(default_factory=dict, description="custom resources of router "
                                                "replicas, e.g. {head_node: 0.01} to keep them beside the proxy")
    draft_scaling: ScalingConfig = Field(default_factory=ScalingConfig)
    target_scaling: ScalingConfig = Field(default_factory=ScalingConfig)
    router_scaling: RouterScaling = Field(default_factory=RouterScaling)
    max_request_bytes: int = Field(1 << 20, ge=1024, description="largest Generate request on the wire; larger "
                                   "ones are refused before any tokenizing")
    max_new_tokens_limit: int = Field(4096, ge=1, description="largest max_new_tokens a request may ask for")
    max_stop_strings: int = Field(16, ge=0)
    max_stop_chars: int = Field(256, ge=1)
    max_messages: int = Field(64, ge=1)
    max_prompt_tokens: int | None = Field(None, ge=1, description="longest prompt in tokens (None: the target's "
                                          "context less max_new_tokens)")
    api_keys_file: str | None = Field(None, description="file of accepted API keys, one per line; clients send "
                                      "'authorization: Bearer <key>' metadata, others get UNAUTHENTICATED")
    api_keys_env: str | None = Field(None, description="environment variable holding accepted API keys "
                                     "(comma-separated); with api_keys_file, both sources count")
    tls_cert_file: str | None = Field(None, description="calid serve: PEM certificate for TLS on grpc_port (with "
                                      "tls_key_file); Serve's own proxy then listens on a loopback port behind it")
    tls_key_file: str | None = None
    worker_call_timeout_s: float = Field(120.0, gt=0, description="one draft/target call may take this long before "
                                         "it counts as failed (a hung replica) and is retried")
    cache_idle_s: float = Field(900.0, gt=0, description="a worker frees a request's KV cache that no call has "
                                "touched for this long (a release that never arrived)")
    edge_round_timeout_s: float = Field(30.0, gt=0, description="Collaborate: a client that sends no draft round "
                                        "for this long gets DEADLINE_EXCEEDED and its request is freed")
    grpc_port: int = Field(50051, ge=1, le=65535)
    http_port: int = Field(8000, ge=0, le=65535, description="the OpenAI-compatible HTTP API's port (Serve's HTTP "
                           "proxy); 0 turns the API off (the proxy then listens on a free loopback port and "
                           "answers 404)")
    http_host: str = Field("127.0.0.1", description="address the HTTP API listens on (loopback by default)")
    route_prefix: str = Field("/", description="the app's HTTP path prefix: the OpenAI base URL is "
                              "http://<host>:<http_port><route_prefix>v1")
    app_name: str = "calid"
    cpu_affinity: list[int] | None = Field(None, description="cores the target replicas are pinned to (set per "
                                           "group by a multi-model placement); None: any")
    served_model: str | None = Field(None, description="the id this app serves its target under (default: the "
                                     "target's preset name or file stem)")
    slo_ttft_ms: float | None = Field(None, gt=0, description="time-to-first-token SLO: requests that meet it "
                                      "(and slo_tpot_ms) count as attained (calid_slo_requests)")
    slo_tpot_ms: float | None = Field(None, gt=0, description="time-per-output-token SLO")
    models: list[ModelSpec] = Field(default_factory=list, description="several models in one app (AlpaServe): "
                                    "each gets its own router, draft and target deployments, and requests name "
                                    "theirs; empty: the one model of target/draft")

    @model_validator(mode="after")
    def _cross_fields(self):
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"models: names must be unique, got {names}")
        if not self.route_prefix.startswith("/"):
            raise ValueError(f"route_prefix must start with /, got {self.route_prefix!r}")
        if self.dtype not in ("auto", "fp32", "bf16"):
            raise ValueError(f"dtype must be auto, fp32 or bf16, got {self.dtype!r}")
        for role in ("target_backend", "draft_backend"):
            if getattr(self, role) not in ("auto", "torch", "llamacpp"):
                raise ValueError(f"{role} must be auto, torch or llamacpp, got {getattr(self, role)!r}")
        if self.prefill_weights not in PREFILL_WEIGHTS:
            raise ValueError(f"prefill_weights must be one of {', '.join(PREFILL_WEIGHTS)}, "
                             f"got {self.prefill_weights!r}")
        if self.draft_weights not in DRAFT_WEIGHTS:
            raise ValueError(f"draft_weights must be one of {', '.join(DRAFT_WEIGHTS)}, got {self.draft_weights!r}")
        if self.target_backend == "llamacpp" and self.target_tp * self.target_pp > 1:
            raise ValueError("tensor/pipeline-parallel target groups run on torch: set target_backend to auto or torch")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("TLS needs both tls_cert_file and tls_key_file")
        if self.topology == "engine" and self.sharded:
            raise ValueError("topology engine holds the target in the router's process: a TP/PP target group needs "
                             "topology split")
        for name in ("device", "draft_device", "target_device"):
            if getattr(self, name) not in ("cpu", "cuda", None if name != "device" else "cpu"):
                raise ValueError(f"{name} must be cpu or cuda, got {getattr(self, name)!r}")
        if self.target_on == "cuda" and self.target_num_gpus <= 0:
            raise ValueError("a cuda target needs target_num_gpus > 0 so that target replicas are placed on GPUs")
        if self.batch_invariant and (self.cuda_graphs or self.sharded):
            raise ValueError("batch_invariant is not built for CUDA graphs or TP/PP target groups")
        if self.cuda_graphs and (self.target_on != "cuda" or self.sharded):
            raise ValueError(
                "cuda_graphs needs an unsharded target on cuda (target_device: cuda, target_tp = target_pp = 1)"
            )
        if self.draft_device == "cuda":
            raise ValueError("draft replicas are given no GPU in this app: draft_device must be cpu")
        if self.draft is not None:
            try:
                parse_self_draft(self.draft)
            except CalidError as e:
                raise ValueError(str(e)) from None
        if self.quality_table is not None and self.draft is not None:  # unreadable: fails here, not in a replica
            table_for(self.target, self.draft, self.quality_table)
        for m in self.models:  # each model's own config must hold (a bad one fails here, not in a replica)
            try:
                self.for_model(m)
            except ConfigError as e:
                raise ValueError(str(e)) from None
        if self.default_mode is not None:
            if self.default_mode not in MODES:
                raise ValueError(f"default_mode must be one of {', '.join(MODES)}, got {self.default_mode!r}")
            if self.draft is None and self.default_mode not in ("ar", "lookahead"):
                raise ValueError(f"default_mode {self.default_mode!r} needs a draft model; draft is not set")
        return self

    @property
    def filter_point(self) -> float:
        """filter's default threshold for this app's pair (filter_threshold's field description)."""
        return self.filter_default[0]

    @property
    def filter_default(self) -> tuple[float, str]:
        """filter's default threshold and where it comes from (the demo says)."""
        if self.filter_threshold is not None:
            return self.filter_threshold, "set in the app config"
        measured = FILTER_OPERATING_POINTS.get((self.target, self.draft))
        if measured is not None:
            return measured, "the pair's measured operating point"
        return FILTER_THRESHOLD, "not calibrated for this pair: calid bench pareto measures one"

    def for_model(self, spec: ModelSpec, cores: list[int] | None = None) -> "AppConfig":
        """The single-model config of one model of a multi-model app: the app's settings, the spec's fields
        over them (validated again); ``cores``: the group of its placement this one runs on."""
        fields = {k: v for k, v in spec.model_dump(exclude={"name", "placement"}).items() if v is not None}
        merged = {**self.model_dump(exclude={"models"}), "draft": spec.draft, **fields, "served_model": spec.name}
        if cores is not None:
            merged.update(cpu_affinity=sorted(cores), worker_threads=len(cores))
        try:
            return AppConfig(**merged)
        except ValidationError as e:
            raise ConfigError(f"model {spec.name!r}: {reasons(e)}") from None

    @property
    def model_configs(self) -> dict[str, "AppConfig"]:
        """Deployment suffix -> one model replica group's config (``served_model``: the name requests use):
        ``<name>`` for a model without a placement, ``<name>@<i>`` for the i-th group of its placement. A
        single-model app has one entry, its served name."""
        if not self.models:
            from calid.models.source import served_name

            return {self.served_model or served_name(self.target): self}
        out = {}
        for m in self.models:
            if m.placement is None:
                out[m.name] = self.for_model(m)
            else:
                out.update({f"{m.name}@{i}": self.for_model(m, g) for i, g in enumerate(m.placement)})
        return out

    @property
    def limits(self):
        from serve_app.ingress.protocol import Limits

        return Limits(self.max_request_bytes, self.max_new_tokens_limit, self.max_stop_strings, self.max_stop_chars,
                      self.max_messages, self.max_prompt_tokens)

    @property
    def draft_on(self) -> str:
        return self.draft_device or "cpu"

    @property
    def target_on(self) -> str:
        return self.target_device or self.device

    @property
    def sharded(self) -> bool:
        """The target model lives in a TP x PP group of shard actors; each replica only drives its group."""
        return self.target_tp * self.target_pp > 1

    @classmethod
    def small(cls, **overrides) -> "AppConfig":
        """SmolLM2-135M as target, its first 16 of 30 layers as the draft: quick to load, for demos and tests."""
        return cls(**{"target": TEST_MODEL, "draft": "self:16", "kv_budget_mb": 512, **overrides})


def with_plain_run_ms(cfg: AppConfig, ms: float | None) -> AppConfig:
    """``cfg`` with a bench's ``--plain-run-ms`` in place of its plain_run_ms (None: as configured)."""
    if ms is None:
        return cfg
    if ms < 0:
        raise CalidError("--plain-run-ms takes milliseconds >= 0")
    return cfg.model_copy(update={"plain_run_ms": ms})


TOPOLOGY_HELP = ("engine (default): the router holds draft and target in one process, no hop per step; "
                 "split: separate draft and target deployments (scaled apart, as on a cluster)")


def add_topology_arg(p) -> None:
    """``--topology`` for calid serve/demo and the served benchmarks: engine unless asked."""
    p.add_argument("--topology", default="engine", choices=("engine", "split"), help=TOPOLOGY_HELP)


def reasons(e: ValidationError) -> str:
    """A validation error on one line: each failed field and why."""
    def one(err) -> str:
        where = ".".join(map(str, err["loc"]))
        msg = err["msg"].removeprefix("Value error, ")
        return f"{where}: {msg}" if where else msg

    return "; ".join(one(err) for err in e.errors())


def load_config(args: dict | AppConfig | None) -> AppConfig:
    if isinstance(args, AppConfig):
        return args
    try:
        return AppConfig(**(args or {}))
    except ValidationError as e:
        raise ConfigError(f"invalid calid config: {reasons(e)}") from None


def check_models(cfg: AppConfig) -> dict:
    """Resolve both models (fetching presets once, converting only what runs on torch) and check they
    share a vocabulary; returns their facts (backend, folder, ModelConfig) by role."""
    from calid.backends import BackendError, model_facts
    from calid.models.config import ModelConfig
    from calid.models.loader import load_tokenizer

    def facts_of(spec: str, backend: str, device: str, sharded: bool = False):
        try:
            chosen, folder = model_facts(spec, backend, device, sharded)
        except BackendError as e:
            raise ConfigError(f"{spec}: {e}") from None
        return chosen, folder, ModelConfig.from_dir(folder)

    facts = {"target": facts_of(cfg.target, cfg.target_backend, cfg.target_on, cfg.sharded)}
    if cfg.draft is not None and parse_self_draft(cfg.draft) is None:
        draft = facts_of(cfg.draft, cfg.draft_backend, cfg.draft_on)
        (_, t_dir, t_cfg), (_, d_dir, d_cfg) = facts["target"], draft
        if (
            t_cfg.vocab_size != d_cfg.vocab_size
            or load_tokenizer(t_dir).get_vocab() != load_tokenizer(d_dir).get_vocab()
        ):
            raise ConfigError(f"draft {cfg.draft} and target {cfg.target} have different tokenizers "
                              f"({d_cfg.vocab_size} vs {t_cfg.vocab_size} tokens); a draft must share the target's "
                              "vocabulary")
        facts["draft"] = draft
    if cfg.sharded:
        from calid.parallel.layout import ParallelConfigError, check_layout

        try:
            check_layout(facts["target"][2], cfg.target_tp, cfg.target_pp)
        except ParallelConfigError as e:
            raise ConfigError(f"target_tp={cfg.target_tp} x target_pp={cfg.target_pp} does not fit {cfg.target}: "
                              f"{e}") from None
    if cfg.draft is not None and parse_self_draft(cfg.draft) is not None:
        if cfg.draft_backend == "llamacpp":
            raise ConfigError("a self-draft (self:N) runs on torch: set draft_backend to auto or torch")
        layers, total = parse_self_draft(cfg.draft), facts["target"][2].num_layers
        if not 1 <= layers <= total:
            raise ConfigError(f"self-draft layers must be in [1, {total}] for {cfg.target}, got {cfg.draft}")
    return facts


def check_resources(cfg: AppConfig, cluster: dict[str, float], nodes: list[dict[str, float]] | None = None) -> None:
    """The cluster must hold the minimum replicas of every deployment (``cluster``: ray.cluster_resources()),
    of every model of a multi-model app together, and, for a TP x PP target, some node must hold a whole
    pipeline stage (``nodes``: each live node's resources), since a stage's tensor-parallel ranks are packed
    on one node."""
    need: dict[str, float] = {}
    if cfg.models:  # the front
        _add(need, {"CPU": cfg.router_num_cpus, **cfg.router_resources})
    for model in cfg.model_configs.values():
        _add(need, _model_needs(model))
    missing = [f"{k}: need {v:g}, cluster has {cluster.get(k, 0.0):g}" for k, v in need.items()
               if v > cluster.get(k, 0.0) + 1e-9]
    if missing:
        raise ConfigError("the cluster cannot place the minimum replicas (" + "; ".join(missing) + ")")
    for model in cfg.model_configs.values():
        if model.sharded and nodes:
            _check_stage(model, nodes)


def _add(into: dict[str, float], more: dict[str, float]) -> None:
    for k, v in more.items():
        into[k] = into.get(k, 0.0) + v


def _model_needs(cfg: AppConfig) -> dict[str, float]:
    """Resources of one model's minimum replicas: routers, targets (with their shard actors), drafts."""
    need: dict[str, float] = {"CPU": 0.0}
    _add(need, {k: v * cfg.router_scaling.min_replicas
                for k, v in {"CPU": cfg.router_num_cpus, **cfg.router_resources}.items()})
    shards = cfg.target_tp * cfg.target_pp if cfg.sharded else 0  # a sharded replica also needs its shard actors
    roles = [(cfg.target_scaling, cfg.target_num_cpus * (1 + shards), cfg.target_num_gpus * max(1, shards),
              {k: v * (1 + shards) for k, v in cfg.target_resources.items()})]
    if cfg.draft is not None:
        roles.append((cfg.draft_scaling, cfg.draft_num_cpus, 0.0, cfg.draft_resources))
    for scaling, cpus, gpus, custom in roles:
        n = max(1, scaling.min_replicas)
        _add(need, {"CPU": n * cpus, **({"GPU": n * gpus} if gpus else {}), **{k: n * v for k, v in custom.items()}})
    return need


def _check_stage(cfg: AppConfig, nodes: list[dict[str, float]]) -> None:
    stage = {"CPU": cfg.target_tp * cfg.target_num_cpus, "GPU": cfg.target_tp * cfg.target_num_gpus,
             **{k: cfg.target_tp * v for k, v in cfg.target_resources.items()}}
    if not any(all(node.get(k, 0.0) + 1e-9 >= v for k, v in stage.items() if v) for node in nodes):
        ask = ", ".join(f"{k}: {v:g}" for k, v in stage.items() if v)
        raise ConfigError(f"no node can hold a pipeline stage of the target_tp={cfg.target_tp} group ({ask} on one "
                          "node: a stage's tensor-parallel ranks share a node); use nodes with more GPUs, or "
                          "lower target_tp and raise target_pp")


def check_auth(cfg: AppConfig) -> None:
    """A configured key source must hold keys here too (the router reads it on its node)."""
    from serve_app.ingress.auth import AuthConfigError, load_keys

    try:
        load_keys(cfg.api_keys_file, cfg.api_keys_env)
    except AuthConfigError as e:
        raise ConfigError(str(e)) from None
