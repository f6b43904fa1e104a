"""``GET /v1/magic/status`` says why a queue's jobs wait (the reasons ``plan`` gives), with
quarantine reasons, each lease's running jobs and a draining lease's grace deadline."""

from __future__ import annotations

import pytest
import requests

from conftest import MagicStack
from test_server_api import DEVICES, register, submit
from test_server_flow import Clock, active_vm_agent_with_a_job, agent_post


def status(m) -> dict:
    r = requests.get(f"{m.url}/v1/magic/status", headers=m.headers("contributor"), timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def queue(m, name="one-gpu-vm") -> dict:
    return next(q for q in status(m)["queues"] if q["name"] == name)


def plan_reasons(m) -> list[str]:
    r = requests.get(f"{m.url}/v1/magic/plan", headers=m.headers("contributor"), timeout=10)
    return [a["reason"] for a in r.json()["actions"] if a["kind"] == "blocked"]


def test_no_blocked_reason_without_waiting_jobs(magic):
    register(magic)
    assert queue(magic)["blocked"] is None


def test_device_too_small_is_the_reason_plan_gives(mongo, serve):
    yaml_text = """\
magic_queues:
  one-gpu-vm:
    description: eight GPUs per VM
    devices: {home_queues: [gpu-hosts]}
    vm: {gpus: 8, vcpus: 2, memory_mib: 4096, disk_gib: 20}
"""
    m = MagicStack(mongo, serve, yaml_text=yaml_text)
    try:
        register(m)
        submit(m, "one-gpu-vm")
        q = queue(m)
        assert q["blocked"]["why"] == "no_device"
        assert "needs 8 GPUs per VM" in q["blocked"]["reason"]
        assert plan_reasons(m) == [q["blocked"]["reason"]]
    finally:
        m.plugin.stop()


def test_all_quarantined_names_each_device_and_its_reason(magic):
    register(magic)
    for d in DEVICES:
        r = requests.post(f"{magic.url}/v1/magic/devices/{d['agent_name']}/quarantine",
                          headers=magic.headers("manager"),
                          json={"reason": f"fan broken on {d['agent_name']}"}, timeout=10)
        assert r.status_code == 200
    submit(magic, "one-gpu-vm")
    q = queue(magic)
    assert q["blocked"]["why"] == "no_device" and "2 quarantined" in q["blocked"]["reason"]
    assert q["quarantined"] == [{"device": "gpu-host-01", "reason": "fan broken on gpu-host-01"},
                                {"device": "gpu-host-02", "reason": "fan broken on gpu-host-02"}]


def test_suspended_queue_says_apply_it_again_once(magic):
    register(magic)
    submit(magic, "one-gpu-vm")
    reason = ("the queue's VM spec does not fit gpu-host-01; fix the queue definition and apply "
              "it again:\nVM one-gpu-vm-0: vcpus 64 > the host's 8 CPUs")
    magic.db.magic_queues.update_one({"_id": "one-gpu-vm"},
                                     {"$set": {"suspended": {"reason": reason}}})
    q = queue(magic)
    assert q["suspended"] == reason and q["blocked"]["why"] == "suspended"
    assert q["blocked"]["reason"].count("apply it again") == 1
    (text,) = plan_reasons(magic)
    assert text.count("apply it again") == 1
    magic.db.magic_queues.update_one({"_id": "one-gpu-vm"},
                                     {"$set": {"suspended": {"reason": "disk too small"}}})
    assert queue(magic)["blocked"]["reason"].endswith(
        "disk too small; fix the definition and apply it again")


def test_max_devices_reached(magic):
    register(magic)
    for _ in range(5):  # 2 devices x 2 VMs serve 4; max_devices 2 stops the fifth
        submit(magic, "one-gpu-vm")
    magic.plugin.tick()
    magic.plugin.tick()
    magic.db.magic_queues.update_one({"_id": "one-gpu-vm"}, {"$set": {"policy.max_devices": 1}})
    q = queue(magic)
    assert q["blocked"]["why"] == "max_devices" and "max_devices 1 reached" in q["blocked"]["reason"]


def test_lease_shows_running_jobs_and_a_drain_shows_its_grace_deadline(mongo, serve):
    clock = Clock()
    m = MagicStack(mongo, serve, clock=clock)
    try:
        lease, name, job_id = active_vm_agent_with_a_job(m)
        agent_post(m, name, state="test", job_id=job_id)
        (open_lease,) = status(m)["leases"]
        assert open_lease["running_jobs"] == [{"agent": name, "job_id": job_id}]
        r = requests.post(f"{m.url}/v1/magic/leases/{lease['_id']}/drain",
                          headers=m.headers("manager"),
                          json={"reason": "maintenance", "grace": "5m"}, timeout=10)
        assert r.status_code == 200
        (open_lease,) = status(m)["leases"]
        assert open_lease["state"] == "draining"
        assert open_lease["drain"]["grace_until"] == clock() + 300
        assert open_lease["running_jobs"] == [{"agent": name, "job_id": job_id}]
    finally:
        m.plugin.stop()


# --- query parameters: a bad value is a 422 naming the parameter ----------------------------

def _get(m, path, **params):
    return requests.get(f"{m.url}/v1/magic/{path}", params=params,
                        headers=m.headers("contributor"), timeout=10)


def _bad_param(r) -> list:
    assert r.status_code == 422, r.text
    return list(r.json()["detail"]["json"])


def test_events_limit_and_since_are_blamed_separately(magic):
    assert _bad_param(_get(magic, "events", limit="abc")) == ["limit"]
    assert _bad_param(_get(magic, "events", since="yesterday")) == ["since"]
    assert _bad_param(_get(magic, "events", since="nan")) == ["since"]
    assert _get(magic, "events", limit="5", since="0").status_code == 200


def test_leases_state_and_open_are_checked(magic):
    r = _get(magic, "leases", state="bogus")
    assert _bad_param(r) == ["state"] and "claimed" in r.json()["detail"]["json"]["state"][0]
    assert _bad_param(_get(magic, "leases", open="maybe")) == ["open"]
    for ok in ({"state": "active"}, {"open": "1"}, {"open": "false"}, {}):
        assert _get(magic, "leases", **ok).status_code == 200


def test_several_bad_parameters_are_named_in_one_422(magic):
    """TRIAL12 F7: ``limit=abc&since=xyz`` named only ``since``; every bad one is named, in
    the format of a single one."""
    r = _get(magic, "events", limit="abc", since="xyz")
    assert r.json() == {"message": "Validation error", "detail": {"json": {
        "since": ["'xyz' is not epoch seconds"], "limit": ["'abc' is not an integer"]}}}
    assert sorted(_bad_param(_get(magic, "events", limit="abc", since="inf"))) == ["limit", "since"]
    r = _get(magic, "leases", state="bogus", open="maybe")
    assert sorted(_bad_param(r)) == ["open", "state"]
    assert r.json()["detail"]["json"]["open"] == [
        "'maybe' is not a boolean; use 1 or 0 (true/false, yes/no)"]


def test_quarantining_again_records_the_new_reason(magic):
    register(magic)
    url = f"{magic.url}/v1/magic/devices/gpu-host-01/quarantine"

    def quarantine(reason):
        r = requests.post(url, headers=magic.headers("manager"), json={"reason": reason},
                          timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    first = quarantine("fan noise")
    assert first["quarantine_reason"] == "fan noise" and first["previous_reason"] is None
    second = quarantine("fan replaced, burn-in pending")
    assert second["quarantine_reason"] == "fan replaced, burn-in pending"
    assert second["previous_reason"] == "fan noise"
    (q,) = status(magic)["queues"]
    assert {"device": "gpu-host-01", "reason": "fan replaced, burn-in pending"} in q["quarantined"]
    messages = [e["message"] for e in _get(magic, "events").json()["events"]]
    assert any("reason now: fan replaced, burn-in pending (was: fan noise)" in m
               for m in messages)


def test_drain_with_grace_zero_cancels_at_once(mongo, serve):
    clock = Clock()
    m = MagicStack(mongo, serve, clock=clock)
    try:
        lease, name, job_id = active_vm_agent_with_a_job(m)
        r = requests.post(f"{m.url}/v1/magic/leases/{lease['_id']}/drain",
                          headers=m.headers("manager"),
                          json={"reason": "now", "grace": "0"}, timeout=10)
        assert r.status_code == 200, r.text
        assert r.json()["drain"]["grace_until"] == clock()
    finally:
        m.plugin.stop()


def test_closed_lease_counts_gpu_hours_borrowed_in_status_and_metrics(mongo, serve):
    """Fairness accounting (issue 11): a lease's GPU-hours (device GPUs x claim-to-close hours)
    are counted once when it closes, per magic queue and home pool: in status (cluster-wide,
    ``magic_fairness``) and in ``magic_gpu_hours_borrowed_total`` (this replica)."""
    from test_server_api import report

    clock = Clock()
    m = MagicStack(mongo, serve, clock=clock)
    try:
        lease, name, job_id = active_vm_agent_with_a_job(m)
        assert status(m)["borrowed"] == []
        clock.advance(2 * 3600)
        agent_post(m, name, state="waiting", job_id="")
        r = requests.post(f"{m.url}/v1/magic/leases/{lease['_id']}/drain",
                          headers=m.headers("manager"), json={"reason": "done", "grace": "0"},
                          timeout=10)
        assert r.status_code == 200, r.text
        m.plugin.tick()  # every VM agent idle: restore
        lease = m.db.magic_leases.find_one({"_id": lease["_id"]})
        assert lease["state"] == "restoring"
        clock.advance(600)
        r = report(m, lease, to_state="returned")
        assert r.status_code == 200 and r.json()["state"] == "returned"
        closed = m.db.magic_leases.find_one({"_id": lease["_id"]})
        hours = 2 * (closed["history"][-1]["at"] - closed["created_at"]) / 3600.0
        assert hours >= 2 * (2 * 3600 + 600) / 3600.0  # 2 GPUs for at least 2 h 10 min
        (row,) = status(m)["borrowed"]
        assert row == {"queue": "one-gpu-vm", "home_pool": "gpu-hosts",
                       "gpu_hours": round(hours, 3), "leases": 1}
        text = requests.get(f"{m.url}/v1/magic/metrics", timeout=10).text
        line = next(x for x in text.splitlines()
                    if x.startswith("magic_gpu_hours_borrowed_total{"))
        assert 'queue="one-gpu-vm"' in line and 'home_pool="gpu-hosts"' in line
        assert float(line.rsplit(" ", 1)[1]) == pytest.approx(hours)
        # A repeated report of the close is stale (409): nothing is counted twice.
        assert report(m, lease, to_state="returned").status_code == 409
        assert status(m)["borrowed"][0]["leases"] == 1
    finally:
        m.plugin.stop()
