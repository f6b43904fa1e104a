"""Can a host run passthrough VMs now? Pure checks over what libvirt reports.

``LibvirtSplitter.host_problems`` gathers the inputs (node devices, domain capabilities, host
interfaces, libvirt networks) and :func:`problems` says what is missing, one sentence each; an
empty list means ready. The ``agent-host check`` command shows the same list.

Sources of each signal:

- domain capabilities (``virConnectGetDomainCapabilities``,
  https://libvirt.org/formatdomaincaps.html):
  ``<os><enum name='firmware'>`` lists ``efi`` when the host has an OVMF firmware descriptor
  (libvirt >= 5.2; Ubuntu's ``ovmf`` package installs them), ``<os><loader><value>`` the
  firmware files; ``<devices><hostdev><enum name='pciBackend'>`` lists ``vfio`` only when the
  host can do VFIO passthrough (libvirt ``virHostdevHostSupportsPassthroughVFIO``: the IOMMU is
  on, ``/sys/kernel/iommu_groups`` is not empty, and ``/dev/vfio/vfio`` exists);
- node devices: a GPU without ``<iommuGroup>`` means the IOMMU is off (``pcidiscovery``);
  ``net`` node devices (``<capability type='net'><interface>NAME``) and libvirt interfaces name
  the host's network interfaces, bridges included;
- node devices' ``<driver><name>`` (libvirt's node device driver reads the sysfs ``driver``
  link: ``nodeDeviceUpdateDriverName``, ``src/node_device/node_device_driver.c``): a lendable
  GPU's function still bound to a host GPU driver (:data:`HOST_GPU_DRIVERS`) means the VM-host
  user data's vfio-pci binding has not taken effect (before its reboot, or an image that loads
  the driver anyway); libvirt's managed hostdev would then have to unbind ``nvidia`` from a GPU
  ``nvidia-persistenced`` holds open, which blocks or fails ("NVRM: ... non-zero usage count")
  when MAAS powers the VM on (agent_host/vmhost_userdata.py);
- libvirt networks: a bridge that belongs to a libvirt network with ``<forward mode='nat'>``
  (the ``default`` network of a fresh ``libvirt-daemon-system``, ``virbr0``), ``route`` or no
  forward at all is that network's private segment: a VM on it does not reach MAAS.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass, field


#: Host drivers that must not hold a GPU the daemon lends (agent_host/vmhost_userdata.py keeps
#: them off): NVIDIA's proprietary driver and nouveau.
HOST_GPU_DRIVERS = frozenset({"nvidia", "nouveau"})


@dataclass(frozen=True)
class DomainCaps:
    """What the checks read from a domain capabilities document: ``firmwares`` (the ``firmware``
    enum values, e.g. ``{"efi", "bios"}``), ``loaders`` (firmware file paths), ``pci_backends``
    (hostdev ``pciBackend`` values, e.g. ``{"default", "vfio"}``), ``domain`` (``kvm``),
    ``machine`` (``pc-q35-6.2``)."""

    firmwares: frozenset[str] = frozenset()
    loaders: tuple[str, ...] = ()
    pci_backends: frozenset[str] = frozenset()
    domain: str = ""
    machine: str = ""


def parse_domain_caps(xml: str) -> DomainCaps:
    """Read a ``<domainCapabilities>`` document; raises ValueError when it does not parse."""
    try:
        root = ET.fromstring(xml)
    except ET.ParseError as e:
        raise ValueError(f"domain capabilities do not parse: {e}") from e
    firmwares = frozenset(v.text.strip() for v in root.findall("os/enum[@name='firmware']/value")
                          if v.text)
    loaders = tuple(v.text.strip() for v in root.findall("os/loader/value") if v.text)
    hostdev = root.find("devices/hostdev")
    backends = frozenset()
    if hostdev is not None and hostdev.get("supported") != "no":
        backends = frozenset(v.text.strip() for v in
                             hostdev.findall("enum[@name='pciBackend']/value") if v.text)
    return DomainCaps(firmwares=firmwares, loaders=loaders, pci_backends=backends,
                      domain=root.findtext("domain", ""), machine=root.findtext("machine", ""))


@dataclass(frozen=True)
class HostFacts:
    """Inputs of :func:`problems`. ``domain_caps``: None when libvirt could not give them
    (``domain_caps_error`` says why); ``interfaces``: names of the host's network interfaces
    (net node devices and libvirt interfaces); ``networks``: libvirt networks as ``{name:
    {"bridge": str|None, "forward": str|None, "active": bool}}``; ``no_iommu``: addresses of GPUs
    without an IOMMU group; ``gpus``: how many GPUs would be lent; ``host_driver``: ``(address,
    driver)`` of each function of a lendable GPU bound to a driver of :data:`HOST_GPU_DRIVERS`
    (:func:`held_by_host_driver`)."""

    domain_caps: DomainCaps | None
    domain_caps_error: str | None = None
    interfaces: frozenset[str] = frozenset()
    networks: dict = field(default_factory=dict)
    no_iommu: tuple[str, ...] = ()
    gpus: int = 0
    host_driver: tuple[tuple[str, str], ...] = ()


def held_by_host_driver(discovery) -> tuple[tuple[str, str], ...]:
    """``(address, driver)`` of every function of a lendable GPU of ``discovery``
    (``pcidiscovery.Discovery``) whose bound driver is in :data:`HOST_GPU_DRIVERS`, sorted."""
    out = set()
    for gpu in discovery.lendable():
        for address in gpu.functions:
            dev = discovery.devices.get(address)
            if dev is not None and dev.driver in HOST_GPU_DRIVERS:
                out.add((address, dev.driver))
    return tuple(sorted(out))


def problems(facts: HostFacts, *, bridge: str | None, network: str | None = None,
             firmware: str | None = "uefi") -> list[str]:
    """What keeps the host from running passthrough VMs whose NIC joins ``bridge`` (or, when the
    operator configured one, libvirt network ``network``) with ``firmware`` (``uefi``/``bios``;
    None: do not check). Empty list: ready."""
    out = []
    if facts.no_iommu:
        out.append(f"IOMMU off: GPU(s) {', '.join(facts.no_iommu)} have no IOMMU group (boot "
                   "with intel_iommu=on, and enable VT-d/AMD-Vi in the firmware setup)")
    if facts.host_driver:
        held = ", ".join(f"{a} ({d})" for a, d in facts.host_driver)
        out.append(f"GPU(s) still bound to a host GPU driver: {held}; they must be on vfio-pci "
                   "before a lend: libvirt cannot take a GPU from nvidia while "
                   "nvidia-persistenced holds it open. The VM-host user data binds them to "
                   "vfio-pci and blacklists nvidia/nouveau at its reboot (not done yet?). "
                   "Expected on a host not deployed with that user data (e.g. an image for "
                   "the device's own GPU jobs): 'testflinger-magic agent-host user-data "
                   "--config FILE' prints it, to deploy the host with by hand before "
                   "'agent-host check'; on a host set up by hand: vfio-pci.ids=<vendor:device> "
                   "on the kernel command line, blacklist nvidia and nouveau, mask "
                   "nvidia-persistenced, reboot (docs/operator-guide.md)")
    if facts.gpus == 0:
        out.append("no GPU to lend on this host (see the refused devices)")
    caps = facts.domain_caps
    if caps is None:
        out.append(f"libvirt gives no domain capabilities for q35/kvm: "
                   f"{facts.domain_caps_error or 'unknown error'} (is qemu-kvm installed and "
                   "/dev/kvm present?)")
    else:
        if "vfio" not in caps.pci_backends:
            out.append("VFIO passthrough unavailable: domain capabilities list no 'vfio' PCI "
                       f"backend (have: {', '.join(sorted(caps.pci_backends)) or 'none'}); "
                       "the IOMMU must be on and the vfio-pci module loadable")
        if firmware == "uefi" and "efi" not in caps.firmwares:
            out.append("no UEFI firmware for q35: domain capabilities list no 'efi' firmware "
                       f"(loaders: {', '.join(caps.loaders) or 'none'}); install the ovmf "
                       "package")
    if bridge:
        owner = next((n for n, net in facts.networks.items() if net.get("bridge") == bridge),
                     None)
        if owner is not None and facts.networks[owner].get("forward") not in ("bridge",):
            mode = facts.networks[owner].get("forward") or "isolated"
            out.append(f"bridge {bridge} belongs to libvirt network {owner} (forward mode "
                       f"{mode}): VMs on it cannot PXE-boot from MAAS; use a bridge of the "
                       "host's MAAS network")
        elif bridge not in facts.interfaces:
            # MAAS' bridge_all name: canonical/maas src/maasserver/models/interface.py
            # Interface.get_default_bridge_name (br-<ifname>; over 15 characters b-<ifname>
            # without a leading "en", then b-<crc32 hex>-<last 6 characters of ifname>).
            out.append(f"bridge {bridge} not found on the host (a deploy with bridge_all "
                       "makes MAAS name its bridge br-<interface>, shortened when that is over "
                       "15 characters, e.g. enp193s0f0np0 -> b-p193s0f0np0; `agent-host check "
                       "--config FILE --device NAME` reads the name from MAAS)")
    elif network:
        net = facts.networks.get(network)
        if net is None:
            out.append(f"libvirt network {network} (splitter.network) does not exist")
        elif not net.get("active"):
            out.append(f"libvirt network {network} (splitter.network) is not active")
    else:
        out.append("no bridge for the VMs' NICs: a lend uses the bridge MAAS renders on the "
                   "deployed device's boot interface (bridge_all: br-<ifname>, or MAAS' "
                   "shortened name when over 15 characters); check a deployed "
                   "device with --config and --device, or name it with --bridge (or set the "
                   "config's bridge, or splitter.network for a libvirt network on purpose)")
    return out
