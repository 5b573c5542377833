"""The target worker: verifies many requests' drafts in one batched target forward.

Each task's committed ids are synced against its KV cache (longest common
prefix reused, the rest recomputed), then its draft is fed after them:
  chain   the draft tokens, causal; logits at every draft position and one after
          (speculative, rollback), before each token the draft was unsure of and
          after the last (filter), or only after the last (ar);
  tree    the tree's nodes under its ancestor mask at tree positions; the cache
          is compacted to the accepted branch afterwards, so it stays a sequence.
A runner that holds a bounded number of sequences (llama.cpp: one slot per
request and per extra tree branch) gets forwards that fit it: more requests
than it holds run as several forwards, and trees are cut to the branches left
(the first tasks' trees keep theirs first; a cut tree still verifies exactly).
The acceptance rule (calid.decoding.acceptance, or tree verification) decides
what to append. Lookahead trees come from the worker's own trie of prompt and
output n-grams (shared across requests, or one per request).
"""
from __future__ import annotations

import threading
from dataclasses import replace
from typing import Hashable

import torch

from calid.decoding.acceptance import RuleInput, get_rule
from calid.decoding.grammar import GrammarMasks, constrain
from calid.decoding.lookahead import LookaheadConfig, LookaheadTrie
from calid.decoding.sampling import argmax_rows, sample, warp
from calid.decoding.tree import TokenTree, verify_greedy, verify_sampled, verify_stochastic
from calid.runtime.runner import ModelRunner, SeqInput
from calid.runtime.twins import twin_key
from calid.workers.messages import (
    ScoreResult,
    ScoreTask,
    VerifyResult,
    VerifyTask,
    grammar_entry,
    load_generator,
    require_full_ids,
    save_generator,
)


MIN_CHUNK = 32  # a prefill chunk is never smaller than this, so a long prompt always progresses
SCORE_ROWS = 128  # logits rows per scoring forward: bounds its memory (128 x 152k vocab x 4 B = 78 MB)
MAX_TOP_K = 20


def teacher_forced(runner: ModelRunner, key: Hashable, ids: list[int], start: int):
    """``ids[start:]`` scored by ``runner`` given the ids before each, in forwards of at most SCORE_ROWS logits
    rows: yields, chunk by chunk, the log-softmax rows and the log-probabilities of the chunk's ids. The
    sequence stays cached under ``key`` (a prefix scored before is not recomputed; the caller releases it)."""
    for pos in range(start, len(ids), SCORE_ROWS):  # ids[p] is scored by the logits row at p - 1
        end = min(len(ids), pos + SCORE_ROWS)
        suffix = runner.sync(key, ids[:end], keep_at_most=pos - 1)
        first = end - len(suffix)  # position of suffix[0]
        rows = runner.forward([SeqInput(key, suffix, logits_at=list(range(pos - 1 - first, end - 1 - first)))])[0]
        lp = torch.log_softmax(rows.float(), -1)
        chosen = torch.tensor(ids[pos:end], dtype=torch.long, device=lp.device)
        yield lp, lp.gather(1, chosen[:, None]).squeeze(1).tolist()


class TargetWorker:
    """``max_forward_tokens`` (SARATHI): the token budget of one forward. Decodes and verifications
    always run (decode-maximal batching); the budget left over is filled with chunks of the
    prompts still being prefilled, so a long new prompt never stalls the running requests.
    None: no budget, every prompt is prefilled in one forward."""

    def __init__(self, runner: ModelRunner, lookahead: LookaheadConfig | None = None, shared_trie: bool = True,
                 max_forward_tokens: int | None = None, grammar: GrammarMasks | None = None):
        self.runner = runner
        self.grammar = grammar  # structured output: each request's grammar cursor (None: none served)
        self.max_forward_tokens = max_forward_tokens
        self.lookahead_cfg = lookahead or LookaheadConfig()
        self.shared_trie = shared_trie
        self._global = LookaheadTrie(self.lookahead_cfg)
        self._tries: dict[Hashable, LookaheadTrie] = {}
        self._trie_seen: dict[Hashable, int] = {}  # ids of a request already in its trie
        self._cut = threading.Event()  # cut_runs() was called since the last verify ended
        self.runs_cut = 0  # verifies whose runs of plain steps a cut ended early

    # ---- lookahead trie lifecycle ------------------------------------------------

    def trie(self, request_id: Hashable) -> LookaheadTrie:
        if self.shared_trie:
            return self._global
        return self._tries.setdefault(request_id, LookaheadTrie(self.lookahead_cfg))

    def _feed_trie(self, t: VerifyTask) -> None:
        """Insert what the trie has not seen of this request: its prompt once, then new output."""
        trie, seen = self.trie(t.request_id), self._trie_seen.get(t.request_id)
        if seen is None:
            trie.put_prompt(t.request_id, t.token_ids[: t.prompt_len])
            seen = t.prompt_len
        if len(t.token_ids) > seen:
            trie.put_output(t.token_ids, len(t.token_ids) - seen)
        self._trie_seen[t.request_id] = len(t.token_ids)

    def release(self, request_ids: list[Hashable], final_ids: dict[Hashable, list[int]] | None = None) -> None:
        """Free finished requests. Their prompts leave the shared trie; their output (``final_ids``) stays."""
        for rid in request_ids:
            self.runner.release(rid)
            if self.grammar is not None:
                self.grammar.release(rid)
            seen = self._trie_seen.pop(rid, None)
            if seen is None:
                continue
            ids = (final_ids or {}).get(rid)
            if self.shared_trie:
                if ids is not None and len(ids) > seen:
                    self._global.put_output(ids, len(ids) - seen)
                self._global.eliminate(rid)
            else:
                self._tries.pop(rid, None)

    # ---- log-probabilities (OpenAI logprobs / echo) ----------------------------------

    def score(self, tasks: list[ScoreTask]) -> list[ScoreResult]:
        """Each task's ids scored by the model, in forwards of at most SCORE_ROWS logits rows, under a cache
        key of its own (a prefix another sequence holds is reused; the request's own cache is not touched)."""
        return [self._score(t) for t in tasks]

    def _score(self, t: ScoreTask) -> ScoreResult:
        if not 1 <= t.start <= len(t.token_ids) or not 0 <= t.top_k <= MAX_TOP_K:
            raise ValueError(f"score: start {t.start} of {len(t.token_ids)} ids, top_k {t.top_k} (at most {MAX_TOP_K})")
        key, ids = ("score", t.request_id), t.token_ids
        logprobs, top = [], []
        try:
            for lp, chosen in teacher_forced(self.runner, key, ids, t.start):
                logprobs += chosen
                if t.top_k:
                    values, indices = lp.topk(t.top_k, -1)
                    top += [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
                else:
                    top += [[] for _ in chosen]
        finally:
            self.runner.release(key)
        return ScoreResult(t.request_id, logprobs, top)

    # ---- one batched verification --------------------------------------------------

    def cut_runs(self) -> None:
        """End the runs of plain steps of the verify in progress (or of the next verify, if none is running)
        after their current step: their requests get the tokens made so far, and the caller's next call can
        take new work at once. Thread-safe."""
        self._cut.set()

    def verify(self, tasks: list[VerifyTask]) -> list[VerifyResult]:
        try:
            return self._verify(tasks)
        finally:
            self._cut.clear()

    def _verify(self, tasks: list[VerifyTask]) -> list[VerifyResult]:
        if not tasks:
            return []
        require_full_ids(tasks)
        for t in tasks:
            if t.steps > 1 and (t.decode.mode != "ar" or t.draft or t.tree is not None):
                raise ValueError(f"request {t.request_id!r}: a run of {t.steps} plain steps in mode "
                                 f"{t.decode.mode!r} with a draft (runs are for ar steps only)")
        cap = self.runner.max_sequences
        if cap is not None and len(tasks) > cap:
            return [r for i in range(0, len(tasks), cap) for r in self._verify(tasks[i : i + cap])]
        trees = {}
        for t in tasks:
            if t.decode.mode == "lookahead":
                self._feed_trie(t)
                trees[t.request_id] = (
                    self.trie(t.request_id).retrieve(t.token_ids, budget=min(t.budget, t.decode.gamma))
                    if t.budget > 0
                    else TokenTree()
                )
            elif t.decode.is_tree:
                trees[t.request_id] = t.tree or TokenTree()
        if cap is not None:
            tasks = _fit_branches(tasks, trees, cap - len(tasks))
        chunks = self._plan_chunks(tasks, trees)
        inputs = [self._chunk_input(t, chunks[t.request_id]) if t.request_id in chunks
                  else self._tree_input(t, trees[t.request_id]) if t.request_id in trees
                  else self._chain_input(t) for t in tasks]
        out = self.runner.forward(inputs)
        results = [VerifyResult(t.request_id, [], 0, 0, False, t.rng) if t.request_id in chunks
                   else self._tree_verdict(t, trees[t.request_id], rows) if t.request_id in trees
                   else self._chain_verdict(t, rows) for t, rows in zip(tasks, out)]
        return self._run_plain(tasks, results) if any(t.steps > 1 for t in tasks) else results

    def _run_plain(self, tasks: list[VerifyTask], results: list[VerifyResult]) -> list[VerifyResult]:
        """Runs of plain steps: a task with ``steps`` > 1 whose token is not a stop id goes on, fed the token it
        just picked, until it has ``steps`` tokens or picks a stop id; the runs step together, one forward a
        token. Each step is the ar step the caller would have sent next (same rows, same generator stream), so
        the tokens are those of as many single calls, without a round trip between them. ``cut_runs`` ends the
        runs early, after the step in progress."""
        results = list(results)
        going = [i for i, (t, r) in enumerate(zip(tasks, results)) if _runs_on(t, r)]
        while going and not self._cut.is_set():
            now = [replace(tasks[i], token_ids=tasks[i].token_ids + results[i].tokens, rng=results[i].rng)
                   for i in going]
            out = self.runner.forward([self._chain_input(t) for t in now])
            for i, t, rows in zip(going, now, out):
                v = self._chain_verdict(t, rows)
                results[i] = replace(results[i], tokens=results[i].tokens + v.tokens, rng=v.rng, top1=v.top1,
                                     forwards=results[i].forwards + 1)
            going = [i for i in going if _runs_on(tasks[i], results[i])]
        self.runs_cut += bool(going)
        return results

    def _plan_chunks(self, tasks: list[VerifyTask], trees: dict) -> dict[Hashable, int]:
        """SARATHI: how many prompt tokens each over-budget task prefills this forward (absent: all of its work)."""
        if self.max_forward_tokens is None:
            return {}

        def uncached(t: VerifyTask) -> int:  # committed ids the cache lacks (the last one is always fed)
            keep = min(self.runner.cached_prefix(t.request_id, t.token_ids), len(t.token_ids) - 1)
            return len(t.token_ids) - keep

        work = {t.request_id: (uncached(t), len(trees[t.request_id]) if t.request_id in trees else len(t.draft))
                for t in tasks}
        left, chunks, planned = self.max_forward_tokens, {}, {}  # planned: a twin's plan (calid.runtime.twins)
        for t in sorted(tasks, key=lambda t: work[t.request_id][0]):  # decodes first, longest prompts last
            prompt, draft = work[t.request_id]
            key = twin_key(t.token_ids, prompt)
            if key in planned:  # the runner feeds the prompt once (calid.runtime.twins): the twin's plan, its draft
                if planned[key] is not None:
                    chunks[t.request_id] = planned[key]
                else:
                    left -= draft
                continue
            if prompt + draft <= left or prompt <= MIN_CHUNK:
                left -= prompt + draft
            else:
                chunks[t.request_id] = max(left, MIN_CHUNK)
                left -= chunks[t.request_id]
            if key is not None:
                planned[key] = chunks.get(t.request_id)
        return chunks

    def _chunk_input(self, t: VerifyTask, n: int) -> SeqInput:
        """The next ``n`` uncached committed tokens of ``t``, no draft: a prefill chunk."""
        suffix = self.runner.sync(t.request_id, t.token_ids, keep_at_most=len(t.token_ids) - 1)
        fit = getattr(self.runner, "chunk_length", None)  # where the runner needs chunks to end (exact mode)
        if fit is not None:
            n = fit(len(t.token_ids) - len(suffix), n, len(t.token_ids))
        return SeqInput(t.request_id, suffix[:n])

    def _chain_input(self, t: VerifyTask) -> SeqInput:
        inp = self._chain_rows(t)
        return replace(inp, pad=t.level - len(inp.tokens)) if t.level > len(inp.tokens) else inp

    def _chain_rows(self, t: VerifyTask) -> SeqInput:
        g, committed = len(t.draft), t.token_ids
        suffix = self.runner.sync(t.request_id, committed + t.draft, keep_at_most=len(committed) - 1)
        n = len(suffix)
        reads = "top1" if _greedy_chain(t) else "rows"
        if t.decode.mode in ("speculative", "rollback"):  # a greedy verdict reads rows up to the first miss
            return SeqInput(t.request_id, suffix, logits_at=list(range(n - g - 1, n)), reads=reads,
                            expect=list(t.draft) if reads == "top1" else None)
        start = len(committed) + g - n  # the position of suffix[0]
        if t.decode.mode != "filter":
            return SeqInput(t.request_id, suffix, logits_at=[n - 1], reads=reads)
        rows = {len(committed) - 1 + i for i in t.unsure} | {start + n - 1}  # before each unsure token, after the last
        if t.audit_from is not None:  # and every row from audit_from on (what the cache does not hold), in one run
            first = min(max(t.audit_from, start + 1) - 1, *rows)  # to the end: the verdict counts positions back
            rows = set(range(first, start + n))
        return SeqInput(t.request_id, suffix, logits_at=[p - start for p in sorted(rows)])

    def _chain_verdict(self, t: VerifyTask, rows: torch.Tensor) -> VerifyResult:
        if t.decode.mode == "filter":
            return self._filter_verdict(t, rows)
        verifying = t.decode.mode in ("speculative", "rollback")
        end = len(t.token_ids) + len(t.draft)
        if t.warp.grammar is not None:
            rows = constrain(self.grammar, rows, _chain_entries(t, range(end - len(rows), end)))
        if t.warp.greedy and t.q is None and t.decode.mode != "rollback":
            return self._greedy_verdict(t, rows, verifying)
        generator = load_generator(t.rng, rows.device)
        draft = torch.tensor(t.draft, dtype=torch.long, device=rows.device)
        target_nll = None
        if t.decode.mode == "rollback" and t.draft:
            target_nll = -torch.log_softmax(rows[:-1].float(), -1).gather(1, draft[:, None]).squeeze(1)
        q = None if t.q is None else t.q.to(rows.device)  # the draft's rows may come from another device
        if q is None and t.decode.mode == "speculative" and t.draft:  # greedy draft: one-hot rows
            q = torch.zeros(len(t.draft), rows.shape[-1], device=rows.device).scatter_(1, draft[:, None], 1.0)
        rule = get_rule("filter" if t.decode.mode == "ar" else t.decode.mode)
        v = rule(RuleInput(draft=draft, q=q, p=warp(rows, t.warp), generator=generator,
                           target_nll=target_nll, rollback_nll=t.decode.rollback_nll))
        return VerifyResult(
            t.request_id,
            t.draft[: v.accepted] + [v.next_token],
            v.accepted,
            len(t.draft),
            verifying,
            save_generator(generator),
            top1=int(rows[v.accepted if verifying else -1].argmax()),
            audit_from=end,
        )

    def _filter_verdict(self, t: VerifyTask, rows: torch.Tensor) -> VerifyResult:
        """Filter (CALID, lossy): the draft's confident tokens stand; at each unsure one the target picks (its
        argmax, or a draw from its warped row), and where it picks another token than the draft's, that token
        ends the chain (the draft tokens after it were drafted from the wrong one). A chain the target agreed
        with all along gets the target's token after its last. Step by step, filter would have gone the same
        way: the target's token at each unsure position, then the draft on from there. Audited requests also
        get each id compared with the target's top-1 (``_chain_input`` asked for every row from audit_from)."""
        committed, end = len(t.token_ids), len(t.token_ids) + len(t.draft)
        if t.audit_from is not None:  # the rows are contiguous: every id from audit_from (or the cache's end) on
            positions = list(range(end - len(rows), end))
        else:
            positions = [committed - 1 + i for i in t.unsure] + [end - 1]
        if t.warp.grammar is not None:
            rows = constrain(self.grammar, rows, _chain_entries(t, positions))
        audit, audit_from = None, end
        if t.audit_from is not None and len(rows) > 1:  # does each id equal the target's top-1 before it?
            ids = t.token_ids + t.draft
            audit = [a == ids[p + 1] for a, p in zip(argmax_rows(rows[:-1]), positions)]
            audit_from = positions[0] + 1
        row_at = {p: j for j, p in enumerate(positions)}
        generator = None if t.warp.greedy else load_generator(t.rng, rows.device)

        def pick(row: torch.Tensor) -> int:
            return int(row.argmax()) if generator is None else int(sample(warp(row[None], t.warp), generator)[0])

        accepted = len(t.draft)
        for i in t.unsure:
            row = rows[row_at[committed - 1 + i]]
            token = pick(row)
            if token != t.draft[i]:
                accepted = i
                break
        else:
            row = rows[-1]
            token = pick(row)
        return VerifyResult(t.request_id, t.draft[:accepted] + [token], accepted, len(t.draft), bool(t.unsure),
                            save_generator(generator) if generator is not None else t.rng, top1=int(row.argmax()),
                            audit_from=audit_from, audit=audit, decided=tuple(i for i in t.unsure if i < accepted))

    @staticmethod
    def _greedy_verdict(t: VerifyTask, rows: torch.Tensor, verifying: bool) -> VerifyResult:
        """A greedy chain (ar, speculative with a greedy draft) decided by the target's argmax at each row,
        with no [rows, V] distribution: the acceptance rules' one-hot arithmetic comes to exactly this. ar adds
        the argmax; speculative accepts while a draft token is the argmax before it (p(x) = 1 under a one-hot
        target, 0 otherwise) and adds the argmax where it stopped (the residual max(0, p - q) of two one-hot rows
        is the target's one-hot row). Nothing is drawn, so the request's generator state passes through
        unchanged."""
        top = argmax_rows(rows)  # [g + 1] with verifying, else [1]
        accepted = len(t.draft)
        if verifying:
            accepted = next((i for i, (d, a) in enumerate(zip(t.draft, top)) if d != a), len(t.draft))
        token = top[accepted if verifying else -1]
        return VerifyResult(t.request_id, t.draft[:accepted] + [token], accepted, len(t.draft), verifying, t.rng,
                            top1=token, audit_from=len(t.token_ids) + len(t.draft))

    def _tree_input(self, t: VerifyTask, tree: TokenTree) -> SeqInput:
        committed = t.token_ids
        suffix = self.runner.sync(t.request_id, committed + tree.tokens, keep_at_most=len(committed) - 1)
        c = len(suffix) - len(tree)  # committed tokens fed again, the root last
        start = len(committed) - c
        positions = list(range(start, len(committed))) + [len(committed) - 1 + d for d in tree.depth]
        return SeqInput(t.request_id, committed[start:] + tree.tokens, positions=positions,
                        ancestors=tree.block_mask(c), logits_at=list(range(c - 1, c + len(tree))),
                        reads="top1" if t.warp.greedy and t.warp.grammar is None else "rows")  # _tree_verdict

    def _tree_verdict(self, t: VerifyTask, tree: TokenTree, rows: torch.Tensor | list[int]) -> VerifyResult:
        if t.warp.greedy and t.warp.grammar is None:  # the runner may have answered with the rows' argmax ids
            verdict = verify_greedy(tree, argmax_rows(rows))
            return self._tree_result(t, tree, verdict, t.rng)
        generator = load_generator(t.rng, rows.device)
        if t.warp.grammar is not None:  # row 0 comes after the committed ids, row i + 1 after tree node i
            rows = constrain(self.grammar, rows, [grammar_entry(t, [])] + [
                grammar_entry(t, [tree.tokens[k] for k in tree.path(i)]) for i in range(len(tree))])
        if t.warp.greedy:
            verdict = verify_greedy(tree, argmax_rows(rows))
        elif t.q is not None:  # i.i.d. sampled children (SpecInfer): multi-step speculative sampling
            verdict = verify_stochastic(tree, warp(rows, t.warp), t.q.to(rows.device), generator)
        else:
            verdict = verify_sampled(tree, warp(rows, t.warp), generator)
        return self._tree_result(t, tree, verdict, save_generator(generator))

    def _tree_result(self, t: VerifyTask, tree: TokenTree, verdict, rng) -> VerifyResult:
        """Keep the accepted path in the target's cache; the result ``verdict`` (calid.decoding.tree) makes."""
        committed = len(t.token_ids)
        self.runner.compact(t.request_id, [committed + i for i in verdict.path], start=committed)
        tokens = [tree.tokens[i] for i in verdict.path] + [verdict.next_token]
        return VerifyResult(t.request_id, tokens, len(verdict.path), tree.max_depth, True, rng)


def _greedy_chain(t: VerifyTask) -> bool:
    """Whether a chain's rows go to ``_greedy_verdict`` as they come from the runner (no grammar mask first):
    only each row's argmax is read."""
    return t.warp.greedy and t.warp.grammar is None and t.q is None and t.decode.mode in ("ar", "speculative")


def _chain_entries(t: VerifyTask, positions) -> list:
    """What ``constrain`` needs for a chain's logits rows at ``positions``: the row at p comes after its first
    p + 1 ids (committed, then draft; rows before the prompt's end, none)."""
    ids = t.token_ids + t.draft
    return [grammar_entry(replace(t, token_ids=ids[: p + 1]), []) if p + 1 >= t.prompt_len else None
            for p in positions]


def _runs_on(t: VerifyTask, r: VerifyResult) -> bool:
    """Whether a run of plain steps takes another step: it has a token (not a prefill chunk), fewer than it may
    take, and the last is not a stop id."""
    return 0 < len(r.tokens) < t.steps and r.tokens[-1] not in t.stop_ids


def _fit_branches(tasks: list[VerifyTask], trees: dict, spare: int) -> list[VerifyTask]:
    """Cut the trees in ``trees`` (in place) to ``spare`` extra branches between them, in task order; the
    tasks, a cut stochastic tree's task carrying only its kept nodes' draft rows."""
    out = []
    for t in tasks:
        tree = trees.get(t.request_id)
        branches = len(tree.leaves()) if tree else 1
        keep = min(branches, 1 + spare)
        spare -= keep - 1
        if keep < branches:
            trees[t.request_id], kept = tree.pruned(keep)
            if t.q is not None:  # row 0 is the root's, row i + 1 node i's
                t = replace(t, q=t.q[[0] + [k + 1 for k in kept]])
        out.append(t)
    return out
