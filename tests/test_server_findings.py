"""A new user's findings on the server plugin, each reproduced in-process (Flask test client on
mongomock, a settable clock): a VM agent that never registers, lendable counts in status, a lent
device agent shown free, and applying a file that drops a queue with waiting jobs."""

from __future__ import annotations

import pytest

from conftest import MAGIC_YAML
from test_server_repairs import Env
from testflinger_magic import leases as L
from testflinger_magic import reconcile as R


@pytest.fixture
def env():
    return Env()


def test_a_vm_agent_that_never_registers_is_reported_and_the_lease_still_drains_idle(env):
    lease = env.bring_up(env.lend())
    vm1, vm2 = (vm["agent_name"] for vm in lease["vms"])
    env.agent(vm1, state="waiting", job_id="")  # vm2's agent failed to start
    env.plugin.tick()
    assert env.events("vm_agent.missing") == []  # still within the grace
    env.clock.t += R.VM_AGENT_GRACE + 1
    env.plugin.tick()
    env.plugin.tick()
    (event,) = env.events("vm_agent.missing")
    assert vm2 in event["message"] and event["data"]["agents"] == [vm2]
    status = env.c.get("/v1/magic/status", headers=env.A).get_json()
    assert status["queues"][0]["missing_vm_agents"] == [vm2]
    # idle_timeout (10m) later the lease drains on its registered agents alone.
    env.clock.t += 600
    env.plugin.tick()
    assert env.lease(lease["_id"])["state"] in ("draining", "restoring")


def test_the_vm_agent_grace_can_be_shrunk(env):
    env.plugin.engine.vm_agent_grace = 5.0
    lease = env.bring_up(env.lend())
    env.clock.t += 6
    env.plugin.tick()
    (event,) = env.events("vm_agent.missing")
    assert event["data"]["agents"] == [vm["agent_name"] for vm in lease["vms"]]


def test_status_counts_only_devices_lendable_now_and_shows_suspension(env):
    env.lend("gpu-host-01")
    env.lend("gpu-host-02")
    (q,) = env.c.get("/v1/magic/status", headers=env.A).get_json()["queues"]
    assert (q["devices_lendable"], q["devices_eligible"], q["suspended"]) == (0, 2, None)


def test_a_lent_device_agent_shown_waiting_is_fenced_again_by_the_tick(env):
    lease = env.lend()
    # The restarted device agent's startup post lands after the new claim fenced it.
    env.c.post("/v1/agents/data/gpu-host-01", json={"state": "waiting", "comment": ""})
    assert env.db.agents.find_one({"name": "gpu-host-01"})["state"] == "waiting"
    env.plugin.tick()
    doc = env.db.agents.find_one({"name": "gpu-host-01"})
    assert doc["state"] == "maintenance"
    assert doc["comment"] == L.lent_comment("one-gpu-vm", lease["_id"])
    # The device agent of a device that is not lent is left alone.
    assert env.db.agents.find_one({"name": "gpu-host-02"})["state"] == "waiting"


def test_the_restores_own_restart_of_the_device_agent_is_no_repair(env):
    """Issue 10 item 18: the restore starts the device agent before it reports ``returned``;
    the agent's startup post (``waiting``, TESTFLINGER.md §3.2) lands while the lease is still
    ``restoring``. That is the give-back under way, not a lent device shown free."""
    lease = env.report(env.lend(), result="error", message="deploy failed").get_json()
    assert lease["state"] == "restoring"
    env.c.post("/v1/agents/data/gpu-host-01", json={"state": "waiting", "comment": ""})
    env.plugin.tick()
    assert env.events("lease.repaired") == []
    assert env.db.agents.find_one({"name": "gpu-host-01"})["state"] == "waiting"
    env.report(lease, result="ok", to_state="returned")
    env.plugin.tick()
    assert env.events("lease.repaired") == []
    doc = env.db.agents.find_one({"name": "gpu-host-01"})
    assert (doc["state"], doc["comment"]) == ("waiting", "")


def test_refence_racing_a_return_gives_the_agent_back(env):
    lease = env.lend()
    store = env.plugin.store
    # Close the lease between the refence's read of open leases and its write.
    orig = store.agents.update_one

    def racing(flt, update, *a, **kw):
        if (update.get("$set") or {}).get("state") == "maintenance" and not racing.done:
            racing.done = True
            restoring = env.report(lease, result="error", message="deploy failed").get_json()
            env.report(restoring, result="ok", to_state="returned")
        return orig(flt, update, *a, **kw)
    racing.done = False
    env.c.post("/v1/agents/data/gpu-host-01", json={"state": "waiting"})
    store.agents.update_one = racing
    try:
        store.reassert_device_fences()
    finally:
        store.agents.update_one = orig
    assert racing.done
    assert env.db.agents.find_one({"name": "gpu-host-01"})["state"] == "waiting"


def put_queues(env, yaml, **kw):
    return env.c.put("/v1/magic/queues", headers=env.A, json={"yaml": yaml, **kw})


OTHER = MAGIC_YAML.replace("one-gpu-vm:", "other-vm:")


def test_removing_a_queue_with_waiting_jobs_is_refused_unless_forced(env):
    job = env.submit()
    env.submit()
    r = put_queues(env, OTHER)
    assert r.status_code == 409
    body = r.get_json()
    assert body["queues"] == [{"name": "one-gpu-vm", "waiting": 2}]
    assert "one-gpu-vm (2 waiting jobs)" in body["message"]
    assert env.db.magic_queues.find_one({"_id": "one-gpu-vm"}) is not None
    assert env.db.magic_queues.find_one({"_id": "other-vm"}) is None  # nothing written
    r = put_queues(env, OTHER, force=True)
    assert r.status_code == 200, r.get_data(as_text=True)
    assert r.get_json()["cancelled"] == {"one-gpu-vm": 2}
    assert env.db.jobs.find_one({"job_id": job})["result_data"]["job_state"] == "cancelled"
    (event,) = env.events("queue.removed")
    assert "2 waiting jobs cancelled" in event["message"]
    # The test engineer learns why where testflinger-cli poll/results look: the job's output
    # (a Testflinger log fragment; no job events here: this server keeps none).
    (frag,) = env.db.logs.find({"job_id": job})
    assert (frag["log_type"], frag["phase"]) == ("output", "setup")
    assert "magic queue one-gpu-vm was removed from the definitions" in frag["log_data"]
    assert "jobs_events" not in env.db.list_collection_names()


def test_removing_a_queue_without_waiting_jobs_needs_no_force(env):
    r = put_queues(env, OTHER)
    assert r.status_code == 200 and r.get_json()["removed"] == ["one-gpu-vm"]


def test_refence_leaves_a_claim_in_progress_alone(env):
    # A lease inserted by a claim that has not fenced the agent yet: the claim's own CAS from
    # waiting must still find the agent waiting.
    env.db.magic_leases.insert_one({"_id": "lease-x", "device": "gpu-host-01",
                                    "queue": "one-gpu-vm", "state": "claimed", "generation": 0,
                                    "device_agent_before": None})
    assert env.plugin.store.reassert_device_fences() == []
    assert env.db.agents.find_one({"name": "gpu-host-01"})["state"] == "waiting"


def test_a_returned_device_is_lent_again_only_once_its_agent_is_back(env):
    """Issue 10 item 18: the restore reports ``returned`` once it started the device agent,
    not once the agent posted; lent again before its startup post (``waiting``, TESTFLINGER.md
    §3.2), the device would have that post undo the new claim's ``offline``. The planner waits
    for the post (the give-back's sign of life) before lending the device again."""
    from datetime import datetime, timezone

    lease = env.lend("gpu-host-01")
    restoring = env.report(lease, result="error", message="deploy failed").get_json()
    env.report(restoring, result="ok", to_state="returned")
    env.agent("gpu-host-02", state="test", job_id="busy-at-home")  # only gpu-host-01 may serve
    env.submit()
    env.clock.t += 1
    env.plugin.tick()
    open_states = {"$nin": ["returned", "failed"]}
    assert env.db.magic_leases.count_documents({"device": "gpu-host-01",
                                                "state": open_states}) == 0
    plan = env.c.get("/v1/magic/plan", headers=env.A).get_json()
    assert any("1 returning" in a["reason"] for a in plan["actions"] if a["kind"] == "blocked"), plan
    # The restarted agent's startup post: now it may be lent again, and nothing is repaired.
    env.db.agents.update_one({"name": "gpu-host-01"}, {"$set": {
        "state": "waiting", "comment": "",
        "updated_at": datetime.fromtimestamp(env.clock.t, timezone.utc)}})
    env.clock.t += 1
    env.plugin.tick()
    assert env.db.magic_leases.count_documents({"device": "gpu-host-01",
                                                "state": open_states}) == 1
    env.plugin.tick()
    assert env.events("lease.repaired") == []
