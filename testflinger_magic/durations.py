"""Durations written as operators write them: ``30s``, ``10m``, ``2h``, ``1d``, ``1h30m``."""

import re

#: The longest duration accepted anywhere (definitions files, ``drain --grace``, the API's
#: ``grace``): one year. Longer is a typo (``max_lease: 8000h``?) and floats beyond this only
#: overflow deadlines.
MAX_DURATION = 366 * 86400.0

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_PART = re.compile(r"(\d+(?:\.\d+)?)([smhd])")


def parse_duration(value) -> float:
    """Return ``value`` in seconds (float).

    Accepts a non-negative number (already seconds) or a string of one or more ``<number><unit>``
    parts with unit ``s``, ``m``, ``h`` or ``d`` (``"1h30m"``), or ``"0"`` (zero needs no unit;
    any other number written as text does: is ``"10"`` seconds or minutes?). Raises
    ``ValueError`` with the offending text otherwise.
    """
    if isinstance(value, bool):
        raise ValueError(f"not a duration: {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"duration must not be negative: {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"not a duration: {value!r}")
    text = value.strip().lower()
    if text.startswith("-"):
        raise ValueError(f"duration must not be negative: {value!r}")
    if re.fullmatch(r"0+(?:\.0+)?", text):
        return 0.0
    pos, total = 0, 0.0
    for m in _PART.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if not text or pos != len(text):
        hint = "a number needs a unit; " if re.fullmatch(r"\d+(?:\.\d+)?", text) else ""
        raise ValueError(f"not a duration: {value!r} ({hint}use e.g. 30s, 10m, 2h, 1d)")
    return total


def parse_bounded_duration(value) -> float:
    """:func:`parse_duration` limited to :data:`MAX_DURATION` (also refusing ``inf``/``nan``
    from e.g. ``1e400``). Raises ``ValueError`` naming the value and the limit."""
    seconds = parse_duration(value)
    if not seconds <= MAX_DURATION:
        raise ValueError(f"{value!r} is longer than the limit of {format_duration(MAX_DURATION)}")
    return seconds


def format_duration(seconds: float) -> str:
    """Format seconds the way operators write them (``5400`` -> ``"1h30m"``)."""
    seconds = int(round(seconds))
    if seconds == 0:
        return "0s"
    out = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        n, seconds = divmod(seconds, size)
        if n:
            out.append(f"{n}{unit}")
    return "".join(out)
