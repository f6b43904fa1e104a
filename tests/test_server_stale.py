"""A stale agent host (no heartbeat for ``reconcile.STALE_HOST_AFTER``) through the real engine:
its devices are not counted as lendable by status nor by the preflight testflinger-cli sees
(server/devicecount.py, one definition), read with one bounded read of the agent hosts; and an
active lease on it is no supply for the queue's waiting jobs (reconcile.plan), so another
device is lent. Flask test client on mongomock with a settable clock (test_server_repairs.Env)."""

from __future__ import annotations

import mongomock
import pytest

from test_server_repairs import Env
from testflinger_magic import reconcile as R


@pytest.fixture
def env():
    return Env()


def heartbeat(env, host):
    r = env.c.post(f"/v1/magic/agent-hosts/{host}/heartbeat", headers=env.H, json={"leases": []})
    assert r.status_code in (200, 204), r.get_data(as_text=True)


def capacity(env, queue="one-gpu-vm"):
    r = env.c.get(f"/v1/queues/{queue}/agents")
    assert r.status_code == 200, r.get_data(as_text=True)
    (entry,) = [a for a in r.get_json() if a["name"] == f"magic:{queue}"]
    return entry["comment"]


def lendable(env, queue="one-gpu-vm"):
    (q,) = [q for q in env.c.get("/v1/magic/status", headers=env.A).get_json()["queues"]
            if q["name"] == queue]
    return q["devices_lendable"], q["devices_eligible"]


def test_status_and_preflight_do_not_count_a_stale_hosts_devices_as_lendable(env):
    """Host h (gpu-host-01, -02) goes silent while host g (gpu-host-03) heartbeats: status'
    devices_lendable and the preflight comment count g's device only, naming h's apart; the
    preflight still offers h's VMs (jobs wait for its next heartbeat), and h's heartbeat makes
    its devices lendable again."""
    env.register(["gpu-host-03"], host="g")
    # Its device agent starts and posts waiting (TESTFLINGER.md §3.2): idle at home.
    env.db.agents.insert_one({"name": "gpu-host-03", "state": "waiting", "job_id": "",
                              "queues": ["gpu-hosts"]})
    assert lendable(env) == (3, 3)
    # Three 2-VM devices, max_devices 2: at most 4 VMs at once.
    assert capacity(env).startswith("3 lendable device(s), up to 4 VMs at once (max_devices 2)")
    env.clock.t += R.STALE_HOST_AFTER + 1
    heartbeat(env, "g")
    assert lendable(env) == (1, 3)
    assert capacity(env).startswith(
        "1 lendable device(s) (2 on a stale agent host), up to 4 VMs at once"), capacity(env)
    heartbeat(env, "h")
    assert lendable(env) == (3, 3)
    assert capacity(env).startswith("3 lendable device(s), up to 4 VMs at once")


def test_a_lent_device_of_a_stale_host_counts_as_lent_once(env):
    """Each device counts once, lent before stale: h's lent device is "lent", its other one
    "on a stale agent host"."""
    env.lend("gpu-host-01")
    env.clock.t += R.STALE_HOST_AFTER + 1
    assert lendable(env) == (0, 2)
    assert capacity(env).startswith(
        "0 lendable device(s) (1 lent to this queue, 1 on a stale agent host), up to 4 VMs; "
        "1 device being deployed for this queue: its jobs wait for it"), capacity(env)


def test_the_preflight_reads_the_agent_hosts_once_however_many_devices(env, monkeypatch):
    """The stale count costs one read of magic_agent_hosts per preflight (not one per device
    or per host), with 12 devices on 6 hosts."""
    for n in range(6):
        env.register([f"gpu-{n}-a", f"gpu-{n}-b"], host=f"host-{n}")
    reads = []
    for name in ("find", "find_one"):
        real = getattr(mongomock.collection.Collection, name)

        def counted(self, *a, _real=real, **k):
            reads.append(self.name)
            return _real(self, *a, **k)
        monkeypatch.setattr(mongomock.collection.Collection, name, counted)
    env.clock.t += R.STALE_HOST_AFTER + 1
    assert "14 on a stale agent host" in capacity(env)
    assert reads.count("magic_agent_hosts") == 1, reads
    assert reads.count("magic_devices") == 1, reads


def test_a_job_waiting_on_idle_vms_of_a_stale_host_gets_another_device(env):
    """An active lease on h with idle VM agents; h goes silent, g (gpu-host-03) heartbeats.
    A job submitted then would wait forever on h's VMs: the tick lends g's device instead,
    and h's lease stays active (not drained for staleness)."""
    env.register(["gpu-host-03"], host="g")
    env.c.post("/v1/agents/data/gpu-host-03", json={"queues": ["gpu-hosts"], "state": "waiting"})
    lease = env.bring_up(env.lend("gpu-host-01"))
    for vm in lease["vms"]:
        env.agent(vm["agent_name"], state="waiting")
    env.clock.t += R.STALE_HOST_AFTER + 1
    heartbeat(env, "g")
    env.submit()
    env.plugin.tick()
    assert env.lease(lease["_id"])["state"] == "active"
    (new,) = env.db.magic_leases.find({"state": "claimed"})
    assert (new["device"], new["agent_host"]) == ("gpu-host-03", "g")


def heartbeat_maas_down(env, host, since):
    r = env.c.post(f"/v1/magic/agent-hosts/{host}/heartbeat", headers=env.H,
                   json={"leases": [], "maas_unreachable_since": since})
    assert r.status_code in (200, 204), r.get_data(as_text=True)


def test_a_host_whose_maas_is_unreachable_is_not_lent_and_its_overdue_bringup_counts_no_failure(env):
    """Finding 2 of the trial: host h's daemon says MAAS does not answer (heartbeat
    ``maas_unreachable_since``): a waiting job gets none of h's devices (plan: blocked, "MAAS
    unreachable"); h's next plain heartbeat makes them lendable again; a bring-up on h that
    passes its deadline while MAAS is down is restored with no failure counted."""
    for d in ("gpu-host-01", "gpu-host-02"):
        env.c.post(f"/v1/agents/data/{d}", json={"queues": ["gpu-hosts"], "state": "waiting"})
    heartbeat_maas_down(env, "h", env.clock.t - 300)
    env.submit()
    plan = env.c.get("/v1/magic/plan", headers=env.A).get_json()["actions"]
    blocked = [a["reason"] for a in plan if a["kind"] == "blocked"]
    assert any("2 MAAS unreachable" in r for r in blocked), blocked
    assert not [a for a in plan if a["kind"] == "lend"], plan
    # Status and the preflight count them as the plan does: not lendable now (they were
    # "2 lendable" while nothing could be lent).
    assert lendable(env) == (0, 2)
    entry = capacity(env)
    assert entry.startswith("0 lendable device(s) (2 on an agent host MAAS does not answer), "
                            "up to 4 VMs"), entry
    heartbeat(env, "h")  # MAAS answers again
    plan = env.c.get("/v1/magic/plan", headers=env.A).get_json()["actions"]
    assert len([a for a in plan if a["kind"] == "lend"]) == 1, plan
    assert lendable(env) == (2, 2) and capacity(env).startswith("2 lendable device(s), up to")

    lease = env.bring_up(env.lend("gpu-host-01"), to=("fenced", "deploying"))
    env.clock.t += 24 * 3600  # far past any provision_timeout
    heartbeat_maas_down(env, "h", env.clock.t - 300)
    env.plugin.tick()
    after = env.lease(lease["_id"])
    assert after["state"] == "restoring", after["state"]
    assert "cannot reach MAAS" in after["history"][-1]["reason"], after["history"][-1]
    assert env.db.magic_devices.find_one({"_id": "gpu-host-01"})["failures"] == 0
    assert not env.events("device.failure")


def test_a_device_busy_at_home_is_not_lendable_and_the_entry_is_busy(env):
    """TRIAL8: a device running its owner's job was counted lendable (status and the capacity
    entry, Available in queue-status) while the plan said "no device can be lent: 1 busy"."""
    env.lend("gpu-host-01")
    env.db.agents.update_one({"name": "gpu-host-02"}, {"$set": {"state": "test", "job_id": "j"}})
    assert lendable(env) == (0, 2)
    r = env.c.get("/v1/queues/one-gpu-vm/agents")
    (entry,) = [a for a in r.get_json() if a["name"] == "magic:one-gpu-vm"]
    assert entry["state"] == "provision"  # gpu-host-01 is being deployed for the queue
    assert entry["comment"].startswith(
        "0 lendable device(s) (1 lent to this queue, 1 busy at home), up to 4 VMs"), entry
    env.db.agents.update_one({"name": "gpu-host-02"}, {"$set": {"state": "waiting", "job_id": ""}})
    assert lendable(env) == (1, 2)
