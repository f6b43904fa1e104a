"""The lab job service's stand-in for Testflinger's duration parsing (lab/tf_duration.py), held
to the examples of canonical/testflinger common/src/testflinger_common/duration.py (fe381ff)."""

import pytest

from testflinger_magic.lab.tf_duration import DurationParseError, parse_duration


@pytest.mark.parametrize("value, seconds", [
    (3600, 3600), ("30m", 1800), ("5h", 18000), ("4d", 345600), ("1h30m", 5400),
    ("2d5h30m", 192600), ("30sec", 30), ("30min", 1800), ("5hour", 18000), ("4day", 345600),
    ("1H 30M", 5400), ("3600", 3600), ("1m1m", 120),
])
def test_testflinger_accepts(value, seconds):
    assert parse_duration(value) == seconds


@pytest.mark.parametrize("value, says", [
    (-1, "negative"), ("-5m", "negative"), ("", "empty"), ("5x", "Invalid duration format"),
    (2.5, "must be string or int"), ("1.5h", "Invalid duration format"),
])
def test_testflinger_refuses(value, says):
    with pytest.raises(DurationParseError, match=says):
        parse_duration(value)
