"""The agent-host daemon's MAAS driver interface: what the lease steps ask of MAAS.

``MaasDriver`` is the interface the lease steps use (docs/architecture.md, "Agent-host
drivers"); ``maas_libmaas.LibMaasDriver`` implements it with python-libmaas against a real MAAS
(or the lab's simulator). Statuses are MAAS ``status_name`` strings (``"Ready"``, ``"Deployed"``,
``"Failed deployment"``...).

Here: the ``MaasError`` family every driver raises, ``MachineInfo`` (a machine as the daemon
needs it), ``Interrupted``, and the pure parts any driver shares: the ``wait_for`` loop
(``_wait_loop``), ``static_address`` and ``pick_subnet``.
"""

from __future__ import annotations

import abc
import logging
import threading
import time
from dataclasses import dataclass, field

from testflinger_magic.agent_host import maas_status as st

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


class MaasInvalid(MaasError):
    """MAAS refused the request's parameters (HTTP 400: maasserver ``MAASAPIValidationError``,
    whose body is the form's errors as JSON, ``{field: [message, ...]}``). ``fields``: those
    errors by field when MAAS gave them so, else ``{}``."""

    def __init__(self, message: str, *, fields: dict | None = None, **kwargs):
        super().__init__(message, **kwargs)
        self.fields = {str(k): [str(m) for m in (v if isinstance(v, list) else [v])]
                       for k, v in (fields or {}).items()}


class MaasConflict(MaasError):
    """MAAS refused the operation in the machine's current state (HTTP 409), or a hostname is
    taken by a machine with another MAC."""


def raised_from(exc: BaseException | None, kind: type) -> BaseException | None:
    """The exception of type ``kind`` that ``exc`` is or was raised from (its ``__cause__`` /
    ``__context__`` chain: a step may wrap it, e.g. ``StepError`` from ``_retry``), or None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def outage_of(exc: BaseException | None) -> "MaasUnreachable | None":
    """The ``MaasUnreachable`` that ``exc`` is or was raised from (:func:`raised_from`)."""
    return raised_from(exc, MaasUnreachable)


class Reachability:
    """Whether MAAS answered the latest call of a driver: ``down_since`` is the epoch time
    (``time.time()``) of the first ``MaasUnreachable`` since the last call MAAS answered (any
    answer, an HTTP error included: only ``MaasUnreachable`` means it is not there), None while
    it answers; ``last_error`` that error's text. Thread-safe; the driver calls ``answered()``
    / ``unreachable(exc)``, the daemon reads it for its heartbeat (docs/api.md)."""

    def __init__(self, clock=time.time):
        self._clock = clock
        self._lock = threading.Lock()
        self.down_since: float | None = None
        self.last_error: str = ""

    def answered(self) -> None:
        """MAAS answered a call (whatever the answer)."""
        with self._lock:
            if self.down_since is not None:
                log.info("MAAS answers again (unreachable for %.0fs)",
                         self._clock() - self.down_since)
            self.down_since, self.last_error = None, ""

    def unreachable(self, exc: BaseException) -> None:
        """A call failed with ``MaasUnreachable`` ``exc``."""
        with self._lock:
            if self.down_since is None:
                self.down_since = self._clock()
            self.last_error = str(exc)


@dataclass(frozen=True)
class MachineInfo:
    """A MAAS machine as the daemon needs it. ``status`` is MAAS' ``status_name``;
    ``ip_addresses`` a tuple of strings; ``status_message`` MAAS' last event text (may be "").
    ``macs`` the MAC addresses of its non-bridge interfaces (lower case). ``bridges`` the names of
    its bridge interfaces (those MAAS creates for ``bridge_all``: maasserver/models/interface.py
    ``create_acquired_bridge``, named ``get_default_bridge_name()``, e.g. ``br-eth0``), the one
    on the boot interface first. ``description``: the machine's free text (the daemon marks the
    VMs it creates there: ``marks.maas_mark``). ``boot_interface``: MAAS' document of the boot
    interface (its ``id``, ``links``, ``vlan``), else of the first interface, None when the
    machine has none (not compared: a detail ``assign_static_ip`` reuses)."""

    system_id: str
    hostname: str
    status: str
    ip_addresses: tuple[str, ...]
    power_type: str
    status_message: str = ""
    macs: tuple[str, ...] = ()
    bridges: tuple[str, ...] = ()
    description: str = ""
    boot_interface: dict | None = field(default=None, compare=False, repr=False)

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
            boot_interface=data.get("boot_interface") or (interfaces[0] if interfaces else None),
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
               bridge_fd: int | None = None, current: MachineInfo | None = None) -> MachineInfo:
        """Start deploying ``system_id`` with Ubuntu ``series`` (raw cloud-config
        ``user_data``). No-op if already Deploying/Deployed; allocates a Ready machine first.
        Raises ``MaasConflict`` in other statuses (e.g. Failed deployment: release first).
        ``current``: the machine as the caller has just read it (``machine``), so the driver
        does not read it again to learn its status (None: it reads it). A status that changed
        meanwhile is met as any race is: MAAS refuses the allocate or deploy (409) and the
        driver reads the machine then.

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
                          description: str | None = None, *, look_first: bool = True) -> str:
        """Enrol a VM (power type ``virsh``; MAAS commissions it, powering the domain
        ``power_id`` on through ``power_address``, a plain ``qemu+ssh://user@host/system``, and
        ``power_pass`` if given) with ``description`` (the daemon's mark; MAAS' admin create
        form takes it: maasserver/forms/__init__.py ``AdminMachineForm``); returns its
        system_id. If a machine with this MAC, or this
        hostname and MAC, exists, returns it instead; a hostname held by another MAC raises
        ``MaasConflict``.

        ``look_first`` False: create at once and look for an existing machine only when MAAS
        refuses the create (HTTP 400), as it does for a hostname or a MAC already taken
        (maasserver/models/node.py ``Node.hostname`` is ``unique=True``;
        maasserver/forms/__init__.py ``MachineWithMACAddressesForm.clean_mac_addresses``:
        "MAC address ... already in use on ..."), with the same outcome and no reads before
        MAAS starts commissioning; for a VM that has not been created before."""

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
    def assign_static_ip(self, system_id: str, subnet: int | str | None = None, *,
                         current: MachineInfo | None = None) -> str:
        """Give the boot interface of ``system_id`` a STATIC address and return it (a string).
        ``current``: the machine as just read (e.g. by the wait for Ready: MAAS' machines list
        gives the same document as a read, maasserver/api/machines.py ``MachinesHandler.fields
        = DISPLAYED_MACHINE_FIELDS``, ``boot_interface`` included), so the driver does not read
        it again (None, or one without an interface: it reads it).

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

    def nvswitch_count(self, system_id: str) -> int | None:
        """The NVSwitches MAAS' commissioning found on ``system_id`` (its node devices, MAAS
        >= 3.0: ``maas_nodedevices``), or None when MAAS cannot say: an older MAAS (no node
        devices), a machine never commissioned, or no NVIDIA device listed at all. One MAAS
        call. Raises ``MaasError`` (``MaasNotFound`` for an unknown machine). This default
        knows nothing (None): a driver that can ask MAAS overrides it."""
        return None


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
