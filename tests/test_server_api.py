"""Server plugin over real HTTP: preflight, dispatch fences, the agent-host protocol, bad input."""

from __future__ import annotations

import requests

DEVICES = [
    {"agent_name": "gpu-host-01", "maas_system_id": "abc123", "gpus": 2, "tags": ["nvidia"],
     "home_queues": ["gpu-hosts"]},
    {"agent_name": "gpu-host-02", "maas_system_id": "def456", "gpus": 2, "tags": ["nvidia"],
     "home_queues": ["gpu-hosts"]},
]


def register(m, host="host-a", devices=DEVICES):
    return requests.post(f"{m.url}/v1/magic/agent-hosts/{host}", headers=m.headers("agent"),
                         json={"devices": devices, "version": "0.1"}, timeout=10)


def poll_job(m, agent, queues, headers=None):
    """GET /v1/job as testflinger-agent does: agent token and ``agent_name`` cookie."""
    return requests.get(f"{m.url}/v1/job", params={"queue": queues},
                        headers=m.headers("agent") if headers is None else headers,
                        cookies={"agent_name": agent}, timeout=10)


def submit(m, queue):
    r = requests.post(f"{m.url}/v1/job", json={"job_queue": queue}, timeout=10)
    assert r.status_code == 200
    return r.json()["job_id"]


def report(m, lease, result="ok", to_state=None, host="host-a", **extra):
    body = {"agent_host": host, "generation": lease["generation"], "state": lease["state"],
            "result": result, **extra}
    if to_state:
        body["to_state"] = to_state
    return requests.post(f"{m.url}/v1/magic/leases/{lease['_id']}/report",
                         headers=m.headers("agent"), json=body, timeout=10)


def lend(m, device="gpu-host-01"):
    r = requests.post(f"{m.url}/v1/magic/leases", headers=m.headers("admin"),
                      json={"device": device, "queue": "one-gpu-vm", "reason": "test"}, timeout=10)
    assert r.status_code == 201, r.text
    return r.json()


def test_preflight_needs_a_registered_device(magic):
    r = requests.get(f"{magic.url}/v1/queues/one-gpu-vm/agents", timeout=10)
    assert r.status_code == 404
    assert "no agent host has registered" in r.json()["message"]
    assert register(magic).status_code == 200
    r = requests.get(f"{magic.url}/v1/queues/one-gpu-vm/agents", timeout=10)
    assert r.status_code == 200
    online = [a for a in r.json() if a["state"] != "offline"]  # testflinger-cli's test (§4.2)
    assert [a["name"] for a in online] == ["magic:one-gpu-vm"]
    assert online[0]["comment"].startswith("2 lendable device(s), up to 4 VMs")
    # Non-magic queues are Testflinger's own handler's business.
    r = requests.get(f"{magic.url}/v1/queues/gpu-hosts/agents", timeout=10)
    assert {a["name"] for a in r.json()} == {"gpu-host-01", "gpu-host-02"}
    assert requests.get(f"{magic.url}/v1/queues/nope/agents", timeout=10).status_code == 404


def test_preflight_counts_lendable_devices_as_status_does(magic):
    """One definition of "lendable" (server/devicecount.py): the capacity entry's comment and
    status' devices_lendable agree once a device is lent and another quarantined; the entry still
    offers the lent device's VMs (jobs wait for it)."""
    register(magic)
    lend(magic, "gpu-host-01")

    def both():
        entry = requests.get(f"{magic.url}/v1/queues/one-gpu-vm/agents", timeout=10).json()
        (capacity,) = [a for a in entry if a["name"] == "magic:one-gpu-vm"]
        status = requests.get(f"{magic.url}/v1/magic/status", timeout=10).json()
        return capacity["comment"], status["queues"][0]["devices_lendable"]

    comment, lendable = both()
    assert lendable == 1 and comment == ("1 lendable device(s) (1 lent to this queue), up to 4 "
                                         "VMs; 1 device being deployed for this queue: its jobs "
                                         "wait for it")
    r = requests.post(f"{magic.url}/v1/magic/devices/gpu-host-02/quarantine",
                      headers=magic.headers("admin"), json={"reason": "fan"}, timeout=10)
    assert r.status_code == 200, r.text
    comment, lendable = both()
    assert lendable == 0
    assert comment.startswith("0 lendable device(s) (1 lent to this queue, 1 quarantined), up "
                              "to 2 VMs"), comment


def test_preflight_shapes_agents_like_testflinger(magic):
    """Entries carry only ``AgentOut`` fields, as Testflinger's ``@v1.output`` leaves them."""
    register(magic)
    magic.db.agents.insert_one({"name": "gpu-host-01-vm1", "state": "waiting",
                                "queues": ["one-gpu-vm"], "job_id": "", "log": ["started"],
                                "identifier": "x", "updated_at": "2026-01-01T00:00:00Z"})
    r = requests.get(f"{magic.url}/v1/queues/one-gpu-vm/agents", timeout=10)
    allowed = {"name", "state", "queues", "location", "provision_type", "job_id", "comment",
               "restricted_to"}
    assert r.status_code == 200
    # Devices none of the queue's leases holds: more VMs can come (a job excluding the online
    # VM agent is still served: the CLI's pre-submit check needs an agent it may use; TRIAL7).
    assert [a["name"] for a in r.json()] == ["gpu-host-01-vm1", "magic:one-gpu-vm"]
    assert all(set(a) <= allowed for a in r.json()), r.json()
    # Once the queue holds every usable device, its online VM agents are all there is: the
    # capacity entry does not inflate queue-status.
    lend(magic, "gpu-host-01")
    r = requests.get(f"{magic.url}/v1/queues/one-gpu-vm/agents", timeout=10)
    assert [a["name"] for a in r.json()] == ["gpu-host-01-vm1", "magic:one-gpu-vm"]
    lend(magic, "gpu-host-02")
    r = requests.get(f"{magic.url}/v1/queues/one-gpu-vm/agents", timeout=10)
    assert [a["name"] for a in r.json()] == ["gpu-host-01-vm1"]
    magic.db.agents.update_one({"name": "gpu-host-01-vm1"}, {"$set": {"state": "offline"}})
    r = requests.get(f"{magic.url}/v1/queues/one-gpu-vm/agents", timeout=10)
    assert [a["name"] for a in r.json()] == ["gpu-host-01-vm1", "magic:one-gpu-vm"]
    assert all(set(a) <= allowed for a in r.json()), r.json()


def test_preflight_auth_errors_pass_through_the_hook(magic, caplog):
    """A bad token or role on a magic queue's preflight is the caller's 403 (Testflinger's codes),
    not a hook failure."""
    register(magic)
    for header, status in (("Bearer junk", 403), (f"Bearer {magic.tokens['agent']}", 403)):
        r = requests.get(f"{magic.url}/v1/queues/one-gpu-vm/agents",
                         headers={"Authorization": header}, timeout=10)
        assert r.status_code == status, r.text
    assert not [rec for rec in caplog.records if "hook failed" in rec.getMessage()]


def test_preflight_all_quarantined(magic):
    register(magic)
    for name in ("gpu-host-01", "gpu-host-02"):
        r = requests.post(f"{magic.url}/v1/magic/devices/{name}/quarantine",
                          headers=magic.headers("manager"), json={"reason": "bad fan"}, timeout=10)
        assert r.status_code == 200 and r.json()["quarantined"] is True
    r = requests.get(f"{magic.url}/v1/queues/one-gpu-vm/agents", timeout=10)
    assert r.status_code == 404 and "quarantined" in r.json()["message"]
    requests.delete(f"{magic.url}/v1/magic/devices/gpu-host-01/quarantine",
                    headers=magic.headers("admin"), timeout=10)
    assert requests.get(f"{magic.url}/v1/queues/one-gpu-vm/agents", timeout=10).status_code == 200


def test_magic_queue_is_advertised(magic):
    r = requests.get(f"{magic.url}/v1/agents/queues", timeout=10)
    assert "one-gpu-vm" in r.json()
    assert magic.db.queues.find_one({"name": "one-gpu-vm"})["description"]


def test_fenced_device_agent_gets_no_job(magic):
    register(magic)
    magic.plugin.tick()  # creates the registered devices' gates (nothing to lend: no demand)
    home_job = submit(magic, "gpu-hosts")
    lease = lend(magic)
    assert lease["state"] == "claimed" and len(lease["vms"]) == 2
    r = poll_job(magic, "gpu-host-01", ["gpu-hosts"])
    assert r.status_code == 204
    assert magic.db.jobs.find_one({"job_id": home_job})["result_data"]["job_state"] == "waiting"
    # The other device agent is not fenced and takes the job; its marker records it.
    r = poll_job(magic, "gpu-host-02", ["gpu-hosts"])
    assert r.status_code == 200 and r.json()["job_id"] == home_job
    marker = magic.db.magic_dispatch.find_one({"agent": "gpu-host-02"})
    assert marker["phase"] == "done" and marker["job_id"] == home_job
    # A poll that gets nothing leaves no marker behind.
    assert poll_job(magic, "gpu-host-02", ["gpu-hosts"]).status_code == 204
    assert magic.db.magic_dispatch.count_documents({"phase": "pending"}) == 0


def test_register_other_hosts_device_is_forbidden(magic):
    assert register(magic, "host-a").status_code == 200
    r = register(magic, "host-b", DEVICES[:1])
    assert r.status_code == 403 and "host-a" in r.json()["message"]
    assert magic.db.magic_devices.find_one({"_id": "gpu-host-01"})["agent_host"] == "host-a"


def test_report_validation_and_conflicts(magic):
    register(magic)
    lease = lend(magic)
    url = f"{magic.url}/v1/magic/leases/{lease['_id']}/report"
    # Malformed: the field is named.
    r = requests.post(url, headers=magic.headers("agent"),
                      json={"agent_host": "host-a", "generation": "x", "state": "claimed",
                            "result": "ok"}, timeout=10)
    assert r.status_code == 422 and "generation" in r.json()["detail"]["json"]
    r = requests.post(url, headers=magic.headers("agent"),
                      json={"agent_host": "host-a", "generation": 0, "state": "claimed",
                            "result": "maybe"}, timeout=10)
    assert r.status_code == 422 and "result" in r.json()["detail"]["json"]
    # Wrong role: an admin is not an agent (exact membership, as Testflinger).
    r = requests.post(url, headers=magic.headers("admin"),
                      json={"agent_host": "host-a", "generation": 0, "state": "claimed",
                            "result": "progress"}, timeout=10)
    assert r.status_code == 403 and "agent" in r.json()["message"]
    # Bad token: 403 "Unable to decode token", as Testflinger's decode_jwt_token.
    r = requests.post(url, headers={"Authorization": "Bearer nonsense"}, json={}, timeout=10)
    assert r.status_code == 403 and "decode" in r.json()["message"]
    # Another host's device.
    assert report(magic, lease, to_state="fenced", host="host-b").status_code == 403
    # Illegal transition for the daemon.
    r = report(magic, lease, to_state="active")
    assert r.status_code == 422 and "to_state" in r.json()["detail"]["json"]
    # Unknown lease.
    r = report(magic, dict(lease, _id="lease-000000000000"), to_state="fenced")
    assert r.status_code == 404
    # Nothing changed so far.
    doc = magic.db.magic_leases.find_one({"_id": lease["_id"]})
    assert (doc["state"], doc["generation"]) == ("claimed", 0)
    # A good report, then the same one again: 409 with the current lease.
    r = report(magic, lease, to_state="fenced")
    assert r.status_code == 200 and r.json()["state"] == "fenced"
    r = report(magic, lease, to_state="fenced")
    assert r.status_code == 409 and r.json()["lease"]["generation"] == 1
    # Out-of-range VM index is rejected naming the field, and changes nothing.
    cur = r.json()["lease"]
    r = report(magic, cur, result="progress", vms=[{"index": 7, "ip": "10.0.0.1"}])
    assert r.status_code == 422 and "vms.0.index" in r.json()["detail"]["json"]
    assert magic.db.magic_leases.find_one({"_id": lease["_id"]})["generation"] == 1


def test_integer_fields_take_json_integers_only(magic):
    """TRIAL12 F8: ``generation`` took "6", 12.0 and 1e308 (then a 409, the CAS compared them);
    a registration's ``gpus`` "2" and 2.0. Wrong types are 422 naming the field."""
    for gpus in ("2", 2.0):
        r = register(magic, devices=[dict(DEVICES[0], gpus=gpus)])
        assert r.status_code == 422 and "gpus" in r.json()["detail"]["json"]["devices"]["0"]
    assert magic.db.magic_devices.count_documents({}) == 0
    register(magic)
    lease = lend(magic)
    for generation in ("0", 0.0, 1e308, True):
        r = report(magic, dict(lease, generation=generation), to_state="fenced")
        assert r.status_code == 422, (generation, r.text)
        assert list(r.json()["detail"]["json"]) == ["generation"]
    assert magic.db.magic_leases.find_one({"_id": lease["_id"]})["generation"] == 0
    assert report(magic, lease, to_state="fenced").status_code == 200


def test_operator_reads_and_writes_need_roles(magic):
    assert requests.get(f"{magic.url}/v1/magic/status", timeout=10).status_code == 200
    r = requests.post(f"{magic.url}/v1/magic/devices/gpu-host-01/quarantine",
                      json={"reason": "x"}, timeout=10)  # anonymous contributor
    assert r.status_code == 403 and "admin" in r.json()["message"]
    r = requests.put(f"{magic.url}/v1/magic/queues", headers=magic.headers("admin"),
                     json={"yaml": "magic_queues:\n  q1:\n    devices: {}\n", "source": "f.yaml"},
                     timeout=10)
    assert r.status_code == 422
    assert r.json()["issues"] and r.json()["issues"][0]["file"] == "f.yaml"
    assert magic.plugin.definition("one-gpu-vm") is not None  # bad file changed nothing


def test_work_long_poll_wakes_on_change(magic):
    import threading

    register(magic)
    got = {}

    def poll():
        got["r"] = requests.get(f"{magic.url}/v1/magic/agent-hosts/host-a/work",
                                params={"wait": 20}, headers=magic.headers("agent"), timeout=30)

    t = threading.Thread(target=poll)
    t.start()
    lend(magic)  # notifies the condition
    t.join(30)
    leases = got["r"].json()["leases"]
    assert [x["state"] for x in leases] == ["claimed"]
    r = requests.post(f"{magic.url}/v1/magic/agent-hosts/host-a/heartbeat",
                      headers=magic.headers("agent"), json={"leases": [leases[0]["_id"]]}, timeout=10)
    assert r.status_code == 200


def test_metrics_text(magic):
    register(magic)
    lend(magic)
    poll_job(magic, "gpu-host-01", ["gpu-hosts"])
    text = requests.get(f"{magic.url}/v1/magic/metrics", timeout=10).text
    assert 'magic_leases{state="claimed"} 1.0' in text
    assert 'magic_dispatch_refusals_total{reason="fenced"} 1.0' in text


def test_metrics_say_what_a_lab_alerts_on(magic):
    """TRIAL5 finding 8: waiting jobs and the oldest wait per magic queue, suspended queues,
    quarantined devices, drains by kind; ``magic_vm_agents`` counts only VM agents that can
    take a job; the returned leases are a count of the stored ones."""
    register(magic)
    submit(magic, "one-gpu-vm")
    submit(magic, "one-gpu-vm")
    r = requests.post(f"{magic.url}/v1/magic/devices/gpu-host-02/quarantine",
                      headers=magic.headers("admin"), json={"reason": "fan"}, timeout=10)
    assert r.status_code == 200, r.text
    # The submissions' quick lend lent gpu-host-01 (the one device not quarantined).
    (lease,) = requests.get(f"{magic.url}/v1/magic/leases", headers=magic.headers("admin"),
                            timeout=10).json()["leases"]
    r = requests.post(f"{magic.url}/v1/magic/leases/{lease['_id']}/drain",
                      headers=magic.headers("admin"), json={"reason": "check"}, timeout=10)
    assert r.status_code == 200, r.text
    text = requests.get(f"{magic.url}/v1/magic/metrics", timeout=10).text
    assert 'magic_queue_waiting_jobs{queue="one-gpu-vm"} 2.0' in text
    assert 'magic_queue_oldest_wait_seconds{queue="one-gpu-vm"}' in text
    assert 'magic_queue_suspended{queue="one-gpu-vm"} 0.0' in text
    assert "magic_devices_quarantined 1.0" in text
    assert 'magic_leases{state="returned"} 0.0' in text
    assert 'magic_vm_agents{queue="one-gpu-vm"} 0.0' in text  # in bring-up: no job taken
    assert 'magic_drains_total{kind="operator",queue="one-gpu-vm"} 1.0' in text


def test_expired_token_is_401(magic):
    from testflinger_magic.server import auth

    old = auth.issue_token(magic.app.config["JWT_SIGNING_KEY"], "x", "agent", ttl=-3600)
    r = requests.post(f"{magic.url}/v1/magic/agent-hosts/host-a",
                      headers={"Authorization": f"Bearer {old}"},
                      json={"devices": DEVICES}, timeout=10)
    assert r.status_code == 401 and "expired" in r.json()["message"]
    assert magic.db.magic_devices.count_documents({}) == 0


def test_paused_admission_refuses_vm_agents(magic):
    from testflinger_magic.reconcile import Action

    register(magic)
    lease = lend(magic)
    for to_state in ("fenced", "deploying", "splitting", "enrolling", "active"):
        lease = report(magic, lease, to_state=to_state).json()
    vm = lease["vms"][0]["agent_name"]
    requests.post(f"{magic.url}/v1/agents/data/{vm}",
                  json={"state": "waiting", "queues": ["one-gpu-vm"], "job_id": ""}, timeout=10)
    job = submit(magic, "one-gpu-vm")
    engine = magic.plugin.engine
    assert engine.apply(Action("pause", "consolidate", lease_id=lease["_id"],
                               generation=lease["generation"]))
    assert poll_job(magic, vm, ["one-gpu-vm"]).status_code == 204
    cur = magic.db.magic_leases.find_one({"_id": lease["_id"]})
    # A stale action (old generation) is skipped, not applied.
    assert not engine.apply(Action("resume", "x", lease_id=lease["_id"],
                                   generation=lease["generation"]))
    assert engine.apply(Action("resume", "demand", lease_id=lease["_id"],
                               generation=cur["generation"]))
    r = poll_job(magic, vm, ["one-gpu-vm"])
    assert r.status_code == 200 and r.json()["job_id"] == job


def test_plan_is_a_dry_run(magic):
    register(magic)
    magic.db.jobs.insert_one({"job_id": "j1", "created_at": 0.0, "job_priority": 0,
                              "job_data": {"job_queue": "one-gpu-vm", "exclude_agents": []},
                              "result_data": {"job_state": "waiting"}})
    r = requests.get(f"{magic.url}/v1/magic/plan", timeout=10)
    (action,) = r.json()["actions"]
    assert (action["kind"], action["queue"]) == ("lend", "one-gpu-vm")
    assert magic.db.magic_leases.count_documents({}) == 0
    status = requests.get(f"{magic.url}/v1/magic/status", timeout=10).json()
    assert status["queues"][0]["waiting"] == 1 and status["queues"][0]["devices_lendable"] == 2


def test_lend_an_already_lent_device_names_the_lease(magic):
    """A second hand-lend says which lease holds the device, not what the fence did to its agent."""
    register(magic)
    first = lend(magic, "gpu-host-01")
    r = requests.post(f"{magic.url}/v1/magic/leases", headers=magic.headers("admin"),
                      json={"device": "gpu-host-01", "queue": "one-gpu-vm"}, timeout=10)
    assert r.status_code == 409
    assert "already lent" in r.json()["message"] and first["_id"] in r.json()["message"]
    assert magic.db.magic_leases.count_documents({"device": "gpu-host-01"}) == 1


def test_preflight_names_the_limiting_fact(mongo, serve):
    """testflinger-cli's ``submit`` preflight (``GET /v1/queues/<q>/agents``, exit on 404 with the
    message; lab.demo.Submitter does what the CLI does, TESTFLINGER.md §4.2) on a magic queue
    whose VMs need more GPUs than any device it selects has: the reason is the GPU count, as the
    planner's ``no_match_detail`` says it, not "not eligible under its selection"."""
    import pytest

    from conftest import MAGIC_YAML, MagicStack
    from testflinger_magic.lab.demo import Submitter

    yaml_text = MAGIC_YAML.replace("vm: {gpus: 1,", "vm: {gpus: 8,").replace(
        "vms_per_device: gpus", "vms_per_device: 1")
    assert "gpus: 8" in yaml_text
    stack = MagicStack(mongo, serve, yaml_text=yaml_text)
    try:
        assert register(stack).status_code == 200
        submitter = Submitter(stack.url, stack.tokens["contributor"])
        with pytest.raises(RuntimeError) as exc:
            submitter.submit({"job_queue": "one-gpu-vm"})
        assert str(exc.value) == (
            "testflinger-cli would exit: Magic queue 'one-gpu-vm': needs 8 GPUs per VM; the "
            "largest of the 2 devices its devices selection picks has 2.")
        # A selection that picks none of the registered devices says so (a device whose
        # agent has not posted yet: one that has must share a queue with its home_queues).
        r = register(stack, devices=[dict(DEVICES[0], agent_name="gpu-host-09",
                                          maas_system_id="zzz999", home_queues=["other"],
                                          tags=[])])
        assert r.status_code == 200, r.text
        with pytest.raises(RuntimeError) as exc:
            submitter.submit({"job_queue": "one-gpu-vm"})
        assert str(exc.value).endswith(
            "no registered device matches its devices selection (1 device registered).")
        assert mongo.jobs.count_documents({"job_data.job_queue": "one-gpu-vm"}) == 0
    finally:
        stack.plugin.stop()


def test_reasons_and_grace_are_bounded(magic):
    """A free-text reason is copied into the lease's history and the events (a MongoDB
    document is at most 16 MB): over events.MAX_REASON characters is 422 naming ``reason``;
    a drain grace over durations.MAX_DURATION (the definitions file's limit) is 422 naming
    ``grace``; nothing changes."""
    from testflinger_magic.events import MAX_REASON

    register(magic)
    long = "x" * (MAX_REASON + 1)
    admin = magic.headers("admin")
    r = requests.post(f"{magic.url}/v1/magic/leases", headers=admin, timeout=10,
                      json={"device": "gpu-host-01", "queue": "one-gpu-vm", "reason": long})
    assert r.status_code == 422 and "reason" in r.json()["detail"]["json"]
    assert magic.db.magic_leases.count_documents({}) == 0
    r = requests.post(f"{magic.url}/v1/magic/devices/gpu-host-02/quarantine", headers=admin,
                      json={"reason": long}, timeout=10)
    assert r.status_code == 422 and "reason" in r.json()["detail"]["json"]
    r = requests.delete(f"{magic.url}/v1/magic/agent-hosts/host-a", headers=admin,
                        params={"reason": long}, timeout=10)
    assert r.status_code == 422 and "reason" in r.json()["detail"]["json"]
    r = requests.put(f"{magic.url}/v1/magic/agent-hosts/host-a/binding", headers=admin,
                     json={"client_id": "agent", "reason": long}, timeout=10)
    assert r.status_code == 422 and "reason" in r.json()["detail"]["json"]
    lease = lend(magic)
    url = f"{magic.url}/v1/magic/leases/{lease['_id']}/drain"
    r = requests.post(url, headers=admin, json={"reason": long}, timeout=10)
    assert r.status_code == 422 and "reason" in r.json()["detail"]["json"]
    r = requests.post(url, headers=admin, json={"grace": "99999999999999999999d"}, timeout=10)
    assert r.status_code == 422
    assert "limit of 366d" in r.json()["detail"]["json"]["grace"][0]
    r = requests.post(url, headers=admin, json={"grace": "-5m"}, timeout=10)
    assert r.status_code == 422 and "negative" in r.json()["detail"]["json"]["grace"][0]
    assert magic.db.magic_leases.find_one({"_id": lease["_id"]})["state"] == lease["state"]
    assert requests.post(url, headers=admin, json={"reason": "y" * MAX_REASON},
                         timeout=10).status_code == 200


def test_a_huge_error_message_in_a_report_is_kept_cut_not_refused(magic):
    """A daemon's failure is never refused for its text's size (the failure must be counted);
    the text is cut, saying how much, before it reaches the lease's history and events."""
    from testflinger_magic.server.api_hosts import MAX_REPORT_MESSAGE

    register(magic)
    lease = lend(magic)
    r = report(magic, lease, result="error", message="x" * (3 * 1024 * 1024))
    assert r.status_code == 200, r.text
    doc = magic.db.magic_leases.find_one({"_id": lease["_id"]})
    stored = [h.get("reason") or "" for h in doc["history"]] + [doc.get("error") or ""]
    longest = max(stored, key=len)
    assert longest.startswith("x" * 100) and longest.endswith(" characters cut)")
    assert len(longest) < MAX_REPORT_MESSAGE + 200
