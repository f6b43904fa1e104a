"""LibvirtSplitter: split a deployed multi-GPU device into one VM per GPU group, and undo it.

Effect code only; every decision (which GPUs, what XML, what is a conflict) is in ``splitplan``.
A domain is ours when its ``<metadata>`` holds ``<magic:lease id=... vm=...>`` in the namespace
``splitplan.LEASE_NS``; that is how ``restore`` finds what to undo after any crash.

Ordering, chosen so a crash at any point leaves something ``restore`` can find:
split = define (metadata recorded) -> create disk volume -> start; restore = destroy -> delete
disk volume -> undefine.

Concurrency: calls for one URI are serialised inside a process (a per-URI lock), so two leases
splitting one host never pick the same GPU. Across processes on a real host there is no lock; a
host is driven by one agent-host daemon.

libvirt's test driver (``test:///abs/path.xml``, see ``lab.hosts``) keeps its state per
connection and starts every connection from the file. For the test driver only, this module keeps
one connection per URI per process and, after each change, writes the domains (with their run
state) and storage volumes back into the file under an ``fcntl`` lock on ``<file>.lock``; a
process whose cached connection is older than the file reopens it. So a restarted daemon, or
another process, sees the same domains. (The cache is shared by all splitters of the process: the
``connect`` of whichever opened the URI last is the one in use.) ``test:///default`` has no file;
its one connection is kept open so libvirt does not forget its state.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import tempfile
import threading
import xml.etree.ElementTree as ET
from xml.sax.saxutils import escape
from typing import Callable, Iterator, Protocol

import libvirt

from testflinger_magic.agent_host.splitplan import (GPU, HostResources, SplitError, VMPlan,
                                                     VMResult, VMSpecDoesNotFit, assign,
                                                     check_domains, check_fit, discover_gpus,
                                                     domain_xml, gpus_of, numa_from_capabilities,
                                                     numa_from_nodeinfo, parse_domain,
                                                     pci_addresses, validate_plan)

__all__ = ["GPU", "LibvirtSplitter", "SplitError", "Splitter", "VMPlan", "VMResult",
           "VMSpecDoesNotFit"]

TEST_NS = "http://libvirt.org/schemas/domain/test/1.0"  # test driver's domain XML namespace
# virDomainState values the test driver reads from <test:runstate> (libvirt-domain.h)
_RUNNING, _SHUTOFF = libvirt.VIR_DOMAIN_RUNNING, libvirt.VIR_DOMAIN_SHUTOFF


class Splitter(Protocol):
    """The split driver interface of docs/architecture.md. All methods are idempotent and raise
    SplitError on failure."""

    def discover(self, uri: str) -> list[GPU]: ...

    def split(self, uri: str, lease_id: str, vms: list[VMPlan]) -> list[VMResult]: ...

    def restore(self, uri: str, lease_id: str, names: list[str] | None = None) -> None: ...

    def domains(self, uri: str, lease_id: str | None = None) -> list[str]: ...

    def gpus_free(self, uri: str) -> bool: ...


def test_driver_file(uri: str) -> str | None:
    """The host file of a test-driver URI (``test:///abs/path.xml`` -> ``/abs/path.xml``), None
    for other URIs and for ``test:///default`` (which libvirt shares in-process itself)."""
    m = re.fullmatch(r"test://(/[^?#]*)", uri)
    if not m or m.group(1) == "/default":
        return None
    return m.group(1)


test_driver_file.__test__ = False


# Process-wide: one lock and (test driver) one cached connection per URI.
_REGISTRY_LOCK = threading.Lock()
_URI_LOCKS: dict[str, threading.RLock] = {}
_TEST_CONNS: dict[str, tuple[libvirt.virConnect, str]] = {}  # uri -> (conn, file digest)


def _uri_lock(uri: str) -> threading.RLock:
    with _REGISTRY_LOCK:
        return _URI_LOCKS.setdefault(uri, threading.RLock())


class _Session:
    """One serialised use of a URI: ``conn``; set ``changed`` to have test-driver state saved."""

    def __init__(self, conn: libvirt.virConnect):
        self.conn = conn
        self.changed = False


def _lv(what: str, fn: Callable, *args):
    """Call libvirt, turning libvirtError into SplitError('<what>: <libvirt message>')."""
    try:
        return fn(*args)
    except libvirt.libvirtError as e:
        raise SplitError(f"{what}: {e.get_error_message() or e}") from e


class LibvirtSplitter:
    """Splitter over libvirt.

    ``connect(uri) -> virConnect`` (default ``libvirt.open``); ``vendor_ids``: GPU vendors to use
    (None: any display controller); ``network``/``bridge``: where each VM's NIC goes (bridge wins);
    ``emulator``: path put in ``<emulator>`` (None: libvirt's default); ``domain_type``: ``kvm``.
    """

    def __init__(self, connect: Callable[[str], libvirt.virConnect] = libvirt.open, *,
                 vendor_ids: set[str] | None = None, network: str = "default",
                 bridge: str | None = None, emulator: str | None = None,
                 domain_type: str = "kvm", test_pool_gib: float | None = None):
        self._connect = connect
        #: Pool capacity (GiB) assumed on ``test:///`` URIs (the test driver reports 100 GiB
        #: for every pool); None: use what the driver reports.
        self.test_pool_gib = test_pool_gib
        self.vendor_ids = vendor_ids
        self.network = network
        self.bridge = bridge
        self.emulator = emulator
        self.domain_type = domain_type

    # --- connection handling ---------------------------------------------------------------

    @contextlib.contextmanager
    def _session(self, uri: str) -> Iterator[_Session]:
        with _uri_lock(uri):
            if not uri.startswith("test:"):
                conn = _lv(f"{uri}: cannot connect", self._connect, uri)
                try:
                    yield _Session(conn)
                finally:
                    with contextlib.suppress(libvirt.libvirtError):
                        conn.close()
                return
            path = test_driver_file(uri)
            if path is None:
                # test:///default: libvirt shares it in-process but forgets it when the last
                # connection closes, so keep one open.
                if uri not in _TEST_CONNS:
                    _TEST_CONNS[uri] = (_lv(f"{uri}: cannot connect", self._connect, uri), "")
                yield _Session(_TEST_CONNS[uri][0])
                return
            with _file_lock(path):
                digest = _digest(path)
                cached = _TEST_CONNS.get(uri)
                if cached is None or cached[1] != digest:
                    # first use, or another process changed the file: start from the file
                    if cached is not None:
                        with contextlib.suppress(libvirt.libvirtError):
                            cached[0].close()
                    _TEST_CONNS.pop(uri, None)
                    conn = _lv(f"{uri}: cannot connect", self._connect, uri)
                    _TEST_CONNS[uri] = (conn, digest)
                session = _Session(_TEST_CONNS[uri][0])
                try:
                    yield session
                finally:
                    if session.changed:
                        _TEST_CONNS[uri] = (session.conn, _save_test_state(session.conn, path))

    # --- reads -----------------------------------------------------------------------------

    def _nodedevs(self, conn) -> list[str]:
        names = _lv("listing node devices", conn.listDevices, "pci", 0)
        return [_lv(f"node device {n}", lambda n=n: conn.nodeDeviceLookupByName(n).XMLDesc(0))
                for n in names]

    def _domains(self, conn) -> dict[str, tuple[libvirt.virDomain, str]]:
        out = {}
        for d in _lv("listing domains", conn.listAllDomains, 0):
            out[d.name()] = (d, _lv(f"domain {d.name()}: XMLDesc", d.XMLDesc, 0))
        return out

    def _numa(self, uri: str, conn) -> dict[int, list[int]] | None:
        numa = numa_from_capabilities(_lv("capabilities", conn.getCapabilities))
        if numa is None and uri.startswith("test:"):
            # The test driver has no capability cells for file hosts; its getInfo() does have
            # the node count. Real hosts without cells are single-node: no pinning.
            info = _lv("node info", conn.getInfo)
            numa = numa_from_nodeinfo(info[4], info[2])
        return numa

    def _resources(self, conn, gpus: list[GPU], vms: list[VMPlan],
                   uri: str = "") -> HostResources:
        """The host's totals for ``splitplan.check_fit``: ``getInfo()`` gives ``[model, memory
        MiB, cpus, mhz, nodes, sockets, cores, threads]``; the pool capacity (bytes) is the
        smallest of the pools holding the VMs' disk directories (None: no pool holds them).
        On a ``test:///`` URI with ``test_pool_gib`` set, that is assumed for each such pool
        instead: the test driver's own figure is a fixed 100 GiB, not the host XML's."""
        info = _lv("node info", conn.getInfo)
        assumed = self.test_pool_gib if uri.startswith("test:") else None
        capacities = []
        for directory in sorted({os.path.dirname(vm.disk_path) for vm in vms}):
            pool = _pool_for(conn, os.path.join(directory, "x"))
            if pool is not None:
                capacities.append(assumed * 2**30 if assumed is not None
                                  else _lv(f"pool {pool.name()}: info", pool.info)[1])
        return HostResources(cpus=int(info[2]), memory_mib=int(info[1]), gpus=len(gpus),
                             pool_gib=min(capacities) / 2**30 if capacities else None)

    def discover(self, uri: str) -> list[GPU]:
        """The host's GPUs with their IOMMU group functions and NUMA node, sorted by address."""
        with self._session(uri) as s:
            return discover_gpus(self._nodedevs(s.conn), self.vendor_ids)

    def domains(self, uri: str, lease_id: str | None = None) -> list[str]:
        """Sorted names of the domains carrying ``lease_id`` in our metadata; every domain on the
        host when ``lease_id`` is None."""
        with self._session(uri) as s:
            doms = self._domains(s.conn)
            return sorted(n for n, (_, xml) in doms.items()
                          if lease_id is None or parse_domain(xml).lease_id == lease_id)

    def gpus_free(self, uri: str) -> bool:
        """True when no defined domain (running or not, ours or not) holds any function of a
        GPU."""
        with self._session(uri) as s:
            gpus = discover_gpus(self._nodedevs(s.conn), self.vendor_ids)
            functions = {f for g in gpus for f in g.functions}
            return not any(functions.intersection(parse_domain(xml).hostdevs)
                           for _, xml in self._domains(s.conn).values())

    # --- split ----------------------------------------------------------------------------

    def split(self, uri: str, lease_id: str, vms: list[VMPlan]) -> list[VMResult]:
        """Define, give a disk and start one domain per VM plan; return them in plan order.

        Idempotent: a domain of that name carrying ``lease_id`` is kept (its GPUs too) and only
        started if needed. Raises VMSpecDoesNotFit (a SplitError blamed on the queue; nothing
        defined) when a VM can never fit this host (``splitplan.check_fit``: vCPUs, memory, disk,
        GPUs against the host's totals). Raises SplitError (nothing defined) when a name is taken
        by a domain of another lease or of nobody, a kept domain has another MAC, too few free
        GPUs, or ``splitplan.check_domains`` finds a conflict with any domain on the host;
        SplitError naming the domain when libvirt fails (what was done so far stays, marked, for
        ``restore``).
        """
        validate_plan(vms)
        with self._session(uri) as s:
            conn = s.conn
            nodedevs = self._nodedevs(conn)
            gpus = discover_gpus(nodedevs, self.vendor_ids)
            # Before anything is defined: libvirt would only fail at define/start, and that
            # failure would count against the device on every lent machine.
            check_fit(vms, self._resources(conn, gpus, vms, uri), uri)
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
            chosen = assign(gpus, todo, in_use)
            numa = self._numa(uri, conn)
            new = {vm.name: domain_xml(vm, chosen[vm.name], lease_id, numa, self.emulator,
                                       domain_type=self.domain_type, network=self.network,
                                       bridge=self.bridge) for vm in todo}
            check_domains(list(new.values()), [xml for _, xml in doms.values()],
                          pci_addresses(nodedevs))
            results = []
            for vm in vms:
                if vm.name in new:
                    s.changed = True
                    dom = _lv(f"domain {vm.name}: define", conn.defineXML, new[vm.name])
                else:
                    dom = doms[vm.name][0]
                if self._ensure_volume(conn, vm):
                    s.changed = True
                if not _lv(f"domain {vm.name}: isActive", dom.isActive):
                    s.changed = True
                    _lv(f"domain {vm.name}: start", dom.create)
                info = parse_domain(_lv(f"domain {vm.name}: XMLDesc", dom.XMLDesc, 0))
                results.append(VMResult(name=vm.name, domain=info.name, mac=vm.mac.lower(),
                                        gpus=gpus_of(info, gpus), disk=vm.disk_path))
            return results

    def _ensure_volume(self, conn, vm: VMPlan) -> bool:
        """Create the VM's qcow2 volume in the pool whose target is the disk's directory.
        No such pool: the lab provides the file itself. Returns True when it created one."""
        pool = _pool_for(conn, vm.disk_path)
        if pool is None:
            return False
        name = os.path.basename(vm.disk_path)
        # listVolumes, not a lookup that fails: libvirt prints every error on stderr.
        if name in _lv(f"pool {pool.name()}: list volumes", pool.listVolumes):
            return False
        # allocation 0: a sparse qcow2 (also what lets the test driver's fixed 100 GiB pool
        # hold many VMs' disks)
        xml = (f"<volume><name>{escape(name)}</name><capacity unit='GiB'>{vm.disk_gib}</capacity>"
               "<allocation>0</allocation><target><format type='qcow2'/></target></volume>")
        _lv(f"domain {vm.name}: create volume {vm.disk_path}", pool.createXML, xml, 0)
        return True

    # --- restore --------------------------------------------------------------------------

    def restore(self, uri: str, lease_id: str, names: list[str] | None = None) -> None:
        """Destroy, delete the pool volumes of, and undefine every domain carrying ``lease_id``
        (only those in ``names`` when given). Domains of other leases are never touched.
        Idempotent: nothing left is not an error. Raises SplitError naming the domain."""
        with self._session(uri) as s:
            conn = s.conn
            for name, (dom, xml) in sorted(self._domains(conn).items()):
                info = parse_domain(xml)
                if info.lease_id != lease_id or (names is not None and name not in names):
                    continue
                s.changed = True
                if _lv(f"domain {name}: isActive", dom.isActive):
                    _lv(f"domain {name}: destroy", dom.destroy)
                for disk in info.disks:
                    vol = _volume_by_path(conn, disk)
                    if vol is not None:
                        _lv(f"domain {name}: delete volume {disk}", vol.delete, 0)
                _lv(f"domain {name}: undefine", dom.undefine)


# --- helpers -----------------------------------------------------------------------------------

def _pool_for(conn, disk_path: str):
    directory = os.path.dirname(disk_path)
    for pool in _lv("listing storage pools", conn.listAllStoragePools, 0):
        target = ET.fromstring(pool.XMLDesc(0)).findtext("target/path")
        if target and os.path.normpath(target) == os.path.normpath(directory) and pool.isActive():
            return pool
    return None


def _volume_by_path(conn, path: str):
    pool = _pool_for(conn, path)
    if pool is None:
        return None
    name = os.path.basename(path)
    if name not in _lv(f"pool {pool.name()}: list volumes", pool.listVolumes):
        return None
    return _lv(f"volume {path}", pool.storageVolLookupByName, name)


@contextlib.contextmanager
def _file_lock(path: str) -> Iterator[None]:
    with open(path + ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _digest(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError as e:
        raise SplitError(f"{path}: cannot read test-driver host file: {e}") from e


def _save_test_state(conn, path: str) -> str:
    """Test driver only: rewrite ``path`` with the connection's domains and volumes; return the
    new file's digest. Called with the file lock held."""
    tree = ET.parse(path)
    root = tree.getroot()
    for el in root.findall("domain"):
        root.remove(el)
    pools = {p.findtext("name"): p for p in root.findall("pool")}
    for p in pools.values():
        for v in p.findall("volume"):
            p.remove(v)
    for pool in conn.listAllStoragePools(0):
        el = pools.get(pool.name())
        if el is not None and pool.isActive():
            for vol in pool.listAllVolumes(0):
                el.append(ET.fromstring(vol.XMLDesc(0)))
    # Domains go in as libvirt's own text: their metadata namespaces must stay declared on the
    # elements libvirt copies, which ElementTree would hoist to <node>.
    domains = []
    for dom in conn.listAllDomains(0):
        text = dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE).rstrip()
        state = _RUNNING if dom.isActive() else _SHUTOFF
        extra = f"  <test:runstate xmlns:test='{TEST_NS}'>{state}</test:runstate>\n"
        if not dom.isPersistent():
            extra += f"  <test:transient xmlns:test='{TEST_NS}'/>\n"
        domains.append(text[: -len("</domain>")] + extra + "</domain>\n")
    body = ET.tostring(root, encoding="unicode")
    body = body[: body.rindex("</node>")] + "".join(domains) + "</node>\n"
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".host-")
    with os.fdopen(fd, "w") as f:
        f.write(body)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return hashlib.sha256(body.encode()).hexdigest()
