"""TextStream on SmolLM2's own tokenizer: the streamed deltas add up to what the tokenizer decodes, through the
``tokenizers`` library's decode (no transformers wrapper a token), and a tokenizer of another kind keeps its own."""
from calid.text import TextStream, _decoder

TEXT = "def área(r):\n    return 3.14159 * r ** 2  # 円の面積 🙂\n\nprint(área(2))"


def test_streamed_text_is_the_tokenizers_decode_of_the_same_ids(smol):
    tok = smol.tokenizer
    ids = tok(TEXT, add_special_tokens=False).input_ids + [tok.eos_token_id]  # a special token is skipped
    stream = TextStream(tok)
    deltas = [stream.push(i) for i in ids] + [stream.finish()]
    assert "".join(deltas) == stream.text == tok.decode(ids, skip_special_tokens=True) == TEXT
    assert all("\ufffd" not in d for d in deltas)  # the emoji's and the kanji's bytes span tokens


def test_the_library_decode_is_used_only_where_it_is_the_tokenizers_own(smol):
    tok = smol.tokenizer
    assert _decoder(tok).func == tok.backend_tokenizer.decode

    class Wrapped:  # any other tokenizer: its decode, as it defines it
        def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
            return "-".join(map(str, ids))

    assert _decoder(Wrapped())([1, 2]) == "1-2"


def test_a_steps_tokens_pushed_at_once_show_the_text_token_by_token_pushes_show(smol):
    """push_many over every way of cutting the ids into steps of 1-5 tokens: after each step the text shown so far
    is what pushing its tokens one by one shows, including steps that end inside a multi-byte character."""
    import random

    tok = smol.tokenizer
    ids = tok(TEXT, add_special_tokens=False).input_ids
    rng = random.Random(0)
    for _ in range(40):
        one, many, shown_one, shown_many, at = TextStream(tok), TextStream(tok), "", "", 0
        while at < len(ids):
            step = ids[at: at + rng.randint(1, 5)]
            at += len(step)
            shown_one += "".join(one.push(i) for i in step)
            shown_many += many.push_many(step)
            assert shown_many == shown_one and many.text == one.text
        assert shown_many + many.finish() == TEXT
    stopped = TextStream(tok, stop=("return",))  # with stop strings: token by token, cut where the stop starts
    assert stopped.push_many(ids) + stopped.finish() == TEXT[: TEXT.index("return")] and stopped.stopped


def test_a_byte_level_stream_decodes_only_the_new_ids_and_shows_what_two_decodes_show(smol):
    """A byte-level tokenizer's stream (calid.text._joins) decodes only the ids not yet shown; over random ids of the
    whole vocabulary (bytes that end mid-character, lone continuation bytes, special tokens) cut into random steps,
    it shows after every step what the stream decoding the shown ids again beside the new ones shows."""
    import random

    from calid.text import _joins

    tok = smol.tokenizer
    assert _joins(tok)
    rng = random.Random(1)
    ids = tok(TEXT, add_special_tokens=False).input_ids
    for trial in range(60):
        seq = ids if trial == 0 else [rng.randrange(len(tok)) for _ in range(rng.randint(1, 40))]
        one, two, shown_one, shown_two, at = TextStream(tok), TextStream(tok, joins=False), "", "", 0
        while at < len(seq):
            step = seq[at: at + rng.randint(1, 6)]
            at += len(step)
            shown_one += one.push_many(step) if len(step) > 1 else one.push(step[0])
            shown_two += two.push_many(step) if len(step) > 1 else two.push(step[0])
            assert (shown_one, one.text) == (shown_two, two.text), seq
        assert shown_one + one.finish() == shown_two + two.finish()
        full = tok.decode(seq, skip_special_tokens=True)
        if not full.endswith("\ufffd"):  # else the stream still holds the unfinished character
            assert shown_one == full
