"""GPUs sharing an IOMMU group only with each other (TRIAL13 F13): two L40S behind one PCIe switch
without ACS, each with its audio function, in one group. VFIO's unit of ownership is the group
and giving every endpoint of a viable group to one guest is the supported case (Linux
``Documentation/driver-api/vfio.rst``, "Groups, Devices, and IOMMUs"), so such a group goes whole
to one VM of at least as many GPUs, never to smaller VMs, and never with a NIC in it."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from types import SimpleNamespace

import libvirt
import pytest

from testflinger_magic import cli
from testflinger_magic.agent_host import check
from testflinger_magic.agent_host import splitplan as sp
from testflinger_magic.agent_host.gpucensus import census_of, count_mismatch, shortfall
from testflinger_magic.agent_host.libvirt_split import LibvirtSplitter, SplitError, VMPlan
from testflinger_magic.agent_host.pcidiscovery import ISOLATE_ADVICE
from testflinger_magic.agent_host.splitplan import parse_domain
from testflinger_magic.lab import hosts

BRIDGE = hosts.lab_bridge("pcie")
POOL = "/var/lib/libvirt/images/testflinger-magic"
G1, G2 = hosts.gpu_address(1, "pcie"), hosts.gpu_address(2, "pcie")  # 31:00.0, 4b:00.0
SINGLES = [hosts.gpu_address(0, "pcie"), hosts.gpu_address(3, "pcie")]  # 17:00.0, 65:00.0
NOTE = "A queue of 2 or more GPUs per VM could take the group"


def _addr_el(a: str) -> str:
    dom, bus, rest = a.split(":")
    slot, fn = rest.split(".")
    return (f"        <address domain='0x{dom}' bus='0x{bus}' slot='0x{slot}' "
            f"function='0x{fn}'/>\n")


def grouped_host(path, extra: tuple[str, ...] = (), **kw):
    """The trial's host: ``write_host_xml(kind="pcie", gpus=4)`` with GPUs 1 and 2 and their
    audio functions (plus ``extra`` addresses) edited into one IOMMU group 41, as the trial
    edited its file. Returns the test:/// URI."""
    path = hosts.write_host_xml(path, kind="pcie", gpus=4, **kw)
    members = sorted([G1, G1[:-1] + "1", G2, G2[:-1] + "1", *extra])
    group = "      <iommuGroup number='41'>\n" + "".join(map(_addr_el, members)) + \
        "      </iommuGroup>\n"
    text = path.read_text()
    for a in members:
        name = "pci_" + a.replace(":", "_").replace(".", "_")
        text, n = re.subn(rf"(<name>{name}</name>.*?)      <iommuGroup number='\d+'>\n.*?"
                          r"</iommuGroup>\n", lambda m: m.group(1) + group, text, count=1,
                          flags=re.S)
        assert n == 1, a
    path.write_text(text)
    return hosts.test_uri(path)


def test_a_group_of_gpus_only_is_lendable_whole_to_vms_of_two_gpus(tmp_path):
    d = LibvirtSplitter().inspect(grouped_host(tmp_path / "h.xml"))
    assert [g.address for g in d.gpus] == SINGLES
    assert [(g.address, g.functions, g.iommu_group) for g in d.grouped] == [
        (G1, (G1, G1[:-1] + "1"), 41), (G2, (G2, G2[:-1] + "1"), 41)]
    assert [g.address for g in d.lendable(1)] == SINGLES
    assert [g.address for g in d.lendable(2)] == sorted([*SINGLES, G1, G2])
    reasons = {r.address: r.reason for r in d.refused_for(1)}
    for gpu, other in ((G1, G2), (G2, G1)):
        assert reasons[gpu].startswith(f"IOMMU group 41 also holds {other} (10de:26b9")
        assert ISOLATE_ADVICE in reasons[gpu] and NOTE in reasons[gpu]
    assert not {G1, G2} & {r.address for r in d.refused_for(2)}


def test_a_group_of_gpus_and_a_nic_is_never_lent(tmp_path):
    uri = grouped_host(tmp_path / "h.xml", extra=(hosts.shared_nic_address(1, "pcie"),),
                       shared_groups={1: "nic"})
    d = LibvirtSplitter().inspect(uri)
    assert d.grouped == [] and [g.address for g in d.lendable(8)] == SINGLES
    reasons = {r.address: r.reason for r in d.refused}
    for gpu in (G1, G2):
        assert "ConnectX-7" in reasons[gpu] and NOTE not in reasons[gpu]
        assert reasons[gpu].endswith(ISOLATE_ADVICE)


def _gpu(address, group, node):
    return sp.GPU(address=address, iommu_group=group, functions=(address,), numa_node=node,
                  vendor_id="0x10de", product_id="0x26b9")


def _plans(n, gpus):
    return [VMPlan(name=f"d-vm{i}", mac=f"52:54:00:00:00:{i:02x}", vcpus=4, memory_mib=4096,
                   disk_gib=20, disk_path=f"{POOL}/d-vm{i}.qcow2", gpu_count=gpus)
            for i in range(n)]


def test_assign_keeps_a_group_in_one_vm_and_never_splits_it():
    a, b = _gpu("0000:31:00.0", 41, 0), _gpu("0000:4b:00.0", 41, 1)
    c, d = _gpu("0000:17:00.0", 40, 0), _gpu("0000:65:00.0", 43, 1)
    gpus = [c, a, b, d]
    out = sp.assign(gpus, _plans(2, 2), set())
    assert sorted(tuple(g.address for g in v) for v in out.values()) == [
        (c.address, d.address), (a.address, b.address)]
    # a 1-GPU VM never takes half a group
    assert sp.assign(gpus, _plans(2, 1), set()) == {"d-vm0": [c], "d-vm1": [d]}
    with pytest.raises(sp.SplitError, match=r"needs 1 GPU\(s\) but only 2 of 4 are free.*"
                                            r"GPUs sharing an IOMMU group go whole.*"
                                            r"no combination of free groups makes 1"):
        sp.assign(gpus, _plans(3, 1), set())
    # a VM of 3: the whole group first, then a single GPU
    assert [g.address for g in sp.assign(gpus, _plans(1, 3), set())["d-vm0"]] == \
        [c.address, a.address, b.address]
    # half of the group held by another domain: the other half is not lent alone
    out = sp.assign(gpus, _plans(1, 2), {a.address})
    assert [g.address for g in out["d-vm0"]] == [c.address, d.address]
    with pytest.raises(sp.SplitError):
        sp.assign(gpus, _plans(2, 2), {a.address})


def test_split_defines_the_group_in_one_domain_and_refuses_it_to_one_gpu_vms(tmp_path):
    uri = grouped_host(tmp_path / "h.xml")
    s = LibvirtSplitter(bridge=BRIDGE)
    results = s.split(uri, "lease-g", _plans(2, 2))
    assert sorted(r.gpus for r in results) == [SINGLES, [G1, G2]]
    conn = libvirt.open(uri)
    [vm] = [r for r in results if r.gpus == [G1, G2]]
    assert sorted(parse_domain(conn.lookupByName(vm.name).XMLDesc(0)).hostdevs) == \
        [G1, G1[:-1] + "1", G2, G2[:-1] + "1"]
    if shutil.which("virt-xml-validate"):
        for r in results:
            f = tmp_path / f"{r.name}.xml"
            f.write_text(conn.lookupByName(r.name).XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE))
            done = subprocess.run(["virt-xml-validate", str(f), "domain"],
                                  capture_output=True, text=True)
            assert done.returncode == 0, done.stdout + done.stderr
    s.restore(uri, "lease-g")
    with pytest.raises(SplitError, match=NOTE):
        s.split(uri, "lease-h", _plans(3, 1))
    assert s.domains(uri) == []


def run(capsys, *argv):
    code = cli.main(["agent-host", "check", *argv])
    return code, json.loads(capsys.readouterr().out)


def test_check_plans_the_grouped_pair_as_one_vm_and_refuses_it_for_one_gpu_vms(tmp_path,
                                                                                 capsys):
    uri = grouped_host(tmp_path / "h.xml")
    code, r = run(capsys, "--libvirt-uri", uri, "--bridge", BRIDGE, "--gpus-per-vm", "2",
                  "--json")
    assert code == 0 and r["ok"], r["problems"]
    assert r["plan"]["vms"] == 2 and len(r["gpus"]) == 4
    assert sorted(p["gpus"] for p in r["pinning"]) == [SINGLES, [G1, G2]]
    assert not {G1, G2} & {x["address"] for x in r["refused"]}
    code, r = run(capsys, "--libvirt-uri", uri, "--bridge", BRIDGE, "--gpus-per-vm", "1",
                  "--json")
    assert code == 0 and [g["address"] for g in r["gpus"]] == SINGLES
    refused = {x["address"]: x["reason"] for x in r["refused"]}
    assert "enable ACS" in refused[G1] and NOTE in refused[G2]
    assert any(w.startswith(f"GPUs {G1}, {G2} share IOMMU group 41 only with each other")
               and "not with --gpus-per-vm 1" in w for w in r["warnings"])


def test_gpus_counts_what_the_queues_vms_can_take_and_check_says_so(tmp_path):
    uri = grouped_host(tmp_path / "h.xml")
    census = census_of(LibvirtSplitter().inspect(uri))
    assert count_mismatch(2, census, "dev") is None  # one GPU per VM: 2
    assert count_mismatch(4, census, "dev", 2) is None  # a device lent only to 2-GPU queues
    wrong = count_mismatch(4, census, "dev", 1)
    assert "but 2 of the host's 4 GPU(s) can be lent to VMs of 1 GPU(s)" in wrong
    assert "set gpus: 2 for device dev" in wrong and NOTE in wrong
    assert "gpus: 4 fits a device lent only to queues of 2 or more GPUs per VM" in wrong
    idle = count_mismatch(2, census, "dev", 2)
    assert "leaving 2 idle" in idle and "only if every queue the device serves has 2" in idle
    assert shortfall(2, 2, census, "dev", 4) is None
    short = shortfall(4, 1, census, "dev", 4)
    assert short.startswith("4 VM(s) x 1 GPU(s) need 4 GPUs; the host has 4 GPU(s), 2 of "
                            "them can be lent to VMs of 1 GPU(s)") and NOTE in short
    # check with a device whose gpus counts the group: fine for 2-GPU VMs, with a warning
    config = SimpleNamespace(device=lambda name: SimpleNamespace(gpus=4))
    report, problems = check.check_host(uri, bridge=BRIDGE, gpus_per_vm=2, config=config,
                                        device="dev", splitter=LibvirtSplitter(bridge=BRIDGE))
    assert not problems
    assert any("counts GPUs that share an IOMMU group" in w and "set gpus: 2" in w
               for w in report["warnings"])
    _, problems = check.check_host(uri, bridge=BRIDGE, gpus_per_vm=1, config=config,
                                   device="dev", splitter=LibvirtSplitter(bridge=BRIDGE))
    assert any(p.startswith("device dev: gpus: 4") for p in problems)
