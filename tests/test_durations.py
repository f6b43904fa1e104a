"""Tests for testflinger_magic.durations: one strict grammar for every duration."""

import re

import pytest
from hypothesis import given, strategies as st

from testflinger_magic.durations import (
    MAX_DURATION,
    format_duration,
    parse_bounded_duration,
    parse_duration,
)


@pytest.mark.parametrize("text, seconds", [
    ("30s", 30.0), ("10m", 600.0), ("2h", 7200.0), ("1d", 86400.0),
    ("1h30m", 5400.0), ("1d2h3m4s", 86400 + 7200 + 180 + 4), ("0s", 0.0),
    (" 2h ", 7200.0), ("1.5h", 5400.0), ("90s", 90.0), ("0", 0.0), ("0.0", 0.0),
    ("600", 600.0), ("2.5", 2.5),
])
def test_parse_strings(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("number", [0, 5, 2.5, 600])
def test_parse_numbers_are_seconds(number):
    assert parse_duration(number) == float(number)
    assert isinstance(parse_duration(number), float)


@pytest.mark.parametrize("number", [0, 7, 600, 2.5, 86400])
def test_a_number_and_the_same_number_quoted_are_the_same_duration(number):
    # docs/api.md: "durations are strings like 15m or seconds"; YAML `600` and `'600'` agree.
    assert parse_duration(number) == parse_duration(str(number))


@pytest.mark.parametrize("bad", ["", "m", "5x", "1h 30m", "-5m", "h1", "1.m", "abc", ".5m",
                                 "1e3", "nan", "inf", "+5m", "5mm", "1d2", "5 m",
                                 -1, -0.5, True, None, [], {}])
def test_parse_rejects(bad):
    with pytest.raises(ValueError):
        parse_duration(bad)


@pytest.mark.parametrize("bad, why", [
    ("10M", r"did you mean '10m'\? units are lowercase.*M would be months"),
    ("2H", r"did you mean '2h'\?"),
    ("1D", r"did you mean '1d'\?"),
    ("0x10", r"plain decimal digits"),
    ("10_000", r"plain decimal digits"),
    ("1m1m", r"the unit 'm' appears twice"),
    ("1h2h", r"the unit 'h' appears twice"),
    ("1m1h", r"order d, h, m, s"),
    ("30s1m", r"order d, h, m, s"),
    ("\u0663m", r"ASCII digits"),      # Arabic-Indic three
    ("\uff13m", r"ASCII digits"),      # fullwidth three
    ("\u0663", r"ASCII digits"),
    ("9" * 400, r"too long"),
])
def test_each_refusal_says_why(bad, why):
    with pytest.raises(ValueError, match=why) as exc:
        parse_duration(bad)
    assert repr(bad) in str(exc.value)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_inf_are_not_finite_not_too_long(bad):
    for parse in (parse_duration, parse_bounded_duration):
        with pytest.raises(ValueError, match="not a finite number"):
            parse(bad)


def test_error_names_the_text():
    with pytest.raises(ValueError, match="'5x'"):
        parse_duration("5x")


def test_bounded():
    assert parse_bounded_duration("366d") == MAX_DURATION
    with pytest.raises(ValueError, match="longer than the limit of 366d"):
        parse_bounded_duration("367d")
    with pytest.raises(ValueError, match="longer than the limit"):
        parse_bounded_duration(MAX_DURATION + 1)


@pytest.mark.parametrize("seconds, text", [
    (0, "0s"), (59, "59s"), (60, "1m"), (5400, "1h30m"), (86400, "1d"),
    (90061, "1d1h1m1s"), (59.6, "1m"),
])
def test_format(seconds, text):
    assert format_duration(seconds) == text


@given(st.integers(min_value=0, max_value=10 * 365 * 86400))
def test_round_trip(seconds):
    assert parse_duration(format_duration(seconds)) == seconds
    assert parse_duration(str(seconds)) == seconds


# The grammar, written out independently of the parser: what the parser must accept.
_NUM = r"[0-9]+(\.[0-9]+)?"
_GRAMMAR = re.compile(rf"\s*({_NUM}|({_NUM}d)?({_NUM}h)?({_NUM}m)?({_NUM}s)?)\s*", re.ASCII)
_ALPHABET = st.sampled_from(list("0123456789.dhmsDHMSxX_-+ e:") + ["\u0663", "\uff13", "M"])


@given(st.text(alphabet=_ALPHABET, max_size=12))
def test_junk_is_refused_and_the_grammar_accepted(text):
    if _GRAMMAR.fullmatch(text) and text.strip():
        assert parse_duration(text) >= 0
    else:
        with pytest.raises(ValueError):
            parse_duration(text)


@given(st.lists(st.tuples(st.integers(0, 999), st.sampled_from("dhms")), min_size=1, max_size=4))
def test_parts_in_order_once_each_add_up_others_refused(parts):
    text = "".join(f"{n}{u}" for n, u in parts)
    units = [u for _, u in parts]
    if units == sorted(set(units), key="dhms".index):
        size = {"d": 86400, "h": 3600, "m": 60, "s": 1}
        assert parse_duration(text) == sum(n * size[u] for n, u in parts)
    else:
        with pytest.raises(ValueError):
            parse_duration(text)
