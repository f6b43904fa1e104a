"""Jobs of a magic queue no registered device can serve (testflinger_magic/unservable.py,
server/unservablejobs.py): marked, then cancelled after the grace, each told why where
testflinger-cli reads it; never when a device can serve it again, when nothing registered yet,
or when an operator's own agent serves the name (TRIAL17 F4). Real HTTP, the lab's job service
(its log routes), mongomock."""

from __future__ import annotations

import pytest
import requests

from conftest import MagicStack
from test_server_api import DEVICES, register, report, submit
from test_server_nvswitch import REFUSAL, TWO_YAML, register_counts, to_splitting
from test_server_flow import Clock
from testflinger_magic import unservable
from testflinger_magic.unservable import UNSERVABLE_GRACE


@pytest.fixture
def stack(mongo, serve):
    s = MagicStack(mongo, serve, yaml_text=TWO_YAML, clock=Clock(), server="old")
    yield s
    s.plugin.stop()


def state(m, job_id):
    r = requests.get(f"{m.url}/v1/result/{job_id}", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["job_state"]


def output(m, job_id) -> str:
    r = requests.get(f"{m.url}/v1/result/{job_id}/log/output", timeout=10)
    assert r.status_code == 200, r.text
    return str(r.json())


def kinds(m):
    return [e["kind"] for e in m.db.magic_events.find({}, sort=[("at", 1)])]


def test_a_job_accepted_before_the_nvswitches_were_known_is_cancelled_told_why(stack):
    """TRIAL17 F4: the count unknown at submit, each board's split refuses its VMs; the job
    then waited for ever, silently. Now: marked at once, cancelled after the grace."""
    m = stack
    assert register(m).status_code == 200          # no count: an older MAAS, say
    job = submit(m, "two-gpu-vm")
    for _ in DEVICES:                              # each board lent once, its split refused
        m.plugin.tick()
        (lease,) = list(m.db.magic_leases.find({"state": "claimed"}))
        r = report(m, to_splitting(m, lease), result="error", message=REFUSAL, blame="hardware",
                   facts={"nvswitches": 4})
        assert r.status_code == 200, r.text
        assert report(m, r.json(), to_state="returned").status_code == 200
    m.plugin.tick()
    assert m.db.magic_leases.count_documents({}) == 2   # nothing more lent
    mark = m.db.magic_queues.find_one({"_id": "two-gpu-vm"})["unservable"]
    assert "2 GPUs per VM need NVIDIA Fabric Manager" in mark["reason"]
    (ev,) = [e for e in m.db.magic_events.find({"kind": "queue.unservable"})]
    assert "1 job waiting" in ev["message"] and "cancelled at" in ev["message"]
    assert state(m, job) == "waiting"
    m.plugin.engine.clock.advance(UNSERVABLE_GRACE - 5)
    m.plugin.tick()
    assert state(m, job) == "waiting"              # the operator's time to act
    m.plugin.engine.clock.advance(10)
    m.plugin.tick()
    assert state(m, job) == "cancelled"
    said = output(m, job)
    assert "cancelled before it ran" in said and "no machine able to run it for 10m" in said
    assert "NVSwitches" in said and "apply" not in said   # the test engineer's words
    assert kinds(m).count("queue.jobs_cancelled") == 1
    assert "unservable" not in m.db.magic_queues.find_one({"_id": "two-gpu-vm"})
    m.plugin.tick()
    assert kinds(m).count("queue.unservable") == 1  # no waiting job: not marked again


def test_the_mark_clears_when_a_device_can_serve_it_again(stack):
    m = stack
    assert register_counts(m, {"gpu-host-01": 4, "gpu-host-02": 4}).status_code == 200
    job = submit(m, "two-gpu-vm")
    m.plugin.tick()
    assert "unservable" in m.db.magic_queues.find_one({"_id": "two-gpu-vm"})
    # The operator opts the agent host in (its registration carries it): eligible again.
    r = requests.post(f"{m.url}/v1/magic/agent-hosts/host-a", headers=m.headers("agent"),
                      json={"devices": DEVICES, "version": "0.1", "nvswitch_multi_gpu": True},
                      timeout=10)
    assert r.status_code == 200, r.text
    m.plugin.tick()
    assert "unservable" not in m.db.magic_queues.find_one({"_id": "two-gpu-vm"})
    assert "queue.servable" in kinds(m)
    m.plugin.engine.clock.advance(2 * UNSERVABLE_GRACE)
    m.plugin.tick()
    assert state(m, job) == "waiting" and "queue.jobs_cancelled" not in kinds(m)


def test_a_reapplied_definition_restarts_the_grace(stack):
    m = stack
    assert register_counts(m, {"gpu-host-01": 4, "gpu-host-02": 4}).status_code == 200
    job = submit(m, "two-gpu-vm")
    m.plugin.tick()
    m.plugin.engine.clock.advance(UNSERVABLE_GRACE - 5)
    r = requests.put(f"{m.url}/v1/magic/queues", headers=m.headers("admin"),
                     json={"yaml": TWO_YAML.replace("10m", "20m"), "source": "q.yaml"},
                     timeout=10)
    assert r.status_code == 200, r.text
    m.plugin.tick()                                # marked again, from now
    m.plugin.engine.clock.advance(10)
    m.plugin.tick()
    assert state(m, job) == "waiting"
    assert kinds(m).count("queue.unservable") == 2


def test_nothing_registered_yet_or_an_operators_own_agent_never_cancels(stack):
    m = stack
    job = submit(m, "two-gpu-vm")                  # no agent host has registered any device
    for _ in range(2):
        m.plugin.tick()
        m.plugin.engine.clock.advance(2 * UNSERVABLE_GRACE)
    assert state(m, job) == "waiting" and "queue.unservable" not in kinds(m)
    # Devices registered, none fits; but an operator pointed a real agent at the name.
    assert register_counts(m, {"gpu-host-01": 4, "gpu-host-02": 4}).status_code == 200
    r = requests.post(f"{m.url}/v1/agents/data/their-rig", headers=m.headers("agent"), json={
        "state": "waiting", "queues": ["two-gpu-vm"], "job_id": ""}, timeout=10)
    assert r.status_code == 200, r.text
    for _ in range(2):
        m.plugin.tick()
        m.plugin.engine.clock.advance(2 * UNSERVABLE_GRACE)
    assert state(m, job) == "waiting" and "queue.unservable" not in kinds(m)


def test_the_status_says_when_the_waiting_jobs_are_cancelled(stack):
    m = stack
    assert register_counts(m, {"gpu-host-01": 4, "gpu-host-02": 4}).status_code == 200
    submit(m, "two-gpu-vm")
    m.plugin.tick()
    (row,) = requests.get(f"{m.url}/v1/magic/status", headers=m.headers("admin"),
                          timeout=10).json()["queues"]
    since = m.db.magic_queues.find_one({"_id": "two-gpu-vm"})["unservable"]["since"]
    assert row["cancel_waiting_at"] == since + UNSERVABLE_GRACE
    from testflinger_magic.cli_output import _why_jobs_wait
    lines = _why_jobs_wait([row], now=since)
    assert any("waiting jobs are cancelled in 10m" in line for line in lines), lines
    page = requests.get(f"{m.url}/v1/magic/", headers=m.headers("admin"), timeout=10).text
    assert "its waiting jobs are cancelled in 10m (at " in page and " UTC), told why" in page


# ---------------------------------------------------------------------- the pure decision

def test_decide_marks_cancels_after_the_grace_and_clears():
    v = unservable.decide(["a", "b", "c"], {"b": 100.0, "c": 0.0, "d": 50.0}, now=600.0,
                          grace=600.0)
    assert (v.mark, v.cancel, v.clear) == (["a"], ["c"], ["d"])
    v = unservable.decide([], {}, now=1.0)
    assert (v.mark, v.cancel, v.clear) == ([], [], [])
