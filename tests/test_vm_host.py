"""The daemon on a real VM host's terms (issue 7, items 1, 5-8): the bridge, the firmware, the
disk pool, the power order and the readiness wait, against the lab's HGX host files."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import libvirt
import pytest

from daemon_lab import lab  # noqa: F401 (fixture)
from test_daemon_e2e import drive
from testflinger_magic.agent_host import steps
from testflinger_magic.agent_host.config import AgentHostConfig
from testflinger_magic.agent_host.daemon import Daemon, default_drivers
from testflinger_magic.agent_host.journal import Journal
from testflinger_magic.agent_host.libvirt_split import LibvirtSplitter
from testflinger_magic.lab import hosts

POOL = "/var/lib/libvirt/images/testflinger-magic"


def domains(lab, device="gpu-host-01") -> dict[str, ET.Element]:
    conn = libvirt.open(f"test://{lab.tmp}/hosts/{device}.xml")
    try:
        return {d.name(): (ET.fromstring(d.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)),
                           bool(d.isActive())) for d in conn.listAllDomains()}
    finally:
        conn.close()


def test_daemon_puts_vms_on_the_bridge_with_uefi_and_pool_disks(lab):
    daemon = Daemon(lab.config())
    daemon.register()
    lease = drive(daemon, lab, lab.lend(), {"active", "restoring", "failed"})
    assert lease["state"] == "active", lease.get("error")
    doms = domains(lab)
    assert set(doms) == {vm["domain"] for vm in lease["vms"]}
    for name, (root, _) in doms.items():
        iface = root.find("devices/interface")
        # never libvirt's NAT "default" network: MAAS could not PXE-boot the VM there
        assert (iface.get("type"), iface.find("source").get("bridge")) == (
            "bridge", hosts.lab_bridge()), name
        assert root.find("os").get("firmware") == "efi"
        assert root.findtext("sysinfo[@type='fwcfg']/entry") == str(512 * 1024)
        assert root.find("devices/disk/source").get("file").startswith(POOL + "/")
    assert all(vm["disk"].startswith(POOL + "/") for vm in lease["vms"])


def test_split_step_uses_the_bridge_maas_rendered_and_leaves_domains_off(lab, tmp_path):
    config = lab.config()
    lease = {"_id": "lease-br", "device": "gpu-host-01", "queue": "q", "state": "splitting",
             "spec": {"gpus_per_vm": 1, "vcpus": 2, "memory_mib": 1024, "disk_gib": 5},
             "vms": [{"index": 0, "name": "gpu-host-01-vm1", "mac": "52:54:00:10:00:01",
                      "disk": "/var/lib/libvirt/images/lease-br-gpu-host-01-vm1.qcow2"}]}
    # MAAS's bridge on this host has another name than the configured fallback
    hosts.write_host_xml(lab.tmp / "hosts" / "gpu-host-01.xml", gpus=2, bridge="br-maas0")
    journal = Journal(config.state_dir, lease["_id"], "gpu-host-01")
    journal.set_fact("device_ip", "10.0.0.5")
    journal.set_fact("bridge", "br-maas0")
    ctx = steps.StepContext(config=config, drivers=default_drivers(config, maas=object(),
                                                                   agents=object()),
                            device=config.devices[0], lease=lease, journal=journal)
    result = steps.split(ctx)
    assert result.to_state == "enrolling"
    [(root, running)] = domains(lab).values()
    assert root.find("devices/interface/source").get("bridge") == "br-maas0"
    assert not running  # MAAS powers it on to commission it
    assert result.vms[0]["disk"] == f"{POOL}/lease-br-gpu-host-01-vm1.qcow2"


class _BecomesReady(LibvirtSplitter):
    """A host still installing packages: the first readiness check finds it without its bridge,
    then the host file is what it is after cloud-init's reboot."""

    def __init__(self, path, **kw):
        super().__init__(**kw)
        self.path, self.calls = path, []

    def host_problems(self, uri, bridge=None, firmware="uefi"):
        got = super().host_problems(uri, bridge, firmware)
        self.calls.append(got)
        if len(self.calls) == 1:
            hosts.write_host_xml(self.path, gpus=2, name="gpu-host-01")
        return got


def test_deploying_waits_for_a_positive_ready_signal(lab):
    path = lab.tmp / "hosts" / "gpu-host-01.xml"
    hosts.write_host_xml(path, gpus=2, name="gpu-host-01", bridge=None, ovmf=False,
                         gpu_driver="nvidia")
    config = lab.config()
    splitter = _BecomesReady(path, bridge=config.bridge)
    daemon = Daemon(config, splitter=splitter)
    daemon.register()
    lease = drive(daemon, lab, lab.lend(), {"splitting", "enrolling", "active", "restoring",
                                            "failed"})
    assert lease["state"] in ("splitting", "enrolling", "active"), lease.get("error")
    first = splitter.calls[0]
    assert any(p.startswith(f"bridge {hosts.lab_bridge()} not found") for p in first)
    assert any(p.startswith("no UEFI firmware") for p in first)
    # before the user data's reboot the GPUs are still on nvidia: not ready (TRIAL3 finding 8)
    assert any(p.startswith("GPU(s) still bound to a host GPU driver: ") for p in first)
    assert [] in splitter.calls


def test_a_host_that_never_gets_ready_fails_the_step_naming_what_is_missing(lab):
    hosts.write_host_xml(lab.tmp / "hosts" / "gpu-host-01.xml", gpus=2, iommu=False)
    daemon = Daemon(lab.config(timeouts={"deploying": "2s", "enrolling": "20s",
                                         "restoring": "30s"}))
    daemon.register()
    lease = drive(daemon, lab, lab.lend(), {"restoring", "failed", "returned"})
    error = str(lease.get("error"))
    assert "not ready for passthrough VMs" in error and "IOMMU off" in error, error
    assert domains(lab) == {}


def test_daemon_passes_the_splitter_settings(lab):
    config = lab.config(splitter={"kind": "libvirt", "gpu_vendors": ["0x10DE", "0x1002"],
                                  "pool_name": "p", "pool_path": "/srv/p",
                                  "nvswitch_multi_gpu": True}, bridge=hosts.lab_bridge())
    s = default_drivers(config, maas=object(), agents=object()).splitter
    assert (s.vendor_ids, s.pool_name, s.pool_path, s.nvswitch_multi_gpu, s.bridge, s.network) \
        == (("0x10de", "0x1002"), "p", "/srv/p", True, hosts.lab_bridge(), None)
    cfg = lab.config_dict(splitter={"kind": "libvirt", "network": "maas"})
    # no bridge configured: MAAS' bridge (learned at deploy) or, failing that, the network
    assert AgentHostConfig.model_validate(cfg).bridge is None
    assert lab.config(splitter={"kind": "libvirt", "network": "maas"},
                      bridge="br9").bridge == "br9"
    with pytest.raises(Exception, match="not a PCI vendor id"):
        lab.config(splitter={"kind": "libvirt", "gpu_vendors": ["nvidia"]})
