"""Stop strings: the first one to complete ends the text, whatever the chunking; streamed text is
never retracted; the check costs the new characters only.

Guards: 300 stop strings of 2,000 characters slowed every other request of the server (the check
searched each stop in the output's tail and held text back by trying every prefix of every stop).
"""
import random
import time

import pytest

from outpace.config import MAX_NUM_STOP, MAX_STOP_CHARS, SamplingParams
from outpace.engine.sequence import Sequence
from outpace.engine.stopping import StopChecker, StopStrings
from outpace.errors import InvalidParameterError


def first_stop(text: str, stops: list[str]) -> int | None:
    """Brute force: the start of the stop string that completes first (earliest end, then earliest start)."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if end >= len(s) and text[end - len(s):end] == s]
        if starts:
            return min(starts)
    return None


def longest_held(text: str, stops: list[str]) -> int:
    """Brute force: the longest proper prefix of a stop string that ends the text."""
    return max([n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])], default=0)


def test_stop_strings_match_brute_force_whatever_the_chunking():
    rng = random.Random(0)
    for _ in range(2000):
        alphabet = "ab" if rng.random() < 0.5 else "abc"
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        matcher, read, found = StopStrings(stops), 0, None
        while read < len(text) and found is None:
            chunk = text[read:read + rng.randint(1, 5)]
            found = matcher.feed(chunk)
            read += len(chunk)
            if found is None:
                assert matcher.num_held == longest_held(text[:read], stops)
        assert found == first_stop(text, stops), (text, stops)


def test_stop_check_costs_the_new_text_only():
    """Feeding 2,000 characters after 200,000 costs what it costs at the start (the old check
    grew with the output)."""
    stops = ["x" * MAX_STOP_CHARS] * (MAX_NUM_STOP - 1) + ["ab" * 127 + "c"]
    text = "ab" * 1000

    def feed_time(matcher: StopStrings) -> float:
        start = time.perf_counter()
        assert matcher.feed(text) is None
        return time.perf_counter() - start

    fresh = min(feed_time(StopStrings(stops)) for _ in range(3))
    long = StopStrings(stops)
    for _ in range(100):
        long.feed(text[:1999] + "y")
    assert min(feed_time(long) for _ in range(3)) < 5 * fresh


class CharTokenizer:
    """Token id i is the character chr(i); no special tokens."""

    eos_token_ids: set = set()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def run_checker(output: str, stops: list[str], chunk: int, max_tokens: int = 100, min_tokens: int = 0):
    params = SamplingParams(stop=stops, max_tokens=max_tokens, ignore_eos=True, min_tokens=min_tokens)
    seq = Sequence(0, [ord(">")], params)
    checker = StopChecker(CharTokenizer(), params, [], max_model_len=1000)
    ids = [ord(c) for c in output]
    shown = []
    for i in range(0, len(ids), chunk):
        checker.append(seq, ids[i:i + chunk])
        shown.append(seq.text)
        if seq.finish_reason:
            break
    return seq, shown


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_checker_cuts_at_the_stop_and_never_retracts(chunk):
    output = "one two thr three four"
    seq, shown = run_checker(output, ["three", "hree f", "xyz"], chunk)
    assert (seq.text, seq.finish_reason) == ("one two thr ", "stop")
    assert all(later.startswith(earlier) for earlier, later in zip(shown, shown[1:]))
    assert seq.output_ids == [ord(c) for c in output[:len("one two thr three")]]   # nothing after the stop


@pytest.mark.parametrize("chunk", [1, 4])
def test_no_stop_string_ends_the_output_before_min_tokens(chunk):
    """vLLM's rule: "one" completes at the 3rd token and "two" at the 7th, both before min_tokens
    (8); the output goes on (and "one" stays in the text) until "thr" completes at the 11th."""
    seq, _ = run_checker("one two three four", ["one", "two", "thr"], chunk, min_tokens=8)
    assert (seq.text, seq.finish_reason, seq.num_output_tokens) == ("one two ", "stop", 11)


def test_checker_releases_held_text_at_the_end():
    seq, shown = run_checker("abcab", ["abd"], chunk=1, max_tokens=5)
    assert shown[-2] == "abc" and (seq.text, seq.finish_reason) == ("abcab", "length")


@pytest.mark.parametrize("stop, words", [
    (["s"] * (MAX_NUM_STOP + 1), "at most 16"),
    (["s" * (MAX_STOP_CHARS + 1)], "longer than 256"),
])
def test_stop_limits(stop, words):
    with pytest.raises(InvalidParameterError, match=words):
        SamplingParams(stop=stop)


@pytest.mark.parametrize("max_tokens, stop_ids, reason, kept", [(4, [], "length", 4), (100, [ord("r")], "stop", 9)])
def test_without_detokenizing_tokens_stop_alike_and_text_stays_empty(max_tokens, stop_ids, reason, kept):
    ids = [ord(c) for c in "hello world, again"]
    ends = []
    for detokenize in (True, False):
        params = SamplingParams(max_tokens=max_tokens, stop_token_ids=stop_ids, detokenize=detokenize, ignore_eos=True)
        seq = Sequence(0, [ord(">")], params)
        checker = StopChecker(CharTokenizer(), params, [], max_model_len=1000)
        for i in range(0, len(ids), 3):
            checker.append(seq, ids[i:i + 3])
            if seq.finish_reason:
                break
        ends.append((seq.output_ids, seq.finish_reason, seq.text))
    assert ends[0][:2] == ends[1][:2] == (ids[:kept], reason)
    assert ends[0][2] == "".join(map(chr, ids[:kept]))[:len(ends[0][2])] != "" and ends[1][2] == ""


def test_stop_strings_need_detokenizing():
    with pytest.raises(InvalidParameterError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)
