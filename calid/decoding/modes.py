"""Per-request decoding options, validated at the edge."""
from __future__ import annotations

import math
from dataclasses import dataclass

from calid.decoding.confidence import Threshold
from calid.decoding.quality_budget import check_budget
from calid.errors import InvalidRequestError
from calid.models.presets import DEFAULT_DRAFT, DEFAULT_TARGET, FILTER_OPERATING_POINTS

MODES = ("ar", "filter", "rollback", "speculative", "tree", "lookahead", "auto")
TREE_MODES = ("tree", "lookahead")
# speculative, rollback, tree: stop drafting after a token the draft is less sure of (best measured: calid bench
# decode); lossless, so a speed setting only
STOP_THRESHOLD = 0.4
# filter, where neither the request nor the app sets a threshold: the default pair's operating point (measured:
# calid.models.presets.FILTER_OPERATING_POINTS); lower thresholds draft more and cost quality (0.4: about 10 points
# of HumanEval pass@1). Another pair gets its own from calid bench pareto (AppConfig.filter_threshold).
FILTER_THRESHOLD = FILTER_OPERATING_POINTS[DEFAULT_TARGET, DEFAULT_DRAFT]


@dataclass(frozen=True)
class DecodeParams:
    """How one request uses the draft.

    mode          ar (target only) | filter | rollback | speculative | tree | lookahead |
                  auto (lossless: each step the planner picks ar, speculative with a draft
                  length, tree with a depth, or lookahead, from measured costs and the request's
                  chain and tree acceptance and lookahead yield; calid.planning)
    gamma         most draft tokens per target call (tree: length of the main branch;
                  lookahead: most tree nodes, capped by the trie's decoding length; auto's n-gram
                  copies of the request's own tokens run up to max(gamma, 32): they cost no draft time)
    tree_width    tree: tokens tried at an unconfident position (main + width-1 alternatives)
    tree_chains   tree: draft chains merged by common prefix (SpecInfer); chain j opens with
                  the draft's j-th best first token, all chains drafted in one batched forward
    threshold     draft confidence as a top-1 probability in [0, 1]; None: the mode's default
                  filter      accept a draft token when its top-1 probability >= threshold
                              (0 = draft only, 1 = target for (almost) every token); default
                              filter_threshold
                  speculative/rollback: dynamic draft length, stop drafting after a token
                              whose top-1 probability < threshold (0 = always gamma tokens);
                              default STOP_THRESHOLD
    filter_threshold  filter's threshold where none is set: the app's operating point
    rollback_nll  rollback: roll back past a draft token whose target NLL exceeds this
    adaptive      LLMCad-style self-adaptive threshold: raised after a rejection,
                  lowered after a fully accepted draft
    min_agreement filter: a token-agreement budget instead of a threshold: the share of output tokens that must
                  equal the target's top-1 given the same prefix; the threshold is chosen, and moved
                  step by step, to hold it while drafting as much as possible (calid.decoding.budget)
    max_quality_loss  filter: a budget in the task's own metric instead of a threshold: the points of task
                  quality filter may lose against ar (calid.decoding.quality_budget); the edge that takes the
                  request resolves it into ``threshold`` from the pair's quality table; where the table
                  vouches for no threshold (1.0) the request runs as auto, lossless (quality_budget.budget_mode)
    """

    mode: str = "speculative"
    gamma: int = 8  # verifying 9 tokens costs about what 5 do on CPU (skinny GEMM), so drafts may run long
    threshold: float | None = None  # ...and stop early when the draft is unsure; None: the mode's default
    rollback_nll: float = 2.0
    adaptive: bool = False
    tree_width: int = 3
    tree_chains: int = 1
    min_agreement: float | None = None
    filter_threshold: float = FILTER_THRESHOLD
    max_quality_loss: float | None = None

    @property
    def top1(self) -> float:
        """The threshold in force: the request's, else the mode's default."""
        if self.threshold is not None:
            return self.threshold
        return self.filter_threshold if self.mode == "filter" else STOP_THRESHOLD

    def validate(self) -> "DecodeParams":
        if self.mode not in MODES:
            raise InvalidRequestError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not isinstance(self.gamma, int) or not 1 <= self.gamma <= 64:
            raise InvalidRequestError(f"gamma must be an integer in [1, 64], got {self.gamma!r}")
        for name in ("threshold", "filter_threshold"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
                raise InvalidRequestError(f"{name} must be a probability in [0, 1], got {value!r}")
        if not isinstance(self.tree_width, int) or not 1 <= self.tree_width <= 16:
            raise InvalidRequestError(f"tree_width must be an integer in [1, 16], got {self.tree_width!r}")
        if not isinstance(self.tree_chains, int) or not 1 <= self.tree_chains <= 8:
            raise InvalidRequestError(f"tree_chains must be an integer in [1, 8], got {self.tree_chains!r}")
        if math.isnan(self.rollback_nll) or self.rollback_nll < 0:
            raise InvalidRequestError(f"rollback_nll must be >= 0, got {self.rollback_nll!r}")
        if self.min_agreement is not None:
            if not isinstance(self.min_agreement, (int, float)) or not 0.0 < self.min_agreement <= 1.0:
                raise InvalidRequestError(f"min_agreement must be in (0, 1], got {self.min_agreement!r}")
            if self.mode != "filter":
                raise InvalidRequestError(f"min_agreement is a budget for mode filter, not {self.mode!r}")
        if self.max_quality_loss is not None:
            try:
                check_budget(self.max_quality_loss)
            except ValueError as e:
                raise InvalidRequestError(str(e)) from None
            lossless = self.mode == "auto" and self.threshold == 1.0  # no threshold vouched for (budget_mode)
            if not (self.mode == "filter" or lossless) or self.min_agreement is not None:
                raise InvalidRequestError(f"max_quality_loss is a budget for mode filter alone, not {self.mode!r}"
                                          + (" with min_agreement" if self.min_agreement is not None else ""))
            if self.threshold is None:
                raise InvalidRequestError("max_quality_loss was not resolved into a threshold (the pair's quality "
                                          "table: calid.decoding.quality_budget.resolve_threshold)")
        return self

    @property
    def uses_draft(self) -> bool:
        """Needs a draft model (lookahead drafts from its trie instead; auto without one picks ar or lookahead)."""
        return self.mode not in ("ar", "lookahead", "auto")

    @property
    def is_tree(self) -> bool:
        return self.mode in TREE_MODES

    def confidence(self) -> Threshold:
        return Threshold.from_prob(self.top1)
