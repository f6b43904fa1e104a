"""Shared pieces of the queue definition schema (queues.py) and the smarter-lending knobs of a
magic queue's ``policy`` (issue 11): warm devices by schedule (:class:`WarmWindow`), a warm level
learnt from arrivals (:class:`WarmLearn`), and their pure evaluation at a time
(:func:`scheduled_level`, :func:`learned_jobs`). queues.py re-exports every model.

Every knob defaults to the behaviour before it existed (reconcile's oracle test holds plan() to
that): no window, no learning, ``device_fit: waste``, no ``yield_idle``, ``max_share: 1``,
``reclaim.idle_wait`` unset. docs/operator-guide.md ("Smarter lending") explains each.
"""

from __future__ import annotations

import bisect
import functools
import math
import re
from datetime import datetime, timezone
from typing import Annotated, Any, Optional
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, model_validator

from testflinger_magic.durations import (  # noqa: F401 (MAX_DURATION re-exported)
    MAX_DURATION,
    format_duration,
    parse_bounded_duration,
)
#: Devices per queue (queue_bounds.MAX_DEVICES says why).
from testflinger_magic.queue_bounds import MAX_DEVICES as _MAX_DEVICES

DAY = 86400.0
#: Day names of ``warm[].days``, Monday first (``datetime.weekday()`` order).
DAY_NAMES = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_HHMM = re.compile(r"^([01]\d|2[0-3]):([0-5]\d)$|^24:00$")


def _seconds(value: Any) -> float:
    return parse_bounded_duration(value)


#: A duration: ``"30m"``/``"2h"``/number of seconds in, float seconds on the model.
Duration = Annotated[float, BeforeValidator(_seconds)]


class _Strict(BaseModel):
    # Not frozen: the lab overrides policy fields in place; assignments are still validated
    # (so ``policy.idle_timeout = "5m"`` stores 300.0), cross-field rules are not re-checked.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _days(value: Any) -> Any:
    """``mon-fri`` / ``sat`` / ``[mon, wed]`` / ``[mon-wed, fri]`` -> sorted unique day names."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        raise ValueError("must be a day name (mon..sun), a range like mon-fri, or a list of them")
    out: set[int] = set()
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"{item!r} is not a day name (mon..sun) or a range like mon-fri")
        lo, sep, hi = item.strip().lower().partition("-")
        if lo not in DAY_NAMES or (sep and hi not in DAY_NAMES):
            raise ValueError(f"{item!r} is not a day name (mon..sun) or a range like mon-fri")
        a, b = DAY_NAMES.index(lo), DAY_NAMES.index(hi) if sep else DAY_NAMES.index(lo)
        if b < a:
            raise ValueError(f"{item!r}: a range runs Monday to Sunday (write sat-sun, mon-fri, or a list)")
        out.update(range(a, b + 1))
    return [DAY_NAMES[i] for i in sorted(out)]


def _hours(value: Any) -> Any:
    """``"08:00-18:00"`` (24 h clock; the end may be ``24:00``; start before end)."""
    if not isinstance(value, str):
        raise ValueError(f"must be a text like \"08:00-18:00\", got {value!r}")
    start, sep, end = (p.strip() for p in value.partition("-"))
    if not sep or not _HHMM.match(start) or not _HHMM.match(end):
        raise ValueError(f"{value!r} is not HH:MM-HH:MM (24 h clock, e.g. \"08:00-18:00\")")
    if _minutes(start) >= _minutes(end):
        raise ValueError(f"{value!r}: the start must be before the end (a window across "
                         "midnight is two windows: 22:00-24:00 and 00:00-06:00 the next day)")
    return f"{start}-{end}"


def _minutes(hhmm: str) -> int:
    h, m = hhmm.split(":")
    return int(h) * 60 + int(m)


class WarmWindow(_Strict):
    """Keep ``devices`` lent (warm, even without waiting jobs) on ``days`` (``mon-fri``, a day,
    or a list) between ``hours`` (``"08:00-18:00"``, in the policy's ``timezone``)."""

    days: Annotated[list[str], BeforeValidator(_days)] = list(DAY_NAMES)
    hours: Annotated[str, BeforeValidator(_hours)]
    devices: Annotated[StrictInt, Field(ge=1, le=_MAX_DEVICES)] = 1

    def covers(self, local: datetime) -> bool:
        """True if ``local`` (a time in the policy's zone) is inside the window."""
        if DAY_NAMES[local.weekday()] not in self.days:
            return False
        start, end = (_minutes(t) for t in self.hours.split("-"))
        minute = local.hour * 60 + local.minute
        return start <= minute < end


class WarmLearn(_Strict):
    """A warm level learnt from the queue's arrivals (rule: :func:`learned_jobs`): look back
    ``lookback``; on each earlier day of the same kind as today (a working day Mon-Fri, or a
    weekend day, in the policy's ``timezone``), count the jobs submitted between this time of
    day and ``ahead`` later; keep lent enough devices for the ``quantile`` of those counts
    (0.5: the median day), at most ``max_devices``."""

    lookback: Duration = 7 * DAY
    ahead: Duration = 3600.0
    quantile: Annotated[float, Field(ge=0.0, le=1.0)] = 0.5
    max_devices: Annotated[StrictInt, Field(ge=1, le=_MAX_DEVICES)] = 1

    @model_validator(mode="after")
    def _sane(self):
        if self.lookback < DAY:
            raise ValueError("lookback must be at least 1d (it compares whole days)")
        if not 0 < self.ahead <= DAY:
            raise ValueError("ahead must be longer than 0s and at most 1d")
        return self


def _zone(value: Any) -> Any:
    if not isinstance(value, str) or not value:
        raise ValueError(f"must be an IANA time zone name such as UTC or Europe/London, got {value!r}")
    try:
        ZoneInfo(value)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"{value!r} is not a known IANA time zone (e.g. UTC, Europe/London, "
                         "America/New_York)") from None
    return value


#: An IANA time zone name (``zoneinfo``), validated on load.
TimeZone = Annotated[str, BeforeValidator(_zone)]
#: ``max_share``: a fraction of a home pool in (0, 1].
Share = Annotated[float, Field(gt=0.0, le=1.0)]
OptDuration = Optional[Duration]


def knob_issues(p) -> list[tuple[tuple, str]]:
    """Cross-field rules of the lending knobs of a ``queues.Policy`` ``p``, as
    ``(path relative to the queue, message)`` pairs (queues._policy_issues adds file, line
    and the queue's path)."""
    out: list[tuple[tuple, str]] = []
    for i, w in enumerate(p.warm):
        if w.devices > p.max_devices:
            out.append((("policy", "warm", i, "devices"),
                        f"warm devices ({w.devices}) exceeds max_devices ({p.max_devices})"))
    if p.warm_learn is not None and p.warm_learn.max_devices > p.max_devices:
        out.append((("policy", "warm_learn", "max_devices"),
                    f"warm_learn max_devices ({p.warm_learn.max_devices}) exceeds max_devices "
                    f"({p.max_devices})"))
    if p.yield_idle is not None and p.yield_idle <= 0:
        out.append((("policy", "yield_idle"), "must be longer than 0s (leave it out to never yield)"))
    if p.reclaim.idle_wait is not None and p.reclaim.idle_wait > p.reclaim.owner_wait:
        out.append((("policy", "reclaim", "idle_wait"),
                    f"idle_wait ({format_duration(p.reclaim.idle_wait)}) is longer than owner_wait "
                    f"({format_duration(p.reclaim.owner_wait)}): an idle lease would be reclaimed "
                    "later than a busy one"))
    return out


@functools.lru_cache(maxsize=1024)
def local_time(wall: float, zone: str) -> datetime:
    """``wall`` (epoch seconds) as a time in ``zone``. Cached: a plan asks for the same few
    moments (now, and now less whole days) once per queue."""
    return datetime.fromtimestamp(wall, timezone.utc).astimezone(ZoneInfo(zone))


def scheduled_level(windows: list[WarmWindow], zone: str, wall: float) -> int:
    """Devices the ``warm`` windows ask for at ``wall`` (epoch seconds): the largest
    ``devices`` of the windows covering that time in ``zone`` (0: none does)."""
    if not windows:
        return 0
    local = local_time(wall, zone)
    return max((w.devices for w in windows if w.covers(local)), default=0)


def _workday(wall: float, zone: str) -> bool:
    return local_time(wall, zone).weekday() < 5


def learned_jobs(learn: WarmLearn, zone: str, now: float, wall: float,
                 arrivals: list[float]) -> float:
    """Jobs expected in the next ``learn.ahead`` (see :class:`WarmLearn`): ``arrivals`` are the
    queue's submission times (seconds, on the clock of ``now``, sorted), ``wall`` the
    epoch time of ``now`` (for the day kind in ``zone``). For each k = 1 .. lookback // 1d
    whose day ``now - k days`` is of the same kind as today, the count of arrivals in
    ``[now - k days, now - k days + ahead)``; the result is the ``quantile`` of those counts by
    the nearest rank (0 when no such day is in the history). Cost: O(days x log arrivals)."""
    if not arrivals:
        return 0.0
    kind = _workday(wall, zone)
    counts = []
    for k in range(1, int(learn.lookback // DAY) + 1):
        if _workday(wall - k * DAY, zone) != kind:
            continue
        lo = now - k * DAY
        hi = lo + learn.ahead
        counts.append(bisect.bisect_left(arrivals, hi) - bisect.bisect_left(arrivals, lo))
    if not counts:
        return 0.0
    counts.sort()
    rank = max(1, math.ceil(learn.quantile * len(counts)))
    return float(counts[rank - 1])
