"""A device's quarantine outlives its registration (TRIAL18 F6).

Deregistering a device deletes its ``magic_devices`` document (``agent-hosts forget HOST``, or
its agent host registering again without it: server/bindings.py, server/hostproto.py). Its
quarantine went with it, and its failure count: registered again (the host reinstalled, the
device moved to another host), a machine quarantined for a fault, or after an abandoned lease
whose VMs were not yet removed from MAAS, was lendable at once, with no event saying so,
though only ``unquarantine`` lifts a quarantine.

So a quarantined device's quarantine is kept when its document is deleted, in
``magic_kept_quarantines`` (``{_id: device, reason, lease_id, failures, host, kept_at}``,
epoch seconds), and a registration that creates the device's document again takes it back
(quarantined, same reason and failures) with an event ``device.quarantine_kept``. The record
is dropped then. Reads: one ``$in`` read per registration that creates documents; none for a
device already registered.
"""

from __future__ import annotations

from datetime import datetime, timezone


def _coll(db):
    return db.magic_kept_quarantines


def keep(db, docs: list[dict], now: float) -> list[str]:
    """Keep the quarantine of those of ``docs`` (deleted ``magic_devices`` documents) that
    were quarantined (an upsert per device: idempotent). Returns their names."""
    kept = []
    for doc in docs:
        if not doc.get("quarantined"):
            continue
        _coll(db).replace_one({"_id": doc["_id"]}, {
            "_id": doc["_id"], "reason": doc.get("quarantine_reason"),
            "lease_id": doc.get("quarantine_lease"), "failures": int(doc.get("failures") or 0),
            "host": doc.get("agent_host"), "kept_at": now}, upsert=True)
        kept.append(doc["_id"])
    return kept


def taken_back(db, names: list[str]) -> dict[str, dict]:
    """``{device: kept record}`` of ``names`` (devices whose documents a registration is about
    to create): one read, none for no names."""
    if not names:
        return {}
    return {r["_id"]: r for r in _coll(db).find({"_id": {"$in": sorted(names)}})}


def fields(record: dict) -> dict:
    """The ``magic_devices`` fields a new document takes from a kept ``record``."""
    return {"quarantined": True, "quarantine_reason": record.get("reason"),
            "quarantine_lease": record.get("lease_id"),
            "failures": int(record.get("failures") or 0)}


def done(db, name: str, record: dict, host: str, events) -> None:
    """The device's new document holds the kept quarantine: drop the record (compare-and-set
    on the record read) and say so (event ``device.quarantine_kept``)."""
    _coll(db).delete_one({"_id": name, "kept_at": record.get("kept_at")})
    at = record.get("kept_at")
    when = (datetime.fromtimestamp(float(at), timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
            if isinstance(at, (int, float)) else "an unknown time")
    events.record("device.quarantine_kept",
                  f"{name} registered by agent host {host} is still quarantined "
                  f"({record.get('reason') or 'no reason given'}; kept when it was deregistered "
                  f"from {record.get('host') or 'its agent host'} at {when}): "
                  "testflinger-magic unquarantine it once a person has looked",
                  device=name, data={"host": host, "reason": record.get("reason")})
