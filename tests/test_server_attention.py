"""What status and the preflight tell people about leases nobody works (TRIAL 2026-12-02,
findings 3, 11, 17, 23), through the real engine and routes (Flask test client on mongomock with
a settable clock, test_server_repairs.Env): a failed lease still holding its device, the VM
agents and leases of a stale agent host, a bring-up's last progress message, home-queue jobs
waiting for their lent devices, a bound agent host that never registered."""

from __future__ import annotations

import pytest

from test_server_repairs import Env
from testflinger_magic import reconcile as R


@pytest.fixture
def env():
    return Env()


def status(env) -> dict:
    r = env.c.get("/v1/magic/status", headers=env.A)
    assert r.status_code == 200, r.get_data(as_text=True)
    return r.get_json()


def fail(env, lease, message):
    """A bring-up error, then a failed restore: the lease ends ``failed``, keeping its claim."""
    r = env.report(lease, result="error", message=message)
    assert r.status_code == 200, r.get_data(as_text=True)
    r = env.report(r.get_json(), result="error", message="restoring: MaasError: release failed")
    assert r.status_code == 200 and r.get_json()["state"] == "failed", r.get_data(as_text=True)
    return r.get_json()


def test_status_lists_a_failed_lease_that_holds_its_device(env):
    failed = fail(env, env.lend("gpu-host-01"), "deploying: MaasError: Failed deployment")
    (f,) = status(env)["failed_leases"]
    assert (f["lease_id"], f["device"], f["queue"], f["agent_host"]) == \
        (failed["_id"], "gpu-host-01", "one-gpu-vm", "h")
    assert f["error"] == "restoring: MaasError: release failed"
    assert f["first_error"] == "deploying: MaasError: Failed deployment"
    # Released by unquarantine: no longer listed.
    r = env.c.delete("/v1/magic/devices/gpu-host-01/quarantine", headers=env.A)
    assert r.status_code == 200 and r.get_json()["released_failed_lease"] == failed["_id"]
    assert status(env)["failed_leases"] == []


def test_a_stale_hosts_vm_agents_are_not_available_and_status_names_its_leases(env):
    active = env.bring_up(env.lend("gpu-host-01"))
    other = env.bring_up(env.lend("gpu-host-02"))
    for vm in active["vms"] + other["vms"]:
        env.agent(vm["agent_name"], state="waiting")
    r = env.report(other, result="error", message="active: VM agent gone")  # -> draining
    assert r.get_json()["state"] == "draining"
    env.clock.t += R.STALE_HOST_AFTER + 60
    r = env.c.get("/v1/queues/one-gpu-vm/agents")
    assert r.status_code == 200, r.get_data(as_text=True)
    by_name = {a["name"]: a for a in r.get_json()}
    for vm in other["vms"]:  # fenced, nobody works the lease: not Available
        a = by_name[vm["agent_name"]]
        assert a["state"] == "offline", a
        assert a["comment"].startswith(f"agent host h is stale (no heartbeat for 3m); lease "
                                       f"{other['_id']} draining"), a
    for vm in active["vms"]:  # under supervisord, may still serve: state kept, noted
        a = by_name[vm["agent_name"]]
        assert a["state"] == "waiting" and "agent host h is stale" in a["comment"], a
    assert set(by_name[vm["agent_name"]].keys()) <= {"name", "state", "queues", "location",
                                                      "provision_type", "job_id", "comment",
                                                      "restricted_to"}
    (host,) = status(env)["stale_agent_hosts"]
    assert host["registered"] is True
    assert sorted((x["lease_id"], x["state"]) for x in host["leases"]) == sorted(
        [(active["_id"], "active"), (other["_id"], "draining")])
    # The host heartbeats again: the stale note goes; the active lease's agents are answered
    # as they are, the draining one's idle agents stay offline, as fenced (TRIAL16 F2).
    env.c.post("/v1/magic/agent-hosts/h/heartbeat", headers=env.H, json={"leases": []})
    agents = env.c.get("/v1/queues/one-gpu-vm/agents").get_json()
    assert not [a for a in agents if "is stale" in (a.get("comment") or "")]
    assert {a["state"] for a in agents if a["name"] in {v["agent_name"] for v in active["vms"]}} \
        == {"waiting"}
    drained = [a for a in agents if a["name"] in {v["agent_name"] for v in other["vms"]}]
    assert {a["state"] for a in drained} == {"offline"}
    assert drained[0]["comment"] == (f"testflinger-magic: lease {other['_id']} is draining: "
                                     "this VM agent takes no new job")


def test_a_bound_host_that_never_registered_is_flagged_so(env):
    r = env.c.put("/v1/magic/agent-hosts/new-host-x/binding", headers=env.A,
                  json={"client_id": "someone", "reason": "new rack", "force": True})
    assert r.status_code == 200, r.get_data(as_text=True)
    hosts = {h["name"]: h for h in status(env)["stale_agent_hosts"]}
    assert hosts["new-host-x"]["registered"] is False
    assert hosts["new-host-x"]["silent_for"] is None


def test_status_keeps_a_bringups_last_progress_message(env):
    lease = env.bring_up(env.lend("gpu-host-01"), to=("fenced", "deploying"))
    r = env.report(lease, result="progress",
                   message="MAAS unreachable since 02:10:00 (ConnectionError)")
    assert r.status_code == 200, r.get_data(as_text=True)
    (x,) = status(env)["leases"]
    assert x["progress_note"]["message"] == "MAAS unreachable since 02:10:00 (ConnectionError)"
    assert x["progress_note"]["state"] == "deploying"


def test_status_says_which_lent_devices_a_home_queue_waits_for(env):
    lease = env.bring_up(env.lend("gpu-host-01"))
    fail(env, env.lend("gpu-host-02"), "deploying: boom")
    import datetime
    job_id = env.c.post("/v1/job", json={"job_queue": "gpu-hosts"}).get_json()["job_id"]
    env.db.jobs.update_one({"job_id": job_id}, {"$set": {"created_at": datetime.datetime.fromtimestamp(
        env.clock.t - 10, datetime.timezone.utc)}})
    (h,) = status(env)["home_waits"]
    assert (h["queue"], h["waiting"]) == ("gpu-hosts", 1)
    lent = {x["device"]: x for x in h["lent"]}
    owner_wait = env.plugin.definition("one-gpu-vm").policy.reclaim.owner_wait
    assert lent["gpu-host-01"]["lease_id"] == lease["_id"]
    assert lent["gpu-host-01"]["owner_wait"] == owner_wait
    assert h["oldest_age"] == pytest.approx(10, abs=1)
    assert lent["gpu-host-01"]["reclaim_in"] == pytest.approx(owner_wait - 10, abs=1)
    assert lent["gpu-host-02"]["state"] == "failed" and lent["gpu-host-02"]["reclaim_in"] is None


def test_apply_warns_of_an_agent_template_no_agent_host_has(env):
    """TRIAL (2026-12-02) 1: hosts say which template folders they have when they register;
    PUT /queues warns of a queue naming none of them (still applied). No host said: no
    warning."""
    from conftest import MAGIC_YAML

    typo = MAGIC_YAML.replace("one-gpu-vm:", "one-gpu-vm:\n    agent_template: does-not-exist", 1)
    r = env.c.put("/v1/magic/queues", headers=env.A, json={"yaml": typo, "source": "t.yaml"})
    assert r.status_code == 200 and r.get_json()["agent_template_warnings"] == [], r.get_json()
    r = env.c.post("/v1/magic/agent-hosts/h", headers=env.H, json={
        "devices": [{"agent_name": "gpu-host-01", "maas_system_id": "gpu-host-01", "gpus": 2,
                     "home_queues": ["gpu-hosts"]}], "templates": ["maas2-vm"]})
    assert r.status_code == 200, r.get_data(as_text=True)
    r = env.c.put("/v1/magic/queues", headers=env.A, json={"yaml": typo, "source": "t.yaml"})
    assert r.status_code == 200, r.get_data(as_text=True)
    assert "one-gpu-vm" in r.get_json()["applied"]
    assert r.get_json()["agent_template_warnings"] == [
        "one-gpu-vm: agent_template 'does-not-exist' is on no registered agent host "
        "(h: maas2-vm); its bring-ups will fail and suspend the queue"]
    r = env.c.put("/v1/magic/queues", headers=env.A, json={"yaml": MAGIC_YAML, "source": "t.yaml"})
    assert r.get_json()["agent_template_warnings"] == []


def _home_job(env, waited):
    import datetime
    job_id = env.c.post("/v1/job", json={"job_queue": "gpu-hosts"}).get_json()["job_id"]
    env.db.jobs.update_one({"job_id": job_id}, {"$set": {"created_at": datetime.datetime.fromtimestamp(
        env.clock.t - waited, datetime.timezone.utc)}})
    return job_id


def test_status_says_only_the_devices_the_reclaim_takes_are_reclaimed(env):
    """TRIAL2 finding 3: one home job and two lent devices: the owner reclaim takes one (one
    device per waiting job, reconcile.plan_reclaims); status said both would come back. Now
    the one it takes has ``reclaimed`` and ``reclaim_in``, the other stays lent, and the tick
    drains the one status named."""
    first = env.bring_up(env.lend("gpu-host-01"))
    env.clock.t += 1  # the oldest lease goes first among equally idle ones (then the lease id,
    second = env.bring_up(env.lend("gpu-host-02"))  # random: the test must not depend on it)
    _home_job(env, 10)
    (h,) = status(env)["home_waits"]
    lent = {x["lease_id"]: x for x in h["lent"]}
    owner_wait = env.plugin.definition("one-gpu-vm").policy.reclaim.owner_wait
    assert lent[first["_id"]]["reclaimed"] is True
    assert lent[first["_id"]]["reclaim_in"] == pytest.approx(owner_wait - 10, abs=1)
    assert (lent[second["_id"]]["reclaimed"], lent[second["_id"]]["reclaim_in"]) == (False, None)
    assert {x["agent_host_stale_for"] for x in h["lent"]} == {None}
    inputs = env.plugin.engine.gather(read_only=True)
    assert R.owner_reclaim_outlook(inputs) == {"gpu-hosts": [first["_id"]]}
    # Due: the tick reclaims exactly the lease status named; the other still stays lent.
    env.clock.t += owner_wait
    env.c.post("/v1/magic/agent-hosts/h/heartbeat", headers=env.H, json={"leases": []})
    env.plugin.tick()
    assert env.lease(first["_id"])["state"] == "draining"
    assert env.lease(first["_id"])["drain"]["kind"] == "reclaim"
    # (the other one may drain for its own idle_timeout, never for the owner)
    assert (env.lease(second["_id"]).get("drain") or {}).get("kind") != "reclaim"


def test_status_says_a_lent_device_on_a_stale_agent_host_is_not_coming_back(env):
    """TRIAL2 finding 2: with the daemon stopped, status still said the lent device would be
    reclaimed in 55s / was on its way back; it names the stale agent host instead."""
    env.bring_up(env.lend("gpu-host-01"))
    _home_job(env, 10)
    env.clock.t += R.STALE_HOST_AFTER + 60
    (h,) = status(env)["home_waits"]
    (x,) = h["lent"]
    assert (x["agent_host"], x["state"]) == ("h", "active")
    assert x["agent_host_stale_for"] == pytest.approx(R.STALE_HOST_AFTER + 60, abs=5)
