"""Review findings on the server plugin, each reproduced in-process (Flask test client on
mongomock): VM fences during bring-up, repairs of interrupted closes and lost undrain races,
failed leases (reconcile and unquarantine), the GET /v1/job hook failing closed, deregistration,
overdue leases and stale agent hosts, typed ``vms`` reports, and a read-only plan."""

from __future__ import annotations

import pytest

from conftest import MAGIC_YAML, mini_testflinger, seed
from testflinger_magic import db as tfdb
from testflinger_magic import leases as L
from testflinger_magic import queues
from testflinger_magic import reconcile as R
from testflinger_magic.server import auth, init_app

BRINGUP = ("fenced", "deploying", "splitting", "enrolling")


class Clock:
    def __init__(self, t=2_000_000_000.0):
        self.t = t

    def __call__(self):
        return self.t


class Env:
    """One (or more) plugin replicas on one database, with agent and admin headers."""

    def __init__(self, replicas=1, devices=("gpu-host-01", "gpu-host-02")):
        self.clock = Clock()
        self.db = tfdb.connect()
        seed(self.db)
        self.apps, self.plugins = [], []
        for _ in range(replicas):
            app = mini_testflinger(self.db)
            plugin = init_app(app, self.db, definitions=queues.load_text(MAGIC_YAML),
                              start_ticker=False, clock=self.clock)
            plugin.kick = lambda *a, **k: None
            self.apps.append(app)
            self.plugins.append(plugin)
        self.plugin = self.plugins[0]
        self.c = self.apps[0].test_client()
        key = self.apps[0].config["JWT_SIGNING_KEY"]
        self.H = {"Authorization": "Bearer " + auth.issue_token(key, "a", "agent")}
        self.A = {"Authorization": "Bearer " + auth.issue_token(key, "m", "admin")}
        self.register(devices)

    def register(self, devices, host="h"):
        return self.c.post(f"/v1/magic/agent-hosts/{host}", headers=self.H, json={"devices": [
            {"agent_name": d, "maas_system_id": d, "gpus": 2, "home_queues": ["gpu-hosts"]}
            for d in devices]})

    def lend(self, device="gpu-host-01"):
        r = self.c.post("/v1/magic/leases", headers=self.A,
                        json={"device": device, "queue": "one-gpu-vm"})
        assert r.status_code == 201, r.get_data(as_text=True)
        return r.get_json()

    def report(self, lease, **kw):
        return self.c.post(f"/v1/magic/leases/{lease['_id']}/report", headers=self.H, json={
            "agent_host": "h", "generation": lease["generation"], "state": lease["state"], **kw})

    def bring_up(self, lease, to=("fenced", "deploying", "splitting", "enrolling", "active")):
        for state in to:
            r = self.report(lease, result="ok", to_state=state)
            assert r.status_code == 200, r.get_data(as_text=True)
            lease = r.get_json()
        return lease

    def poll(self, agent, queue="one-gpu-vm"):
        self.c.set_cookie("agent_name", agent)
        return self.c.get("/v1/job", query_string={"queue": queue}, headers=self.H)

    def submit(self, queue="one-gpu-vm"):
        return self.c.post("/v1/job", json={"job_queue": queue}).get_json()["job_id"]

    def agent(self, name, **fields):
        self.c.post(f"/v1/agents/data/{name}", json={"queues": ["one-gpu-vm"], **fields})

    def lease(self, lease_id):
        return self.db.magic_leases.find_one({"_id": lease_id})

    def fenced(self, name):
        return self.db.magic_fences.find_one({"_id": name}) is not None

    def events(self, kind):
        return list(self.db.magic_events.find({"kind": kind}))


@pytest.fixture
def env():
    return Env()


# ---------------------------------------------------------------- 1. VM fences during bring-up

def test_vm_agents_are_fenced_from_claim_until_active(env):
    lease = env.lend()
    names = [vm["agent_name"] for vm in lease["vms"]]
    assert all(env.fenced(n) for n in names)
    lease = env.bring_up(lease, BRINGUP)
    env.submit()
    # enroll() started vm1's agent while the lease is still enrolling: it gets no job.
    env.agent(names[0], state="waiting", job_id="")
    assert env.poll(names[0]).status_code == 204
    lease = env.bring_up(lease, ("active",))
    assert not any(env.fenced(n) for n in names)
    assert env.poll(names[0]).status_code == 200


def test_bringup_error_restores_a_lease_whose_vm_agents_never_got_a_job(env):
    lease = env.bring_up(env.lend(), BRINGUP)
    env.submit()
    vm1 = lease["vms"][0]["agent_name"]
    env.agent(vm1, state="waiting", job_id="")
    assert env.poll(vm1).status_code == 204
    lease = env.report(lease, result="error", message="vm2 commissioning failed").get_json()
    assert lease["state"] == "restoring"
    assert env.fenced(vm1) and env.plugin.store.agent_busy(vm1) is None


def test_claim_undo_removes_the_vm_fences(env):
    env.db.magic_dispatch.insert_one({"_id": "m", "agent": "gpu-host-01", "phase": "pending",
                                      "job_id": None, "queue": None, "at": env.clock()})
    r = env.c.post("/v1/magic/leases", headers=env.A,
                   json={"device": "gpu-host-01", "queue": "one-gpu-vm"})
    assert r.status_code == 409
    assert env.db.magic_fences.count_documents({}) == 0


# ---------------------------------------------------------------- 2. interrupted close

def test_a_crash_between_close_and_cleanup_is_repaired_by_the_next_tick(env):
    lease = env.report(env.lend("gpu-host-02"), result="error", message="deploy failed").get_json()
    store = env.plugin.store
    orig = store.cleanup
    store.cleanup = lambda lease: (_ for _ in ()).throw(RuntimeError("server killed here"))
    assert env.report(lease, result="ok", to_state="returned").status_code == 500
    store.cleanup = orig
    assert env.lease(lease["_id"])["state"] == "returned"
    assert env.fenced("gpu-host-02")
    env.plugin.tick()  # a close in progress looks the same for a while: left alone
    assert env.fenced("gpu-host-02") and env.events("lease.repaired") == []
    env.clock.t += L.CLOSE_CLEANUP_AGE + 1
    env.plugin.tick()
    assert not env.fenced("gpu-host-02")
    assert env.db.magic_device_claims.find_one({"_id": "gpu-host-02"}) is None
    assert env.db.agents.find_one({"name": "gpu-host-02"})["state"] == "waiting"
    repaired = env.events("lease.repaired")
    assert [(e["lease_id"], e["queue"], e["device"]) for e in repaired] == [
        (lease["_id"], "one-gpu-vm", "gpu-host-02")]
    assert "one-gpu-vm" in repaired[0]["message"] and "gpu-host-02" in repaired[0]["message"]
    env.plugin.tick()  # nothing left to repair
    assert len(env.events("lease.repaired")) == 1


def _restoring(env, device="gpu-host-01"):
    """A lease of ``device`` brought up, drained and restoring (an ordinary idle drain)."""
    lease = env.bring_up(env.lend(device))
    r = env.report(lease, result="error", message="vm lost")  # active -> draining
    lease = r.get_json()
    lease = env.plugin.store.transition(lease["_id"], "draining", lease["generation"],
                                        "restoring", "idle")
    return lease


def test_a_close_that_finishes_between_the_ticks_read_and_its_repair_is_not_a_repair(env):
    """The tick reads the claims once (TickReads) and then the leases they name: a close (the
    daemon's report, or another replica) that runs whole in between leaves the tick holding a
    claim that is gone and a lease that is returned. The repair reads the lease's claim and
    fences again before it acts: nothing to repair, no warning, no event (issue 10 item 18)."""
    from testflinger_magic.tickreads import TickReads

    lease = _restoring(env)
    reads = TickReads(env.db)
    assert [c["lease_id"] for c in reads.claims()] == [lease["_id"]]  # the tick's shared read
    reads.fences()
    assert env.report(lease, result="ok", to_state="returned").status_code == 200  # the close
    assert env.plugin.engine.store.repair_closed(reads) == []
    env.plugin.engine.repair(TickReads(env.db))
    assert env.events("lease.repaired") == []
    assert env.db.magic_device_claims.find_one({"_id": "gpu-host-01"}) is None


def test_a_tick_that_runs_inside_a_close_does_not_call_it_interrupted(env):
    """The tick runs between a close's compare-and-set (the lease is ``returned``) and its
    cleanup (claim and fences still there): a close in progress, not an interrupted one. The
    repair leaves a lease returned less than CLOSE_CLEANUP_AGE ago alone; the close finishes
    its own cleanup and no ``lease.repaired`` appears."""
    from testflinger_magic.tickreads import TickReads

    lease = _restoring(env)
    store = env.plugin.store
    orig = store.cleanup
    ran = []

    def cleanup_after_a_tick(doc):
        if not ran:
            ran.append(doc["_id"])
            # The tick's repairs, interleaved: after the close's CAS, before its cleanup.
            env.plugin.engine.repair(TickReads(env.db))
            assert env.fenced("gpu-host-01")  # the tick left the close's cleanup to the close
        return orig(doc)

    store.cleanup = cleanup_after_a_tick
    try:
        assert env.report(lease, result="ok", to_state="returned").status_code == 200
    finally:
        store.cleanup = orig
    assert ran == [lease["_id"]]
    assert env.events("lease.repaired") == []
    assert not env.fenced("gpu-host-01")
    assert env.db.magic_device_claims.find_one({"_id": "gpu-host-01"}) is None
    env.clock.t += L.CLOSE_CLEANUP_AGE + 1
    env.plugin.tick()
    assert env.events("lease.repaired") == []


def test_a_tick_between_the_active_reports_cas_and_its_lift_is_not_a_repair(env):
    """The tick runs between the ``enrolling -> active`` report's compare-and-set and the
    report's own lift of the VM fences: the lease is active and its VM agents still fenced, a
    report in progress, not a fence left behind. repair_active_fences reads the lease again and
    leaves a lease active for less than ACTIVE_LIFT_AGE s to the report (issue 10 item 18)."""
    from testflinger_magic.tickreads import TickReads

    lease = env.bring_up(env.lend(), BRINGUP)
    names = [vm["agent_name"] for vm in lease["vms"]]
    store = env.plugin.store
    orig = store.lift_vm_fences
    ran = []

    def lift_after_a_tick(doc):
        if not ran:
            ran.append(doc["_id"])
            # The tick's repairs, interleaved: after the report's CAS, before its lift.
            env.plugin.engine.repair(TickReads(env.db))
            assert all(env.fenced(n) for n in names)  # left to the report
        return orig(doc)

    store.lift_vm_fences = lift_after_a_tick
    try:
        assert env.report(lease, result="ok", to_state="active").status_code == 200
    finally:
        del store.lift_vm_fences
    assert ran == [lease["_id"]]
    assert not any(env.fenced(n) for n in names)
    assert env.events("lease.repaired") == []
    env.clock.t += L.ACTIVE_LIFT_AGE + 1
    env.plugin.tick()
    assert env.events("lease.repaired") == []


def test_a_tick_between_a_closes_fence_delete_and_its_gate_sync_is_not_a_repair(env):
    """The tick runs inside a close's cleanup, after the fences went and before the gates were
    synced: the gates disagree with the fences for a moment. The gate repair reads the lease
    again and leaves the agents of a lease closed less than CLOSE_CLEANUP_AGE s ago to its
    close: no ``lease.repaired`` (issue 10 item 18)."""
    from testflinger_magic.tickreads import TickReads

    lease = _restoring(env)
    store = env.plugin.store
    gates = store.gates
    orig_cleanup, orig_sync = store.cleanup, gates.sync
    state = {"in_cleanup": False, "ran": False}

    def sync_after_a_tick(names, *a, **kw):
        if state["in_cleanup"] and not state["ran"]:
            state["ran"] = True
            assert not env.fenced("gpu-host-01")  # the close deleted the fences already
            env.plugin.engine.repair(TickReads(env.db))
            assert env.db.magic_agent_gate.find_one({"_id": "gpu-host-01"})["fenced"]
        return orig_sync(names, *a, **kw)

    def cleanup(doc):
        state["in_cleanup"] = True
        try:
            return orig_cleanup(doc)
        finally:
            state["in_cleanup"] = False

    store.cleanup, gates.sync = cleanup, sync_after_a_tick
    try:
        assert env.report(lease, result="ok", to_state="returned").status_code == 200
    finally:
        del store.cleanup, gates.sync
    assert state["ran"]
    assert not env.db.magic_agent_gate.find_one({"_id": "gpu-host-01"})["fenced"]
    assert env.events("lease.repaired") == []
    env.clock.t += L.CLOSE_CLEANUP_AGE + 1
    env.plugin.tick()
    assert env.events("lease.repaired") == []


def test_close_cleans_up_even_if_the_event_log_fails(env):
    lease = env.report(env.lend(), result="error", message="deploy failed").get_json()
    events = env.plugin.store.events
    orig = events.record

    def broken(kind, *a, **kw):
        if kind == "lease.returned":
            raise RuntimeError("AutoReconnect")
        return orig(kind, *a, **kw)

    events.record = broken
    r = env.report(lease, result="ok", to_state="returned")
    events.record = orig
    assert r.status_code == 200 and r.get_json()["state"] == "returned"
    assert not env.fenced("gpu-host-01")
    assert env.db.magic_device_claims.find_one({"_id": "gpu-host-01"}) is None


# ---------------------------------------------------------------- 3. unquarantine frees a failed lease

def fail(env, device="gpu-host-01"):
    lease = env.report(env.lend(device), result="error", message="deploy failed").get_json()
    lease = env.report(lease, result="error", message="restore failed").get_json()
    assert lease["state"] == "failed"
    return lease


def test_unquarantine_releases_a_failed_lease_and_gives_the_agent_back(env):
    lease = fail(env)
    assert env.c.post("/v1/magic/devices/gpu-host-01/quarantine", headers=env.A,
                      json={"reason": "look at it"}).status_code == 200
    r = env.c.delete("/v1/magic/devices/gpu-host-01/quarantine", headers=env.A)
    assert r.status_code == 200 and not r.get_json()["quarantined"]
    assert env.db.magic_device_claims.find_one({"_id": "gpu-host-01"}) is None
    assert env.db.magic_fences.count_documents({"lease_id": lease["_id"]}) == 0
    # Offline until the agent posts (TRIAL14 F5: a failed restore may have left it stopped,
    # and Testflinger listed it as waiting); lendable again once it posts waiting.
    agent = env.db.agents.find_one({"name": "gpu-host-01"})
    assert agent["state"] == "offline", agent
    assert agent["comment"].endswith("offline until its testflinger-agent posts (start it if "
                                     "it is stopped)"), agent
    assert [e["device"] for e in env.events("device.released")] == ["gpu-host-01"]
    env.db.agents.update_one({"name": "gpu-host-01"},
                             {"$set": {"state": "waiting", "comment": ""}})  # its post
    assert env.lend()["state"] == "claimed"  # lendable again


def test_unquarantine_lets_the_device_agent_serve_its_home_queue_again(env):
    fail(env)
    env.submit("gpu-hosts")
    assert env.poll("gpu-host-01", "gpu-hosts").status_code == 204
    env.c.delete("/v1/magic/devices/gpu-host-01/quarantine", headers=env.A)
    assert env.poll("gpu-host-01", "gpu-hosts").status_code == 200


def test_release_keeps_an_agent_comment_someone_else_wrote(env):
    fail(env)
    env.db.agents.update_one({"name": "gpu-host-01"}, {"$set": {"state": "maintenance",
                                                                "comment": "PSU replaced"}})
    env.c.delete("/v1/magic/devices/gpu-host-01/quarantine", headers=env.A)
    agent = env.db.agents.find_one({"name": "gpu-host-01"})
    assert (agent["state"], agent["comment"]) == ("maintenance", "PSU replaced")
    assert env.db.magic_device_claims.find_one({"_id": "gpu-host-01"}) is None


# ---------------------------------------------------------------- 4. failed leases are held

def test_a_failed_device_is_not_planned_every_tick(env):
    fail(env)
    # The restore got as far as restarting the device agent: it says waiting again.
    env.db.agents.update_one({"name": "gpu-host-01"}, {"$set": {"state": "waiting", "comment": ""}})
    env.submit()
    refused = len(env.events("claim.refused"))
    plan = env.plugin.engine.plan_only()
    assert [(a.kind, a.device) for a in plan] == [("lend", "gpu-host-02")]
    for _ in range(3):
        env.plugin.tick()
    assert len(env.events("claim.refused")) == refused
    assert env.db.magic_leases.find_one({"device": "gpu-host-02"})["state"] == "claimed"


# ---------------------------------------------------------------- 5. undrain races, force CAS

def active_with_agents(env):
    lease = env.bring_up(env.lend())
    for vm in lease["vms"]:
        env.agent(vm["agent_name"], state="waiting", job_id="")
    return lease


def test_undrain_racing_restore_leaves_no_fenced_active_lease():
    env = Env(replicas=2)
    a, b = env.plugins
    lease = active_with_agents(env)
    a.engine.apply(R.Action("drain", "idle", lease_id=lease["_id"], generation=lease["generation"],
                            data={"kind": "idle", "grace": 60, "force": False}))
    lease = env.lease(lease["_id"])
    orig = a.store.fence_agents

    def racing(*args, **kw):  # replica B undrains between A's read and A's fence
        b.engine.apply(R.Action("undrain", "demand back", lease_id=lease["_id"],
                                generation=lease["generation"]))
        return orig(*args, **kw)

    a.store.fence_agents = racing
    with pytest.raises(L.StaleGeneration):
        a.engine.apply(R.Action("restore", "all idle", lease_id=lease["_id"],
                                generation=lease["generation"]))
    a.store.fence_agents = orig
    assert env.lease(lease["_id"])["state"] == "active"
    vm1 = lease["vms"][0]["agent_name"]
    assert env.fenced(vm1)  # A's late fence
    env.submit()
    a.tick()  # an undrain just now: its lift is left to it (ACTIVE_LIFT_AGE)
    assert env.fenced(vm1) and env.events("lease.repaired") == []
    env.clock.t += L.ACTIVE_LIFT_AGE + 1
    a.tick()
    assert not env.fenced(vm1)
    assert env.poll(vm1).status_code == 200


def test_a_drain_after_the_repair_read_keeps_its_fence(env):
    """lift_vm_fences only removes fences at or below the generation it saw active: a drain
    that commits after the repair read fences with a higher generation, which stays."""
    lease = active_with_agents(env)
    seen = env.lease(lease["_id"])  # the repair's read: active
    env.plugin.engine.apply(R.Action("drain", "idle", lease_id=lease["_id"],
                                     generation=seen["generation"],
                                     data={"kind": "idle", "grace": 60, "force": False}))
    assert env.plugin.store.lift_vm_fences(seen) == 0
    assert all(env.fenced(vm["agent_name"]) for vm in seen["vms"])


def test_a_crash_after_undrain_cas_is_repaired(env):
    lease = active_with_agents(env)
    env.plugin.engine.apply(R.Action("drain", "idle", lease_id=lease["_id"],
                                     generation=lease["generation"],
                                     data={"kind": "idle", "grace": 60, "force": False}))
    lease = env.lease(lease["_id"])
    env.plugin.store.lift_vm_fences = lambda lease: (_ for _ in ()).throw(RuntimeError("killed"))
    with pytest.raises(RuntimeError):
        env.plugin.engine.apply(R.Action("undrain", "demand", lease_id=lease["_id"],
                                         generation=lease["generation"]))
    del env.plugin.store.lift_vm_fences
    assert env.lease(lease["_id"])["state"] == "active"
    env.clock.t += L.ACTIVE_LIFT_AGE + 1  # a lease active for longer: the undrain died
    env.plugin.tick()
    assert not any(env.fenced(vm["agent_name"]) for vm in lease["vms"])
    assert [e["lease_id"] for e in env.events("lease.repaired")] == [lease["_id"]]


def test_force_cancels_nothing_when_its_cas_loses(env):
    lease = active_with_agents(env)
    vm1 = lease["vms"][0]["agent_name"]
    job_id = env.submit()
    assert env.poll(vm1).status_code == 200
    env.agent(vm1, state="test", job_id=job_id)
    env.plugin.engine.apply(R.Action("drain", "reclaim", lease_id=lease["_id"],
                                     generation=lease["generation"],
                                     data={"kind": "reclaim", "grace": 60, "force": False}))
    lease = env.lease(lease["_id"])
    store = env.plugin.store
    orig = store.progress

    def other_replica_first(lease_id, state, generation, **kw):
        env.db.magic_leases.update_one({"_id": lease_id}, {"$inc": {"generation": 1}})
        return orig(lease_id, state, generation, **kw)

    store.progress = other_replica_first
    with pytest.raises(L.StaleGeneration):
        env.plugin.engine.apply(R.Action("force", "grace over", lease_id=lease["_id"],
                                         generation=lease["generation"]))
    store.progress = orig
    assert env.db.jobs.find_one({"job_id": job_id})["result_data"]["job_state"] == "running"


# ---------------------------------------------------------------- 6. GET /v1/job fails closed

@pytest.mark.parametrize("broken", ["read", "mark"])
def test_job_poll_hook_failure_answers_no_job(env, broken):
    """Whatever fails (the gate read before the handler, the marker write after it), the poll
    answers 204 and no job stays handed out: the fence was not (re-)checked."""
    env.plugin.store.gates.ensure(["gpu-host-02"])  # watched, not fenced
    job_id = env.submit("gpu-hosts")

    def boom(*a, **kw):
        raise RuntimeError("AutoReconnect: primary stepped down")

    setattr(env.plugin.store.gates, broken, boom)
    r = env.poll("gpu-host-02", "gpu-hosts")
    assert r.status_code == 204
    assert env.db.jobs.find_one({"job_id": job_id})["result_data"]["job_state"] == "waiting"
    assert env.db.magic_dispatch.count_documents({}) == 0
    delattr(env.plugin.store.gates, broken)
    r = env.poll("gpu-host-02", "gpu-hosts")
    assert r.status_code == 200 and r.get_json()["job_id"] == job_id


# ---------------------------------------------------------------- 7. deregistration, alerts

def test_register_deregisters_devices_no_longer_listed(env):
    r = env.register(["gpu-host-01"])
    assert r.status_code == 200
    assert env.db.magic_devices.find_one({"_id": "gpu-host-02"}) is None
    assert [e["data"]["devices"] for e in env.events("device.deregistered")] == [["gpu-host-02"]]
    env.db.agents.update_one({"name": "gpu-host-01"}, {"$set": {"state": "test", "job_id": "x"}})
    env.submit()
    env.plugin.tick()
    assert env.db.magic_leases.count_documents({}) == 0  # gpu-host-02 is not lent


def test_register_refuses_to_drop_a_device_with_a_lease(env):
    lease = env.lend("gpu-host-02")
    r = env.register(["gpu-host-01"])
    assert r.status_code == 409
    assert "gpu-host-02" in r.get_json()["message"] and lease["_id"] in r.get_json()["message"]
    assert env.db.magic_devices.find_one({"_id": "gpu-host-02"}) is not None


def test_a_claim_of_a_deregistered_device_is_refused(env):
    env.register(["gpu-host-01"])
    q = env.plugin.definition("one-gpu-vm")
    with pytest.raises(L.ClaimRefused, match="not registered"):
        env.plugin.store.claim("gpu-host-02", q, "h", 2, "stale plan")
    assert env.db.magic_device_claims.count_documents({}) == 0


def test_overdue_leases_and_stale_hosts_in_status_events_and_metrics(env):
    lease = env.report(env.lend(), result="error", message="deploy failed").get_json()
    env.clock.t += L.RESTORE_TIMEOUT + 1
    env.plugin.tick()
    env.plugin.tick()
    status = env.c.get("/v1/magic/status", headers=env.A).get_json()
    assert [o["lease_id"] for o in status["overdue_leases"]] == [lease["_id"]]
    assert [h["name"] for h in status["stale_agent_hosts"]] == ["h"]
    assert [e["lease_id"] for e in env.events("lease.overdue")] == [lease["_id"]]
    assert len(env.events("agent_host.stale")) == 1
    text = env.c.get("/v1/magic/metrics").get_data(as_text=True)
    assert "magic_leases_overdue 1.0" in text and "magic_agent_hosts_stale 1.0" in text
    # The daemon's report is not 409'd by the overdue mark.
    assert env.report(lease, result="ok", to_state="returned").status_code == 200
    env.c.post("/v1/magic/agent-hosts/h/heartbeat", headers=env.H, json={"leases": []})
    status = env.c.get("/v1/magic/status", headers=env.A).get_json()
    assert status["overdue_leases"] == [] and status["stale_agent_hosts"] == []


# ---------------------------------------------------------------- 9. typed vms reports

@pytest.mark.parametrize("vm, field", [
    ({"index": 0, "agent_name": "gpu-host-02"}, "vms.0.agent_name"),
    ({"index": 0, "ip.v4": "10.0.0.1"}, "vms.0.ip.v4"),
    ({"index": 0, "metrics_port": "8000"}, "vms.0.metrics_port"),
    ({"index": 0, "gpus": [1]}, "vms.0.gpus"),
    ({"index": True}, "vms.0.index"),
])
def test_report_vms_accepts_only_typed_fields(env, vm, field):
    lease = env.lend()
    r = env.report(lease, result="progress", vms=[vm])
    assert r.status_code == 422
    assert field in r.get_json()["detail"]["json"]
    assert env.lease(lease["_id"])["generation"] == lease["generation"]


def test_report_vms_accepts_the_daemons_fields(env):
    """What the daemon's split and enroll steps report (agent_host/steps.py), each at its step
    (engine.VM_STEP_FIELDS); the enroll report repeats domain and GPUs unchanged."""
    lease = env.bring_up(env.lend(), to=("fenced", "deploying", "splitting"))
    vm = lease["vms"][0]
    r = env.report(lease, result="ok", to_state="enrolling", vms=[{
        "index": 0, "name": vm["name"], "agent_name": vm["agent_name"], "domain": "d",
        "mac": vm["mac"], "gpus": ["0000:01:00.0"], "disk": "/x.qcow2"}])
    assert r.status_code == 200, r.get_data(as_text=True)
    r = env.report(r.get_json(), result="ok", to_state="active", vms=[{
        "index": 0, "maas_system_id": "abc", "ip": "10.0.0.5", "metrics_port": 8001,
        "domain": "d", "gpus": ["0000:01:00.0"]}])
    assert r.status_code == 200, r.get_data(as_text=True)
    assert r.get_json()["vms"][0]["ip"] == "10.0.0.5"
    r = env.report(r.get_json(), result="progress", vms=[{"index": 0, "metrics_port": 8002}])
    assert r.status_code == 200 and r.get_json()["vms"][0]["metrics_port"] == 8002


# ---------------------------------------------------------------- 10. plan is a dry run

def test_plan_writes_nothing(env):
    lease = active_with_agents(env)
    vm1 = lease["vms"][0]["agent_name"]
    env.db.magic_leases.update_one({"_id": lease["_id"]}, {"$set": {"idle_since": None}})
    env.db.jobs.insert_one({"job_id": "old", "job_data": {"job_queue": "one-gpu-vm"},
                            "result_data": {"job_state": "complete"}})
    env.db.magic_dispatch.insert_one({"_id": "done-1", "agent": vm1, "phase": "done",
                                      "job_id": "old", "queue": "one-gpu-vm", "at": env.clock()})
    before = env.lease(lease["_id"])
    r = env.c.get("/v1/magic/plan", headers=env.A)
    assert r.status_code == 200
    assert env.lease(lease["_id"]) == before
    assert env.db.magic_dispatch.find_one({"_id": "done-1"}) is not None


def test_one_index_on_vm_agent_names(env):
    keys = [list(spec["key"]) for spec in env.db.magic_leases.index_information().values()]
    assert [k for k in keys if k and k[0][0] == "vms.agent_name"] == \
        [[("vms.agent_name", 1), ("admission", 1)]]
