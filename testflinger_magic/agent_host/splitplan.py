"""Pure planning for a GPU split: find GPUs, assign them to VMs, write and check domain XML.

No libvirt, no I/O: every function takes XML text or dataclasses and returns values, so the whole
plan is unit-testable. ``libvirt_split`` does the effects.

PCI addresses are strings ``"DDDD:BB:SS.F"`` in lower-case hex (``"0000:01:00.0"``), MACs are
lower-case ``"52:54:00:12:34:56"``, memory is MiB, disk GiB.

Facts from libvirt this module relies on (libvirt 9.0, checked against its test driver):
- node device XML (``virNodeDevice.XMLDesc``) of a PCI device has ``<capability type='pci'>``
  with ``<class>0xCCSSPP</class>``, ``<domain>/<bus>/<slot>/<function>`` as decimal integers,
  ``<vendor id=>``, ``<product id=>``, ``<iommuGroup number=>`` listing ``<address>`` children
  (every function in the group, including the device itself) and ``<numa node=>``;
- VFIO can only hand a whole IOMMU group to one guest, so every function of a GPU's group goes
  with it (e.g. the GPU's HD audio function ``.1``);
- libvirt accepts domains whose ``<hostdev>`` names a PCI address that does not exist, two
  domains claiming the same PCI device and two domains with the same MAC (they only fail at start,
  or never with the test driver), hence ``check_domains``.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from xml.sax.saxutils import quoteattr

LEASE_NS = "https://github.com/canonical/testflinger-magic/lease"
DISPLAY_CLASS_PREFIX = 0x03  # PCI base class 0x03: display controller (VGA 0x0300, 3D 0x0302)

_MAC_RE = re.compile(r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,62}$")


class SplitError(Exception):
    """A split/restore cannot be done; the message names the domain, device or field at fault.

    ``blame`` says whose fault it is, for the daemon's error report (docs/api.md): ``"device"``
    (the default: the server counts a failure against the device) or ``"queue"``."""

    blame = "device"


class VMSpecDoesNotFit(SplitError):
    """The queue's VM spec can never fit this device (more vCPUs, memory, disk or GPUs per VM
    than the host has at all): a configuration error, reported with ``blame = "queue"`` so the
    server suspends the queue instead of counting failures against healthy hardware. Raised by
    :func:`check_fit` before anything is defined."""

    blame = "queue"


@dataclass(frozen=True)
class GPU:
    """A passthrough-capable GPU.

    ``address``: its PCI address; ``iommu_group``: IOMMU group number (None when the host has no
    IOMMU, then it cannot be passed through); ``functions``: every PCI address of the group, sorted
    (they all go to the same VM); ``numa_node``: host NUMA node or None; ``vendor_id`` and
    ``product_id``: ``"0x10de"``-style strings.
    """

    address: str
    iommu_group: int | None
    functions: tuple[str, ...]
    numa_node: int | None
    vendor_id: str
    product_id: str

    def to_dict(self) -> dict:
        """JSON shape: ``{"address", "iommu_group", "functions": [...], "numa_node",
        "vendor_id", "product_id"}``."""
        return {"address": self.address, "iommu_group": self.iommu_group,
                "functions": list(self.functions), "numa_node": self.numa_node,
                "vendor_id": self.vendor_id, "product_id": self.product_id}

    @classmethod
    def from_dict(cls, d: dict) -> "GPU":
        """Inverse of ``to_dict``; raises KeyError/TypeError on a malformed dict."""
        return cls(address=d["address"], iommu_group=d.get("iommu_group"),
                   functions=tuple(d.get("functions") or [d["address"]]),
                   numa_node=d.get("numa_node"), vendor_id=d.get("vendor_id", ""),
                   product_id=d.get("product_id", ""))


@dataclass(frozen=True)
class VMPlan:
    """One VM to create: ``name`` (also the libvirt domain name), ``mac``, ``vcpus``,
    ``memory_mib`` (MiB), ``disk_gib`` (GiB), ``disk_path`` (absolute path of its qcow2 file),
    ``gpu_count`` (GPUs to pass through)."""

    name: str
    mac: str
    vcpus: int
    memory_mib: int
    disk_gib: int
    disk_path: str
    gpu_count: int

    def to_dict(self) -> dict:
        return {"name": self.name, "mac": self.mac, "vcpus": self.vcpus,
                "memory_mib": self.memory_mib, "disk_gib": self.disk_gib,
                "disk_path": self.disk_path, "gpu_count": self.gpu_count}

    @classmethod
    def from_dict(cls, d: dict) -> "VMPlan":
        return cls(**{k: d[k] for k in ("name", "mac", "vcpus", "memory_mib", "disk_gib",
                                        "disk_path", "gpu_count")})


@dataclass(frozen=True)
class VMResult:
    """A VM as it exists after a split: ``name``, ``domain`` (libvirt domain name, the MAAS virsh
    ``power_id``), ``mac``, ``gpus`` (PCI addresses of its GPUs, not of their other functions),
    ``disk`` (path of its disk file)."""

    name: str
    domain: str
    mac: str
    gpus: list[str] = field(default_factory=list)
    disk: str = ""

    def to_dict(self) -> dict:
        return {"name": self.name, "domain": self.domain, "mac": self.mac,
                "gpus": list(self.gpus), "disk": self.disk}


@dataclass(frozen=True)
class DomainInfo:
    """What the splitter needs from a domain's XML: ``name``, ``lease_id`` and ``vm`` from our
    metadata (None when the domain is not ours), ``macs``, ``hostdevs`` (PCI source addresses),
    ``disks`` (source file paths)."""

    name: str
    lease_id: str | None
    vm: str | None
    macs: tuple[str, ...]
    hostdevs: tuple[str, ...]
    disks: tuple[str, ...]


# --- addresses ---------------------------------------------------------------------------------

def pci_address(domain: int, bus: int, slot: int, function: int) -> str:
    """``pci_address(0, 1, 0, 0) == "0000:01:00.0"``."""
    return f"{domain:04x}:{bus:02x}:{slot:02x}.{function:x}"


def _address_from_attrs(el: ET.Element) -> str:
    """PCI address from an ``<address domain='0x0000' bus='0x01' slot='0x00' function='0x0'/>``."""
    try:
        return pci_address(*(int(el.get(k, "0"), 0) for k in ("domain", "bus", "slot",
                                                                 "function")))
    except ValueError as e:
        raise SplitError(f"bad PCI <address> {ET.tostring(el, 'unicode').strip()}: {e}") from e


def _address_parts(address: str) -> tuple[str, str, str, str]:
    m = re.fullmatch(r"([0-9a-fA-F]{4}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])", address)
    if not m:
        raise SplitError(f"bad PCI address {address!r} (want DDDD:BB:SS.F)")
    return m.groups()


# --- discovery ---------------------------------------------------------------------------------

def discover_gpus(nodedev_xmls: list[str], vendor_ids: set[str] | list[str] | None = None
                  ) -> list[GPU]:
    """GPUs among node device XML documents (``virNodeDevice.XMLDesc()`` of each device).

    A GPU is a PCI device whose ``<class>`` base class is 0x03 (display controller: VGA 0x0300xx,
    3D 0x0302xx); ``vendor_ids`` (e.g. ``{"0x10de"}``) keeps only those vendors. Devices without a
    ``<class>`` (libvirt before 5.x) are skipped. Returns GPUs sorted by address. Raises SplitError
    naming the device on unparsable XML.
    """
    vendors = {v.lower() for v in vendor_ids} if vendor_ids else None
    gpus = []
    for text in nodedev_xmls:
        try:
            root = ET.fromstring(text)
        except ET.ParseError as e:
            raise SplitError(f"node device XML does not parse: {e}: {text[:80]!r}") from e
        cap = root.find("capability[@type='pci']")
        if cap is None:
            continue
        name = root.findtext("name", "?")
        cls = cap.findtext("class")
        if cls is None or (int(cls, 16) >> 16) != DISPLAY_CLASS_PREFIX:
            continue
        vendor = (cap.find("vendor").get("id", "") if cap.find("vendor") is not None
                  else "").lower()
        if vendors is not None and vendor not in vendors:
            continue
        try:
            address = pci_address(*(int(cap.findtext(k, "0"), 0)
                                    for k in ("domain", "bus", "slot", "function")))
        except ValueError as e:
            raise SplitError(f"node device {name}: bad PCI address field: {e}") from e
        group_el = cap.find("iommuGroup")
        group = int(group_el.get("number")) if group_el is not None else None
        functions = ({_address_from_attrs(a) for a in group_el.findall("address")}
                     if group_el is not None else set())
        functions.add(address)
        numa_el = cap.find("numa")
        numa = int(numa_el.get("node")) if numa_el is not None and numa_el.get("node") else None
        if numa is not None and numa < 0:  # sysfs says -1 when the platform does not know
            numa = None
        product = cap.find("product")
        gpus.append(GPU(address=address, iommu_group=group, functions=tuple(sorted(functions)),
                        numa_node=numa, vendor_id=vendor,
                        product_id=(product.get("id", "") if product is not None else "")))
    return sorted(gpus, key=lambda g: g.address)


def pci_addresses(nodedev_xmls: list[str]) -> set[str]:
    """Every PCI address present on the host (from node device XML)."""
    out = set()
    for text in nodedev_xmls:
        cap = ET.fromstring(text).find("capability[@type='pci']")
        if cap is not None:
            out.add(pci_address(*(int(cap.findtext(k, "0"), 0)
                                  for k in ("domain", "bus", "slot", "function"))))
    return out


def numa_from_capabilities(caps_xml: str) -> dict[int, list[int]] | None:
    """Host NUMA cells from ``virConnect.getCapabilities()``: ``{node id: [host CPU ids]}``, or
    None when the host reports no cells (single node, or libvirt's test driver with a file)."""
    cells = ET.fromstring(caps_xml).findall("host/topology/cells/cell")
    out = {int(c.get("id")): sorted(int(cpu.get("id")) for cpu in c.findall("cpus/cpu"))
           for c in cells}
    return out or None


def numa_from_nodeinfo(nodes: int, cpus: int) -> dict[int, list[int]] | None:
    """Test-driver fallback: split ``cpus`` CPU ids evenly and contiguously over ``nodes``
    nodes (what ``virConnect.getInfo()`` reports). Only for hosts without capability cells."""
    if nodes < 2 or cpus < nodes:
        return None
    per = cpus // nodes
    return {n: list(range(n * per, (n + 1) * per)) for n in range(nodes)}


def cpuset(cpus: list[int]) -> str:
    """libvirt cpuset syntax for CPU ids: ``[0,1,2,3,8] -> "0-3,8"``."""
    out, ids = [], sorted(set(cpus))
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


# --- does the spec fit the host at all ----------------------------------------------------------

@dataclass(frozen=True)
class HostResources:
    """What a host has in total (not what is free now): ``cpus`` (logical CPUs) and
    ``memory_mib`` (MiB) from ``virConnect.getInfo()`` (its items 2 and 1), ``gpus`` (display
    controllers found by :func:`discover_gpus`), ``pool_gib``: capacity in GiB of the storage
    pool holding the VM disks (``virStoragePool.info()[1]`` bytes / 2**30), None when no pool
    holds them (the lab or the operator provides the files)."""

    cpus: int
    memory_mib: int
    gpus: int
    pool_gib: float | None = None


def check_fit(vms: list[VMPlan], host: HostResources, device: str = "the device") -> None:
    """Raise :class:`VMSpecDoesNotFit` listing every way ``vms`` (one lease's VMs) can never fit
    ``host``, whatever else runs there:

    - a VM with more vCPUs than the host has CPUs (overcommit within the host's CPU count is the
      operator's choice, beyond it every vCPU thread fights its siblings);
    - the VMs' memory together above the host's: VFIO pins all guest RAM of a passthrough VM;
    - a VM's disk larger than the pool (disks are thin qcow2 files, so their sum may exceed it);
    - a VM with more GPUs than the host has.

    Shortages caused by other domains (GPUs in use, memory taken) are not checked here: they are
    no fault of the queue's spec (``assign`` reports GPUs in use).
    """
    problems = []
    for vm in vms:
        if vm.vcpus > host.cpus:
            problems.append(f"VM {vm.name}: vcpus {vm.vcpus} > the host's {host.cpus} CPUs")
        if vm.gpu_count > host.gpus:
            problems.append(f"VM {vm.name}: {vm.gpu_count} GPU(s) per VM > the host's "
                            f"{host.gpus} GPU(s)")
        if host.pool_gib is not None and vm.disk_gib > host.pool_gib:
            problems.append(f"VM {vm.name}: disk_gib {vm.disk_gib} > the storage pool's "
                            f"{host.pool_gib:g} GiB")
    memory = sum(vm.memory_mib for vm in vms)
    if memory > host.memory_mib:
        problems.append(f"{len(vms)} VM(s) x memory_mib need {memory} MiB > the host's "
                        f"{host.memory_mib} MiB (passthrough VMs pin all their memory)")
    if problems:
        raise VMSpecDoesNotFit(
            f"the queue's VM spec does not fit {device}; fix the queue definition and apply it "
            "again:\n" + "\n".join(problems))


# --- assignment --------------------------------------------------------------------------------

def assign(gpus: list[GPU], vms: list[VMPlan], in_use: set[str]) -> dict[str, list[GPU]]:
    """Give each VM ``gpu_count`` GPUs: ``{vm name: [GPU, ...]}``, deterministic.

    ``in_use``: PCI addresses held by other domains; a GPU is free only if none of its group's
    functions is in use (and, once given to a VM, its functions are in use for the next VMs).
    Bigger VMs choose first; a VM takes GPUs from the single NUMA node with the fewest free GPUs
    that still has enough (keeps nodes whole for later VMs), else the lowest addresses across
    nodes. GPUs without an IOMMU group are never assigned. Raises SplitError when there are not
    enough free GPUs, naming the VM, how many it needs and which GPUs are taken.
    """
    used = set(in_use)
    usable = [g for g in gpus if g.iommu_group is not None]
    out: dict[str, list[GPU]] = {}
    for vm in sorted(vms, key=lambda v: (-v.gpu_count, v.name)):
        if vm.gpu_count < 0:
            raise SplitError(f"VM {vm.name}: gpu_count {vm.gpu_count} is negative")
        free = [g for g in usable if not used.intersection(g.functions)]
        if len(free) < vm.gpu_count:
            taken = sorted(g.address for g in usable if used.intersection(g.functions))
            no_iommu = sorted(g.address for g in gpus if g.iommu_group is None)
            hint = f"; without IOMMU group (IOMMU off?): {no_iommu}" if no_iommu else ""
            raise SplitError(
                f"VM {vm.name}: needs {vm.gpu_count} GPU(s) but only {len(free)} of "
                f"{len(gpus)} are free (in use: {taken}){hint}")
        by_node: dict[object, list[GPU]] = {}
        for g in free:
            by_node.setdefault(g.numa_node, []).append(g)
        fitting = [(len(gs), str(n), gs) for n, gs in by_node.items() if len(gs) >= vm.gpu_count]
        chosen = (min(fitting, key=lambda t: (t[0], t[1]))[2] if fitting else free)
        chosen = chosen[:vm.gpu_count]
        for g in chosen:
            used.update(g.functions)
        out[vm.name] = chosen
    return {vm.name: out[vm.name] for vm in vms}


# --- domain XML --------------------------------------------------------------------------------

def validate_plan(vms: list[VMPlan]) -> None:
    """Check VM plans before any XML: names, MAC syntax, positive sizes, absolute disk paths,
    unique names/MACs/disks. Raises SplitError listing every problem (``VM <name>: field: ...``).
    """
    problems = []
    seen: dict[str, dict[str, str]] = {"name": {}, "mac": {}, "disk_path": {}}
    for vm in vms:
        if not _NAME_RE.match(vm.name or ""):
            problems.append(f"VM {vm.name!r}: name: must match {_NAME_RE.pattern}")
        if not _MAC_RE.match((vm.mac or "").lower()):
            problems.append(f"VM {vm.name}: mac: {vm.mac!r} is not a MAC like 52:54:00:ab:cd:ef")
        elif int(vm.mac[:2], 16) & 1:
            problems.append(f"VM {vm.name}: mac: {vm.mac} is a multicast address")
        for fld in ("vcpus", "memory_mib", "disk_gib"):
            v = getattr(vm, fld)
            if not isinstance(v, int) or v <= 0:
                problems.append(f"VM {vm.name}: {fld}: must be a positive integer, got {v!r}")
        if not (vm.disk_path or "").startswith("/"):
            problems.append(f"VM {vm.name}: disk_path: {vm.disk_path!r} is not absolute")
        for fld, val in (("name", vm.name), ("mac", (vm.mac or "").lower()),
                         ("disk_path", vm.disk_path)):
            if val in seen[fld]:
                problems.append(f"VM {vm.name}: {fld}: {val} also used by VM {seen[fld][val]}")
            seen[fld][val] = vm.name
    if problems:
        raise SplitError("invalid VM plan:\n" + "\n".join(problems))


def domain_xml(vm: VMPlan, gpus: list[GPU], lease_id: str,
               numa: dict[int, list[int]] | None, emulator: str | None = None, *,
               domain_type: str = "kvm", network: str | None = "default",
               bridge: str | None = None) -> str:
    """The libvirt domain XML of one VM.

    - every function of each GPU's IOMMU group as ``<hostdev mode='subsystem' type='pci'
      managed='yes'>`` (managed: libvirt binds vfio-pci on start and gives the device back on
      destroy);
    - ``<vcpu cpuset=>`` pinned to the CPUs of the GPUs' NUMA node(s) and ``<numatune>`` strict on
      those nodes, when ``numa`` (``{node: [cpu ids]}``) is given and the GPUs' nodes are known;
    - ``<memory unit='MiB'>``; a virtio NIC with ``vm.mac`` on ``bridge`` if given else on libvirt
      network ``network``; a qcow2 file disk at ``vm.disk_path``;
    - per-device boot order: NIC first (PXE, MAAS commissions/deploys over the network), disk next;
    - ``<metadata><magic:lease xmlns:magic=LEASE_NS id=lease_id vm=vm.name/></metadata>``.
    ``domain_type``: ``kvm`` (libvirt's test driver accepts it too). Raises SplitError on a bad
    plan (see ``validate_plan``).
    """
    validate_plan([vm])
    functions = sorted({f for g in gpus for f in g.functions})
    nodes = sorted({g.numa_node for g in gpus if g.numa_node is not None})
    lines = [f"<domain type={quoteattr(domain_type)}>",
             f"  <name>{_esc(vm.name)}</name>",
             "  <metadata>",
             f"    <magic:lease xmlns:magic={quoteattr(LEASE_NS)} id={quoteattr(lease_id)}"
             f" vm={quoteattr(vm.name)}/>",
             "  </metadata>",
             f"  <memory unit='MiB'>{vm.memory_mib}</memory>",
             f"  <currentMemory unit='MiB'>{vm.memory_mib}</currentMemory>"]
    pinned = numa and nodes and all(n in numa for n in nodes)
    if pinned:
        cpus = [c for n in nodes for c in numa[n]]
        lines.append(f"  <vcpu placement='static' cpuset='{cpuset(cpus)}'>{vm.vcpus}</vcpu>")
        lines += ["  <numatune>",
                  f"    <memory mode='strict' nodeset='{cpuset(nodes)}'/>",
                  "  </numatune>"]
    else:
        lines.append(f"  <vcpu placement='static'>{vm.vcpus}</vcpu>")
    lines += ["  <os>",
              "    <type arch='x86_64' machine='q35'>hvm</type>",
              "  </os>",
              "  <features><acpi/><apic/></features>",
              "  <cpu mode='host-passthrough'/>",
              "  <devices>"]
    if emulator:
        lines.append(f"    <emulator>{_esc(emulator)}</emulator>")
    lines += ["    <disk type='file' device='disk'>",
              "      <driver name='qemu' type='qcow2'/>",
              f"      <source file={quoteattr(vm.disk_path)}/>",
              "      <target dev='vda' bus='virtio'/>",
              "      <boot order='2'/>",
              "    </disk>"]
    if bridge:
        lines += ["    <interface type='bridge'>", f"      <source bridge={quoteattr(bridge)}/>"]
    else:
        lines += ["    <interface type='network'>",
                  f"      <source network={quoteattr(network or 'default')}/>"]
    lines += [f"      <mac address='{vm.mac.lower()}'/>",
              "      <model type='virtio'/>",
              "      <boot order='1'/>",
              "    </interface>"]
    for f in functions:
        d, b, s, fn = _address_parts(f)
        lines += ["    <hostdev mode='subsystem' type='pci' managed='yes'>",
                  f"      <source><address domain='0x{d}' bus='0x{b}' slot='0x{s}'"
                  f" function='0x{fn}'/></source>",
                  "    </hostdev>"]
    lines += ["    <serial type='pty'><target port='0'/></serial>",
              "    <console type='pty'><target type='serial' port='0'/></console>",
              "  </devices>",
              "</domain>", ""]
    return "\n".join(lines)


def _esc(text: str) -> str:
    return quoteattr(text)[1:-1]


def parse_domain(xml: str) -> DomainInfo:
    """Read name, our lease metadata, MACs, PCI hostdev sources and disk files of a domain XML.
    Raises SplitError when the XML does not parse."""
    try:
        root = ET.fromstring(xml)
    except ET.ParseError as e:
        raise SplitError(f"domain XML does not parse: {e}: {xml[:80]!r}") from e
    lease = root.find(f"metadata/{{{LEASE_NS}}}lease")
    devices = root.find("devices")
    devices = devices if devices is not None else ET.Element("devices")
    hostdevs = tuple(_address_from_attrs(a) for h in devices.findall("hostdev[@type='pci']")
                     for a in h.findall("source/address"))
    return DomainInfo(
        name=root.findtext("name", ""),
        lease_id=lease.get("id") if lease is not None else None,
        vm=lease.get("vm") if lease is not None else None,
        macs=tuple(m.get("address", "").lower() for m in devices.findall("interface/mac")),
        hostdevs=hostdevs,
        disks=tuple(s.get("file") for s in devices.findall("disk/source") if s.get("file")))


def check_domains(new_xmls: list[str], existing_xmls: list[str], host_pci: set[str]) -> None:
    """Reject what libvirt would let through, before anything is defined.

    ``new_xmls``: domains about to be defined; ``existing_xmls``: every other domain on the host
    (any lease, ours or not, active or not); ``host_pci``: PCI addresses present on the host.
    Raises SplitError listing every problem: a hostdev address the host does not have, a PCI
    device claimed twice (by two new domains, or by a new and an existing one), a MAC used twice,
    a domain name used twice. Conflicts among existing domains alone are not reported.
    """
    new = [parse_domain(x) for x in new_xmls]
    old = [parse_domain(x) for x in existing_xmls]
    problems = []
    names: dict[str, int] = {}
    for d in new:
        names[d.name] = names.get(d.name, 0) + 1
    for d in old:
        if d.name in names:
            problems.append(f"domain {d.name}: a domain of that name already exists")
    problems += [f"domain {n}: defined {c} times in this split" for n, c in names.items() if c > 1]
    for d in new:
        for a in d.hostdevs:
            if a not in host_pci:
                problems.append(f"domain {d.name}: hostdev {a}: no such PCI device on the host")
    for kind, get in (("PCI device", lambda d: d.hostdevs), ("MAC", lambda d: d.macs)):
        owner: dict[str, str] = {}
        for d in old:
            for v in get(d):
                owner.setdefault(v, d.name)
        claimed_new: dict[str, str] = {}
        for d in new:
            for v in set(get(d)):
                if v in claimed_new:
                    problems.append(f"domain {d.name}: {kind} {v} also in new domain "
                                    f"{claimed_new[v]}")
                elif v in owner:
                    problems.append(f"domain {d.name}: {kind} {v} already used by domain "
                                    f"{owner[v]}")
                claimed_new[v] = d.name
    if problems:
        raise SplitError("domain check failed:\n" + "\n".join(problems))


def gpus_of(info: DomainInfo, gpus: list[GPU]) -> list[str]:
    """GPU addresses (not other functions) a domain holds, sorted."""
    held = set(info.hostdevs)
    return sorted(g.address for g in gpus if g.address in held)
