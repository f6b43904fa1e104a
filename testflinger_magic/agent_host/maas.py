"""The agent-host daemon's MAAS driver: a narrow interface over python-libmaas.

``MaasDriver`` is the interface the lease steps use (docs/architecture.md, "Agent-host
drivers"); ``LibMaasDriver`` implements it with python-libmaas against a real MAAS (or the lab's
simulator). Statuses are MAAS ``status_name`` strings (``"Ready"``, ``"Deployed"``,
``"Failed deployment"``...).

python-libmaas quirks hidden here (none leaks to callers):

- Its functions are wrapped by ``maas.client.utils.maas_async.asynchronous``, which calls
  ``asyncio.get_event_loop()`` and fails in any thread without a loop ("There is no current
  event loop"). All libmaas work therefore runs as coroutines on ONE private event loop thread;
  callers from any thread submit to it and block on the result.
- ``maas.client.viscera.version`` imports ``distutils``, which Python >= 3.12 only has through
  setuptools: an ImportError becomes a ``MaasError`` saying so.
- A ``str`` ``user_data`` is taken as already base64-encoded by libmaas; this driver takes raw
  cloud-config (str or bytes) and encodes it, as the MAAS API requires base64
  (MAAS API reference, ``POST machines/{system_id}/?op=deploy``, ``user_data``).
- Its exceptions (``CallError``, ``RemoteError``, aiohttp and socket errors) become the
  ``MaasError`` family below. The API key is never logged nor put in an error message.
"""

from __future__ import annotations

import abc
import asyncio
import base64
import logging
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from testflinger_magic.agent_host import maas_status as st
from testflinger_magic.agent_host.maas_watch import StatusWatch

log = logging.getLogger(__name__)

# MAAS statuses (one table with MAAS' sources: maas_status.py).
DEPLOYING_OR_DEPLOYED = st.DEPLOYING_OR_DEPLOYED
# MAAS statuses from which "release" is legal (maasserver/models/node.py RELEASABLE_STATUSES).
RELEASABLE = st.RELEASABLE
# Statuses in which release has nothing to do (already released or on its way).
RELEASED_OR_RELEASING = st.RELEASED_OR_RELEASING


class MaasError(Exception):
    """A MAAS operation failed. ``system_id``/``status``/``status_message`` when known."""

    def __init__(self, message: str, *, system_id: str | None = None,
                 status: str | None = None, status_message: str | None = None):
        super().__init__(message)
        self.system_id = system_id
        self.status = status
        self.status_message = status_message


class MaasUnreachable(MaasError):
    """MAAS could not be reached (connection refused/reset, timeout, HTTP 502/503/504)."""


class MaasTimeout(MaasError):
    """``wait_for`` ran out of time before the machine reached a wanted status."""


class MaasAuthError(MaasError):
    """MAAS rejected the API key (HTTP 401/403)."""


class MaasNotFound(MaasError):
    """No such machine (HTTP 404)."""


class MaasConflict(MaasError):
    """MAAS refused the operation in the machine's current state (HTTP 409), or a hostname is
    taken by a machine with another MAC."""


@dataclass(frozen=True)
class MachineInfo:
    """A MAAS machine as the daemon needs it. ``status`` is MAAS' ``status_name``;
    ``ip_addresses`` a tuple of strings; ``status_message`` MAAS' last event text (may be "").
    ``macs`` the MAC addresses of its non-bridge interfaces (lower case). ``bridges`` the names of
    its bridge interfaces (those MAAS creates for ``bridge_all``: maasserver/models/interface.py
    ``create_acquired_bridge``, named ``get_default_bridge_name()``, e.g. ``br-eth0``), the one
    on the boot interface first. ``description``: the machine's free text (the daemon marks the
    VMs it creates there: ``marks.maas_mark``)."""

    system_id: str
    hostname: str
    status: str
    ip_addresses: tuple[str, ...]
    power_type: str
    status_message: str = ""
    macs: tuple[str, ...] = ()
    bridges: tuple[str, ...] = ()
    description: str = ""

    @classmethod
    def from_json(cls, data: dict) -> "MachineInfo":
        """Build from a MAAS machine document (``GET machines/{system_id}/``)."""
        interfaces = list(data.get("interface_set") or ())
        boot = (data.get("boot_interface") or {}).get("name")
        bridges = [i for i in interfaces if i.get("type") == "bridge"]
        bridges.sort(key=lambda i: boot not in (i.get("parents") or ()))
        return cls(
            system_id=data["system_id"], hostname=data.get("hostname") or "",
            status=data.get("status_name") or "", ip_addresses=tuple(data.get("ip_addresses")
                                                                       or ()),
            power_type=data.get("power_type") or "",
            status_message=data.get("status_message") or "",
            macs=tuple((i.get("mac_address") or "").lower() for i in interfaces
                       if i.get("type") != "bridge"),
            bridges=tuple(i.get("name") or "" for i in bridges),
            description=data.get("description") or "",
        )


class Interrupted(Exception):
    """A wait was abandoned because its caller asked to stop (``should_stop`` became true).

    Not a ``MaasError``: nothing failed. The daemon raises it out of a step when it is being
    stopped; the step is resumed from the server's state at the next start.
    """


def _stop_check(should_stop):
    """``should_stop`` (None, a ``threading.Event`` or a no-argument callable) as
    ``(is_set() -> bool, wait(seconds) -> None)``: waiting returns early once it is set."""
    if should_stop is None:
        return (lambda: False), time.sleep
    if isinstance(should_stop, threading.Event):
        return should_stop.is_set, should_stop.wait
    return should_stop, time.sleep


class MaasDriver(abc.ABC):
    """What the lease steps need from MAAS. Every operation is idempotent as documented, may
    raise ``MaasUnreachable``/``MaasAuthError``, and is safe to call from any thread."""

    @abc.abstractmethod
    def deploy(self, system_id: str, series: str, user_data: str | bytes | None = None, *,
               bridge_all: bool = False, bridge_stp: bool | None = None,
               bridge_fd: int | None = None) -> MachineInfo:
        """Start deploying ``system_id`` with Ubuntu ``series`` (raw cloud-config
        ``user_data``). No-op if already Deploying/Deployed; allocates a Ready machine first.
        Raises ``MaasConflict`` in other statuses (e.g. Failed deployment: release first).

        ``bridge_all`` (with ``bridge_stp``/``bridge_fd``, seconds): MAAS puts a bridge on every
        configured interface and renders it in the deployed netplan with the interface's
        address (MAAS API ``allocate``/``deploy`` parameters, read by maasserver/api/machines.py
        ``get_allocation_options``). MAAS creates the bridges when it ALLOCATES the machine
        (``Node.acquire``), so they are sent with the allocation; a machine already Allocated
        without them is deployed without bridges."""

    @abc.abstractmethod
    def machine(self, system_id: str) -> MachineInfo:
        """Current state of ``system_id``; ``MaasNotFound`` if MAAS has no such machine."""

    @abc.abstractmethod
    def wait_for(self, system_id: str, want: set[str], fail: set[str], timeout: float,
                 poll: float = 10.0, should_stop=None) -> MachineInfo:
        """Poll every ``poll`` seconds until the status is in ``want`` (return it); raise
        ``MaasError`` (naming machine, status, status_message) if it is in ``fail``,
        ``MaasTimeout`` after ``timeout`` seconds. ``should_stop`` (a ``threading.Event`` or a
        callable returning bool) is checked before every read and wakes the pause between
        polls: once true, ``Interrupted`` is raised within one MAAS call."""

    @abc.abstractmethod
    def release(self, system_id: str) -> MachineInfo:
        """Release ``system_id``; no-op if already Ready/Releasing. ``MaasNotFound`` if gone."""

    @abc.abstractmethod
    def create_vm_machine(self, hostname: str, mac: str, power_address: str, power_id: str,
                          architecture: str = "amd64/generic", power_pass: str | None = None,
                          description: str | None = None) -> str:
        """Enrol a VM (power type ``virsh``; MAAS commissions it, powering the domain
        ``power_id`` on through ``power_address``, a plain ``qemu+ssh://user@host/system``, and
        ``power_pass`` if given) with ``description`` (the daemon's mark; MAAS' admin create
        form takes it: maasserver/forms/__init__.py ``AdminMachineForm``); returns its
        system_id. If a machine with this MAC, or this
        hostname and MAC, exists, returns it instead; a hostname held by another MAC raises
        ``MaasConflict``."""

    @abc.abstractmethod
    def mark_broken(self, system_id: str, comment: str = "") -> MachineInfo:
        """Mark ``system_id`` Broken (MAAS releases a releasable machine first)."""

    @abc.abstractmethod
    def mark_fixed(self, system_id: str, comment: str = "") -> MachineInfo:
        """Mark a Broken ``system_id`` fixed (Ready, or Deployed if it was); ``MaasConflict``
        if it is not Broken."""

    @abc.abstractmethod
    def power_off(self, system_id: str) -> MachineInfo:
        """Ask MAAS to power ``system_id`` off (a Releasing machine then becomes Ready)."""

    @abc.abstractmethod
    def events(self, system_id: str, limit: int = 10, level: str = "INFO") -> list[dict]:
        """The machine's latest events, newest first, at ``level`` or above: MAAS' event
        documents (``GET events/?op=query``: ``type``, ``description``, ``level``,
        ``created``...). A failed power action shows here with the power driver's error."""

    @abc.abstractmethod
    def assign_static_ip(self, system_id: str, subnet: int | str | None = None) -> str:
        """Give the boot interface of ``system_id`` a STATIC address and return it (a string).

        Unlike an AUTO address (given at each deploy, possibly a different one), a STATIC link
        keeps its address across release and deploy, so it can be a VM agent's ``device_ip``
        (TESTFLINGER.md §5.3-5.4). Idempotent: an existing STATIC link's address is returned.
        ``subnet`` (id or CIDR; None: the first subnet MAAS lists on the boot interface's VLAN)
        is where the address comes from; MAAS picks a free one. The machine must be Ready,
        Allocated or Broken to be linked (else ``MaasConflict``). Errors are ``MaasError`` naming
        the machine and the interface."""

    @abc.abstractmethod
    def find_by_hostname(self, hostname: str) -> str | None:
        """system_id of the machine named ``hostname`` (short name), or None."""

    @abc.abstractmethod
    def delete(self, system_id: str) -> None:
        """Delete ``system_id`` from MAAS; a missing machine is fine."""

    @abc.abstractmethod
    def list_machines(self, hostname_prefix: str = "") -> list[MachineInfo]:
        """All machines whose hostname starts with ``hostname_prefix``."""


def static_address(interface: dict) -> str | None:
    """The address of the first STATIC link of a MAAS interface document, or None.

    Link modes are MAAS' INTERFACE_LINK_TYPE values, lower case in documents (python-libmaas
    ``LinkMode``)."""
    for link in interface.get("links") or ():
        if (link.get("mode") or "").lower() == "static" and link.get("ip_address"):
            return link["ip_address"]
    return None


def pick_subnet(subnets: list[dict], vlan: dict | None, wanted: int | str | None = None
                ) -> dict | None:
    """The subnet document to link to: ``wanted`` (id, or CIDR/name), else the first subnet on
    ``vlan`` (the interface's VLAN document), else the first subnet listed. None if nothing fits.

    ``subnets`` are MAAS subnet documents (``GET subnets/``: ``id``, ``cidr``, ``name``,
    ``vlan.id``)."""
    if wanted is not None:
        for sn in subnets:
            if str(wanted) in (str(sn.get("id")), sn.get("cidr"), sn.get("name")):
                return sn
        return None
    vlan_id = (vlan or {}).get("id")
    on_vlan = [sn for sn in subnets if vlan_id is not None
               and (sn.get("vlan") or {}).get("id") == vlan_id]
    return (on_vlan or subnets or [None])[0]


def _wait_loop(read, system_id, want, fail, timeout, poll, clock=time.monotonic,
               sleep=None, should_stop=None) -> MachineInfo:
    """``wait_for`` logic on a ``read(system_id) -> MachineInfo``. Transient
    ``MaasUnreachable`` is retried until the deadline, then re-raised. ``should_stop``: see
    ``MaasDriver.wait_for`` (``Interrupted``); ``sleep`` replaces the pause (tests)."""
    stopping, pause = _stop_check(should_stop)
    if sleep is not None:
        pause = sleep
    deadline = clock() + timeout

    def check_stop():
        if stopping():
            raise Interrupted(f"stopped while waiting for MAAS machine {system_id} to be "
                              f"{'/'.join(sorted(want))}")

    unreachable = False
    while True:
        check_stop()
        try:
            info = read(system_id)
        except MaasUnreachable as exc:
            if clock() >= deadline:
                raise
            if not unreachable:  # once per outage: a wait that seems stuck says why
                log.warning("MAAS unreachable while waiting for machine %s (%s); retrying "
                            "every %gs for up to %.0fs more", system_id, exc, poll,
                            max(0.0, deadline - clock()))
                unreachable = True
            pause(poll)
            continue
        if unreachable:
            log.info("MAAS reachable again while waiting for machine %s", system_id)
            unreachable = False
        if info.status in want:
            return info
        if info.status in fail:
            raise MaasError(
                f"MAAS machine {info.hostname} ({system_id}) is {info.status!r}"
                f"{': ' + info.status_message if info.status_message else ''}",
                system_id=system_id, status=info.status, status_message=info.status_message)
        if clock() >= deadline:
            raise MaasTimeout(
                f"MAAS machine {info.hostname} ({system_id}) still {info.status!r} after "
                f"{timeout:g}s waiting for {sorted(want)}"
                f"{': ' + info.status_message if info.status_message else ''}",
                system_id=system_id, status=info.status, status_message=info.status_message)
        pause(min(poll, max(0.0, deadline - clock())))


class _LoopThread:
    """One private asyncio event loop on a daemon thread; ``run(coro)`` from any thread."""

    def __init__(self, name: str):
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def _ensure(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._loop.is_closed():
                loop = asyncio.new_event_loop()
                ready = threading.Event()

                def main():
                    asyncio.set_event_loop(loop)
                    loop.call_soon(ready.set)
                    try:
                        loop.run_forever()
                    finally:
                        loop.close()

                threading.Thread(target=main, name=self._name, daemon=True).start()
                ready.wait()
                self._loop = loop
            return self._loop

    def run(self, coro, timeout: float):
        """Run ``coro`` on the loop and return its result (re-raising its exception)."""
        future = asyncio.run_coroutine_threadsafe(coro, self._ensure())
        try:
            return future.result(timeout)
        except FutureTimeout:
            future.cancel()
            raise

    def close(self) -> None:
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(loop.stop)  # the loop thread then closes it


class LibMaasDriver(MaasDriver):
    """``MaasDriver`` over python-libmaas' bones layer (the raw MAAS 2.0 handlers as listed by
    ``describe/``), reached with ``maas.client.viscera.Origin.connect`` (what
    ``maas.client.connect`` does).

    ``url``: MAAS URL, e.g. ``http://maas:5240/MAAS/`` (``api/2.0/`` is added by libmaas).
    ``apikey``: ``consumer:token:secret`` (``ValueError`` if malformed; never logged).
    ``request_timeout``: seconds per HTTP call before ``MaasUnreachable``.
    """

    def __init__(self, url: str, apikey: str, *, request_timeout: float = 30):
        if not isinstance(apikey, str) or apikey.count(":") != 2 or not all(apikey.split(":")):
            raise ValueError("MAAS API key must be 'consumer:token:secret' (3 non-empty parts "
                             "separated by colons)")
        self.url = url
        self._apikey = apikey
        self.request_timeout = float(request_timeout)
        self._loop = _LoopThread(f"libmaas-{url}")
        self._session = None  # bones.SessionAPI, created on the loop thread
        self._connect_lock: asyncio.Lock | None = None
        self._watch = StatusWatch(
            self._read_many,
            not_found=lambda sid: MaasNotFound(f"MAAS at {url}: machine {sid} not found",
                                               system_id=sid),
            interrupted=lambda sid: Interrupted(f"stopped while waiting for MAAS machine {sid}"),
            name=f"maas-watch-{url}")

    def __repr__(self) -> str:
        return f"LibMaasDriver({self.url!r})"

    def close(self) -> None:
        """Stop the private event loop thread (the driver restarts it if used again)."""
        self._loop.close()
        self._session, self._connect_lock = None, None

    # ------------------------------------------------------------------ plumbing

    async def _handlers(self):
        """The bones session (connecting once); runs on the loop thread."""
        if self._connect_lock is None:
            self._connect_lock = asyncio.Lock()
        async with self._connect_lock:
            if self._session is None:
                try:
                    from maas.client.viscera import Origin
                except ImportError as e:  # Python >= 3.12 without setuptools
                    raise MaasError(f"python-libmaas cannot be imported ({e}); on Python "
                                    ">= 3.12 it needs setuptools for distutils") from e
                _, origin = await Origin.connect(self.url, apikey=self._apikey)
                self._session = origin.session
                log.info("connected to MAAS at %s", self.url)
            return self._session

    def _call(self, what: str, system_id: str | None, fn):
        """Run ``await fn(session)`` on the loop thread with the per-call timeout; translate
        errors. ``what`` names the operation in messages."""

        async def job():
            return await fn(await self._handlers())

        try:
            return self._loop.run(asyncio.wait_for(job(), self.request_timeout),
                                  self.request_timeout + 5)
        except MaasError:
            raise
        except Exception as e:
            translated = self._translate(e, what, system_id)
            if translated is e:  # not a MAAS/network error: a bug, let it show as is
                raise
            raise translated from e

    def _translate(self, e: Exception, what: str, system_id: str | None) -> Exception:
        import aiohttp
        from maas.client.bones import CallError
        from maas.client.bones.helpers import RemoteError

        where = f"MAAS at {self.url}"
        sid = {"system_id": system_id}
        if isinstance(e, CallError):
            body = e.content.decode("utf-8", "replace")[:300]
            msg = f"{where}: {what} -> HTTP {e.status}: {body}"
            if e.status in (401, 403):
                return MaasAuthError(f"{where} rejected the API key (HTTP {e.status}) during "
                                     f"{what}: {body}", **sid)
            if e.status == 404:
                return MaasNotFound(msg, **sid)
            if e.status == 409:
                return MaasConflict(msg, **sid)
            if e.status in (502, 503, 504):
                return MaasUnreachable(msg, **sid)
            return MaasError(msg, **sid)
        if isinstance(e, RemoteError):  # describe/ did not answer 200 JSON
            text = str(e)
            cls = MaasUnreachable if any(f"-> {c}" in text for c in (502, 503, 504)) \
                else MaasError
            return cls(f"{where} is not a usable MAAS 2.0 API ({what}): {text}", **sid)
        if isinstance(e, (asyncio.TimeoutError, FutureTimeout)):
            return MaasUnreachable(f"{where} did not answer {what} within "
                                   f"{self.request_timeout:g}s", **sid)
        if isinstance(e, (aiohttp.ClientError, OSError)):
            return MaasUnreachable(f"{where} unreachable during {what}: "
                                   f"{type(e).__name__}: {e}", **sid)
        return e

    def _read(self, system_id: str) -> MachineInfo:
        async def fn(s):
            return await s.Machine.read(system_id=system_id)

        return MachineInfo.from_json(self._call(f"read {system_id}", system_id, fn))

    def _op(self, op: str, system_id: str, **params) -> MachineInfo:
        async def fn(s):
            return await getattr(s.Machine, op)(system_id=system_id, **params)

        return MachineInfo.from_json(self._call(f"{op} {system_id}", system_id, fn))

    def _list(self, **filters) -> list[MachineInfo]:
        async def fn(s):
            return await s.Machines.read(**filters)

        return [MachineInfo.from_json(d) for d in self._call("list machines", None, fn)]

    # ------------------------------------------------------------------ MaasDriver

    def connect(self) -> None:
        """Connect now (python-libmaas fetches MAAS' API description) rather than at the first
        call: the daemon warms up at its start so the first lease's deploy does not wait for
        it. Raises what any call raises (``MaasUnreachable``, ``MaasError``)."""
        async def fn(_s):
            return None

        self._call("connect", None, fn)

    def whoami(self) -> str:
        """The user name the API key belongs to: a cheap check of URL and key."""
        async def fn(s):
            return await s.Users.whoami()

        return self._call("whoami", None, fn)["username"]

    def machine(self, system_id: str) -> MachineInfo:
        return self._read(system_id)

    def deploy(self, system_id: str, series: str, user_data: str | bytes | None = None, *,
               bridge_all: bool = False, bridge_stp: bool | None = None,
               bridge_fd: int | None = None) -> MachineInfo:
        info = self._read(system_id)
        if info.status in DEPLOYING_OR_DEPLOYED:
            return info
        bridges = {}
        if bridge_all:
            bridges["bridge_all"] = "true"
            if bridge_stp is not None:
                bridges["bridge_stp"] = "true" if bridge_stp else "false"
            if bridge_fd is not None:
                bridges["bridge_fd"] = str(int(bridge_fd))
        if info.status == st.READY:
            # MAAS deploys only allocated machines (testflinger maas2: allocate then deploy);
            # bridge_all takes effect at allocation (Node.acquire).
            async def allocate(s):
                return await s.Machines.allocate(system_id=system_id, **bridges)

            try:
                # MAAS answers the allocated machine's document (python-libmaas
                # viscera/machines.py ``MachinesType.allocate`` builds its Machine from it):
                # no second read.
                info = MachineInfo.from_json(
                    self._call(f"allocate {system_id}", system_id, allocate))
            except MaasConflict:
                info = self._read(system_id)  # someone else allocated it meanwhile
                if info.status in DEPLOYING_OR_DEPLOYED:
                    return info
                if info.status != st.ALLOCATED:
                    raise
        if info.status != st.ALLOCATED:
            raise MaasConflict(
                f"cannot deploy MAAS machine {info.hostname} ({system_id}) in status "
                f"{info.status!r}{': ' + info.status_message if info.status_message else ''}",
                system_id=system_id, status=info.status, status_message=info.status_message)
        params = {"distro_series": series}
        if user_data is not None:
            raw = user_data.encode() if isinstance(user_data, str) else user_data
            params["user_data"] = base64.b64encode(raw).decode("ascii")
        params.update(bridges)
        try:
            info = self._op("deploy", system_id, **params)
        except MaasConflict:
            info = self._read(system_id)  # a concurrent deploy won the race
            if info.status not in DEPLOYING_OR_DEPLOYED:
                raise
        log.info("MAAS deploy of %s (%s) with %s: %s", info.hostname, system_id, series,
                 info.status)
        return info

    def wait_for(self, system_id: str, want: set[str], fail: set[str], timeout: float,
                 poll: float = 10.0, should_stop=None) -> MachineInfo:
        """``MaasDriver.wait_for``; the reads are shared with every other wait of this driver
        (``maas_watch.StatusWatch``: one ``GET machines/?id=..`` per round for all the
        machines waited on, e.g. the VMs of a lease commissioning together)."""
        stopping, _pause = _stop_check(should_stop)
        with self._watch.watching(system_id, poll) as next_info:
            return _wait_loop(lambda _sid: next_info(stopping), system_id, set(want), set(fail),
                              timeout, poll, should_stop=should_stop, sleep=lambda _s: None)

    def _read_many(self, system_ids: list[str]) -> dict[str, MachineInfo]:
        """``{system_id: MachineInfo}`` of ``system_ids`` in one list call (MAAS API machines
        ``read`` with repeated ``id``); machines that do not exist are absent."""
        return {m.system_id: m for m in self._list(id=list(system_ids))}

    def release(self, system_id: str) -> MachineInfo:
        info = self._read(system_id)
        if info.status in RELEASED_OR_RELEASING:
            return info
        if info.status not in RELEASABLE:
            raise MaasConflict(f"cannot release MAAS machine {info.hostname} ({system_id}) in "
                               f"status {info.status!r}", system_id=system_id,
                               status=info.status, status_message=info.status_message)
        try:
            info = self._op("release", system_id)
        except MaasConflict:
            info = self._read(system_id)
            if info.status not in RELEASED_OR_RELEASING:
                raise
        log.info("MAAS release of %s (%s): %s", info.hostname, system_id, info.status)
        return info

    def _find_vm(self, hostname: str, mac: str) -> str | None:
        by_mac = self._list(mac_address=[mac])
        for m in by_mac:
            if mac in m.macs:
                return m.system_id
        for m in self._list(hostname=[hostname]):
            if m.hostname == hostname and mac in m.macs:
                return m.system_id  # created by a racing call between the two reads
            if m.hostname == hostname:
                raise MaasConflict(
                    f"MAAS machine {hostname} ({m.system_id}) exists with MAC(s) "
                    f"{', '.join(m.macs) or 'none'}, not {mac}: delete it first",
                    system_id=m.system_id, status=m.status)
        return None

    def create_vm_machine(self, hostname: str, mac: str, power_address: str, power_id: str,
                          architecture: str = "amd64/generic", power_pass: str | None = None,
                          description: str | None = None) -> str:
        mac = mac.lower()
        existing = self._find_vm(hostname, mac)
        if existing:
            return existing
        extra = {"power_parameters_power_pass": power_pass} if power_pass else {}
        if description:
            extra["description"] = description

        # power_parameters_<name> is the form the MAAS API reference documents for create.
        async def create(s):
            return await s.Machines.create(
                architecture=architecture, mac_addresses=[mac], power_type="virsh",
                hostname=hostname, power_parameters_power_address=power_address,
                power_parameters_power_id=power_id, **extra)

        try:
            data = self._call(f"create {hostname}", None, create)
        except (MaasUnreachable, MaasAuthError):
            raise
        except MaasError as e:
            # A concurrent create of the same VM wins with "already in use/exists" (HTTP 400).
            found = self._find_vm(hostname, mac)
            if found:
                return found
            raise MaasError(f"MAAS refused to create VM machine {hostname} ({mac}): {e}") from e
        log.info("MAAS created VM machine %s (%s) mac %s", hostname, data["system_id"], mac)
        return data["system_id"]

    def assign_static_ip(self, system_id: str, subnet: int | str | None = None) -> str:
        data = self._call(f"read {system_id}", system_id,
                          lambda s: s.Machine.read(system_id=system_id))
        iface = data.get("boot_interface") or next(iter(data.get("interface_set") or ()), None)
        where = f"MAAS machine {data.get('hostname')} ({system_id})"
        if not iface:
            raise MaasError(f"{where} has no network interface to give a static address",
                            system_id=system_id, status=data.get("status_name"))
        where += f" interface {iface.get('name')} (id {iface['id']})"
        ip = static_address(iface)
        if ip:
            return ip
        subnets = self._call("list subnets", system_id, lambda s: s.Subnets.read())
        chosen = pick_subnet(subnets, iface.get("vlan"), subnet)
        if chosen is None:
            raise MaasError(f"{where}: no subnet {subnet!r} in MAAS" if subnet is not None
                            else f"{where}: MAAS has no subnet", system_id=system_id)

        def interface_call(op: str, **params):
            async def fn(s):
                return await getattr(s.Interface, op)(system_id=system_id, id=iface["id"],
                                                      **params)
            return self._call(f"{op} {system_id}/{iface['id']}", system_id, fn)

        try:
            # An AUTO link on the same subnet would add a second address, a new one at every
            # deploy: the STATIC link replaces it. A crash between the two only leaves no link,
            # which the next call links again.
            for link in iface.get("links") or ():
                if ((link.get("mode") or "").lower() == "auto"
                        and (link.get("subnet") or {}).get("id") == chosen["id"]):
                    interface_call("unlink_subnet", _id=link["id"])
            result = interface_call("link_subnet", mode="STATIC", subnet=chosen["id"])
        except (MaasUnreachable, MaasAuthError):
            raise
        except MaasError as e:
            # A concurrent call may have linked it meanwhile: its address is as good.
            again = self._call(f"read interface {system_id}/{iface['id']}", system_id,
                               lambda s: s.Interface.read(system_id=system_id, id=iface["id"]))
            ip = static_address(again)
            if ip:
                return ip
            raise type(e)(f"{where}: link_subnet STATIC on {chosen.get('cidr')} failed: {e}",
                          system_id=system_id, status=data.get("status_name")) from e
        ip = static_address(result)
        if not ip:
            raise MaasError(f"{where}: MAAS linked subnet {chosen.get('cidr')} STATIC but gave "
                            "no address", system_id=system_id)
        log.info("%s: static address %s on %s", where, ip, chosen.get("cidr"))
        return ip

    def mark_broken(self, system_id: str, comment: str = "") -> MachineInfo:
        info = self._op("mark_broken", system_id, **({"comment": comment} if comment else {}))
        log.info("MAAS marked %s (%s) broken: %s", info.hostname, system_id, info.status)
        return info

    def mark_fixed(self, system_id: str, comment: str = "") -> MachineInfo:
        info = self._op("mark_fixed", system_id, **({"comment": comment} if comment else {}))
        log.info("MAAS marked %s (%s) fixed: %s", info.hostname, system_id, info.status)
        return info

    def power_off(self, system_id: str) -> MachineInfo:
        info = self._op("power_off", system_id)
        log.info("MAAS power off of %s (%s): %s", info.hostname, system_id, info.status)
        return info

    def events(self, system_id: str, limit: int = 10, level: str = "INFO") -> list[dict]:
        async def fn(s):
            return await s.Events.query(id=[system_id], limit=[str(int(limit))], level=[level])

        return list((self._call(f"events of {system_id}", system_id, fn) or {}).get("events")
                    or [])

    def find_by_hostname(self, hostname: str) -> str | None:
        short = hostname.split(".", 1)[0]
        for m in self._list(hostname=[short]):
            if m.hostname == short:
                return m.system_id
        return None

    def delete(self, system_id: str) -> None:
        async def fn(s):
            return await s.Machine.delete(system_id=system_id)

        try:
            self._call(f"delete {system_id}", system_id, fn)
            log.info("MAAS deleted machine %s", system_id)
        except MaasNotFound:
            pass

    def list_machines(self, hostname_prefix: str = "") -> list[MachineInfo]:
        return [m for m in self._list() if m.hostname.startswith(hostname_prefix)]
