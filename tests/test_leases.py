"""LeaseStore on mongomock with Testflinger-shaped agents/jobs documents (TESTFLINGER.md §1.3)."""

import random
import threading

import pytest

from testflinger_magic import db as dbmod
from testflinger_magic import leases as L
from testflinger_magic.queues import MagicQueue


class Clock:
    def __init__(self, t=1_000_000.0):
        self.t = t

    def __call__(self):
        return self.t


def make_queue(**policy):
    return MagicQueue(name="one-gpu-vm", description="one GPU VM",
                      devices={"home_queues": ["gpu-hosts"]},
                      vm={"gpus": 1, "vcpus": 4, "memory_mib": 8192, "disk_gib": 50},
                      policy={"provision_timeout": 600.0, "max_lease": 3600.0, **policy})


def agent_doc(name, state="waiting", job_id="", comment=""):
    return {"name": name, "state": state, "comment": comment, "queues": ["gpu-hosts"],
            "location": "lab", "provision_type": "maas2", "identifier": "", "job_id": job_id,
            "log": [], "updated_at": None, "provision_streak_type": "pass", "provision_streak_count": 0}


def job_doc(job_id, state="waiting", queue="gpu-hosts"):
    return {"job_id": job_id, "created_at": None, "job_priority": 0,
            "job_data": {"job_queue": queue, "exclude_agents": []},
            "result_data": {"job_state": state}}


@pytest.fixture
def env():
    db = dbmod.connect()
    clock = Clock()
    store = L.LeaseStore(db, clock, rng=random.Random(7))
    store.ensure_indexes()
    db.agents.insert_one(agent_doc("gpu-1"))
    db.magic_devices.insert_one({"_id": "gpu-1", "agent_host": "h1", "gpus": 4, "failures": 0})
    return db, clock, store


def claim(store, vms=4, device="gpu-1", q=None):
    return store.claim(device, q or make_queue(), "h1", vms, "3 waiting jobs")


# ---------------------------------------------------------------- pure table

def test_transition_table_matches_the_contract():
    assert L.STATES == ("claimed", "fenced", "deploying", "splitting", "enrolling", "active",
                        "draining", "restoring", "returned", "failed")
    chain = ["claimed", "fenced", "deploying", "splitting", "enrolling", "active", "draining",
             "restoring", "returned"]
    for a, b in zip(chain, chain[1:]):
        assert L.is_legal(a, b)
    for s in L.BRINGUP_STATES:
        assert L.is_legal(s, "restoring")
    assert L.is_legal("draining", "active") and L.is_legal("restoring", "failed")
    assert not L.is_legal("active", "restoring") and not L.is_legal("claimed", "active")
    assert not L.TRANSITIONS["returned"] and not L.TRANSITIONS["failed"]
    assert L.OPEN_STATES == frozenset(L.STATES) - {"returned", "failed"}
    assert "restoring" in L.DAEMON_STATES and "active" not in L.DAEMON_STATES


def test_deadline_for():
    p = make_queue(reclaim={"grace": 120.0}).policy
    assert L.deadline_for("claimed", p, 100.0) == 700.0
    assert L.deadline_for("splitting", p, 300.0, bringup_deadline=700.0) == 700.0
    assert L.deadline_for("draining", p, 100.0) == 220.0
    assert L.deadline_for("draining", p, 100.0, drain={"grace_until": 150.0}) == 150.0
    assert L.deadline_for("active", p, 500.0, created_at=100.0) == 3700.0
    assert L.deadline_for("active", make_queue(max_lease=0).policy, 500.0) is None
    assert L.deadline_for("restoring", p, 100.0) == 100.0 + L.RESTORE_TIMEOUT
    assert L.deadline_for("returned", p, 100.0) is None


# ---------------------------------------------------------------- claim

def test_claim_creates_lease_fence_and_marks_agent_offline(env):
    db, clock, store = env
    lease = claim(store)
    lid = lease["_id"]
    assert lid.startswith("lease-") and len(lid) == len("lease-") + 12
    assert lease["state"] == "claimed" and lease["generation"] == 0
    assert lease["deadline"] == clock.t + 600.0
    assert [v["name"] for v in lease["vms"]] == [f"gpu-1-vm{i}" for i in range(1, 5)]
    assert [v["index"] for v in lease["vms"]] == [0, 1, 2, 3]
    macs = [v["mac"] for v in lease["vms"]]
    assert len(set(macs)) == 4 and all(m.startswith("52:54:00:") for m in macs)
    assert {r["_id"] for r in db.magic_resources.find({"lease_id": lid})} == {f"mac:{m}" for m in macs}
    assert lease["vms"][0]["disk"] == f"/var/lib/libvirt/images/{lid}-gpu-1-vm1.qcow2"
    assert lease["spec"] == {"vcpus": 4, "memory_mib": 8192, "disk_gib": 50, "gpus_per_vm": 1,
                             "firmware": "uefi", "mmio64_mib": None,
                             "series": "jammy", "template": "maas2-vm", "provision_type": "maas2"}
    assert store.get(lid) == lease
    assert db.magic_device_claims.find_one({"_id": "gpu-1"})["lease_id"] == lid
    assert store.is_fenced("gpu-1") and store.gates.admit("gpu-1") == ("fenced", True)
    agent = db.agents.find_one({"name": "gpu-1"})
    # maintenance, not offline: testflinger-cli's pre-submit check still sees the home queue
    # (TESTFLINGER.md §4.2; leases.LENT_AGENT_STATE).
    assert agent["state"] == "maintenance" and agent["comment"] == f"lent to magic queue one-gpu-vm (lease {lid})"
    assert set(agent) == set(agent_doc("gpu-1")) | {"_id"}  # no document shape change
    assert db.magic_devices.find_one({"_id": "gpu-1"})["last_lent_at"] == clock.t
    assert store.open_lease_for_device("gpu-1")["_id"] == lid
    assert [e["kind"] for e in store.events.list()] == ["lease.claimed"]
    assert "lent gpu-1 (4 VMs), lease" in store.events.list()[0]["message"]


def test_the_claim_event_says_when_vms_per_device_was_capped(env):
    """Trial finding 14: an integer vms_per_device above what the GPUs feed is capped; the
    lease.claimed event says so beside the VM count used."""
    db, clock, store = env
    q = MagicQueue.model_validate(dict(make_queue().model_dump(), vms_per_device=16))
    claim(store, vms=q.vms_for(4), q=q)
    (event,) = store.events.list()
    assert "lent gpu-1 (4 VMs, vms_per_device 16 capped by the device's GPUs), lease" \
        in event["message"]


def assert_nothing_left(db, store, agent_state="waiting", agent_comment=""):
    assert db.magic_leases.count_documents({}) == 0
    assert db.magic_device_claims.count_documents({}) == 0
    assert db.magic_fences.count_documents({}) == 0
    assert db.magic_resources.count_documents({}) == 0
    agent = db.agents.find_one({"name": "gpu-1"})
    assert (agent["state"], agent["comment"]) == (agent_state, agent_comment)


@pytest.mark.parametrize("state,job_id", [("provision", "j1"), ("waiting", "j1"), ("offline", "")])
def test_claim_refused_when_agent_doc_busy(env, state, job_id):
    db, clock, store = env
    db.agents.update_one({"name": "gpu-1"}, {"$set": {"state": state, "job_id": job_id}})
    with pytest.raises(L.ClaimRefused):
        claim(store)
    assert_nothing_left(db, store, state)
    assert store.events.list()[-1]["kind"] == "claim.refused"


def test_claim_undone_when_a_dispatched_job_still_runs(env):
    db, clock, store = env
    db.jobs.insert_one(job_doc("j-run", "running"))
    store.gates.sync(["gpu-1"])  # watched
    assert poll(store, db, "gpu-1", "j-run", pop=False) == "j-run"
    db.agents.update_one({"name": "gpu-1"}, {"$set": {"comment": "before"}})
    with pytest.raises(L.ClaimRefused, match="slipped in: job j-run is running"):
        claim(store)
    assert_nothing_left(db, store, "waiting", "before")
    assert db.jobs.find_one({"job_id": "j-run"})["result_data"]["job_state"] == "running"
    # Once the job is terminal the device can be lent, and the stale marker is pruned.
    db.jobs.update_one({"job_id": "j-run"}, {"$set": {"result_data.job_state": "complete"}})
    assert claim(store)["state"] == "claimed"
    assert db.magic_dispatch.count_documents({}) == 0


def test_claim_undone_on_legacy_inflight_poll_but_not_on_abandoned_marker(env):
    """A ``pending`` marker left by a server of the previous version during an upgrade."""
    db, clock, store = env
    db.magic_dispatch.insert_one({"_id": "m", "agent": "gpu-1", "phase": "pending",
                                  "job_id": None, "queue": None, "at": clock.t})
    with pytest.raises(L.ClaimRefused, match="in flight"):
        claim(store)
    assert_nothing_left(db, store)
    clock.t += L.DISPATCH_PENDING_TTL + 1  # the request crashed between its hooks
    assert claim(store)["state"] == "claimed"


def started(db, job_id, seconds_ago, clock):
    from datetime import datetime, timezone

    at = datetime.fromtimestamp(clock.t - seconds_ago, timezone.utc)
    db.jobs.update_one({"job_id": job_id}, {"$set": {"started_at": at}})


def test_claim_waits_for_a_job_an_unwatched_poll_just_handed_out(env):
    """A poll that read no gate (the device was registered a moment ago) writes no marker; an
    older agent posts its job_id only after receiving the job. A job of a queue the device
    polls, popped that recently and claimed by no agent, may be the device's: no lend yet."""
    db, clock, store = env
    db.jobs.insert_one(job_doc("j-new", "running"))
    assert poll(store, db, "gpu-1", "j-new", pop=False) == "j-new"  # no gate: not watched
    assert db.magic_dispatch.count_documents({}) == 0
    with pytest.raises(L.ClaimRefused, match="no agent has claimed them"):
        claim(store)
    assert_nothing_left(db, store)
    # Another agent posts it as its job: not this device's.
    db.agents.insert_one(agent_doc("other", state="setup", job_id="j-new"))
    assert claim(store)["state"] == "claimed"


def test_a_job_the_device_itself_reports_during_the_claim_is_its_own(env):
    """The claim's unattributed-job read runs after its busy check: a job the device's own
    agent posts in between is the device's (refuse), while another agent's post claims it."""
    db, clock, store = env
    db.jobs.insert_one(job_doc("j-new", "setup"))
    started(db, "j-new", 2, clock)
    db.agents.insert_one(agent_doc("other", job_id="j-new"))
    assert store.gates.unattributed_jobs("gpu-1", ["gpu-hosts"]) == []
    db.agents.update_one({"name": "other"}, {"$set": {"job_id": ""}})
    db.agents.update_one({"name": "gpu-1"}, {"$set": {"job_id": "j-new"}})
    assert store.gates.unattributed_jobs("gpu-1", ["gpu-hosts"]) == ["j-new"]


def test_claim_ignores_older_unattributed_jobs_and_other_queues(env):
    db, clock, store = env
    db.jobs.insert_one(job_doc("j-old", "running"))
    started(db, "j-old", L.DISPATCH_PENDING_TTL + 5, clock)
    db.jobs.insert_one(job_doc("j-else", "running", queue="elsewhere"))
    assert claim(store)["state"] == "claimed"


def test_claim_refused_for_a_job_the_server_attributes_to_the_device(env):
    """testflinger#1253: the server records ``result_data.agent_id`` at pop; a newer agent
    never posts job_id, so the agents document alone would look idle."""
    db, clock, store = env
    db.jobs.insert_one(dict(job_doc("j-a", "provision"), result_data={
        "job_state": "provision", "agent_id": "gpu-1"}))
    started(db, "j-a", 3600, clock)
    with pytest.raises(L.ClaimRefused, match="j-a is assigned to it"):
        claim(store)
    assert_nothing_left(db, store)


def test_claim_refused_for_unknown_agent_and_second_claim(env):
    db, clock, store = env
    with pytest.raises(L.ClaimRefused, match="not registered"):
        claim(store, device="ghost")
    # Registered, but its agent never posted: the agents document CAS matches nothing.
    db.magic_devices.insert_one({"_id": "ghost", "agent_host": "h1", "gpus": 4, "failures": 0})
    with pytest.raises(L.ClaimRefused, match="no Testflinger agents document"):
        claim(store, device="ghost")
    assert db.magic_leases.count_documents({}) == 0
    assert db.magic_device_claims.count_documents({}) == 0
    assert db.magic_fences.count_documents({}) == 0
    claim(store)
    db.agents.update_one({"name": "gpu-1"}, {"$set": {"state": "waiting"}})  # agent restarted
    with pytest.raises(L.ClaimRefused, match="already lent"):
        claim(store)
    assert db.magic_leases.count_documents({}) == 1


def test_undo_keeps_agent_doc_if_someone_else_changed_it(env):
    db, clock, store = env
    original = store.claim_checks

    def busy_after_operator_edit(agent, queues):
        db.agents.update_one({"name": agent}, {"$set": {"state": "maintenance", "comment": "operator"}})
        return "a job request is in flight", []

    store.claim_checks = busy_after_operator_edit
    with pytest.raises(L.ClaimRefused):
        claim(store)
    store.claim_checks = original
    assert_nothing_left(db, store, "maintenance", "operator")


def test_one_open_lease_per_device_with_eight_threads(env):
    db, clock, store = env
    results, barrier = [], threading.Barrier(8)

    def worker():
        barrier.wait()
        try:
            results.append(claim(store)["_id"])
        except L.ClaimRefused as exc:
            results.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [r for r in results if isinstance(r, str)]
    assert len(won) == 1 and len(results) == 8
    assert db.magic_leases.count_documents({}) == 1
    assert db.magic_resources.count_documents({}) == 4
    assert db.magic_fences.find_one({"_id": "gpu-1"})["lease_id"] == won[0]


def test_macs_unique_across_leases_even_with_a_colliding_rng(env):
    db, clock, store = env

    class FewValues(random.Random):
        # Only 8 distinct MACs possible: collisions are certain, retries must resolve them.
        def randrange(self, n):
            return super().randrange(2)

    store._rng = FewValues(1)
    for i in range(2, 4):
        db.agents.insert_one(agent_doc(f"gpu-{i}"))
        db.magic_devices.insert_one({"_id": f"gpu-{i}", "agent_host": "h1", "gpus": 4})
    macs = [vm["mac"] for d in ("gpu-1", "gpu-2") for vm in claim(store, 4, d)["vms"]]
    assert len(set(macs)) == 8
    with pytest.raises(L.LeaseError, match="no free MAC"):
        claim(store, 1, "gpu-3")
    assert db.magic_device_claims.find_one({"_id": "gpu-3"}) is None


# ---------------------------------------------------------------- transitions

def test_transition_cas_history_deadline_and_vms(env):
    db, clock, store = env
    lease = claim(store, 2)
    lid = lease["_id"]
    clock.t += 10
    lease = store.transition(lid, "claimed", 0, "fenced", "device agent stopped")
    assert (lease["state"], lease["generation"]) == ("fenced", 1)
    assert lease["deadline"] == clock.t - 10 + 600.0  # one deadline for the whole bring-up
    lease = store.progress(lid, "fenced", 1, push_intent=[{"action": "maas.deploy", "target": "abc",
                                                           "phase": "begin", "data": {}}],
                           merge_vms=[{"index": 1, "maas_system_id": "x7", "ip": "10.0.0.9"}])
    assert (lease["state"], lease["generation"]) == ("fenced", 2)
    assert lease["intent"] == [{"at": clock.t, "action": "maas.deploy", "target": "abc",
                                "phase": "begin", "data": {}}]
    assert lease["vms"][1]["maas_system_id"] == "x7" and lease["vms"][1]["name"] == "gpu-1-vm2"
    assert lease["vms"][0]["maas_system_id"] is None
    assert [h["state"] for h in lease["history"]] == ["claimed", "fenced"]
    with pytest.raises(L.LeaseError, match="index 5 out of range"):
        store.progress(lid, "fenced", 2, merge_vms=[{"index": 5, "ip": "x"}])
    for s in ("deploying", "splitting", "enrolling"):
        lease = store.transition(lid, lease["state"], lease["generation"], s, "step")
    lease = store.transition(lid, "enrolling", lease["generation"], "active", "agents started")
    assert lease["deadline"] == lease["created_at"] + 3600.0
    lease = store.transition(lid, "active", lease["generation"], "draining", "idle",
                             set_fields={"drain": {"reason": "idle", "requested_at": clock.t,
                                                   "grace_until": clock.t + 5, "forced": False}})
    assert lease["deadline"] == clock.t + 5 and lease["drain"]["reason"] == "idle"


def test_stale_generation_and_illegal_and_not_found(env):
    db, clock, store = env
    lid = claim(store)["_id"]
    store.transition(lid, "claimed", 0, "fenced", "ok")
    with pytest.raises(L.StaleGeneration) as info:
        store.transition(lid, "claimed", 0, "fenced", "repeated report")
    assert info.value.lease["generation"] == 1 and info.value.lease["state"] == "fenced"
    with pytest.raises(L.StaleGeneration):
        store.progress(lid, "fenced", 0)
    with pytest.raises(L.IllegalTransition):
        store.transition(lid, "fenced", 1, "active", "skip")
    with pytest.raises(L.LeaseNotFound):
        store.transition("lease-000000000000", "claimed", 0, "fenced", "x")
    assert store.get(lid)["generation"] == 1


def test_concurrent_reports_apply_once(env):
    db, clock, store = env
    lid = claim(store)["_id"]
    outcomes, barrier = [], threading.Barrier(6)

    def report():
        barrier.wait()
        try:
            outcomes.append(store.transition(lid, "claimed", 0, "fenced", "stopped")["generation"])
        except L.StaleGeneration:
            outcomes.append("stale")

    threads = [threading.Thread(target=report) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes, key=str) == [1] + ["stale"] * 5
    assert len(store.get(lid)["history"]) == 2


# ---------------------------------------------------------------- close

def drive_to_restoring(store, lid):
    lease = store.get(lid)
    for s in ("fenced", "restoring"):
        lease = store.transition(lid, lease["state"], lease["generation"], s, "test")
    return lease


def test_close_returned_frees_everything(env):
    db, clock, store = env
    lease = claim(store, 2)
    lid = lease["_id"]
    names = [v["name"] for v in lease["vms"]]
    for n in names:
        db.agents.insert_one(agent_doc(n, comment=""))
    store.fence_agents(lid, names, reason="draining")
    lease = drive_to_restoring(store, lid)
    closed = store.close(lid, lease["generation"], "returned", "restored")
    assert closed["state"] == "returned" and closed["deadline"] is None
    assert db.magic_device_claims.count_documents({}) == 0
    assert db.magic_fences.count_documents({}) == 0
    assert db.magic_resources.count_documents({}) == 0
    assert db.agents.count_documents({"name": {"$in": names}}) == 0
    agent = db.agents.find_one({"name": "gpu-1"})
    assert (agent["state"], agent["comment"]) == ("waiting", "")
    assert store.open_lease_for_device("gpu-1") is None
    store.cleanup(closed)  # idempotent
    # The device can be lent again.
    assert claim(store)["state"] == "claimed"


def test_close_returned_leaves_agent_doc_an_operator_changed(env):
    db, clock, store = env
    lid = claim(store)["_id"]
    db.agents.update_one({"name": "gpu-1"}, {"$set": {"state": "maintenance", "comment": "broken fan"}})
    lease = drive_to_restoring(store, lid)
    store.close(lid, lease["generation"], "returned")
    agent = db.agents.find_one({"name": "gpu-1"})
    assert (agent["state"], agent["comment"]) == ("maintenance", "broken fan")


def test_close_failed_keeps_claim_and_fence_and_counts_once(env):
    db, clock, store = env
    lid = claim(store)["_id"]
    assert store.record_failure(lid, "deadline passed")
    lease = drive_to_restoring(store, lid)
    store.close(lid, lease["generation"], "failed", "GPUs not back on host")
    assert db.magic_devices.find_one({"_id": "gpu-1"})["failures"] == 1
    assert store.is_fenced("gpu-1")
    assert db.magic_device_claims.count_documents({"_id": "gpu-1"}) == 1
    db.agents.update_one({"name": "gpu-1"}, {"$set": {"state": "waiting", "comment": ""}})
    with pytest.raises(L.ClaimRefused, match="already lent"):
        claim(store)
    assert store.release_failed("gpu-1")
    assert not store.is_fenced("gpu-1")
    assert claim(store)["state"] == "claimed"
    with pytest.raises(L.IllegalTransition):
        store.close(lid, 99, "active")


def test_list_filters(env):
    db, clock, store = env
    db.agents.insert_one(agent_doc("gpu-2"))
    db.magic_devices.insert_one({"_id": "gpu-2", "agent_host": "h2", "gpus": 4, "failures": 0})
    a = claim(store, 1, "gpu-1")["_id"]
    clock.t += 1
    b = store.claim("gpu-2", make_queue(), "h2", 1, "r")["_id"]
    store.transition(b, "claimed", 0, "restoring", "error")
    assert [x["_id"] for x in store.list()] == [a, b]
    assert [x["_id"] for x in store.list(state="restoring")] == [b]
    assert [x["_id"] for x in store.list(agent_host="h1")] == [a]
    assert [x["_id"] for x in store.list(queue="one-gpu-vm", open_only=True)] == [a, b]
    assert store.list(device="gpu-3") == []


# ---------------------------------------------------------------- fences and dispatch

def test_fences(env):
    db, clock, store = env
    store.fence_agents("lease-1", ["a", "b"], reason="drain")
    store.fence_agents("lease-1", ["a"], reason="again")  # idempotent
    assert store.is_fenced("a") and store.is_fenced("b") and not store.is_fenced("c")
    assert db.magic_fences.find_one({"_id": "a"})["kind"] == "vm"
    store.unfence(["a"])
    assert not store.is_fenced("a") and store.is_fenced("b")


def poll(store, db, agent, job_id, hold=None, pop=True):
    """One served GET /v1/job as the hook (gates.admit / gates.hand_out) and Testflinger's
    handler do it; ``hold`` runs between the pop and the marker (the handshake's window).
    ``pop=False``: the job is already stored running. Returns the job delivered, or None."""
    refusal, watched = store.gates.admit(agent)
    if refusal is not None:
        return None
    if pop:
        db.jobs.insert_one(job_doc(job_id, "running"))
    if hold:
        hold()
    if store.gates.hand_out(agent, job_id, "q", watched) is not None:
        return None
    return job_id


def test_agent_busy_reasons(env):
    db, clock, store = env
    db.agents.insert_one(agent_doc("vm1"))
    assert store.agent_busy("vm1") is None
    db.agents.update_one({"name": "vm1"}, {"$set": {"state": "test"}})
    assert "state test" in store.agent_busy("vm1")
    db.agents.update_one({"name": "vm1"}, {"$set": {"state": "restart"}})
    assert "state restart" in store.agent_busy("vm1")  # testflinger#1304: never idle
    db.agents.update_one({"name": "vm1"}, {"$set": {"state": "waiting", "job_id": "j9"}})
    assert "j9" in store.agent_busy("vm1")
    assert store.agent_busy("vm1", include_agent_doc=False) is None
    db.agents.update_one({"name": "vm1"}, {"$unset": {"job_id": ""}})  # newer agents post none
    db.jobs.insert_one(dict(job_doc("j0", "setup"), result_data={"job_state": "setup",
                                                                  "agent_id": "vm1"}))
    assert "j0 is assigned to it" in store.agent_busy("vm1")
    db.jobs.update_one({"job_id": "j0"}, {"$set": {"result_data.job_state": "complete"}})
    assert store.agent_busy("vm1") is None
    store.gates.sync(["vm1"])  # watched: a job handed out leaves a marker
    assert poll(store, db, "vm1", "j1") == "j1"
    assert "j1 is running" in store.agent_busy("vm1")
    db.jobs.update_one({"job_id": "j1"}, {"$set": {"result_data.job_state": "cancelled"}})
    assert store.agent_busy("vm1") is None


def test_claim_checks_recent_jobs_as_the_query_says(env):
    """started_at: missing or at/after the cutoff is recent; older, null or not a datetime is
    not (MongoDB's comparison); as unattributed_jobs' own query answers."""
    from datetime import datetime, timezone

    db, clock, store = env
    at = {"old": clock.t - L.DISPATCH_PENDING_TTL - 5, "new": clock.t - 1,
          "edge": clock.t - L.DISPATCH_PENDING_TTL}
    for name, t in at.items():
        db.jobs.insert_one(dict(job_doc(f"j-{name}", "running"),
                                started_at=datetime.fromtimestamp(t, timezone.utc)))
    db.jobs.insert_one(dict(job_doc("j-null", "running"), started_at=None))
    db.jobs.insert_one(dict(job_doc("j-text", "running"), started_at="2020-01-01"))
    db.jobs.insert_one(job_doc("j-missing", "setup"))
    db.jobs.insert_one(job_doc("j-done", "complete"))
    want = ["j-edge", "j-missing", "j-new"]
    assert store.gates.unattributed_jobs("gpu-1", ["gpu-hosts"]) == want
    assert store.claim_checks("gpu-1", ["gpu-hosts"]) == (None, want)
    # The same of one document, as claim_checks tells its branches apart (a tz-aware client
    # returns aware datetimes; mongomock returns naive ones).
    from testflinger_magic import claimchecks as G

    cutoff = G._utc(clock.t - L.DISPATCH_PENDING_TTL)
    for name, t in at.items():
        aware = datetime.fromtimestamp(t, timezone.utc)
        for value in (aware, aware.replace(tzinfo=None),
                      aware.astimezone(timezone(__import__("datetime").timedelta(hours=2)))):
            assert G._recent({"started_at": value}, cutoff) is (name != "old"), (name, value)
    assert G._recent({}, cutoff) and not G._recent({"started_at": None}, cutoff)
    assert not G._recent({"started_at": "2020-01-01"}, cutoff)


@pytest.mark.parametrize("seed", range(60))
def test_claim_checks_answer_as_the_busy_check_then_the_unattributed_check(env, seed):
    """The claim's one jobs read (Gates.claim_checks) tells the three kinds of jobs apart as
    the separate reads did: drawn jobs (states, queues, attribution, started_at missing, null,
    naive, aware, old, recent, not a datetime), markers and agent documents naming them."""
    from datetime import datetime, timezone

    db, clock, store = env
    rng = random.Random(seed)
    states = ["waiting", "running", "running", "setup", "provision", "test", "complete",
              "cancelled"]
    for k in range(rng.randrange(0, 6)):
        doc = job_doc(f"j{k}", rng.choice(states), rng.choice(["gpu-hosts", "gpu-hosts", "rack",
                                                                "other"]))
        owner = rng.choice([None] * 8 + ["gpu-1", "vm-x", ""])
        if owner is not None:
            doc["result_data"]["agent_id"] = owner
        kind = rng.choice(["missing", "null", "naive", "naive", "aware", "aware", "text"])
        ago = rng.choice([1.0, L.DISPATCH_PENDING_TTL - 1, L.DISPATCH_PENDING_TTL + 5, 3600.0])
        at = datetime.fromtimestamp(clock.t - ago, timezone.utc)
        if kind != "missing":
            doc["started_at"] = {"null": None, "naive": at.replace(tzinfo=None), "aware": at,
                                 "text": "2020-01-01"}[kind]
        db.jobs.insert_one(doc)
        if rng.random() < 0.3:
            db.magic_dispatch.insert_one({"_id": f"m{k}", "agent": rng.choice(["gpu-1", "vm-x",
                                                                               "vm-x"]),
                                          "phase": "done", "job_id": f"j{k}", "queue": None,
                                          "at": clock.t})
        if rng.random() < 0.2:
            db.agents.insert_one(agent_doc(f"a{k}", state="setup", job_id=f"j{k}"))
    if rng.random() < 0.1:
        db.magic_dispatch.insert_one({"_id": "mp", "agent": "gpu-1", "phase": "pending",
                                      "job_id": None, "queue": None,
                                      "at": clock.t - rng.choice([1.0, 100.0])})
    queues = rng.choice([["gpu-hosts"], ["gpu-hosts", "rack"], ["gpu-hosts"], []])
    busy = store.agent_busy("gpu-1", include_agent_doc=False, prune=False)
    loose = [] if busy else store.gates.unattributed_jobs("gpu-1", queues)
    assert store.claim_checks("gpu-1", queues) == (busy, loose)


@pytest.mark.parametrize("order", ["fence_first", "poll_first_checked_before_fence",
                                   "fence_between_pop_and_marker"])
def test_handshake_orders(env, order):
    """Whatever the interleaving: if the fencer saw the agent idle, no job reaches it later."""
    db, clock, store = env
    db.agents.insert_one(agent_doc("vm1"))
    store.gates.sync(["vm1"])  # a VM agent: watched from its lease's claim
    seen = {}

    def fence_and_look():
        store.fence_agents("lease-1", ["vm1"])
        seen["busy"] = store.agent_busy("vm1")

    if order == "fence_first":
        fence_and_look()
        got = poll(store, db, "vm1", "j1")
        assert got is None and seen["busy"] is None
    elif order == "poll_first_checked_before_fence":
        got = poll(store, db, "vm1", "j1")
        fence_and_look()
        assert got == "j1" and "j1" in seen["busy"]
    else:
        got = poll(store, db, "vm1", "j1", hold=fence_and_look)
        # The fencer saw no marker yet and judged the agent idle; the poll's second gate read
        # saw the fence and gave the job back: it never reached the agent.
        assert got is None and seen["busy"] is None
        assert db.jobs.find_one({"job_id": "j1"})["result_data"]["job_state"] == "waiting"
        assert store.agent_busy("vm1") is None
    assert poll(store, db, "vm1", "j2") is None  # fenced from now on


def test_handshake_threads_never_hand_a_job_after_idle_verdict(env):
    db, clock, store = env
    for round_ in range(30):
        agent = f"vm{round_}"
        db.agents.insert_one(agent_doc(agent))
        store.gates.sync([agent])
        handed, verdicts = [], []
        barrier = threading.Barrier(2)

        def poller():
            barrier.wait()
            for i in range(5):
                if poll(store, db, agent, f"{agent}-j{i}"):
                    handed.append(f"{agent}-j{i}")
                    db.jobs.update_one({"job_id": f"{agent}-j{i}"}, {"$set": {"result_data.job_state": "complete"}})

        def fencer():
            barrier.wait()
            store.fence_agents("lease-x", [agent])
            busy = store.agent_busy(agent)
            verdicts.append((busy, list(handed)))

        threads = [threading.Thread(target=poller), threading.Thread(target=fencer)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        busy, handed_before_verdict = verdicts[0]
        if busy is None:
            # Provably idle: every job the agent ever got was handed (and finished) before.
            assert handed == handed_before_verdict
        assert poll(store, db, agent, f"{agent}-late") is None


def test_an_empty_poll_reads_one_gate_and_writes_nothing(env):
    db, clock, store = env
    store.gates.sync(["gpu-1"])
    before = list(db.magic_dispatch.find()), list(db.magic_agent_gate.find())
    assert store.gates.admit("gpu-1") == (None, True)
    assert store.gates.admit("not-ours") == (None, False)
    assert (list(db.magic_dispatch.find()), list(db.magic_agent_gate.find())) == before


def test_gate_sync_cas_never_drops_a_newer_fence(env):
    """A sync that read the sources before a fence cannot overwrite the fencer's sync: its CAS
    on ``version`` fails and it re-reads (the fencer's busy check relies on this)."""
    db, clock, store = env
    store.gates.sync(["vm1"])
    gates = store.gates
    real_find = gates.fences.find
    state = {"raced": False}

    def stale_find(*a, **kw):  # the first sync reads fences, then a fencer commits and syncs
        docs = list(real_find(*a, **kw))
        if not state["raced"]:
            state["raced"] = True
            db.magic_fences.insert_one({"_id": "vm1", "lease_id": "l", "kind": "vm"})
            gates.fences.find = real_find
            gates.sync(["vm1"])
        return docs

    gates.fences.find = stale_find
    try:
        gates.sync(["vm1"])
    finally:
        gates.fences.find = real_find
    assert store.gates.admit("vm1") == ("fenced", True)


def test_repair_gates_after_a_crash_between_fence_and_sync(env):
    db, clock, store = env
    db.magic_fences.insert_one({"_id": "gpu-1", "lease_id": "l", "kind": "device"})
    assert store.gates.admit("gpu-1") == (None, False)  # the sync never ran
    assert store.repair_gates() == ["gpu-1"]
    assert store.gates.admit("gpu-1") == ("fenced", True)
    db.magic_fences.delete_one({"_id": "gpu-1"})
    assert store.repair_gates() == ["gpu-1"]
    assert store.gates.admit("gpu-1") == (None, True)  # a registered device stays watched
    assert store.repair_gates() == []


def test_claim_that_died_before_its_lease_is_freed_after_the_orphan_age(env):
    """A server that dies inside claim() between the claim lock and the lease insert (or while
    undoing a refused claim) leaves a lock with no lease: the device could never be lent again.
    repair_closed frees it, but only once it is older than ORPHAN_CLAIM_AGE (a claim in progress
    on another replica is never touched)."""
    db, clock, store = env
    lease = claim(store)
    # Simulate the crash: the lease document is gone, the lock, fences and MACs are not.
    db.magic_leases.delete_one({"_id": lease["_id"]})
    assert store.repair_closed() == []  # too young: may be a claim in progress
    assert db.magic_device_claims.count_documents({}) == 1
    clock.t += L.ORPHAN_CLAIM_AGE + 1
    assert store.repair_closed() == [lease["_id"]]
    assert db.magic_device_claims.count_documents({}) == 0
    assert db.magic_fences.count_documents({"lease_id": lease["_id"]}) == 0
    assert db.magic_resources.count_documents({"lease_id": lease["_id"]}) == 0
    agent = db.agents.find_one({"name": "gpu-1"})
    assert agent["state"] == "waiting" and agent["comment"] == ""
    assert claim(store)["device"] == "gpu-1"  # lendable again


def test_unwatched_poll_gives_the_job_back_if_registered_and_lent_meanwhile(env):
    """A poll that read no gate (R1) takes a job after the agent got a gate and a fence (a device
    registered and lent between R1 and the pop): the second gate read gives the job back, and
    writes no marker."""
    db, clock, store = env
    db.jobs.insert_one(job_doc("j-late", "running"))
    refusal, watched = store.gates.admit("late-dev")
    assert (refusal, watched) == (None, False)
    store.fence_agents("lease-x", ["late-dev"], kind="device", reason="lent")
    assert store.gates.hand_out("late-dev", "j-late", "q", watched) == "fenced_late"
    assert db.jobs.find_one({"job_id": "j-late"})["result_data"]["job_state"] == "waiting"
    assert db.magic_dispatch.count_documents({}) == 0
    # Not fenced at the second read: delivered, still no marker (not ours).
    db.jobs.insert_one(job_doc("j-other", "running"))
    assert store.gates.hand_out("other-agent", "j-other", "q", False) is None
    assert db.magic_dispatch.count_documents({}) == 0
