"""Registration refuses device names and MAAS machines another device already has, in the
same registration or across agent hosts (TRIAL4 findings 2 and 3; names.vm_name_clash), over
real HTTP; nothing is written when refused."""

from __future__ import annotations

import pytest
import requests

from testflinger_magic import names
from testflinger_magic.lab import dbcount

DEVICE = {"agent_name": "t4-host-01", "maas_system_id": "abc123", "gpus": 2}


def register(m, devices, host="host-a"):
    return requests.post(f"{m.url}/v1/magic/agent-hosts/{host}", headers=m.headers("agent"),
                         json={"devices": devices, "version": "0.1"}, timeout=30)


def _nothing_written(m, host):
    assert m.db.magic_agent_hosts.count_documents({"_id": host}) == 0
    assert m.db.magic_devices.count_documents({"agent_host": host}) == 0


@pytest.mark.parametrize("second,words", [
    ("t4-host-01-vm1", "is the agent name of VM 1 of device 't4-host-01' (devices.0)"),
    ("t4-host-01-vm64", "VM 64 of device 't4-host-01'"),
    ("T4-HOST-01", "differs from device 't4-host-01' (devices.0) only in case"),
    ("T4-Host-01-VM2", "VM 2 of device 't4-host-01'"),
])
def test_a_registration_naming_a_vm_of_its_own_device_is_422(magic, second, words):
    r = register(magic, [DEVICE, dict(DEVICE, agent_name=second, maas_system_id="other")])
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]["json"]["devices"]
    assert list(detail) == ["1"] and words in detail["1"]["agent_name"][0], detail
    _nothing_written(magic, "host-a")


def test_a_device_whose_vms_would_be_named_like_an_earlier_one_is_422(magic):
    r = register(magic, [dict(DEVICE, agent_name="t4-host-01-vm3"),
                         dict(DEVICE, maas_system_id="other")])
    assert r.status_code == 422, r.text
    why = r.json()["detail"]["json"]["devices"]["1"]["agent_name"][0]
    assert "would name its VM 3 t4-host-01-vm3 while lent, which is device " \
           "'t4-host-01-vm3' (devices.0)" in why


@pytest.mark.parametrize("name", ["t4-host-01-vm0", "t4-host-01-vm65", "t4-host-01-vm01",
                                  "t4-host-01-vm", "t4-host-011", "t4-host-01-v1"])
def test_names_no_vm_has_are_accepted(magic, name):
    r = register(magic, [DEVICE, dict(DEVICE, agent_name=name, maas_system_id="other")])
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("name,words", [
    ("t4-host-01-vm1", "'t4-host-01-vm1' is the agent name of VM 1 of device 't4-host-01' "
                       "(agent host host-a)"),
    ("T4-HOST-01", "differs from device 't4-host-01' (agent host host-a) only in case"),
    ("t4-host", "would name its VM 1 t4-host-vm1"),
])
def test_names_clash_across_agent_hosts(magic, name, words):
    first = [DEVICE, dict(DEVICE, agent_name="t4-host-vm1", maas_system_id="s2")]
    assert register(magic, first).status_code == 200
    r = register(magic, [dict(DEVICE, agent_name=name, maas_system_id="zzz")], host="host-b")
    assert r.status_code == 409, r.text
    message = r.json()["message"]
    assert message.startswith("registration refused: devices.0.agent_name: ") and words in message
    _nothing_written(magic, "host-b")


def test_an_agent_host_may_re_register_and_rename_its_own_devices(magic):
    """Its own devices are not others: re-registering, or replacing t4-host-01 by
    t4-host-01-vm1 (the old one is deregistered), is no clash."""
    assert register(magic, [DEVICE]).status_code == 200
    assert register(magic, [DEVICE]).status_code == 200
    r = register(magic, [dict(DEVICE, agent_name="t4-host-01-vm1")])
    assert r.status_code == 200, r.text
    assert [d["_id"] for d in magic.db.magic_devices.find()] == ["t4-host-01-vm1"]


def test_a_maas_machine_of_another_agent_hosts_device_is_refused(magic):
    """TRIAL4 3: two devices of two hosts on one MAAS machine would deploy and release it under
    two leases; refused like a device of another host (403), naming both."""
    assert register(magic, [DEVICE]).status_code == 200
    r = register(magic, [dict(DEVICE, agent_name="t4-z")], host="host-b")
    assert r.status_code == 403, r.text
    message = r.json()["message"]
    assert "devices.0.maas_system_id: MAAS machine abc123 is device t4-host-01's, registered " \
           "to agent host host-a, not host-b" in message
    _nothing_written(magic, "host-b")
    # the same host may move the machine to a renamed device
    assert register(magic, [dict(DEVICE, agent_name="t4-z")]).status_code == 200


def test_registration_reads_the_devices_a_bounded_number_of_times(magic):
    """No query per device: registering 50 devices reads ``magic_devices`` as often as
    registering 2 (the other devices' names and system ids are read once)."""
    assert register(magic, [dict(DEVICE, agent_name=f"o{i}", maas_system_id=f"o{i}")
                            for i in range(50)], host="host-b").status_code == 200
    engine = magic.plugin.engine
    real = engine.db
    reads = []
    for n, host in ((2, "host-c"), (50, "host-d")):
        engine.db = dbcount.Counting(real, kinds=True, this_thread=True)
        engine.db.on = True
        try:
            engine.register(host, [dict(DEVICE, agent_name=f"{host}-{i}",
                                        maas_system_id=f"{host}-{i}") for i in range(n)], "0.1")
        finally:
            counted, engine.db = engine.db, real
        reads.append(sum(c for (coll, kind, _m), c in counted.ops.items()
                         if coll == "magic_devices" and kind == "read"))
    assert reads[0] == reads[1] and reads[0] >= 1, reads


def test_vm_name_clash_is_none_for_unrelated_and_identical_names():
    assert names.vm_name_clash("gpu-host-01", ["gpu-host-02", "gpu-host-01"]) is None
    assert names.vm_name_clash("gpu-host-01", []) is None
