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
