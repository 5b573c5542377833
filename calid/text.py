"""Prompt encoding and streaming detokenization with stop strings."""
from __future__ import annotations


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


class TextStream:
    """Turns token ids into text deltas, one token at a time.

    * Never emits a broken UTF-8 character: text ending in U+FFFD (a byte
      sequence cut mid-character) is held until the next token completes it.
    * Holds back a tail that could be the start of a stop string, and finishes
      at the first stop string, which is not part of the text.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] decode to text already accounted for
        self._read = 0
        self.text = ""  # all complete text so far (stop string excluded once stopped)
        self.emitted = 0  # len of text handed out
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        """Add a token; return the text that is now safe to show (may be empty)."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)
            self._check_stop(len(after) - len(before))
        return self._release(final=False)

    def finish(self) -> str:
        """Flush held-back text at the end of generation."""
        return self._release(final=True)

    def _check_stop(self, added: int) -> None:
        if not self.stop:
            return
        lo = max(0, len(self.text) - added - max(map(len, self.stop)))
        hits = [i for i in (self.text.find(s, lo) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def _release(self, final: bool) -> str:
        safe = len(self.text)
        if not final and not self.stopped:
            safe -= self._partial_stop_len()
        delta = self.text[self.emitted : safe]
        self.emitted = max(self.emitted, safe)
        return delta

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best
