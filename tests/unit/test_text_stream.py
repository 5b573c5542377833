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


# ---- the stop matcher against a brute-force reference -------------------------------------------------

from hypothesis import given, settings, strategies as st  # noqa: E402

from calid.text import StopMatcher  # noqa: E402

_small = st.text(alphabet="abc", min_size=1, max_size=6)


def _reference(text: str, stops: tuple[str, ...]) -> tuple[str, bool, int]:
    """Cut at the first stop string to complete (the longest of those ending at the same place); else the
    longest tail that is a proper prefix of a stop string, by trying every length."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            return text[: end - max(map(len, done))], True, 0
    hold = max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
    return text, False, hold


@settings(deadline=None)  # examples: the hypothesis profile (tests/conftest.py)
@given(text=st.text(alphabet="abc", max_size=30), stops=st.lists(_small, min_size=1, max_size=4))
def test_stream_cuts_and_holds_back_like_the_brute_force_reference(text, stops):
    stops = tuple(stops)
    deltas, stream = run(text, stops)
    want_text, want_stopped, _ = _reference(text, stops)
    assert (stream.text, stream.stopped) == (want_text, want_stopped)
    assert "".join(deltas) == want_text


@settings(deadline=None)  # examples: the hypothesis profile (tests/conftest.py)
@given(text=st.text(alphabet="abc", max_size=30), stops=st.lists(_small, min_size=1, max_size=4))
def test_matcher_depth_is_the_longest_partial_stop(text, stops):
    stops = tuple(stops)
    m = StopMatcher(stops)
    for i, ch in enumerate(text):
        if m.feed(ch):
            return  # the reference's cut is checked above
        assert m.depth == _reference(text[: i + 1], stops)[2]
