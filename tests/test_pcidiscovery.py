"""What a host's IOMMU groups let the daemon lend (TRIAL3 findings 1 and 2), read through the real
libvirt test driver from host files (lab.hosts ``shared_groups``, and the trial's own HGX file):
a bridge in a GPU's group stays on the host and the GPU is lent (Linux VFIO accepts non-type-0
headers in a group: ``vfio_dev_driver_allowed``); a foreign endpoint refuses it with the ACS
advice; the census, the split's shortfall and check's mismatch say the truth about the count."""

from __future__ import annotations

import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from testflinger_magic.agent_host.gpucensus import (
    census_of, count_mismatch, shortfall, take_census,
)
from testflinger_magic.agent_host.libvirt_split import LibvirtSplitter
from testflinger_magic.agent_host.pcidiscovery import ISOLATE_ADVICE, discover
from testflinger_magic.lab import hosts

TRIAL_HGX = Path(__file__).parent / "data" / "trial3-hgx.xml"


def inspect(tmp_path, **kw):
    """Discovery of a lab host file, through libvirt's test driver."""
    uri = hosts.test_uri(hosts.write_host_xml(tmp_path / "host.xml", **kw))
    return LibvirtSplitter().inspect(uri)


def test_a_gpu_grouped_with_its_switch_port_is_lent_without_the_port(tmp_path):
    d = inspect(tmp_path, gpus=2, shared_groups={0: "port"})
    gpu, port = hosts.gpu_address(0), hosts.switch_port_address(0)
    assert d.devices[gpu].group == (port, gpu)  # libvirt reports them in one group
    assert d.devices[port].bridge_header and d.devices[port].pci_class == 0x060400
    assert [g.address for g in d.gpus] == [gpu, hosts.gpu_address(1)]
    assert d.gpus[0].functions == (gpu,)  # the port is never a hostdev
    assert d.host_bridges(gpu) == [port] and d.host_bridges(hosts.gpu_address(1)) == []
    assert port not in {r.address for r in d.refused}


def test_a_pcie_gpu_grouped_with_its_port_takes_its_audio_function_only(tmp_path):
    d = inspect(tmp_path, gpus=1, kind="pcie", shared_groups={0: "port"})
    gpu = hosts.gpu_address(0, "pcie")
    assert [g.functions for g in d.gpus] == [(gpu, gpu[:-1] + "1")]


def test_a_gpu_grouped_with_a_nic_is_refused_with_the_acs_advice(tmp_path):
    d = inspect(tmp_path, gpus=2, shared_groups={1: "nic"})
    gpu, nic = hosts.gpu_address(1), hosts.shared_nic_address(1)
    assert [g.address for g in d.gpus] == [hosts.gpu_address(0)]
    reason = {r.address: r.reason for r in d.refused}[gpu]
    assert reason == (
        f"IOMMU group 41 also holds {nic} (15b3:1021 MT2910 Family [ConnectX-7], class "
        "0x020700): VFIO gives a whole group to one guest, and that device is not this GPU's "
        f"own function nor a bridge; {ISOLATE_ADVICE}")
    assert "enable ACS" in ISOLATE_ADVICE
    # its switch port isolates (its own group): nothing to say about it
    assert d.host_bridges(gpu) == []
    assert d.all_gpus == [hosts.gpu_address(0), gpu]
    assert [r.address for r in d.refused_gpus] == [gpu]


def _with_group(text: str, gpu: str, extra: list[str]) -> list[str]:
    """Node device documents of ``text`` with ``extra`` addresses added to ``gpu``'s group
    (in the GPU's document and every extra member's), as libvirt lists one group."""
    root = ET.fromstring(text)
    docs = []
    for dev in root.findall("device"):
        name = dev.findtext("name")
        if name in {"pci_" + a.replace(":", "_").replace(".", "_") for a in [gpu, *extra]}:
            group = dev.find("capability/iommuGroup")
            group.set("number", "77")
            for child in list(group):
                group.remove(child)
            for a in sorted([gpu, *extra]):
                dom, bus, rest = a.split(":")
                slot, fn = rest.split(".")
                ET.SubElement(group, "address", domain=f"0x{dom}", bus=f"0x{bus}",
                              slot=f"0x{slot}", function=f"0x{fn}")
        docs.append(ET.tostring(dev, encoding="unicode"))
    return docs


def test_bridge_plus_a_foreign_endpoint_still_refuses_naming_only_the_endpoint():
    gpu = hosts.gpu_address(0)
    docs = _with_group(hosts.host_xml(gpus=2), gpu, [hosts.BMC_BRIDGE, hosts.NVSWITCHES[0]])
    d = discover(docs)
    reason = {r.address: r.reason for r in d.refused}[gpu]
    assert f"also holds {hosts.NVSWITCHES[0]} (10de:22a3" in reason
    assert hosts.BMC_BRIDGE not in reason  # the bridge is no reason to refuse
    # two GPUs behind one non-ACS port: each needs the other, both refused
    docs = _with_group(hosts.host_xml(gpus=2), gpu, [hosts.gpu_address(1)])
    assert discover(docs).gpus == []


@pytest.mark.parametrize("pci_class, header, lent", [
    ("0x060400", False, True),   # PCI-to-PCI bridge by class (no header capability reported)
    ("0x060901", False, True),   # semi-transparent PCI-to-PCI bridge: type 1 header too
    ("0x060000", False, False),  # host bridge: a type-0 header, an endpoint for VFIO
    ("0x068000", True, True),    # whatever the class, libvirt's pci-bridge header decides
])
def test_a_bridge_is_a_non_type_0_header(pci_class, header, lent):
    """Linux decides by ``pdev->hdr_type != PCI_HEADER_TYPE_NORMAL``; libvirt shows the header
    as the pci-bridge sub-capability, and the class of a PCI-to-PCI bridge implies it."""
    text = hosts.host_xml(gpus=1).replace(
        "<class>0x060400</class>", f"<class>{pci_class}</class>")
    if not header:
        text = text.replace("<capability type='pci-bridge'/>", "")
    gpu = hosts.gpu_address(0)
    d = discover(_with_group(text, gpu, [hosts.BMC_BRIDGE]))
    assert ([g.address for g in d.gpus] == [gpu]) is lent


def test_the_trials_hgx_host_lends_7_of_its_8_gpus(tmp_path):
    # A copy: the test driver session locks (and may write back) the host file beside it.
    d = LibvirtSplitter().inspect(hosts.test_uri(shutil.copy(TRIAL_HGX, tmp_path / TRIAL_HGX.name)))
    census = census_of(d)
    assert len(census.present) == 8 and len(census.lendable) == 7
    assert "0000:3a:00.0" in {g.address for g in d.gpus}
    assert d.host_bridges("0000:3a:00.0") == ["0000:39:00.0"]
    assert [r.address for r in census.refused] == ["0000:ab:00.0"]
    assert {g.address: g.numa_node for g in d.gpus}["0000:ba:00.0"] is None  # NUMA -1
    # NVSwitches and the BMC are no GPUs of the census
    assert not set(census.present) & {"0000:03:00.0", *d.nvswitches}


def test_shortfall_and_mismatch_name_the_count_the_refusals_and_the_fix(tmp_path):
    uri = hosts.test_uri(hosts.write_host_xml(tmp_path / "h.xml", gpus=3,
                                              shared_groups={2: "nic"}))
    census = take_census(LibvirtSplitter(), uri)
    assert shortfall(2, 1, census, "gpu-host-01", 3) is None
    text = shortfall(3, 1, census, "gpu-host-01", 3)
    assert text.startswith("3 VM(s) x 1 GPU(s) need 3 GPUs; the host has 3 GPU(s), 2 of them "
                           f"can be lent; refused: {hosts.gpu_address(2)}: IOMMU group 42")
    assert text.endswith("Fix: set gpus: 2 for device gpu-host-01 in the agent-host config (gpus "
                         "is the number of GPUs that can be lent) and restart the daemon, or "
                         "fix the IOMMU grouping (ACS) so that every GPU can be lent")
    # registered with more GPUs than are on the bus: one may have fallen off
    assert "gpus: 4, 1 more than are on the bus" in shortfall(4, 1, census, "d", 4)
    assert count_mismatch(2, census, "d") is None
    assert "every lend would fail at split" in count_mismatch(3, census, "d")
    assert "leaving 1 idle" in count_mismatch(1, census, "d")


def test_a_splitter_without_inspect_counts_its_lendable_gpus_as_present(tmp_path):
    uri = hosts.test_uri(hosts.write_host_xml(tmp_path / "h.xml", gpus=2))

    class OnlyDiscover:
        def discover(self, uri):
            return LibvirtSplitter().discover(uri)

    census = take_census(OnlyDiscover(), uri)
    assert list(census.present) == [hosts.gpu_address(0), hosts.gpu_address(1)]
    assert census.refused == []
