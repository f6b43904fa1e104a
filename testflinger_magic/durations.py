"""Durations written as operators write them: ``30s``, ``10m``, ``2h``, ``1d``, ``1h30m``, or a
number of seconds.

One grammar for every duration the project reads (definition files, agent-host.yaml, simulate
traces and ``--policy``, ``drain --grace``, the API's ``grace``)::

    duration := seconds | part+
    seconds  := number                       # "600", 600, 2.5: seconds
    part     := number unit                  # units in the order d, h, m, s, each at most once
    number   := [0-9]+ ("." [0-9]+)?         # ASCII digits only
    unit     := "d" | "h" | "m" | "s"        # lowercase, as docs/operator-guide.md writes them

A YAML number and the same number quoted are the same duration (``600`` and ``"600"``: 600 s;
docs/api.md: "durations are strings like ``15m`` or seconds"). Everything else is refused with
the text and the reason: ``10M`` (is it minutes or months? units are lowercase), ``1m1m`` (a
unit twice), ``1m1h`` (out of order), ``٣m`` (not an ASCII digit), ``0x10``/``10_000``, negative,
``nan``/``inf``. (YAML 1.1's own number forms -- ``0x10``, ``010``, ``10_000``, ``1:30`` -- are
refused where the YAML is read, :mod:`testflinger_magic.yamlfile`, before any field sees them.)
"""

import math
import re

#: The longest duration accepted anywhere (definitions files, ``drain --grace``, the API's
#: ``grace``): one year. Longer is a typo (``max_lease: 8000h``?) and floats beyond this only
#: overflow deadlines.
MAX_DURATION = 366 * 86400.0

_UNITS = {"d": 86400, "h": 3600, "m": 60, "s": 1}
_ORDER = "dhms"
_NUMBER = r"[0-9]+(?:\.[0-9]+)?"
_SECONDS = re.compile(_NUMBER)
_PARTS = re.compile(rf"(?:{_NUMBER}[dhms])+")
_PART = re.compile(rf"({_NUMBER})([dhms])")
_EXAMPLES = "use e.g. 30s, 10m, 2h, 1d, 1h30m, or a number of seconds"


def _refuse(value, why: str) -> ValueError:
    return ValueError(f"not a duration: {value!r} ({why}; {_EXAMPLES})")


def _why_not(text: str) -> str:
    """The reason ``text`` (stripped, not matching the grammar) is not a duration."""
    if any(c.isdigit() and not "0" <= c <= "9" for c in text):
        return "only the ASCII digits 0-9 are numbers here"
    if _PARTS.fullmatch(text.lower()):
        hint = " (M would be months; minutes are m)" if "M" in text else ""
        return f"did you mean {text.lower()!r}? units are lowercase: d, h, m, s{hint}"
    if "_" in text or text.lower().startswith("0x"):
        return "write the number in plain decimal digits, without '_' or 0x"
    return "not <number><unit> parts"


def parse_duration(value) -> float:
    """Return ``value`` in seconds (float), by the grammar in this module's docstring.

    ``value`` is a non-negative finite int/float (seconds) or a string: a number of seconds
    (``"600"``) or ``<number><unit>`` parts, units ``d``, ``h``, ``m``, ``s`` in that order and
    each at most once (``"1h30m"``). Surrounding blanks are ignored. Raises ``ValueError``
    naming the value and why (a bool, negative, ``nan``/``inf``, an upper-case or repeated or
    out-of-order unit, a digit that is not ASCII, anything else)."""
    if isinstance(value, bool):
        raise ValueError(f"not a duration: {value!r}")
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise _refuse(value, "not a finite number")
        if value < 0:
            raise ValueError(f"duration must not be negative: {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"not a duration: {value!r}")
    text = value.strip()
    if text.startswith("-"):
        raise ValueError(f"duration must not be negative: {value!r}")
    if not text:
        raise _refuse(value, "empty")
    if _SECONDS.fullmatch(text):
        return _finite(value, float(text))
    if not _PARTS.fullmatch(text):
        raise _refuse(value, _why_not(text))
    total, last = 0.0, -1
    for m in _PART.finditer(text):
        unit = m.group(2)
        at = _ORDER.index(unit)
        if at == last:
            raise _refuse(value, f"the unit {unit!r} appears twice")
        if at < last:
            raise _refuse(value, "write the units in the order d, h, m, s")
        last = at
        total += float(m.group(1)) * _UNITS[unit]
    return _finite(value, total)


def _finite(value, seconds: float) -> float:
    """``seconds``, or ValueError when the digits overflowed a float (``"9" * 400``)."""
    if not math.isfinite(seconds):
        raise _refuse(value, "too long to be a number of seconds")
    return seconds


def parse_bounded_duration(value) -> float:
    """:func:`parse_duration` limited to :data:`MAX_DURATION`. Raises ``ValueError`` naming the
    value and the limit."""
    seconds = parse_duration(value)
    if seconds > MAX_DURATION:
        raise ValueError(f"{value!r} is longer than the limit of {format_duration(MAX_DURATION)}")
    return seconds


def format_duration(seconds: float) -> str:
    """Format seconds the way operators write them (``5400`` -> ``"1h30m"``), rounded to the
    second; :func:`parse_duration` reads it back (``parse(format(n)) == n`` for whole seconds)."""
    seconds = int(round(seconds))
    if seconds == 0:
        return "0s"
    out = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        n, seconds = divmod(seconds, size)
        if n:
            out.append(f"{n}{unit}")
    return "".join(out)
