"""``exclude_agents`` on a magic queue, over real HTTP through the lab job service (TRIAL3 #13).

The lab's ``job_post`` does Testflinger's check (api/v1.py ``job_post`` against
``database.get_agents_on_queue``); the plugin (server/excludes.py) makes the future VM agents of
the queue's lendable devices count, and refuses a job every possible VM agent is excluded from.
"""

from __future__ import annotations

import pytest
import requests
from conftest import MagicStack, report_up_to_active

from testflinger_magic.server import excludes

DEVICES = [
    {"agent_name": "gpu-host-01", "maas_system_id": "abc123", "gpus": 2, "tags": ["nvidia"],
     "home_queues": ["gpu-hosts"]},
    {"agent_name": "gpu-host-02", "maas_system_id": "def456", "gpus": 2, "tags": ["nvidia"],
     "home_queues": ["gpu-hosts"]},
]
ALL_VMS = ["gpu-host-01-vm1", "gpu-host-01-vm2", "gpu-host-02-vm1", "gpu-host-02-vm2"]


@pytest.fixture
def lab(mongo, serve):
    """The plugin on the lab job service (Testflinger's job_post check, pop_job filter)."""
    s = MagicStack(mongo, serve, server="old")
    yield s
    s.plugin.stop()


def register(m, devices=DEVICES):
    r = requests.post(f"{m.url}/v1/magic/agent-hosts/host-a", headers=m.headers("agent"),
                      json={"devices": devices, "version": "0.1"}, timeout=10)
    assert r.status_code == 200, r.text


def submit(m, queue, exclude):
    return requests.post(f"{m.url}/v1/job", headers=m.headers("contributor"),
                         json={"job_queue": queue, "exclude_agents": exclude}, timeout=10)


def test_the_lab_refuses_like_testflinger_where_no_agent_may_run(lab):
    # A plain queue: Testflinger's own check, unchanged (only gpu-host-01/02 list gpu-hosts).
    r = submit(lab, "gpu-hosts", ["gpu-host-01", "gpu-host-02"])
    assert r.status_code == 422 and r.json()["message"] == excludes.TF_MESSAGE
    assert submit(lab, "gpu-hosts", ["gpu-host-01"]).status_code == 200
    # Testflinger's check with the plugin's help undone: the idle magic queue has no agent
    # document, so the job is refused (the finding's 422).
    from testflinger_magic.lab import jobservice

    wrapped = jobservice.get_agents_on_queue
    register(lab)
    try:
        jobservice.get_agents_on_queue = wrapped.__wrapped__
        r = submit(lab, "one-gpu-vm", ["some-flaky-agent"])
        assert r.status_code == 422 and r.json()["message"] == excludes.TF_MESSAGE
    finally:
        jobservice.get_agents_on_queue = wrapped


def test_an_idle_magic_queue_accepts_a_job_excluding_some_agents(lab):
    register(lab)
    r = submit(lab, "one-gpu-vm", ["some-flaky-agent"])
    assert r.status_code == 200, r.text
    job = lab.db.jobs.find_one({"job_id": r.json()["job_id"]})
    assert job["job_data"]["exclude_agents"] == ["some-flaky-agent"]
    # Excluding every VM of one device is fine: the other device can be lent.
    assert submit(lab, "one-gpu-vm", ALL_VMS[:2]).status_code == 200
    # The plugin's stand-ins exist only for that request: no agent document was written.
    assert lab.db.agents.count_documents({"queues": "one-gpu-vm"}) == 0


def test_a_job_excluding_every_possible_vm_agent_is_refused(lab):
    register(lab)
    r = submit(lab, "one-gpu-vm", ALL_VMS)
    assert r.status_code == 422
    msg = r.json()["message"]
    assert msg.startswith(excludes.TF_MESSAGE) and "gpu-host-02-vm2" in msg
    assert lab.db.jobs.count_documents({"job_data.job_queue": "one-gpu-vm"}) == 0
    # A quarantined device's VMs are not possible agents: excluding the other's is refusal.
    r = requests.post(f"{lab.url}/v1/magic/devices/gpu-host-02/quarantine",
                      headers=lab.headers("admin"), json={"reason": "test"}, timeout=10)
    assert r.status_code == 200, r.text
    assert submit(lab, "one-gpu-vm", ALL_VMS[:2]).status_code == 422


def test_an_existing_vm_agent_counts_as_testflinger_counts_it(lab):
    register(lab, DEVICES[:1])
    # A VM agent document listing the queue (another name than the future ones): allowed.
    requests.post(f"{lab.url}/v1/agents/data/extra-agent", headers=lab.headers("agent"),
                  json={"state": "waiting", "queues": ["one-gpu-vm"], "job_id": ""}, timeout=10)
    assert submit(lab, "one-gpu-vm", ALL_VMS).status_code == 200
    assert submit(lab, "one-gpu-vm", [*ALL_VMS, "extra-agent"]).status_code == 422


def test_no_registered_device_leaves_testflinger_check_alone(lab):
    # No device: nothing can be lent, no agent lists the queue: Testflinger's own 422.
    r = submit(lab, "one-gpu-vm", ["x"])
    assert r.status_code == 422 and "every agent" in r.json()["message"]
    # A malformed exclude_agents is Testflinger's schema's business (422 from the schema).
    r = submit(lab, "one-gpu-vm", "gpu-host-01-vm1")
    assert r.status_code == 422 and "exclude_agents" in r.text


def _report_active(m, lease):
    return report_up_to_active(m.url, m.headers("agent"), lease)


def test_an_excluded_vm_agent_is_not_handed_the_job(lab):
    """Dispatch: the gate lets the VM agents poll, Testflinger's pop_job filter skips the job
    for the excluded one; the other VM agent of the lease gets it."""
    register(lab, DEVICES[:1])
    r = requests.post(f"{lab.url}/v1/magic/leases", headers=lab.headers("admin"),
                      json={"device": "gpu-host-01", "queue": "one-gpu-vm", "reason": "t"},
                      timeout=10)
    assert r.status_code == 201, r.text
    lease = _report_active(lab, r.json())
    vm1, vm2 = (v["agent_name"] for v in lease["vms"])
    for vm in (vm1, vm2):
        requests.post(f"{lab.url}/v1/agents/data/{vm}", headers=lab.headers("agent"),
                      json={"state": "waiting", "queues": ["one-gpu-vm"], "job_id": ""},
                      timeout=10)
    r = submit(lab, "one-gpu-vm", [vm1])
    assert r.status_code == 200, r.text
    job_id = r.json()["job_id"]

    def poll(vm):
        return requests.get(f"{lab.url}/v1/job", params={"queue": ["one-gpu-vm"]},
                            headers=lab.headers("agent"), cookies={"agent_name": vm}, timeout=10)

    assert poll(vm1).status_code == 204
    assert lab.db.jobs.find_one({"job_id": job_id})["result_data"]["job_state"] == "waiting"
    r = poll(vm2)
    assert r.status_code == 200 and r.json()["job_id"] == job_id


def test_decide_is_pure():
    assert excludes.decide(["a"], ["a", "b"], ["d-vm1"]) == (["d-vm1"], "")
    assert excludes.decide(["a"], ["a"], ["d-vm1", "d-vm2"]) == (["d-vm1", "d-vm2"], "")
    allowed, why = excludes.decide(["a", "d-vm1"], ["a"], ["d-vm1"])
    assert allowed == [] and why.startswith(excludes.TF_MESSAGE) and "a, d-vm1" in why
    assert "no device can be lent" in excludes.decide(["x"], [], [])[1]


def quarantine(m, device):
    r = requests.post(f"{m.url}/v1/magic/devices/{device}/quarantine",
                      headers=m.headers("admin"), json={"reason": "test"}, timeout=10)
    assert r.status_code == 200, r.text


def test_a_job_no_lendable_vm_may_run_is_no_demand(lab, monkeypatch):
    """Accepted while gpu-host-02 could be lent, the job excludes both VMs of gpu-host-01; once
    gpu-host-02 is quarantined no lend can serve it, so the tick lends nothing for it (it would
    hold gpu-host-01 with VMs that never take it)."""
    kicks = []
    monkeypatch.setattr(lab.plugin, "kick", lambda queue=None: kicks.append(queue))
    register(lab)
    assert submit(lab, "one-gpu-vm", ALL_VMS[:2]).status_code == 200
    quarantine(lab, "gpu-host-02")
    lab.plugin.tick()
    assert lab.db.magic_leases.count_documents({}) == 0
    # A job one of gpu-host-01's VMs may run is demand: the tick lends gpu-host-01 for it.
    assert submit(lab, "one-gpu-vm", ALL_VMS[:1]).status_code == 200
    lab.plugin.tick()
    assert [d["device"] for d in lab.db.magic_leases.find({})] == ["gpu-host-01"]


def test_possible_by_queue_counts_lent_vms_and_skips_quarantined_devices():
    from conftest import MAGIC_YAML

    from testflinger_magic import queues

    (q,) = queues.load_text(MAGIC_YAML)
    devices = [{"_id": "a", "gpus": 2, "home_queues": ["gpu-hosts"]},
               {"_id": "b", "gpus": 2, "home_queues": ["gpu-hosts"], "quarantined": True}]
    got = excludes.possible_by_queue([q], devices, [("one-gpu-vm", "b", ["b-vm1"]),
                                                    ("other", "x", ["x-vm1"])])
    assert got == {"one-gpu-vm": {"a": frozenset({"a-vm1", "a-vm2"}), "b": frozenset({"b-vm1"})}}
    per = got["one-gpu-vm"]
    assert excludes.excluded_devices(["a-vm1", "a-vm2", "b-vm1", "z"], per) is None
    assert excludes.excluded_devices(["a-vm1", "a-vm2"], per) == {"a"}
    assert excludes.excluded_devices(["a-vm1"], per) == frozenset()
    assert excludes.excluded_devices(["a-vm1"], {}) == frozenset()
    assert excludes.excluded_devices("a-vm1", per) == frozenset()


def test_a_job_excluding_a_devices_vms_gets_another_device_lent(lab, monkeypatch):
    kicks = []
    monkeypatch.setattr(lab.plugin, "kick", lambda queue=None: kicks.append(queue))
    register(lab)
    assert submit(lab, "one-gpu-vm", ALL_VMS[:2]).status_code == 200
    lab.plugin.tick()
    assert [d["device"] for d in lab.db.magic_leases.find({})] == ["gpu-host-02"]


def test_the_quick_lend_at_submit_skips_the_excluded_device(lab):
    """The submission's kick (a quick lend, server/quicklend.py) reads the demand with the same
    exclusions as the tick."""
    from test_server_flow import wait_until

    register(lab)
    assert submit(lab, "one-gpu-vm", ALL_VMS[:2]).status_code == 200
    wait_until(lambda: lab.db.magic_leases.count_documents({}), "the quick lend")
    assert [d["device"] for d in lab.db.magic_leases.find({})] == ["gpu-host-02"]


# ----- the planner (reconcile.plan) with QueueDemand.avoid --------------------------------

def test_plan_neither_lends_nor_counts_a_device_every_waiting_job_excludes():
    from test_reconcile import NOW, agents, device, inputs, lease, queue

    from testflinger_magic.reconcile import QueueDemand, plan

    q = queue()
    devs = [device("gpu-1", gpus=2), device("gpu-2", gpus=2)]
    avoid = {"one-gpu-vm": QueueDemand(waiting=1, last_job_at=NOW - 900,
                                       avoid=frozenset({"gpu-1"}))}
    (a,) = plan(inputs([q], devs, avoid))
    assert (a.kind, a.device) == ("lend", "gpu-2")
    # gpu-1 already lent with idle VMs: they are no supply for the job, so gpu-2 is lent, and
    # the idle lease drains after idle_timeout although a job waits.
    l1 = lease("l1", "gpu-1", vms=2, idle_since=NOW - 700)
    acts = plan(inputs([q], devs, avoid, [l1], agents("l1", idle=2)))
    assert sorted((x.kind, x.lease_id or x.device) for x in acts) == [("drain", "l1"),
                                                                      ("lend", "gpu-2")]
    # Without avoid the idle VMs cover the job: nothing happens.
    plain = {"one-gpu-vm": QueueDemand(waiting=1, last_job_at=NOW - 900)}
    assert plan(inputs([q], devs, plain, [l1], agents("l1", idle=2))) == []
    # Only gpu-1 can be lent and the waiting jobs exclude it: no lend, and explain says why.
    acts = plan(inputs([q], devs[:1], avoid), explain=True)
    assert [x.kind for x in acts] == ["blocked"]
    assert "1 excluded by the waiting jobs" in acts[0].reason


def test_a_job_excluding_every_online_vm_agent_passes_the_cli_check_while_a_device_can_be_lent(lab):
    """TRIAL7: with one lease active, a job excluding its VM agents (after a bad run there) was
    refused by testflinger-cli's pre-submit check (every listed online agent excluded), though
    the other device could be lent for it. The capacity entry stays listed while a usable device
    is none of the queue's, so the CLI submits, as the server's own check accepts."""
    from testflinger_magic.lab.demo import Submitter

    register(lab)
    r = requests.post(f"{lab.url}/v1/magic/leases", headers=lab.headers("admin"),
                      json={"device": "gpu-host-01", "queue": "one-gpu-vm", "reason": "t"},
                      timeout=10)
    assert r.status_code == 201, r.text
    lease = report_up_to_active(lab.url, lab.headers("agent"), r.json())
    for vm in lease["vms"]:  # the VM agents start and post waiting, as testflinger-agent does
        r = requests.post(f"{lab.url}/v1/agents/data/{vm['agent_name']}", headers=lab.headers("agent"),
                          json={"state": "waiting", "queues": ["one-gpu-vm"]}, timeout=10)
        assert r.status_code == 200, r.text
    cli = Submitter(lab.url, lab.tokens["contributor"])
    job = {"job_queue": "one-gpu-vm", "exclude_agents": ["gpu-host-01-vm1", "gpu-host-01-vm2"]}
    assert cli.submit(job)
    # ... and the submission's quick lend gives the queue the other device for it.
    import time

    deadline = time.monotonic() + 20
    while not lab.db.magic_leases.find_one({"device": "gpu-host-02", "queue": "one-gpu-vm"}):
        assert time.monotonic() < deadline, "gpu-host-02 was not lent for the job"
        time.sleep(0.05)
    # Every usable device is the queue's now: the online VM agents are all the CLI sees, and a
    # job excluding them is refused by the CLI, as on any queue.
    names = [a["name"] for a in requests.get(f"{lab.url}/v1/queues/one-gpu-vm/agents",
                                             timeout=10, headers=lab.headers("contributor")).json()]
    assert names == ["gpu-host-01-vm1", "gpu-host-01-vm2"]
    with pytest.raises(RuntimeError, match="that the job does not exclude"):
        cli.submit(job)


def test_an_idle_vm_agent_the_waiting_job_excludes_does_not_hold_off_a_lend(lab, monkeypatch):
    """TRIAL7: gpu-host-01's vm2 runs a job, its vm1 is idle; the waiting job excludes every
    device's vm1. The idle vm1 is no supply for it (QueueDemand.avoid_agents, read with the
    demand): the tick lends gpu-host-02, whose vm2 may run it."""
    monkeypatch.setattr(lab.plugin, "kick", lambda queue=None: None)
    register(lab)
    r = requests.post(f"{lab.url}/v1/magic/leases", headers=lab.headers("admin"),
                      json={"device": "gpu-host-01", "queue": "one-gpu-vm", "reason": "t"},
                      timeout=10)
    assert r.status_code == 201, r.text
    report_up_to_active(lab.url, lab.headers("agent"), r.json())
    for vm, state in (("gpu-host-01-vm1", "waiting"), ("gpu-host-01-vm2", "test")):
        r = requests.post(f"{lab.url}/v1/agents/data/{vm}", headers=lab.headers("agent"),
                          json={"state": state, "queues": ["one-gpu-vm"]}, timeout=10)
        assert r.status_code == 200, r.text
    assert submit(lab, "one-gpu-vm", ["gpu-host-01-vm1", "gpu-host-02-vm1"]).status_code == 200
    facts = lab.plugin.engine.gather(read_only=True)
    assert facts.demand["one-gpu-vm"].avoid_agents == {"gpu-host-01-vm1", "gpu-host-02-vm1"}
    lab.plugin.tick()
    assert sorted(d["device"] for d in lab.db.magic_leases.find({})) == [
        "gpu-host-01", "gpu-host-02"]


def test_the_owner_reclaim_takes_back_a_device_the_owners_job_may_run(mongo, serve):
    """TRIAL11 F4: a home job excluding gpu-host-01 while both devices were lent made the
    reclaim take gpu-host-01 back (the idlest), which then sat at home unlent while the owner's
    job waited for a second reclaim. The home queue's demand now carries the devices its jobs
    exclude (``QueueDemand.avoid``, read with the demand), and the reclaim takes gpu-host-02."""
    from test_server_flow import Clock

    clock = Clock()
    m = MagicStack(mongo, serve, server="old", clock=clock)
    try:
        register(m)
        leases = {}
        for device in ("gpu-host-01", "gpu-host-02"):
            r = requests.post(f"{m.url}/v1/magic/leases", headers=m.headers("admin"),
                              json={"device": device, "queue": "one-gpu-vm", "reason": "t"},
                              timeout=10)
            assert r.status_code == 201, r.text
            leases[device] = report_up_to_active(m.url, m.headers("agent"), r.json())["_id"]
        # gpu-host-01's VMs are the idler: one job runs on gpu-host-02's vm1.
        for vm in ALL_VMS:
            r = requests.post(f"{m.url}/v1/agents/data/{vm}", headers=m.headers("agent"),
                              json={"state": "test" if vm == "gpu-host-02-vm1" else "waiting",
                                    "queues": ["one-gpu-vm"]}, timeout=10)
            assert r.status_code == 200, r.text
        assert submit(m, "gpu-hosts", ["gpu-host-01"]).status_code == 200
        facts = m.plugin.engine.gather(read_only=True)
        assert facts.demand["gpu-hosts"].avoid == {"gpu-host-01"}
        clock.advance(31 * 60)  # past the owner_wait (30m default)
        r = requests.post(f"{m.url}/v1/magic/agent-hosts/host-a/heartbeat",
                          headers=m.headers("agent"), json={"leases": []}, timeout=10)
        assert r.status_code in (200, 204), r.text
        m.plugin.tick()
        drained = {x["device"]: (x.get("drain") or {}).get("kind")
                   for x in m.db.magic_leases.find({"state": {"$in": ["draining", "restoring"]}})}
        # (gpu-host-01, with no magic job waiting, goes home by the idle rule instead)
        assert drained.get("gpu-host-02") == "reclaim", drained
        assert drained.get("gpu-host-01") != "reclaim", drained
    finally:
        m.plugin.stop()
