"""A device's quarantine outlives its registration (TRIAL18 F6).

Deregistering a device deletes its ``magic_devices`` document (``agent-hosts forget HOST``, or
its agent host registering again without it: server/bindings.py, server/hostproto.py). Its
quarantine went with it, and its failure count: registered again (the host reinstalled, the
device moved to another host), a machine quarantined for a fault, or after an abandoned lease
whose VMs were not yet removed from MAAS, was lendable at once, with no event saying so,
though only ``unquarantine`` lifts a quarantine.

So a quarantined device's quarantine is kept when its document is deleted, in
``magic_kept_quarantines`` (``{_id: device, maas_system_id, reason, lease_id, failures, host,
kept_at}``, epoch seconds), and a registration that creates a device document again takes it
back (quarantined, same reason and failures) with an event ``device.quarantine_kept``, whether
the device comes back under its agent name or as the same MAAS machine under another name (a
machine is what is faulty; TRIAL19 F2). The record is dropped then, or by ``unquarantine`` of
the name while it is not registered (:func:`lift`). ``status`` lists the records
(``kept_quarantines``). Reads: one read per registration that creates documents; none for a
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
            "_id": doc["_id"], "maas_system_id": doc.get("maas_system_id"),
            "reason": doc.get("quarantine_reason"),
            "lease_id": doc.get("quarantine_lease"), "failures": int(doc.get("failures") or 0),
            "host": doc.get("agent_host"), "kept_at": now}, upsert=True)
        kept.append(doc["_id"])
    return kept


def taken_back(db, devices: list[dict]) -> dict[str, dict]:
    """``{agent name: kept record}`` of ``devices`` (registration entries, ``agent_name`` and
    ``maas_system_id``, whose documents a registration is about to create): a record kept
    under the agent name, or under another name for the same MAAS machine. One read, none for
    no devices."""
    if not devices:
        return {}
    names = sorted(d["agent_name"] for d in devices)
    sids = sorted({d["maas_system_id"] for d in devices if d.get("maas_system_id")})
    records = list(_coll(db).find({"$or": [{"_id": {"$in": names}},
                                           {"maas_system_id": {"$in": sids}}]}))
    by_name = {r["_id"]: r for r in records}
    by_sid = {r.get("maas_system_id"): r for r in records if r.get("maas_system_id")}
    out = {}
    for d in devices:
        record = by_name.get(d["agent_name"]) or by_sid.get(d.get("maas_system_id"))
        if record is not None:
            out[d["agent_name"]] = record
    return out


def lift(db, name: str) -> dict | None:
    """Drop the kept quarantine of ``name`` (an agent name not registered now): the operator's
    ``unquarantine`` once a person has looked. Returns the record dropped, or None."""
    return _coll(db).find_one_and_delete({"_id": name})


def listed(db) -> list[dict]:
    """Every kept quarantine (``status``'s ``kept_quarantines``), by device name."""
    return list(_coll(db).find({}, sort=[("_id", 1)]))


def fields(record: dict) -> dict:
    """The ``magic_devices`` fields a new document takes from a kept ``record``."""
    return {"quarantined": True, "quarantine_reason": record.get("reason"),
            "quarantine_lease": record.get("lease_id"),
            "failures": int(record.get("failures") or 0)}


def done(db, name: str, record: dict, host: str, events) -> None:
    """The device's new document holds the kept quarantine: drop the record (compare-and-set
    on the record read) and say so (event ``device.quarantine_kept``)."""
    _coll(db).delete_one({"_id": record["_id"], "kept_at": record.get("kept_at")})
    at = record.get("kept_at")
    when = (datetime.fromtimestamp(float(at), timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
            if isinstance(at, (int, float)) else "an unknown time")
    was = "" if record["_id"] == name else \
        f" (MAAS machine {record.get('maas_system_id')}, quarantined as {record['_id']})"
    events.record("device.quarantine_kept",
                  f"{name}{was} registered by agent host {host} is still quarantined "
                  f"({record.get('reason') or 'no reason given'}; kept when it was deregistered "
                  f"from {record.get('host') or 'its agent host'} at {when}): "
                  "testflinger-magic unquarantine it once a person has looked",
                  device=name, data={"host": host, "reason": record.get("reason")})
