"""A bad magic queue definition is the queue's fault, never the devices', and never stops the
reconciler (over real HTTP, mongomock): the user's three cases."""

from __future__ import annotations

import pytest
import requests

from conftest import MAGIC_YAML, MagicStack
from test_server_api import register, report, submit
from test_server_flow import Clock, wait_until
from testflinger_magic import queues
from testflinger_magic.server.plugin import bson_issues

OTHER_YAML = MAGIC_YAML + """\
  other-vm:
    description: Another queue on the same devices
    devices:
      tags: [nvidia]
    vm: {gpus: 1, vcpus: 2, memory_mib: 4096, disk_gib: 20}
    policy: {max_devices: 2, max_starting: 1}
"""
#: MAGIC_YAML with one-gpu-vm's definition changed (the operator's fix).
FIXED_YAML = MAGIC_YAML + "      provision_timeout: 2h\n"


@pytest.fixture
def stack(mongo, serve):
    s = MagicStack(mongo, serve, clock=Clock())
    yield s
    s.plugin.stop()


def put_queues(m, text, source="queues.yaml"):
    return requests.put(f"{m.url}/v1/magic/queues", headers=m.headers("admin"),
                        json={"yaml": text, "source": source}, timeout=10)


def get(m, path):
    r = requests.get(f"{m.url}/v1/magic/{path}", headers=m.headers("admin"), timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def events(m, kind):
    return [e for e in get(m, "events?limit=1000")["events"] if e["kind"] == kind]


def bring_up_to_splitting(m, lease):
    for to_state in ("fenced", "deploying", "splitting"):
        r = report(m, lease, to_state=to_state)
        assert r.status_code == 200, r.text
        lease = r.json()
    return lease


def split_error(m, lease, blame):
    msg = ("splitting: VMSpecDoesNotFit: the queue's VM spec does not fit test:///h.xml; fix "
           "the queue definition and apply it again:\n2 VM(s) x memory_mib need 18000000 MiB > "
           "the host's 524288 MiB")
    r = report(m, lease, result="error", message=msg, blame=blame)
    assert r.status_code == 200, r.text
    return r.json()


def test_split_failure_blamed_on_the_queue_suspends_it_and_spares_the_devices(stack):
    m = stack
    register(m)
    submit(m, "one-gpu-vm")
    m.plugin.tick()
    (lease,) = list(m.db.magic_leases.find({}))
    lease = split_error(m, bring_up_to_splitting(m, lease), "queue")
    assert lease["state"] == "restoring" and "does not fit" in lease["error"]
    # No failure counted against the machine: it stays healthy for its other queues.
    device = m.db.magic_devices.find_one({"_id": lease["device"]})
    assert (device["failures"], device["quarantined"]) == (0, False)
    assert events(m, "device.failure") == []
    (ev,) = events(m, "queue.misconfigured")
    assert ev["queue"] == "one-gpu-vm" and ev["data"] == {"suspended": True}
    assert "lending suspended until a changed definition is applied" in ev["message"]
    # The daemon restores; the job still waits, but nothing more is lent: the plan says why.
    assert report(m, lease, to_state="returned").status_code == 200
    assert m.plugin.tick() == []
    assert m.db.magic_leases.count_documents({"state": {"$ne": "returned"}}) == 0
    (blocked,) = get(m, "plan")["actions"]
    assert blocked["kind"] == "blocked" and blocked["queue"] == "one-gpu-vm"
    assert blocked["reason"].startswith("one-gpu-vm: 1 waiting job; lending suspended: splitting: "
                                        "VMSpecDoesNotFit")
    (row,) = get(m, "status")["queues"]
    assert "VMSpecDoesNotFit" in row["suspended"]
    pre = requests.get(f"{m.url}/v1/queues/one-gpu-vm/agents", timeout=10)
    assert pre.status_code == 404 and "lending is suspended" in pre.json()["message"]
    # A test engineer reads it at submit: the lab's operators act, nobody tells them to apply
    # (not even the agent host's VMSpecDoesNotFit message inside the reason).
    assert "apply" not in pre.json()["message"] and "operators" in pre.json()["message"]
    assert "VMSpecDoesNotFit" in pre.json()["message"]
    r = requests.post(f"{m.url}/v1/magic/leases", headers=m.headers("admin"),
                      json={"device": "gpu-host-02", "queue": "one-gpu-vm"}, timeout=10)
    assert r.status_code == 409 and "suspended" in r.json()["message"]
    # Applying the (fixed, so changed) definition lifts the suspension; lending resumes.
    assert put_queues(m, FIXED_YAML).status_code == 200
    assert get(m, "status")["queues"][0]["suspended"] is None
    m.plugin.tick()  # (apply also kicked a background tick)
    wait_until(lambda: m.db.magic_leases.count_documents({"state": "claimed"}) == 1,
               "a lease claimed again after the re-apply")


def suspend_one_gpu_vm(m):
    """Register, submit, and have one-gpu-vm's bring-up fail on its definition: suspended."""
    register(m)
    submit(m, "one-gpu-vm")
    m.plugin.tick()
    (lease,) = list(m.db.magic_leases.find({}))
    lease = split_error(m, bring_up_to_splitting(m, lease), "queue")
    assert report(m, lease, to_state="returned").status_code == 200
    assert m.db.magic_queues.find_one({"_id": "one-gpu-vm"})["suspended"]


def test_apply_keeps_an_unchanged_queues_suspension(stack):
    """TRIAL2 finding 5: applying a file that changes only another queue kept re-lending a
    broken queue (un-suspended by every apply); an unchanged definition keeps its suspension,
    a changed one (or --unsuspend) lifts it."""
    m = stack
    suspend_one_gpu_vm(m)
    before = m.db.magic_queues.find_one({"_id": "one-gpu-vm"})
    r = put_queues(m, OTHER_YAML, source="other.yaml")  # one-gpu-vm as it was, other-vm added
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["applied"] == ["one-gpu-vm", "other-vm"]
    assert answer["unchanged"] == ["one-gpu-vm"]
    (kept,) = answer["still_suspended"]
    assert kept["queue"] == "one-gpu-vm" and "VMSpecDoesNotFit" in kept["reason"]
    assert m.db.magic_queues.find_one({"_id": "one-gpu-vm"}) == before  # not rewritten
    rows = {q["name"]: q for q in get(m, "status")["queues"]}
    assert "VMSpecDoesNotFit" in rows["one-gpu-vm"]["suspended"]
    assert rows["other-vm"]["suspended"] is None
    m.plugin.tick()
    assert m.db.magic_leases.count_documents({"state": {"$ne": "returned"}}) == 0  # nothing lent
    (ev,) = [e for e in events(m, "queue.applied") if "other.yaml" in e["message"]
             and e["queue"] == "one-gpu-vm"]
    assert "unchanged" in ev["message"]
    # --unsuspend writes the unchanged definition anyway: the suspension is lifted.
    r = requests.put(f"{m.url}/v1/magic/queues", headers=m.headers("admin"),
                     json={"yaml": OTHER_YAML, "source": "other.yaml", "unsuspend": True},
                     timeout=10)
    assert r.status_code == 200 and r.json()["unchanged"] == [], r.text
    assert r.json()["still_suspended"] == []
    assert m.db.magic_queues.find_one({"_id": "one-gpu-vm"}).get("suspended") is None


def test_queues_shows_a_suspension_and_its_cause(stack):
    """TRIAL12 F3: ``GET /queues`` said nothing of a suspended queue (only ``status`` did);
    each queue carries the stored ``suspended`` (null when it lends)."""
    m = stack
    suspend_one_gpu_vm(m)
    (lease,) = list(m.db.magic_leases.find({}))
    (q,) = get(m, "queues")["queues"]
    assert q["_id"] == "one-gpu-vm"
    assert set(q["suspended"]) == {"reason", "at", "lease_id", "device"}
    assert "VMSpecDoesNotFit" in q["suspended"]["reason"]
    assert (q["suspended"]["lease_id"], q["suspended"]["device"]) == (lease["_id"],
                                                                      lease["device"])
    assert put_queues(m, FIXED_YAML).status_code == 200
    (q,) = get(m, "queues")["queues"]
    assert q["suspended"] is None


def test_apply_of_a_changed_definition_lifts_the_suspension(stack):
    m = stack
    suspend_one_gpu_vm(m)
    r = put_queues(m, FIXED_YAML)
    assert r.status_code == 200, r.text
    assert (r.json()["unchanged"], r.json()["still_suspended"]) == ([], [])
    doc = m.db.magic_queues.find_one({"_id": "one-gpu-vm"})
    assert doc.get("suspended") is None and doc["policy"]["provision_timeout"] == 7200


def test_device_blamed_failure_still_counts(stack):
    m = stack
    register(m)
    submit(m, "one-gpu-vm")
    m.plugin.tick()
    (lease,) = list(m.db.magic_leases.find({}))
    split_error(m, bring_up_to_splitting(m, lease), "device")
    assert m.db.magic_devices.find_one({"_id": lease["device"]})["failures"] == 1
    assert events(m, "queue.misconfigured") == []
    bad = report(m, m.db.magic_leases.find_one({}), result="progress", blame="nobody")
    assert bad.status_code == 422 and "blame" in bad.text


def test_definition_applied_after_the_claim_is_not_suspended(stack):
    m = stack
    register(m)
    submit(m, "one-gpu-vm")
    m.plugin.tick()
    (lease,) = list(m.db.magic_leases.find({}))
    lease = bring_up_to_splitting(m, lease)
    m.plugin.clock.advance(60)
    assert put_queues(m, FIXED_YAML).status_code == 200  # the operator's fix, already applied
    split_error(m, lease, "queue")
    assert m.db.magic_queues.find_one({"_id": "one-gpu-vm"}).get("suspended") is None
    (ev,) = events(m, "queue.misconfigured")
    assert ev["data"] == {"suspended": False} and "applied again since" in ev["message"]


def test_apply_of_an_unstorable_value_is_a_422_and_writes_nothing(stack):
    m = stack
    before = m.db.magic_queues.find_one({"_id": "one-gpu-vm"})
    # The user's case 2: rejected by validation now, naming file, line and field.
    bad = MAGIC_YAML.replace("memory_mib: 4096", "memory_mib: 99999999999999999999999")
    r = put_queues(m, OTHER_YAML.replace(MAGIC_YAML, bad))
    assert r.status_code == 422, r.text
    (issue,) = r.json()["issues"]
    assert issue["field"] == "magic_queues.one-gpu-vm.vm.memory_mib" and issue["line"] == 7
    assert m.db.magic_queues.find_one({"_id": "one-gpu-vm"}) == before
    assert m.db.magic_queues.find_one({"_id": "other-vm"}) is None
    # Even a model that skipped validation (model_copy does not validate) is checked as BSON
    # before anything is written: all or nothing.
    good, other = queues.load_text(OTHER_YAML)
    huge = other.model_copy(update={"vm": other.vm.model_copy(update={"memory_mib": 10**23})})
    with pytest.raises(queues.DefinitionError) as info:
        m.plugin.apply([good, huge], source="api-test")
    (issue,) = info.value.issues
    assert (issue.file, issue.field) == ("api-test", "magic_queues.other-vm.vm.memory_mib")
    assert "does not fit MongoDB's 8-byte integers" in issue.message
    assert m.db.magic_queues.find_one({"_id": "one-gpu-vm"}) == before
    assert m.db.magic_queues.find_one({"_id": "other-vm"}) is None
    assert bson_issues({"description": "x" * (17 * 1024 * 1024)}, "q", "f")[0].message.endswith(
        "over MongoDB's 16777216-byte document limit")


def test_invalid_stored_definition_is_skipped_and_other_queues_keep_lending(stack):
    m = stack
    register(m)
    assert put_queues(m, OTHER_YAML).status_code == 200
    # What the user's failed apply left behind: a half-written one-gpu-vm.
    m.db.magic_queues.replace_one({"_id": "one-gpu-vm"}, {})
    submit(m, "other-vm")  # (the submission also kicks a background tick)
    m.plugin.tick()
    m.plugin.tick()
    wait_until(lambda: m.db.magic_leases.count_documents({"queue": "other-vm"}) == 1,
               "other-vm lends despite the broken one-gpu-vm")
    (ev,) = events(m, "queue.invalid")  # once, not once per tick
    assert ev["queue"] == "one-gpu-vm" and "description: Field required" in ev["message"]
    status = get(m, "status")
    assert [q["name"] for q in status["queues"]] == ["other-vm"]
    assert status["invalid_queues"][0]["name"] == "one-gpu-vm"
    assert [q["_id"] for q in get(m, "queues")["queues"]] == ["other-vm"]
    pre = requests.get(f"{m.url}/v1/queues/one-gpu-vm/agents", timeout=10)
    assert pre.status_code == 404 and "stored definition is invalid" in pre.json()["message"]
    # Applying again repairs it.
    assert put_queues(m, OTHER_YAML).status_code == 200
    assert [q["name"] for q in get(m, "status")["queues"]] == ["one-gpu-vm", "other-vm"]


def test_plan_explains_jobs_waiting_on_quarantined_devices(stack):
    m = stack
    register(m)
    for name in ("gpu-host-01", "gpu-host-02"):
        r = requests.post(f"{m.url}/v1/magic/devices/{name}/quarantine",
                          headers=m.headers("admin"), json={"reason": "test"}, timeout=10)
        assert r.status_code == 200
    submit(m, "one-gpu-vm")
    assert m.plugin.tick() == []  # the blocked explanation is never applied
    (act,) = get(m, "plan")["actions"]
    assert act["kind"] == "blocked" and act["queue"] == "one-gpu-vm"
    assert act["reason"] == ("one-gpu-vm: 1 waiting job, 0 idle or starting VMs; no device can be "
                             "lent: 2 quarantined, 0 idle")


def heartbeat(m, host="host-a"):
    """The agent host's heartbeat (every 30 s): a host silent since the clock jumped 46 minutes
    would be stale, and its bring-ups restored as nobody's (reconcile: Inputs.stale_hosts)."""
    r = requests.post(f"{m.url}/v1/magic/agent-hosts/{host}/heartbeat",
                      headers=m.headers("agent"), json={"leases": []}, timeout=10)
    assert r.status_code in (200, 204), r.text


def time_out_bringup(m, device):
    """Lend ``device`` by hand, let its bring-up pass the queue's provision_timeout (45m by
    default) in ``deploying``, tick (the deadline restore) and report the restore done."""
    from test_server_api import lend

    heartbeat(m)
    lease = lend(m, device)
    for to_state in ("fenced", "deploying"):
        lease = report(m, lease, to_state=to_state).json()
    m.plugin.clock.advance(46 * 60)
    heartbeat(m)  # its daemon is alive: a stale host's bring-up would not be the device's fault
    m.plugin.tick()
    doc = m.db.magic_leases.find_one({"_id": lease["_id"]})
    assert doc["state"] == "restoring" and "deadline passed" in doc["error"]
    assert report(m, doc, to_state="returned").status_code == 200
    return doc


def test_bringups_timing_out_on_two_devices_blame_the_queue_not_the_devices(stack):
    """Issue 10 item 4: a provision_timeout too short for the queue times out on every device;
    the second distinct device suspends the queue and neither device keeps a failure."""
    m = stack
    register(m)
    time_out_bringup(m, "gpu-host-01")
    # One device timing out may be the device: counted, the queue still lends.
    assert m.db.magic_devices.find_one({"_id": "gpu-host-01"})["failures"] == 1
    assert m.db.magic_queues.find_one({"_id": "one-gpu-vm"}).get("suspended") is None
    time_out_bringup(m, "gpu-host-02")
    suspended = m.db.magic_queues.find_one({"_id": "one-gpu-vm"})["suspended"]
    assert suspended and "provision_timeout" in suspended["reason"]
    for name in ("gpu-host-01", "gpu-host-02"):
        device = m.db.magic_devices.find_one({"_id": name})
        assert (device["failures"], device["quarantined"]) == (0, False), name
    (ev,) = events(m, "queue.misconfigured")
    assert ev["data"]["suspended"] is True and "gpu-host-01" in ev["message"]
    m.plugin.tick()
    assert all(not d["quarantined"] for d in m.db.magic_devices.find({}))
    # Applying the fixed definition lifts the suspension; an earlier run no longer counts.
    assert put_queues(m, FIXED_YAML).status_code == 200
    assert m.db.magic_queues.find_one({"_id": "one-gpu-vm"}).get("suspended") is None


def test_a_successful_bringup_in_between_keeps_the_queue_lending(stack):
    m = stack
    register(m)
    time_out_bringup(m, "gpu-host-01")
    from test_server_api import lend

    heartbeat(m)
    lease = lend(m, "gpu-host-02")
    for to_state in ("fenced", "deploying", "splitting", "enrolling", "active"):
        lease = report(m, lease, to_state=to_state).json()
    r = requests.post(f"{m.url}/v1/magic/leases/{lease['_id']}/drain", headers=m.headers("admin"),
                      json={"reason": "done"}, timeout=10)
    assert r.status_code == 200, r.text
    m.plugin.tick()
    lease = m.db.magic_leases.find_one({"_id": lease["_id"]})
    assert lease["state"] == "restoring", lease["state"]
    assert report(m, lease, to_state="returned").status_code == 200
    time_out_bringup(m, "gpu-host-02")
    assert m.db.magic_queues.find_one({"_id": "one-gpu-vm"}).get("suspended") is None
    assert [d["failures"] for d in m.db.magic_devices.find({}, sort=[("_id", 1)])] == [1, 1]


QUARANTINE_AT_ONE = MAGIC_YAML + "      failures_before_quarantine: 1\n"


def test_a_failure_taken_back_lifts_the_quarantine_it_caused(stack):
    """failures_before_quarantine 1: the first device's bring-up timeout is counted and the
    next tick quarantines it; the second device's timeout blames the queue and takes that
    failure back, and with it the quarantine it caused (an event says which and why)."""
    m = stack
    assert put_queues(m, QUARANTINE_AT_ONE).status_code == 200
    register(m)
    first = time_out_bringup(m, "gpu-host-01")
    m.plugin.tick()  # the planner's quarantine for the failure count
    device = m.db.magic_devices.find_one({"_id": "gpu-host-01"})
    assert device["quarantined"] and device["quarantine_lease"] == first["_id"]
    time_out_bringup(m, "gpu-host-02")
    assert m.db.magic_queues.find_one({"_id": "one-gpu-vm"})["suspended"]
    for name in ("gpu-host-01", "gpu-host-02"):
        device = m.db.magic_devices.find_one({"_id": name})
        assert (device["failures"], device["quarantined"]) == (0, False), name
    (ev,) = events(m, "device.unquarantined")
    assert ev["device"] == "gpu-host-01" and first["_id"] in ev["message"]
    assert "taken back" in ev["message"] and "one-gpu-vm is at fault" in ev["message"]
    m.plugin.tick()
    assert not any(d["quarantined"] for d in m.db.magic_devices.find({}))


def test_a_failure_taken_back_keeps_an_operators_quarantine(stack):
    """The same run, but an operator quarantined the first device (before the planner did):
    that quarantine is not the failure's, so taking the failure back leaves it."""
    m = stack
    assert put_queues(m, QUARANTINE_AT_ONE).status_code == 200
    register(m)
    time_out_bringup(m, "gpu-host-01")
    r = requests.post(f"{m.url}/v1/magic/devices/gpu-host-01/quarantine",
                      headers=m.headers("admin"), json={"reason": "BMC flaky"}, timeout=10)
    assert r.status_code == 200, r.text
    m.plugin.tick()
    time_out_bringup(m, "gpu-host-02")
    assert m.db.magic_queues.find_one({"_id": "one-gpu-vm"})["suspended"]
    device = m.db.magic_devices.find_one({"_id": "gpu-host-01"})
    assert (device["failures"], device["quarantined"]) == (0, True)
    assert device["quarantine_reason"] == "BMC flaky"
    assert events(m, "device.unquarantined") == []


def test_init_app_refuses_an_app_without_testflinger_database(monkeypatch):
    """Testflinger's create_flask_app leaves MongoDB unconnected when TESTING is set
    (``testflinger.database.mongo.db`` is None): init_app says so instead of failing later with
    a TypeError deep in the event log (found running Testflinger's own suite with the plugin)."""
    from flask import Flask

    import testflinger_magic.server as server

    monkeypatch.setattr(server, "default_db", lambda: None)
    app = Flask("tf")
    with pytest.raises(RuntimeError, match=r"database is not connected.*pass db="):
        server.init_app(app, start_ticker=False)
    assert "testflinger_magic" not in app.extensions


def test_the_planners_quarantine_names_the_last_failure_and_its_fix(stack):
    """TRIAL5 finding 9: "3 failed leases (limit 3)" alone sent the operator to the events;
    the quarantine reason carries the last counted failure's lease and error."""
    m = stack
    assert put_queues(m, QUARANTINE_AT_ONE).status_code == 200
    register(m)
    first = time_out_bringup(m, "gpu-host-01")
    m.plugin.tick()
    reason = m.db.magic_devices.find_one({"_id": "gpu-host-01"})["quarantine_reason"]
    assert f"; last failure ({first['_id']}): " in reason and "deadline passed" in reason


def test_a_bring_up_error_that_asks_for_quarantine_quarantines_at_once(stack):
    """TRIAL5 finding 9: a split that finds the registration promising GPUs the host cannot
    lend (agent_host/bringup.py DeviceMisconfigured) quarantines the device with its message
    (no second and third deploy to reach the failure limit); a progress or ok report may not
    ask for it."""
    m = stack
    register(m)
    submit(m, "one-gpu-vm")
    m.plugin.tick()
    (lease,) = list(m.db.magic_leases.find({}))
    lease = bring_up_to_splitting(m, lease)
    r = report(m, lease, result="progress", message="x", quarantine=True)
    assert r.status_code == 422 and "quarantine" in r.text
    msg = ("2 VM(s) x 1 GPU(s) need 2 GPUs; the host has 1 GPU(s), 1 of them can be lent. "
           "Fix: set gpus: 1 for device gpu-host-01 in the agent-host config")
    r = report(m, lease, result="error", message=msg, quarantine=True)
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "restoring"
    device = m.db.magic_devices.find_one({"_id": lease["device"]})
    assert device["quarantined"] is True and device["quarantine_reason"] == msg
    assert device["failures"] == 1
