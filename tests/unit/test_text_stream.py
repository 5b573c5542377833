"""TextStream on a byte-level tokenizer: one token per UTF-8 byte, so characters really split."""
from calid.text import TextStream


class ByteTokenizer:
    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return bytes(ids).decode("utf-8", errors="replace")


def run(text: str, stop=()):
    stream = TextStream(ByteTokenizer(), stop)
    deltas = []
    for b in text.encode():
        deltas.append(stream.push(b))
        if stream.stopped:
            break
    deltas.append(stream.finish())
    return deltas, stream


def test_multibyte_characters_are_never_split():
    deltas, stream = run("héllo → wörld 🙂")
    assert "".join(deltas) == "héllo → wörld 🙂"
    assert all("\ufffd" not in d for d in deltas)
    assert stream.text == "héllo → wörld 🙂"


def test_stop_string_ends_text_and_is_excluded():
    deltas, stream = run("abc STOP def", stop=("STOP",))
    assert stream.stopped and "".join(deltas) == "abc " and stream.text == "abc "


def test_partial_stop_prefix_is_held_back_then_released():
    stream = TextStream(ByteTokenizer(), ("END",))
    shown = "".join(stream.push(b) for b in b"aEN")
    assert shown == "a"  # "EN" might start "END"
    shown += stream.push(ord("x"))
    assert shown == "aENx" and not stream.stopped


def test_earliest_of_several_stop_strings_wins():
    deltas, stream = run("one two three", stop=("three", "two"))
    assert "".join(deltas) == "one "
