"""Hold a device back from lending after MAAS refused to bring it up (TRIAL13 F6).

A bring-up that fails because MAAS answered 502/503/504 (or did not answer) is reported with
``blame: maas`` and restores the lease without counting a failure against the device: an
outage of the lab's MAAS is nobody's fault (hostproto ``_report``). But MAAS answers 503 for
more than outages: ``maasserver/exceptions.py`` ``PowerProblem`` (``api_error`` 503: "a problem
with a power operation ... with parameters, a problem with the power controller") is raised for
one machine whose power type is unknown, whose power state is not queryable or that has a power
action in progress, while MAAS answers every other call, the agent host's ``whoami`` probe
included. Such a device was lent again at once, fenced, deployed, refused, restored, its own
agent stopped and started each time: 34 leases a minute, for ever.

So each such restore is counted on the device (``magic_devices.maas_refusals``, with
``maas_refused_at`` and ``maas_refused_reason``) and the device is not lent for
:func:`backoff_seconds` after it: 1 minute after the first, doubling to an hour at most. No
failure is counted and nothing is quarantined (a rack controller down refuses every machine it
powers, and is not their fault either). A lease of the device whose deploy succeeds clears the
count (:func:`clear`), as does unquarantining it (an operator looked). ``status`` says why a
held-back device is not lent (reconcile ``unlendable``: ``held back: MAAS refused it``).
"""

from __future__ import annotations

#: Seconds a device is held back after its first refused bring-up; doubled for each further
#: one in a row, up to :data:`BACKOFF_MAX`.
BACKOFF_BASE = 60.0
BACKOFF_MAX = 3600.0
#: The device document fields this module keeps.
FIELDS = ("maas_refusals", "maas_refused_at", "maas_refused_reason")


def backoff_seconds(refusals: int) -> float:
    """Seconds a device is held back after ``refusals`` (>= 1) bring-ups in a row MAAS refused:
    ``BACKOFF_BASE * 2**(refusals - 1)``, at most :data:`BACKOFF_MAX`; 0 for none."""
    if refusals < 1:
        return 0.0
    return min(BACKOFF_MAX, BACKOFF_BASE * 2 ** min(refusals - 1, 32))


def held_back(device: dict, now: float) -> str | None:
    """Why ``device`` (a ``magic_devices`` document with :data:`FIELDS`) is not lent until its
    back-off ends, or None (none, or it ended by ``now``, epoch seconds)."""
    refusals = int(device.get("maas_refusals") or 0)
    at = device.get("maas_refused_at")
    if refusals < 1 or not isinstance(at, (int, float)):
        return None
    until = at + backoff_seconds(refusals)
    if now >= until:
        return None
    return (f"MAAS refused to bring it up {refusals} time(s) in a row "
            f"({device.get('maas_refused_reason') or 'no reason given'}); not lent for "
            f"{int(until - now)}s more")


def count(db, device: str, reason: str, now: float) -> dict | None:
    """Count one refused bring-up of ``device`` (one atomic update); returns the device
    document as it is now (None if it is not registered)."""
    from testflinger_magic.db import ReturnDocument  # noqa: PLC0415

    return db.magic_devices.find_one_and_update(
        {"_id": device},
        {"$inc": {"maas_refusals": 1},
         "$set": {"maas_refused_at": now, "maas_refused_reason": reason[:300]}},
        {f: 1 for f in FIELDS}, return_document=ReturnDocument.AFTER)


def clear(db, device: str) -> None:
    """Forget the refusals of ``device`` (its deploy went through, or an operator looked);
    writes only when there are some."""
    db.magic_devices.update_one({"_id": device, "maas_refusals": {"$exists": True}},
                                {"$unset": dict.fromkeys(FIELDS, "")})
