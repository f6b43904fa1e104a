"""The stale-job rule (testflinger_magic.stalejob): pure, then through Gates.busy on mongomock
with Testflinger-shaped documents (a VM agent that restarted mid-job, TRIAL3 finding 12)."""

import random
from datetime import datetime, timezone

import pytest

from testflinger_magic import db as dbmod
from testflinger_magic import leases as L
from testflinger_magic import stalejob as S
from testflinger_magic import tfstates

NOW = 2_000_000_000.0


def doc(state="waiting", job_id="j1", age=S.STALE_AFTER + 1, updated_at=None):
    at = updated_at if updated_at is not None else \
        datetime.fromtimestamp(NOW - age, timezone.utc).replace(tzinfo=None)
    return {"name": "vm1", "state": state, "job_id": job_id, "updated_at": at}


@pytest.mark.parametrize("job_state", sorted(S.STALE_JOB_STATES))
def test_a_waiting_agent_quiet_since_naming_a_job_in_a_phase_or_ended_is_stale(job_state):
    why = S.stale_job(doc(), job_state, NOW)
    assert why and "j1" in why and job_state in why and "restarted" in why
    assert S.orphaned(doc(), job_state, NOW) is (job_state in tfstates.JOB_PHASES)


def test_a_missing_job_is_stale_and_no_orphan():
    assert "no longer exists" in S.stale_job(doc(), None, NOW, job_exists=False)
    assert not S.orphaned(doc(), None, NOW)


@pytest.mark.parametrize("agent_state", sorted(tfstates.JOB_PHASES) + ["restart", "offline",
                                                                        "maintenance", None])
def test_never_stale_unless_the_agent_says_waiting(agent_state):
    # A phase: a job runs; restart (testflinger#1304): about to restart, maybe after a job.
    assert S.stale_job(doc(state=agent_state), "provision", NOW) is None


def test_never_stale_while_the_job_is_running_recently_posted_or_post_time_unknown():
    assert S.stale_job(doc(), tfstates.JOB_RUNNING, NOW) is None      # downloading attachments
    assert S.stale_job(doc(), tfstates.JOB_WAITING, NOW) is None
    assert S.stale_job(doc(age=S.STALE_AFTER - 1), "setup", NOW) is None  # between paired posts
    assert S.stale_job(doc(updated_at="yesterday"), "provision", NOW) is None
    assert S.stale_job(dict(doc(), updated_at=None), "provision", NOW) is None
    assert S.stale_job(doc(job_id=""), "provision", NOW) is None
    assert S.stale_job(None, "provision", NOW) is None
    assert S.stale_job(doc(age=S.STALE_AFTER), "setup", NOW)            # the boundary counts


def test_epoch_reads_naive_aware_and_numbers():
    naive = datetime(2030, 1, 1, 12, 0, 0)
    aware = naive.replace(tzinfo=timezone.utc)
    assert S.epoch(naive) == S.epoch(aware) == aware.timestamp()
    assert S.epoch(12.5) == 12.5 and S.epoch(True) is None and S.epoch("x") is None


def test_candidates_and_claims_need_the_job_states():
    docs = {"a": dict(doc(), job_id="ja"), "b": dict(doc(state="test"), job_id="jb"),
            "c": dict(doc(age=1), job_id="jc"), "d": dict(doc(), job_id="jd")}
    assert S.candidates(docs, ["a", "b", "c", "d", "e"], NOW) == {"ja", "jd"}
    # jd is not among the states: gone from jobs, so stale too
    assert S.stale_claims(docs, ["a", "b", "c", "d"], {"ja": "provision"}, NOW) == \
        {"a": "ja", "d": "jd"}
    assert S.stale_claims(docs, ["a"], {"ja": "running"}, NOW) == {}


# ---------------------------------------------------------------- through Gates.busy

class Clock:
    t = NOW

    def __call__(self):
        return self.t


@pytest.fixture
def store():
    db = dbmod.connect()
    s = L.LeaseStore(db, Clock(), rng=random.Random(3))
    s.ensure_indexes()
    return s


def _restart_mid_job(store, job_state="provision"):
    """vm1 took j1 (marker written by the hand-out, as the hook does), posted its job_id and
    phases, then restarted: the fe381ff startup post (state waiting, comment "", identity; no
    job_id, agent.py::_post_initial_agent_data) leaves job_id j1."""
    db = store.db
    store.gates.sync(["vm1"])
    db.jobs.insert_one({"job_id": "j1", "job_data": {"job_queue": "one-gpu-vm"},
                        "result_data": {"job_state": job_state}})
    store.gates.mark("vm1", "j1", "one-gpu-vm")
    db.agents.insert_one(doc(job_id="j1", age=10))


def _age(store, seconds):
    at = datetime.fromtimestamp(NOW - seconds, timezone.utc).replace(tzinfo=None)
    store.db.agents.update_one({"name": "vm1"}, {"$set": {"updated_at": at}})


def test_a_restarted_agent_is_busy_until_quiet_then_idle_and_its_marker_kept(store):
    _restart_mid_job(store)
    assert "j1 is provision" in store.gates.agent_busy("vm1")
    _age(store, S.STALE_AFTER + 5)
    assert store.gates.agent_busy("vm1") is None
    assert store.db.magic_dispatch.count_documents({"job_id": "j1"}) == 1  # not pruned
    # Without the agent document (the claim's check) the marker still counts: stricter.
    assert "j1" in store.gates.agent_busy("vm1", include_agent_doc=False)


def test_after_a_cancel_the_restarted_agent_is_idle_and_the_marker_pruned(store):
    _restart_mid_job(store)
    store.db.jobs.update_one({"job_id": "j1"}, {"$set": {"result_data.job_state": "cancelled"}})
    assert "reports job j1" in store.gates.agent_busy("vm1")  # posted 10 s ago: not yet
    _age(store, S.STALE_AFTER + 5)
    assert store.gates.agent_busy("vm1") is None
    assert store.db.magic_dispatch.count_documents({}) == 0


def test_a_running_job_or_a_new_job_keeps_the_agent_busy(store):
    _restart_mid_job(store, job_state="running")
    _age(store, S.STALE_AFTER + 5)
    assert "j1 is running" in store.gates.agent_busy("vm1")
    store.db.jobs.update_one({"job_id": "j1"}, {"$set": {"result_data.job_state": "provision"}})
    assert store.gates.agent_busy("vm1") is None
    # It takes a new job: the new marker makes it busy whatever its document still says.
    store.db.jobs.insert_one({"job_id": "j2", "result_data": {"job_state": "running"}})
    store.gates.mark("vm1", "j2", "one-gpu-vm")
    assert "j2 is running" in store.gates.agent_busy("vm1")


def test_a_held_job_of_a_newer_server_is_stale_the_same_way(store):
    """testflinger#1253: the server set agents.job_id and result_data.agent_id; the agent
    restarted in provision."""
    db = store.db
    db.jobs.insert_one({"job_id": "j1", "result_data": {"job_state": "provision",
                                                        "agent_id": "vm1"}})
    db.agents.insert_one(doc(job_id="j1", age=S.STALE_AFTER + 5))
    assert store.gates.agent_busy("vm1") is None
    # Its document no longer names j1, but it is quiet and waiting: it runs no job in a phase
    # (a running agent posts each phase as its state), so j1 is still an orphan (TRIAL4 #7).
    db.agents.update_one({"name": "vm1"}, {"$unset": {"job_id": ""}})
    orphans: list = []
    assert store.gates.busy(["vm1"], orphans_out=orphans) == {}
    assert orphans == [{"agent": "vm1", "job_id": "j1", "job_state": "provision"}]
    _age(store, 10)  # it posted lately: not judged yet
    assert "j1 is assigned to it" in store.gates.agent_busy("vm1")


def test_restarted_then_took_and_finished_another_job_leaves_the_first_an_orphan(store):
    """TRIAL4 finding 7: vm1 restarted in setup of j1, then took j2 and finished it (its
    document: job_id "", waiting). j1's marker still names a job in setup: once vm1 has been
    quiet for STALE_AFTER, j1 is an orphan (not busy, listed) and vm1 is idle."""
    _restart_mid_job(store, job_state="setup")
    db = store.db
    db.jobs.insert_one({"job_id": "j2", "result_data": {"job_state": "running"}})
    store.gates.mark("vm1", "j2", "one-gpu-vm")
    db.agents.update_one({"name": "vm1"}, {"$set": {"job_id": "j2", "state": "test"}})
    db.jobs.update_one({"job_id": "j2"}, {"$set": {"result_data.job_state": "test"}})
    _age(store, S.STALE_AFTER + 5)
    assert store.gates.agent_busy("vm1") is not None  # running j2 in its test phase: busy
    db.jobs.update_one({"job_id": "j2"}, {"$set": {"result_data.job_state": "complete"}})
    db.agents.update_one({"name": "vm1"}, {"$set": {"job_id": "", "state": "waiting"}})
    _age(store, 10)
    assert "j1 is setup" in store.gates.agent_busy("vm1")  # just finished j2: not judged yet
    _age(store, S.STALE_AFTER + 5)
    orphans: list = []
    assert store.gates.busy(["vm1"], orphans_out=orphans) == {}
    assert orphans == [{"agent": "vm1", "job_id": "j1", "job_state": "setup"}]
    # A job still running (popped, attachments) is never judged: busy.
    db.jobs.update_one({"job_id": "j1"}, {"$set": {"result_data.job_state": "running"}})
    assert "j1 is running" in store.gates.agent_busy("vm1")


def test_stale_agents_reads_only_the_missing_states_and_fills_out():
    docs = {"a": dict(doc(), job_id="ja"), "b": dict(doc(), job_id="jb"),
            "c": dict(doc(state="provision"), job_id="jc")}
    asked = []

    def read(ids):
        asked.append(ids)
        return {"jb": "complete"}

    out = {}
    assert S.stale_agents(docs, ["a", "b", "c"], {"ja": "test"}, NOW, read, out) == \
        {"a": "ja", "b": "jb"}
    assert asked == [["jb"]] and out == {"a": ("ja", "test"), "b": ("jb", "complete")}
    assert S.stale_agents(docs, ["a"], {"ja": "running"}, NOW, read) == {}
    assert asked == [["jb"]]  # every state known: no read
    assert S.stale_agents(docs, ["c"], {}, NOW, read) == {}  # no candidate: no read either
    assert asked == [["jb"]]
