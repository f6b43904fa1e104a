"""Magic queues against the devices the server knows, over real HTTP (trial 2026-12-02, items 4,
5, 8, 9, 16, 25): hand lends the selection refuses, names taken by devices, apply's warnings, a
removed queue that stops taking jobs and never strands one, owners submitting while lent."""

from __future__ import annotations

import pytest
import requests

from conftest import MAGIC_YAML, MagicStack
from testflinger_magic import cli
from testflinger_magic.lab.jobservice_auth import add_client

DEVICES = [
    {"agent_name": "gpu-host-01", "maas_system_id": "abc123", "gpus": 2, "tags": ["nvidia"],
     "home_queues": ["gpu-hosts"]},
    {"agent_name": "gpu-host-02", "maas_system_id": "def456", "gpus": 2, "tags": ["nvidia"],
     "home_queues": ["gpu-hosts"]},
]

TWO_QUEUES = MAGIC_YAML + """\
  two-gpu-vm:
    description: Two GPUs per VM, never gpu-host-02
    devices: {home_queues: [gpu-hosts], exclude: [gpu-host-02]}
    vm: {gpus: 2}
  nodevice:
    description: Selects a device nobody registered
    devices: {agents: [gpu-host-99]}
"""

ADMIN, SECRET = "ops-admin", "ops-secret-of-some-length"


@pytest.fixture
def stack(mongo, serve):
    """The plugin on the lab job service (Testflinger's auth: the CLI can log in as ADMIN)."""
    s = MagicStack(mongo, serve, yaml_text=TWO_QUEUES, server="old")
    add_client(mongo, ADMIN, SECRET, "admin")
    register(s)
    yield s
    s.plugin.stop()


def register(m, host="host-a", devices=DEVICES):
    r = requests.post(f"{m.url}/v1/magic/agent-hosts/{host}", headers=m.headers("agent"),
                      json={"devices": devices, "version": "0.1"}, timeout=10)
    assert r.status_code == 200, r.text
    return r


def run(m, *argv):
    return cli.main([*argv, "--server", m.url, "--client-id", ADMIN, "--secret-key", SECRET])


def lend(m, device, queue, **extra):
    return requests.post(f"{m.url}/v1/magic/leases", headers=m.headers("admin"),
                         json={"device": device, "queue": queue, **extra}, timeout=10)


# ----- 8: a hand lend honours the devices selection -----------------------------------------
def test_lend_refuses_an_excluded_or_unselected_device_unless_forced(stack, capsys):
    r = lend(stack, "gpu-host-02", "two-gpu-vm")
    assert r.status_code == 409
    assert "two-gpu-vm's devices.exclude lists gpu-host-02" in r.json()["message"]
    assert "--force" in r.json()["message"]
    r = lend(stack, "gpu-host-01", "nodevice")
    assert r.status_code == 409
    assert "nodevice's devices selection does not pick gpu-host-01" in r.json()["message"]
    assert stack.db.magic_leases.count_documents({}) == 0
    # The CLI says the same and exits 1.
    assert run(stack, "lend", "gpu-host-02", "two-gpu-vm") == 1
    assert "devices.exclude lists gpu-host-02" in capsys.readouterr().err
    assert stack.db.magic_leases.count_documents({}) == 0
    # --force lends it, and says what it overrode (answer and the lease's history).
    assert run(stack, "lend", "gpu-host-02", "two-gpu-vm", "--force") == 0
    out = capsys.readouterr().out
    assert "lent gpu-host-02 to two-gpu-vm" in out
    assert "forced: two-gpu-vm's devices.exclude lists gpu-host-02" in out
    lease = stack.db.magic_leases.find_one({"device": "gpu-host-02"})
    assert "forced" in lease["history"][0]["reason"]
    # A selected device needs no force, and its answer says nothing was forced.
    r = lend(stack, "gpu-host-01", "one-gpu-vm")
    assert r.status_code == 201 and "forced" not in r.json()


# ----- 9: a magic queue never takes a device's name ------------------------------------------
def put_queues(m, yaml_text, **extra):
    return requests.put(f"{m.url}/v1/magic/queues", headers=m.headers("admin"), timeout=10,
                        json={"yaml": yaml_text, "source": "ops.yaml", **extra})


@pytest.mark.parametrize("name, says", [
    ("gpu-hosts", "'gpu-hosts' is the home queue of registered device(s) gpu-host-01, gpu-host-02"),
    ("gpu-host-01", "'gpu-host-01' is the agent name of registered device gpu-host-01"),
])
def test_apply_refuses_a_queue_named_like_a_device_or_its_home_queue(stack, name, says):
    # The trial's file: the clash plus one-gpu-vm by tag (no queue lists gpu-hosts as a home
    # queue, which validation alone already refuses).
    yaml_text = f"""\
magic_queues:
  {name}:
    description: clashes
    devices: {{agents: [gpu-host-01]}}
  one-gpu-vm:
    description: by tag
    devices: {{tags: [nvidia]}}
"""
    r = put_queues(stack, yaml_text)
    assert r.status_code == 422, r.text
    (issue,) = r.json()["issues"]
    assert issue["field"] == f"magic_queues.{name}" and says in issue["message"]
    assert stack.db.magic_queues.find_one({"_id": name}) is None  # nothing written
    assert stack.db.magic_queues.count_documents({}) == 3


def test_registration_refuses_a_device_whose_home_queue_is_a_magic_queue(stack):
    bad = [dict(DEVICES[0], home_queues=["gpu-hosts", "one-gpu-vm"])]
    r = requests.post(f"{stack.url}/v1/magic/agent-hosts/host-a", headers=stack.headers("agent"),
                      json={"devices": bad, "version": "0.1"}, timeout=10)
    assert r.status_code == 409
    assert "device gpu-host-01: its home queue 'one-gpu-vm' is a magic queue" in r.json()["message"]
    assert stack.db.magic_devices.find_one({"_id": "gpu-host-01"})["home_queues"] == ["gpu-hosts"]
    r = requests.post(f"{stack.url}/v1/magic/agent-hosts/host-b", headers=stack.headers("agent"),
                      json={"devices": [dict(DEVICES[0], agent_name="nodevice")]}, timeout=10)
    assert r.status_code == 409 and "its agent name is the magic queue 'nodevice'" in r.text
    assert stack.db.magic_devices.find_one({"_id": "nodevice"}) is None


# ----- 16: apply warns of queues nothing can serve --------------------------------------------
def test_apply_warns_of_queues_no_registered_device_can_serve(stack, tmp_path, capsys):
    path = tmp_path / "q.yaml"
    path.write_text(TWO_QUEUES + """\
  ninegpu:
    description: Nine GPUs per VM
    devices: {home_queues: [gpu-hosts]}
    vm: {gpus: 9}
""")
    assert run(stack, "apply", str(path)) == 0
    err = capsys.readouterr().err
    assert ("warning: nodevice: no registered device matches its devices selection (2 devices "
            "registered)") in err
    assert ("warning: ninegpu: needs 9 GPUs per VM; the largest of the 2 devices its devices "
            "selection picks has 2") in err
    assert "one-gpu-vm:" not in err and "two-gpu-vm:" not in err
    # The same reason as the preflight's 404 (one definition).
    r = requests.get(f"{stack.url}/v1/queues/ninegpu/agents", timeout=10)
    assert r.status_code == 404 and "needs 9 GPUs per VM" in r.json()["message"]


# ----- 4 and 25: a removed queue drains, is not advertised, takes no job, strands none ---------
def bring_up(m, device="gpu-host-01", queue="one-gpu-vm"):
    """Lend ``device`` by hand and report its bring-up up to ``active`` (a fake daemon); its
    VM agents post ``waiting`` and advertise the queue, as testflinger-agent does at startup."""
    r = lend(m, device, queue)
    assert r.status_code == 201, r.text
    lease = r.json()
    for to_state in ("fenced", "deploying", "splitting", "enrolling", "active"):
        body = {"agent_host": "host-a", "generation": lease["generation"],
                "state": lease["state"], "result": "ok", "to_state": to_state}
        lease = requests.post(f"{m.url}/v1/magic/leases/{lease['_id']}/report",
                              headers=m.headers("agent"), json=body, timeout=10).json()
    assert lease["state"] == "active", lease
    for vm in lease["vms"]:
        for path, body in ((f"agents/data/{vm['agent_name']}",
                            {"state": "waiting", "queues": [queue], "job_id": "", "comment": ""}),
                           ("agents/queues", {queue: f"testflinger-magic queue {queue}"})):
            r = requests.post(f"{m.url}/v1/{path}", json=body, headers=m.headers("agent"),
                              timeout=10)
            assert r.status_code == 200, r.text
    return lease


def advertised(m):
    r = requests.get(f"{m.url}/v1/agents/queues", headers=m.headers("contributor"), timeout=10)
    assert r.status_code == 200
    return r.json()


BUSY_JOB = "11111111-2222-3333-4444-555555555555"


def bring_up_with_a_busy_vm(m, job_id=BUSY_JOB):
    """:func:`bring_up`, then its first VM agent posts that it runs ``job_id``; returns
    ``(lease, that agent's name)``."""
    lease = bring_up(m)
    busy = lease["vms"][0]["agent_name"]
    r = requests.post(f"{m.url}/v1/agents/data/{busy}", headers=m.headers("agent"),
                      json={"state": "test", "queues": ["one-gpu-vm"], "job_id": job_id},
                      timeout=10)
    assert r.status_code == 200, r.text
    return lease, busy


def remove_one_gpu_vm(m, tmp_path):
    """Apply TWO_QUEUES without one-gpu-vm (``gone-vm`` instead) and tick; returns the file."""
    path = tmp_path / "q.yaml"
    path.write_text(TWO_QUEUES.replace("  one-gpu-vm:", "  gone-vm:", 1))
    assert run(m, "apply", str(path)) == 0
    m.plugin.tick()
    return path


def test_a_removed_queue_drains_and_never_strands_a_job(stack, tmp_path, capsys):
    import shutil
    import subprocess

    lease = bring_up(stack)
    assert "one-gpu-vm" in advertised(stack)
    path = tmp_path / "q.yaml"
    path.write_text(TWO_QUEUES.replace("  one-gpu-vm:", "  gone-vm:", 1))
    # 25: apply says the lease drains, and with which grace (the removed-queue grace, 15m).
    assert run(stack, "apply", str(path)) == 0
    out = capsys.readouterr().out
    assert "removed: one-gpu-vm" in out
    assert (f"draining: one-gpu-vm: lease {lease['_id']} on gpu-host-01 (active): drains: "
            "running jobs get 15m (the removed-queue grace)") in out
    # 4: no longer advertised (list-queues)...
    assert "one-gpu-vm" not in advertised(stack) and "gone-vm" in advertised(stack)
    # ... and a submission is refused while its VM agents (still listing it) drain, as
    # Testflinger refuses a job no agent may run: 422 with the reason.
    r = requests.post(f"{stack.url}/v1/job", json={"job_queue": "one-gpu-vm"}, timeout=10)
    assert r.status_code == 422
    assert "Magic queue 'one-gpu-vm' was removed" in r.json()["message"]
    assert "by ops" not in r.json()["message"] and str(path) in r.json()["message"]
    tfc = shutil.which("testflinger-cli", path="/tmp/tfvenv/bin")
    if tfc:  # the real CLI: its preflight is refused (no VM agent takes a new job), saying why
        job = tmp_path / "job.yaml"
        job.write_text("job_queue: one-gpu-vm\n")
        cp = subprocess.run([tfc, "--server", stack.url, "submit", str(job)], text=True,
                            capture_output=True, timeout=60, env={"HOME": str(tmp_path)})
        assert cp.returncode != 0 and "was removed" in cp.stderr, (cp.stdout, cp.stderr)
    assert stack.db.jobs.count_documents({"job_data.job_queue": "one-gpu-vm"}) == 0

    # A job that got in anyway (a submission racing the apply) is cancelled by the next tick,
    # told why; a VM agent that re-advertises the queue is unadvertised again.
    stray = {"job_id": "11111111-2222-3333-4444-555555555555", "created_at": None,
             "job_priority": 0, "job_data": {"job_queue": "one-gpu-vm", "exclude_agents": []},
             "result_data": {"job_state": "waiting"}}
    stack.db.jobs.insert_one(dict(stray))
    requests.post(f"{stack.url}/v1/agents/queues", json={"one-gpu-vm": "again"},
                  headers=stack.headers("agent"), timeout=10)
    stack.plugin.tick()
    job = stack.db.jobs.find_one({"job_id": stray["job_id"]})
    assert job["result_data"]["job_state"] == "cancelled"
    note = stack.db.logs.find_one({"job_id": stray["job_id"]})
    assert "magic queue one-gpu-vm was removed from the definitions" in note["log_data"]
    assert "one-gpu-vm" not in advertised(stack)
    kinds = [e["kind"] for e in stack.plugin.events.list(limit=100)]
    assert "queue.jobs_cancelled" in kinds
    # The lease drains (orphan, its VM agents are idle): restored, returned.
    doc = stack.db.magic_leases.find_one({"_id": lease["_id"]})
    assert doc["state"] in ("draining", "restoring")
    stack.plugin.tick()
    doc = stack.db.magic_leases.find_one({"_id": lease["_id"]})
    assert doc["state"] == "restoring"
    body = {"agent_host": "host-a", "generation": doc["generation"], "state": "restoring",
            "result": "ok", "to_state": "returned"}
    assert requests.post(f"{stack.url}/v1/magic/leases/{doc['_id']}/report",
                         headers=stack.headers("agent"), json=body, timeout=10).status_code == 200
    stack.plugin.tick()
    rec = stack.db.magic_removed_queues.find_one({"_id": "one-gpu-vm"})
    assert rec["drained_at"] is not None
    # TRIAL2 finding 4: its VM agents gone, the preflight's 404 still says why (the removal
    # record is kept a week), in Testflinger's body shape; the real CLI prints it.
    assert stack.db.agents.count_documents({"queues": "one-gpu-vm"}) == 0
    r = requests.get(f"{stack.url}/v1/queues/one-gpu-vm/agents", timeout=10)
    assert r.status_code == 404 and r.json()["detail"] == {}, r.text
    msg = r.json()["message"]
    assert msg.startswith("Queue 'one-gpu-vm' does not exist: it was a magic queue, removed ")
    assert f"(by {path}, " in msg and " UTC)" in msg
    if tfc:
        jobfile = tmp_path / "job.yaml"
        cp = subprocess.run([tfc, "--server", stack.url, "submit", str(jobfile)], text=True,
                            capture_output=True, timeout=60, env={"HOME": str(tmp_path)})
        assert cp.returncode != 0 and msg in cp.stderr, (cp.stdout, cp.stderr)
    # A queue never defined gets Testflinger's own answer.
    r = requests.get(f"{stack.url}/v1/queues/never-was/agents", timeout=10)
    assert r.status_code == 404 and r.json()["message"] == "Queue 'never-was' does not exist."
    # Applying the queue again forgets the removal: advertised, submissions taken.
    path.write_text(TWO_QUEUES)
    assert run(stack, "apply", str(path)) == 0
    assert stack.db.magic_removed_queues.find_one({"_id": "one-gpu-vm"}) is None
    assert "one-gpu-vm" in advertised(stack)
    r = requests.post(f"{stack.url}/v1/job", json={"job_queue": "one-gpu-vm"}, timeout=10)
    assert r.status_code == 200, r.text


# ----- 5: owners submit to their home queue while every device of it is lent ---------------
def test_owners_submit_to_a_home_queue_whose_devices_are_all_lent_and_reclaim_them(
        mongo, serve, tmp_path):
    """testflinger-cli's pre-submit check counts an agent online when its state is not
    ``offline`` (TESTFLINGER.md §4.2): a lent device agent shows ``maintenance`` (Busy in
    queue-status), so the owner's job is taken, waits, and the reclaim (owner_wait) drains."""
    import shutil
    import subprocess

    from test_server_flow import Clock

    from testflinger_magic.lab.demo import Submitter

    clock = Clock()
    yaml_text = MAGIC_YAML + "      reclaim: {owner_wait: 5m, grace: 10m}\n"
    m = MagicStack(mongo, serve, yaml_text=yaml_text, server="old", clock=clock)
    try:
        register(m)
        leases = [bring_up(m, d["agent_name"]) for d in DEVICES]
        r = requests.get(f"{m.url}/v1/queues/gpu-hosts/agents", timeout=10,
                         headers=m.headers("contributor"))
        assert {a["name"]: a["state"] for a in r.json()} == {
            "gpu-host-01": "maintenance", "gpu-host-02": "maintenance"}
        assert all(a["comment"].startswith("lent to magic queue one-gpu-vm") for a in r.json())
        job = {"job_queue": "gpu-hosts", "test_data": {"test_cmds": "true"}}
        tfc = shutil.which("testflinger-cli", path="/tmp/tfvenv/bin")
        if tfc:  # the real CLI, without --wait-for-available-agents
            path = tmp_path / "home.yaml"
            path.write_text("job_queue: gpu-hosts\ntest_data: {test_cmds: 'true'}\n")
            cp = subprocess.run([tfc, "--server", m.url, "submit", str(path)], text=True,
                                capture_output=True, timeout=60, env={"HOME": str(tmp_path)})
            assert cp.returncode == 0 and "Job submitted successfully!" in cp.stdout, (
                cp.stdout, cp.stderr)
        else:  # the CLI's check as lab.demo models it
            Submitter(m.url, m.tokens["contributor"]).submit(job)
        assert m.db.jobs.count_documents({"job_data.job_queue": "gpu-hosts",
                                          "result_data.job_state": "waiting"}) == 1
        m.plugin.tick()
        assert all(m.db.magic_leases.find_one({"_id": x["_id"]})["state"] == "active"
                   for x in leases)
        clock.advance(6 * 60)  # past owner_wait: the owner's job reclaims a device
        # ... from a live agent host (a stale host's lease cannot come back: not reclaimed)
        r = requests.post(f"{m.url}/v1/magic/agent-hosts/host-a/heartbeat",
                          headers=m.headers("agent"), json={"leases": []}, timeout=10)
        assert r.status_code == 200, r.text
        m.plugin.tick()
        drained = [d for d in (m.db.magic_leases.find_one({"_id": x["_id"]}) for x in leases)
                   if d["state"] in ("draining", "restoring")]
        assert drained and all(d["drain"]["kind"] == "reclaim" for d in drained)
        # The agent's own offline (its poll raced the claim) is turned back, silently.
        name = drained[0]["device"]
        other = next(d["agent_name"] for d in DEVICES if d["agent_name"] != name)
        doc = m.db.agents.find_one({"name": other})
        m.db.agents.update_one({"name": other}, {"$set": {"state": "offline"}})
        m.plugin.tick()
        assert m.db.agents.find_one({"name": other})["state"] == "maintenance"
        assert m.db.agents.find_one({"name": other})["comment"] == doc["comment"]
        assert not [e for e in m.plugin.events.list(limit=200) if e["kind"] == "lease.repaired"]
    finally:
        m.plugin.stop()


def test_a_drain_over_a_removed_queues_drain_says_what_it_replaced(stack, tmp_path, capsys):
    """TRIAL2 finding 8: draining a lease that already drains (the removed-queue drain, 15m)
    replaced its grace and reason silently; the answer and the CLI now say what it replaced."""
    lease, _busy = bring_up_with_a_busy_vm(stack)  # a job runs: the drain waits for it
    remove_one_gpu_vm(stack, tmp_path)
    doc = stack.db.magic_leases.find_one({"_id": lease["_id"]})
    assert doc["state"] == "draining" and doc["drain"]["kind"] == "orphan", doc
    capsys.readouterr()
    assert run(stack, "drain", lease["_id"], "--grace", "10m") == 0
    out = capsys.readouterr().out
    assert (f"draining {lease['_id']}: state draining; grace changed from 15m "
            "(removed-queue drain: ") in out
    assert out.rstrip().endswith("to 10m (operator drain)"), out
    r = requests.get(f"{stack.url}/v1/magic/leases/{lease['_id']}", headers=stack.headers("admin"),
                     timeout=10)
    drain = r.json()["drain"]
    assert (drain["kind"], drain["grace_until"] - drain["requested_at"]) == ("operator", 600)
    replaced = drain["replaced"]
    assert (replaced["kind"], replaced["label"], replaced["grace"]) == (
        "orphan", "removed-queue drain", 900)
    # A third drain replaces the operator's, not the removal (the last one is named).
    assert run(stack, "drain", lease["_id"], "--grace", "1h30m", "--reason", "later") == 0
    out = capsys.readouterr().out
    assert "grace changed from 10m (operator drain: operator drain) to 1h30m (later)" in out
    # status' DRAIN column keeps a trace of the drain it replaced.
    assert run(stack, "status") == 0
    assert "later (grace until " in (out := capsys.readouterr().out) and \
        "; replaced operator drain" in out


def test_a_reclaim_moves_to_a_lease_that_went_idle_and_no_job_is_cancelled(mongo, serve):
    """TRIAL6 finding M1, end to end through the engine: the owner's job reclaims the idlest
    lease (one busy VM); during its grace the other lease's jobs end. That lease is reclaimed
    instead (it is idle: given back at once) and the first is undrained before its grace ends:
    its VM agent keeps its job, nothing is forced."""
    from test_server_flow import Clock

    clock = Clock()
    m = MagicStack(mongo, serve, yaml_text=MAGIC_YAML + "      reclaim: {owner_wait: 5m, grace: 10m}\n",
                   server="old", clock=clock)

    def post(agent, state, job_id=""):
        r = requests.post(f"{m.url}/v1/agents/data/{agent}", headers=m.headers("agent"),
                          json={"state": state, "queues": ["one-gpu-vm"], "job_id": job_id},
                          timeout=10)
        assert r.status_code == 200, r.text

    def state(lease):
        return m.db.magic_leases.find_one({"_id": lease["_id"]})

    try:
        register(m)
        first, second = (bring_up(m, d["agent_name"]) for d in DEVICES)
        post(first["vms"][0]["agent_name"], "test", "11111111-0000-0000-0000-000000000001")
        for k, vm in enumerate(second["vms"]):
            post(vm["agent_name"], "test", f"22222222-0000-0000-0000-00000000000{k}")
        m.db.jobs.insert_one({"job_id": "33333333-0000-0000-0000-000000000000",
                              "job_data": {"job_queue": "gpu-hosts"}, "created_at": clock(),
                              "result_data": {"job_state": "waiting"}})
        m.plugin.tick()
        clock.advance(6 * 60)  # past owner_wait
        requests.post(f"{m.url}/v1/magic/agent-hosts/host-a/heartbeat", timeout=10,
                      headers=m.headers("agent"), json={"leases": []}).raise_for_status()
        m.plugin.tick()
        assert (state(first)["state"], state(first)["drain"]["kind"]) == ("draining", "reclaim")
        assert state(second)["state"] == "active"  # two busy VMs: not the idlest
        for vm in second["vms"]:  # its jobs end during the grace
            post(vm["agent_name"], "waiting")
        clock.advance(60)
        m.plugin.tick()  # the idle lease is reclaimed too ...
        assert state(second)["drain"]["kind"] == "reclaim"
        assert "taken instead of lease" in state(second)["drain"]["reason"]
        clock.advance(5)
        m.plugin.tick()  # ... and the busy one undrained, its grace not over
        now = state(first)
        assert (now["state"], now["drain"]) == ("active", None)
        assert state(second)["state"] in ("restoring", "returned")
        assert m.db.agents.find_one({"name": first["vms"][0]["agent_name"]})["state"] == "test"
        assert not m.db.magic_fences.find_one({"_id": first["vms"][1]["agent_name"]})
        clock.advance(10 * 60)  # past the grace it had: nothing is forced
        m.plugin.tick()
        events = m.plugin.events.list(limit=200)
        assert "lease.forced" not in [e["kind"] for e in events]
        assert state(first)["state"] == "active"
        assert any(e["kind"] == "lease.active" and "cancel the reclaim drain" in e["message"]
                   and first["_id"] in e["message"] for e in events), events
    finally:
        m.plugin.stop()


def test_the_capacity_entry_says_whose_lease_holds_a_device_and_what_is_being_deployed(stack):
    """TRIAL7 (LOW): "(1 lent)" counted the device lent to the very queue asked about, and a
    test engineer reading the entry could not tell that a machine was being deployed for the
    queue's waiting jobs."""
    def entry(queue):
        r = requests.get(f"{stack.url}/v1/queues/{queue}/agents", timeout=10,
                         headers=stack.headers("contributor"))
        (found,) = [a for a in r.json() if a["name"] == f"magic:{queue}"]
        return found["state"], found["comment"]

    # testflinger-cli queue-status: Available only when a device can be lent for it now.
    assert entry("one-gpu-vm") == ("waiting", "2 lendable device(s), up to 4 VMs")
    assert lend(stack, "gpu-host-01", "one-gpu-vm").status_code == 201
    assert entry("one-gpu-vm") == ("provision", (
        "1 lendable device(s) (1 lent to this queue), up to 4 VMs; 1 device being deployed "
        "for this queue: its jobs wait for it"))
    assert entry("two-gpu-vm") == ("maintenance",
                                   "0 lendable device(s) (1 lent to other queues), up to 1 VM")


def test_applying_a_removed_queue_again_undoes_its_leases_removed_queue_drain(
        stack, tmp_path, capsys):
    """TRIAL16 F1: a queue removed by mistake and applied again 3 s later left its lease
    draining under the removal: its idle VM agents fenced, a new machine deployed for the
    next job, and its running jobs due to be cancelled when the 15m grace ended. Applying
    the queue again now says the drain is undone, and the next tick makes the lease active
    again, its VM agents' fences lifted, the busy one keeping its job."""
    lease, busy = bring_up_with_a_busy_vm(stack)
    path = remove_one_gpu_vm(stack, tmp_path)
    doc = stack.db.magic_leases.find_one({"_id": lease["_id"]})
    assert (doc["state"], doc["drain"]["kind"]) == ("draining", "orphan"), doc
    assert stack.db.magic_fences.count_documents({"lease_id": lease["_id"]}) > 0
    capsys.readouterr()
    path.write_text(TWO_QUEUES)
    assert run(stack, "apply", str(path)) == 0
    out = capsys.readouterr().out
    assert (f"undraining: one-gpu-vm: lease {lease['_id']} on gpu-host-01 (draining): its "
            "removed-queue drain is undone") in out, out
    stack.plugin.tick()
    doc = stack.db.magic_leases.find_one({"_id": lease["_id"]})
    assert (doc["state"], doc["drain"]) == ("active", None), doc
    vm_names = [vm["agent_name"] for vm in doc["vms"]]
    assert stack.db.magic_fences.count_documents({"_id": {"$in": vm_names}}) == 0
    assert stack.db.magic_agent_gate.count_documents(
        {"_id": {"$in": vm_names}, "fenced": True}) == 0
    agent = stack.db.agents.find_one({"name": busy})
    assert (agent["state"], agent["job_id"]) == ("test", BUSY_JOB)  # not cancelled
    assert "undrain" in doc["history"][-1]["reason"] or "defined again" in \
        doc["history"][-1]["reason"], doc["history"][-1]


def test_a_draining_leases_vm_agents_are_not_available_to_the_cli(stack):
    """TRIAL16 F2: testflinger-cli's queue-status counted the fenced, idle VM agents of a
    draining lease as Available while the job waited for a new machine, and its preflight
    passed on a suspended queue because of them. They are answered ``offline`` (saying why),
    a busy one keeps its state (queue-status counts it Busy), and when no agent serves the
    queue and nothing can be lent, the preflight gets the 404 saying why."""
    lease, busy = bring_up_with_a_busy_vm(stack)
    url = f"{stack.url}/v1/queues/one-gpu-vm/agents"
    before = {a["name"]: a["state"] for a in requests.get(url, timeout=10).json()}
    assert before[lease["vms"][1]["agent_name"]] == "waiting"
    assert run(stack, "drain", lease["_id"], "--grace", "1h") == 0
    stack.plugin.tick()
    assert stack.db.magic_leases.find_one({"_id": lease["_id"]})["state"] == "draining"
    listed = {a["name"]: a for a in requests.get(url, timeout=10).json()}
    idle = [vm["agent_name"] for vm in lease["vms"][1:]]
    assert {listed[n]["state"] for n in idle} == {"offline"}, listed
    assert f"lease {lease['_id']} is draining" in listed[idle[0]]["comment"]
    assert listed[busy]["state"] == "test"
    # Another device can still be lent to the queue: its capacity entry stands in.
    assert any(n.startswith("magic:") for n in listed)
    # Nothing can be lent (lending suspended) and no agent serves the queue: 404 saying why.
    stack.db.magic_queues.update_one({"_id": "one-gpu-vm"},
                                     {"$set": {"suspended": {"reason": "agent template missing"}}})
    r = requests.get(url, timeout=10)
    assert r.status_code == 404, r.text
    assert "lending is suspended" in r.json()["message"], r.json()


def test_a_removed_queues_draining_vm_agents_are_not_available_to_the_cli(stack, tmp_path):
    """F2: while a removed queue's lease drained (kind ``orphan``), queue-status counted its
    fenced, idle VM agents Available: the queue agents hook left the removed queue to
    Testflinger's handler. They are answered ``offline`` naming the lease, the busy one keeps
    its state, and a real agent an operator pointed at the name is listed as it is; with no
    such agent the preflight gets a 404 saying the queue was removed (nothing serves it)."""
    lease, busy = bring_up_with_a_busy_vm(stack)
    remove_one_gpu_vm(stack, tmp_path)
    doc = stack.db.magic_leases.find_one({"_id": lease["_id"]})
    assert (doc["state"], doc["drain"]["kind"]) == ("draining", "orphan"), doc
    url = f"{stack.url}/v1/queues/one-gpu-vm/agents"
    # A real agent an operator pointed at the removed name: it serves the queue.
    r = requests.post(f"{stack.url}/v1/agents/data/lab-box-1", headers=stack.headers("agent"),
                      json={"state": "waiting", "queues": ["one-gpu-vm"], "job_id": ""},
                      timeout=10)
    assert r.status_code == 200, r.text
    r = requests.get(url, timeout=10)
    assert r.status_code == 200, r.text
    listed = {a["name"]: a for a in r.json()}
    idle = [vm["agent_name"] for vm in lease["vms"][1:]]
    assert {listed[n]["state"] for n in idle} == {"offline"}, listed
    assert (f"testflinger-magic: lease {lease['_id']} is draining: this VM agent takes no new "
            "job") == listed[idle[0]]["comment"]
    assert (listed[busy]["state"], listed[busy]["job_id"]) == ("test", BUSY_JOB)
    assert listed["lab-box-1"]["state"] == "waiting"
    assert not any(n.startswith("magic:") for n in listed)  # nothing is lent to it
    # Without it, no agent listed takes a new job: the preflight says the queue was removed.
    stack.db.agents.delete_one({"name": "lab-box-1"})
    r = requests.get(url, timeout=10)
    assert r.status_code == 404, r.text
    assert r.json()["message"].startswith("Magic queue 'one-gpu-vm' was removed from the "
                                          "testflinger-magic definitions"), r.json()
