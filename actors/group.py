"""A model-parallel target group: ``tp x pp`` TargetShard actors, gang-scheduled in placement groups.

Each pipeline stage is one placement group of ``tp`` STRICT_PACK bundles, so a
stage's tensor-parallel ranks share a node (they all-reduce twice per layer)
while the stages may spread across nodes (they exchange one hidden state per
micro-batch). No shard starts before every stage's placement group is ready.

The group looks like a TargetWorker to its owner (``verify``, ``release``,
``cached``). A shard that dies takes the group down: the call raises
GroupFailed, the group kills the other shards and frees its placement groups,
and the next call builds a fresh group. The router keeps every request's token
ids, so it retries the call and nothing is lost.
"""
from __future__ import annotations

import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.shard import TargetShard


PING_TIMEOUT_S = 10.0  # a shard that does not say its pid within this is taken for lost


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


class GroupFailed(RuntimeError):
    """A shard of the group died (the group was torn down), or the group cannot be placed yet; the next call
    builds it again."""


class TargetGroup:
    def __init__(self, target: str, tp: int, dtype: str = "fp32", device: str = "cpu", cpus_per_shard: float = 0.5,
                 gpus_per_shard: float = 0.0, kv_budget_bytes: int | None = None,
                 max_forward_tokens: int | None = None, threads: int | None = None, ready_timeout_s: float = 300,
                 pp: int = 1, micro_batches: int | None = None, resources: dict[str, float] | None = None,
                 build_wait_s: float | None = None):
        self.spec = dict(target=target, dtype=dtype, device=device, kv_budget_bytes=kv_budget_bytes,
                         max_forward_tokens=max_forward_tokens, threads=threads, micro_batches=micro_batches)
        self.tp, self.pp = tp, pp
        # each shard's bundle carries the target's custom resources (e.g. target_node), so that shards land on
        # the node type the config names, as the target replicas do
        self.bundle = {"CPU": cpus_per_shard, **({"GPU": gpus_per_shard} if gpus_per_shard else {}),
                       **(resources or {})}
        self.ready_timeout_s = ready_timeout_s  # the first build's wait (at start-up)
        self.build_wait_s = ready_timeout_s if build_wait_s is None else build_wait_s  # a rebuild's, per call
        self.shards: list = []
        self.pgs: list = []
        self.holdings: list[dict] = []  # what each shard holds, by rank (from its setup)
        self.builds = 0

    def start(self) -> None:
        """Build the group now (a replica's start-up), waiting up to ready_timeout_s for room."""
        if not self.shards:
            self._build(self.ready_timeout_s)

    def _build(self, wait_s: float) -> None:
        """Reserve every stage's placement group and start the shards, within ``wait_s``.

        A reservation that does not fit yet (a node holding a stage was lost and none has rejoined) is kept
        across calls: GCS places it when room appears, and each call waits for it at most ``wait_s`` before
        failing with GroupFailed, which the router retries. A call never waits longer than that, so the
        replica's health check (a forward longer than worker_call_timeout_s) does not take a rebuild for a
        hung replica. Shards that do not start (their node died before Ray declared it dead) free the
        reservation, so that the next call reserves afresh on the nodes that are left."""
        if not self.pgs:
            self.pgs = [placement_group([dict(self.bundle) for _ in range(self.tp)], strategy="STRICT_PACK")
                        for _ in range(self.pp)]
        deadline = time.monotonic() + wait_s
        try:
            ray.get([pg.ready() for pg in self.pgs], timeout=wait_s)
        except GetTimeoutError:
            raise GroupFailed(f"the {self.tp}x{self.pp} (TP x PP) target group waits for room for its stages "
                              f"({self.pp} placement groups of {self.tp} x {self.bundle}), none within {wait_s:g} s; "
                              f"the reservation stays and the next call waits again") from None
        try:
            self.shards = [
                TargetShard.options(num_cpus=self.bundle["CPU"], num_gpus=self.bundle.get("GPU", 0),
                                    resources={k: v for k, v in self.bundle.items() if k not in ("CPU", "GPU")},
                                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.pgs[rank // self.tp],
                                                                                         rank % self.tp)
                                    ).remote(rank, self.tp, self.pp)
                for rank in range(self.tp * self.pp)
            ]
            host, port = ray.get(self.shards[0].address.remote(), timeout=_left(deadline))
            self.holdings = ray.get([s.setup.remote(host, port, **self.spec) for s in self.shards],
                                    timeout=_left(deadline))
        except BaseException as e:
            self.shutdown()  # a group that cannot start must not keep half its resources
            if isinstance(e, (RayActorError, GetTimeoutError)):
                raise GroupFailed(f"the {self.tp}x{self.pp} (TP x PP) target group's shards did not start "
                                  f"({e.__class__.__name__}); the next call builds it again") from e
            raise
        self.builds += 1

    def _all(self, method: str, *args):
        if not self.shards:
            self._build(self.build_wait_s)
        refs = [getattr(s, method).remote(*args) for s in self.shards]
        try:
            pending = list(refs)
            while pending:  # a dead shard must not leave us waiting on the others, stuck in a collective
                done, pending = ray.wait(pending, num_returns=1)
                ray.get(done[0])
            return ray.get(refs[0])
        except (RayActorError, RayTaskError) as e:
            if isinstance(e, RayTaskError) and not self._broken(e):
                raise  # an error of these tasks (the router isolates its request); the group is fine
            self.shutdown()
            raise GroupFailed(
                f"a shard of the {self.tp}x{self.pp} (TP x PP) target group died or lost its peers "
                f"({e.__class__.__name__}); the group was torn down and is rebuilt on the next call"
            ) from e

    def _broken(self, e: RayTaskError) -> bool:
        """Whether a shard's error means the group cannot go on: a collective failed (a peer's process or node
        went away mid-forward: the survivors see a connection reset before Ray reports the death), or some
        shard does not answer."""
        cause = getattr(e, "cause", None)
        text = str(cause).lower()
        if isinstance(cause, RuntimeError) and ("gloo" in text or "nccl" in text or
                                                 type(cause).__name__.startswith("Dist")):
            return True
        try:
            ray.get([s.pid.remote() for s in self.shards], timeout=PING_TIMEOUT_S)
        except (RayActorError, GetTimeoutError):
            return True
        return False

    def verify(self, tasks: list) -> list:
        return self._all("verify", tasks)

    def score(self, tasks: list) -> list:
        return self._all("score", tasks)

    def release(self, request_ids: list, final_ids: dict | None = None) -> None:
        if self.shards:
            self._all("release", request_ids, final_ids)

    def cached(self) -> int:
        return self._all("cached")

    def pids(self) -> list[int]:
        """Process ids of the live shards, by rank (for operators and fault tests)."""
        return ray.get([s.pid.remote() for s in self.shards]) if self.shards else []

    def shutdown(self) -> None:
        for s in self.shards:
            ray.kill(s, no_restart=True)
        self.shards = []
        for pg in self.pgs:
            remove_placement_group(pg)
        self.pgs = []
