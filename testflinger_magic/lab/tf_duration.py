"""Testflinger's own duration parsing, as the lab's job service needs it (``reserve_data.timeout``).

Source: canonical/testflinger ``common/src/testflinger_common/duration.py::parse_duration`` (fe381ff),
used by ``server/src/testflinger/api/schemas.py::DurationField``. It is more lenient than
testflinger-magic's own grammar (:mod:`testflinger_magic.durations`), which must not be used for
a stand-in of Testflinger: it takes an int as seconds (a float is refused), and a string after
``strip().lower()``: a plain integer (Python's ``int()``), or number+unit tokens with the units
``s/sec/secs``, ``m/min/mins``, ``h/hour/hours``, ``d/day/days`` in any order and repetition,
blanks between tokens ignored. Anything else raises :class:`DurationParseError`.
"""

from __future__ import annotations

import re

#: Seconds per unit word (the real module's ``unit_multipliers``).
UNIT_SECONDS = {"s": 1, "sec": 1, "secs": 1, "m": 60, "min": 60, "mins": 60,
                "h": 3600, "hour": 3600, "hours": 3600, "d": 86400, "day": 86400, "days": 86400}
_TOKEN = re.compile(r"(\d+)\s*(secs?|mins?|hours?|days?|[smhd])")


class DurationParseError(ValueError):
    """Testflinger's ``DurationParseError``: the text says what is wrong."""


def parse_duration(value) -> int:
    """Seconds (int) of ``value`` as Testflinger reads it; raises :class:`DurationParseError`."""
    if isinstance(value, int):
        if value < 0:
            raise DurationParseError("Duration cannot be negative")
        return value
    if not isinstance(value, str):
        raise DurationParseError(f"Duration must be string or int, got {type(value)}")
    text = value.strip().lower()
    if not text:
        raise DurationParseError("Duration cannot be empty")
    if text.startswith("-"):
        raise DurationParseError("Duration cannot be negative")
    try:
        return int(text)
    except ValueError:
        pass
    tokens = _TOKEN.findall(text)
    if not tokens or "".join(n + u for n, u in tokens) != re.sub(r"\s+", "", text):
        raise DurationParseError(f"Invalid duration format: '{text}'")
    return sum(int(n) * UNIT_SECONDS[u] for n, u in tokens)
