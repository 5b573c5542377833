"""Run several decoding configurations on the same prompts, interleaved, and tabulate them.

Every configuration runs each prompt once at batch 1; the order rotates per
prompt so that machine drift spreads evenly. A configuration is either calid
``DecodeParams`` or an external runner (HF transformers) given as a function
``(prompt_ids, max_new) -> output ids``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from calid.bench.quality import passes_humaneval, prefix_agreement, target_nll
from calid.decoding.modes import DecodeParams
from calid.progress import progress

External = Callable[[list[int], int], list[int]]


@dataclass
class Prompt:
    kind: str  # "humaneval" | "mtbench" | "xsum" | "multilexsum" ...
    ids: list[int]
    max_new: int
    problem: dict | None = None  # HumanEval problem, for pass@1


@dataclass
class Tally:
    outputs: list[list[int]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    seconds: float = 0.0
    draft_tokens: int = 0
    target_calls: int = 0
    verifications: int = 0
    accepted: int = 0
    per_prompt: list[tuple[float, int, int, int, int]] = field(
        default_factory=list
    )  # seconds, draft, calls, verif, acc

    def subset(self, idx: list[int]) -> "Tally":
        t = Tally(outputs=[self.outputs[i] for i in idx], texts=[self.texts[i] for i in idx])
        for i in idx:
            secs, draft, calls, ver, acc = self.per_prompt[i]
            t.seconds += secs
            t.draft_tokens += draft
            t.target_calls += calls
            t.verifications += ver
            t.accepted += acc
        return t


def run_configs(engine, tokenizer, prompts: list[Prompt], cfgs: list[tuple[str, DecodeParams | External]],
                desc: str) -> dict[str, Tally]:
    from calid.generation import GenerationRequest, SamplingParams

    tallies = {name: Tally() for name, _ in cfgs}
    with progress(len(prompts) * len(cfgs), desc, "run") as bar:
        for i, pr in enumerate(prompts):
            for name, how in cfgs[i % len(cfgs):] + cfgs[: i % len(cfgs)]:
                t = tallies[name]
                start = time.perf_counter()
                counts = (0, 0, 0, 0)
                if isinstance(how, DecodeParams):
                    req = GenerationRequest(pr.ids, SamplingParams(max_new_tokens=pr.max_new), decode=how)
                    res = engine.generate([req])[0]
                    out = res.output_ids
                    st = res.stats
                    counts = (st.draft_tokens, st.target_calls, st.verifications, st.accepted_total)
                else:
                    out = how(pr.ids, pr.max_new)
                secs = time.perf_counter() - start
                t.per_prompt.append((secs, *counts))
                t.seconds += secs
                t.draft_tokens += counts[0]
                t.target_calls += counts[1]
                t.verifications += counts[2]
                t.accepted += counts[3]
                t.outputs.append(out)
                t.texts.append(tokenizer.decode(out, skip_special_tokens=True))
                bar.update(1)
                bar.set_postfix_str(name)
    return tallies


def tabulate(cfgs, tallies: dict[str, Tally], prompts: list[Prompt], target_runner, quality: bool = True) -> list[dict]:
    """One row per configuration; the first configuration is the reference (target-only)."""
    ref = tallies[cfgs[0][0]]
    ref_tps = sum(map(len, ref.outputs)) / ref.seconds
    nll_cache: dict[tuple, float] = {}  # lossless configurations repeat the target's output: score it once

    def nll(pr: Prompt, out: list[int]) -> float:
        key = (tuple(pr.ids), tuple(out))
        if key not in nll_cache:
            nll_cache[key] = target_nll(target_runner, pr.ids, out)
        return nll_cache[key]

    rows = []
    for name, how in cfgs:
        t = tallies[name]
        tokens = sum(map(len, t.outputs))
        row = {"config": name, "tokens": tokens, "seconds": t.seconds, "tok_s": tokens / t.seconds,
               "ratio_vs_ar": tokens / t.seconds / ref_tps,
               "agreement_with_ar": sum(prefix_agreement(o, r) for o, r in zip(t.outputs, ref.outputs)) / len(prompts)}
        if quality:
            he = [(text, pr.problem) for text, pr in zip(t.texts, prompts) if pr.kind == "humaneval"]
            row["target_nll"] = sum(nll(pr, o) for pr, o in zip(prompts, t.outputs)) / len(prompts)
            row["pass_at_1"] = sum(passes_humaneval(x, p) for x, p in he) / len(he) if he else "-"
        if isinstance(how, DecodeParams):
            row["filtered_fraction"] = t.draft_tokens / tokens if tokens else 0.0
            row["target_calls_per_token"] = t.target_calls / tokens if tokens else 0.0
            row["mean_accepted"] = t.accepted / t.verifications if t.verifications else "-"
            row["edl"] = tokens / t.target_calls if t.target_calls else "-"  # tokens per target forward
        else:
            row.update(filtered_fraction="-", target_calls_per_token="-", mean_accepted="-", edl="-")
        rows.append(row)
    return rows
