"""testflinger_magic.fairness: GPU-hours a closed lease borrowed, per queue and home pool."""

from __future__ import annotations

import mongomock
import pytest

from testflinger_magic import fairness as F


def lease(**kw):
    doc = {"_id": "lease-1", "queue": "one-gpu-vm", "device": "gpu-host-01", "created_at": 1000.0,
           "updated_at": 1000.0 + 7200, "history": [{"state": "claimed", "at": 1000.0},
                                                     {"state": "returned", "at": 1000.0 + 3600}],
           "spec": {"gpus_per_vm": 1}, "vms": [{}, {}, {}]}
    doc.update(kw)
    return doc


def test_hours_run_from_claim_to_the_close_entry_times_device_gpus():
    dev = {"gpus": 4, "home_queues": ["gpu-hosts", "ci"]}
    assert F.borrowed(lease(), dev) == ("one-gpu-vm", "ci+gpu-hosts", pytest.approx(4.0))
    # no history: updated_at is the close time
    assert F.borrowed(lease(history=[]), dev)[2] == pytest.approx(8.0)
    # a deregistered device: the GPUs its VMs were planned to use, home pool "-"
    assert F.borrowed(lease(), None) == ("one-gpu-vm", "-", pytest.approx(3.0))


def test_record_accumulates_per_queue_and_pool():
    db = mongomock.MongoClient().db
    db.magic_devices.insert_one({"_id": "gpu-host-01", "gpus": 2, "home_queues": ["gpu-hosts"]})
    F.record(db, lease())
    F.record(db, lease(_id="lease-2", queue="two-gpu-vm"))
    F.record(db, lease(_id="lease-3"))
    assert F.totals(db) == [
        {"queue": "one-gpu-vm", "home_pool": "gpu-hosts", "gpu_hours": 4.0, "leases": 2},
        {"queue": "two-gpu-vm", "home_pool": "gpu-hosts", "gpu_hours": 2.0, "leases": 1}]
