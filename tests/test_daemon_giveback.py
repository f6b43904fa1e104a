"""Verified give-back (issue 7 item 10): a device goes back to its agent only when every GPU it
was lent with enumerates on the host again, none left on vfio-pci; otherwise the lease fails,
the device is quarantined with the reason, and its agent stays stopped."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from daemon_lab import lab  # noqa: F401 (fixture)
from test_daemon_e2e import drive
from testflinger_magic.agent_host.daemon import Daemon
from testflinger_magic.agent_host.splitplan import GPU
from testflinger_magic.agent_host.steps import gpus_back_problems


def _gpu(address: str, driver: str | None) -> GPU:
    return GPU(address=address, iommu_group=1, functions=(address,), numa_node=0,
               vendor_id="0x10de", product_id="0x2330", driver=driver)


def test_gpus_back_problems_names_what_did_not_come_back():
    lent = ["0000:18:00.0", "0000:2a:00.0"]
    before = {a: "nvidia" for a in lent}
    assert gpus_back_problems(2, lent, before, [_gpu(a, "nvidia") for a in lent]) == []
    # libvirt does not report the driver (its test driver): not judged
    assert gpus_back_problems(2, lent, before, [_gpu(a, None) for a in lent]) == []
    gone = gpus_back_problems(2, lent, before, [_gpu(lent[0], "nvidia")])
    assert gone == ["GPU(s) 0000:2a:00.0 no longer enumerate on the host",
                    "1 GPU(s) enumerate, the device is registered with 2"]
    stuck = gpus_back_problems(2, lent, before, [_gpu(lent[0], "vfio-pci"),
                                                 _gpu(lent[1], "nvidia")])
    assert stuck == ["GPU(s) 0000:18:00.0 still bound to vfio-pci (were nvidia)"]
    # a GPU whose own driver is vfio-pci (a host that keeps them there) stays there
    assert gpus_back_problems(1, lent[:1], {lent[0]: "vfio-pci"},
                              [_gpu(lent[0], "vfio-pci")]) == []


def test_a_gpu_that_fell_off_the_bus_keeps_the_device_away_quarantined(lab):
    daemon = Daemon(lab.config())
    daemon.register()
    lease_id = lab.lend()
    lease = drive(daemon, lab, lease_id, {"active", "restoring", "failed"})
    assert lease["state"] == "active", lease.get("error")
    # NVIDIA Xid 79 "GPU has fallen off the bus": the device no longer enumerates (its node
    # device is gone from the host, as udev removes it).
    gone = lease["vms"][1]["gpus"][0]
    host = lab.tmp / "hosts" / "gpu-host-01.xml"
    tree = ET.parse(host)
    name = "pci_" + gone.replace(":", "_").replace(".", "_")
    (dev,) = [d for d in tree.getroot().findall("device") if d.findtext("name") == name]
    tree.getroot().remove(dev)
    tree.write(host)

    lab.drain(lease_id)
    lease = drive(daemon, lab, lease_id, {"returned", "failed"})
    assert lease["state"] == "failed"
    why = lease["history"][-1]["reason"]
    assert f"GPU(s) {gone} no longer enumerate" in why, why
    device = lab.db.magic_devices.find_one({"_id": "gpu-host-01"})
    assert device["quarantined"] and gone in device["quarantine_reason"]
    # The lease's queue hears of it (its webhooks are chosen by the event's queue).
    assert lab.db.magic_events.find_one({"kind": "device.quarantined", "device": "gpu-host-01",
                                         "queue": "one-gpu-vm"})
    # Not given back: its agent stays stopped and its MAAS machine is not released; the VMs
    # themselves are gone (domains, MAAS machines, programs).
    assert lab.procs.state("gpu-host-01") == "STOPPED"
    assert lab.maas.machine(lab.system_ids["gpu-host-01"])["status_name"] == "Deployed"
    orphans = lab.orphans()
    assert (orphans["domains"], orphans["maas_machines"], orphans["programs"]) == (0, 0, 0)
    # One attempt, not RESTORE_ATTEMPTS: the hardware will not heal by retrying.
    attempts = [h for h in lease["history"] if h["state"] == "restoring"]
    assert len(attempts) == 1


def test_a_lease_drained_before_its_fence_is_restored_and_its_agent_restarted(lab):
    """Issue 10 item 5: a mistaken lend can be undone during bring-up (at once, no failure
    counted); and the device agent, never stopped, is restarted so it posts its state (the
    give-back's sign of life: one running since before the claim would never post again)."""
    daemon = Daemon(lab.config())
    daemon.register()
    rpc = lab.sv.rpc().supervisor
    pid_before = rpc.getProcessInfo("gpu-host-01")["pid"]
    lease_id = lab.lend()
    lab.drain(lease_id)  # still claimed: the daemon has run nothing yet
    lease = lab.lease(lease_id)
    assert lease["state"] == "restoring"
    assert lease["history"][-1]["reason"].startswith("drained during bring-up: test")
    lease = drive(daemon, lab, lease_id, {"returned", "failed"})
    assert lease["state"] == "returned", lease["history"][-1]
    assert lab.db.magic_devices.find_one({"_id": "gpu-host-01"})["failures"] == 0
    info = rpc.getProcessInfo("gpu-host-01")
    assert info["statename"] == "RUNNING" and info["pid"] != pid_before
