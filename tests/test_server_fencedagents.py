"""The VM agents that take no new job, as ``GET /v1/queues/<queue>/agents`` (testflinger-cli's
preflight and ``queue-status``) answers them (server/fencedagents.py): a lease paused because its
device is quarantined (F5), and the route's reads, bounded whatever the number of leases and
agents. Flask test client on mongomock (test_server_repairs.Env)."""

from __future__ import annotations

import threading

import mongomock
from conftest import MAGIC_YAML
from test_server_repairs import Env

JOB = "11111111-2222-3333-4444-555555555555"
#: MAGIC_YAML with one-gpu-vm renamed: applied, it removes one-gpu-vm.
OTHER_QUEUE = MAGIC_YAML.replace("  one-gpu-vm:", "  gone-vm:", 1)


def heartbeat(env, host="h"):
    r = env.c.post(f"/v1/magic/agent-hosts/{host}/heartbeat", headers=env.H, json={"leases": []})
    assert r.status_code in (200, 204), r.get_data(as_text=True)


def listed(env, queue="one-gpu-vm"):
    r = env.c.get(f"/v1/queues/{queue}/agents")
    assert r.status_code == 200, r.get_data(as_text=True)
    return {a["name"]: a for a in r.get_json()}


def active_with_a_busy_vm(env, device="gpu-host-01"):
    """Lend ``device``, bring it up; its first VM agent runs :data:`JOB`, the other waits.
    Returns ``(lease, busy agent, idle agent)``."""
    lease = env.bring_up(env.lend(device))
    busy, idle = (vm["agent_name"] for vm in lease["vms"])
    env.agent(busy, state="test", job_id=JOB)
    env.agent(idle, state="waiting", job_id="")
    return lease, busy, idle


def quarantine(env, device, reason):
    r = env.c.post(f"/v1/magic/devices/{device}/quarantine", headers=env.A,
                   json={"reason": reason})
    assert r.status_code == 200, r.get_data(as_text=True)


def test_a_lease_paused_for_its_quarantined_device_is_not_available_to_the_cli():
    """F5: a device quarantined while its lease is active pauses the lease (its running jobs
    finish, no new job starts there: the idle VM agent's polls get no job), but queue-status
    counted the idle VM agent Available. It is answered ``offline`` naming the lease and the
    quarantine; the busy one keeps its state. A lease paused while its device is not
    quarantined (consolidation: demand resumes it) keeps its agents' own states."""
    env = Env()
    lease, busy, idle = active_with_a_busy_vm(env)
    heartbeat(env)
    assert listed(env)[idle]["state"] == "waiting"
    quarantine(env, "gpu-host-01", "PSU alarm from the BMC")
    env.plugin.tick()
    doc = env.lease(lease["_id"])
    assert (doc["state"], doc["admission"]) == ("active", "paused"), doc
    # The answer is true: the idle VM agent's poll gets no job while one waits.
    job = env.submit()
    assert env.poll(idle).status_code == 204
    assert env.db.jobs.find_one({"job_id": job})["result_data"]["job_state"] == "waiting"
    agents = listed(env)
    assert agents[idle]["state"] == "offline", agents[idle]
    assert agents[idle]["comment"] == (
        f"testflinger-magic: lease {lease['_id']} is paused (device gpu-host-01 quarantined: "
        "PSU alarm from the BMC): this VM agent takes no new job")
    assert (agents[busy]["state"], agents[busy]["job_id"]) == ("test", JOB)
    # Unquarantined, the lease is paused only until demand resumes it: its agents as they are.
    r = env.c.delete("/v1/magic/devices/gpu-host-01/quarantine", headers=env.A)
    assert r.status_code == 200, r.get_data(as_text=True)
    assert env.lease(lease["_id"])["admission"] == "paused"
    agents = listed(env)
    assert agents[idle]["state"] == "waiting" and not agents[idle].get("comment"), agents[idle]


def counted_reads(monkeypatch) -> list[tuple[str, str]]:
    """``(collection, method)`` of every read this thread makes from now on (mongomock's
    collection; the plugin's notifier thread reads definitions on its own)."""
    me = threading.get_ident()
    reads: list[tuple[str, str]] = []
    for name in ("find", "find_one", "count_documents", "aggregate", "distinct"):
        real = getattr(mongomock.collection.Collection, name)

        def counted(self, *a, _real=real, _name=name, **k):
            if threading.get_ident() == me:
                reads.append((self.name, _name))
            return _real(self, *a, **k)
        monkeypatch.setattr(mongomock.collection.Collection, name, counted)
    return reads


def preflight_reads(devices: int, monkeypatch) -> tuple[dict, dict]:
    """The reads of one ``GET /v1/queues/one-gpu-vm/agents`` with ``devices`` leases (half
    paused for their quarantined device, half draining, each with a busy and an idle VM agent),
    then of the same once an apply removed the queue (every lease draining): ``(reads of the
    magic queue, reads of the removed one)``, ``{(collection, method): calls}``. The answers are
    checked too."""
    env = Env(devices=[f"gpu-host-{n:02}" for n in range(1, devices + 1)])
    for n in range(3, devices + 1):  # the device agents (seed posts those of 01 and 02)
        env.c.post(f"/v1/agents/data/gpu-host-{n:02}",
                   json={"queues": ["gpu-hosts"], "state": "waiting"})
    leases = [active_with_a_busy_vm(env, f"gpu-host-{n:02}") for n in range(1, devices + 1)]
    for n, (lease, _busy, _idle) in enumerate(leases):
        if n % 2:
            r = env.c.post(f"/v1/magic/leases/{lease['_id']}/drain", headers=env.A,
                           json={"reason": "test", "grace": "1h"})
            assert r.status_code == 200, r.get_data(as_text=True)
        else:
            quarantine(env, lease["device"], "fan")
    heartbeat(env)
    out = []
    for removed in (False, True):
        if removed:
            r = env.c.put("/v1/magic/queues", headers=env.A, json={"yaml": OTHER_QUEUE})
            assert r.status_code == 200 and r.get_json()["removed"] == ["one-gpu-vm"], r.get_json()
        env.plugin.tick()
        assert env.plugin.notifier.flush(30)  # the tick's events told: its reads are done
        reads = counted_reads(monkeypatch)
        r = env.c.get("/v1/queues/one-gpu-vm/agents")
        monkeypatch.undo()
        if removed:  # no VM agent of it takes a new job: 404 saying it was removed
            assert r.status_code == 404 and "was removed" in r.get_json()["message"], r.get_json()
        else:
            agents = {a["name"]: a for a in r.get_json()}
            assert {agents[idle]["state"] for _lease, _busy, idle in leases} == {"offline"}
            assert {agents[busy]["state"] for _lease, busy, _idle in leases} == {"test"}
        counts: dict = {}
        for key in reads:
            counts[key] = counts.get(key, 0) + 1
        out.append(counts)
    return out[0], out[1]


def test_the_preflight_reads_are_the_same_however_many_leases_and_agents(monkeypatch):
    """The fenced answer costs one read of the queue's open leases (shared with the capacity
    entry) and one of its paused leases' devices, whatever the number of leases and VM agents
    (no read per agent or lease): the same reads with 3 times the leases, for a magic queue
    and for one an apply removed (F2: its answer is the plugin's now, not Testflinger's)."""
    few, few_removed = preflight_reads(2, monkeypatch)
    many, many_removed = preflight_reads(6, monkeypatch)
    assert few == many, (few, many)
    assert few[("magic_leases", "find")] == 1, few
    # The devices with their claims (capacity) and the paused leases' quarantined devices.
    assert few[("magic_devices", "find")] == 2, few
    assert sum(few.values()) <= 13, few  # 6 of them: the definition and its problem
    assert few_removed == many_removed, (few_removed, many_removed)
    assert few_removed[("magic_leases", "find")] == 1, few_removed
    assert sum(few_removed.values()) <= 12, few_removed
