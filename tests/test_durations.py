"""Tests for testflinger_magic.durations."""

import pytest
from hypothesis import given, strategies as st

from testflinger_magic.durations import format_duration, parse_duration


@pytest.mark.parametrize("text, seconds", [
    ("30s", 30.0), ("10m", 600.0), ("2h", 7200.0), ("1d", 86400.0),
    ("1h30m", 5400.0), ("1d2h3m4s", 86400 + 7200 + 180 + 4), ("0s", 0.0),
    (" 2H ", 7200.0), ("1.5h", 5400.0), ("90s", 90.0), ("0", 0.0), ("0.0", 0.0),
])
def test_parse_strings(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("number", [0, 5, 2.5])
def test_parse_numbers_are_seconds(number):
    assert parse_duration(number) == float(number)
    assert isinstance(parse_duration(number), float)


@pytest.mark.parametrize("bad", ["", "10", "m", "5x", "1h 30m", "-5m", "h1", "1.m", "abc",
                                 -1, -0.5, True, None, [], {}])
def test_parse_rejects(bad):
    with pytest.raises(ValueError):
        parse_duration(bad)


def test_error_names_the_text():
    with pytest.raises(ValueError, match="'5x'"):
        parse_duration("5x")


def test_a_bare_number_other_than_zero_is_told_to_take_a_unit():
    with pytest.raises(ValueError, match="'10' \\(a number needs a unit; use e.g. 30s"):
        parse_duration("10")


@pytest.mark.parametrize("seconds, text", [
    (0, "0s"), (59, "59s"), (60, "1m"), (5400, "1h30m"), (86400, "1d"),
    (90061, "1d1h1m1s"), (59.6, "1m"),
])
def test_format(seconds, text):
    assert format_duration(seconds) == text


@given(st.integers(min_value=0, max_value=10 * 365 * 86400))
def test_round_trip(seconds):
    assert parse_duration(format_duration(seconds)) == seconds
