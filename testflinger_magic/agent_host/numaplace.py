"""Pure NUMA placement of a split's VMs: which host NUMA cell holds each VM's memory, and on which
host CPUs its vCPUs run, so that every domain can start and no cell's CPUs carry all the vCPUs
while another cell idles.

No libvirt, no I/O. ``libvirt_split`` reads the cells (:func:`cells_from_capabilities`, or
:func:`cells_from_nodeinfo` for libvirt's test driver) and puts each :class:`Placement` into the
domain XML (``splitplan.domain_xml``); ``check`` prints them.

Facts this module relies on:

- libvirt's ``<numatune><memory mode=... nodeset=...>`` (https://libvirt.org/formatdomain.html,
  "NUMA Node Tuning"): ``strict`` (the default) makes an allocation fail when the memory cannot
  be allocated on the nodeset; ``interleave`` spreads pages round-robin over the nodeset;
  ``preferred`` takes memory from one preferred node first and from other nodes when it is
  full. A passthrough (VFIO) guest has all its memory allocated and pinned when it starts
  (VFIO maps all guest RAM for the device's DMA), so a strictly bound guest whose cell has not
  that much free memory does not start at all.
- ``virConnect.getCapabilities()`` lists the host's cells as
  ``host/topology/cells/cell[@id]`` with ``memory[@unit='KiB']`` and ``cpus/cpu[@id]``
  (https://libvirt.org/formatcaps.html, "Host capabilities").

The rules (:func:`place`):

1. Memory: a VM is bound ``strict`` to the cell of its GPU(s) when that cell still holds it,
   counting the memory of every VM already bound there and keeping :func:`headroom_mib` of the
   cell for the host (its kernel, QEMU's own memory). Otherwise it is bound ``strict`` to the
   cell with the most memory left that holds it (its memory and vCPUs move together, away from
   its GPU: a guest's CPUs touch its RAM on every access, its GPU only for DMA transfers). We
   choose moving over ``preferred`` on the GPU's cell: ``preferred`` takes the whole cell first
   and would leave too little for a strictly bound VM that MAAS happens to power on later, so
   whether a domain starts would depend on the order they start in. A VM that no single cell
   can hold is ``interleave``d over all cells (its pages spread evenly; only ``strict`` is
   documented to fail an allocation its nodeset cannot serve) and its share is taken from each
   cell before any strict binding is decided. When the others have left no single cell room
   for a VM, it is bound ``strict`` to all cells (any of them may give it memory; the host's
   total was checked by ``splitplan.check_fit``). A VM whose GPUs' node is unknown is bound like a
   moved one (it has no locality to lose). With fewer than two cells nothing is pinned.
2. vCPUs: a VM's vCPUs run on the CPUs of the cell(s) holding its memory. When the VMs of a
   cell have more vCPUs together than the cell has CPUs while another cell has CPUs to spare,
   those VMs get every host CPU instead (the kernel's scheduler then balances their threads
   over the whole host; their memory stays where rule 1 put it). When every cell is
   oversubscribed, widening buys nothing and the VMs stay on their cell's CPUs; such a cell
   is then overcommitted (its vCPU threads share CPUs), which :func:`overcommitted` reports
   for ``agent-host check`` to warn about (TRIAL13 F12).
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass

#: Part of each cell kept for the host when binding strictly: 1/16 of the cell, at least
#: :data:`MIN_HEADROOM_MIB`. The host's kernel, page tables and each VM's QEMU process take
#: memory beyond the guests' RAM; a strict binding that fills a cell to its last MiB would fail
#: to start on real hardware. ``splitplan.check_fit`` (the refusal of a queue spec) keeps no
#: reserve on the host's total; this headroom only decides where a VM's memory is bound.
HEADROOM_FRACTION = 16
MIN_HEADROOM_MIB = 1024


@dataclass(frozen=True)
class Cell:
    """One host NUMA cell: ``id``, ``cpus`` (host CPU ids, sorted), ``memory_mib`` (MiB)."""

    id: int
    cpus: tuple[int, ...]
    memory_mib: int


@dataclass(frozen=True)
class VMNeed:
    """What placement needs of one VM: ``name``, ``vcpus``, ``memory_mib`` (MiB) and
    ``gpu_cells`` (NUMA nodes of its GPUs, sorted; empty when unknown or no GPU)."""

    name: str
    vcpus: int
    memory_mib: int
    gpu_cells: tuple[int, ...] = ()


@dataclass(frozen=True)
class Placement:
    """Where one VM runs. ``mode``: ``"strict"``, ``"interleave"`` or None (nothing pinned, a
    host with fewer than two cells); ``nodeset``: the cells its memory comes from; ``cpus``:
    the host CPUs its vCPUs may run on (empty: unpinned); ``gpu_cells``: its GPUs' cells;
    ``why``: why it is not local to its GPU (empty when it is, or nothing is pinned)."""

    vm: str
    mode: str | None
    nodeset: tuple[int, ...] = ()
    cpus: tuple[int, ...] = ()
    gpu_cells: tuple[int, ...] = ()
    why: str = ""

    @property
    def local(self) -> bool:
        """Memory strict on exactly its GPUs' cells and vCPUs on those cells' CPUs only (or
        nothing pinned at all)."""
        return self.mode is None or not self.why

    def to_dict(self) -> dict:
        """JSON shape: ``{"vm", "mode", "nodeset", "cpuset", "gpu_cells", "local", "why"}``
        (``nodeset``/``cpuset`` in libvirt's range syntax, "" when unpinned)."""
        return {"vm": self.vm, "mode": self.mode, "nodeset": cpuset(self.nodeset),
                "cpuset": cpuset(self.cpus), "gpu_cells": list(self.gpu_cells),
                "local": self.local, "why": self.why}


def cpuset(ids) -> str:
    """libvirt cpuset syntax for CPU (or node) ids: ``[0,1,2,3,8] -> "0-3,8"``."""
    out, ids = [], sorted(set(ids))
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


def cells_from_capabilities(caps_xml: str) -> list[Cell] | None:
    """The host's cells from ``virConnect.getCapabilities()`` XML, sorted by id, or None when
    it lists none (libvirt's test driver with a host file never does). A cell's ``<memory>``
    is read in its ``unit`` (KiB when absent, as libvirt writes it). Raises ValueError on a
    malformed number."""
    out = []
    for c in ET.fromstring(caps_xml).findall("host/topology/cells/cell"):
        mem = c.find("memory")
        kib = _kib(int(mem.text), mem.get("unit", "KiB")) if mem is not None else 0
        out.append(Cell(id=int(c.get("id")), memory_mib=kib // 1024,
                        cpus=tuple(sorted(int(cpu.get("id")) for cpu in c.findall("cpus/cpu")))))
    return sorted(out, key=lambda c: c.id) or None


def cells_from_nodeinfo(nodes: int, cpus: int, memory_mib: int) -> list[Cell] | None:
    """Test-driver fallback from ``virConnect.getInfo()`` (nodes, CPUs, memory MiB): CPUs split
    evenly and contiguously, memory evenly (libvirt's test driver reads ``/node/cpu/nodes`` and
    ``/node/memory`` of the host file, ``testOpenParse`` in ``src/test/test_driver.c``, and
    builds no cells from them). None for fewer than two nodes."""
    if nodes < 2 or cpus < nodes:
        return None
    per = cpus // nodes
    return [Cell(id=n, cpus=tuple(range(n * per, (n + 1) * per)), memory_mib=memory_mib // nodes)
            for n in range(nodes)]


def _kib(value: int, unit: str) -> int:
    scale = {"b": 1 / 1024, "bytes": 1 / 1024, "kib": 1, "k": 1, "kb": 1000 / 1024,
             "mib": 1024, "m": 1024, "gib": 1024 ** 2, "g": 1024 ** 2, "tib": 1024 ** 3}
    try:
        return int(value * scale[unit.lower()])
    except KeyError:
        raise ValueError(f"unknown memory unit {unit!r}") from None


def headroom_mib(cell: Cell) -> int:
    """MiB of ``cell`` kept for the host when binding VMs strictly to it."""
    return max(MIN_HEADROOM_MIB, cell.memory_mib // HEADROOM_FRACTION)


def place(needs: list[VMNeed], cells: list[Cell] | None) -> dict[str, Placement]:
    """``{vm name: Placement}`` for one split's VMs (rules in the module docstring), in the
    order of ``needs``. Deterministic: bigger VMs are placed first, ties by name; among cells
    with equal room the lowest id. ``cells`` None or a single cell: nothing pinned. Never
    raises for a host too small: whether the VMs fit the host at all is
    ``splitplan.check_fit``'s question (a VM no cell holds is interleaved)."""
    if not cells or len(cells) < 2:
        return {n.name: Placement(vm=n.name, mode=None, gpu_cells=n.gpu_cells) for n in needs}
    by_id = {c.id: c for c in cells}
    room = {c.id: c.memory_mib - headroom_mib(c) for c in cells}
    biggest = max(room.values())
    out: dict[str, Placement] = {}
    everyone = tuple(sorted(by_id))
    all_cpus = tuple(sorted(cpu for c in cells for cpu in c.cpus))
    order = sorted(needs, key=lambda n: (-n.memory_mib, n.name))
    for n in order:  # first the VMs no single cell holds: their share comes off every cell
        if n.memory_mib > biggest:
            for c in everyone:
                room[c] -= n.memory_mib / len(everyone)
            out[n.name] = Placement(
                vm=n.name, mode="interleave", nodeset=everyone, cpus=all_cpus,
                gpu_cells=n.gpu_cells, why=f"its {n.memory_mib} MiB fit no single cell "
                f"(at most {biggest} MiB each): memory interleaved over all cells")
    for n in order:
        if n.name in out:
            continue
        home = tuple(c for c in n.gpu_cells if c in by_id)
        if home and sum(max(0, room[c]) for c in home) >= n.memory_mib:
            chosen, why = home, ""
        else:
            fits = [c for c in everyone if room[c] >= n.memory_mib]
            if not fits:  # the others took each cell's room: any cell may give it memory
                chosen = everyone
                why = "no cell has room left for it: memory bound to all cells"
            else:
                chosen = (max(fits, key=lambda c: (room[c], -c)),)
                left = int(sum(max(0, room[c]) for c in home))
                why = (f"its GPU's cell {cpuset(home)} has {left} MiB left for it, it needs "
                       f"{n.memory_mib}: bound to cell {chosen[0]}"
                       if home else "its GPUs' NUMA node is unknown: bound to the cell with "
                       "the most memory left")
        _take(room, chosen, n.memory_mib)
        out[n.name] = Placement(vm=n.name, mode="strict", nodeset=chosen,
                                cpus=tuple(sorted(cpu for c in chosen for cpu in by_id[c].cpus)),
                                gpu_cells=n.gpu_cells, why=why)
    out = _spread_vcpus(out, {n.name: n for n in needs}, cells, all_cpus)
    return {n.name: out[n.name] for n in needs}


def _take(room: dict[int, float], cells: tuple[int, ...], mib: int) -> None:
    """Count ``mib`` strictly bound to ``cells`` against their room: a strict nodeset of
    several cells lets the kernel take memory from any of them, so the roomiest give first."""
    left = float(mib)
    for c in sorted(cells, key=lambda c: (-room[c], c)):
        take = min(left, max(0.0, room[c]))
        room[c] -= take
        left -= take
    if left > 0:  # more than they have room for (the all-cells fallback): spread the rest
        for c in cells:
            room[c] -= left / len(cells)


def _spread_vcpus(out: dict[str, Placement], needs: dict[str, VMNeed], cells: list[Cell],
                  all_cpus: tuple[int, ...]) -> dict[str, Placement]:
    """Rule 2: VMs of a cell with more vCPUs than CPUs get every host CPU, when another cell has
    CPUs to spare."""
    load = {c.id: 0.0 for c in cells}
    for p in out.values():
        for c in p.nodeset:
            load[c] += needs[p.vm].vcpus / len(p.nodeset)
    size = {c.id: len(c.cpus) for c in cells}
    over = {c for c in load if load[c] > size[c]}
    spare = {c for c in load if load[c] < size[c]}
    if not over or not spare:
        return out
    wide = {}
    for name, p in out.items():
        if p.mode == "strict" and set(p.nodeset) & over and p.cpus != all_cpus:
            note = (f"cell {cpuset(sorted(set(p.nodeset) & over))}'s CPUs are oversubscribed "
                    f"while cell {cpuset(sorted(spare))} has CPUs to spare: vCPUs on all "
                    "host CPUs")
            wide[name] = Placement(vm=p.vm, mode=p.mode, nodeset=p.nodeset, cpus=all_cpus,
                                   gpu_cells=p.gpu_cells,
                                   why=f"{p.why}; {note}" if p.why else note)
    return {**out, **wide}


def overcommitted(placements: dict[str, Placement], vcpus: dict[str, int],
                  cells: list[Cell] | None) -> list[str]:
    """A sentence per cell whose CPUs carry more vCPUs than it has CPUs (the VMs' threads then
    share CPUs), naming the cell, its CPUs, the VMs and the counts; empty when none is, or
    nothing is pinned (fewer than two cells). A VM whose ``cpus`` span several cells (widened
    by rule 2, or interleaved) counts on each cell in proportion to the CPUs it has there, as
    the scheduler spreads it at best. ``vcpus``: each VM's vCPU count by name."""
    if not cells or len(cells) < 2:
        return []
    out = []
    for c in cells:
        own = set(c.cpus)
        load, names, only = 0.0, [], 0
        for name, p in placements.items():
            shared = own & set(p.cpus)
            if not shared:
                continue
            load += vcpus[name] * len(shared) / len(p.cpus)
            names.append(name)
            only += set(p.cpus) <= own
        if load > len(c.cpus) + 1e-9:
            hint = (f"; at most {len(c.cpus) // only} vCPUs per VM would fit it"
                    if only == len(names) and len(c.cpus) // only else "")
            out.append(f"NUMA cell {c.id}'s {len(c.cpus)} CPUs ({cpuset(c.cpus)}) carry "
                       f"{load:.4g} vCPUs of VM(s) {', '.join(sorted(names))}: overcommitted "
                       f"{load / len(c.cpus):.1f}x (their vCPU threads share CPUs){hint}")
    return out
