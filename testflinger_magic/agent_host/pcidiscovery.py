"""Which PCI devices of a host are GPUs to lend, what goes with each, and what is refused (pure).

Input: node device XML documents (``virNodeDevice.XMLDesc()`` of every ``pci`` device, libvirt's
nodedev format, https://libvirt.org/formatnode.html). Output: a :class:`Discovery` of the GPUs a
split may lend, each with the functions that go to the VM with it, and every refused device with
its reason. No libvirt, no I/O.

The rules, and where each comes from:

- A GPU is a display controller (PCI base class 0x03: VGA 0x0300, 3D 0x0302; PCI Code and ID
  Assignment spec) of a vendor in ``gpu_vendors`` (default NVIDIA ``0x10de``). A display
  controller of another vendor is refused: a server's BMC shows up as an ASPEED VGA (1a03:2000)
  and must stay with the host.
- Bridges (base class 0x06, among them PCI-to-PCI bridges 0x0604 and NVSwitches 0x0680) are
  never lent. libvirt marks a bridge header with a ``<capability type='pci-bridge'/>`` (or
  ``cardbus-bridge``) child of ``<capability type='pci'>`` (``virNodeDeviceCapPCIDefFormat`` in
  libvirt's ``src/conf/node_device_conf.c`` formats ``virPCIHeaderTypeToString(hdrType)`` for any
  non-endpoint header), and vfio-pci refuses any device whose header is not type 0
  (``vfio_pci_core_register_device`` in Linux ``drivers/vfio/pci/vfio_pci_core.c``), so a domain
  holding a bridge as ``<hostdev>`` fails to start.
- VFIO gives a whole IOMMU group to one user (Linux ``Documentation/driver-api/vfio.rst``,
  "Groups"), so a GPU goes with its own other functions (same domain, bus and slot, another
  function: the HD audio controller ``.1`` of PCIe GPUs, and the like), which must be in its
  group.
- Bridges in a GPU's group stay with the host and do not refuse it. A PCIe root port or switch
  downstream port without ACS shares its group with what is behind it (Linux
  ``pci_device_group`` in ``drivers/iommu/iommu.c``), and VFIO counts such a group viable with
  the bridge bound to its host driver: until Linux 5.19, ``vfio_dev_driver_allowed`` (earlier
  ``vfio_dev_whitelisted``) in ``drivers/vfio/vfio.c`` returns true for ``pdev->hdr_type !=
  PCI_HEADER_TYPE_NORMAL`` ("if we lack isolation on a bridge then all of the downstream
  devices will be part of the same IOMMU group as the bridge"); since 5.19 the IOMMU core's DMA
  ownership decides (``iommu_group_claim_dma_owner``, ``drivers/iommu/iommu.c``) and the
  bridges' ``pcieport`` driver sets ``driver_managed_dma`` (``drivers/pci/pcie/portdrv.c``,
  commit "PCI: portdrv: Set driver_managed_dma"), so a group of GPU and port is still viable.
  As the kernel does, a bridge is a device whose header is not type 0: libvirt's
  ``pci-bridge``/``cardbus-bridge`` sub-capability (above), or the class of a PCI-to-PCI bridge
  (0x0604, 0x0609), whose header the PCI spec makes type 1. A host bridge (0x0600) or an
  NVSwitch (0x0680) has a type-0 header: an endpoint.
- A GPU whose group holds a foreign endpoint (a NIC behind a switch with ACS off, a disk, a
  display controller of another vendor) is refused, naming that device and how to isolate it
  (ACS), and the other GPUs are still lent. (VFIO would accept an endpoint with no driver
  bound, but the guest could then reach it, and a later driver bind on the host would fail:
  the daemon never lends such a group.)
- GPUs that share a group only with each other (and their own functions and bridges: two GPUs
  behind one PCIe switch without ACS) are lent as a unit: VFIO's unit of ownership is the
  group, and a group is viable, so usable, once every endpoint in it is bound to VFIO and
  given to the same user (Linux ``Documentation/driver-api/vfio.rst``, "Groups, Devices, and
  IOMMUs": "the group is the minimum granularity that must be used to ensure secure user
  access"). Such GPUs are :attr:`Discovery.grouped`: a VM of at least as many GPUs as the
  group holds takes them all (``splitplan.assign``), one of fewer GPUs never does (the group
  cannot be split across VMs), so for one GPU per VM they stay refused, with the ACS advice
  and a note that a queue of that many GPUs per VM could take the group.
- A GPU with no IOMMU group (the host's IOMMU is off: ``intel_iommu=on`` missing, or disabled in
  firmware) cannot be passed through at all and is refused.
- NVSwitches (NVIDIA, class 0x0680) stay on the host. One GPU per VM needs no fabric; more than
  one GPU per VM over NVLink needs NVIDIA Fabric Manager running the shared NVSwitch
  virtualization model (NVIDIA Fabric Manager User Guide, "Shared NVSwitch Virtualization
  Model"), where the GPUs of a VM talk over NVLink only once a partition holding exactly them
  is activated (FM API ``fmActivateFabricPartition``; NVIDIA/Fabric-Manager-Client's ``fmpm
  -l``/``-a``/``-d`` list, activate and deactivate partitions, each listed with its GPUs'
  ``pciBusId``). Nothing here activates one: the operator opts in
  (``splitter.nvswitch_multi_gpu``) and brings the activation: :func:`multi_gpu_problem`.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

DEFAULT_GPU_VENDORS = ("0x10de",)  # NVIDIA (pci.ids)
DISPLAY_BASE_CLASS = 0x03
BRIDGE_BASE_CLASS = 0x06
NVSWITCH_CLASS = 0x0680  # base 0x06 "bridge", subclass 0x80 "other": how NVSwitches enumerate
NVIDIA = "0x10de"
#: sub-capabilities of <capability type='pci'> naming a non-endpoint header (libvirt
#: ``virPCIHeaderType``: "endpoint", "pci-bridge", "cardbus-bridge").
_BRIDGE_HEADERS = ("pci-bridge", "cardbus-bridge")
#: classes (base + subclass) whose header the PCI spec makes type 1: PCI-to-PCI bridge and
#: semi-transparent PCI-to-PCI bridge (PCI Code and ID Assignment spec, base class 0x06).
_BRIDGE_CLASSES = (0x0604, 0x0609)
#: What the refusal of a GPU sharing its IOMMU group with a foreign endpoint says to do. Linux
#: enables ACS on every port that has it when the IOMMU is on (``pci_request_acs``, called by
#: the Intel and AMD IOMMU drivers), so a NIC in a GPU's group means a switch without ACS, or
#: ACS turned off in firmware or cleared at boot (NCCL's troubleshooting guide, "PCI Access
#: Control Services (ACS)", has bare-metal GPUDirect hosts clear it with setpci).
ISOLATE_ADVICE = (
    "to lend it, enable ACS (Access Control Services) on the PCIe switch or root port above it "
    "(in the firmware/BIOS setup, and do not clear it at boot: GPUDirect RDMA setups on bare "
    "metal often do), or move the card behind a port of its own")


class DiscoveryError(Exception):
    """A node device document cannot be read; the message names the device."""


@dataclass(frozen=True)
class PCIDevice:
    """One PCI function as libvirt reports it.

    ``address`` ``"DDDD:BB:SS.F"``; ``pci_class`` the 24-bit class code (``0x030200``);
    ``vendor_id``/``product_id`` ``"0x10de"``-style; ``product``: libvirt's product name (may be
    empty); ``iommu_group``: group number or None (no IOMMU); ``group``: every address of the
    group, sorted; ``numa_node``: node or None; ``driver``: bound kernel driver or None;
    ``bridge_header``: True when libvirt reports a bridge header (``pci-bridge``/``cardbus-
    bridge``) or the class is a PCI bridge (0x0604).
    """

    address: str
    pci_class: int
    vendor_id: str
    product_id: str
    product: str
    iommu_group: int | None
    group: tuple[str, ...]
    numa_node: int | None
    driver: str | None
    bridge_header: bool

    @property
    def base_class(self) -> int:
        return self.pci_class >> 16

    @property
    def class_code(self) -> int:
        """Base class and subclass (``0x0302``)."""
        return self.pci_class >> 8

    @property
    def slot(self) -> str:
        """``"DDDD:BB:SS"``: the physical device this function belongs to."""
        return self.address.rsplit(".", 1)[0]

    def describe(self) -> str:
        """``"0000:02:00.0 (1a03:1150 AST1150 PCI bridge, class 0x060400)"``."""
        what = f"{self.vendor_id[2:]}:{self.product_id[2:]}"
        if self.product:
            what += f" {self.product}"
        kind = ("PCI bridge" if self.bridge_header else
                "NVSwitch" if self.is_nvswitch else "")
        return f"{self.address} ({what}{', ' + kind if kind else ''}, class 0x{self.pci_class:06x})"

    @property
    def is_nvswitch(self) -> bool:
        return self.vendor_id == NVIDIA and self.class_code == NVSWITCH_CLASS


@dataclass(frozen=True)
class Refusal:
    """A device not lent: ``address`` and ``reason`` (a sentence for the operator)."""

    address: str
    reason: str

    def to_dict(self) -> dict:
        return {"address": self.address, "reason": self.reason}


@dataclass(frozen=True)
class Discovery:
    """What :func:`discover` found: ``gpus`` (lendable, sorted by address; ``splitplan.GPU``),
    ``refused`` (sorted by address), ``nvswitches`` (addresses), ``devices`` (every PCI function
    by address), ``all_gpus`` (every display controller of a GPU vendor on the bus, lendable or
    refused, sorted)."""

    gpus: list
    refused: list[Refusal] = field(default_factory=list)
    nvswitches: list[str] = field(default_factory=list)
    devices: dict[str, PCIDevice] = field(default_factory=dict)
    all_gpus: list[str] = field(default_factory=list)
    #: GPUs sharing their IOMMU group only with other GPUs (and those GPUs' own functions):
    #: lendable only together, the whole group to one VM (module docstring). Each is also in
    #: ``refused`` (for VMs of fewer GPUs than its group holds). Sorted by address.
    grouped: list = field(default_factory=list)

    @property
    def refused_gpus(self) -> list[Refusal]:
        """The refusals of GPUs (of a GPU vendor) only, sorted by address."""
        every = set(self.all_gpus)
        return [r for r in self.refused if r.address in every]

    def lendable(self, gpus_per_vm: int | None = None) -> list:
        """The GPUs VMs of ``gpus_per_vm`` GPUs can take, sorted by address: :attr:`gpus`,
        plus the :attr:`grouped` GPUs whose group holds no more than ``gpus_per_vm`` GPUs
        (a group goes whole to one VM). None: every GPU some VM size can take."""
        return lendable_of(self.gpus, self.grouped, gpus_per_vm)

    def refused_for(self, gpus_per_vm: int | None = 1) -> list[Refusal]:
        """:attr:`refused` without the grouped GPUs VMs of ``gpus_per_vm`` GPUs can take."""
        taken = {g.address for g in self.lendable(gpus_per_vm)}
        return [r for r in self.refused if r.address not in taken]

    def host_bridges(self, address: str) -> list[str]:
        """The bridges in the IOMMU group of the device at ``address`` (they stay with the
        host when it is lent), sorted; [] for an unknown address."""
        dev = self.devices.get(address)
        if dev is None:
            return []
        return [m for m in dev.group if m != address and m in self.devices
                and self.devices[m].bridge_header]


def group_sizes(gpus) -> dict:
    """``{iommu group: number of GPUs of ``gpus`` in it}``."""
    sizes: dict = {}
    for g in gpus:
        sizes[g.iommu_group] = sizes.get(g.iommu_group, 0) + 1
    return sizes


def lendable_of(gpus, grouped, gpus_per_vm: int | None) -> list:
    """``gpus`` plus the ``grouped`` GPUs whose group (counted in ``grouped``) holds at most
    ``gpus_per_vm`` GPUs (None: all), sorted by address (:meth:`Discovery.lendable`)."""
    sizes = group_sizes(grouped)
    fit = [g for g in grouped if gpus_per_vm is None or sizes[g.iommu_group] <= gpus_per_vm]
    return sorted([*gpus, *fit], key=lambda g: g.address)


def pci_address(domain: int, bus: int, slot: int, function: int) -> str:
    """``pci_address(0, 1, 0, 0) == "0000:01:00.0"`` (libvirt's ``DDDD:BB:SS.F``, lower case)."""
    return f"{domain:04x}:{bus:02x}:{slot:02x}.{function:x}"


def _attr_address(el: ET.Element, name: str) -> str:
    try:
        return pci_address(*(int(el.get(k, "0"), 0) for k in ("domain", "bus", "slot",
                                                                 "function")))
    except ValueError as e:
        raise DiscoveryError(f"node device {name}: bad <address> in <iommuGroup>: {e}") from e


def parse_pci_device(text: str) -> PCIDevice | None:
    """One ``virNodeDevice.XMLDesc()`` document as a :class:`PCIDevice`; None when it is not a
    PCI device or has no ``<class>`` (libvirt before 1.2.x). Raises DiscoveryError naming the
    device on unparsable XML or fields."""
    try:
        root = ET.fromstring(text)
    except ET.ParseError as e:
        raise DiscoveryError(f"node device XML does not parse: {e}: {text[:80]!r}") from e
    cap = root.find("capability[@type='pci']")
    if cap is None:
        return None
    name = root.findtext("name", "?")
    cls = cap.findtext("class")
    if cls is None:
        return None
    try:
        pci_class = int(cls, 16)
        address = pci_address(*(int(cap.findtext(k, "0"), 0)
                                for k in ("domain", "bus", "slot", "function")))
    except ValueError as e:
        raise DiscoveryError(f"node device {name}: bad PCI class or address field: {e}") from e
    group_el = cap.find("iommuGroup")
    group_no = int(group_el.get("number")) if group_el is not None else None
    members = ({_attr_address(a, name) for a in group_el.findall("address")}
               if group_el is not None else set())
    if group_el is not None:
        members.add(address)
    numa_el = cap.find("numa")
    numa = int(numa_el.get("node")) if numa_el is not None and numa_el.get("node") else None
    if numa is not None and numa < 0:  # sysfs says -1 when the platform does not know
        numa = None
    vendor = cap.find("vendor")
    product = cap.find("product")
    headers = {c.get("type") for c in cap.findall("capability")}
    return PCIDevice(
        address=address, pci_class=pci_class,
        vendor_id=(vendor.get("id", "") if vendor is not None else "").lower(),
        product_id=(product.get("id", "") if product is not None else "").lower(),
        product=(product.text or "").strip() if product is not None else "",
        iommu_group=group_no, group=tuple(sorted(members)), numa_node=numa,
        # <driver><name> is filled by libvirt's node device driver from the sysfs ``driver``
        # link at each XML read (nodeDeviceUpdateDriverName, src/node_device/
        # node_device_driver.c); the XML parser never reads it, so libvirt's test driver
        # (test:///FILE) never reports one. None: no driver bound, or not reported.
        driver=root.findtext("driver/name"),
        bridge_header=(bool(headers.intersection(_BRIDGE_HEADERS))
                       or pci_class >> 8 in _BRIDGE_CLASSES))


def discover(nodedev_xmls: list[str], gpu_vendors=DEFAULT_GPU_VENDORS) -> Discovery:
    """Classify a host's PCI devices (see the module docstring for the rules).

    ``gpu_vendors``: vendor ids (``"0x10de"``, any case) whose display controllers are GPUs;
    None or empty: any vendor. Returns a :class:`Discovery`; ``gpus`` are ``splitplan.GPU`` with
    ``functions`` = the GPU and its companion functions. Raises DiscoveryError on bad XML.
    """
    from testflinger_magic.agent_host.splitplan import GPU  # GPU is splitplan's public type

    vendors = {v.lower() for v in gpu_vendors} if gpu_vendors else None
    devices: dict[str, PCIDevice] = {}
    for text in nodedev_xmls:
        dev = parse_pci_device(text)
        if dev is not None:
            devices[dev.address] = dev
    gpus, refused = [], []
    nvswitches = sorted(a for a, d in devices.items() if d.is_nvswitch)
    for a in nvswitches:
        refused.append(Refusal(a, "NVSwitch: stays with the host (NVLink fabric; NVIDIA Fabric "
                                  "Manager manages it), never passed through"))
    all_gpus = []

    def passable_gpu(d: PCIDevice | None) -> bool:
        # A GPU that could be passed through were it alone in its group.
        return (d is not None and d.base_class == DISPLAY_BASE_CLASS and not d.bridge_header
                and (vendors is None or d.vendor_id in vendors))

    grouped = []
    for dev in sorted(devices.values(), key=lambda d: d.address):
        if dev.base_class != DISPLAY_BASE_CLASS:
            continue
        if vendors is None or dev.vendor_id in vendors:
            all_gpus.append(dev.address)
        if vendors is not None and dev.vendor_id not in vendors:
            refused.append(Refusal(dev.address, (
                f"display controller of vendor {dev.vendor_id} ({dev.product or dev.product_id}) "
                f"is not a GPU vendor in splitter.gpu_vendors {sorted(vendors)} (a BMC's VGA "
                "stays with the host)")))
            continue
        if dev.bridge_header:
            refused.append(Refusal(dev.address, "has a bridge header: vfio-pci only takes "
                                                "endpoint (type 0) devices"))
            continue
        if dev.iommu_group is None:
            refused.append(Refusal(dev.address, (
                "no IOMMU group: the host's IOMMU is off (kernel option intel_iommu=on, or "
                "VT-d/AMD-Vi disabled in firmware), so it cannot be passed through")))
            continue
        companions, others = [], []
        members = [devices.get(m) for m in dev.group]
        peer_slots = {m.slot for m in members if m is not None and m.address != dev.address
                      and passable_gpu(m)}
        foreign = False
        for member, other in zip(dev.group, members):
            if member == dev.address:
                continue
            if other is not None and other.bridge_header:
                # A bridge: VFIO accepts it in the group, and it stays with the host
                # (vfio_dev_driver_allowed, module docstring); never a hostdev.
                continue
            if (other is not None and other.slot == dev.slot
                    and other.base_class != DISPLAY_BASE_CLASS):
                companions.append(member)
                continue
            # Another GPU, or another GPU's own function, goes to the same VM with the group;
            # anything else makes the group unlendable.
            peer = other is not None and (passable_gpu(other) or (
                other.slot in peer_slots and other.base_class != DISPLAY_BASE_CLASS))
            foreign = foreign or not peer
            others.append(other.describe() if other is not None
                          else f"{member} (not listed by libvirt)")
        gpu = GPU(address=dev.address, iommu_group=dev.iommu_group,
                  functions=tuple(sorted([dev.address, *companions])),
                  numa_node=dev.numa_node, vendor_id=dev.vendor_id,
                  product_id=dev.product_id, driver=dev.driver)
        if others and foreign:
            refused.append(Refusal(dev.address, (
                f"IOMMU group {dev.iommu_group} also holds {', '.join(others)}: VFIO gives a "
                "whole group to one guest, and that device is not this GPU's own function "
                f"nor a bridge; {ISOLATE_ADVICE}")))
            continue
        if others:
            size = 1 + sum(1 for m in members
                           if m is not None and m.address != dev.address and passable_gpu(m))
            refused.append(Refusal(dev.address, (
                f"IOMMU group {dev.iommu_group} also holds {', '.join(others)}: VFIO gives a "
                "whole group to one guest, so a VM of fewer GPUs than the group holds cannot "
                "have it; "
                f"{ISOLATE_ADVICE}. A queue of {size} or more GPUs per VM could take the group "
                f"(its {size} GPUs and their functions) whole")))
            grouped.append((gpu, size))
            continue
        gpus.append(gpu)
    # A group is lent whole only when every GPU it holds was found grouped in it (libvirt lists
    # one group the same way in each member's document; anything else stays refused).
    sizes = group_sizes([g for g, _ in grouped])
    grouped = [g for g, size in grouped if sizes[g.iommu_group] == size]
    return Discovery(gpus=gpus, refused=sorted(refused, key=lambda r: r.address),
                     nvswitches=nvswitches, devices=devices, all_gpus=all_gpus,
                     grouped=grouped)


def multi_gpu_problem(discovery: Discovery, gpus_per_vm: int, nvswitch_multi_gpu: bool
                      ) -> str | None:
    """Why ``gpus_per_vm`` GPUs per VM cannot be lent on this host, or None.

    More than one GPU per VM on a host with NVSwitches needs NVIDIA Fabric Manager's shared
    NVSwitch virtualization model (the GPUs of one VM talk over NVLink only once Fabric Manager
    has activated their partition); the operator says its own tooling does that with
    ``splitter.nvswitch_multi_gpu: true`` (the daemon activates nothing, see the module
    docstring).
    """
    if gpus_per_vm > 1 and discovery.nvswitches and not nvswitch_multi_gpu:
        return (f"{gpus_per_vm} GPUs per VM on a host with {len(discovery.nvswitches)} "
                "NVSwitch(es) need NVIDIA Fabric Manager in shared NVSwitch virtualization mode "
                "to connect them over NVLink, and a partition of exactly the VM's GPUs "
                "activated before it starts, which this daemon does not do; lend one GPU per VM "
                "(or keep NVSwitch hosts out of this queue), or set "
                "splitter.nvswitch_multi_gpu: true in the agent-host config only once your own "
                "tooling activates those partitions (docs/operator-guide.md, 'NVSwitch "
                "systems')")
    return None
