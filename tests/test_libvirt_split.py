"""LibvirtSplitter against libvirt's test driver with generated multi-GPU hosts (lab.hosts)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import threading
import xml.etree.ElementTree as ET
from pathlib import Path

import libvirt
import pytest

from testflinger_magic.agent_host import libvirt_split
from testflinger_magic.agent_host.libvirt_session import save_test_state, test_driver_file
from testflinger_magic.agent_host.libvirt_split import LibvirtSplitter, SplitError, VMPlan
from testflinger_magic.agent_host.splitplan import LEASE_NS, parse_domain
from testflinger_magic.lab import hosts

POOL = "/var/lib/libvirt/images/testflinger-magic"  # LibvirtSplitter's default pool
BRIDGE = hosts.lab_bridge()


def S(**kw) -> LibvirtSplitter:
    """A splitter whose VMs join the lab hosts' MAAS bridge."""
    return LibvirtSplitter(**{"bridge": BRIDGE, **kw})


@pytest.fixture
def host8(tmp_path):
    """An HGX H100 board (lab.hosts): 8 GPUs, NVSwitches, a BMC, no pool, NAT default."""
    return hosts.test_uri(hosts.write_host_xml(tmp_path / "host8.xml", gpus=8, name="host8"))


@pytest.fixture
def host_audio(tmp_path):
    """A PCIe host: 4 L40S, each with its HD audio function .1 in its IOMMU group."""
    return hosts.test_uri(hosts.write_host_xml(tmp_path / "audio.xml", gpus=4, kind="pcie",
                                               name="audio"))


def plans(prefix, n, gpus=1, mac_base=0):
    return [VMPlan(name=f"{prefix}-vm{i}", mac=f"52:54:00:00:{mac_base:02x}:{i:02x}", vcpus=4,
                   memory_mib=4096, disk_gib=20, disk_path=f"{POOL}/{prefix}-vm{i}.qcow2",
                   gpu_count=gpus) for i in range(n)]


def fresh(uri):
    """A connection of our own, straight from the file (what another process would see)."""
    return libvirt.open(uri)


def test_discover_both_hosts(host8, host_audio):
    s = S()
    gpus = s.discover(host8)
    assert [g.address for g in gpus] == [hosts.gpu_address(i) for i in range(8)]
    assert {g.numa_node for g in gpus} == {0, 1}
    audio = s.discover(host_audio)
    assert all(len(g.functions) == 2 for g in audio)
    assert S(vendor_ids={"0x1002"}).discover(host8) == []


def test_split_into_8_one_gpu_vms(host8, tmp_path):
    s = S()
    results = s.split(host8, "lease-a", plans("d", 8))
    assert [r.name for r in results] == [f"d-vm{i}" for i in range(8)]
    assert sorted(g for r in results for g in r.gpus) == [hosts.gpu_address(i) for i in range(8)]
    assert all(len(r.gpus) == 1 for r in results)
    conn = fresh(host8)
    doms = {d.name(): d for d in conn.listAllDomains()}
    assert set(doms) == {r.name for r in results}
    # defined, not started: MAAS powers each VM on to commission it
    assert not any(d.isActive() for d in doms.values())
    pool = conn.storagePoolLookupByName("testflinger-magic")
    assert sorted(v.name() for v in pool.listAllVolumes()) == \
        sorted(f"d-vm{i}.qcow2" for i in range(8))
    assert not s.gpus_free(host8)
    if shutil.which("virt-xml-validate"):
        for name, dom in doms.items():
            f = tmp_path / f"{name}.xml"
            f.write_text(dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE))
            r = subprocess.run(["virt-xml-validate", str(f), "domain"], capture_output=True,
                               text=True)
            assert r.returncode == 0, r.stdout + r.stderr


def test_split_into_4_two_gpu_vms_pins_numa(host8):
    s = S(nvswitch_multi_gpu=True)  # the operator runs Fabric Manager in shared NVSwitch mode
    results = s.split(host8, "lease-b", plans("d", 4, gpus=2))
    gpus = {g.address: g for g in s.discover(host8)}
    conn = fresh(host8)
    for r in results:
        assert len(r.gpus) == 2
        nodes = {gpus[a].numa_node for a in r.gpus}
        assert len(nodes) == 1
        root = ET.fromstring(conn.lookupByName(r.name).XMLDesc(0))
        assert root.find("numatune/memory").get("nodeset") == str(nodes.pop())
        assert root.find("vcpu").get("cpuset")  # pinned to that node's CPUs


def test_trial_pcie_host_never_binds_more_memory_to_a_cell_than_it_has(tmp_path):
    """A fresh-user trial's PCIe server (tests/data/trial3-pcie-host.xml: 4 GPUs all on node 0,
    2 nodes, 128 CPUs, 512 GiB): 4 VMs of 48 vCPU / 96 GiB used to be bound strictly to node
    0 (384 GiB on its 256: the third VFIO guest cannot start on real hardware; the test driver
    never enforces numatune, so the domain XML is what is checked)."""
    path = tmp_path / "pcie.xml"
    shutil.copy(Path(__file__).parent / "data" / "trial3-pcie-host.xml", path)
    uri = hosts.test_uri(path)
    vms = [VMPlan(name=f"h-vm{i}", mac=f"52:54:00:00:33:{i:02x}", vcpus=48, memory_mib=98304,
                  disk_gib=50, disk_path=f"{POOL}/h-vm{i}.qcow2", gpu_count=1)
           for i in range(1, 5)]
    s = LibvirtSplitter(bridge="br-enp193s0f0")
    planned = s.placement(uri, vms)
    s.split(uri, "lease-numa", vms)
    conn = fresh(uri)
    strict = {}
    for vm in vms:
        root = ET.fromstring(conn.lookupByName(vm.name).XMLDesc(0))
        mem = root.find("numatune/memory")
        assert mem.get("mode") == "strict"
        strict.setdefault(mem.get("nodeset"), []).append(vm.name)
        assert root.find("vcpu").get("cpuset") == ("0-63" if mem.get("nodeset") == "0"
                                                   else "64-127")
        assert planned[vm.name][1].to_dict()["nodeset"] == mem.get("nodeset")
    # node 0 (256 GiB, 16 GiB kept for the host) holds two 96 GiB guests, node 1 the others
    assert strict == {"0": ["h-vm1", "h-vm2"], "1": ["h-vm3", "h-vm4"]}
    # a re-split (idempotent) keeps them
    assert [r.name for r in s.split(uri, "lease-numa", vms)] == [vm.name for vm in vms]


def test_audio_function_goes_with_its_gpu(host_audio):
    s = S()
    results = s.split(host_audio, "lease-c", plans("a", 4))
    conn = fresh(host_audio)
    for r in results:
        info = parse_domain(conn.lookupByName(r.name).XMLDesc(0))
        [gpu] = r.gpus
        assert sorted(info.hostdevs) == [gpu, gpu[:-1] + "1"]


def test_not_enough_gpus_defines_nothing(host8):
    s = S()
    with pytest.raises(SplitError, match="needs 1 GPU") as info:
        s.split(host8, "lease-a", plans("d", 9))
    assert f"{hosts.BMC_VGA}: display controller of vendor 0x1a03" in str(info.value)
    assert s.domains(host8) == [] and s.gpus_free(host8)


def test_vm_spec_bigger_than_the_host_defines_nothing_and_blames_the_queue(host8):
    # The user's case: memory the host can never give (the lab host has 512 GiB, 32 CPUs, a
    # 100 GiB pool). libvirt would only fail at define, counted against the device.
    s = S()
    vms = [VMPlan(**{**vm.to_dict(), "memory_mib": 1024 * 1024}) for vm in plans("d", 2)]
    with pytest.raises(libvirt_split.VMSpecDoesNotFit) as info:
        s.split(host8, "lease-a", vms)
    assert info.value.blame == "queue"
    assert "VM spec does not fit" in str(info.value)
    assert "need 2097152 MiB > the host's 524288 MiB" in str(info.value)
    assert s.domains(host8) == [] and s.gpus_free(host8)
    too_many_cpus = [VMPlan(**{**plans("c", 1)[0].to_dict(), "vcpus": 33})]
    with pytest.raises(libvirt_split.VMSpecDoesNotFit, match="vcpus 33 > the host's 32 CPUs"):
        s.split(host8, "lease-b", too_many_cpus)
    big_disk = [VMPlan(**{**plans("b", 1)[0].to_dict(), "disk_gib": 101})]
    with pytest.raises(libvirt_split.VMSpecDoesNotFit, match="storage pool's 100 GiB"):
        s.split(host8, "lease-c", big_disk)
    assert s.domains(host8) == []


def test_mac_collision_with_foreign_domain_rejected(host8):
    s = S()
    s.split(host8, "lease-a", plans("a", 1))
    with pytest.raises(SplitError, match="MAC 52:54:00:00:00:00 already used by domain a-vm0"):
        s.split(host8, "lease-b", plans("b", 2))
    assert s.domains(host8) == ["a-vm0"]


def test_name_of_other_lease_rejected(host8):
    s = S()
    s.split(host8, "lease-a", plans("d", 1))
    with pytest.raises(SplitError, match="d-vm0: already exists and belongs to lease lease-a"):
        s.split(host8, "lease-b", plans("d", 1, mac_base=9))


def test_gpu_of_foreign_domain_is_never_taken(host8):
    conn = fresh(host8)
    # a domain nobody of ours defined holds GPU 0 (e.g. an operator's VM)
    foreign = ("<domain type='kvm'><name>manual</name><memory unit='MiB'>512</memory>"
               "<os><type arch='x86_64'>hvm</type></os><devices>"
               "<hostdev mode='subsystem' type='pci' managed='yes'><source>"
               "<address domain='0x0000' bus='0x18' slot='0x00' function='0x0'/></source>"
               "</hostdev></devices></domain>")
    conn.defineXML(foreign)
    # persist it the way the splitter does, so the splitter's connection sees it
    save_test_state(conn, test_driver_file(host8))
    s = S()
    results = s.split(host8, "lease-a", plans("d", 7))
    assert hosts.gpu_address(0) not in {g for r in results for g in r.gpus}
    with pytest.raises(SplitError, match="only 0 of 8 are free"):
        s.split(host8, "lease-b", plans("e", 1, mac_base=5))
    s.restore(host8, "lease-a")
    assert s.domains(host8) == ["manual"] and not s.gpus_free(host8)


def test_same_gpu_twice_rejected_even_if_assignment_is_wrong(host8, monkeypatch):
    def naive(gpus, vms, in_use):  # a broken assignment: everyone gets GPU 0
        return {vm.name: gpus[:1] for vm in vms}

    monkeypatch.setattr(libvirt_split, "assign", naive)
    s = S()
    with pytest.raises(SplitError, match="PCI device 0000:18:00.0 also in new domain d-vm0"):
        s.split(host8, "lease-a", plans("d", 2))
    s.split(host8, "lease-a", plans("d", 1))
    with pytest.raises(SplitError, match="PCI device 0000:18:00.0 already used by domain d-vm0"):
        s.split(host8, "lease-b", plans("e", 1, mac_base=3))
    assert s.domains(host8) == ["d-vm0"]


def test_nonexistent_pci_function_in_group_refuses_that_gpu(tmp_path):
    # The host claims GPU 0's IOMMU group has a function .3 that is not a device on the host.
    path = hosts.write_host_xml(tmp_path / "odd.xml", gpus=2)
    text = path.read_text().replace(
        "<address domain='0x0000' bus='0x18' slot='0x00' function='0x0'/>\n",
        "<address domain='0x0000' bus='0x18' slot='0x00' function='0x0'/>\n"
        "<address domain='0x0000' bus='0x18' slot='0x00' function='0x3'/>\n", 1)
    path.write_text(text)
    s = S()
    with pytest.raises(SplitError, match=r"0000:18:00.3 \(not listed by libvirt\)"):
        s.split(hosts.test_uri(path), "lease-a", plans("d", 2))
    assert s.domains(hosts.test_uri(path)) == []
    [r] = s.split(hosts.test_uri(path), "lease-a", plans("d", 1))
    assert r.gpus == [hosts.gpu_address(1)]


def test_concurrent_splits_in_threads_never_share_a_gpu(host8):
    results, errors = {}, []

    def run(lease, prefix, base):
        try:
            results[lease] = S().split(host8, lease, plans(prefix, 4, mac_base=base))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(f"lease-{p}", p, i))
               for i, p in enumerate("xy")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    used = [g for rs in results.values() for r in rs for g in r.gpus]
    assert len(used) == len(set(used)) == 8


CHILD = textwrap.dedent("""
    import json, sys
    from testflinger_magic.agent_host.libvirt_split import LibvirtSplitter, VMPlan
    uri, lease, prefix, base = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    vms = [VMPlan(f"{prefix}-vm{i}", f"52:54:00:00:{base:02x}:{i:02x}", 2, 1024, 10,
                  f"/var/lib/libvirt/images/testflinger-magic/{prefix}-vm{i}.qcow2", 1)
           for i in range(4)]
    s = LibvirtSplitter(bridge="br-enp12s0f0np0")
    print(json.dumps([r.to_dict() for r in s.split(uri, lease, vms)]))
""")


def test_concurrent_splits_in_processes_never_share_a_gpu(host8):
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, host8, f"lease-{p}", p, str(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, p in enumerate("pq")]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    used = [g for out, _ in outs for r in json.loads(out) for g in r["gpus"]]
    assert len(used) == len(set(used)) == 8
    assert len(S().domains(host8)) == 8


def test_restore_and_idempotence(host8):
    s = S()
    first = s.split(host8, "lease-a", plans("a", 4))
    other = s.split(host8, "lease-b", plans("b", 2, mac_base=1))
    again = s.split(host8, "lease-a", plans("a", 4))
    assert again == first
    assert len(s.domains(host8)) == 6
    s.restore(host8, "lease-a")
    s.restore(host8, "lease-a")
    assert s.domains(host8, "lease-a") == []
    assert s.domains(host8, "lease-b") == [r.name for r in other]
    assert not s.gpus_free(host8)
    s.restore(host8, "lease-b", names=["b-vm0"])
    assert s.domains(host8) == ["b-vm1"]
    s.restore(host8, "lease-b")
    assert s.domains(host8) == [] and s.gpus_free(host8)
    conn = fresh(host8)
    assert conn.listAllDomains() == []
    assert conn.storagePoolLookupByName("testflinger-magic").listAllVolumes() == []


def test_split_again_keeps_domains_and_their_power_state(host8):
    s = S()
    s.split(host8, "lease-a", plans("a", 2))
    conn = fresh(host8)
    conn.lookupByName("a-vm1").create()  # MAAS powered it on to commission it
    save_test_state(conn, test_driver_file(host8))
    results = s.split(host8, "lease-a", plans("a", 3))
    assert [r.name for r in results] == ["a-vm0", "a-vm1", "a-vm2"]
    assert {d.name(): bool(d.isActive()) for d in fresh(host8).listAllDomains()} == {
        "a-vm0": False, "a-vm1": True, "a-vm2": False}


def test_state_persists_for_a_fresh_process(host8):
    s = S()
    s.split(host8, "lease-a", plans("a", 3))
    code = textwrap.dedent(f"""
        import json, libvirt
        c = libvirt.open({host8!r})
        print(json.dumps(sorted([d.name(), d.isActive(),
            d.metadata(libvirt.VIR_DOMAIN_METADATA_ELEMENT, {LEASE_NS!r})]
            for d in c.listAllDomains())))
        from testflinger_magic.agent_host.libvirt_split import LibvirtSplitter
        LibvirtSplitter().restore({host8!r}, "lease-a", ["a-vm0"])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert [(n, a) for n, a, _ in seen] == [("a-vm0", 0), ("a-vm1", 0), ("a-vm2", 0)]
    assert all('id="lease-a"' in m for _, _, m in seen)
    # this process's cached connection is stale: the splitter must notice the file changed
    assert s.domains(host8) == ["a-vm1", "a-vm2"]


def test_libvirt_errors_become_split_errors_naming_the_domain(tmp_path):
    uri = hosts.test_uri(hosts.write_host_xml(tmp_path / "err.xml", gpus=2))

    def connect(u):
        conn = libvirt.open(u)
        real = conn.defineXML

        def define(xml):
            if "<name>bad-vm1</name>" in xml:
                raise libvirt.libvirtError("simulated failure")
            return real(xml)

        conn.defineXML = define
        return conn

    s = S(connect=connect)
    with pytest.raises(SplitError, match="domain bad-vm1: define: simulated failure"):
        s.split(uri, "lease-e", plans("bad", 2))
    assert s.domains(uri, "lease-e") == ["bad-vm0"]  # what was done stays, marked for restore
    s.restore(uri, "lease-e")
    assert s.domains(uri) == [] and s.gpus_free(uri)


def test_missing_host_file_is_a_split_error(tmp_path):
    with pytest.raises(SplitError, match="cannot read test-driver host file"):
        S().discover(hosts.test_uri(tmp_path / "nope.xml"))


def test_default_test_uri_keeps_state_between_calls():
    s = S()
    # test:///default has no GPUs, but it must keep domains between calls of this process
    vm = VMPlan("dflt-vm0", "52:54:00:00:7f:00", 1, 256, 1, f"{POOL}/dflt-vm0.qcow2", 0)
    try:
        s.split("test:///default", "lease-dflt", [vm])
        assert s.domains("test:///default", "lease-dflt") == ["dflt-vm0"]
    finally:
        s.restore("test:///default", "lease-dflt")
    assert s.domains("test:///default", "lease-dflt") == []


def test_test_pool_gib_replaces_the_test_drivers_fixed_100_gib(host8):
    """examples/magic-queues.yaml's two-gpu-vm has 200 GiB disks; the test driver says 100."""
    big = [VMPlan(**{**plans("t", 1)[0].to_dict(), "disk_gib": 200})]
    with pytest.raises(libvirt_split.VMSpecDoesNotFit, match="storage pool's 100 GiB"):
        S().split(host8, "lease-t", big)
    s = S(test_pool_gib=4096)
    assert [r.name for r in s.split(host8, "lease-t", big)] == [big[0].name]
    s.restore(host8, "lease-t")
    assert s.domains(host8) == [] and s.gpus_free(host8)
    too_big = [VMPlan(**{**plans("u", 1)[0].to_dict(), "disk_gib": 5000})]
    with pytest.raises(libvirt_split.VMSpecDoesNotFit, match="storage pool's 4096 GiB"):
        s.split(host8, "lease-u", too_big)


# --- issue 7: what a fresh HGX/PCIe host needs ---------------------------------------------------

def test_fresh_host_gets_a_pool_that_persists_and_loses_the_volumes_on_restore(host8):
    assert fresh(host8).listAllStoragePools() == []  # like a fresh libvirt-daemon-system
    s = S()
    assert s.pool_state(host8)["exists"] is False
    s.split(host8, "lease-p", plans("p", 2))
    assert s.pool_state(host8) == {"name": "testflinger-magic", "path": POOL, "exists": True,
                                   "active": True, "autostart": True}
    conn = fresh(host8)  # what another process (the next daemon) sees
    pool = conn.storagePoolLookupByName("testflinger-magic")
    assert ET.fromstring(pool.XMLDesc(0)).findtext("target/path") == POOL
    assert sorted(v.name() for v in pool.listAllVolumes()) == ["p-vm0.qcow2", "p-vm1.qcow2"]
    s.restore(host8, "lease-p")
    assert fresh(host8).storagePoolLookupByName("testflinger-magic").listAllVolumes() == []
    s.split(host8, "lease-q", plans("q", 1, mac_base=2))  # the pool is reused
    assert [p.name() for p in fresh(host8).listAllStoragePools()] == ["testflinger-magic"]


def test_disk_outside_the_pool_or_pool_elsewhere_is_refused(host8, tmp_path):
    bad = [VMPlan(**{**plans("o", 1)[0].to_dict(), "disk_path": "/srv/o-vm0.qcow2"})]
    with pytest.raises(SplitError, match="not in the storage pool directory"):
        S().split(host8, "lease-o", bad)
    other = hosts.test_uri(hosts.write_host_xml(tmp_path / "p.xml", pool_path="/srv/pool"))
    with pytest.raises(SplitError, match="exists at /srv/pool, not at"):
        S(pool_name="default").split(other, "lease-o", plans("o", 1))
    assert S().domains(host8) == []


def test_domains_join_the_bridge_boot_uefi_and_validate(host8, tmp_path):
    s = S()
    s.split(host8, "lease-u", plans("u", 1) + [VMPlan(**{**plans("w", 1, mac_base=1)[0].to_dict(),
                                                          "bridge": "br-other"})])
    conn = fresh(host8)
    for name, bridge in (("u-vm0", BRIDGE), ("w-vm0", "br-other")):
        root = ET.fromstring(conn.lookupByName(name).XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE))
        assert root.find("devices/interface").get("type") == "bridge"
        assert root.find("devices/interface/source").get("bridge") == bridge
        assert root.find("os").get("firmware") == "efi"
        assert root.findtext("sysinfo[@type='fwcfg']/entry") == str(512 * 1024)
    with pytest.raises(SplitError, match="no bridge for its NIC"):
        LibvirtSplitter().split(host8, "lease-n", plans("n", 1, mac_base=3))


def test_two_gpus_per_vm_on_an_nvswitch_host_need_the_opt_in(host8, host_audio):
    with pytest.raises(SplitError, match="Fabric Manager in shared NVSwitch virtualization") \
            as refused:
        S().split(host8, "lease-f", plans("f", 2, gpus=2))
    # a 2-GPU spec on a host nothing activates partitions on: a property of the device (its
    # 4 NVSwitches, reported as a fact the server keeps), neither its failure nor the queue's
    assert refused.value.blame == "hardware" and "this daemon does not do" in str(refused.value)
    assert refused.value.facts == {"nvswitches": len(hosts.NVSWITCHES)}
    assert S().domains(host8) == []
    assert len(S().split(host_audio, "lease-g", plans("g", 2, gpus=2))) == 2  # no NVSwitch


def test_host_problems_say_what_a_fresh_deployed_host_still_lacks(tmp_path):
    ready = hosts.test_uri(hosts.write_host_xml(tmp_path / "ready.xml"))
    assert S().host_problems(ready) == []
    assert S().host_problems(hosts.test_uri(hosts.write_host_xml(
        tmp_path / "pcie.xml", kind="pcie", bridge=BRIDGE))) == []
    cases = {
        "iommu": ({"iommu": False}, ["IOMMU off", "VFIO passthrough unavailable"]),
        "vfio": ({"vfio": False}, ["VFIO passthrough unavailable"]),
        "ovmf": ({"ovmf": False}, ["no UEFI firmware for q35"]),
        "bridge": ({"bridge": None}, [f"bridge {BRIDGE} not found"]),
        # before the user data's reboot (or an image that loads it anyway): nvidia holds them
        "nvidia": ({"gpu_driver": "nvidia"}, ["GPU(s) still bound to a host GPU driver: "
                                              "0000:18:00.0 (nvidia), 0000:2a:00.0 (nvidia)"]),
        "nouveau": ({"gpu_driver": "nouveau"}, ["GPU(s) still bound to a host GPU driver: "
                                                "0000:18:00.0 (nouveau)"]),
    }
    for name, (kw, want) in cases.items():
        uri = hosts.test_uri(hosts.write_host_xml(tmp_path / f"{name}.xml", **kw))
        got = S().host_problems(uri)
        assert [p for p in got if any(p.startswith(w) for w in want)] and all(
            any(p.startswith(w) for w in want) or p.startswith("no GPU") for p in got), got
    assert S().host_problems(hosts.test_uri(tmp_path / "ovmf.xml"), firmware="bios") == []
    nat = S(bridge="virbr0").host_problems(ready)
    assert nat == ["bridge virbr0 belongs to libvirt network default (forward mode nat): VMs "
                   "on it cannot PXE-boot from MAAS; use a bridge of the host's MAAS network"]
    assert LibvirtSplitter().host_problems(ready)[0].startswith("no bridge for the VMs' NICs")
    assert S().host_problems(hosts.test_uri(tmp_path / "gone.xml"))[0].startswith(
        "libvirt at test:///")


def test_node_device_driver_comes_from_the_host_file_on_test_uris(tmp_path):
    """libvirt's test driver drops <driver> from node devices (the real node device driver
    fills it from sysfs); the splitter reads it from the host file, so readiness can see a GPU
    left on nvidia. A device without one in the file stays None."""
    path = hosts.write_host_xml(tmp_path / "h.xml", gpus=2, gpu_driver="nvidia")
    conn = libvirt.open(hosts.test_uri(path))
    try:
        xml = conn.nodeDeviceLookupByName("pci_0000_18_00_0").XMLDesc(0)
    finally:
        conn.close()
    assert "<driver>" not in xml  # what the test driver itself gives (libvirt 9.0)
    disc = S().inspect(hosts.test_uri(path))
    assert {g.address: disc.devices[g.address].driver for g in disc.gpus} == {
        "0000:18:00.0": "nvidia", "0000:2a:00.0": "nvidia"}
    assert disc.devices[hosts.BMC_BRIDGE].driver is None
    ready = S().inspect(hosts.test_uri(hosts.write_host_xml(tmp_path / "r.xml", gpus=2)))
    assert {ready.devices[g.address].driver for g in ready.gpus} == {"vfio-pci"}
    assert {ready.devices[a].driver for a in hosts.NVSWITCHES} == {None}
