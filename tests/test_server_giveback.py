"""Verified give-back, server side (issue 7 item 10): a returned device's agent must post its
state within the bound, else the device is quarantined and the lease's queue is told."""

from __future__ import annotations

from datetime import datetime, timezone

import mongomock

from testflinger_magic.events import EventLog
from testflinger_magic.server.giveback import GiveBackWatch, verdicts

NOW = 1_000_000.0


def lease(id, device, returned_at, state="returned", restoring_at=None):
    restoring_at = returned_at - 30 if restoring_at is None else restoring_at
    return {"_id": id, "device": device, "queue": "one-gpu-vm", "state": state,
            "updated_at": returned_at,
            "history": [{"state": "claimed", "at": returned_at - 3600},
                        {"state": "restoring", "at": restoring_at},
                        {"state": state, "at": returned_at}]}


def test_verdicts_wait_for_the_agent_or_the_bound():
    leases = [lease("l1", "d1", NOW - 100), lease("l2", "d2", NOW - 700),
              lease("l3", "d3", NOW - 100)]
    agents = {"d1": {"updated_at": datetime.fromtimestamp(NOW - 50, timezone.utc)},
              "d2": {"updated_at": NOW - 800},  # before the return: not a sign of life
              "d3": {}}
    verified, overdue = verdicts(leases, agents, NOW, 600)
    assert [l["_id"] for l in verified] == ["l1"]
    assert [l["_id"] for l in overdue] == ["l2"]  # l3 still has time
    # The restore starts the agent and reports the return after: a startup post between the
    # two (after restoring began) is the agent's sign of life.
    early = [lease("l4", "d4", NOW - 5, restoring_at=NOW - 20)]
    verified, _ = verdicts(early, {"d4": {"updated_at": NOW - 8}}, NOW, 600)
    assert [l["_id"] for l in verified] == ["l4"]
    # ...but a post from before the restore began (the agent was stopped since fenced) is not.
    verified, _ = verdicts(early, {"d4": {"updated_at": NOW - 25}}, NOW, 600)
    assert verified == []


def test_watch_quarantines_once_and_tells_the_queue():
    db = mongomock.MongoClient().db
    events = EventLog(db, clock=lambda: NOW)
    quarantined = []
    watch = GiveBackWatch(db, events, lambda d, on, reason, queue=None:
                          quarantined.append((d, on, queue, reason)), lambda: NOW, bound=600)
    watch.ensure_indexes()
    db.magic_leases.insert_many([lease("l1", "d1", NOW - 100), lease("l2", "d2", NOW - 700),
                                 lease("old", "d9", NOW - 99999),
                                 lease("open", "d3", NOW - 900, state="active")])
    db.agents.insert_many([{"name": "d1", "updated_at": datetime.fromtimestamp(NOW - 10,
                                                                             timezone.utc)},
                           {"name": "d2", "updated_at": datetime.fromtimestamp(NOW - 800,
                                                                             timezone.utc)}])
    assert watch.check() == {"verified": ["l1"], "overdue": ["l2"]}
    assert [(d, on, q) for d, on, q, _ in quarantined] == [("d2", True, "one-gpu-vm")]
    assert "not seen" in quarantined[0][3] and "l2" in quarantined[0][3]
    event = db.magic_events.find_one({"kind": "device.giveback_failed"})
    assert event["device"] == "d2" and event["queue"] == "one-gpu-vm"
    assert db.magic_leases.find_one({"_id": "l2"})["giveback"]["state"] == "overdue"
    # judged once: a second pass (another replica) records nothing again
    assert watch.check() == {"verified": [], "overdue": []}
    assert len(quarantined) == 1
    assert "giveback" not in db.magic_leases.find_one({"_id": "old"})
