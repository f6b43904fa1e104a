"""Pure split planning: GPU discovery from node device XML, assignment, domain XML, checks."""

from __future__ import annotations

import shutil
import subprocess
import xml.etree.ElementTree as ET

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from testflinger_magic.agent_host import numaplace
from testflinger_magic.agent_host import splitplan as sp
from testflinger_magic.agent_host.pcidiscovery import discover, multi_gpu_problem
from testflinger_magic.lab import hosts


def nodedevs(**kw) -> list[str]:
    """Node device XML documents of a generated lab host, as libvirt would list them."""
    root = ET.fromstring(hosts.host_xml(**kw))
    return [ET.tostring(d, encoding="unicode") for d in root.findall("device")]


def plan(name, gpus=1, mac=None, index=0, **kw):
    return sp.VMPlan(name=name, mac=mac or f"52:54:00:00:10:{index:02x}", vcpus=4,
                     memory_mib=2048, disk_gib=20,
                     disk_path=f"/var/lib/libvirt/images/{name}.qcow2", gpu_count=gpus,
                     **{"bridge": "br-enp12s0f0np0", **kw})


def test_discover_8_gpus_on_two_nodes():
    gpus = sp.discover_gpus(nodedevs(gpus=8, numa_nodes=2))
    assert [g.address for g in gpus] == [hosts.gpu_address(i) for i in range(8)]
    assert [g.numa_node for g in gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(g.functions == (g.address,) for g in gpus)
    assert len({g.iommu_group for g in gpus}) == 8
    assert {g.vendor_id for g in gpus} == {hosts.NVIDIA}


def test_discover_audio_function_goes_with_gpu_and_is_not_a_gpu():
    gpus = sp.discover_gpus(nodedevs(gpus=4, gpu_audio_functions=True))
    assert len(gpus) == 4  # the 0x0403 audio functions are not display controllers
    for g in gpus:
        assert g.functions == (g.address, g.address[:-1] + "1")


def test_discover_vendor_filter_and_non_gpu_devices():
    docs = nodedevs(gpus=2)
    assert sp.discover_gpus(docs, {"0x1002"}) == []
    assert len(sp.discover_gpus(docs, {"0x10DE"})) == 2
    assert {"0000:0c:00.0", "0000:c2:00.0", hosts.BMC_BRIDGE} <= sp.pci_addresses(docs)


def test_discover_gpu_without_iommu_is_refused_with_the_reason():
    doc = ("<device><name>pci_0000_05_00_0</name><capability type='pci'><class>0x030000</class>"
           "<domain>0</domain><bus>5</bus><slot>0</slot><function>0</function>"
           "<product id='0x1'/><vendor id='0x10de'/></capability></device>")
    assert sp.discover_gpus([doc]) == []
    [refused] = discover([doc]).refused
    assert refused.address == "0000:05:00.0" and "no IOMMU group" in refused.reason
    gpu = sp.GPU("0000:05:00.0", None, ("0000:05:00.0",), None, "0x10de", "0x1")
    with pytest.raises(sp.SplitError, match="IOMMU"):  # assign never takes one either
        sp.assign([gpu], [plan("a")], set())


def test_assign_one_gpu_vms_all_distinct():
    gpus = sp.discover_gpus(nodedevs())
    vms = [plan(f"vm{i}", index=i) for i in range(8)]
    got = sp.assign(gpus, vms, set())
    assert list(got) == [v.name for v in vms]
    assert sorted(g.address for gs in got.values() for g in gs) == [g.address for g in gpus]


def test_assign_two_gpu_vms_stay_on_one_numa_node():
    gpus = sp.discover_gpus(nodedevs())
    got = sp.assign(gpus, [plan(f"vm{i}", gpus=2, index=i) for i in range(4)], set())
    for gs in got.values():
        assert len(gs) == 2 and len({g.numa_node for g in gs}) == 1


def test_assign_skips_gpus_in_use_by_any_function():
    gpus = sp.discover_gpus(nodedevs(gpus=2, gpu_audio_functions=True))
    # another domain holds only the audio function of GPU 0: the whole group is taken
    got = sp.assign(gpus, [plan("a")], {gpus[0].address[:-1] + "1"})
    assert [g.address for g in got["a"]] == [gpus[1].address]


def test_assign_not_enough_gpus_names_vm():
    gpus = sp.discover_gpus(nodedevs(gpus=2))
    with pytest.raises(sp.SplitError, match=r"VM big: needs 3 GPU\(s\) but only 2"):
        sp.assign(gpus, [plan("big", gpus=3)], set())


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(0, 3), min_size=1, max_size=6),
       busy=st.sets(st.integers(0, 7), max_size=4))
def test_assign_never_overlaps_or_reuses(counts, busy):
    gpus = sp.discover_gpus(nodedevs())
    in_use = {gpus[i].address for i in busy}
    vms = [plan(f"vm{i}", gpus=c, index=i) for i, c in enumerate(counts)]
    if sum(counts) > 8 - len(busy):
        with pytest.raises(sp.SplitError):
            sp.assign(gpus, vms, in_use)
        return
    got = sp.assign(gpus, vms, in_use)
    given_out = [g.address for gs in got.values() for g in gs]
    assert len(given_out) == len(set(given_out)) == sum(counts)
    assert not in_use.intersection(given_out)
    assert all(len(got[v.name]) == v.gpu_count for v in vms)


def test_cpuset_and_numa_fallback():
    assert sp.cpuset([3, 0, 1, 2, 8, 10, 11]) == "0-3,8,10-11"
    assert numaplace.cells_from_nodeinfo(2, 32, 1024) == [
        numaplace.Cell(0, tuple(range(16)), 512), numaplace.Cell(1, tuple(range(16, 32)), 512)]
    assert numaplace.cells_from_nodeinfo(1, 32, 1024) is None
    caps = ("<capabilities><host><topology><cells num='2'>"
            "<cell id='0'><memory unit='KiB'>2097152</memory>"
            "<cpus num='2'><cpu id='0'/><cpu id='2'/></cpus></cell>"
            "<cell id='1'><memory unit='GiB'>3</memory>"
            "<cpus num='2'><cpu id='1'/><cpu id='3'/></cpus></cell>"
            "</cells></topology></host></capabilities>")
    assert numaplace.cells_from_capabilities(caps) == [numaplace.Cell(0, (0, 2), 2048),
                                                       numaplace.Cell(1, (1, 3), 3072)]
    assert numaplace.cells_from_capabilities("<capabilities><host/></capabilities>") is None


def placed(vm, gpus, cells=None):
    """The placement split would give ``vm`` alone with ``gpus`` on the lab hosts' 2 cells."""
    cells = cells or numaplace.cells_from_nodeinfo(2, 32, 512 * 1024)
    return numaplace.place(sp.numa_needs([vm], {vm.name: gpus}), cells)[vm.name]


def test_domain_xml_shape_and_parse_back():
    gpus = sp.discover_gpus(nodedevs(gpu_audio_functions=True))
    vm = plan("dev-vm0", gpus=1, mac="52:54:00:AB:CD:EF")
    xml = sp.domain_xml(vm, [gpus[5]], "lease-0123456789ab", placed(vm, [gpus[5]]))
    root = ET.fromstring(xml)
    assert root.find("memory").get("unit") == "MiB" and root.findtext("memory") == "2048"
    assert root.find("vcpu").get("cpuset") == "16-31"  # GPU 5 is on node 1
    assert root.find("numatune/memory").get("nodeset") == "1"
    iface, disk = root.find("devices/interface"), root.find("devices/disk")
    assert iface.find("boot").get("order") == "1" and disk.find("boot").get("order") == "2"
    assert disk.find("source").get("file") == vm.disk_path
    info = sp.parse_domain(xml)
    assert info.lease_id == "lease-0123456789ab" and info.vm == "dev-vm0"
    assert info.macs == ("52:54:00:ab:cd:ef",)
    assert info.hostdevs == gpus[5].functions
    assert all(h.get("managed") == "yes" for h in root.findall("devices/hostdev"))
    assert sp.gpus_of(info, gpus) == [gpus[5].address]


def test_domain_xml_without_numa_has_no_pinning_and_uses_bridge():
    gpus = sp.discover_gpus(nodedevs())
    root = ET.fromstring(sp.domain_xml(plan("x", bridge=None), gpus[:1], "l", None,
                                       "/usr/bin/qemu-system-x86_64", bridge="br0"))
    assert root.find("vcpu").get("cpuset") is None and root.find("numatune") is None
    assert root.find("devices/interface").get("type") == "bridge"
    assert root.find("devices/interface/source").get("bridge") == "br0"
    assert root.findtext("devices/emulator") == "/usr/bin/qemu-system-x86_64"


@pytest.mark.skipif(not shutil.which("virt-xml-validate"), reason="needs libvirt-clients")
def test_domain_xml_validates_against_libvirt_schema(tmp_path):
    gpus = sp.discover_gpus(nodedevs(gpu_audio_functions=True))
    for firmware in ("uefi", "bios"):
        vm = plan("v", gpus=2, firmware=firmware)
        xml = sp.domain_xml(vm, gpus[:2], "lease-x", placed(vm, gpus[:2]),
                            "/usr/bin/qemu-system-x86_64")
        assert ("X-PciMmio64Mb" in xml) == (firmware == "uefi")
        f = tmp_path / f"v-{firmware}.xml"
        f.write_text(xml)
        r = subprocess.run(["virt-xml-validate", str(f), "domain"], capture_output=True,
                           text=True)
        assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("field,value,message", [
    ("mac", "52:54:00:00:00", "not a MAC"),
    ("mac", "01:00:5e:00:00:01", "multicast"),
    ("vcpus", 0, "vcpus: must be a positive"),
    ("disk_path", "relative.qcow2", "not absolute"),
    ("name", "bad name", "name: must match"),
])
def test_validate_plan_rejects(field, value, message):
    vm = sp.VMPlan(**{**plan("ok").to_dict(), field: value})
    with pytest.raises(sp.SplitError, match=message):
        sp.validate_plan([vm])


def test_validate_plan_rejects_duplicates():
    with pytest.raises(sp.SplitError, match="mac: 52:54:00:00:00:01 also used by VM a"):
        sp.validate_plan([plan("a", mac="52:54:00:00:00:01"), plan("b", mac="52:54:00:00:00:01")])


def test_check_domains_rejects_each_collision():
    docs = nodedevs(gpus=2)
    gpus = sp.discover_gpus(docs)
    host = sp.pci_addresses(docs)
    a = sp.domain_xml(plan("a", index=1), [gpus[0]], "l1", None)
    b_same_gpu = sp.domain_xml(plan("b", index=2), [gpus[0]], "l2", None)
    c_same_mac = sp.domain_xml(plan("c", index=1), [gpus[1]], "l2", None)
    ghost = sp.GPU("0000:99:00.0", 99, ("0000:99:00.0",), 0, "0x10de", "0x1")
    d_ghost = sp.domain_xml(plan("d", index=4), [ghost], "l2", None)
    sp.check_domains([a], [], host)  # fine alone
    with pytest.raises(sp.SplitError, match="PCI device 0000:18:00.0 already used by domain a"):
        sp.check_domains([b_same_gpu], [a], host)
    with pytest.raises(sp.SplitError, match="PCI device 0000:18:00.0 also in new domain a"):
        sp.check_domains([a, b_same_gpu], [], host)
    with pytest.raises(sp.SplitError, match="MAC 52:54:00:00:10:01 already used by domain a"):
        sp.check_domains([c_same_mac], [a], host)
    with pytest.raises(sp.SplitError, match="hostdev 0000:99:00.0: no such PCI device"):
        sp.check_domains([d_ghost], [], host)
    with pytest.raises(sp.SplitError, match="domain a: a domain of that name already exists"):
        sp.check_domains([a], [a], host)


def test_gpu_dict_round_trip():
    [g] = sp.discover_gpus(nodedevs(gpus=1, gpu_audio_functions=True))
    assert sp.GPU.from_dict(g.to_dict()) == g


def test_check_fit_accepts_a_spec_that_fits():
    host = sp.HostResources(cpus=32, memory_mib=524288, gpus=8, pool_gib=100)
    sp.check_fit([plan(f"v{i}", index=i) for i in range(8)], host)  # 8 x 2 GiB, 4 vCPU, 1 GPU


def test_check_fit_blames_the_queue_listing_every_misfit():
    # The user's case scaled down: a VM spec bigger than the whole machine.
    huge = sp.VMPlan(name="d-vm0", mac="52:54:00:00:10:00", vcpus=64, memory_mib=9_000_000,
                     disk_gib=500, disk_path="/var/lib/libvirt/images/d-vm0.qcow2", gpu_count=9)
    host = sp.HostResources(cpus=32, memory_mib=524288, gpus=8, pool_gib=100)
    with pytest.raises(sp.VMSpecDoesNotFit) as info:
        sp.check_fit([huge], host, "gpu-host-01")
    err = info.value
    assert isinstance(err, sp.SplitError) and err.blame == "queue"
    text = str(err)
    assert "the queue's VM spec does not fit gpu-host-01" in text
    for part in ("vcpus 64 > the host's 32 CPUs", "9 GPU(s) per VM > the host's 8",
                 "disk_gib 500 > the storage pool's 100 GiB", "need 9000000 MiB > the host's 524288"):
        assert part in text, text


def test_check_fit_memory_is_summed_disks_are_not():
    # Passthrough pins every VM's RAM: 8 x 80 GiB > 512 GiB. Thin qcow2 disks may overcommit.
    vms = [sp.VMPlan(**{**plan(f"v{i}", index=i).to_dict(), "memory_mib": 80 * 1024,
                        "disk_gib": 60}) for i in range(8)]
    host = sp.HostResources(cpus=32, memory_mib=524288, gpus=8, pool_gib=100)
    with pytest.raises(sp.VMSpecDoesNotFit, match="8 VM\\(s\\) x memory_mib need 655360 MiB"):
        sp.check_fit(vms, host)
    sp.check_fit(vms[:6], host)  # 480 GiB of RAM and 360 GiB of thin disks in a 100 GiB pool


def test_split_errors_blame_the_device_by_default():
    assert sp.SplitError("x").blame == "device"


# --- what counts as a GPU (issue 7, item 4) ------------------------------------------------------

def test_hgx_board_lends_its_8_gpus_and_nothing_else():
    d = discover(nodedevs())  # the lab's default host: an HGX H100 board
    assert [g.address for g in d.gpus] == [hosts.gpu_address(i) for i in range(8)]
    assert all(g.functions == (g.address,) for g in d.gpus)
    assert d.nvswitches == list(hosts.NVSWITCHES)
    refused = {r.address: r.reason for r in d.refused}
    assert set(refused) == {hosts.BMC_VGA, *hosts.NVSWITCHES}
    assert "vendor 0x1a03" in refused[hosts.BMC_VGA]
    assert all("NVSwitch" in refused[a] for a in hosts.NVSWITCHES)
    lent = {f for g in d.gpus for f in g.functions}
    assert hosts.BMC_BRIDGE not in lent and not lent & set(hosts.NVSWITCHES)


# A GPU sharing its IOMMU group with a bridge or a NIC: tests/test_pcidiscovery.py.


def test_pcie_gpu_takes_its_audio_function_but_not_another_gpu_of_its_group():
    text = hosts.host_xml(gpus=2, kind="pcie")
    # a second GPU in the first one's group (no ACS between them)
    text = text.replace(
        "<address domain='0x0000' bus='0x17' slot='0x00' function='0x1'/>\n",
        "<address domain='0x0000' bus='0x17' slot='0x00' function='0x1'/>\n"
        "<address domain='0x0000' bus='0x31' slot='0x00' function='0x0'/>\n", 1)
    docs = [ET.tostring(dev, encoding="unicode") for dev in ET.fromstring(text).findall("device")]
    d = discover(docs)
    first = hosts.gpu_address(0, "pcie")
    assert first in {r.address for r in d.refused}
    assert "0000:31:00.0" in {r.address: r.reason for r in d.refused}[first]
    clean = discover(nodedevs(gpus=2, kind="pcie"))
    assert [g.functions for g in clean.gpus] == [(first, first[:-1] + "1"),
                                                ("0000:31:00.0", "0000:31:00.1")]


def test_several_gpus_per_vm_on_an_nvswitch_host_need_the_operators_opt_in():
    hgx, pcie = discover(nodedevs()), discover(nodedevs(kind="pcie"))
    assert multi_gpu_problem(hgx, 1, False) is None
    assert "Fabric Manager" in multi_gpu_problem(hgx, 2, False)
    assert multi_gpu_problem(hgx, 2, True) is None
    assert multi_gpu_problem(pcie, 2, False) is None


# --- firmware and large BARs (issue 7, item 5) -------------------------------------------------

def test_default_aperture_fits_h200_bars_per_gpu():
    # 2 x BAR1 per GPU (edk2 PciBusDxe window alignment), H200 BAR1 = 256 GiB
    assert sp.default_mmio64_mib(1) == 512 * 1024
    assert sp.default_mmio64_mib(8) == 4 * 1024 * 1024
    assert sp.default_mmio64_mib(8) >= 8 * 2 * sp.H200_BAR1_MIB
    assert sp.default_mmio64_mib(64) == sp.MAX_MMIO64_MIB  # OVMF's 16 TiB cap


def test_domain_xml_boots_ovmf_with_an_aperture_that_fits():
    gpus = sp.discover_gpus(nodedevs())
    root = ET.fromstring(sp.domain_xml(plan("u", gpus=2), gpus[:2], "l", None))
    assert root.find("os").get("firmware") == "efi"
    assert root.find("os/type").get("machine") == "q35"
    [entry] = root.findall("sysinfo[@type='fwcfg']/entry")
    assert entry.get("name") == "opt/ovmf/X-PciMmio64Mb" and entry.text == str(1024 * 1024)
    root = ET.fromstring(sp.domain_xml(plan("m", mmio64_mib=262144), gpus[:1], "l", None))
    assert root.findtext("sysinfo/entry") == "262144"
    root = ET.fromstring(sp.domain_xml(plan("b", firmware="bios"), gpus[:1], "l", None))
    assert root.find("os").get("firmware") is None and root.find("sysinfo") is None
    with pytest.raises(sp.SplitError, match="firmware: 'efi' is not one of uefi, bios"):
        sp.validate_plan([plan("x", firmware="efi")])
    with pytest.raises(sp.SplitError, match="mmio64_mib"):
        sp.validate_plan([plan("x", mmio64_mib=sp.MAX_MMIO64_MIB + 1)])


# --- VM network (issue 7, item 1) --------------------------------------------------------------

def test_a_vm_without_bridge_never_lands_on_libvirts_default_network():
    gpus = sp.discover_gpus(nodedevs())
    with pytest.raises(sp.SplitError, match="no bridge for its NIC"):
        sp.domain_xml(plan("n", bridge=None), gpus[:1], "l", None)
    root = ET.fromstring(sp.domain_xml(plan("n", bridge=None), gpus[:1], "l", None,
                                       network="maas-net"))
    assert root.find("devices/interface").get("type") == "network"
    assert root.find("devices/interface/source").get("network") == "maas-net"
