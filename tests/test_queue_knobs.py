"""Validation of the smarter-lending knobs of a magic queue's policy (queue_policy.py, issue 11):
every bad value is reported with file, line and dotted field; good values load, default to the
old behaviour, and survive dump_yaml / to_document round trips."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from testflinger_magic import queues
from testflinger_magic.queues import DefinitionError, MagicQueue, load_file, load_text

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "examples" / "magic-queues-workhours.yaml"

GOOD = textwrap.dedent("""\
    magic_queues:
      one-gpu-vm:
        description: One VM with one GPU
        devices: {home_queues: [gpu-hosts]}
        policy:
          max_devices: 2
          KNOBS
""")


def with_knobs(*lines: str) -> str:
    return GOOD.replace("KNOBS", "\n      ".join(lines))


def issues(*lines: str) -> list[str]:
    with pytest.raises(DefinitionError) as info:
        load_text(with_knobs(*lines), "q.yaml")
    return [str(i) for i in info.value.issues]


def test_defaults_are_the_old_behaviour():
    (q,) = load_text(with_knobs("min_devices: 0"))
    p = q.policy
    assert p.warm == [] and p.warm_learn is None and p.timezone == "UTC"
    assert p.device_fit == "waste" and p.yield_idle is None and p.max_share == 1.0
    assert p.reclaim.idle_wait is None


def test_good_knobs_load_in_seconds_and_names():
    (q,) = load_text(with_knobs(
        'warm: [{days: mon-fri, hours: "08:00-18:00", devices: 2}, {days: [sat, sun], hours: "10:00-12:00"}]',
        "timezone: Europe/London",
        "warm_learn: {lookback: 14d, ahead: 90m, quantile: 0.75, max_devices: 2}",
        "device_fit: demand", "yield_idle: 5m", "max_share: 0.5",
        "reclaim: {owner_wait: 30m, idle_wait: 0s}"))
    p = q.policy
    assert p.warm[0].days == ["mon", "tue", "wed", "thu", "fri"] and p.warm[0].devices == 2
    assert p.warm[1].days == ["sat", "sun"] and p.warm[1].devices == 1
    assert p.warm_learn.lookback == 14 * 86400 and p.warm_learn.ahead == 5400
    assert p.yield_idle == 300 and p.reclaim.idle_wait == 0.0 and p.max_share == 0.5


@pytest.mark.parametrize("line, field, words", [
    ('warm: [{days: mon-fry, hours: "08:00-18:00"}]', "policy.warm.0.days", "'mon-fry' is not a day name"),
    ('warm: [{days: fri-mon, hours: "08:00-18:00"}]', "policy.warm.0.days", "a range runs Monday to Sunday"),
    ('warm: [{days: mon, hours: "8-18"}]', "policy.warm.0.hours", "is not HH:MM-HH:MM"),
    ('warm: [{days: mon, hours: "18:00-08:00"}]', "policy.warm.0.hours", "across midnight is two windows"),
    ('warm: [{days: mon}]', "policy.warm.0.hours", "required field is missing"),
    ('warm: [{hours: "08:00-18:00", devices: 3}]', "policy.warm.0.devices",
     "warm devices (3) exceeds max_devices (2)"),
    ('warm: [{hours: "08:00-18:00", devices: 0}]', "policy.warm.0.devices", "greater than or equal to 1"),
    ('warm: [{hours: "08:00-18:00", dayz: mon}]', "policy.warm.0.dayz", "unknown field"),
    ("timezone: Europe/Londn", "policy.timezone", "'Europe/Londn' is not a known IANA time zone"),
    ("timezone: 5", "policy.timezone", "must be an IANA time zone name"),
    ("warm_learn: {lookback: 12h}", "policy.warm_learn", "lookback must be at least 1d"),
    ("warm_learn: {ahead: 2d}", "policy.warm_learn", "ahead must be longer than 0s and at most 1d"),
    ("warm_learn: {quantile: 1.5}", "policy.warm_learn.quantile", "must be at most 1.0, got 1.5"),
    ("warm_learn: {max_devices: 3}", "policy.warm_learn.max_devices",
     "warm_learn max_devices (3) exceeds max_devices (2)"),
    ("device_fit: best", "policy.device_fit", "Input should be 'waste' or 'demand'"),
    ("yield_idle: 0s", "policy.yield_idle", "must be longer than 0s (leave it out to never yield)"),
    ("yield_idle: soon", "policy.yield_idle", "soon"),
    ("max_share: 0", "policy.max_share", "greater than 0"),
    ("max_share: 1.5", "policy.max_share", "must be at most 1.0"),
    ("reclaim: {owner_wait: 10m, idle_wait: 1h}", "policy.reclaim.idle_wait",
     "idle_wait (1h) is longer than owner_wait (10m)"),
])
def test_bad_knob_is_reported_with_line_and_field(line, field, words):
    found = issues(line)
    assert len(found) == 1, found
    assert found[0].startswith(f"q.yaml:7: magic_queues.one-gpu-vm.{field}: "), found[0]
    assert words in found[0], found[0]


def test_shipped_policy_loads_and_round_trips():
    qs = load_file(SHIPPED)
    one = {q.name: q for q in qs}["one-gpu-vm"]
    assert one.policy.warm[0].hours == "08:00-18:00" and one.policy.warm_learn is not None
    text = queues.dump_yaml(qs)
    assert load_text(text) == qs
    assert "yield_idle: 5m" in text and "lookback: 7d" in text
    for q in qs:
        doc = q.to_document()
        assert json.loads(json.dumps(doc)) == doc
        assert MagicQueue.from_document(dict(doc, applied_at=1.0)) == q


def test_a_max_lease_shorter_than_a_warm_window_warns_and_the_shipped_policy_does_not():
    """A lease lent when a warm window opens would reach max_lease while still warm and busy:
    its drain cancels running jobs after reclaim.grace (the forced cancel the shipped policy had
    on the bursty trace with max_lease 8h and a 10 h window)."""
    from testflinger_magic.queue_warnings import queue_warnings

    (short,) = load_text(with_knobs('warm: [{hours: "08:00-18:00"}]', "max_lease: 8h",
                                    "idle_timeout: 10m"), "q.yaml")
    (warning,) = queue_warnings(short)
    assert warning[0] == ("policy", "max_lease")
    assert "8h is shorter than the longest warm window (10h) plus idle_timeout (10m)" in warning[1]
    (long_,) = load_text(with_knobs('warm: [{hours: "08:00-18:00"}]', "max_lease: 12h",
                                    "idle_timeout: 10m"), "q.yaml")
    assert queue_warnings(long_) == []
    assert all(queue_warnings(q) == [] for q in load_file(SHIPPED))
