"""Verified give-back (issue 7 item 10): a device goes back to its agent only when every GPU it
was lent with enumerates on the host again, none left on vfio-pci; otherwise the lease fails,
the device is quarantined with the reason, and its agent stays stopped."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import libvirt

from daemon_lab import NOTHING, lab  # noqa: F401 (fixture)
from test_daemon_e2e import drive
from testflinger_magic.agent_host.daemon import Daemon
from testflinger_magic.agent_host.steps import gpus_back_problems
from testflinger_magic.lab import hosts
from testflinger_magic.lab.hosts import write_host_xml


def test_gpus_back_problems_names_what_did_not_come_back():
    at_split = ["0000:18:00.0", "0000:2a:00.0"]
    before = {a: "nvidia" for a in at_split}
    assert gpus_back_problems(at_split, before, dict(before)) == []
    # libvirt does not report the driver (its test driver): not judged
    assert gpus_back_problems(at_split, before, {a: None for a in at_split}) == []
    gone = gpus_back_problems(at_split, before, {at_split[0]: "nvidia"})
    assert gone == ["GPU(s) 0000:2a:00.0 no longer enumerate on the host (1 of the 2 GPU(s) "
                    "on the bus at split do)"]
    stuck = gpus_back_problems(at_split, before, {at_split[0]: "vfio-pci",
                                                  at_split[1]: "nvidia"})
    assert stuck == ["GPU(s) 0000:18:00.0 still bound to vfio-pci (were nvidia)"]
    # a GPU whose own driver is vfio-pci (a host that keeps them there) stays there
    assert gpus_back_problems(at_split[:1], {at_split[0]: "vfio-pci"},
                              {at_split[0]: "vfio-pci"}) == []


def test_a_refused_gpu_still_on_the_bus_never_fails_the_give_back():
    """TRIAL3 finding 1: 8 GPUs on the bus at split, 6 lendable (2 refused by discovery): all 8
    back is a clean give-back, whatever the registered count; one of them gone is not."""
    at_split = [f"0000:{b:02x}:00.0" for b in (0x18, 0x2a, 0x3a, 0x5d, 0x9a, 0xab, 0xba, 0xdb)]
    now = {a: "nvidia" for a in at_split}
    assert gpus_back_problems(at_split, dict(now), now) == []
    del now["0000:ab:00.0"]  # the refused one fell off the bus: the device lost a GPU
    assert gpus_back_problems(at_split, {}, now) == [
        "GPU(s) 0000:ab:00.0 no longer enumerate on the host (7 of the 8 GPU(s) on the bus at "
        "split do)"]


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


# --- a host with a GPU that cannot be lent (TRIAL3 findings 1 and 2) ----------------------------

def _rewrite_host(lab, **kw) -> None:
    """The device's host file as a real HGX board may be (lab.hosts ``shared_groups``)."""
    write_host_xml(lab.tmp / "hosts" / "gpu-host-01.xml", gpus=lab.gpus, name="gpu-host-01",
                   **kw)


def test_a_refused_gpu_fails_the_split_with_the_truth_and_the_device_is_given_back(lab):
    """Registered with its physical count (2) while one GPU shares its IOMMU group with a NIC:
    the server plans 2 VMs, the split says how many GPUs the host has, how many can be lent,
    why the other is refused and what to set; the give-back sees every GPU that was on the bus
    at split still there, so the device goes back to its agent. The registration promises a GPU
    the host cannot lend, so every lend would end the same way (a bare-metal deploy each):
    the device is quarantined at once with that message (TRIAL5 finding 9), its home queues
    keep it."""
    _rewrite_host(lab, shared_groups={1: "nic"})
    refused = hosts.gpu_address(1)
    daemon = Daemon(lab.config())
    daemon.register()
    lease_id = lab.lend()
    lease = drive(daemon, lab, lease_id, {"returned", "failed", "active"})
    assert lease["state"] == "returned", lease["history"][-2:]
    why = next(h["reason"] for h in lease["history"] if h["state"] == "restoring")
    for part in ("2 VM(s) x 1 GPU(s) need 2 GPUs", "the host has 2 GPU(s), 1 of them can be lent",
                 f"{refused}: IOMMU group 41 also holds {hosts.shared_nic_address(1)}",
                 "enable ACS", "set gpus: 1 for device gpu-host-01 in the agent-host config"):
        assert part in why, why
    device = lab.db.magic_devices.find_one({"_id": "gpu-host-01"})
    assert device["quarantined"] is True
    assert "set gpus: 1 for device gpu-host-01" in device["quarantine_reason"]
    assert "quarantined until the agent host's configuration is fixed" in \
        device["quarantine_reason"]
    assert device["failures"] == 1  # a failed bring-up of the device: counted
    assert lab.procs.state("gpu-host-01") == "RUNNING"
    assert lab.maas.machine(lab.system_ids["gpu-host-01"])["status_name"] == "Ready"
    assert lab.orphans() == NOTHING


def test_a_device_registered_with_its_lendable_gpus_is_lent_and_given_back(lab):
    """gpus: 1 on the same host: one VM, and the refused GPU (still on the bus, never lent)
    does not stop the give-back."""
    _rewrite_host(lab, shared_groups={1: "nic"})
    daemon = Daemon(lab.config(devices=[{**lab.config_dict()["devices"][0], "gpus": 1}]))
    daemon.register()
    lease_id = lab.lend()
    lease = drive(daemon, lab, lease_id, {"active", "restoring", "failed"})
    assert lease["state"] == "active", lease["history"][-1]
    assert [vm["gpus"] for vm in lease["vms"]] == [[hosts.gpu_address(0)]]
    lab.drain(lease_id)
    lease = drive(daemon, lab, lease_id, {"returned", "failed"})
    assert lease["state"] == "returned", lease["history"][-1]
    assert lab.procs.state("gpu-host-01") == "RUNNING"


def test_a_gpu_sharing_its_group_with_its_switch_port_is_lent_without_the_port(lab):
    """The port (a bridge) stays with the host: both GPUs are lent, no domain holds the port."""
    _rewrite_host(lab, shared_groups={0: "port"})
    daemon = Daemon(lab.config())
    daemon.register()
    lease_id = lab.lend()
    lease = drive(daemon, lab, lease_id, {"active", "restoring", "failed"})
    assert lease["state"] == "active", lease["history"][-1]
    assert sorted(g for vm in lease["vms"] for g in vm["gpus"]) == [hosts.gpu_address(0),
                                                                     hosts.gpu_address(1)]
    port = hosts.switch_port_address(0)
    bus = f"bus='0x{port[5:7]}'"
    conn = libvirt.open(f"test://{lab.tmp}/hosts/gpu-host-01.xml")
    try:
        xmls = [d.XMLDesc(0) for d in conn.listAllDomains()]
    finally:
        conn.close()
    assert xmls and not any(f"<address domain='0x0000' {bus}" in x for x in xmls), xmls
    lab.drain(lease_id)
    lease = drive(daemon, lab, lease_id, {"returned", "failed"})
    assert lease["state"] == "returned", lease["history"][-1]


def test_a_device_registered_with_fewer_gpus_than_it_can_lend_is_lent_with_a_warning(lab, caplog):
    daemon = Daemon(lab.config(devices=[{**lab.config_dict()["devices"][0], "gpus": 1}]))
    daemon.register()
    lease_id = lab.lend()
    lease = drive(daemon, lab, lease_id, {"active", "restoring", "failed"})
    assert lease["state"] == "active" and len(lease["vms"]) == 1, lease["history"][-1]
    assert any("device gpu-host-01: gpus: 1 in the agent-host config, but 2 of the host's 2 "
               "GPU(s) can be lent" in r.getMessage() and "leaving 1 idle" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_a_gpu_another_domain_holds_keeps_the_device_away_quarantined_at_once(lab):
    """TRIAL15 F2: a domain that is not the lease's (an operator's VM, another lease's
    leftover) holds a GPU when the restore ends: the device must not go back to its agent with
    a GPU in a VM, and retrying frees nothing. It was a plain step error, retried
    RESTORE_ATTEMPTS times with no quarantine event; now refused at once, quarantined naming
    the domain."""
    from testflinger_magic.agent_host.libvirt_session import save_test_state, test_driver_file

    daemon = Daemon(lab.config())
    daemon.register()
    lease_id = lab.lend()
    lease = drive(daemon, lab, lease_id, {"active", "restoring", "failed"})
    assert lease["state"] == "active", lease.get("error")
    bus = lease["vms"][0]["gpus"][0].split(":")[1]
    uri = f"test://{lab.tmp}/hosts/gpu-host-01.xml"
    conn = libvirt.open(uri)
    try:
        conn.defineXML(
            "<domain type='kvm'><name>manual</name><memory unit='MiB'>512</memory>"
            "<os><type arch='x86_64'>hvm</type></os><devices>"
            "<hostdev mode='subsystem' type='pci' managed='yes'><source>"
            f"<address domain='0x0000' bus='0x{bus}' slot='0x00' function='0x0'/></source>"
            "</hostdev></devices></domain>")
        save_test_state(conn, test_driver_file(uri))
    finally:
        conn.close()

    lab.drain(lease_id)
    lease = drive(daemon, lab, lease_id, {"returned", "failed"})
    assert lease["state"] == "failed"
    why = lease["history"][-1]["reason"]
    assert "GPUs still held by domain(s) manual (not made by testflinger-magic)" in why, why
    device = lab.db.magic_devices.find_one({"_id": "gpu-host-01"})
    assert device["quarantined"] and "manual" in device["quarantine_reason"]
    assert lab.db.magic_events.find_one({"kind": "device.quarantined", "device": "gpu-host-01"})
    assert lab.procs.state("gpu-host-01") == "STOPPED"
    assert len([h for h in lease["history"] if h["state"] == "restoring"]) == 1
