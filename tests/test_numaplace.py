"""Pure NUMA placement (agent_host.numaplace): per-cell memory, moved bindings, interleave and
vCPU widening, on the trial's PCIe layout (all GPUs on node 0) and the lab's HGX layout."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from testflinger_magic.agent_host import splitplan as sp
from testflinger_magic.agent_host.numaplace import (Cell, VMNeed, cells_from_nodeinfo,
                                                    headroom_mib, place)

GIB = 1024
#: A fresh-user trial's PCIe card server (tests/data/trial3-pcie-host.xml): 2 nodes, 128 CPUs,
#: 512 GiB, its 4 GPUs all on node 0 (one root complex).
TRIAL_PCIE = Path(__file__).parent / "data" / "trial3-pcie-host.xml"
PCIE_CELLS = cells_from_nodeinfo(2, 128, 512 * GIB)


def needs(n, vcpus, memory_mib, cells=(0,)):
    return [VMNeed(f"vm{i}", vcpus, memory_mib, tuple(cells)) for i in range(n)]


def strict_load(placements, ns):
    """MiB strictly bound to each cell."""
    load = {}
    for p in placements.values():
        if p.mode == "strict":
            for c in p.nodeset:
                load[c] = load.get(c, 0) + ns[p.vm].memory_mib / len(p.nodeset)
    return load


def test_trial_pcie_host_gpus_all_on_node0_from_its_node_devices():
    root = ET.parse(TRIAL_PCIE).getroot()
    gpus = sp.discover_gpus([ET.tostring(d, encoding="unicode") for d in root.findall("device")])
    assert len(gpus) == 4 and {g.numa_node for g in gpus} == {0}
    vms = [sp.VMPlan(name=f"h-vm{i}", mac=f"52:54:00:00:00:0{i}", vcpus=48, memory_mib=96 * GIB,
                     disk_gib=50, disk_path=f"/p/h-vm{i}.qcow2", gpu_count=1)
           for i in range(1, 5)]
    chosen = sp.assign(gpus, vms, set())
    got = place(sp.numa_needs(vms, chosen), PCIE_CELLS)
    # 4 x 96 GiB never strictly on node 0's 256 GiB: two stay, two move to node 1
    assert [(p.mode, p.nodeset) for p in got.values()] == [("strict", (0,))] * 2 + \
        [("strict", (1,))] * 2
    assert [p.local for p in got.values()] == [True, True, False, False]
    assert "bound to cell 1" in got["h-vm3"].why
    assert got["h-vm3"].cpus == tuple(range(64, 128)) and got["h-vm1"].cpus == tuple(range(64))


def test_every_strict_cell_holds_its_vms_with_headroom():
    ns = needs(4, 48, 96 * GIB)
    got = place(ns, PCIE_CELLS)
    by = {n.name: n for n in ns}
    for cell, mib in strict_load(got, by).items():
        c = PCIE_CELLS[cell]
        assert mib <= c.memory_mib - headroom_mib(c)


def test_vms_that_fit_their_gpus_cell_stay_local():
    got = place(needs(2, 8, 32 * GIB), PCIE_CELLS)
    assert all(p.local and p.nodeset == (0,) and p.cpus == tuple(range(64))
               for p in got.values())


def test_oversubscribed_cell_widens_vcpus_while_another_idles():
    # 3 x 48 vCPU: two on node 0 (96 vCPUs on 64 CPUs), one moved to node 1 (48 on 64)
    got = place(needs(3, 48, 96 * GIB), PCIE_CELLS)
    assert [p.nodeset for p in got.values()] == [(0,), (0,), (1,)]
    assert got["vm0"].cpus == got["vm1"].cpus == tuple(range(128))
    assert "oversubscribed" in got["vm0"].why and not got["vm0"].local
    assert got["vm2"].cpus == tuple(range(64, 128))  # its own cell is not oversubscribed
    # small VMs, many vCPUs, memory fits node 0: vCPUs widened, memory still local
    got = place(needs(4, 32, 16 * GIB), PCIE_CELLS)
    assert all(p.nodeset == (0,) and p.cpus == tuple(range(128)) for p in got.values())


def test_every_cell_oversubscribed_stays_local():
    """The lab's HGX: 4 GPUs per node, 16 CPUs per node, 8 x 8 vCPU: widening buys nothing."""
    cells = cells_from_nodeinfo(2, 32, 512 * GIB)
    ns = [VMNeed(f"vm{i}", 8, 32 * GIB, (i // 4,)) for i in range(8)]
    got = place(ns, cells)
    assert all(p.local and p.nodeset == (i // 4,) and p.cpus == cells[i // 4].cpus
               for i, p in enumerate(got.values()))


def test_a_vm_no_cell_holds_is_interleaved_and_its_share_counted():
    ns = [VMNeed("big", 16, 400 * GIB, (0,)), VMNeed("small", 8, 32 * GIB, (0,))]
    got = place(ns, PCIE_CELLS)
    assert got["big"].mode == "interleave" and got["big"].nodeset == (0, 1)
    assert got["big"].cpus == tuple(range(128)) and "fit no single cell" in got["big"].why
    # 200 GiB of each node are the big VM's: 32 GiB more still fit the 240 GiB it may bind
    assert got["small"].mode == "strict" and got["small"].nodeset == (0,)
    ns.append(VMNeed("third", 8, 32 * GIB, (0,)))
    got = place(ns, PCIE_CELLS)
    assert got["third"].nodeset == (1,) and "bound to cell 1" in got["third"].why
    ns.append(VMNeed("fourth", 8, 32 * GIB, (0,)))  # 8 GiB left on either cell
    got = place(ns, PCIE_CELLS)
    spilled = [p for p in got.values() if "no cell has room" in p.why]
    assert [(p.mode, p.nodeset) for p in spilled] == [("strict", (0, 1))]


def test_unknown_gpu_node_binds_to_the_roomiest_cell_and_one_cell_pins_nothing():
    got = place([VMNeed("a", 4, 200 * GIB, (0,)), VMNeed("b", 4, 8 * GIB, ())], PCIE_CELLS)
    assert got["b"].nodeset == (1,) and "unknown" in got["b"].why
    one = [Cell(0, tuple(range(8)), 64 * GIB)]
    assert place([VMNeed("a", 4, 8 * GIB, (0,))], one)["a"].mode is None
    assert place([VMNeed("a", 4, 8 * GIB, (0,))], None)["a"].local


def test_domain_xml_carries_the_placement():
    gpus = sp.discover_gpus([ET.tostring(d, encoding="unicode")
                             for d in ET.parse(TRIAL_PCIE).getroot().findall("device")])
    vm = sp.VMPlan(name="x", mac="52:54:00:00:00:01", vcpus=48, memory_mib=400 * GIB,
                   disk_gib=50, disk_path="/p/x.qcow2", gpu_count=1, bridge="br0")
    p = place(sp.numa_needs([vm], {"x": gpus[:1]}), PCIE_CELLS)["x"]
    root = ET.fromstring(sp.domain_xml(vm, gpus[:1], "l", p))
    assert root.find("numatune/memory").attrib == {"mode": "interleave", "nodeset": "0-1"}
    assert root.find("vcpu").get("cpuset") == "0-127"
    with pytest.raises(sp.SplitError, match="placement of VM x"):
        sp.domain_xml(sp.VMPlan(**{**vm.to_dict(), "name": "y"}), gpus[:1], "l", p)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 64), st.integers(1, 300), st.sampled_from([(0,), (1,),
                                                                                     (0, 1), ()])),
                min_size=1, max_size=8))
def test_no_cell_is_ever_strictly_overfilled(specs):
    """Whatever the VMs, unless the host is so full that a VM falls back to all cells: the
    memory strictly bound to one cell fits what that cell may bind, and all memory bound
    (interleaved shares included) fits what all cells may bind together."""
    ns = [VMNeed(f"v{i}", c, m * GIB, cells) for i, (c, m, cells) in enumerate(specs)]
    got = place(ns, PCIE_CELLS)
    by = {n.name: n for n in ns}
    room = {c.id: c.memory_mib - headroom_mib(c) for c in PCIE_CELLS}
    assert set(got) == set(by) and all(p.cpus for p in got.values())
    assert all(p.mode in ("strict", "interleave") for p in got.values())
    if any("no cell has room" in p.why for p in got.values()):
        return
    single = {}
    for p in got.values():
        if p.mode == "strict" and len(p.nodeset) == 1:
            single[p.nodeset[0]] = single.get(p.nodeset[0], 0) + by[p.vm].memory_mib
    interleaved = sum(by[p.vm].memory_mib for p in got.values() if p.mode == "interleave")
    for c, mib in single.items():
        assert mib + interleaved / 2 <= room[c] + 1e-6, (c, single, got)
    assert sum(by[n].memory_mib for n in by) <= sum(room.values()) + 1e-6 or interleaved


def test_overcommitted_counts_a_widened_vm_on_each_cell_it_may_run_on():
    """TRIAL13 F12: vCPUs pinned to one cell count there; a VM on every host CPU counts on
    each cell in proportion to its CPUs there."""
    from testflinger_magic.agent_host.numaplace import Placement, overcommitted

    cells = [Cell(0, tuple(range(4)), 1 << 16), Cell(1, tuple(range(4, 8)), 1 << 16)]
    pinned = {"a": Placement("a", "strict", (0,), tuple(range(4))),
              "b": Placement("b", "strict", (0,), tuple(range(4)))}
    (w,) = overcommitted(pinned, {"a": 3, "b": 2}, cells)
    assert w.startswith("NUMA cell 0's 4 CPUs (0-3) carry 5 vCPUs of VM(s) a, b: "
                        "overcommitted 1.2x"), w
    wide = {"a": Placement("a", "strict", (0,), tuple(range(8))),
            "b": Placement("b", "strict", (0,), tuple(range(8)))}
    assert overcommitted(wide, {"a": 3, "b": 2}, cells) == []  # 2.5 per cell of 4
    assert overcommitted(pinned, {"a": 30, "b": 2}, None) == []  # nothing pinned
