"""TRIAL13 F16: the daemon's registration carries, per device, the NVSwitch count MAAS'
commissioning listed (MAAS >= 3.0 node devices), so a queue of several GPUs per VM is never
lent an HGX board to find out by a deploy. Real parts (tests/daemon_lab.py): the daemon and
python-libmaas against the MAAS simulator, the server plugin over real HTTP."""

from __future__ import annotations

import logging

import pytest

from daemon_lab import DaemonLab
from test_daemon_e2e import drive
from testflinger_magic import queues
from testflinger_magic.agent_host.daemon import Daemon

#: A queue of two GPUs per VM and one of one GPU per VM, both over the HGX board.
YAML = """
magic_queues:
  two-gpu-vm:
    description: two GPUs per VM
    devices: {agents: [gpu-host-01]}
    vms_per_device: 1
    vm: {gpus: 2, vcpus: 2, memory_mib: 2048, disk_gib: 10}
    vm_host_series: jammy
    agent_template: maas2-vm
    provision_type: maas2
    policy: {max_devices: 1, max_starting: 1, min_devices: 0, idle_timeout: 1h}
  one-gpu-vm:
    description: one GPU per VM
    devices: {agents: [gpu-host-01]}
    vms_per_device: gpus
    vm: {gpus: 1, vcpus: 2, memory_mib: 2048, disk_gib: 10}
    vm_host_series: jammy
    agent_template: maas2-vm
    provision_type: maas2
    policy: {max_devices: 1, max_starting: 1, min_devices: 0, idle_timeout: 1h}
"""


@pytest.fixture
def mixed(tmp_path):
    """gpu-host-01: an HGX board (4 NVSwitches); gpu-host-02: a PCIe server (none)."""
    parts = DaemonLab(tmp_path, devices=("gpu-host-01", "gpu-host-02"),
                      kinds={"gpu-host-01": "hgx", "gpu-host-02": "pcie"})
    parts.plugin.apply(queues.load_text(YAML), source="q.yaml")
    yield parts
    parts.stop()


def device_calls(lab):
    return [p for _, p in lab.maas.requests if "/devices/" in p]


def maas_writes(lab):
    return [p for m, p in lab.maas.requests if m == "POST"]


def test_a_two_gpu_job_right_after_registration_is_not_lent_the_board(mixed):
    lab = mixed
    daemon = Daemon(lab.config())
    daemon.register()
    board = lab.db.magic_devices.find_one({"_id": "gpu-host-01"})
    assert board["nvswitches"] == 4 and board["nvswitches_found"]["source"] == "maas"
    assert lab.db.magic_devices.find_one({"_id": "gpu-host-02"})["nvswitches"] == 0
    assert len(device_calls(lab)) == 2  # one MAAS call per device per registration
    lab.submit("two-gpu-vm")
    for _ in range(3):
        lab.plugin.tick()
        daemon.run_once(wait=0, block=True)
    assert lab.db.magic_leases.count_documents({}) == 0
    assert maas_writes(lab) == []  # no allocate, no deploy: nothing wasted
    assert len(device_calls(lab)) == 2  # polls ask MAAS nothing more
    (blocked,) = [a for a in lab.plugin.engine.plan_only(explain=True)
                  if a.kind == "blocked" and a.queue == "two-gpu-vm"]
    assert "gpu-host-01 (4 NVSwitches, listed by MAAS commissioning)" in blocked.reason
    status = {q["name"]: q for q in lab.plugin.engine.status()["queues"]}
    assert status["two-gpu-vm"]["blocked"]["reason"] == blocked.reason
    # A one-GPU-per-VM lend of the same board is unaffected.
    lab.submit("one-gpu-vm")
    lab.plugin.tick()
    (lease,) = list(lab.db.magic_leases.find({}))
    assert (lease["device"], lease["queue"]) == ("gpu-host-01", "one-gpu-vm")
    lease = drive(daemon, lab, lease["_id"], {"active", "restoring", "failed"})
    assert lease["state"] == "active", lease.get("error")
    assert lab.db.magic_devices.find_one({"_id": "gpu-host-01"})["nvswitches"] == 4


def test_a_maas_error_never_stops_the_registration(mixed, caplog):
    lab = mixed
    lab.maas.inject("GET", r"/devices/", 500, body="boom", times=-1)
    daemon = Daemon(lab.config())
    with caplog.at_level(logging.WARNING):
        daemon.register()
    assert lab.db.magic_devices.count_documents({}) == 2
    assert all(d.get("nvswitches") is None for d in lab.db.magic_devices.find({}))
    assert "NVSwitch" in caplog.text and "gpu-host-01" in caplog.text


def test_an_unreachable_maas_is_asked_once_per_registration(mixed):
    lab = mixed
    lab.maas.set_unreachable(True)
    daemon = Daemon(lab.config())
    daemon.register()
    assert lab.db.magic_devices.count_documents({}) == 2
    # The first device's call met the outage; the second was not tried (no second timeout).
    assert len([p for _, p in lab.maas.requests if "/devices/" in p or "describe" in p]) == 1


def test_a_server_older_than_the_field_still_registers_the_devices():
    """A server before the devices' ``nvswitches`` refuses it as an unknown nested field (422
    ``devices.<i>.nvswitches``): the daemon registers again without it, once, and never sends
    it to that server again; any other 422 stays an error."""
    from apiflask import APIFlask, Schema
    from apiflask.fields import Integer, List, Nested, String

    from testflinger_magic.agent_host import client as clientmod
    from testflinger_magic.lab.httpserve import serve

    class OldDeviceIn(Schema):  # api_hosts.DeviceIn before nvswitches
        agent_name = String(required=True)
        maas_system_id = String(required=True)
        gpus = Integer(required=True)

    class OldRegisterIn(Schema):
        devices = List(Nested(OldDeviceIn), required=True)
        version = String()

    app = APIFlask(__name__)
    seen = []

    @app.post("/v1/oauth2/token")
    def token():
        return {"access_token": "t", "refresh_token": "r"}

    @app.post("/v1/magic/agent-hosts/<host>")
    @app.input(OldRegisterIn, location="json")
    def register(host, json_data):
        seen.append(sorted(json_data["devices"][0]))
        return {"agent_host": host, "devices": [d["agent_name"] for d in json_data["devices"]]}

    devices = [{"agent_name": "d1", "maas_system_id": "abc123", "gpus": 8, "nvswitches": 4},
               {"agent_name": "d2", "maas_system_id": "def456", "gpus": 8}]
    handle = serve(app)
    try:
        c = clientmod.MagicClient(handle.url, "cid", "secret")
        assert c.register("h", devices)["devices"] == ["d1", "d2"]
        assert c.register("h", devices)["devices"] == ["d1", "d2"]
        with pytest.raises(clientmod.ServerError, match="HTTP 422"):
            c.register("h", [dict(devices[0], gpus="many")])
    finally:
        handle.stop()
    assert seen == [["agent_name", "gpus", "maas_system_id"]] * 2
    assert c._unknown == {clientmod.DEVICE_NVSWITCHES}
