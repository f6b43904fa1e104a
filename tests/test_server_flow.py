"""The whole server-side path over real HTTP, with a fake agent-host daemon and fake agents:
submit to an empty magic queue -> preflight -> lend -> bring-up reports -> VM agents take the
job -> idle -> drain -> restore -> returned -> device agent served again."""

from __future__ import annotations

import threading
import time

import pytest
import requests

from conftest import MAGIC_YAML, MagicStack
from test_server_api import DEVICES, poll_job, register, report, submit


class Clock:
    """A settable clock (epoch seconds) starting at the real time."""

    def __init__(self):
        self.now = time.time()
        self.lock = threading.Lock()

    def __call__(self):
        with self.lock:
            return self.now

    def advance(self, seconds):
        with self.lock:
            self.now += seconds


def wait_until(predicate, what, limit=30.0):
    """Poll ``predicate`` until true; fails naming ``what`` (a liveness guard, not a timing
    assertion)."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"never happened: {what}")


#: Every flow runs against both server generations of the lab job service.
SERVERS = pytest.mark.parametrize("server", ["old", "newer"])


def agent_post(m, name, **fields):
    """POST /v1/agents/data/<name> as testflinger-agent (agent token); a newer agent never posts
    ``job_id`` (testflinger#1253: the server sets and clears it)."""
    if m.newer:
        fields.pop("job_id", None)
    r = requests.post(f"{m.url}/v1/agents/data/{name}", json=fields, headers=m.headers("agent"),
                      timeout=10)
    assert r.status_code == 200, r.text
    return r


def result_post(m, job_id, **fields):
    r = requests.post(f"{m.url}/v1/result/{job_id}", json=fields, headers=m.headers("agent"),
                      timeout=10)
    assert r.status_code == 200, r.text


def work(m, host="host-a"):
    r = requests.get(f"{m.url}/v1/magic/agent-hosts/{host}/work", params={"wait": 0},
                     headers=m.headers("agent"), timeout=10)
    assert r.status_code == 200
    return r.json()["leases"]


@SERVERS
def test_full_path(mongo, serve, server):
    clock = Clock()
    m = MagicStack(mongo, serve, clock=clock, server=server)
    try:
        assert register(m, devices=DEVICES[:1]).status_code == 200
        # The CLI's preflight on an empty magic queue (TESTFLINGER.md §4.2).
        pre = requests.get(f"{m.url}/v1/queues/one-gpu-vm/agents", timeout=10)
        assert pre.status_code == 200 and any(a["state"] != "offline" for a in pre.json())
        job_id = submit(m, "one-gpu-vm")
        # The submission kicked a background tick, which claims the device.
        wait_until(lambda: m.db.magic_leases.count_documents({}) == 1, "lease claimed on submit")
        m.plugin.tick()  # a repeated tick must not lend again
        assert m.db.magic_leases.count_documents({}) == 1
        (lease,) = work(m)
        assert (lease["device"], lease["state"], len(lease["vms"])) == ("gpu-host-01", "claimed", 2)
        # The device agent is fenced, whatever queue it asks for.
        assert poll_job(m, "gpu-host-01", ["gpu-hosts", "one-gpu-vm"]).status_code == 204
        assert m.db.agents.find_one({"name": "gpu-host-01"})["state"] == "maintenance"

        # Fake daemon: bring-up reports up to active.
        for to_state in ("fenced", "deploying", "splitting", "enrolling", "active"):
            vms = []
            if to_state == "enrolling":
                vms = [{"index": i, "domain": vm["name"], "gpus": [f"0000:0{i + 1}:00.0"]}
                       for i, vm in enumerate(lease["vms"])]
            r = report(m, lease, to_state=to_state, vms=vms,
                       intent=[{"action": to_state, "target": lease["device"], "phase": "done"}])
            assert r.status_code == 200, r.text
            lease = r.json()
        assert lease["state"] == "active" and lease["vms"][0]["domain"] == "gpu-host-01-vm1"

        # VM agents come up (as testflinger-agent does: post state, then poll) and take the job.
        names = [vm["agent_name"] for vm in lease["vms"]]
        for name in names:
            agent_post(m, name, state="waiting", queues=["one-gpu-vm"], job_id="", comment="")
        got = [poll_job(m, name, ["one-gpu-vm"]) for name in names]
        assert sorted(r.status_code for r in got) == [200, 204]
        runner = names[[r.status_code for r in got].index(200)]
        assert got[[r.status_code for r in got].index(200)].json()["job_id"] == job_id
        agent_post(m, runner, state="test", job_id=job_id)
        m.plugin.tick()
        clock.advance(3600)  # long idle_timeout passes, but the job still runs: no drain
        m.plugin.tick()
        assert m.db.magic_leases.find_one({"_id": lease["_id"]})["state"] == "active"

        # Job done: the agent posts the outcome and goes back to waiting.
        result_post(m, job_id, job_state="complete")
        agent_post(m, runner, state="waiting", job_id="")
        m.plugin.tick()  # records idle_since
        clock.advance(11 * 60)
        m.plugin.tick()  # idle_timeout passed: drain
        doc = m.db.magic_leases.find_one({"_id": lease["_id"]})
        assert doc["state"] in ("draining", "restoring") and doc["drain"]["kind"] == "idle"
        # A draining lease's VM agents are fenced.
        submit(m, "gpu-hosts")
        assert poll_job(m, names[0], ["one-gpu-vm"]).status_code == 204
        m.plugin.tick()  # all idle and fenced: restore
        (lease,) = work(m)
        assert lease["state"] == "restoring"

        r = report(m, lease, to_state="returned")
        assert r.status_code == 200 and r.json()["state"] == "returned"
        # Device agent unfenced and back; VM agent documents gone.
        assert m.db.agents.count_documents({"name": {"$in": names}}) == 0
        assert m.db.agents.find_one({"name": "gpu-host-01"})["state"] == "waiting"
        assert m.db.magic_fences.count_documents({}) == 0
        r = poll_job(m, "gpu-host-01", ["gpu-hosts"])
        assert r.status_code == 200 and r.json()["job_queue"] == "gpu-hosts"
        assert work(m) == []
        kinds = [e["kind"] for e in requests.get(f"{m.url}/v1/magic/events", timeout=10).json()["events"]]
        assert "lease.claimed" in kinds and "lease.returned" in kinds
    finally:
        m.plugin.stop()


def active_vm_agent_with_a_job(m) -> tuple[dict, str, str]:
    """One device lent and brought up to ``active`` by reports; its first VM agent posted
    ``waiting`` and popped the one submitted job. Returns (lease, VM agent name, job_id)."""
    register(m, devices=DEVICES[:1])
    job_id = submit(m, "one-gpu-vm")
    m.plugin.tick()
    (lease,) = work(m)
    for to_state in ("fenced", "deploying", "splitting", "enrolling", "active"):
        lease = report(m, lease, to_state=to_state).json()
    name = lease["vms"][0]["agent_name"]
    agent_post(m, name, state="waiting", queues=["one-gpu-vm"], job_id="")
    assert poll_job(m, name, ["one-gpu-vm"]).status_code == 200
    return lease, name, job_id


def forced_during(m, clock, phase: str, before=None):
    """An active VM agent running a job in ``phase`` (agent and job say so; ``before(job_id)``
    called between the agent's post and the job's), its lease drained by an operator with a
    5 min grace, the clock past it and a tick: the force cancelled the job. Returns (lease, VM
    agent name, job_id)."""
    lease, name, job_id = active_vm_agent_with_a_job(m)
    agent_post(m, name, state=phase, job_id=job_id)
    if before is not None:
        before(job_id)
    result_post(m, job_id, job_state=phase)
    r = requests.post(f"{m.url}/v1/magic/leases/{lease['_id']}/drain",
                      headers=m.headers("manager"),
                      json={"reason": "maintenance", "grace": "5m"}, timeout=10)
    assert r.status_code == 200
    clock.advance(6 * 60)
    m.plugin.tick()  # grace over: force, cancel
    assert m.db.jobs.find_one({"job_id": job_id})["result_data"]["job_state"] == "cancelled"
    return lease, name, job_id


@SERVERS
def test_force_cancels_jobs_after_grace(mongo, serve, server):
    clock = Clock()
    m = MagicStack(mongo, serve, clock=clock, server=server)
    try:
        lease, name, job_id = active_vm_agent_with_a_job(m)
        agent_post(m, name, state="test", job_id=job_id)
        r = requests.post(f"{m.url}/v1/magic/leases/{lease['_id']}/drain",
                          headers=m.headers("manager"),
                          json={"reason": "maintenance", "grace": "5m"}, timeout=10)
        assert r.status_code == 200 and r.json()["state"] == "draining"
        m.plugin.tick()  # busy: nothing to do yet
        assert m.db.magic_leases.find_one({"_id": lease["_id"]})["state"] == "draining"
        clock.advance(6 * 60)
        m.plugin.tick()  # grace over: force (cancel), but the agent has not noticed yet
        assert m.db.jobs.find_one({"job_id": job_id})["result_data"]["job_state"] == "cancelled"
        doc = m.db.magic_leases.find_one({"_id": lease["_id"]})
        assert doc["state"] == "draining" and doc["drain"]["forced_at"] is not None
        assert doc["drain"]["cancelled"] == [job_id]
        m.plugin.tick()  # still busy: the VMs are not torn down under the job
        assert m.db.magic_leases.find_one({"_id": lease["_id"]})["state"] == "draining"
        agent_post(m, name, state="waiting", job_id="")  # the agent saw the cancel
        m.plugin.tick()
        assert m.db.magic_leases.find_one({"_id": lease["_id"]})["state"] == "restoring"
    finally:
        m.plugin.stop()


@SERVERS
def test_forced_drain_tells_the_cancelled_job_why_in_its_output(mongo, serve, server):
    """Issue 10 item 2: the job's output, as testflinger-cli poll reads it (GET
    /v1/result/<id>/log/output?start_fragment=N), ends with the reason: lease, owner's queue,
    grace; after the agent's own fragments."""
    clock = Clock()
    m = MagicStack(mongo, serve, clock=clock, server=server)
    try:
        def output(job_id):  # the agent's own fragment, before the cancel
            r = requests.post(f"{m.url}/v1/result/{job_id}/log/output",
                              headers=m.headers("agent"),
                              json={"fragment_number": 0, "timestamp": "2026-01-01T00:00:00+00:00",
                                    "phase": "test", "log_data": "running the tests\n"},
                              timeout=10)
            assert r.status_code == 200, r.text

        lease, name, job_id = forced_during(m, clock, "test", before=output)
        r = requests.get(f"{m.url}/v1/result/{job_id}/log/output",
                         params={"start_fragment": 1}, headers=m.headers("contributor"),
                         timeout=10)
        assert r.status_code == 200, r.text
        test = r.json()["output"]["test"]
        assert test["last_fragment_number"] > 0
        text = test["log_data"]
        for part in (lease["_id"], "gpu-hosts", "grace of 5m ran out", "maintenance",
                     "one-gpu-vm", "drained by an operator's drain"):
            assert part in text, (part, text)
        assert "forced" not in text and "--force" not in text  # trial finding 19: no --force
        whole = requests.get(f"{m.url}/v1/result/{job_id}/log/output",
                             headers=m.headers("contributor"), timeout=10).json()
        assert whole["output"]["test"]["log_data"].startswith("running the tests\n")
    finally:
        m.plugin.stop()


@SERVERS
def test_forced_drain_records_the_cancel_in_the_job_events(mongo, serve, server):
    """Issue 10 item 2: on a Testflinger that keeps job events (testflinger#1297-#1299), GET
    /v1/events/job/<id> ends with the cancel, ``job_cancelled`` in the server's own shape, its
    detail naming the lease, the owner's queue and the grace; an older server has no events, and
    the plugin writes none there."""
    clock = Clock()
    m = MagicStack(mongo, serve, clock=clock, server=server)
    try:
        lease, name, job_id = forced_during(m, clock, "test")
        r = requests.get(f"{m.url}/v1/events/job/{job_id}", headers=m.headers("contributor"),
                         timeout=10)
        if server == "old":
            assert r.status_code == 404
            assert "jobs_events" not in m.db.list_collection_names()
            return
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["job_id"] == job_id
        names = [e["event_name"] for e in body["events"]]
        assert names[0] == "job_submitted" and "job_assigned" in names, names
        assert "job_phase_started" in names, names
        last = body["events"][-1]
        assert last["event_name"] == "job_cancelled", names
        assert set(last) == {"event_name", "timestamp", "message", "detail"}, last
        assert last["message"] == "Job cancellation requested by user testflinger-magic."
        assert set(last["timestamp"]) == {"$date"}
        for part in (lease["_id"], "gpu-hosts", "grace of 5m ran out", "maintenance",
                     "one-gpu-vm"):
            assert part in last["detail"], (part, last["detail"])
        assert "forced" not in last["detail"]
        r = requests.get(f"{m.url}/v1/events/job/00000000-0000-4000-8000-000000000000",
                         headers=m.headers("contributor"), timeout=10)
        assert r.status_code == 404 and r.json() == {"message": "Job not found"}
        # The agent notices the cancel and posts its final complete: the server adds
        # job_completed after the cancel (events.detect_new_result_events).
        result_post(m, job_id, job_state="complete")
        events = requests.get(f"{m.url}/v1/events/job/{job_id}", headers=m.headers("contributor"),
                              timeout=10).json()["events"]
        assert [e["event_name"] for e in events[-2:]] == ["job_cancelled", "job_completed"]
    finally:
        m.plugin.stop()


@SERVERS
def test_force_restores_anyway_after_the_force_wait(mongo, serve, server):
    """An agent that never notices the cancel (mid-provision) holds the lease only until
    force_until (the policy grace, 15m by default); then restore, with an event."""
    clock = Clock()
    m = MagicStack(mongo, serve, clock=clock, server=server)
    try:
        lease, name, job_id = active_vm_agent_with_a_job(m)
        agent_post(m, name, state="provision", job_id=job_id)
        r = requests.post(f"{m.url}/v1/magic/leases/{lease['_id']}/drain",
                          headers=m.headers("manager"),
                          json={"reason": "maintenance", "grace": "1m", "force": True}, timeout=10)
        assert r.status_code == 200
        clock.advance(2 * 60)
        m.plugin.tick()  # force
        doc = m.db.magic_leases.find_one({"_id": lease["_id"]})
        assert doc["state"] == "draining" and doc["drain"]["force_until"] == doc["deadline"]
        clock.advance(doc["drain"]["force_until"] - clock() - 1)
        m.plugin.tick()
        assert m.db.magic_leases.find_one({"_id": lease["_id"]})["state"] == "draining"
        clock.advance(2)
        m.plugin.tick()
        assert m.db.magic_leases.find_one({"_id": lease["_id"]})["state"] == "restoring"
        (ev,) = list(m.db.magic_events.find({"kind": "lease.force_timeout"}))
        assert name in ev["message"] and ev["data"]["busy"] == [name]
    finally:
        m.plugin.stop()


@SERVERS
def test_bringup_deadline_restores_and_counts_failure(mongo, serve, server):
    clock = Clock()
    m = MagicStack(mongo, serve, clock=clock, server=server)
    try:
        register(m, devices=DEVICES[:1])
        submit(m, "one-gpu-vm")
        m.plugin.tick()
        (lease,) = work(m)
        lease = report(m, lease, to_state="fenced").json()
        clock.advance(46 * 60)  # provision_timeout default 45m
        # Its daemon heartbeats meanwhile (a stale host's bring-up is not the device's fault).
        r = requests.post(f"{m.url}/v1/magic/agent-hosts/host-a/heartbeat",
                          headers=m.headers("agent"), json={"leases": []}, timeout=10)
        assert r.status_code == 200, r.text
        m.plugin.tick()
        doc = m.db.magic_leases.find_one({"_id": lease["_id"]})
        assert doc["state"] == "restoring" and doc["error"]
        assert m.db.magic_devices.find_one({"_id": "gpu-host-01"})["failures"] == 1
        # The daemon's stale report now gets 409 with the current lease.
        r = report(m, lease, to_state="deploying")
        assert r.status_code == 409 and r.json()["lease"]["state"] == "restoring"
        # Restore fails: failed keeps the device fenced.
        r = report(m, doc, result="error", message="GPU did not come back")
        assert r.status_code == 200 and r.json()["state"] == "failed"
        assert poll_job(m, "gpu-host-01", ["gpu-hosts"]).status_code == 204
    finally:
        m.plugin.stop()


@SERVERS
def test_fence_holds_when_the_agent_ignores_offline(mongo, serve, server):
    """An agent that re-asserts its own state over our ``offline`` (an older agent restarting,
    TESTFLINGER.md §3.2; the open agent-mode PRs' heartbeats, §9) still gets no job: the gate
    answers, not the agents document."""
    m = MagicStack(mongo, serve, server=server)
    try:
        register(m, devices=DEVICES[:1])
        m.plugin.tick()
        submit(m, "gpu-hosts")
        lend = requests.post(f"{m.url}/v1/magic/leases", headers=m.headers("admin"),
                             json={"device": "gpu-host-01", "queue": "one-gpu-vm"}, timeout=10)
        assert lend.status_code == 201
        agent_post(m, "gpu-host-01", state="waiting", comment="")
        assert poll_job(m, "gpu-host-01", ["gpu-hosts"]).status_code == 204
        assert m.db.jobs.count_documents({"result_data.job_state": "waiting"}) == 1
    finally:
        m.plugin.stop()


@SERVERS
def test_device_agent_left_offline_by_a_crash_is_given_back(mongo, serve, server):
    """A claim that died after marking the device agent ours, and whose claim lock is gone
    too, left it ``offline`` with our comment; a newer agent keeps that across restarts
    (testflinger#1291). The tick gives it back, and its gate is open again."""
    from testflinger_magic import leases as L

    m = MagicStack(mongo, serve, server=server)
    try:
        register(m, devices=DEVICES[:1])
        m.db.agents.update_one({"name": "gpu-host-01"}, {"$set": {
            "state": "offline", "comment": L.lent_comment("one-gpu-vm", "lease-0123456789ab")}})
        m.db.magic_fences.insert_one({"_id": "gpu-host-01", "lease_id": "lease-0123456789ab",
                                      "kind": "device", "since": 0})
        m.plugin.tick()
        doc = m.db.agents.find_one({"name": "gpu-host-01"})
        assert (doc["state"], doc["comment"]) == ("waiting", "")
        assert m.db.magic_fences.count_documents({}) == 0
        job_id = submit(m, "gpu-hosts")
        r = poll_job(m, "gpu-host-01", ["gpu-hosts"])
        assert r.status_code == 200 and r.json()["job_id"] == job_id
    finally:
        m.plugin.stop()


@SERVERS
def test_job_handed_out_while_the_agent_was_fenced_is_given_back(mongo, serve, server):
    """The fence lands between the poll's gate read and its marker (the handshake's window):
    the fencer saw no marker, so the poll's second gate read must give the job back."""
    m = MagicStack(mongo, serve, server=server)
    try:
        register(m, devices=DEVICES[:1])
        m.plugin.tick()
        job_id = submit(m, "gpu-hosts")
        gates = m.plugin.store.gates
        real_mark = gates.mark

        def fence_then_mark(agent, job, queue):
            m.plugin.store.fence_agents("lease-x", [agent], kind="device", reason="race")
            assert m.plugin.store.agent_busy(agent, include_agent_doc=False) is None
            return real_mark(agent, job, queue)

        gates.mark = fence_then_mark
        r = poll_job(m, "gpu-host-01", ["gpu-hosts"])
        assert r.status_code == 204
        job = m.db.jobs.find_one({"job_id": job_id})
        assert job["result_data"]["job_state"] == "waiting"
        assert "agent_id" not in job["result_data"]
        assert not m.db.agents.find_one({"name": "gpu-host-01"}).get("job_id")
        assert m.db.magic_dispatch.count_documents({}) == 0
    finally:
        m.plugin.stop()


def test_a_forced_apply_tells_the_jobs_it_cancels_why(mongo, serve):
    """A job cancelled because apply --force removed its magic queue learns why in its events
    (newer Testflinger) and its output, as a forced drain's do."""
    m = MagicStack(mongo, serve, server="newer")
    try:
        job_id = submit(m, "one-gpu-vm")
        r = requests.put(f"{m.url}/v1/magic/queues", headers=m.headers("admin"), timeout=10,
                         json={"yaml": MAGIC_YAML.replace("one-gpu-vm:", "other-vm:"),
                               "source": "ops.yaml", "force": True})
        assert r.status_code == 200 and r.json()["cancelled"] == {"one-gpu-vm": 1}, r.text
        events = requests.get(f"{m.url}/v1/events/job/{job_id}", headers=m.headers("contributor"),
                              timeout=10).json()["events"]
        assert [e["event_name"] for e in events] == ["job_submitted", "job_cancelled"]
        assert "magic queue one-gpu-vm was removed" in events[-1]["detail"]
        assert "ops.yaml" in events[-1]["detail"]
        out = requests.get(f"{m.url}/v1/result/{job_id}/log/output",
                           headers=m.headers("contributor"), timeout=10).json()
        assert "cancelled before it ran" in out["output"]["setup"]["log_data"]
    finally:
        m.plugin.stop()


def test_a_job_submitted_while_a_forced_apply_cancels_is_told_why_too(mongo, serve):
    """A submit racing the forced apply's read of the waiting jobs is cancelled and told, not
    cancelled silently (the cancel was by queue) nor left waiting on a removed queue."""
    import copy
    import uuid

    m = MagicStack(mongo, serve, server="newer")
    try:
        first = submit(m, "one-gpu-vm")
        raw = m.db._db["jobs"]  # the mongomock collection under the locked handles
        real_find, raced = raw.find, []

        def find_then_submit(*args, **kwargs):
            found = list(real_find(*args, **kwargs))
            if not raced and args and "job_data.job_queue" in args[0]:
                # A job lands right after the read (inserted as the job service stores one).
                job = copy.deepcopy(raw.find_one({"job_id": first}, {"_id": 0}))
                job["job_id"] = str(uuid.uuid4())
                raw.insert_one(job)
                raced.append(job["job_id"])
            return iter(found)

        raw.find = find_then_submit
        try:
            r = requests.put(f"{m.url}/v1/magic/queues", headers=m.headers("admin"), timeout=10,
                             json={"yaml": MAGIC_YAML.replace("one-gpu-vm:", "other-vm:"),
                                   "source": "ops.yaml", "force": True})
        finally:
            del raw.find
        assert raced, "the racing submit did not happen"
        assert r.status_code == 200 and r.json()["cancelled"] == {"one-gpu-vm": 2}, r.text
        for job_id in (first, *raced):
            assert m.db.jobs.find_one({"job_id": job_id})["result_data"]["job_state"] == "cancelled"
            events = requests.get(f"{m.url}/v1/events/job/{job_id}",
                                  headers=m.headers("contributor"), timeout=10).json()["events"]
            assert events[-1]["event_name"] == "job_cancelled", (job_id, events)
    finally:
        m.plugin.stop()


@SERVERS
def test_a_cancel_the_agent_overwrote_is_repeated(mongo, serve, server):
    """TRIAL8: a force's cancel landing during ``allocate`` is overwritten by the agent's
    ``job_state: allocated`` (add_job_results is unguarded, TESTFLINGER.md §1.6); the agent then
    never sees it. The next tick cancels it again (a ``lease.repaired`` event says so); a job
    that ended (``complete``) is left as it is."""
    clock = Clock()
    m = MagicStack(mongo, serve, clock=clock, server=server)
    try:
        lease, name, job_id = forced_during(m, clock, "allocate")
        result_post(m, job_id, job_state="allocated")  # the agent's post after allocate
        assert m.db.jobs.find_one({"job_id": job_id})["result_data"]["job_state"] == "allocated"
        m.plugin.tick()
        assert m.db.jobs.find_one({"job_id": job_id})["result_data"]["job_state"] == "cancelled"
        events = m.plugin.events.list(limit=100)
        assert any(e["kind"] == "lease.repaired" and "cancelled again" in e["message"]
                   and e["lease_id"] == lease["_id"] for e in events), events
        result_post(m, job_id, job_state="complete")  # its outcome post: ended, left as it is
        m.plugin.tick()
        assert m.db.jobs.find_one({"job_id": job_id})["result_data"]["job_state"] == "complete"
    finally:
        m.plugin.stop()
