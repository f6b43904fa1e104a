"""A device's quarantine outlives its registration (server/keptquarantine.py, TRIAL18 F6):
``agent-hosts forget`` or a registration that leaves the device out deleted its document, and
registered again it was lendable, its quarantine and failures gone, nothing said. Real HTTP,
mongomock."""

from __future__ import annotations

import requests

from test_server_api import DEVICES, register


def quarantine(m, device, reason):
    r = requests.post(f"{m.url}/v1/magic/devices/{device}/quarantine",
                      headers=m.headers("admin"), json={"reason": reason}, timeout=10)
    assert r.status_code == 200, r.text


def device(m, name):
    return m.db.magic_devices.find_one({"_id": name})


def test_forgetting_the_host_keeps_the_quarantine_for_the_next_registration(magic):
    m = magic
    assert register(m).status_code == 200
    quarantine(m, "gpu-host-02", "PSU check")
    m.db.magic_devices.update_one({"_id": "gpu-host-02"}, {"$set": {"failures": 2}})
    r = requests.delete(f"{m.url}/v1/magic/agent-hosts/host-a", headers=m.headers("admin"),
                        params={"reason": "host reinstall"}, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["quarantine_kept"] == ["gpu-host-02"]
    assert device(m, "gpu-host-02") is None
    # Registered again, by another host (the device moved): still quarantined, same reason.
    assert register(m, host="host-b").status_code == 200
    dev = device(m, "gpu-host-02")
    assert (dev["quarantined"], dev["quarantine_reason"], dev["failures"]) == \
        (True, "PSU check", 2)
    assert device(m, "gpu-host-01")["quarantined"] is False
    (ev,) = list(m.db.magic_events.find({"kind": "device.quarantine_kept"}))
    assert ev["device"] == "gpu-host-02" and "PSU check" in ev["message"]
    assert "host-a" in ev["message"] and "unquarantine" in ev["message"]
    r = requests.post(f"{m.url}/v1/magic/leases", headers=m.headers("admin"),
                      json={"device": "gpu-host-02", "queue": "one-gpu-vm", "reason": "t"},
                      timeout=10)
    assert r.status_code == 409, r.text  # a quarantine is never overridden
    # Taken back once: unquarantined, a later forget and registration start clean.
    r = requests.delete(f"{m.url}/v1/magic/devices/gpu-host-02/quarantine",
                        headers=m.headers("admin"), timeout=10)
    assert r.status_code == 200, r.text
    assert requests.delete(f"{m.url}/v1/magic/agent-hosts/host-b", headers=m.headers("admin"),
                           params={"reason": "x"}, timeout=10).json()["quarantine_kept"] == []
    assert register(m).status_code == 200
    assert device(m, "gpu-host-02")["quarantined"] is False
    assert m.db.magic_kept_quarantines.count_documents({}) == 0


def test_a_device_left_out_of_a_registration_keeps_its_quarantine(magic):
    m = magic
    assert register(m).status_code == 200
    quarantine(m, "gpu-host-01", "fan")
    assert register(m, devices=DEVICES[1:]).status_code == 200   # removed from agent-host.yaml
    assert device(m, "gpu-host-01") is None
    (ev,) = list(m.db.magic_events.find({"kind": "device.deregistered"}))
    assert "quarantine of gpu-host-01 is kept" in ev["message"]
    assert register(m).status_code == 200                         # and put back
    dev = device(m, "gpu-host-01")
    assert (dev["quarantined"], dev["quarantine_reason"]) == (True, "fan")


def test_the_same_maas_machine_under_another_name_keeps_the_quarantine(magic):
    """TRIAL19 F2: the kept quarantine followed the agent name only; the same MAAS machine
    registered under another name came back lendable."""
    m = magic
    assert register(m).status_code == 200
    quarantine(m, "gpu-host-02", "RMA-2 PSU")
    assert register(m, devices=DEVICES[:1]).status_code == 200
    renamed = [DEVICES[0], dict(DEVICES[1], agent_name="gpu-host-02b")]
    assert register(m, devices=renamed).status_code == 200
    dev = device(m, "gpu-host-02b")
    assert (dev["quarantined"], dev["quarantine_reason"]) == (True, "RMA-2 PSU")
    (ev,) = list(m.db.magic_events.find({"kind": "device.quarantine_kept"}))
    assert "quarantined as gpu-host-02" in ev["message"]
    assert m.db.magic_kept_quarantines.count_documents({}) == 0


def test_a_kept_quarantine_is_listed_and_lifted_while_unregistered(magic):
    """TRIAL19 F3: invisible in status and unquarantine answered 404 'not registered'."""
    m = magic
    assert register(m).status_code == 200
    quarantine(m, "gpu-host-01", "fan")
    assert register(m, devices=DEVICES[1:]).status_code == 200
    status = requests.get(f"{m.url}/v1/magic/status", headers=m.headers("admin"),
                          timeout=10).json()
    (kept,) = status["kept_quarantines"]
    assert (kept["device"], kept["reason"], kept["maas_system_id"]) == \
        ("gpu-host-01", "fan", DEVICES[0]["maas_system_id"])
    from testflinger_magic.cli_output import _needs_a_person
    assert any("gpu-host-01" in line and "unquarantine gpu-host-01" in line
               for line in _needs_a_person(status))
    page = requests.get(f"{m.url}/v1/magic/", headers=m.headers("admin"), timeout=10).text
    assert "is not registered and stays quarantined when it is (fan)" in page
    r = requests.delete(f"{m.url}/v1/magic/devices/gpu-host-01/quarantine",
                        headers=m.headers("admin"), timeout=10)
    assert r.status_code == 200, r.text
    assert (r.json()["registered"], r.json()["previous_reason"]) == (False, "fan")
    assert register(m).status_code == 200
    assert device(m, "gpu-host-01")["quarantined"] is False
    r = requests.delete(f"{m.url}/v1/magic/devices/nope/quarantine",
                        headers=m.headers("admin"), timeout=10)
    assert r.status_code == 404  # nothing kept, nothing registered
