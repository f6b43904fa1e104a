"""The lab trial's wrong lending decisions (see tests/test_reconcile_trial.py for the plan()
rules), through the real engine: the Flask test client on mongomock with a settable clock
(test_server_repairs.Env), daemon reports posted as the agent host posts them."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from conftest import MAGIC_YAML
from test_server_repairs import Env
from testflinger_magic import reconcile as R

OPEN = {"$nin": ["returned", "failed"]}

RECLAIM_YAML = MAGIC_YAML.replace(
    "      idle_timeout: 10m\n",
    "      idle_timeout: 10m\n      reclaim: {owner_wait: 5s, grace: 2s}\n").replace(
    "max_starting: 1", "max_starting: 2")


@pytest.fixture
def env():
    return Env()


def apply(env, yaml):
    r = env.c.put("/v1/magic/queues", headers=env.A, json={"yaml": yaml})
    assert r.status_code == 200, r.get_data(as_text=True)


def active_with_busy_vms(env, device):
    lease = env.bring_up(env.lend(device))
    for n, vm in enumerate(lease["vms"]):
        env.agent(vm["agent_name"], state="test", job_id=f"{device}-job{n}")
    return lease


def post_at(env, name, t, **fields):
    """The agent's own post, stamped with the test's clock (the mini server stamps real time)."""
    env.db.agents.update_one({"name": name}, {"$set": {
        **fields, "updated_at": datetime.fromtimestamp(t, timezone.utc)}})


def test_one_waiting_home_job_takes_back_one_device(env):
    """Item 1: both devices lent, one job on the home queue gpu-hosts. The first reclaimed
    device comes back; until its restarted agent has taken the job (it posts, then asks for a
    job at once) it is the job's device, and the other lease is left alone."""
    apply(env, RECLAIM_YAML)
    l1 = active_with_busy_vms(env, "gpu-host-01")
    l2 = active_with_busy_vms(env, "gpu-host-02")
    env.submit("gpu-hosts")
    env.clock.t += 6  # past owner_wait 5s
    env.plugin.tick()
    draining = [l for l in (env.lease(l1["_id"]), env.lease(l2["_id"]))
                if l["state"] == "draining"]
    assert len(draining) == 1 and draining[0]["drain"]["kind"] == "reclaim"
    gone, kept = (l1, l2) if draining[0]["_id"] == l1["_id"] else (l2, l1)
    # Grace over: forced, its VM agents stop, the lease restores and the device comes back.
    env.clock.t += 3
    env.plugin.tick()
    for vm in gone["vms"]:
        env.agent(vm["agent_name"], state="waiting", job_id="")
    env.clock.t += 1
    env.plugin.tick()
    restoring = env.lease(gone["_id"])
    assert restoring["state"] == "restoring"
    r = env.report(restoring, result="ok", to_state="returned")
    assert r.status_code == 200, r.get_data(as_text=True)
    # 28 ms later, before the device agent's startup post: the trial reclaimed the other one.
    env.clock.t += 0.028
    env.plugin.tick()
    assert env.lease(kept["_id"])["state"] == "active"
    # The startup post (waiting): the agent asks for the job right after it.
    post_at(env, gone["device"], env.clock.t, state="waiting", comment="")
    env.clock.t += 1
    env.plugin.tick()
    assert env.lease(kept["_id"])["state"] == "active"
    # It took the job: the owner has no job waiting, nothing to reclaim.
    job = env.db.jobs.find_one({"job_data.job_queue": "gpu-hosts",
                                "result_data.job_state": "waiting"})
    env.db.jobs.update_one({"_id": job["_id"]}, {"$set": {"result_data.job_state": "setup"}})
    post_at(env, gone["device"], env.clock.t, state="setup", job_id=job["job_id"])
    env.clock.t += 60
    env.plugin.tick()
    assert env.lease(kept["_id"])["state"] == "active"
    assert len(env.events("lease.draining")) == 1


def test_a_returned_device_whose_agent_never_takes_the_job_does_not_hold_the_reclaim(env):
    """Bounded: an agent that posted waiting but has not taken the owner's job
    ``AGENT_PICKUP`` seconds later (it asks every polling_interval) no longer counts; the next
    device is reclaimed."""
    apply(env, RECLAIM_YAML)
    l1 = active_with_busy_vms(env, "gpu-host-01")
    env.submit("gpu-hosts")
    env.clock.t += 6
    env.plugin.tick()
    assert env.lease(l1["_id"])["state"] == "draining"
    env.clock.t += 3
    env.plugin.tick()
    for vm in l1["vms"]:
        env.agent(vm["agent_name"], state="waiting", job_id="")
    env.clock.t += 1
    env.plugin.tick()
    env.report(env.lease(l1["_id"]), result="ok", to_state="returned")
    env.clock.t += 0.5
    post_at(env, "gpu-host-01", env.clock.t, state="waiting", comment="")
    l2 = active_with_busy_vms(env, "gpu-host-02")
    env.plugin.tick()
    assert env.lease(l2["_id"])["state"] == "active"
    env.clock.t += R.AGENT_PICKUP + 1
    env.plugin.tick()
    assert env.lease(l2["_id"])["state"] == "draining"


def test_a_bringup_whose_only_job_was_cancelled_stops_and_gives_the_device_back(env):
    """Item 3: one job, cancelled a second later. The lease lent for it is drained once no job
    came for the hold (min(idle_timeout 10m, UNNEEDED_HOLD)): restoring at once, no failure
    counted against the device, the daemon's report of the step in flight refused."""
    job = env.submit()
    env.plugin.tick()
    (lease,) = env.db.magic_leases.find({"state": "claimed"})
    env.clock.t += 1
    r = env.c.post(f"/v1/job/{job}/action", json={"action": "cancel"})
    assert r.status_code == 200
    lease = env.bring_up(lease, ("fenced", "deploying"))
    env.clock.t += R.UNNEEDED_HOLD - 2  # within the hold (from the claim): kept
    env.plugin.tick()
    assert env.lease(lease["_id"])["state"] == "deploying"
    env.clock.t += 2
    env.plugin.tick()
    doc = env.lease(lease["_id"])
    assert doc["state"] == "restoring" and doc["drain"]["kind"] == "unneeded"
    assert "stop its bring-up" in doc["history"][-1]["reason"]
    assert env.db.magic_devices.find_one({"_id": lease["device"]}).get("failures", 0) == 0
    # The daemon's deploy finishes late: refused (the generation moved), the restore runs next.
    late = env.report(lease, result="ok", to_state="splitting")
    assert late.status_code == 409
    assert env.report(doc, result="ok", to_state="returned").status_code == 200
    assert env.db.magic_leases.count_documents({"state": OPEN}) == 0


def test_a_hand_lend_with_no_job_waiting_is_kept_through_its_bring_up(env):
    """TRIAL5 finding 3, through the engine: an operator's lend with no job waiting says what
    becomes of it, is not drained during its bring-up however long the deploy takes, and is
    given back by the idle rule once active and idle for idle_timeout (10m here)."""
    lease = env.lend("gpu-host-01")
    assert lease["by_hand"] is True
    assert lease["note"].startswith("no job waits on one-gpu-vm: the lease is kept through its "
                                    "bring-up, then given back once idle for 10m")
    lease = env.bring_up(lease, ("fenced", "deploying"))
    env.clock.t += 5 * 60  # far past the hold (60 s), within provision_timeout
    heartbeat(env)  # the agent host works it
    env.plugin.tick()
    assert env.lease(lease["_id"])["state"] == "deploying"
    lease = env.bring_up(env.lease(lease["_id"]), ("splitting", "enrolling", "active"))
    for vm in lease["vms"]:
        env.agent(vm["agent_name"], state="waiting", job_id="")
    env.plugin.tick()
    env.clock.t += 10 * 60 + 1
    heartbeat(env)
    env.plugin.tick()
    doc = env.lease(lease["_id"])
    assert doc["state"] == "draining" and doc["drain"]["kind"] == "idle"


def test_quarantining_a_lent_device_names_its_open_lease(env):
    """TRIAL5 finding 4: a quarantine stops new lends only; the answer names the open lease
    that still holds the device (the CLI says how to drain it), and none when it holds none."""
    lease = env.lend("gpu-host-01")
    r = env.c.post("/v1/magic/devices/gpu-host-01/quarantine", headers=env.A,
                   json={"reason": "PSU alarm from the BMC"})
    assert r.status_code == 200, r.get_data(as_text=True)
    assert r.get_json()["open_lease"] == {"_id": lease["_id"], "queue": "one-gpu-vm",
                                          "state": "claimed"}
    r = env.c.post("/v1/magic/devices/gpu-host-02/quarantine", headers=env.A,
                   json={"reason": "fan"})
    assert r.get_json()["open_lease"] is None
    # TRIAL6 finding 3: the next tick stops the bring-up of the quarantined device.
    heartbeat(env)
    env.plugin.tick()
    doc = env.lease(lease["_id"])
    assert doc["state"] == "restoring" and doc["drain"]["kind"] == "quarantined"


def test_apply_of_a_changed_vm_spec_names_the_open_leases_that_keep_the_old_one(env):
    """TRIAL5 finding 2: a changed ``vm.memory_mib`` reaches new leases only; the answer
    names the open lease that keeps the old value, and nothing for a change that applies at
    once (idle_timeout) or for an unchanged queue."""
    lease = env.lend("gpu-host-01")
    r = env.c.put("/v1/magic/queues", headers=env.A,
                  json={"yaml": MAGIC_YAML.replace("idle_timeout: 10m", "idle_timeout: 5m")})
    assert r.status_code == 200, r.get_data(as_text=True)
    assert r.get_json()["keeping_old"] == []
    bigger = MAGIC_YAML.replace("idle_timeout: 10m", "idle_timeout: 5m").replace(
        "memory_mib: 4096", "memory_mib: 8192")
    r = env.c.put("/v1/magic/queues", headers=env.A, json={"yaml": bigger})
    assert r.status_code == 200, r.get_data(as_text=True)
    body = r.get_json()
    assert body["keeping_old"] == [{"queue": "one-gpu-vm", "fields": ["vm.memory_mib"],
                                    "leases": [{"lease_id": lease["_id"],
                                                "device": "gpu-host-01", "state": "claimed",
                                                "keeps": ["vm.memory_mib"]}],
                                    "deselected": [], "over_max_devices": None}]
    assert "one-gpu-vm" not in body["unchanged"] and body["changed"] == ["one-gpu-vm"]
    r = env.c.put("/v1/magic/queues", headers=env.A, json={"yaml": bigger})  # again: no-op
    assert (r.get_json()["changed"], r.get_json()["unchanged"]) == ([], ["one-gpu-vm"])
    # TRIAL9 F6: reverted to the value the lease was claimed with, it keeps nothing: no line
    # telling the operator to drain it (it compared the old definition with the new one).
    r = env.c.put("/v1/magic/queues", headers=env.A,
                  json={"yaml": MAGIC_YAML.replace("idle_timeout: 10m", "idle_timeout: 5m")})
    assert r.get_json()["changed"] == ["one-gpu-vm"] and r.get_json()["keeping_old"] == []
    # A lease claimed with the new value keeps nothing either; the older one still does.
    r = env.c.put("/v1/magic/queues", headers=env.A, json={"yaml": bigger})
    newer = env.lend("gpu-host-02")
    r = env.c.put("/v1/magic/queues", headers=env.A,
                  json={"yaml": bigger.replace("vcpus: 2", "vcpus: 4")})
    (entry,) = r.get_json()["keeping_old"]
    keeps = {h["lease_id"]: h["keeps"] for h in entry["leases"]}
    assert keeps == {lease["_id"]: ["vm.vcpus", "vm.memory_mib"], newer["_id"]: ["vm.vcpus"]}
    assert entry["fields"] == ["vm.vcpus", "vm.memory_mib"]


def test_apply_names_leases_that_keep_their_vm_count_and_a_queue_over_its_new_max_devices(env):
    """TRIAL9 F4: lowering ``max_devices`` below the open leases, or changing
    ``vms_per_device``, drew no word from apply. A lease's VMs are made at its claim, so
    ``vms_per_device`` is among the fields it keeps; a queue holding more open leases than its
    new ``max_devices`` is named with that limit (nothing more is lent; nothing is drained)."""
    first, second = env.lend("gpu-host-01"), env.lend("gpu-host-02")
    # (each device has 2 GPUs: 2 VMs of 1 GPU before, 1 VM after)
    changed = MAGIC_YAML.replace("vms_per_device: gpus", "vms_per_device: 1").replace(
        "max_devices: 2", "max_devices: 1")
    assert changed.count("vms_per_device: 1") == 1 and "max_devices: 1" in changed
    assert len(first["vms"]) == 2
    r = env.c.put("/v1/magic/queues", headers=env.A, json={"yaml": changed})
    assert r.status_code == 200, r.get_data(as_text=True)
    (entry,) = r.get_json()["keeping_old"]
    assert entry["queue"] == "one-gpu-vm" and entry["fields"] == ["vms_per_device"]
    assert entry["over_max_devices"] == 1
    assert {h["lease_id"] for h in entry["leases"]} == {first["_id"], second["_id"]}
    # max_devices back to what the queue holds: the leases still keep their 2 VMs.
    r = env.c.put("/v1/magic/queues", headers=env.A,
                  json={"yaml": changed.replace("max_devices: 1", "max_devices: 2")})
    (entry,) = r.get_json()["keeping_old"]
    assert (entry["fields"], entry["over_max_devices"]) == (["vms_per_device"], None)
    # Back to the definition they were claimed with: nothing to say.
    r = env.c.put("/v1/magic/queues", headers=env.A, json={"yaml": MAGIC_YAML})
    assert r.get_json()["keeping_old"] == []


def test_a_device_named_where_a_lease_or_queue_goes_is_answered_with_the_likely_mistake(env):
    """TRIAL9: ``lend QUEUE DEVICE`` (swapped) said only "gpu-host-01 is not a magic queue";
    ``drain DEVICE`` said "no lease gpu-host-01". Both now say what was meant."""
    r = env.c.post("/v1/magic/leases", headers=env.A,
                   json={"device": "one-gpu-vm", "queue": "gpu-host-01", "reason": "swapped"})
    assert r.status_code == 404
    assert ("gpu-host-01 is not a magic queue but a device, and one-gpu-vm is a magic queue: "
            "the device comes first (lend gpu-host-01 one-gpu-vm)") in r.get_data(as_text=True)
    r = env.c.post("/v1/magic/leases/gpu-host-01/drain", headers=env.A, json={"reason": "x"})
    assert r.status_code == 404
    assert "that is a device, and no open lease holds it" in r.get_data(as_text=True)
    lease = env.lend("gpu-host-01")
    r = env.c.post("/v1/magic/leases/gpu-host-01/drain", headers=env.A, json={"reason": "x"})
    assert r.status_code == 404
    assert (f"no lease gpu-host-01: that is a device; its open lease is {lease['_id']} "
            f"(claimed, one-gpu-vm): drain {lease['_id']}") in r.get_data(as_text=True)
    r = env.c.post("/v1/magic/leases/nope/drain", headers=env.A, json={"reason": "x"})
    assert r.status_code == 404 and "no lease nope" in r.get_data(as_text=True)
    r = env.c.post("/v1/magic/leases", headers=env.A,
                   json={"device": "gpu-host-01", "queue": "nope", "reason": "x"})
    assert r.status_code == 404 and "nope is not a magic queue" in r.get_data(as_text=True) \
        and "device comes first" not in r.get_data(as_text=True)


def test_apply_names_the_open_lease_of_a_device_the_selection_no_longer_picks(env):
    """TRIAL5: a device added to ``devices.exclude`` kept taking the queue's jobs with no word
    from apply; the answer names its lease (the CLI says how to drain it)."""
    lease = env.lend("gpu-host-01")
    excluded = MAGIC_YAML.replace("      home_queues: [gpu-hosts]\n",
                                  "      home_queues: [gpu-hosts]\n      exclude: [gpu-host-01]\n")
    assert excluded != MAGIC_YAML
    r = env.c.put("/v1/magic/queues", headers=env.A, json={"yaml": excluded})
    assert r.status_code == 200, r.get_data(as_text=True)
    (entry,) = r.get_json()["keeping_old"]
    assert entry["queue"] == "one-gpu-vm" and entry["fields"] == []
    assert entry["deselected"] == [lease["_id"]]


def test_a_drain_by_hand_of_a_warm_queues_lease_says_it_is_replaced(env):
    """TRIAL5 finding 11: draining a lease of a queue with a warm level (min_devices 1 here) is
    answered with how to keep the device out; a queue without one gets no note."""
    lease = env.lend("gpu-host-01")
    r = env.c.post(f"/v1/magic/leases/{lease['_id']}/drain", headers=env.A,
                   json={"reason": "check"})
    assert r.status_code == 200, r.get_data(as_text=True)
    assert "note" not in r.get_json()
    apply(env, MAGIC_YAML.replace("max_starting: 1", "max_starting: 1\n      min_devices: 1"))
    lease = env.lend("gpu-host-02")
    r = env.c.post(f"/v1/magic/leases/{lease['_id']}/drain", headers=env.A,
                   json={"reason": "check"})
    assert "to keep gpu-host-02 out, quarantine it" in r.get_json()["note"]


def heartbeat(env, host="h"):
    r = env.c.post(f"/v1/magic/agent-hosts/{host}/heartbeat", headers=env.H, json={"leases": []})
    assert r.status_code in (200, 204), r.get_data(as_text=True)


def test_no_device_of_a_stale_agent_host_is_lent_until_it_heartbeats(env):
    """Item 2: agent host h reported stale (``agent_host.stale``), then a job: its devices are
    not lent, and plan and status say why; the host's next heartbeat lets them be lent."""
    env.clock.t += R.STALE_HOST_AFTER + 10
    env.plugin.tick()
    assert len(env.events("agent_host.stale")) == 1
    env.submit()
    env.clock.t += 2
    env.plugin.tick()
    assert env.db.magic_leases.count_documents({}) == 0
    plan = env.c.get("/v1/magic/plan", headers=env.A).get_json()
    (why,) = [a for a in plan["actions"] if a["kind"] == "blocked"]
    assert "2 on stale host" in why["reason"] and "agent host h sent no heartbeat" in why["reason"]
    (q,) = env.c.get("/v1/magic/status", headers=env.A).get_json()["queues"]
    assert "agent host h sent no heartbeat" in q["blocked"]["reason"]
    heartbeat(env)
    env.plugin.tick()
    assert env.db.magic_leases.count_documents({"state": "claimed"}) == 1


def test_a_claimed_lease_of_a_host_gone_stale_is_restored_without_a_failure(env):
    """Item 2: a lease claimed on a host that then goes silent is not worked by anyone; it is
    restored (no failure counted against the device) so the queue's job is not held by it, and
    the host's daemon finishes the restore when it is back (returned: the device goes home)."""
    env.submit()
    env.plugin.tick()
    (lease,) = env.db.magic_leases.find({"state": "claimed"})
    env.clock.t += R.STALE_HOST_AFTER + 1
    env.plugin.tick()
    doc = env.lease(lease["_id"])
    assert doc["state"] == "restoring"
    assert "agent host h sent no heartbeat" in doc["history"][-1]["reason"]
    assert env.db.magic_devices.find_one({"_id": lease["device"]}).get("failures", 0) == 0
    heartbeat(env)
    assert env.report(doc, result="ok", to_state="returned").status_code == 200
    assert env.db.magic_device_claims.count_documents({"_id": lease["device"]}) == 0


def test_a_hand_lend_on_a_stale_agent_host_is_refused_with_the_reason(env):
    """Item 2: an operator's lend of a device whose host is stale would only be restored by
    the next tick (nobody brings it up): refused (409) naming the host, accepted after a
    heartbeat."""
    env.clock.t += R.STALE_HOST_AFTER + 5
    r = env.c.post("/v1/magic/leases", headers=env.A,
                   json={"device": "gpu-host-01", "queue": "one-gpu-vm"})
    assert r.status_code == 409
    assert "agent host h sent no heartbeat for 125s" in r.get_json()["message"]
    heartbeat(env)
    env.lend("gpu-host-01")
