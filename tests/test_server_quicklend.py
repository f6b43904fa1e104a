"""Submit -> lease claimed without a full tick (server/quicklend.py), and the tick's shared reads
(tickreads.py) and jobs read (server/jobreads.py) saying what the per-query code said."""

from __future__ import annotations

import threading
from datetime import datetime, timezone

from conftest import MagicStack
from test_server_api import DEVICES, register, submit
from test_server_flow import wait_until
from testflinger_magic import db as tfdb
from testflinger_magic.lab import dbcount
from testflinger_magic.server.jobreads import JobReads, LatestJobs


def waiting_job(queue: str, created: datetime | float | None = None, state: str = "waiting") -> dict:
    """A job document as POST /v1/job stores it."""
    import uuid

    return {"job_id": str(uuid.uuid4()), "job_priority": 0,
            "created_at": created or datetime.now(timezone.utc),
            "job_data": {"job_queue": queue}, "result_data": {"job_state": state}}


def join_kicks() -> None:
    """Wait for the background ticks registering or submitting kicked (no ticker runs)."""
    for thread in threading.enumerate():
        if thread.name == "magic-kick":
            thread.join(30)


def open_leases(db) -> list[dict]:
    return list(db.magic_leases.find({"state": {"$nin": ["returned", "failed"]}}))


def test_a_submission_is_lent_by_the_quick_lend_without_a_gather(magic):
    """POST /v1/job to an empty magic queue: the hook's quick lend claims a device on the last
    tick's snapshot; no tick and no full gather run (both are replaced by spies here)."""
    assert register(magic, devices=DEVICES[:1]).status_code == 200
    join_kicks()
    magic.plugin.tick()  # the snapshot a quick lend plans on
    engine = magic.plugin.engine
    gathers, ticks = [], []
    real_gather = engine.gather
    engine.gather = lambda *a, **k: (gathers.append(1), real_gather(*a, **k))[1]
    magic.plugin.tick = lambda *a, **k: ticks.append(1) or []
    submit(magic, "one-gpu-vm")
    wait_until(lambda: len(open_leases(magic.db)) == 1, "lease claimed by the quick lend")
    (lease,) = open_leases(magic.db)
    assert (lease["device"], lease["queue"], lease["state"]) == ("gpu-host-01", "one-gpu-vm",
                                                                 "claimed")
    wait_until(lambda: ticks, "the kicked tick after the quick lend")
    assert gathers == []  # the quick lend did not gather; the tick that follows is a spy
    del engine.gather
    del magic.plugin.tick
    assert magic.plugin.tick() == []  # a full tick then lends nothing more


def test_the_quick_lend_lends_what_a_tick_would(magic):
    """Same decisions: on the same database the quick lend applies exactly the lends a tick's
    plan lists for that queue (max_starting 1 of two lendable devices: one)."""
    from testflinger_magic import reconcile as R

    assert register(magic).status_code == 200
    join_kicks()
    magic.plugin.tick()
    magic.db.jobs.insert_many([waiting_job("one-gpu-vm") for _ in range(3)])
    expected = [(a.device, a.queue) for a in R.plan(magic.plugin.engine.gather(read_only=True))
                if a.kind == "lend"]
    got = magic.plugin.engine.lend_now(["one-gpu-vm"], max_age=60)
    assert expected and [(a.device, a.queue) for a in got] == expected
    assert [x["device"] for x in open_leases(magic.db)] == [d for d, _ in expected]


def test_no_quick_lend_without_a_recent_snapshot(magic):
    """No tick yet (or a snapshot older than max_age): the quick lend declines (None) and the
    kicked tick lends."""
    assert register(magic, devices=DEVICES[:1]).status_code == 200
    join_kicks()
    engine = magic.plugin.engine
    engine._snapshot = None
    magic.db.jobs.insert_one(waiting_job("one-gpu-vm"))
    assert engine.lend_now(["one-gpu-vm"], max_age=60) is None
    magic.plugin.tick()
    assert engine.lend_now(["one-gpu-vm"], max_age=0.0) is None
    assert len(open_leases(magic.db)) == 1  # the tick lent


def test_two_replicas_racing_quick_lends_claim_one_device_once(mongo, serve):
    """Two replicas on one database, each with its snapshot, quick-lend for the same submission
    at the same moment: one lease, its device claimed once."""
    stacks = [MagicStack(mongo, serve) for _ in range(2)]
    try:
        assert register(stacks[0], devices=DEVICES[:1]).status_code == 200
        join_kicks()
        for s in stacks:
            s.plugin.tick()
        assert open_leases(mongo) == []
        mongo.jobs.insert_one(waiting_job("one-gpu-vm"))
        start, out = threading.Barrier(2), []

        def lend(stack):
            start.wait()
            out.append(stack.plugin.engine.lend_now(["one-gpu-vm"], max_age=60))

        threads = [threading.Thread(target=lend, args=(s,)) for s in stacks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(len(x) for x in out) == [0, 1]  # one won; the other lent nothing
        (lease,) = open_leases(mongo)
        assert mongo.magic_device_claims.count_documents({}) == 1
        assert mongo.magic_device_claims.find_one({"_id": "gpu-host-01"})["lease_id"] == lease["_id"]
    finally:
        for s in stacks:
            s.plugin.stop()


def test_a_tick_does_not_lend_again_for_a_queue_quick_lent_during_its_gather(magic):
    """A quick lend lands while a tick gathers: the tick's plan did not count it, so its lend
    for that queue is skipped (no second lend, no refused claim); the next tick plans again."""
    assert register(magic).status_code == 200
    join_kicks()
    engine = magic.plugin.engine
    magic.plugin.tick()
    magic.db.jobs.insert_one(waiting_job("one-gpu-vm"))
    real_gather = engine.gather

    def gather(*a, **k):
        inputs = real_gather(*a, **k)
        assert len(engine.lend_now(["one-gpu-vm"], max_age=60)) == 1
        return inputs

    engine.gather = gather
    assert [a.kind for a in engine.tick()] == []
    del engine.gather
    assert len(open_leases(magic.db)) == 1
    assert magic.db.magic_events.count_documents({"kind": "claim.refused"}) == 0


def test_a_device_returned_since_the_snapshot_is_not_quick_lent(magic):
    """A lease that closed after the snapshot: its device's agent may not have posted since
    (Snapshot._returning; the snapshot cannot tell), so the quick lend leaves the device to the
    next tick, which lends it once it sees the post."""
    from testflinger_magic import leases as L

    assert register(magic, devices=DEVICES[:1]).status_code == 200
    join_kicks()
    magic.db.jobs.insert_one(waiting_job("one-gpu-vm"))
    magic.plugin.tick()
    (lease,) = open_leases(magic.db)
    store = magic.plugin.store
    lease = store.transition(lease["_id"], L.CLAIMED, lease["generation"], L.RESTORING, "test")
    # The restore started the device agent, which posted its state (TESTFLINGER.md §3.2) a
    # second later (a stored datetime keeps milliseconds only).
    posted = datetime.fromtimestamp(magic.plugin.clock() + 1, timezone.utc)
    magic.db.agents.update_one({"name": "gpu-host-01"}, {"$set": {
        "state": "waiting", "comment": "", "job_id": "", "updated_at": posted}})
    magic.plugin.tick()  # the snapshot: the lease still holds the device, its agent waiting
    store.close(lease["_id"], lease["generation"], L.RETURNED, "test")
    assert magic.plugin.engine.lend_now(["one-gpu-vm"], max_age=60) == []
    assert open_leases(magic.db) == []
    assert [a.kind for a in magic.plugin.tick()] == ["lend"]  # the tick saw the post


def test_latest_job_kept_between_reads_equals_the_aggregate():
    """LatestJobs raises each magic queue's latest job with the jobs inserted since its last read
    (by ``_id``), whatever their ``created_at`` says: the same values as the full aggregate, and
    the aggregate runs once."""
    db = dbcount.Counting(tfdb.connect())
    reads = JobReads(db)
    db.jobs.insert_one(waiting_job("q1", 1000.0, "complete"))
    facts = reads.read(5000.0, ["q1", "q2"], [], [], [])
    assert (facts.demand["q1"].last_job_at, facts.demand["q2"].last_job_at) == (1000.0, None)
    db.jobs.insert_many([waiting_job("q1", 500.0, "complete"),   # back-dated: not the latest
                         waiting_job("q2", 2000.0, "cancelled"),
                         waiting_job("q1", datetime.fromtimestamp(3000.0, timezone.utc), "complete"),
                         waiting_job("q3", 4000.0)])  # not a magic queue
    db.on = True
    facts = reads.read(5000.0, ["q1", "q2"], [], [], [])
    db.on = False
    assert (facts.demand["q1"].last_job_at, facts.demand["q2"].last_job_at) == (3000.0, 2000.0)
    assert "q3" not in facts.demand
    assert dict(db.ops) == {("jobs", "find"): 1}  # no second aggregate
    fresh = JobReads(db).read(5000.0, ["q1", "q2"], [], [], [])
    assert fresh.demand == facts.demand


def test_latest_job_read_in_full_again_when_due_or_a_queue_appears():
    """The aggregate runs again after ``refresh`` seconds and for a new magic queue."""
    db = dbcount.Counting(tfdb.connect())
    clock = [0.0]
    latest = LatestJobs(db, refresh=600.0, monotonic=lambda: clock[0])
    reads = JobReads(db, latest)
    db.jobs.insert_one(waiting_job("q1", 1000.0, "complete"))
    db.on = True
    reads.read(5000.0, ["q1"], [], [], [])
    reads.read(5000.0, ["q1"], [], [], [])
    assert db.ops[("jobs", "aggregate")] == 1
    reads.read(5000.0, ["q1", "q2"], [], [], [])
    assert db.ops[("jobs", "aggregate")] == 2
    clock[0] = 601.0
    reads.read(5000.0, ["q1", "q2"], [], [], [])
    assert db.ops[("jobs", "aggregate")] == 3


def test_a_fence_after_the_ticks_shared_read_is_no_gate_repair(magic):
    """The tick reads the fences once, early (tickreads.TickReads); a claim or drain that fences
    an agent (and syncs its gate) after that read is not a disagreement to repair: the gate
    repair looks again before it reports (no ``lease.repaired``). A real disagreement (a fence
    whose gate sync never ran) still is one."""
    from testflinger_magic.tickreads import TickReads

    assert register(magic, devices=DEVICES[:1]).status_code == 200
    join_kicks()
    store = magic.plugin.store
    reads = TickReads(magic.db)
    reads.fences()  # the tick's read, before the fence
    store.fence_agents("lease-x", ["gpu-host-01-vm9"], reason="a claim elsewhere")
    assert store.repair_gates(reads) == []
    # A fence written without its gate sync (a crash between the two writes) is repaired.
    magic.db.magic_fences.insert_one({"_id": "gpu-host-01-vm8", "lease_id": "lease-y",
                                      "kind": "vm", "reason": "crash", "since": 0.0})
    assert store.repair_gates(TickReads(magic.db)) == ["gpu-host-01-vm8"]
    assert magic.db.magic_agent_gate.find_one({"_id": "gpu-host-01-vm8"})["fenced"] is True


def test_a_lease_claimed_since_the_snapshot_counts(magic):
    """A lend after the snapshot (an operator's, or another replica's) is read again by the
    quick lend (leases written since the snapshot): max_starting 1 is reached, so no lend, as
    a tick would decide."""
    from testflinger_magic import reconcile as R

    assert register(magic).status_code == 200
    join_kicks()
    magic.plugin.tick()  # the snapshot: nothing lent
    magic.plugin.engine.lend_by_hand("gpu-host-01", "one-gpu-vm", "an operator")
    magic.db.jobs.insert_many([waiting_job("one-gpu-vm") for _ in range(5)])
    assert [a for a in R.plan(magic.plugin.engine.gather(read_only=True))
            if a.kind == "lend"] == []
    assert magic.plugin.engine.lend_now(["one-gpu-vm"], max_age=60) == []
    assert [x["device"] for x in open_leases(magic.db)] == ["gpu-host-01"]
    # Not planned at all (a plan on the snapshot alone would lend gpu-host-01, refused).
    assert magic.db.magic_events.count_documents({"kind": "claim.refused"}) == 0


def test_a_lease_that_became_active_since_the_snapshot_is_seen_so(magic):
    """A lease in bring-up at the snapshot (max_starting 1 reached) that became active since:
    the quick lend reads it again and lends the second device, exactly what a tick's plan
    lends now."""
    from testflinger_magic import leases as L
    from testflinger_magic import reconcile as R

    assert register(magic).status_code == 200
    join_kicks()
    magic.db.jobs.insert_one(waiting_job("one-gpu-vm"))
    magic.plugin.tick()
    (lease,) = open_leases(magic.db)
    magic.plugin.tick()  # the snapshot: the lease is starting
    store = magic.plugin.store
    for to_state in (L.FENCED, L.DEPLOYING, L.SPLITTING, L.ENROLLING, L.ACTIVE):
        lease = store.transition(lease["_id"], lease["state"], lease["generation"], to_state,
                                 "test")
    # Read with the flat vm_names and active_since; a lease written before those fields
    # existed is read for vms and history instead, to the same view (tickreads.with_vms).
    engine = magic.plugin.engine
    cached, _, read_at = engine._snapshot
    new = engine._leases_now(R, cached, read_at)[lease["_id"]]
    assert new.vm_names and new.active_since == lease["active_since"]
    magic.db.magic_leases.update_one({"_id": lease["_id"]},
                                     {"$unset": {"vm_names": "", "active_since": ""}})
    assert engine._leases_now(R, cached, read_at)[lease["_id"]] == new
    magic.db.jobs.insert_many([waiting_job("one-gpu-vm") for _ in range(4)])
    expected = [(a.device, a.queue) for a in R.plan(magic.plugin.engine.gather(read_only=True))
                if a.kind == "lend"]
    got = magic.plugin.engine.lend_now(["one-gpu-vm"], max_age=60)
    assert expected == [("gpu-host-02", "one-gpu-vm")]
    assert [(a.device, a.queue) for a in got] == expected


def test_a_tick_does_not_lend_again_for_a_queue_quick_lent_during_its_repairs(magic):
    """The repairs read the open leases the gather then uses (tickreads.TickReads): a quick
    lend after that read, still before the gather, was not counted by the tick's plan either,
    so the tick skips its lend for that queue (no second device lent for one submission)."""
    assert register(magic).status_code == 200
    join_kicks()
    engine = magic.plugin.engine
    magic.plugin.tick()
    magic.db.jobs.insert_one(waiting_job("one-gpu-vm"))
    real_repair = engine.repair

    def repair(reads=None):
        real_repair(reads)
        assert reads.open_leases() == []  # read by the repairs, before the quick lend
        assert len(engine.lend_now(["one-gpu-vm"], max_age=60)) == 1

    engine.repair = repair
    assert [a.kind for a in engine.tick()] == []
    del engine.repair
    assert len(open_leases(magic.db)) == 1
    # Skipped, not tried and refused by the claim (which a second free device would not be).
    assert magic.db.magic_events.count_documents({"kind": "claim.refused"}) == 0
