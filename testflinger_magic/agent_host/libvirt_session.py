"""libvirt sessions of the agent host's splitter: one serialised use of a URI at a time,
libvirt errors as ``SplitError``, and the test driver's state kept in its host file.

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

``libvirt_split.LibvirtSplitter`` does all its libvirt work in a ``session``; the lab's virsh
power driver (``lab.virsh_power``) does too, so what it does to a domain is saved to the host file
the daemon's splitter reads. What else the test driver cannot do is in the ``libvirt_split``
module docstring.
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
from typing import Callable, Iterator

import libvirt

from testflinger_magic.agent_host.splitplan import TEST_HOST_NS, SplitError

TEST_NS = "http://libvirt.org/schemas/domain/test/1.0"  # test driver's domain XML namespace
ET.register_namespace("magic", TEST_HOST_NS)  # keep the lab host files readable when saved
# virDomainState values the test driver reads from <test:runstate> (libvirt-domain.h)
_RUNNING, _SHUTOFF = libvirt.VIR_DOMAIN_RUNNING, libvirt.VIR_DOMAIN_SHUTOFF


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


class Session:
    """One serialised use of a URI: ``conn``; set ``changed`` to have test-driver state saved."""

    def __init__(self, conn: libvirt.virConnect):
        self.conn = conn
        self.changed = False


def lv(what: str, fn: Callable, *args):
    """Call libvirt, turning libvirtError into SplitError('<what>: <libvirt message>')."""
    try:
        return fn(*args)
    except libvirt.libvirtError as e:
        raise SplitError(f"{what}: {e.get_error_message() or e}") from e


@contextlib.contextmanager
def session(uri: str, connect: Callable[[str], libvirt.virConnect] = libvirt.open
            ) -> Iterator[Session]:
    """One serialised use of ``uri`` (module docstring): yields a ``Session`` on a connection
    opened with ``connect`` (a cached one for the test driver); when the caller set
    ``changed``, a test-driver host file is rewritten with the connection's state. Raises
    SplitError when libvirt cannot connect or the host file cannot be read."""
    with _uri_lock(uri):
        if not uri.startswith("test:"):
            conn = lv(f"{uri}: cannot connect", connect, uri)
            try:
                yield Session(conn)
            finally:
                with contextlib.suppress(libvirt.libvirtError):
                    conn.close()
            return
        path = test_driver_file(uri)
        if path is None:
            # test:///default: libvirt shares it in-process but forgets it when the last
            # connection closes, so keep one open.
            if uri not in _TEST_CONNS:
                _TEST_CONNS[uri] = (lv(f"{uri}: cannot connect", connect, uri), "")
            yield Session(_TEST_CONNS[uri][0])
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
                conn = lv(f"{uri}: cannot connect", connect, uri)
                _TEST_CONNS[uri] = (conn, digest)
            used = Session(_TEST_CONNS[uri][0])
            try:
                yield used
            finally:
                if used.changed:
                    _TEST_CONNS[uri] = (used.conn, save_test_state(used.conn, path))


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


def save_test_state(conn, path: str) -> str:
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
        if el is None:
            # defined by us (split's pool): the test driver reads /node/pool as active pools
            el = pools[pool.name()] = ET.fromstring(pool.XMLDesc(0))
            root.append(el)
        if pool.isActive():
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
