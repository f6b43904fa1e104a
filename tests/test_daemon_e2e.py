"""The daemon carries a lease claimed -> active -> returned against real parts (see daemon_lab)."""

from __future__ import annotations

import pytest

from daemon_lab import DaemonLab
from testflinger_magic.agent_host.daemon import Daemon
from testflinger_magic.agent_host.journal import journaled_leases

BRINGUP = ["claimed", "fenced", "deploying", "splitting", "enrolling", "active"]


@pytest.fixture
def lab(tmp_path):
    parts = DaemonLab(tmp_path)
    yield parts
    parts.stop()


def drive(daemon: Daemon, lab: DaemonLab, lease_id: str, until: set[str], limit: int = 60) -> dict:
    """Poll and work (synchronously) until the lease reaches a state in ``until``."""
    for _ in range(limit):
        lease = lab.lease(lease_id)
        if lease["state"] in until:
            return lease
        daemon.run_once(wait=0, block=True)
    raise AssertionError(f"lease stuck in {lab.lease(lease_id)['state']}")


def test_lease_claimed_to_active_and_back_to_returned(lab):
    daemon = Daemon(lab.config())
    daemon.register()
    lease_id = lab.lend()
    lease = drive(daemon, lab, lease_id, {"active", "restoring", "failed"})
    assert lease["state"] == "active", lease.get("error")
    assert [h["state"] for h in lease["history"]] == BRINGUP
    # The server saw every effect, begun and done.
    actions = {(i["action"], i["phase"]) for i in lease["intent"]}
    for action in ("agent.stop", "maas.deploy", "libvirt.split", "maas.create", "agent.add"):
        assert {(action, "begin"), (action, "done")} <= actions
    assert len(lease["vms"]) == lab.gpus
    for vm in lease["vms"]:
        assert vm["maas_system_id"] and vm["domain"] == vm["name"] and len(vm["gpus"]) == 1
        assert lab.procs.state(vm["name"]) == "RUNNING"
        power = lab.maas.machine(vm["maas_system_id"])
        assert power["power_type"] == "virsh" and vm["ip"] in power["ip_addresses"]
    assert len({vm["metrics_port"] for vm in lease["vms"]}) == lab.gpus
    assert lab.procs.state("gpu-host-01") == "STOPPED"
    assert lab.orphans() == {"domains": 2, "maas_machines": 2, "programs": 2, "folders": 2}

    lab.drain(lease_id)
    lease = drive(daemon, lab, lease_id, {"returned", "failed"})
    assert lease["state"] == "returned", lease.get("error")
    assert lab.orphans() == {"domains": 0, "maas_machines": 0, "programs": 0, "folders": 0}
    assert lab.procs.state("gpu-host-01") == "RUNNING"
    assert lab.maas.machine(lab.system_ids["gpu-host-01"])["status_name"] == "Ready"
    assert journaled_leases(lab.config().state_dir) == []


def test_charm_wipe_of_vm_programs_is_repaired_while_active(lab):
    daemon = Daemon(lab.config(heartbeat_interval=0))
    daemon.register()
    lease_id = lab.lend()
    lease = drive(daemon, lab, lease_id, {"active", "restoring"})
    assert lease["state"] == "active", lease.get("error")
    name = lease["vms"][0]["name"]
    lab.procs.remove_vm_agent(name)  # what a charm config-changed does to our conf file
    assert lab.procs.state(name) == "ABSENT"
    daemon.run_once(wait=0, block=True)
    assert lab.procs.state(name) == "RUNNING"
