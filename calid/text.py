"""Prompt encoding and streaming detokenization with stop strings."""
from __future__ import annotations

import functools
from typing import Callable


def encode_prompt(tokenizer, prompt: str | list[dict], chat: bool = True) -> list[int]:
    """Token ids for a prompt string or a list of chat messages.

    Instruct models get their chat template (with the assistant turn opened);
    ``chat=False`` or a tokenizer without a template encodes the raw text.
    """
    if isinstance(prompt, list) or (chat and getattr(tokenizer, "chat_template", None)):
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False).input_ids
    return tokenizer(prompt, add_special_tokens=True).input_ids


def _decoder(tokenizer) -> Callable[[list[int]], str]:
    """Text of token ids, special tokens skipped, spaces as the tokenizer's pieces give them. Where the tokenizer
    is transformers' wrapper of a ``tokenizers`` one whose decode is exactly that library's, the library's own
    decode is called: the wrapper's conversions cost more than the decode (1 -> 3 us a call warm, Qwen's tokenizer,
    two calls a streamed token; TextStream.push between forwards went from 23 to 12 us a token)."""
    if _library_decode(tokenizer):
        return functools.partial(tokenizer.backend_tokenizer.decode, skip_special_tokens=True)
    return functools.partial(tokenizer.decode, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _library_decode(tokenizer) -> bool:
    from transformers import PreTrainedTokenizerFast

    cls = type(tokenizer)
    return (isinstance(tokenizer, PreTrainedTokenizerFast) and cls.decode is PreTrainedTokenizerFast.decode
            and cls._decode is PreTrainedTokenizerFast._decode)


def _joins(tokenizer) -> bool:
    """Whether the text of ids ``a + b`` is the text of ``a`` and then that of ``b`` wherever ``a``'s bytes end on a
    whole character: so with a byte-level decoder (each token's bytes, joined, read as UTF-8: GPT-2's, Qwen's,
    SmolLM2's), not with SentencePiece's, which drops the space a decode starts with."""
    from tokenizers import decoders

    return _library_decode(tokenizer) and isinstance(tokenizer.backend_tokenizer.decoder, decoders.ByteLevel)


class TextStream:
    """Turns token ids into text deltas, one token at a time.

    * Never emits a broken UTF-8 character: text ending in U+FFFD (a byte
      sequence cut mid-character) is held until the next token completes it.
    * Holds back a tail that could be the start of a stop string, and finishes
      at the first stop string, which is not part of the text.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), joins: bool | None = None):
        self._decode = _decoder(tokenizer)
        # ``_joins``: a token's text is the text of the ids after those already shown, one decode of the new ids
        # (otherwise the text the last shown ids had before and after them: two decodes, the older ids again)
        self._joins = _joins(tokenizer) if joins is None else joins
        self.stop = tuple(s for s in stop if s)
        self._matcher = StopMatcher(self.stop) if self.stop else None
        self.ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] decode to text already accounted for
        self._read = 0
        self.text = ""  # all complete text so far (stop string excluded once stopped)
        self.emitted = 0  # len of text handed out
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add a token; return the text that is now safe to show (may be empty)."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        added = self._take()
        if added:
            self._check_stop(added)
        return self._release(final=False)

    def push_many(self, token_ids: list[int]) -> str:
        """``push`` of each token in turn, with the text it would have shown by the last one: with no stop strings
        and the tokens ending on a whole character, decoded at once (a verification keeps up to 32 tokens a step;
        decoded one by one they cost 0.01 ms each). Otherwise token by token."""
        if len(token_ids) > 1 and self._matcher is None and not self.stopped:
            self.ids += token_ids
            if self._take():
                return self._release(final=False)
            del self.ids[-len(token_ids):]  # a character left open: where each token's text ends matters
        return "".join(self.push(t) for t in token_ids)

    def _take(self) -> int:
        """Add the text of the ids not yet shown to ``text`` if they end on a whole character; its length."""
        if self._joins:
            new = self._decode(self.ids[self._read:])
            if not new or new.endswith("\ufffd"):
                return 0
        else:
            before = self._decode(self.ids[self._prefix: self._read])
            after = self._decode(self.ids[self._prefix:])
            if len(after) <= len(before) or after.endswith("\ufffd"):
                return 0
            new = after[len(before):]
        self.text += new
        self._prefix, self._read = self._read, len(self.ids)
        return len(new)

    def finish(self) -> str:
        """Flush held-back text at the end of generation."""
        return self._release(final=True)

    def _check_stop(self, added: int) -> None:
        """Feed the new text to the stop matcher; cut the text at the first stop string that completes."""
        if self._matcher is None:
            return
        base = len(self.text) - added
        for i, ch in enumerate(self.text[base:]):
            length = self._matcher.feed(ch)
            if length:
                self.text = self.text[: base + i + 1 - length]
                self.stopped = True
                return

    def _release(self, final: bool) -> str:
        safe = len(self.text)
        if not final and not self.stopped:
            safe -= self._partial_stop_len()
        delta = self.text[self.emitted : safe]
        self.emitted = max(self.emitted, safe)
        return delta

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of text that is a proper prefix of a stop string."""
        return self._matcher.depth if self._matcher is not None else 0


class StopMatcher:
    """Aho-Corasick automaton over the stop strings, fed one character at a time.

    Linear in the text and the stop strings together: every character costs
    amortised O(1) however many stop strings there are or how long they are.
    ``depth`` is the length of the longest tail of the text fed so far that is a
    prefix of some stop string, which is exactly what a stream must hold back.
    """

    def __init__(self, stops: tuple[str, ...]):
        self._next: list[dict[str, int]] = [{}]
        self._depth = [0]
        self._ends = [0]  # the longest stop string ending at this state (via suffix links), 0 for none
        for s in stops:
            node = 0
            for ch in s:
                nxt = self._next[node].get(ch)
                if nxt is None:
                    nxt = len(self._next)
                    self._next[node][ch] = nxt
                    self._next.append({})
                    self._depth.append(self._depth[node] + 1)
                    self._ends.append(0)
                node = nxt
            self._ends[node] = len(s)
        self._fail = [0] * len(self._next)
        order = list(self._next[0].values())
        for node in order:  # breadth first, so a node's suffix link is final before its children use it
            for ch, child in self._next[node].items():
                f = self._fail[node]
                while f and ch not in self._next[f]:
                    f = self._fail[f]
                link = self._next[f].get(ch, 0)
                self._fail[child] = link if link != child else 0
                self._ends[child] = self._ends[child] or self._ends[self._fail[child]]
                order.append(child)
        self._state = 0

    @property
    def depth(self) -> int:
        return self._depth[self._state]

    def feed(self, ch: str) -> int:
        """Advance by one character; returns the length of the stop string that ends here (0 if none)."""
        node = self._state
        while node and ch not in self._next[node]:
            node = self._fail[node]
        self._state = self._next[node].get(ch, 0)
        return self._ends[self._state]
