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


def load_draft(spec: str, target_spec: str, dtype="fp32", device="cpu", show_progress: bool = True):
    """A draft as a LoadedModel: a model spec, or ``self:N`` (the target's first N layers)."""
    from calid.models.loader import load_model

    layers = parse_self_draft(spec)
    if layers is None:
        return load_model(spec, dtype, device, show_progress)
    target = load_model(target_spec, dtype, device, show_progress)
    return replace_model(target, self_draft(target.model, layers), f"self:{layers} of {target.name}")


def parse_self_draft(spec: str) -> int | None:
    """N for ``self:N``, None for any other spec."""
    if not spec.startswith("self:"):
        return None
    try:
        return int(spec[5:])
    except ValueError:
        raise CalidError(f"a self-draft spec self:N needs an integer N (the target's first N layers), got {spec!r}") from None


def replace_model(loaded, model: LlamaModel, name: str):
    from dataclasses import replace as dc_replace

    return dc_replace(loaded, model=model, name=name)
