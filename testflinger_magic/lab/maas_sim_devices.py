"""The MAAS simulator's node devices: ``GET nodes/<system_id>/devices/`` as MAAS answers it.

Since MAAS 3.0 (canonical/maas commits "Create the NodeDevice model" and "Add the NodeDevice
API", first tagged 3.0.0-beta1; 2.9.x has neither) MAAS keeps every PCI and USB device its
commissioning found as a *node device* (src/maasserver/models/nodedevice.py ``NodeDevice``),
served by src/maasserver/api/nodedevices.py ``NodeDevicesHandler.read`` at
``/MAAS/api/2.0/nodes/{system_id}/devices/`` (src/maasserver/urls_api.py
``node_devices_handler``). What is modelled here, each from that source:

- **Where the devices come from.** metadataserver/builtin_scripts/hooks.py
  ``update_node_devices`` / ``_process_pcie_devices`` / ``_add_or_update_node_device``: one node
  device per PCI function LXD's resources list (``pci.devices``), ``vendor_id``/``product_id``
  as LXD gives them (4 lower-case hex digits, no ``0x``), ``vendor_name``/``product_name`` the
  pci.ids names, ``commissioning_driver`` the driver bound *during commissioning*,
  ``hardware_type`` NETWORK for a NIC whose port is one of the machine's interfaces
  (``physical_interface``), STORAGE for a disk MAAS has as a block device, GPU for an address
  in LXD's ``gpu.cards`` (LXD lists display controllers, PCI class 0x03: the BMC's VGA too),
  NODE for everything else: NVSwitches (class 0x0680), bridges, the HD audio function of a PCIe
  GPU. The simulator reads the PCI layout from the lab host file (testflinger_magic/lab/hosts.py
  writes it): :func:`layout_from_host_xml`. That file shows the *deployed* VM host, whose GPU
  functions the VM-host user data bound to ``vfio-pci``; the commissioning environment binds no
  ``vfio-pci`` (nor, here, any other GPU driver: which in-tree driver the ephemeral kernel
  binds is not modelled), so those are recorded with no driver.
- **A machine never commissioned** (status New) has no node device: the list is ``[]``. A
  commissioning that ends records the machine's layout (``MaasSimulator.set_hardware``).
- **The rendering** (``NodeDeviceHandler.fields``, src/maasserver/api/tests/test_nodedevices.py
  ``TestNodeDeviceAPI.test_GET``): ``id``, ``bus`` (int, NODE_DEVICE_BUS: PCIE 1, USB 2),
  ``bus_name`` ("PCIE"), ``hardware_type`` (int, metadataserver/enum.py HARDWARE_TYPE: NODE 0,
  CPU 1, MEMORY 2, STORAGE 3, NETWORK 4, GPU 5), ``hardware_type_name`` ("Node", "GPU", ...),
  ``system_id``, ``numa_node`` (the NUMA node's index, an int), ``physical_blockdevice``,
  ``physical_interface`` (the related document or null), ``vendor_id``, ``product_id``,
  ``vendor_name``, ``product_name``, ``commissioning_driver`` (strings, "" when none),
  ``bus_number``, ``device_number`` (ints, parsed from the BDF: ``NodeDevice.save``),
  ``pci_address`` and ``resource_uri``.
- **The filters** (``NodeDevicesHandler.read``): ``bus`` (``translate_bus``: PCIE/pcie/USB/usb
  or the number, else 400 "Bus must be PCIE or USB!"), ``hardware_type``
  (src/maasserver/models/script.py ``translate_hardware_type``: names and aliases, any case, or
  the number, else 400), and ``vendor_id``, ``product_id``, ``vendor_name``, ``product_name``,
  ``commissioning_driver`` compared case-insensitively (``__iexact``). One value each
  (``get_optional_param``); an unknown machine is 404 "No Node matches the given query."
- **An older MAAS** (< 3.0) has no such handler: its describe/ lists none and the path falls to
  the catch-all (src/maasserver/urls_api.py ``handler_404``, api/not_found.py
  ``not_found_handler``): 404 "Unknown API endpoint: <path>." (``MaasSimulator(version=...)``).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass

from testflinger_magic.lab.maas_sim_records import API, Machine, SimError, interface_json

#: The first MAAS version with node devices (module docstring).
NODE_DEVICES_SINCE = (3, 0)
#: NODE_DEVICE_BUS (maascommon/enums/node.py ``NodeDeviceBus``) and its labels.
BUS_PCIE, BUS_USB = 1, 2
BUS_NAMES = {BUS_PCIE: "PCIE", BUS_USB: "USB"}
#: HARDWARE_TYPE (maascommon/enums/node.py ``HardwareDeviceTypeEnum``) and its labels
#: (metadataserver/enum.py ``HARDWARE_TYPE_CHOICES``).
NODE, CPU, MEMORY, STORAGE, NETWORK, GPU = range(6)
HARDWARE_TYPE_NAMES = {NODE: "Node", CPU: "CPU", MEMORY: "Memory", STORAGE: "Storage",
                       NETWORK: "Network", GPU: "GPU"}
#: translate_hardware_type's names (lower-cased first).
_HARDWARE_TYPE_WORDS = {
    **dict.fromkeys(("node", "machine", "controller", "other", "generic"), NODE),
    **dict.fromkeys(("cpu", "processor"), CPU), **dict.fromkeys(("memory", "ram"), MEMORY),
    **dict.fromkeys(("storage", "disk", "ssd"), STORAGE),
    **dict.fromkeys(("network", "net", "interface"), NETWORK),
    **dict.fromkeys(("gpu", "graphics"), GPU)}
#: Drivers the commissioning environment never binds (module docstring).
_DEPLOYED_ONLY_DRIVERS = {"vfio-pci"}


def supports_node_devices(version: str) -> bool:
    """True when a MAAS of ``version`` ("3.4.0", "2.9.2") serves node devices (>= 3.0)."""
    nums = [int(n) for n in re.findall(r"\d+", version)[:2]]
    return tuple(nums + [0] * (2 - len(nums))) >= NODE_DEVICES_SINCE


@dataclass(frozen=True)
class PciFunction:
    """One PCI function of a host as commissioning sees it. ``pci_class``: e.g. 0x068000;
    ``vendor_id``/``product_id``: 4 lower-case hex digits; ``driver``: "" for none."""

    pci_address: str
    pci_class: int
    vendor_id: str
    product_id: str
    vendor_name: str
    product_name: str
    driver: str
    numa_node: int

    @property
    def is_display(self) -> bool:
        """A display controller (PCI base class 0x03): what LXD lists as a GPU card."""
        return self.pci_class >> 16 == 0x03


def _hex4(value: str) -> str:
    return f"{int(value, 16):04x}"


def layout_from_host_xml(text: str) -> list[PciFunction]:
    """The PCI functions of a libvirt test-driver host file (lab/hosts.py ``host_xml``), sorted
    by address. Raises ``ValueError`` on a document that is not one."""
    try:
        root = ET.fromstring(text)
    except ET.ParseError as e:
        raise ValueError(f"not a libvirt host document: {e}") from None
    out = []
    for dev in root.findall("device"):
        cap = dev.find("capability[@type='pci']")
        if cap is None:
            continue
        addr = "{:04x}:{:02x}:{:02x}.{:x}".format(
            *(int(cap.findtext(k) or 0) for k in ("domain", "bus", "slot", "function")))
        vendor, product = cap.find("vendor"), cap.find("product")
        numa = cap.find("numa")
        driver = (dev.findtext("driver/name") or "").strip()
        out.append(PciFunction(
            pci_address=addr, pci_class=int(cap.findtext("class") or "0", 16),
            vendor_id=_hex4(vendor.get("id")), product_id=_hex4(product.get("id")),
            vendor_name=(vendor.text or "").strip(), product_name=(product.text or "").strip(),
            driver="" if driver in _DEPLOYED_ONLY_DRIVERS else driver,
            numa_node=int(numa.get("node")) if numa is not None else 0))
    return sorted(out, key=lambda f: f.pci_address)


@dataclass(frozen=True)
class NodeDevice:
    """A recorded node device: the function, its id and hardware type; ``interface_id``: the
    machine interface it is (NETWORK), else None."""

    id: int
    function: PciFunction
    hardware_type: int
    interface_id: int | None = None


def interface_address(text: str, ifname: str) -> str | None:
    """The PCI address of the function behind network interface ``ifname`` in a host file (its
    ``net`` node device's parent), or None. Commissioning ties a NIC to the machine's interface
    by MAC (hooks.py ``update_node_devices``); the simulator's machines carry their own MACs, so
    it ties them by the interface name, which commissioning reads from the same host."""
    root = ET.fromstring(text)
    for dev in root.findall("device"):
        if dev.findtext("capability[@type='net']/interface") == ifname:
            m = re.fullmatch(r"pci_([0-9a-f]{4})_([0-9a-f]{2})_([0-9a-f]{2})_([0-9a-f])",
                             dev.findtext("parent") or "")
            return "{}:{}:{}.{}".format(*m.groups()) if m else None
    return None


def commission(functions: list[PciFunction], nic_address: str | None, interface_id: int,
               ids) -> list[NodeDevice]:
    """The node devices a commissioning records from ``functions`` (hooks.py
    ``_add_or_update_node_device``): NETWORK for the NIC at ``nic_address`` (the machine's one
    interface, ``interface_id``: the simulated machines have no other), GPU for display
    controllers, NODE for the rest (the simulated machines have no block devices, so an NVMe
    drive is NODE too, as MAAS records a disk it has no block device for). ``ids``: an iterator
    of new ids."""
    out = []
    for f in functions:
        if f.pci_address == nic_address:
            out.append(NodeDevice(next(ids), f, NETWORK, interface_id))
        else:
            out.append(NodeDevice(next(ids), f, GPU if f.is_display else NODE))
    return out


def device_json(system_id: str, d: NodeDevice, interface_doc: dict | None) -> dict:
    """A node device as ``NodeDeviceHandler`` renders it (module docstring)."""
    f = d.function
    _, bus, rest = f.pci_address.split(":")
    bus, slot = int(bus, 16), int(rest.split(".")[0], 16)
    return {"id": d.id, "bus": BUS_PCIE, "bus_name": BUS_NAMES[BUS_PCIE],
            "hardware_type": d.hardware_type,
            "hardware_type_name": HARDWARE_TYPE_NAMES[d.hardware_type],
            "system_id": system_id, "numa_node": f.numa_node, "physical_blockdevice": None,
            "physical_interface": interface_doc, "vendor_id": f.vendor_id,
            "product_id": f.product_id, "vendor_name": f.vendor_name,
            "product_name": f.product_name, "commissioning_driver": f.driver,
            "bus_number": bus, "device_number": slot, "pci_address": f.pci_address,
            "resource_uri": f"{API}/nodes/{system_id}/devices/{d.id}/"}


def translate_bus(value: str) -> int:
    """maasserver/models/nodedevice.py ``translate_bus``; SimError 400 as the handler's
    ``MAASAPIValidationError`` (one message: text/plain)."""
    if value.isdigit():
        if int(value) in BUS_NAMES:
            return int(value)
        raise SimError(400, "Invalid bus numeric value!")
    if value in ("PCIE", "pcie"):
        return BUS_PCIE
    if value in ("USB", "usb"):
        return BUS_USB
    raise SimError(400, "Bus must be PCIE or USB!")


def translate_hardware_type(value: str) -> int:
    """maasserver/models/script.py ``translate_hardware_type``; SimError 400 otherwise."""
    if value.isdigit():
        if int(value) in HARDWARE_TYPE_NAMES:
            return int(value)
        raise SimError(400, "Invalid hardware type numeric value.")
    try:
        return _HARDWARE_TYPE_WORDS[value.lower()]
    except KeyError:
        raise SimError(400, "Hardware type must be node, cpu, memory, storage, or gpu") from None


#: The case-insensitive string filters (``__iexact``) and the field each compares.
_TEXT_FILTERS = ("vendor_id", "product_id", "vendor_name", "product_name",
                 "commissioning_driver")


def select(docs: list[dict], args) -> list[dict]:
    """``docs`` (rendered devices) through the handler's filters in ``args`` (a werkzeug
    MultiDict: the last value of each, as Django's ``QueryDict.get``)."""
    def last(key):
        values = args.getlist(key)
        return values[-1] if values else None

    bus, hw = last("bus"), last("hardware_type")
    if bus is not None:
        want = translate_bus(bus)
        docs = [d for d in docs if d["bus"] == want]
    if hw is not None:
        want = translate_hardware_type(hw)
        docs = [d for d in docs if d["hardware_type"] == want]
    for key in _TEXT_FILTERS:
        value = last(key)
        if value is not None:
            docs = [d for d in docs if (d[key] or "").lower() == value.lower()]
    return docs


class NodeDevicesMixin:
    """The simulator's node devices (mixed into ``MaasSimulator``: it uses ``_lock``,
    ``_machines``, ``_advance``, ``_node_device_ids``)."""

    def set_hardware(self, system_id: str, host_xml: str) -> None:
        """Give machine ``system_id`` the PCI layout of ``host_xml`` (a libvirt host document,
        lab/hosts.py ``host_xml``): what its commissioning finds. A machine already commissioned
        (any status but New) has its node devices recorded at once, as its commissioning
        would have; a New one when its commissioning ends. ``KeyError`` if missing,
        ``ValueError`` for a document that is not a host."""
        functions = layout_from_host_xml(host_xml)
        with self._lock:
            m = self._machines[system_id]
            m.hardware = functions
            m.nic_address = interface_address(host_xml, m.ifname(0))
            if m.status_name != "New":
                self._record_node_devices(m)

    def _record_node_devices(self, m: Machine) -> None:
        """A commissioning's node devices (metadataserver/builtin_scripts/hooks.py
        ``update_node_devices``); none when the simulator knows no layout for the machine."""
        if m.hardware is None:
            return
        m.node_devices = commission(m.hardware, m.nic_address, m.interface_ids[0],
                                    self._node_device_ids)

    def _h_node_devices(self, request, system_id):
        """src/maasserver/api/nodedevices.py ``NodeDevicesHandler.read`` (Node.objects: any
        node type; 404 for an unknown system_id)."""
        m = self._machines.get(system_id)
        if m is None:
            raise SimError(404, "No Node matches the given query.")
        self._advance(m)
        docs = [device_json(m.system_id, d, interface_json(m, d.interface_id)
                            if d.interface_id is not None else None)
                for d in m.node_devices]
        return select(docs, request.args)
