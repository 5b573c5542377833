"""Self-drafting: a draft made of the target's first N layers plus its final norm and head.

Shares every weight with the target (no copy); it gets its own runner and KV
caches. Useful where the target has no smaller sibling (SmolLM2-135M).
"""
from __future__ import annotations

from dataclasses import replace

from torch import nn

from calid.errors import CalidError
from calid.models.llama import LlamaModel, Rotary


def self_draft(target: LlamaModel, num_layers: int) -> LlamaModel:
    total = target.cfg.num_layers
    if not 1 <= num_layers <= total:
        raise CalidError(f"self-draft layers must be in [1, {total}], got {num_layers}")
    cfg = replace(target.cfg, num_layers=num_layers)
    draft = LlamaModel.__new__(LlamaModel)
    nn.Module.__init__(draft)
    draft.cfg = cfg
    draft.embed = target.embed
    draft.layers = nn.ModuleList(list(target.layers)[:num_layers])
    draft.norm = target.norm
    draft.lm_head = target.lm_head
    draft.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
    return draft.eval()


def parse_self_draft(spec: str) -> int | None:
    """N for ``self:N``, None for any other spec."""
    if not spec.startswith("self:"):
        return None
    try:
        return int(spec[5:])
    except ValueError:
        raise CalidError(
            f"a self-draft spec self:N needs an integer N (the target's first N layers), got {spec!r}"
        ) from None
