"""A device MAAS refuses to bring up (HTTP 503 on its deploy: maasserver ``PowerProblem``, a
machine whose power MAAS cannot drive, while MAAS answers everything else) is held back,
longer each time in a row, not lent again at once for ever (TRIAL13 F6: 34 leases a minute);
its deploy going through, or an operator's unquarantine, ends that (server/maasbackoff.py)."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
import requests

from conftest import MagicStack
from test_server_api import register, report
from testflinger_magic import leases as L
from testflinger_magic import reconcile as R
from testflinger_magic.server import maasbackoff

#: What the daemon reports when MAAS answers the deploy with PowerProblem's 503
#: (agent_host/maas_libmaas.py maps 502/503/504 to MaasUnreachable; the daemon blames MAAS).
REFUSED = ("deploying: MaasUnreachable: MAAS at http://maas:5240/MAAS/: deploy abc123 -> "
           "HTTP 503: Power state is not queryable")


class Clock:
    def __init__(self):
        self.t = 1_900_000_000.0

    def __call__(self):
        return self.t


def _stack(mongo, serve):
    clock = Clock()
    stack = MagicStack(mongo, serve, clock=clock)
    # One device, so the only lend is the refused one's.
    assert register(stack, devices=[{"agent_name": "gpu-host-01", "maas_system_id": "abc123",
                                     "gpus": 2, "tags": ["nvidia"],
                                     "home_queues": ["gpu-hosts"]}]).status_code == 200
    return stack, clock


def _heartbeat(m):
    r = requests.post(f"{m.url}/v1/magic/agent-hosts/host-a/heartbeat", headers=m.headers("agent"),
                      json={"leases": []}, timeout=10)
    assert r.status_code == 200, r.text


def _bring_up_refused(m) -> dict:
    """The open lease (claimed by the last tick) fenced, deploying, refused, returned."""
    (lease,) = list(m.db.magic_leases.find({"state": {"$in": sorted(L.OPEN_STATES)}}))
    for to_state in (L.FENCED, L.DEPLOYING):
        r = report(m, lease, to_state=to_state)
        assert r.status_code == 200, r.text
        lease = r.json()
    r = report(m, lease, result="error", message=REFUSED, blame="maas")
    assert r.status_code == 200 and r.json()["state"] == L.RESTORING, r.text
    r = report(m, r.json(), to_state=L.RETURNED)
    assert r.status_code == 200, r.text
    # The restore started the device agent again; it posts waiting (TESTFLINGER.md §3.2).
    m.db.agents.update_one({"name": "gpu-host-01"}, {"$set": {
        "state": "waiting", "job_id": "",
        "updated_at": datetime.fromtimestamp(m.plugin.clock() + 1, timezone.utc)}})
    return r.json()


def _held_back(m, clock, refusals: int) -> None:
    """gpu-host-01 as ``refusals`` refused bring-ups in a row, the last one now, leave it."""
    m.db.magic_devices.update_one({"_id": "gpu-host-01"}, {"$set": {
        "maas_refusals": refusals, "maas_refused_at": clock.t, "maas_refused_reason": REFUSED}})


def _lends(m):
    return [a for a in R.plan(m.plugin.engine.gather(read_only=True)) if a.kind == "lend"]


def test_a_device_maas_refuses_is_held_back_longer_each_time_then_lent_again(mongo, serve):
    m, clock = _stack(mongo, serve)
    try:
        requests.post(f"{m.url}/v1/job", json={"job_queue": "one-gpu-vm"}, timeout=10)
        m.plugin.tick()
        _bring_up_refused(m)
        device = m.db.magic_devices.find_one({"_id": "gpu-host-01"})
        assert device["maas_refusals"] == 1 and device["failures"] == 0
        assert not device["quarantined"]
        # Held back for a minute: no lend, and status says why.
        clock.t += 30
        _heartbeat(m)
        assert _lends(m) == []
        m.plugin.tick()
        assert m.db.magic_leases.count_documents({"state": {"$in": sorted(L.OPEN_STATES)}}) == 0
        status = requests.get(f"{m.url}/v1/magic/status", timeout=10).json()
        row = next(q for q in status["queues"] if q["name"] == "one-gpu-vm")
        assert "held back: MAAS refused it" in str(row), row
        assert row["devices_lendable"] == 0, row  # as the plan: not lendable now
        entry = requests.get(f"{m.url}/v1/queues/one-gpu-vm/agents", timeout=10).json()
        assert any("1 held back: MAAS refused to bring it up" in str(a) for a in entry), entry
        events = requests.get(f"{m.url}/v1/magic/events", timeout=10).json()
        assert any("not lent for 60s, refusal 1 in a row" in e["message"]
                   for e in events["events"]), events
        # The minute is over: lent again; refused again: two minutes this time.
        clock.t += 31
        _heartbeat(m)
        assert [a.device for a in _lends(m)] == ["gpu-host-01"]
        m.plugin.tick()
        _bring_up_refused(m)
        assert m.db.magic_devices.find_one({"_id": "gpu-host-01"})["maas_refusals"] == 2
        clock.t += 90
        _heartbeat(m)
        assert _lends(m) == []
        clock.t += 31
        _heartbeat(m)
        assert [a.device for a in _lends(m)] == ["gpu-host-01"]
        # This time MAAS deploys it: the refusals in a row are over.
        m.plugin.tick()
        (lease,) = list(m.db.magic_leases.find({"state": {"$in": sorted(L.OPEN_STATES)}}))
        for to_state in (L.FENCED, L.DEPLOYING, L.SPLITTING):
            r = report(m, lease, to_state=to_state)
            assert r.status_code == 200, r.text
            lease = r.json()
        device = m.db.magic_devices.find_one({"_id": "gpu-host-01"})
        assert not set(maasbackoff.FIELDS) & set(device)
    finally:
        m.plugin.stop()


@pytest.fixture
def lab(mongo, serve):
    """``(stack, clock)`` of :func:`_stack`, stopped after the test."""
    m, clock = _stack(mongo, serve)
    yield m, clock
    m.plugin.stop()


def test_unquarantine_ends_the_hold_and_the_back_off_is_bounded(lab):
    m, clock = lab
    _held_back(m, clock, 40)
    requests.post(f"{m.url}/v1/job", json={"job_queue": "one-gpu-vm"}, timeout=10)
    assert maasbackoff.backoff_seconds(40) == maasbackoff.BACKOFF_MAX == 3600
    clock.t += 3599
    _heartbeat(m)
    assert _lends(m) == []
    r = requests.delete(f"{m.url}/v1/magic/devices/gpu-host-01/quarantine",
                        headers=m.headers("admin"), timeout=10)
    assert r.status_code == 200, r.text
    assert "MAAS refused to bring it up 40 time(s)" in r.json()["lifted_hold_back"]
    assert [a.device for a in _lends(m)] == ["gpu-host-01"]


def test_a_hand_lend_of_a_held_back_device_says_so(lab):
    """TRIAL14 F6: the operator lends it anyway, and is told it was held back."""
    m, clock = lab
    _held_back(m, clock, 1)
    r = requests.post(f"{m.url}/v1/magic/leases", headers=m.headers("admin"),
                      json={"device": "gpu-host-01", "queue": "one-gpu-vm"}, timeout=10)
    assert r.status_code == 201, r.text
    assert r.json()["note"].startswith("gpu-host-01 was held back from lending: MAAS "
                                       "refused to bring it up 1 time(s)"), r.json()["note"]
