"""Pure planning for a GPU split: find GPUs, assign them to VMs, write and check domain XML.

No libvirt, no I/O: every function takes XML text or dataclasses and returns values, so the whole
plan is unit-testable. ``libvirt_split`` does the effects.

PCI addresses are strings ``"DDDD:BB:SS.F"`` in lower-case hex (``"0000:01:00.0"``), MACs are
lower-case ``"52:54:00:12:34:56"``, memory is MiB, disk GiB.

Facts from libvirt this module relies on (libvirt 9.0, checked against its test driver):
- which PCI devices are lendable GPUs, and what goes with each, is ``pcidiscovery``'s job;
- which NUMA cell holds each VM's memory and which CPUs run its vCPUs is ``numaplace``'s;
- VFIO can only hand a whole IOMMU group to one guest, so a GPU's own functions go with it (e.g.
  the GPU's HD audio function ``.1``), and GPUs sharing a group go to one VM together
  (:func:`assign`);
- libvirt accepts domains whose ``<hostdev>`` names a PCI address that does not exist, two
  domains claiming the same PCI device and two domains with the same MAC (they only fail at start,
  or never with the test driver), hence ``check_domains``;
- firmware: ``<os firmware='efi'>`` asks libvirt to pick an OVMF build from the host's firmware
  descriptors (firmware autoselection, libvirt >= 5.2, https://libvirt.org/formatdomain.html
  "BIOS bootloader"); ``<sysinfo type='fwcfg'><entry name='opt/...'>`` (libvirt >= 6.5, same
  page, "SMBIOS System Information") becomes QEMU's ``-fw_cfg name=opt/...,string=...``; OVMF
  reads ``opt/ovmf/X-PciMmio64Mb`` as the size in MiB of its 64-bit PCI MMIO aperture
  (edk2 ``OvmfPkg/Library/PlatformInitLib/MemDetect.c``, ``PlatformGetFirstNonAddress``: at
  most 0x1000000 MiB, 16 TiB). See :func:`default_mmio64_mib` for the size.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from xml.sax.saxutils import quoteattr

from testflinger_magic.agent_host.numaplace import (Placement, VMNeed,  # noqa: F401
                                                    cpuset)
from testflinger_magic import vm_rules
from testflinger_magic.names import VM_NAME_RE
from testflinger_magic.agent_host.pcidiscovery import (DEFAULT_GPU_VENDORS, DiscoveryError,
                                                       discover, pci_address)

LEASE_NS = "https://github.com/canonical/testflinger-magic/lease"
#: Namespace of what a lab host file (``lab.hosts``) adds for the libvirt test driver, which
#: cannot report it itself (``<magic:domainCapabilities>``; see ``libvirt_split``).
TEST_HOST_NS = "https://github.com/canonical/testflinger-magic/lab-host"
FIRMWARES = ("uefi", "bios")
#: OVMF's limit for ``opt/ovmf/X-PciMmio64Mb`` (MemDetect.c: ``FwCfgPciMmio64Mb <= 0x1000000``;
#: vm_rules, which the queue definition and ``agent-host check`` share).
MAX_MMIO64_MIB = vm_rules.MAX_MMIO64_MIB
#: BAR1 of the largest GPU the default aperture is sized for: an H200 (141 GB of HBM3e) maps
#: its memory through BAR1, and BARs are powers of two (PCI Express Base spec, "Base Address
#: Registers"), so 256 GiB; an H100 80 GB has 128 GiB.
H200_BAR1_MIB = 256 * 1024

_MAC_RE = re.compile(r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}$")
#: A domain name at split: the shared rule (testflinger_magic.names, which device names follow).
_NAME_RE = VM_NAME_RE


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


class MultiGPUNeedsFabric(SplitError):
    """Several GPUs per VM on a host with NVSwitches without ``splitter.nvswitch_multi_gpu``
    (``pcidiscovery.multi_gpu_problem``): such VMs would have no NVLink between their GPUs.
    A property of this *device*, not a failure of it nor a fault of the queue (whose other
    devices may serve it): reported with ``blame = "hardware"`` and ``facts =
    {"nvswitches": N}``, so the server counts no failure, suspends nothing, keeps the count
    on the device and no longer lends it to queues of several GPUs per VM
    (testflinger_magic/fabric.py). ``nvswitches``: the host's NVSwitch count."""

    blame = "hardware"

    def __init__(self, message: str, nvswitches: int = 0):
        super().__init__(message)
        self.facts = {"nvswitches": int(nvswitches)}


@dataclass(frozen=True)
class GPU:
    """A passthrough-capable GPU.

    ``address``: its PCI address; ``iommu_group``: IOMMU group number (None when the host has no
    IOMMU, then it cannot be passed through); ``functions``: every PCI address of the group, sorted
    (they all go to the same VM); ``numa_node``: host NUMA node or None; ``vendor_id`` and
    ``product_id``: ``"0x10de"``-style strings; ``driver``: the kernel driver bound to it as
    libvirt's node device reports it (``<driver><name>``), None when not reported (libvirt's
    test driver never reports it).
    """

    address: str
    iommu_group: int | None
    functions: tuple[str, ...]
    numa_node: int | None
    vendor_id: str
    product_id: str
    driver: str | None = None

    def to_dict(self) -> dict:
        """JSON shape: ``{"address", "iommu_group", "functions": [...], "numa_node",
        "vendor_id", "product_id", "driver"}``."""
        return {"address": self.address, "iommu_group": self.iommu_group,
                "functions": list(self.functions), "numa_node": self.numa_node,
                "vendor_id": self.vendor_id, "product_id": self.product_id,
                "driver": self.driver}

    @classmethod
    def from_dict(cls, d: dict) -> "GPU":
        """Inverse of ``to_dict``; raises KeyError/TypeError on a malformed dict."""
        return cls(address=d["address"], iommu_group=d.get("iommu_group"),
                   functions=tuple(d.get("functions") or [d["address"]]),
                   numa_node=d.get("numa_node"), vendor_id=d.get("vendor_id", ""),
                   product_id=d.get("product_id", ""), driver=d.get("driver"))


@dataclass(frozen=True)
class VMPlan:
    """One VM to create: ``name`` (also the libvirt domain name), ``mac``, ``vcpus``,
    ``memory_mib`` (MiB), ``disk_gib`` (GiB), ``disk_path`` (absolute path of its qcow2 file),
    ``gpu_count`` (GPUs to pass through), ``bridge`` (host bridge its NIC joins: a bridge of the
    MAAS network, so it PXE-boots from MAAS; None: the splitter's own setting),
    ``firmware`` (``"uefi"``: OVMF on q35; ``"bios"``: SeaBIOS), ``mmio64_mib`` (OVMF's 64-bit
    PCI aperture in MiB; None: :func:`default_mmio64_mib` of ``gpu_count``; ignored for bios).
    """

    name: str
    mac: str
    vcpus: int
    memory_mib: int
    disk_gib: int
    disk_path: str
    gpu_count: int
    bridge: str | None = None
    firmware: str = "uefi"
    mmio64_mib: int | None = None

    _FIELDS = ("name", "mac", "vcpus", "memory_mib", "disk_gib", "disk_path", "gpu_count",
               "bridge", "firmware", "mmio64_mib")

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self._FIELDS}

    @classmethod
    def from_dict(cls, d: dict) -> "VMPlan":
        """Inverse of ``to_dict``; ``bridge``, ``firmware`` and ``mmio64_mib`` may be absent
        (their defaults). Raises TypeError for a missing required field."""
        return cls(**{k: d[k] for k in cls._FIELDS if k in d})

    def aperture_mib(self) -> int | None:
        """The 64-bit MMIO aperture this VM gets (MiB), None with bios or without GPUs."""
        if self.firmware != "uefi" or (self.mmio64_mib is None and self.gpu_count <= 0):
            return None
        return self.mmio64_mib if self.mmio64_mib is not None else \
            default_mmio64_mib(self.gpu_count)


def default_mmio64_mib(gpus: int, bar1_mib: int = H200_BAR1_MIB) -> int:
    """OVMF 64-bit PCI aperture (MiB) that fits ``gpus`` GPUs of ``bar1_mib`` BAR1 each.

    Arithmetic (edk2 ``MdeModulePkg/Bus/Pci/PciBusDxe/PciResourceSupport.c``,
    ``CalculateResourceAperture``): each passthrough GPU sits behind its own PCIe root port on
    q35; a root port's prefetchable window holds the GPU's BAR1 plus its small 64-bit BARs (an
    H100/H200 BAR3 is 32 MiB), and takes the alignment of its largest BAR, BAR1. Windows are
    placed in order of alignment, so window *k* starts on a BAR1 boundary after window *k-1*
    ends: BAR1 + 32 MiB rounds up to 2 x BAR1 per GPU. ``2 x BAR1 x gpus`` therefore fits them
    all, with almost one BAR1 to spare after the last window for the small 64-bit BARs of the
    virtio NIC and disk (kilobytes). OVMF aligns the aperture base to the largest power of two
    not above its size (MemDetect.c), which is >= BAR1 from 2 x BAR1 on, so no further loss.
    H200: 512 GiB per GPU (8 GPUs: 4 TiB); H100 (BAR1 128 GiB) fits in the same with room.
    Clamped to OVMF's 16 TiB limit. Raises ValueError for gpus < 0.
    """
    if gpus < 0:
        raise ValueError(f"gpus must be >= 0, got {gpus}")
    return min(MAX_MMIO64_MIB, 2 * bar1_mib * max(gpus, 1))


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

def discover_gpus(nodedev_xmls: list[str], vendor_ids=DEFAULT_GPU_VENDORS) -> list[GPU]:
    """The lendable GPUs among node device XML documents (``virNodeDevice.XMLDesc()`` of each
    device), sorted by address: :func:`pcidiscovery.discover`'s ``gpus`` (see its rules:
    display controllers of ``vendor_ids``, default NVIDIA, with their own functions; GPUs whose
    IOMMU group holds anything else, or without a group, are refused and not returned).
    Raises SplitError naming the device on unparsable XML."""
    try:
        return discover(nodedev_xmls, vendor_ids).gpus
    except DiscoveryError as e:
        raise SplitError(str(e)) from e


def pci_addresses(nodedev_xmls: list[str]) -> set[str]:
    """Every PCI address present on the host (from node device XML)."""
    out = set()
    for text in nodedev_xmls:
        cap = ET.fromstring(text).find("capability[@type='pci']")
        if cap is not None:
            out.add(pci_address(*(int(cap.findtext(k, "0"), 0)
                                  for k in ("domain", "bus", "slot", "function"))))
    return out


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
    no fault of the queue's spec (``assign`` reports GPUs in use). Totals only, no reserve kept
    for the host: where on the host each VM's memory and vCPUs go, cell by cell, so that every
    domain can start, is ``numaplace.place``'s decision (it keeps a per-cell headroom).
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

    GPUs of one IOMMU group (``pcidiscovery.Discovery.grouped``: GPUs sharing a group only with
    each other) are a unit: VFIO's unit of ownership is the group, a group whose endpoints are
    not all given to the same user is not viable (Linux ``Documentation/driver-api/vfio.rst``,
    "Groups, Devices, and IOMMUs"), so a unit goes whole to one VM and never to a VM of fewer
    GPUs than it holds. A VM is filled with units whose GPUs add up to exactly its
    ``gpu_count``, whole groups first (largest first, then by address), then single GPUs.

    ``in_use``: PCI addresses held by other domains; a unit is free only if none of its
    functions is in use (and, once given to a VM, its functions are in use for the next VMs).
    Bigger VMs choose first; a VM takes GPUs from the single NUMA node with the fewest free
    GPUs that can still make its count (keeps nodes whole for later VMs), else from any node
    (a unit whose GPUs span nodes counts only there). GPUs without an IOMMU group are never
    assigned. Raises SplitError when the free units cannot make a VM's count, naming the VM,
    how many it needs and which GPUs are taken.
    """
    used = set(in_use)
    units_by_group: dict[int, list[GPU]] = {}
    for g in gpus:
        if g.iommu_group is not None:
            units_by_group.setdefault(g.iommu_group, []).append(g)
    units = sorted((sorted(u, key=lambda g: g.address) for u in units_by_group.values()),
                   key=lambda u: (-len(u), u[0].address))
    usable = [g for u in units for g in u]
    out: dict[str, list[GPU]] = {}
    for vm in sorted(vms, key=lambda v: (-v.gpu_count, v.name)):
        if vm.gpu_count < 0:
            raise SplitError(f"VM {vm.name}: gpu_count {vm.gpu_count} is negative")
        free = [u for u in units if not used.intersection(f for g in u for f in g.functions)]
        by_node: dict[object, list[list[GPU]]] = {}
        for u in free:
            nodes = {g.numa_node for g in u}
            if len(nodes) == 1:
                by_node.setdefault(nodes.pop(), []).append(u)
        fitting = [(sum(map(len, us)), str(n), picked) for n, us in by_node.items()
                   if (picked := _exact(us, vm.gpu_count)) is not None]
        chosen = (min(fitting, key=lambda t: (t[0], t[1]))[2] if fitting
                  else _exact(free, vm.gpu_count))
        if chosen is None:
            n_free = sum(map(len, free))
            taken = sorted(g.address for g in usable if used.intersection(g.functions))
            no_iommu = sorted(g.address for g in gpus if g.iommu_group is None)
            hint = f"; without IOMMU group (IOMMU off?): {no_iommu}" if no_iommu else ""
            whole = [sorted(g.address for g in u) for u in free if len(u) > 1]
            if n_free >= vm.gpu_count and whole:
                hint += (f"; GPUs sharing an IOMMU group go whole to one VM ({whole}), and no "
                         f"combination of free groups makes {vm.gpu_count}")
            raise SplitError(
                f"VM {vm.name}: needs {vm.gpu_count} GPU(s) but only {n_free} of "
                f"{len(gpus)} are free (in use: {taken}){hint}")
        for g in chosen:
            used.update(g.functions)
        out[vm.name] = sorted(chosen, key=lambda g: g.address)
    return {vm.name: out[vm.name] for vm in vms}


def _exact(units: list[list[GPU]], count: int) -> list[GPU] | None:
    """The GPUs of the first combination of ``units`` (in their order: whole groups first)
    holding exactly ``count`` GPUs, else None. Depth-first over at most a host's few units."""
    if count == 0:
        return []
    if sum(map(len, units)) < count:
        return None
    for i, u in enumerate(units):
        if len(u) > count:
            continue
        rest = _exact(units[i + 1:], count - len(u))
        if rest is not None:
            return [*u, *rest]
    return None


def numa_needs(vms: list[VMPlan], gpus_by_vm: dict[str, list[GPU]]) -> list[VMNeed]:
    """What ``numaplace.place`` needs of each VM, in ``vms`` order: its vCPUs, memory (MiB)
    and the NUMA nodes of its GPUs (``gpus_by_vm``: ``{vm name: [GPU]}`` as ``assign``
    returns; GPUs of unknown node are left out)."""
    return [VMNeed(name=vm.name, vcpus=vm.vcpus, memory_mib=vm.memory_mib,
                   gpu_cells=tuple(sorted({g.numa_node for g in gpus_by_vm.get(vm.name, [])
                                           if g.numa_node is not None})))
            for vm in vms]


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
        if vm.firmware not in FIRMWARES:
            problems.append(f"VM {vm.name}: firmware: {vm.firmware!r} is not one of "
                            f"{', '.join(FIRMWARES)}")
        if mmio := vm_rules.mmio64_problem(vm.mmio64_mib):
            problems.append(f"VM {vm.name}: mmio64_mib: {mmio}")
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
               placement: Placement | None, emulator: str | None = None, *,
               domain_type: str = "kvm", network: str | None = None,
               bridge: str | None = None) -> str:
    """The libvirt domain XML of one VM.

    - every function of each GPU (``GPU.functions``) as ``<hostdev mode='subsystem' type='pci'
      managed='yes'>`` (managed: libvirt binds vfio-pci on start and gives the device back on
      destroy);
    - ``<vcpu cpuset=>`` and ``<numatune><memory mode= nodeset=>`` as ``placement`` says
      (``numaplace.place``: strict on the GPUs' cell when that cell holds the VM, else moved,
      interleaved or with vCPUs widened; None or ``mode`` None: nothing pinned);
    - q35; ``vm.firmware`` ``uefi``: ``<os firmware='efi'>`` (libvirt picks the host's OVMF) and,
      when :meth:`VMPlan.aperture_mib` says so, ``<sysinfo type='fwcfg'>`` entry
      ``opt/ovmf/X-PciMmio64Mb`` (see the module docstring); ``bios``: SeaBIOS, no aperture;
    - ``<memory unit='MiB'>``; a virtio NIC with ``vm.mac`` on the host bridge ``vm.bridge`` or
      else ``bridge``, or, only when neither is set and the operator named one, on libvirt
      network ``network``; a qcow2 file disk at ``vm.disk_path``;
    - per-device boot order: NIC first (PXE, MAAS commissions/deploys over the network), disk next;
    - ``<metadata><magic:lease xmlns:magic=LEASE_NS id=lease_id vm=vm.name/></metadata>``.
    ``domain_type``: ``kvm`` (libvirt's test driver accepts it too). Raises SplitError on a bad
    plan (see ``validate_plan``) and when the VM would have neither bridge nor network: a NIC on
    libvirt's NAT ``default`` network never reaches MAAS.
    """
    bridge = vm.bridge or bridge
    if not bridge and not network:
        raise SplitError(f"VM {vm.name}: no bridge for its NIC: set the agent-host config's "
                         "bridge (a bridge of the host's MAAS network), or splitter.network to "
                         "use a libvirt network on purpose")
    validate_plan([vm])
    functions = sorted({f for g in gpus for f in g.functions})
    lines = [f"<domain type={quoteattr(domain_type)}>",
             f"  <name>{_esc(vm.name)}</name>",
             "  <metadata>",
             f"    <magic:lease xmlns:magic={quoteattr(LEASE_NS)} id={quoteattr(lease_id)}"
             f" vm={quoteattr(vm.name)}/>",
             "  </metadata>",
             f"  <memory unit='MiB'>{vm.memory_mib}</memory>",
             f"  <currentMemory unit='MiB'>{vm.memory_mib}</currentMemory>"]
    if placement is not None and placement.mode is not None:
        if placement.vm != vm.name:
            raise SplitError(f"VM {vm.name}: given the NUMA placement of VM {placement.vm}")
        lines.append(f"  <vcpu placement='static' cpuset='{cpuset(placement.cpus)}'>"
                     f"{vm.vcpus}</vcpu>")
        lines += ["  <numatune>",
                  f"    <memory mode='{placement.mode}' nodeset='{cpuset(placement.nodeset)}'/>",
                  "  </numatune>"]
    else:
        lines.append(f"  <vcpu placement='static'>{vm.vcpus}</vcpu>")
    aperture = vm.aperture_mib()
    if aperture is not None:
        lines += ["  <sysinfo type='fwcfg'>",
                  f"    <entry name='opt/ovmf/X-PciMmio64Mb'>{aperture}</entry>",
                  "  </sysinfo>"]
    lines += ["  <os firmware='efi'>" if vm.firmware == "uefi" else "  <os>",
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
                  f"      <source network={quoteattr(network)}/>"]
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
