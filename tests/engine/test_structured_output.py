"""Structured output in every decoding mode, on SmolLM2-135M (llama.cpp target, a 10-layer torch self-draft that
is often wrong, so drafts are rejected under the grammar too).

Greedy lossless modes (speculative, tree, SpecInfer chains, Lookahead, auto) give exactly ar's tokens under the
same grammar; the lossy ones (filter, rollback) and sampled decoding give output the grammar accepts. The
masks themselves: a cursor moved anywhere gives the mask a fresh matcher gives there."""
from __future__ import annotations

import json
import re

import pytest
import torch

from calid.backends import open_draft, open_model
from calid.decoding.grammar import Grammar, GrammarMasks, GrammarTokens
from calid.decoding.modes import DecodeParams
from calid.engine import Engine
from calid.generation import GenerationRequest, SamplingParams
from calid.models.presets import TEST_MODEL
from calid.text import encode_prompt

pytestmark = pytest.mark.model
QUIET = dict(log=lambda line: None, show_progress=False)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
PROMPTS = ["Give a person's name and age as JSON.", "Describe a cat called Tom, 3 years old, in JSON."]
N = 40


@pytest.fixture(scope="module")
def ll():
    return open_model(TEST_MODEL, backend="llamacpp", **QUIET)


@pytest.fixture(scope="module")
def draft(ll):
    return open_draft("self:10", ll, backend="torch", dtype="fp32", **QUIET)


@pytest.fixture(scope="module")
def schema():
    return Grammar.compile("json_schema", json.dumps(SCHEMA))


def generate(ll, draft, grammar, decode, prompts=PROMPTS, **params):
    eng = Engine(ll.runner, ll.tokenizer, ll.eos_ids, draft=draft.runner)
    reqs = [GenerationRequest(encode_prompt(ll.tokenizer, p), SamplingParams(max_new_tokens=N, grammar=grammar,
                                                                             **params), decode=decode)
            for p in prompts]
    return eng.generate(reqs)


def valid(text: str) -> bool:
    obj = json.loads(text)
    return set(obj) == {"name", "age"} and isinstance(obj["name"], str) and len(obj["name"]) <= 12 \
        and isinstance(obj["age"], int) and 0 <= obj["age"] <= 120


@pytest.fixture(scope="module")
def ar(ll, draft, schema):
    res = generate(ll, draft, schema, DecodeParams(mode="ar"))
    assert all(r.finish_reason == "eos" and valid(r.text) for r in res), [r.text for r in res]
    return res


def test_unconstrained_ar_is_not_this_json(ll, draft):
    """The grammar is what makes the answers below JSON: without it the model writes prose."""
    res = generate(ll, draft, None, DecodeParams(mode="ar"))
    assert not any(r.text.startswith('{"name": ') for r in res)


@pytest.mark.parametrize("decode", [
    DecodeParams(mode="speculative", gamma=6),
    DecodeParams(mode="tree", gamma=6, threshold=0.6, tree_width=3),
    DecodeParams(mode="tree", gamma=4, threshold=0.4, tree_width=1, tree_chains=3),
    DecodeParams(mode="lookahead", gamma=12),
    DecodeParams(mode="auto"),
], ids=["speculative", "tree", "tree-chains", "lookahead", "auto"])
def test_greedy_lossless_modes_equal_ar_under_the_same_grammar(ll, draft, schema, ar, decode):
    res = generate(ll, draft, schema, decode)
    assert [r.output_ids for r in res] == [r.output_ids for r in ar]
    if decode.mode in ("speculative", "tree"):
        assert sum(r.stats.draft_tokens for r in res) > 0


@pytest.mark.parametrize("decode", [DecodeParams(mode="filter", threshold=0.4), DecodeParams(mode="rollback"),
                                    DecodeParams(mode="filter", threshold=0.0)], ids=["filter", "rollback", "draft"])
def test_lossy_modes_keep_to_the_grammar(ll, draft, schema, decode):
    res = generate(ll, draft, schema, decode)
    assert all(r.finish_reason == "eos" and valid(r.text) for r in res), [r.text for r in res]
    assert sum(r.stats.draft_tokens for r in res) > 0


@pytest.mark.parametrize("mode", ["ar", "speculative", "tree"])
def test_sampled_output_keeps_to_the_grammar(ll, draft, schema, mode):
    decode = DecodeParams(mode=mode, tree_chains=2) if mode == "tree" else DecodeParams(mode=mode)
    res = generate(ll, draft, schema, decode, temperature=1.0, seed=11)
    assert all(r.finish_reason == "eos" and valid(r.text) for r in res), [r.text for r in res]


def test_regex_and_lark_grammars(ll, draft):
    date = generate(ll, draft, Grammar.compile("regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
                    DecodeParams(mode="speculative"), prompts=["When did the Berlin wall fall?"])[0]
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", date.text) and date.finish_reason == "eos"
    answer = Grammar.compile("lark", 'start: ("yes" | "no") "." ')
    a, s = (generate(ll, draft, answer, DecodeParams(mode=m), prompts=["Is the sky blue?"])[0]
            for m in ("ar", "speculative"))
    assert a.text in ("yes.", "no.") and s.output_ids == a.output_ids


def test_a_cursor_moved_anywhere_masks_as_a_fresh_matcher(ll, schema):
    from llguidance import LLMatcher

    tokens = GrammarTokens(ll.tokenizer, ll.runner.vocab_size, ll.eos_ids)
    masks = tokens.masks()
    text = ll.tokenizer.encode('{"name": "Ann", "age": 7}', add_special_tokens=False)
    rows = torch.zeros(1, ll.runner.vocab_size)

    def fresh(prefix):
        m = LLMatcher(tokens.get(), schema.spec, log_level=0)
        assert m.consume_tokens(prefix)
        return GrammarMasks._forbidden(m, rows.shape[-1])[None]

    for k in (5, 2, len(text), 0, 3):  # back and forth over the same cursor
        got = torch.isinf(masks.apply(rows, [("r", schema, text[:k])]))
        assert torch.equal(got, fresh(text[:k])), k
    done = masks.apply(rows, [("r", schema, text)])[0]
    assert sorted(torch.nonzero(done == 0).flatten().tolist()) == sorted(ll.eos_ids & set(range(rows.shape[-1])))
    assert torch.equal(masks.apply(rows, [None]), rows)  # no grammar: no mask
    broken = text[:2] + ll.tokenizer.encode("zz", add_special_tokens=False)
    assert torch.equal(masks.apply(rows, [("r", schema, broken)]), rows)  # past the grammar: left as it is
    masks.release("r")
    assert len(masks) == 0

