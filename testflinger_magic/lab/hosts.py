"""Multi-GPU hosts for libvirt's test driver (the embedded lab and the tests).

``write_host_xml`` writes a libvirt test-driver "custom node" document: the file a
``test:///<absolute path>`` URI opens (three slashes, then the absolute path; ``test://x/...``
would name a remote host). What libvirt 9.0's test driver reads from it (``testOpenParse`` in
libvirt's ``src/test/test_driver.c``): ``/node/cpu/{nodes,sockets,cores,threads,mhz,model}`` and
``/node/memory`` (KiB) for ``virNodeGetInfo``; ``/node/domain``, ``/node/network``,
``/node/pool`` (with ``/node/pool/volume``) and ``/node/device`` (node devices in libvirt's nodedev
XML format, kept as written: ``iommuGroup``, ``numa`` and ``class`` come back verbatim).

It does **not** build NUMA cells for capabilities from a file (only ``test:///default`` has them),
so ``getCapabilities()`` of a custom host shows no ``<cells>``; the splitter falls back to
``/node/cpu/nodes`` for the test driver (see ``libvirt_split``). Each connection opened on the file
starts from the file: nothing a connection changes is written back by libvirt.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path
from xml.sax.saxutils import escape

NVIDIA = "0x10de"
# Real NVIDIA IDs (pci.ids): GA100 [A100 SXM4 40GB] and its HD audio controller's class.
GPU_PRODUCT = ("0x20b0", "GA100 [A100 SXM4 40GB]")
AUDIO_PRODUCT = ("0x1aef", "GA102 High Definition Audio Controller")
VGA_CLASS = "0x030000"
CONTROLLER_3D_CLASS = "0x030200"
AUDIO_CLASS = "0x040300"

CPU_CORES_PER_SOCKET = 8
CPU_THREADS = 2
MEMORY_KIB_PER_NODE = 256 * 1024 * 1024  # 256 GiB per NUMA node
DEFAULT_POOL_PATH = "/var/lib/libvirt/images"


def gpu_address(index: int) -> str:
    """PCI address ("0000:BB:00.0") of GPU ``index`` on a generated host."""
    return f"0000:{0x01 + 0x10 * index:02x}:00.0"


def _pci_device(address: str, *, pci_class: str, vendor: tuple[str, str],
                product: tuple[str, str], group: int, group_members: list[str],
                numa_node: int | None, driver: str) -> str:
    dom, bus, rest = address.split(":")
    slot, function = rest.split(".")
    members = "".join(
        "        <address domain='0x{}' bus='0x{}' slot='0x{}' function='0x{}'/>\n".format(
            m.split(":")[0], m.split(":")[1], m.split(":")[2].split(".")[0],
            m.split(".")[1])
        for m in group_members)
    numa = f"    <numa node='{numa_node}'/>\n" if numa_node is not None else ""
    name = "pci_" + address.replace(":", "_").replace(".", "_")
    return (
        "  <device>\n"
        f"    <name>{name}</name>\n"
        f"    <path>/sys/devices/pci{dom}:00/{address}</path>\n"
        "    <parent>computer</parent>\n"
        f"    <driver><name>{driver}</name></driver>\n"
        "    <capability type='pci'>\n"
        f"      <class>{pci_class}</class>\n"
        f"      <domain>{int(dom, 16)}</domain>\n"
        f"      <bus>{int(bus, 16)}</bus>\n"
        f"      <slot>{int(slot, 16)}</slot>\n"
        f"      <function>{int(function, 16)}</function>\n"
        f"      <product id='{product[0]}'>{escape(product[1])}</product>\n"
        f"      <vendor id='{vendor[0]}'>{escape(vendor[1])}</vendor>\n"
        f"      <iommuGroup number='{group}'>\n{members}      </iommuGroup>\n"
        f"  {numa}"
        "    </capability>\n"
        "  </device>\n")


def host_xml(*, gpus: int = 8, numa_nodes: int = 2, gpu_audio_functions: bool = False,
             name: str = "gpu-host", pool_path: str = DEFAULT_POOL_PATH) -> str:
    """Return the custom node XML of a host with ``gpus`` NVIDIA GPUs over ``numa_nodes`` nodes.

    GPU ``i`` sits at ``gpu_address(i)``, alone in IOMMU group ``10 + i`` (or with an HD audio
    function ``.1`` of class 0x040300 when ``gpu_audio_functions``), on NUMA node
    ``i * numa_nodes // gpus``. Even GPUs have class 0x030200 (3D controller), odd ones 0x030000
    (VGA). Non-GPU PCI devices (a NIC and an NVMe controller, 0x8086) have their own groups. The
    host has ``numa_nodes * 8`` cores with 2 threads each, 256 GiB (in KiB) per node, a network
    ``default``, an active dir pool ``default`` at ``pool_path`` and a ``computer`` root device.
    Raises ValueError for gpus < 0 or numa_nodes < 1.
    """
    if gpus < 0 or numa_nodes < 1:
        raise ValueError(f"need gpus >= 0 and numa_nodes >= 1, got {gpus}, {numa_nodes}")
    devices = []
    for i in range(gpus):
        addr = gpu_address(i)
        audio = addr[:-1] + "1"
        members = [addr, audio] if gpu_audio_functions else [addr]
        node = i * numa_nodes // gpus
        pci_class = CONTROLLER_3D_CLASS if i % 2 == 0 else VGA_CLASS
        devices.append(_pci_device(addr, pci_class=pci_class, vendor=(NVIDIA, "NVIDIA Corporation"),
                                   product=GPU_PRODUCT, group=10 + i, group_members=members,
                                   numa_node=node, driver="vfio-pci"))
        if gpu_audio_functions:
            devices.append(_pci_device(audio, pci_class=AUDIO_CLASS,
                                       vendor=(NVIDIA, "NVIDIA Corporation"),
                                       product=AUDIO_PRODUCT, group=10 + i,
                                       group_members=members, numa_node=node,
                                       driver="vfio-pci"))
    intel = ("0x8086", "Intel Corporation")
    devices.append(_pci_device("0000:c1:00.0", pci_class="0x020000", vendor=intel,
                               product=("0x1592", "Ethernet Controller E810-C"), group=2,
                               group_members=["0000:c1:00.0"], numa_node=numa_nodes - 1,
                               driver="ice"))
    devices.append(_pci_device("0000:c2:00.0", pci_class="0x010802", vendor=intel,
                               product=("0x0a54", "NVMe Datacenter SSD"), group=3,
                               group_members=["0000:c2:00.0"], numa_node=0, driver="nvme"))
    return (
        "<node>\n"
        f"  <!-- testflinger-magic lab host {escape(name)} -->\n"
        "  <cpu>\n"
        "    <mhz>2400</mhz>\n"
        "    <model>x86_64</model>\n"
        f"    <nodes>{numa_nodes}</nodes>\n"
        "    <sockets>1</sockets>\n"
        f"    <cores>{CPU_CORES_PER_SOCKET}</cores>\n"
        f"    <threads>{CPU_THREADS}</threads>\n"
        "  </cpu>\n"
        f"  <memory>{MEMORY_KIB_PER_NODE * numa_nodes}</memory>\n"
        "  <network>\n"
        "    <name>default</name>\n"
        "    <bridge name='virbr0'/>\n"
        "    <forward mode='bridge'/>\n"
        "  </network>\n"
        "  <pool type='dir'>\n"
        "    <name>default</name>\n"
        f"    <target><path>{escape(pool_path)}</path></target>\n"
        "  </pool>\n"
        "  <device>\n"
        "    <name>computer</name>\n"
        "    <capability type='system'>\n"
        f"      <hardware><vendor>testflinger-magic lab</vendor><version>{escape(name)}</version>"
        f"<uuid>{uuid.uuid5(uuid.NAMESPACE_DNS, name + '.lab.invalid')}</uuid></hardware>\n"
        "    </capability>\n"
        "  </device>\n"
        + "".join(devices) +
        "</node>\n")


def write_host_xml(path: str | os.PathLike, *, gpus: int = 8, numa_nodes: int = 2,
                   gpu_audio_functions: bool = False, name: str = "gpu-host",
                   pool_path: str = DEFAULT_POOL_PATH) -> Path:
    """Write ``host_xml(...)`` to ``path`` atomically and return it as an absolute Path.

    Open it with ``libvirt.open("test://" + str(returned_path))`` (the path is absolute, so the
    URI has three slashes). Arguments as in ``host_xml``.
    """
    target = Path(path).absolute()
    text = host_xml(gpus=gpus, numa_nodes=numa_nodes, gpu_audio_functions=gpu_audio_functions,
                    name=name, pool_path=pool_path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, target)
    return target


def test_uri(path: str | os.PathLike) -> str:
    """The libvirt URI of a host file: ``test:///abs/path/host.xml``."""
    return "test://" + str(Path(path).absolute())


test_uri.__test__ = False  # not a pytest test despite the name
