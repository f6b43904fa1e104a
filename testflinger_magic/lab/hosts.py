"""Multi-GPU hosts for libvirt's test driver (the embedded lab and the tests).

``write_host_xml`` writes a libvirt test-driver "custom node" document: the file a
``test:///<absolute path>`` URI opens (three slashes, then the absolute path; ``test://x/...``
would name a remote host). What libvirt 9.0's test driver reads from it (``testOpenParse`` in
libvirt's ``src/test/test_driver.c``): ``/node/cpu/{nodes,sockets,cores,threads,mhz,model}`` and
``/node/memory`` (KiB) for ``virNodeGetInfo``; ``/node/domain``, ``/node/network``,
``/node/interface``, ``/node/pool`` (with ``/node/pool/volume``) and ``/node/device`` (node
devices in libvirt's nodedev XML format: ``iommuGroup``, ``numa``, ``class`` and the
``pci-bridge`` sub-capability come back verbatim; ``<driver>`` does **not**: the real udev backend
fills it from sysfs, the test driver drops it, so ``libvirt_split`` reads it from the file for
``test:///`` URIs, as the QEMU host's node devices would report it). It
needs the ``computer`` device to carry a system UUID.

It does **not** build NUMA cells for capabilities from a file (only ``test:///default`` has them),
so ``getCapabilities()`` of a custom host shows no ``<cells>``; the splitter falls back to
``/node/cpu/nodes`` for the test driver (see ``libvirt_split``). It has no domain capabilities
at all, so the file carries what the QEMU driver of the host would answer in a
``<magic:domainCapabilities>`` element (namespace ``splitplan.TEST_HOST_NS``), which
``libvirt_split`` reads for ``test:///`` URIs only. Each connection opened on the file starts
from the file: nothing a connection changes is written back by libvirt.

The hosts are the two kinds a GPU lab has (facts: /work/shared/MAAS-AND-HOSTS.md, "Servers"):

- ``hgx`` (the default): an HGX H100 board: 8 H100 SXM5 (10de:2330) as 3D controllers (class
  0x030200), each alone in its IOMMU group, bound to ``vfio-pci``: the state the VM-host user
  data leaves after its reboot (agent_host/vmhost_userdata.py: ``vfio-pci.ids`` of each GPU
  slot's functions, ``nouveau``/``nvidia`` blacklisted; ``gpu_driver`` models a host where a
  driver still holds them); 4 NVSwitches (10de:22a3, class 0x068000, no driver: ``nvidia`` is
  blacklisted) sharing one group; the BMC's VGA (ASPEED 1a03:2000, class 0x030000, driver
  ``ast``) behind its own PCIe-to-PCI bridge (ASPEED AST1150 1a03:1150, class 0x060400) in one
  group; ConnectX-7 NICs (15b3:1021, ``mlx5_core``), the first one the boot interface; an NVMe
  drive;
- ``pcie``: PCIe GPUs (L40S, 10de:26b9) in display mode, each with its HD audio function ``.1``
  (10de:22ba, class 0x040300) in the same IOMMU group, both on ``vfio-pci`` (the user data binds
  every function of a GPU's slot); the BMC as above; an Intel E810 NIC.

``shared_groups`` adds the two IOMMU groupings a real board often has (Linux
``pci_device_group``/``pci_acs_path_enabled`` in ``drivers/iommu/iommu.c``: a device shares the
group of every device its upstream path does not isolate with ACS):

- ``"port"``: the GPU sits behind a PCIe switch downstream port (Broadcom PEX890xx, 1000:c030,
  a bridge: class 0x060400 and libvirt's ``pci-bridge`` header capability) without ACS, so port
  and GPU share one group. VFIO accepts such a group (a bridge stays with the host, Linux
  ``vfio_dev_driver_allowed``), so the GPU is lent;
- ``"nic"``: the switch has ACS off (what NVIDIA advises for GPUDirect RDMA on bare metal), so a
  ConnectX-7 (15b3:1021, InfiniBand class 0x020700, ``mlx5_core``) behind the same switch shares
  the GPU's group (its downstream port keeps its own). A foreign endpoint: the GPU is refused.

Like a freshly deployed Ubuntu with ``libvirt-daemon-system``: **no storage pool**, and the NAT
network ``default`` on ``virbr0``. The MAAS bridge (``bridge``, named as MAAS names the bridge it
renders on the boot interface with ``bridge_all``: ``br-<interface>``, canonical/maas
``Interface.get_default_bridge_name``) is present once the host is "ready"; ``iommu``, ``vfio``
and ``ovmf`` model the rest of readiness (``agent_host.hostready``).
"""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path
from xml.sax.saxutils import escape

NVIDIA = "0x10de"
ASPEED = "0x1a03"
KINDS = ("hgx", "pcie")
# Real IDs (pci.ids).
H100_SXM5 = ("0x2330", "GH100 [H100 SXM5 80GB]")
NVSWITCH = ("0x22a3", "GH100 [H100 NVSwitch]")
L40S = ("0x26b9", "AD102GL [L40S]")
L40S_AUDIO = ("0x22ba", "AD102 High Definition Audio Controller")
AST_BRIDGE = ("0x1150", "AST1150 PCI-to-PCI Bridge")
AST_VGA = ("0x2000", "ASPEED Graphics Family")
VGA_CLASS = "0x030000"
CONTROLLER_3D_CLASS = "0x030200"
AUDIO_CLASS = "0x040300"
PCI_BRIDGE_CLASS = "0x060400"
INFINIBAND_CLASS = "0x020700"
PEX_SWITCH = ("0x1000", "Broadcom / LSI")
PEX890XX = ("0xc030", "PEX890xx PCIe Gen 5 Switch")
MELLANOX = ("0x15b3", "Mellanox Technologies")
CX7 = ("0x1021", "MT2910 Family [ConnectX-7]")
SHARED_GROUP_KINDS = ("port", "nic")
NVSWITCH_CLASS = "0x068000"

CPU_CORES_PER_SOCKET = 8
CPU_THREADS = 2
MEMORY_KIB_PER_NODE = 256 * 1024 * 1024  # 256 GiB per NUMA node
TEST_HOST_NS = "https://github.com/canonical/testflinger-magic/lab-host"  # = splitplan's

# Bus numbers of the GPUs of a Dell XE9680-like HGX H100 8-GPU board, and of a 2U PCIe server.
_HGX_GPU_BUSES = (0x18, 0x2a, 0x3a, 0x5d, 0x9a, 0xab, 0xba, 0xdb)
_PCIE_GPU_BUSES = (0x17, 0x31, 0x4b, 0x65, 0x98, 0xb1, 0xca, 0xe3)
MAX_GPUS = 8
NVSWITCHES = ("0000:05:00.0", "0000:06:00.0", "0000:07:00.0", "0000:08:00.0")
BMC_BRIDGE = "0000:02:00.0"
BMC_VGA = "0000:03:00.0"
BOOT_NIC = {"hgx": ("0000:0c:00.0", "enp12s0f0np0"), "pcie": ("0000:c1:00.0", "enp193s0f0")}


def maas_bridge_name(ifname: str) -> str:
    """The bridge MAAS renders on ``ifname`` when deploying with ``bridge_all`` (canonical/maas
    ``src/maasserver/models/interface.py``, ``Interface.get_default_bridge_name``:
    ``br-<name>``, shortened when over 15 characters, the kernel's IFNAMSIZ - 1)."""
    name = f"br-{ifname}"
    if len(name) > 15:
        raise ValueError(f"{ifname}: MAAS would shorten the bridge name; the lab does not model "
                         "that")
    return name


def lab_bridge(kind: str = "hgx") -> str:
    """The MAAS bridge name of a lab host of ``kind`` (on its boot interface)."""
    return maas_bridge_name(BOOT_NIC[kind][1])


def gpu_address(index: int, kind: str = "hgx") -> str:
    """PCI address ("0000:BB:00.0") of GPU ``index`` (0-7) on a generated host of ``kind``."""
    buses = _HGX_GPU_BUSES if kind == "hgx" else _PCIE_GPU_BUSES
    if not 0 <= index < len(buses):
        raise ValueError(f"GPU index {index} out of 0..{len(buses) - 1}")
    return f"0000:{buses[index]:02x}:00.0"


def switch_port_address(index: int, kind: str = "hgx") -> str:
    """The PCIe switch downstream port above GPU ``index`` (bus of the GPU - 1) when
    ``shared_groups`` adds one."""
    bus = int(gpu_address(index, kind)[5:7], 16)
    return f"0000:{bus - 1:02x}:00.0"


def shared_nic_address(index: int, kind: str = "hgx") -> str:
    """The ConnectX-7 sharing GPU ``index``'s IOMMU group (``shared_groups`` ``"nic"``): the
    bus after the GPU's."""
    bus = int(gpu_address(index, kind)[5:7], 16)
    return f"0000:{bus + 1:02x}:00.0"


def _node_name(address: str) -> str:
    return "pci_" + address.replace(":", "_").replace(".", "_")


def _addr_el(m: str) -> str:
    dom, bus, rest = m.split(":")
    slot, fn = rest.split(".")
    return f"        <address domain='0x{dom}' bus='0x{bus}' slot='0x{slot}' function='0x{fn}'/>\n"


def _pci_device(address: str, *, pci_class: str, vendor: tuple[str, str],
                product: tuple[str, str], group: int | None, group_members: list[str],
                numa_node: int | None, driver: str | None, bridge: bool = False,
                parent: str = "computer") -> str:
    dom, bus, rest = address.split(":")
    slot, function = rest.split(".")
    numa = f"      <numa node='{numa_node}'/>\n" if numa_node is not None else ""
    name = "pci_" + address.replace(":", "_").replace(".", "_")
    drv = f"    <driver><name>{driver}</name></driver>\n" if driver else ""
    # libvirt formats a non-endpoint header as a sub-capability (node_device_conf.c,
    # virNodeDeviceCapPCIDefFormat: virPCIHeaderTypeToString(hdrType)).
    header = "      <capability type='pci-bridge'/>\n" if bridge else ""
    # No IOMMU: libvirt reports no <iommuGroup> (no /sys/bus/pci/devices/*/iommu_group link).
    iommu = (f"      <iommuGroup number='{group}'>\n{''.join(map(_addr_el, group_members))}"
             "      </iommuGroup>\n" if group is not None else "")
    return (
        "  <device>\n"
        f"    <name>{name}</name>\n"
        f"    <path>/sys/devices/pci{dom}:00/{address}</path>\n"
        f"    <parent>{parent}</parent>\n"
        f"{drv}"
        "    <capability type='pci'>\n"
        f"      <class>{pci_class}</class>\n"
        f"      <domain>{int(dom, 16)}</domain>\n"
        f"      <bus>{int(bus, 16)}</bus>\n"
        f"      <slot>{int(slot, 16)}</slot>\n"
        f"      <function>{int(function, 16)}</function>\n"
        f"      <product id='{product[0]}'>{escape(product[1])}</product>\n"
        f"      <vendor id='{vendor[0]}'>{escape(vendor[1])}</vendor>\n"
        f"{header}{iommu}{numa}"
        "    </capability>\n"
        "  </device>\n")


def _net_device(ifname: str, mac: str, parent: str) -> str:
    """A ``net`` node device as libvirt's udev backend lists it (``net_<if>_<mac>``)."""
    return (
        "  <device>\n"
        f"    <name>net_{ifname.replace('-', '_')}_{mac.replace(':', '_')}</name>\n"
        f"    <path>/sys/devices/virtual/net/{ifname}</path>\n"
        f"    <parent>{parent}</parent>\n"
        "    <capability type='net'>\n"
        f"      <interface>{ifname}</interface>\n"
        f"      <address>{mac}</address>\n"
        "      <link state='up'/>\n"
        "      <capability type='80203'/>\n"
        "    </capability>\n"
        "  </device>\n")


def _domain_caps(*, vfio: bool, ovmf: bool) -> str:
    """What ``virsh domcapabilities --machine q35 --virttype kvm`` answers on Ubuntu 22.04
    (libvirt 8.0, QEMU 6.2; https://libvirt.org/formatdomaincaps.html), trimmed to what the
    agent host reads: the firmware enum lists ``efi`` and the loader the OVMF builds when the
    ``ovmf`` package is installed; ``pciBackend`` lists ``vfio`` only when VFIO passthrough works
    (libvirt ``virHostdevHostSupportsPassthroughVFIO``)."""
    loaders = ("".join(f"        <value>/usr/share/OVMF/{f}</value>\n"
                       for f in ("OVMF_CODE_4M.fd", "OVMF_CODE_4M.secboot.fd",
                                 "OVMF_CODE_4M.ms.fd")) if ovmf else "")
    firmware = "          <value>efi</value>\n" if ovmf else ""
    backends = "".join(f"          <value>{b}</value>\n"
                       for b in (("default", "vfio") if vfio else ("default",)))
    return (
        f"  <magic:domainCapabilities xmlns:magic='{TEST_HOST_NS}'>\n"
        "    <domainCapabilities>\n"
        "      <path>/usr/bin/qemu-system-x86_64</path>\n"
        "      <domain>kvm</domain>\n"
        "      <machine>pc-q35-6.2</machine>\n"
        "      <arch>x86_64</arch>\n"
        "      <os supported='yes'>\n"
        f"        <enum name='firmware'>\n{firmware}        </enum>\n"
        f"        <loader supported='yes'>\n{loaders}        </loader>\n"
        "      </os>\n"
        "      <devices>\n"
        "        <hostdev supported='yes'>\n"
        f"          <enum name='pciBackend'>\n{backends}          </enum>\n"
        "        </hostdev>\n"
        "      </devices>\n"
        "    </domainCapabilities>\n"
        "  </magic:domainCapabilities>\n")


def host_xml(*, kind: str = "hgx", gpus: int = 8, numa_nodes: int = 2, name: str = "gpu-host",
             gpu_audio_functions: bool | None = None, iommu: bool = True, vfio: bool = True,
             ovmf: bool = True, bridge: str | None = "maas", pool_path: str | None = None,
             shared_groups: dict[int, str] | None = None,
             gpu_driver: str | None = "vfio-pci") -> str:
    """Return the custom node XML of a ``kind`` host (``hgx`` or ``pcie``, module docstring)
    with ``gpus`` (1-8) GPUs over ``numa_nodes`` nodes.

    GPU ``i`` sits at ``gpu_address(i, kind)``, alone in IOMMU group ``40 + i`` (with its audio
    function ``.1`` on ``pcie``), on NUMA node ``i * numa_nodes // gpus``.
    ``gpu_audio_functions=True`` is the old name of ``kind="pcie"``. Readiness: ``iommu=False``
    drops every ``<iommuGroup>`` (and VFIO with it), ``vfio=False`` drops VFIO from the domain
    capabilities, ``ovmf=False`` the UEFI firmware; ``bridge``: ``"maas"`` (MAAS's bridge on the
    boot interface, :func:`lab_bridge`), another name, or None (no bridge yet). ``pool_path``: an
    active dir pool ``default`` there (None: no pool, like a fresh install). The host has
    ``numa_nodes * 8`` cores with 2 threads each, 256 GiB (in KiB) per node and a ``computer``
    root device. ``shared_groups``: ``{GPU index: "port" | "nic"}``, the GPU's IOMMU group also
    holds its switch downstream port, or a ConnectX-7 (module docstring). ``gpu_driver``: the
    driver bound to every GPU function (``vfio-pci``, the VM-host user data's; ``nvidia``: a host
    whose driver still holds them, with the NVSwitches on ``nvidia`` too; None: unbound). Raises
    ValueError for
    a bad kind, gpus outside 0..8, numa_nodes < 1 or a bad ``shared_groups`` entry.
    """
    if gpu_audio_functions:
        kind = "pcie"
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if not 0 <= gpus <= MAX_GPUS or numa_nodes < 1:
        raise ValueError(f"need 0 <= gpus <= {MAX_GPUS} and numa_nodes >= 1, got {gpus}, "
                         f"{numa_nodes}")
    shared = dict(shared_groups or {})
    bad = {i: k for i, k in shared.items() if not 0 <= i < gpus or k not in SHARED_GROUP_KINDS}
    if bad:
        raise ValueError(f"shared_groups: {bad}: need a GPU index below {gpus} and one of "
                         f"{SHARED_GROUP_KINDS}")
    nv = (NVIDIA, "NVIDIA Corporation")
    aspeed = (ASPEED, "ASPEED Technology, Inc.")

    def grp(n):
        return n if iommu else None

    devices = []
    for i in range(gpus):
        addr = gpu_address(i, kind)
        node = i * numa_nodes // gpus
        own = [addr] if kind == "hgx" else [addr, addr[:-1] + "1"]
        members, parent = list(own), "computer"
        if i in shared:
            port = switch_port_address(i, kind)
            parent = _node_name(port)
            if shared[i] == "port":
                members.insert(0, port)
            else:
                nic = shared_nic_address(i, kind)
                members.append(nic)
                devices.append(_pci_device(nic, pci_class=INFINIBAND_CLASS, vendor=MELLANOX,
                                           product=CX7, group=grp(40 + i), group_members=members,
                                           numa_node=node, driver="mlx5_core", parent=parent))
            # The downstream port: a bridge, bound to pcieport (not reported by the test
            # driver, as every <driver>); alone in group 60 + i when it isolates (ACS).
            devices.append(_pci_device(
                port, pci_class=PCI_BRIDGE_CLASS, vendor=PEX_SWITCH, product=PEX890XX,
                group=grp(40 + i if shared[i] == "port" else 60 + i),
                group_members=members if shared[i] == "port" else [port], numa_node=node,
                driver="pcieport", bridge=True))
        if kind == "hgx":
            devices.append(_pci_device(addr, pci_class=CONTROLLER_3D_CLASS, vendor=nv,
                                       product=H100_SXM5, group=grp(40 + i),
                                       group_members=members, numa_node=node,
                                       driver=gpu_driver, parent=parent))
        else:
            devices.append(_pci_device(addr, pci_class=VGA_CLASS, vendor=nv, product=L40S,
                                       group=grp(40 + i), group_members=members,
                                       numa_node=node, driver=gpu_driver, parent=parent))
            devices.append(_pci_device(own[1], pci_class=AUDIO_CLASS, vendor=nv,
                                       product=L40S_AUDIO, group=grp(40 + i),
                                       group_members=members, numa_node=node,
                                       driver=("vfio-pci" if gpu_driver == "vfio-pci"
                                               else "snd_hda_intel"), parent=parent))
    if kind == "hgx":
        for a in NVSWITCHES:
            devices.append(_pci_device(a, pci_class=NVSWITCH_CLASS, vendor=nv, product=NVSWITCH,
                                       group=grp(30), group_members=list(NVSWITCHES),
                                       numa_node=0,
                                       driver="nvidia" if gpu_driver == "nvidia" else None))
    bmc = [BMC_BRIDGE, BMC_VGA]
    devices.append(_pci_device(BMC_BRIDGE, pci_class=PCI_BRIDGE_CLASS, vendor=aspeed,
                               product=AST_BRIDGE, group=grp(20), group_members=bmc,
                               numa_node=0, driver=None, bridge=True))
    devices.append(_pci_device(BMC_VGA, pci_class=VGA_CLASS, vendor=aspeed, product=AST_VGA,
                               group=grp(20), group_members=bmc, numa_node=0, driver="ast",
                               parent="pci_" + BMC_BRIDGE.replace(":", "_").replace(".", "_")))
    nic_addr, ifname = BOOT_NIC[kind]
    if kind == "hgx":
        devices.append(_pci_device(nic_addr, pci_class="0x020000", vendor=MELLANOX, product=CX7,
                                   group=grp(21), group_members=[nic_addr], numa_node=0,
                                   driver="mlx5_core"))
        devices.append(_pci_device("0000:0c:00.1", pci_class="0x020000", vendor=MELLANOX,
                                   product=CX7, group=grp(22), group_members=["0000:0c:00.1"],
                                   numa_node=0, driver="mlx5_core"))
    else:
        devices.append(_pci_device(nic_addr, pci_class="0x020000",
                                   vendor=("0x8086", "Intel Corporation"),
                                   product=("0x1592", "Ethernet Controller E810-C"),
                                   group=grp(21), group_members=[nic_addr],
                                   numa_node=numa_nodes - 1, driver="ice"))
    devices.append(_pci_device("0000:c2:00.0", pci_class="0x010802",
                               vendor=("0x144d", "Samsung Electronics Co Ltd"),
                               product=("0xa80a", "NVMe SSD Controller PM9A1/PM9A3/980PRO"),
                               group=grp(23), group_members=["0000:c2:00.0"], numa_node=0,
                               driver="nvme"))
    host_id = uuid.uuid5(uuid.NAMESPACE_DNS, name + ".lab.invalid")
    mac = "0c:42:a1:" + ":".join(host_id.hex[i:i + 2] for i in (0, 2, 4))
    nic_parent = "pci_" + nic_addr.replace(":", "_").replace(".", "_")
    devices.append(_net_device(ifname, mac, nic_parent))
    devices.append(_net_device("virbr0", "52:54:00:6b:3c:58", "computer"))
    bridge_name = lab_bridge(kind) if bridge == "maas" else bridge
    interfaces = ""
    if bridge_name:
        # What netplan renders from MAAS's bridge: the bridge carries the port's MAC.
        devices.append(_net_device(bridge_name, mac, "computer"))
        interfaces = (
            f"  <interface type='bridge' name='{escape(bridge_name)}'>\n"
            "    <start mode='onboot'/>\n"
            f"    <mac address='{mac}'/>\n"
            "    <bridge stp='off' delay='15'>\n"
            f"      <interface type='ethernet' name='{escape(ifname)}'>\n"
            f"        <mac address='{mac}'/>\n"
            "      </interface>\n"
            "    </bridge>\n"
            "  </interface>\n")
    pool = (f"  <pool type='dir'>\n    <name>default</name>\n"
            f"    <target><path>{escape(pool_path)}</path></target>\n  </pool>\n"
            if pool_path else "")
    return (
        "<node>\n"
        f"  <!-- testflinger-magic lab host {escape(name)} ({kind}) -->\n"
        "  <cpu>\n"
        "    <mhz>2400</mhz>\n"
        "    <model>x86_64</model>\n"
        f"    <nodes>{numa_nodes}</nodes>\n"
        "    <sockets>1</sockets>\n"
        f"    <cores>{CPU_CORES_PER_SOCKET}</cores>\n"
        f"    <threads>{CPU_THREADS}</threads>\n"
        "  </cpu>\n"
        f"  <memory>{MEMORY_KIB_PER_NODE * numa_nodes}</memory>\n"
        # libvirt-daemon-system's /etc/libvirt/qemu/networks/default.xml: NAT with dnsmasq
        "  <network>\n"
        "    <name>default</name>\n"
        "    <bridge name='virbr0'/>\n"
        "    <forward mode='nat'/>\n"
        "    <ip address='192.168.122.1' netmask='255.255.255.0'>\n"
        "      <dhcp><range start='192.168.122.2' end='192.168.122.254'/></dhcp>\n"
        "    </ip>\n"
        "  </network>\n"
        + interfaces + pool +
        _domain_caps(vfio=vfio and iommu, ovmf=ovmf) +
        "  <device>\n"
        "    <name>computer</name>\n"
        "    <capability type='system'>\n"
        f"      <hardware><vendor>testflinger-magic lab</vendor><version>{escape(name)}</version>"
        f"<uuid>{host_id}</uuid></hardware>\n"
        "    </capability>\n"
        "  </device>\n"
        + "".join(devices) +
        "</node>\n")


def write_host_xml(path: str | os.PathLike, **kw) -> Path:
    """Write ``host_xml(**kw)`` to ``path`` atomically and return it as an absolute Path.

    Open it with ``libvirt.open("test://" + str(returned_path))`` (the path is absolute, so the
    URI has three slashes). Arguments as in ``host_xml``.
    """
    target = Path(path).absolute()
    text = host_xml(**kw)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, target)
    return target


def test_uri(path: str | os.PathLike) -> str:
    """The libvirt URI of a host file: ``test:///abs/path/host.xml``."""
    return "test://" + str(Path(path).absolute())


test_uri.__test__ = False  # not a pytest test despite the name
