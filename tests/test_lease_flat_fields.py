"""A lease's ``vm_names`` and ``active_since``: the flat copies of what every tick reads of its
``vms`` and ``history`` (tickreads.OPEN_LEASE_FIELDS), and leases written before they existed
(an older version, or an older replica in a rolling upgrade), which the tick and the quick
lend read for ``vms`` and ``history`` instead (tickreads.with_vms)."""

from __future__ import annotations

import random

import pytest

from test_leases import Clock, agent_doc, make_queue
from test_server_scale import _bench
from testflinger_magic import db as dbmod
from testflinger_magic import leases as L


@pytest.fixture(scope="module")
def lab():
    """100 devices / 5 queues filled through the real code (benchmarks/reconcile_scale.py):
    open leases in every state, VM agents busy and idle."""
    lab = _bench().Lab(100, 5)
    assert lab.settle() < 30
    assert lab.plugin.notifier.flush(30)
    return lab


def _store():
    """A lease store on a fresh database with one idle 4-GPU device, gpu-1."""
    db, clock = dbmod.connect(), Clock()
    store = L.LeaseStore(db, clock, rng=random.Random(7))
    store.ensure_indexes()
    db.agents.insert_one(agent_doc("gpu-1"))
    db.magic_devices.insert_one({"_id": "gpu-1", "agent_host": "h1", "gpus": 4, "failures": 0})
    return db, clock, store


def test_a_claim_writes_vm_names_and_the_first_move_to_active_writes_active_since():
    db, clock, store = _store()
    lease = store.claim("gpu-1", make_queue(), "h1", 3, "3 waiting jobs")
    stored = db.magic_leases.find_one({"_id": lease["_id"]})
    assert stored["vm_names"] == [vm["agent_name"] for vm in stored["vms"]] == \
        ["gpu-1-vm1", "gpu-1-vm2", "gpu-1-vm3"]
    assert "active_since" not in stored
    for to_state in (L.FENCED, L.DEPLOYING, L.SPLITTING, L.ENROLLING):
        clock.t += 10
        lease = store.transition(lease["_id"], lease["state"], lease["generation"], to_state, "t")
    assert "active_since" not in lease
    clock.t += 10
    became_active = clock.t
    lease = store.transition(lease["_id"], L.ENROLLING, lease["generation"], L.ACTIVE, "t")
    assert lease["active_since"] == became_active == L.first_active(lease)
    # A drain cancelled (draining -> active) keeps the first time, as the history does.
    clock.t += 10
    lease = store.transition(lease["_id"], L.ACTIVE, lease["generation"], L.DRAINING, "t")
    clock.t += 10
    lease = store.transition(lease["_id"], L.DRAINING, lease["generation"], L.ACTIVE, "t")
    assert lease["active_since"] == became_active
    assert [h["at"] for h in lease["history"] if h["state"] == L.ACTIVE][0] == became_active


def test_a_restore_from_bring_up_writes_active_since_null():
    """Never active: ``active_since`` is there, null (a lease without it in a state after
    active is an older server's, read for its history: tickreads.with_vms)."""
    db, clock, store = _store()
    lease = store.claim("gpu-1", make_queue(), "h1", 1, "1 waiting job")
    lease = store.transition(lease["_id"], L.CLAIMED, 0, L.FENCED, "t")
    lease = store.transition(lease["_id"], L.FENCED, lease["generation"], L.RESTORING, "t")
    stored = db.magic_leases.find_one({"_id": lease["_id"]})
    assert "active_since" in stored and stored["active_since"] is None


def test_a_lease_made_active_by_an_older_server_gets_active_since_from_its_history():
    """A lease whose first move to active was written without ``active_since`` (an older
    replica) gets, at its next move to active, the time of that first move, not the new one."""
    db, clock, store = _store()
    lease = store.claim("gpu-1", make_queue(), "h1", 1, "1 waiting job")
    for to_state in (L.FENCED, L.DEPLOYING, L.SPLITTING, L.ENROLLING, L.ACTIVE, L.DRAINING):
        clock.t += 10
        lease = store.transition(lease["_id"], lease["state"], lease["generation"], to_state, "t")
    first = lease["active_since"]
    db.magic_leases.update_one({"_id": lease["_id"]}, {"$unset": {"active_since": ""}})
    clock.t += 10
    lease = store.transition(lease["_id"], L.DRAINING, lease["generation"], L.ACTIVE, "t")
    assert lease["active_since"] == first < clock.t


def _views(inputs):
    return (sorted(inputs.leases, key=lambda v: v.id),
            sorted(inputs.vm_agents, key=lambda v: v.name))


@pytest.mark.parametrize("unset", [("vm_names", "active_since"), ("active_since",)],
                         ids=["written-before-the-fields", "made-active-by-an-older-server"])
def test_the_tick_sees_older_leases_as_it_sees_new_ones(lab, unset):
    """The same leases and VM agents whether the open leases carry the flat fields or not;
    the older ones cost one more read (by ``_id``), the new ones none."""
    db = lab.db
    before = _views(lab.engine.gather(read_only=True))
    active = [v for v in before[0] if v.active_since is not None]
    assert active and before[1], "the lab has active leases and VM agents"
    assert all(v.vm_names for v in before[0])
    db.ops.clear()
    db.on = True
    lab.engine.gather(read_only=True)
    db.on = False
    new_reads = db.ops[("magic_leases", "find")]
    saved = {d["_id"]: d for d in db.magic_leases.find({"state": {"$in": sorted(L.OPEN_STATES)}},
                                                       {"vm_names": 1, "active_since": 1})}
    db.magic_leases.update_many({"_id": {"$in": sorted(saved)}},
                                {"$unset": {field: "" for field in unset}})
    try:
        db.ops.clear()
        db.on = True
        after = _views(lab.engine.gather(read_only=True))
        db.on = False
        assert after == before
        assert db.ops[("magic_leases", "find")] == new_reads + 1
    finally:
        db.on = False
        for lease_id, doc in saved.items():
            db.magic_leases.update_one({"_id": lease_id}, {"$set": {
                k: doc[k] for k in ("vm_names", "active_since") if k in doc}})
    assert _views(lab.engine.gather(read_only=True)) == before
