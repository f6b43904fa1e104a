"""LibvirtSplitter: split a deployed multi-GPU device into one VM per GPU group, and undo it.

Effect code only; every decision (which GPUs, what XML, what is a conflict) is in ``splitplan``.
A domain is ours when its ``<metadata>`` holds ``<magic:lease id=... vm=...>`` in the namespace
``splitplan.LEASE_NS``; that is how ``restore`` finds what to undo after any crash.

Ordering, chosen so a crash at any point leaves something ``restore`` can find:
split = ensure the storage pool -> define (metadata recorded) -> create disk volume; restore =
destroy -> delete disk volume -> undefine (with its UEFI NVRAM file). Split does **not** start the
domains: MAAS powers each VM on to commission it (its virsh power driver, ``VirshSSH.poweron`` in
canonical/maas ``src/provisioningserver/drivers/power/virsh.py``, only runs ``start`` for a shut
off domain), and a VM started before MAAS knows its MAC PXE-boots into enlistment as a New
machine.

Host readiness (:meth:`LibvirtSplitter.host_problems`): MAAS marks a machine Deployed when
cloud-init asks for its user data (canonical/maas ``src/metadataserver/api.py``), before packages
install and before the reboot the user data asks for, so a host is only used once libvirt says it
can run passthrough VMs: GPUs in IOMMU groups, ``vfio`` among the domain capabilities'
``hostdev`` ``pciBackend`` values, ``efi`` among its firmware values (OVMF installed, libvirt
``docs/formatdomaincaps.rst``), and the VM bridge present (a ``net`` node device or a libvirt
interface of that name, not the bridge of a libvirt NAT network).

Disks: VM volumes live in a ``dir`` storage pool (``pool_name`` at ``pool_path``), created,
built, started and marked autostart when missing (``libvirt_pool``): a fresh Ubuntu
``libvirt-daemon-system`` has no storage pool at all.

Connections (``libvirt_session``): calls for one URI are serialised inside a process (a per-URI
lock), so two leases splitting one host never pick the same GPU; for libvirt's test driver
(``test:///abs/path.xml``, see ``lab.hosts``) the domains, with their run state, and the storage
volumes are written back into the host file after each change, so a restarted daemon, or another
process, sees the same domains.

What the test driver cannot do, and how it is covered (checked against libvirt 9.0's
``src/test/test_driver.c``): it has no ``connectGetDomainCapabilities`` (the call fails with
VIR_ERR_NO_SUPPORT), so for a ``test:///path`` URI the domain capabilities come from the host
file's ``<magic:domainCapabilities>`` element (namespace ``splitplan.TEST_HOST_NS``, written by
``lab.hosts`` as libvirt's QEMU driver would answer); and its ``virDomainUndefineFlags`` accepts
no ``VIR_DOMAIN_UNDEFINE_NVRAM``, so test-driver domains are undefined without it. Pools it
defines are written to the host file with the domains, so the next connection has them.
"""

from __future__ import annotations

import logging
import os
import xml.etree.ElementTree as ET
from typing import Callable, Protocol

import libvirt

from testflinger_magic.agent_host import hostready
from testflinger_magic.agent_host.libvirt_pool import (ensure_pool, ensure_volume, find_pool,
                                                       pool_for, volume_by_path)
from testflinger_magic.agent_host.libvirt_session import lv, session, test_driver_file
from testflinger_magic.agent_host.numaplace import (Cell, Placement, cells_from_capabilities,
                                                    cells_from_nodeinfo, place)
from testflinger_magic.agent_host.pcidiscovery import (DEFAULT_GPU_VENDORS, Discovery,
                                                       DiscoveryError, discover,
                                                       multi_gpu_problem)
from testflinger_magic.agent_host.splitplan import (GPU, TEST_HOST_NS, HostResources,
                                                     MultiGPUNeedsFabric, SplitError, VMPlan,
                                                     VMResult, VMSpecDoesNotFit, assign,
                                                     check_domains,
                                                     check_fit, domain_xml, gpus_of,
                                                     numa_needs, parse_domain, pci_addresses,
                                                     validate_plan)

log = logging.getLogger(__name__)

__all__ = ["GPU", "LibvirtSplitter", "SplitError", "Splitter", "VMPlan", "VMResult",
           "VMSpecDoesNotFit"]

DEFAULT_POOL_NAME = "testflinger-magic"
DEFAULT_POOL_PATH = "/var/lib/libvirt/images/testflinger-magic"


class Splitter(Protocol):
    """The split driver interface of docs/architecture.md. All methods are idempotent and raise
    SplitError on failure."""

    def discover(self, uri: str) -> list[GPU]: ...

    def split(self, uri: str, lease_id: str, vms: list[VMPlan]) -> list[VMResult]: ...

    def restore(self, uri: str, lease_id: str, names: list[str] | None = None) -> None: ...

    def domains(self, uri: str, lease_id: str | None = None) -> list[str]: ...

    def gpus_free(self, uri: str) -> bool: ...


class LibvirtSplitter:
    """Splitter over libvirt.

    ``connect(uri) -> virConnect`` (default ``libvirt.open``); ``vendor_ids``: vendors whose
    display controllers are GPUs (default NVIDIA; ``pcidiscovery``); ``bridge``: host bridge for
    VMs whose plan names none; ``network``: a libvirt network for VMs with no bridge at all, only
    when the operator sets one (None: such a VM is an error, never libvirt's NAT ``default``);
    ``pool_name``/``pool_path``: the ``dir`` storage pool for VM disks (created when missing);
    ``nvswitch_multi_gpu``: allow several GPUs per VM on NVSwitch hosts (refused otherwise,
    ``MultiGPUNeedsFabric``, blamed on the device's hardware). The splitter does nothing with NVIDIA Fabric
    Manager: it neither activates nor deactivates a partition and picks GPUs by NUMA node and
    address (``splitplan.assign``), not by Fabric Manager's partition table, so the operator's
    own tooling must activate the partition of exactly those GPUs before the VM starts
    (docs/operator-guide.md, "NVSwitch systems"); ``emulator``: path put in ``<emulator>``
    (None: libvirt's default); ``domain_type``: ``kvm``.
    """

    def __init__(self, connect: Callable[[str], libvirt.virConnect] = libvirt.open, *,
                 vendor_ids=DEFAULT_GPU_VENDORS, network: str | None = None,
                 bridge: str | None = None, emulator: str | None = None,
                 domain_type: str = "kvm", test_pool_gib: float | None = None,
                 pool_name: str = DEFAULT_POOL_NAME, pool_path: str = DEFAULT_POOL_PATH,
                 nvswitch_multi_gpu: bool = False):
        self._connect = connect
        #: Pool capacity (GiB) assumed on ``test:///`` URIs (the test driver reports 100 GiB
        #: for every pool); None: use what the driver reports.
        self.test_pool_gib = test_pool_gib
        self.vendor_ids = vendor_ids
        self.network = network
        self.bridge = bridge
        self.emulator = emulator
        self.domain_type = domain_type
        self.pool_name = pool_name
        self.pool_path = os.path.normpath(pool_path)
        self.nvswitch_multi_gpu = nvswitch_multi_gpu

    # --- connection handling ---------------------------------------------------------------

    def _session(self, uri: str):
        """``libvirt_session.session`` of ``uri`` with this splitter's ``connect``."""
        return session(uri, self._connect)

    # --- reads -----------------------------------------------------------------------------

    def _nodedevs(self, conn) -> list[str]:
        names = lv("listing node devices", conn.listDevices, "pci", 0)
        xmls = [lv(f"node device {n}", lambda n=n: conn.nodeDeviceLookupByName(n).XMLDesc(0))
                for n in names]
        path = test_driver_file(lv("connection URI", conn.getURI))
        if path is None:
            return xmls
        # libvirt's node device driver fills <driver><name> from the sysfs driver link at each
        # read (nodeDeviceUpdateDriverName, src/node_device/node_device_driver.c); the test
        # driver's XML parser drops it, so the host file says which driver is bound (lab.hosts).
        drivers = _file_drivers(path)
        return [_with_driver(x, drivers) for x in xmls]

    def _domains(self, conn) -> dict[str, tuple[libvirt.virDomain, str]]:
        out = {}
        for d in lv("listing domains", conn.listAllDomains, 0):
            out[d.name()] = (d, lv(f"domain {d.name()}: XMLDesc", d.XMLDesc, 0))
        return out

    def _cells(self, uri: str, conn) -> list[Cell] | None:
        """The host's NUMA cells (``numaplace``): from the capabilities' ``<cells>``; for
        libvirt's test driver, which builds none from a host file, from ``getInfo()``'s node
        count, CPUs and memory split evenly. Real hosts without cells are single-node: None,
        nothing is pinned."""
        cells = cells_from_capabilities(lv("capabilities", conn.getCapabilities))
        if cells is None and uri.startswith("test:"):
            info = lv("node info", conn.getInfo)
            cells = cells_from_nodeinfo(info[4], info[2], info[1])
        return cells

    def _resources(self, conn, gpus: list[GPU], vms: list[VMPlan],
                   uri: str = "") -> HostResources:
        """The host's totals for ``splitplan.check_fit``: ``getInfo()`` gives ``[model, memory
        MiB, cpus, mhz, nodes, sockets, cores, threads]``; the pool capacity (bytes) is the
        smallest of the pools holding the VMs' disk directories (None: no pool holds them).
        On a ``test:///`` URI with ``test_pool_gib`` set, that is assumed for each such pool
        instead: the test driver's own figure is a fixed 100 GiB, not the host XML's."""
        info = lv("node info", conn.getInfo)
        assumed = self.test_pool_gib if uri.startswith("test:") else None
        capacities = []
        for directory in sorted({os.path.dirname(vm.disk_path) for vm in vms}):
            pool = pool_for(conn, os.path.join(directory, "x"))
            if pool is not None:
                capacities.append(assumed * 2**30 if assumed is not None
                                  else lv(f"pool {pool.name()}: info", pool.info)[1])
        return HostResources(cpus=int(info[2]), memory_mib=int(info[1]), gpus=len(gpus),
                             pool_gib=min(capacities) / 2**30 if capacities else None)

    def _discovery(self, conn) -> Discovery:
        try:
            return discover(self._nodedevs(conn), self.vendor_ids)
        except DiscoveryError as e:
            raise SplitError(str(e)) from e

    def discover(self, uri: str) -> list[GPU]:
        """The host's lendable GPUs with the functions that go with each and their NUMA node,
        sorted by address (``pcidiscovery.discover``; refused devices are left out), GPUs that
        share an IOMMU group only with each other included (``Discovery.lendable``: a VM of
        enough GPUs takes such a group whole)."""
        with self._session(uri) as s:
            return self._discovery(s.conn).lendable()

    def inspect(self, uri: str) -> Discovery:
        """Everything discovery found: lendable GPUs, refused devices with reasons, NVSwitches."""
        with self._session(uri) as s:
            return self._discovery(s.conn)

    def host_problems(self, uri: str, bridge: str | None = None,
                      firmware: str | None = "uefi") -> list[str]:
        """Why the host cannot run passthrough VMs yet (module docstring, "Host readiness"):
        one sentence per problem, empty when ready. ``bridge``: the VMs' bridge (None: this
        splitter's ``bridge``); ``firmware``: the VMs' firmware (``uefi`` needs OVMF; None: not
        checked). Never raises for the host's state: libvirt not answering is a problem too."""
        try:
            facts = self.host_facts(uri)
        except SplitError as e:
            return [f"libvirt at {uri} does not answer: {e}"]
        return hostready.problems(facts, bridge=bridge or self.bridge, network=self.network,
                                  firmware=firmware)

    def host_facts(self, uri: str) -> hostready.HostFacts:
        """What ``hostready.problems`` needs, read from libvirt without changing anything.
        Raises SplitError when libvirt fails."""
        with self._session(uri) as s:
            conn = s.conn
            disc = self._discovery(conn)
            no_iommu = tuple(r.address for r in disc.refused if "no IOMMU group" in r.reason)
            caps, caps_error = None, None
            try:
                caps = hostready.parse_domain_caps(self._domain_caps(uri, conn))
            except (SplitError, ValueError) as e:
                caps_error = str(e)
            return hostready.HostFacts(domain_caps=caps, domain_caps_error=caps_error,
                                       interfaces=frozenset(self._interfaces(conn)),
                                       networks=self._networks(conn), no_iommu=no_iommu,
                                       gpus=len(disc.lendable()),
                                       host_driver=hostready.held_by_host_driver(disc))

    def pool_state(self, uri: str) -> dict:
        """The configured VM disk pool as it is now: ``{"name", "path", "exists", "active",
        "autostart"}`` (``name`` is the existing pool's at ``path`` if another name holds it).
        Read only."""
        with self._session(uri) as s:
            pool = find_pool(s.conn, self.pool_name, self.pool_path)
            if pool is None:
                return {"name": self.pool_name, "path": self.pool_path, "exists": False,
                        "active": False, "autostart": False}
            return {"name": pool.name(), "path": self.pool_path, "exists": True,
                    "active": bool(pool.isActive()), "autostart": bool(pool.autostart())}

    def _domain_caps(self, uri: str, conn) -> str:
        path = test_driver_file(uri)
        if path is None:
            return lv("domain capabilities (q35, x86_64)", conn.getDomainCapabilities,
                      None, "x86_64", "q35", self.domain_type, 0)
        # libvirt's test driver has no connectGetDomainCapabilities (VIR_ERR_NO_SUPPORT): the
        # host file says what the QEMU driver of that host would answer (lab.hosts).
        el = ET.parse(path).getroot().find(
            f"{{{TEST_HOST_NS}}}domainCapabilities/domainCapabilities")
        if el is None:
            raise SplitError(f"domain capabilities: test host file {path} has none "
                             f"(<domainCapabilities> in namespace {TEST_HOST_NS})")
        return ET.tostring(el, encoding="unicode")

    def _interfaces(self, conn) -> set[str]:
        names = set()
        for n in lv("listing net node devices", conn.listDevices, "net", 0):
            xml = lv(f"node device {n}", lambda n=n: conn.nodeDeviceLookupByName(n).XMLDesc(0))
            name = ET.fromstring(xml).findtext("capability[@type='net']/interface")
            if name:
                names.add(name)
        try:  # the interface driver may be absent (modular daemons without virtinterfaced)
            names.update(i.name() for i in conn.listAllInterfaces(0))
        except libvirt.libvirtError:
            pass
        return names

    def _networks(self, conn) -> dict:
        out = {}
        for net in lv("listing networks", conn.listAllNetworks, 0):
            root = ET.fromstring(lv(f"network {net.name()}", net.XMLDesc, 0))
            fwd = root.find("forward")
            br = root.find("bridge")
            out[net.name()] = {"bridge": br.get("name") if br is not None else None,
                               "forward": fwd.get("mode", "nat") if fwd is not None else None,
                               "active": bool(net.isActive())}
        return out

    def domains(self, uri: str, lease_id: str | None = None) -> list[str]:
        """Sorted names of the domains carrying ``lease_id`` in our metadata; every domain on the
        host when ``lease_id`` is None."""
        with self._session(uri) as s:
            doms = self._domains(s.conn)
            return sorted(n for n, (_, xml) in doms.items()
                          if lease_id is None or parse_domain(xml).lease_id == lease_id)

    def lease_domains(self, uri: str) -> dict[str, str]:
        """``{domain name: lease id}`` of every domain on the host carrying our lease
        metadata (``splitplan.LEASE_NS``); domains without it are not listed (the orphan
        sweep's view: agent_host/sweep.py)."""
        with self._session(uri) as s:
            out = {}
            for name, (_, xml) in self._domains(s.conn).items():
                lease_id = parse_domain(xml).lease_id
                if lease_id:
                    out[name] = lease_id
            return out

    def domain_holdings(self, uri: str) -> dict[str, tuple[str | None, set[str]]]:
        """``{domain name: (its lease id from our metadata or None, PCI addresses of its
        <hostdev>s)}`` of every defined domain (running or not, ours or not), in one read;
        ``agent-host check`` tells from it who holds the GPUs."""
        with self._session(uri) as s:
            out = {}
            for name, (_, xml) in self._domains(s.conn).items():
                parsed = parse_domain(xml)
                out[name] = (parsed.lease_id, set(parsed.hostdevs))
            return out

    def gpus_free(self, uri: str) -> bool:
        """True when no defined domain (running or not, ours or not) holds any function of a
        GPU."""
        with self._session(uri) as s:
            gpus = self._discovery(s.conn).lendable()
            functions = {f for g in gpus for f in g.functions}
            return not any(functions.intersection(parse_domain(xml).hostdevs)
                           for _, xml in self._domains(s.conn).values())

    def placement(self, uri: str, vms: list[VMPlan]) -> dict[str, tuple[list[GPU], Placement]]:
        """What a split of ``vms`` would give each VM now, without defining anything:
        ``{vm name: ([GPU], Placement)}`` (``splitplan.assign`` over the GPUs no domain holds,
        then ``numaplace.place`` on the host's cells). Raises SplitError when there are not
        enough free GPUs."""
        with self._session(uri) as s:
            conn = s.conn
            # Grouped GPUs too: assign gives a group only to a VM that can take it whole.
            gpus = self._discovery(conn).lendable()
            in_use = {a for _, xml in self._domains(conn).values()
                      for a in parse_domain(xml).hostdevs}
            chosen = assign(gpus, vms, in_use)
            placements = place(numa_needs(vms, chosen), self._cells(uri, conn))
            return {vm.name: (chosen[vm.name], placements[vm.name]) for vm in vms}

    def numa_cells(self, uri: str) -> list[Cell] | None:
        """The host's NUMA cells, as placement sees them (``_cells``); for ``agent-host
        check``'s overcommit warning (``numaplace.overcommitted``)."""
        with self._session(uri) as s:
            return self._cells(uri, s.conn)

    def fit(self, uri: str, vms: list[VMPlan]) -> None:
        """The fit rule ``split`` applies before defining anything, without changing anything:
        raises VMSpecDoesNotFit (``splitplan.check_fit`` on the host's totals, the message
        ``split`` would give) when ``vms`` can never fit the host at ``uri``; SplitError when
        libvirt fails. Used by ``agent-host check``."""
        with self._session(uri) as s:
            self._check_fit(s.conn, self._discovery(s.conn).lendable(), vms, uri)

    def _check_fit(self, conn, gpus: list[GPU], vms: list[VMPlan], uri: str) -> None:
        """``splitplan.check_fit`` of ``vms`` against this host's totals (``_resources``):
        the one fit rule of ``split`` and ``fit``."""
        check_fit(vms, self._resources(conn, gpus, vms, uri), uri)

    # --- split ----------------------------------------------------------------------------

    def split(self, uri: str, lease_id: str, vms: list[VMPlan]) -> list[VMResult]:
        """Ensure the disk pool, then define one domain per VM plan and create its disk volume;
        return them in plan order. Domains are left shut off: MAAS powers them on.

        Idempotent: a domain of that name carrying ``lease_id`` is kept (its GPUs and run state
        too). Each new domain's NUMA pinning comes from ``numaplace.place`` over the whole
        lease: memory strict on a cell only while the cell holds every VM bound to it.

        Raises VMSpecDoesNotFit (a SplitError blamed on the queue; nothing defined) when a
        VM can never fit this host (``splitplan.check_fit``: vCPUs, memory, disk, GPUs against
        the host's totals) and MultiGPUNeedsFabric (blamed on the hardware; nothing defined)
        for several GPUs per VM on an NVSwitch host without ``nvswitch_multi_gpu``. Raises
        SplitError (nothing defined) when a name is taken by a domain of another lease or of
        nobody, a kept domain has another MAC, too few free GPUs (naming the refused devices),
        a VM without bridge or network, a disk outside the pool, or
        ``splitplan.check_domains`` finds a conflict with any domain on the host; SplitError
        naming the domain when libvirt fails (what was done so far stays, marked, for
        ``restore``).
        """
        validate_plan(vms)
        with self._session(uri) as s:
            conn = s.conn
            nodedevs = self._nodedevs(conn)
            disc = self._discovery(conn)
            # Every GPU some VM can take: assign (splitplan) keeps a shared IOMMU group whole
            # in one VM of enough GPUs and never gives it to a smaller one.
            gpus = disc.lendable()
            for per_vm in sorted({vm.gpu_count for vm in vms}):
                problem = multi_gpu_problem(disc, per_vm, self.nvswitch_multi_gpu)
                if problem:
                    raise MultiGPUNeedsFabric(f"{uri}: {problem}", len(disc.nvswitches))
            outside = sorted(vm.disk_path for vm in vms
                             if os.path.normpath(os.path.dirname(vm.disk_path)) != self.pool_path)
            if outside:
                raise SplitError(f"VM disk(s) {', '.join(outside)} are not in the storage pool "
                                 f"directory {self.pool_path} (splitter.pool_path)")
            if ensure_pool(conn, self.pool_name, self.pool_path):
                s.changed = True
            # Before anything is defined: libvirt would only fail at define/start, and that
            # failure would count against the device on every lent machine.
            self._check_fit(conn, gpus, vms, uri)
            doms = self._domains(conn)
            kept = {}
            for vm in vms:
                if vm.name not in doms:
                    continue
                info = parse_domain(doms[vm.name][1])
                if info.lease_id != lease_id:
                    owner = f"lease {info.lease_id}" if info.lease_id else "no lease"
                    raise SplitError(f"domain {vm.name}: already exists and belongs to {owner}, "
                                     f"not {lease_id}")
                if vm.mac.lower() not in info.macs:
                    raise SplitError(f"domain {vm.name}: exists for {lease_id} with MAC(s) "
                                     f"{list(info.macs)}, plan says {vm.mac}")
                kept[vm.name] = info
            todo = [vm for vm in vms if vm.name not in kept]
            in_use = {a for _, xml in doms.values() for a in parse_domain(xml).hostdevs}
            try:
                chosen = assign(gpus, todo, in_use)
            except SplitError as e:
                refusals = disc.refused_for(max((vm.gpu_count for vm in vms), default=1))
                if not refusals:
                    raise
                refused = "\n".join(f"  {r.address}: {r.reason}" for r in refusals)
                raise SplitError(f"{e}\nrefused devices:\n{refused}") from e
            held = {**chosen, **{n: [g for g in gpus if g.address in info.hostdevs]
                                 for n, info in kept.items()}}
            # NUMA placement of the whole lease, kept domains included: a cell's memory must
            # hold every VM strictly bound to it (numaplace; libvirt's test driver never
            # enforces numatune, real VFIO guests do not start without it).
            placements = place(numa_needs(vms, held), self._cells(uri, conn))
            new = {vm.name: domain_xml(vm, chosen[vm.name], lease_id, placements[vm.name],
                                       self.emulator,
                                       domain_type=self.domain_type, network=self.network,
                                       bridge=self.bridge) for vm in todo}
            check_domains(list(new.values()), [xml for _, xml in doms.values()],
                          pci_addresses(nodedevs))
            results = []
            for vm in vms:
                if vm.name in new:
                    s.changed = True
                    dom = lv(f"domain {vm.name}: define", conn.defineXML, new[vm.name])
                else:
                    dom = doms[vm.name][0]
                if ensure_volume(conn, vm):
                    s.changed = True
                info = parse_domain(lv(f"domain {vm.name}: XMLDesc", dom.XMLDesc, 0))
                results.append(VMResult(name=vm.name, domain=info.name, mac=vm.mac.lower(),
                                        gpus=gpus_of(info, gpus), disk=vm.disk_path))
            return results

    # --- restore --------------------------------------------------------------------------

    def restore(self, uri: str, lease_id: str, names: list[str] | None = None) -> None:
        """Destroy, delete the pool volumes of, and undefine (NVRAM included) every domain
        carrying ``lease_id`` (only those in ``names`` when given). Only volumes inside
        ``pool_path`` are deleted (split puts disks nowhere else). Domains of other leases are
        never touched. Idempotent: nothing left is not an error. Raises SplitError naming the
        domain."""
        with self._session(uri) as s:
            conn = s.conn
            for name, (dom, xml) in sorted(self._domains(conn).items()):
                info = parse_domain(xml)
                if info.lease_id != lease_id or (names is not None and name not in names):
                    continue
                s.changed = True
                if lv(f"domain {name}: isActive", dom.isActive):
                    lv(f"domain {name}: destroy", dom.destroy)
                for disk in info.disks:
                    if os.path.normpath(os.path.dirname(disk)) != self.pool_path:
                        # split puts disks only there; anything else is not a volume we made
                        log.warning("domain %s: disk %s is outside the pool directory %s: "
                                    "its volume is left alone", name, disk, self.pool_path)
                        continue
                    vol = volume_by_path(conn, disk)
                    if vol is not None:
                        lv(f"domain {name}: delete volume {disk}", vol.delete, 0)
                if uri.startswith("test:"):
                    # the test driver accepts no VIR_DOMAIN_UNDEFINE_NVRAM (module docstring)
                    lv(f"domain {name}: undefine", dom.undefine)
                else:
                    # A UEFI domain has an NVRAM file; the QEMU driver refuses to undefine it
                    # without this flag (qemuDomainUndefineFlags: "cannot undefine domain
                    # with nvram"), and the flag is harmless without one.
                    lv(f"domain {name}: undefine", dom.undefineFlags,
                       libvirt.VIR_DOMAIN_UNDEFINE_NVRAM)


def _file_drivers(path: str) -> dict[str, str]:
    """``{node device name: driver}`` of a test-driver host file's ``<device>`` elements that
    carry ``<driver><name>`` (lab.hosts writes what the real host would report)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        raise SplitError(f"test host file {path}: {e}") from e
    return {d.findtext("name"): d.findtext("driver/name") for d in root.findall("device")
            if d.findtext("driver/name")}


def _with_driver(xml: str, drivers: dict[str, str]) -> str:
    """Node device ``xml`` with the ``<driver><name>`` of ``drivers`` for its name, when libvirt
    gave none."""
    root = ET.fromstring(xml)
    name = root.findtext("name")
    if root.find("driver") is not None or name not in drivers:
        return xml
    el = ET.Element("driver")
    ET.SubElement(el, "name").text = drivers[name]
    root.insert(2, el)
    return ET.tostring(root, encoding="unicode")
