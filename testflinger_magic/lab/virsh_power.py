"""The MAAS simulator's virsh power driver: MAAS' own, modelled on libvirt test-driver hosts.

MAAS powers a machine of power type ``virsh`` from a rack controller
(src/provisioningserver/drivers/power/virsh.py, ``VirshPowerDriver`` and ``VirshSSH``, read at
canonical/maas 9e51f33ce6f7f19bd91ecddfd97baf5495db4eba). What is modelled, each from there:

- ``VirshSSH.login``: ``urlparse(power_address)``; any query string is refused with
  "Supplying extra parameters to the Virsh address is not supported." (the rack then appends
  its own ``?command=/usr/lib/maas/unverified-ssh``). The login goes over SSH as the user of
  the address with the rack's SSH key, or ``power_pass`` when the host asks for a password; a
  failed login is ``VirshError("Failed to login to virsh console.")``
  (``VirshPowerDriver.power_control_virsh``).
- ``power_control_virsh``: the domain's state (``domstate power_id``) is read first; none is
  "<power_id>: Failed to get power state". Power on runs ``start`` only on a "shut off"
  domain; power off runs ``destroy`` only on a "running" one; either failing is
  "<power_id>: Failed to power on VM" / "... off VM".
- ``power_state_virsh``: "running" is on, "shut off" (and paused, crashed...) off
  (``VM_STATE_TO_POWER_STATE``).

Where the rack's SSH lands is the lab's business: ``VirshHosts`` maps the address's host to a
libvirt URI (a ``test:///<file>.xml`` host of ``lab.hosts``), and decides whether the login is
accepted. An unknown host is a login failure, as an SSH connection that cannot be made is. The
test-driver files are opened through ``libvirt_session.session``, as the daemon's splitter opens
them, so that what the simulator does to a domain is saved to the host file the splitter reads
(libvirt_session module doc).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable
from urllib.parse import urlparse

import libvirt

#: VirshSSH.login's refusal of a query string (provisioningserver/drivers/power/virsh.py).
EXTRA_PARAMETERS = "Supplying extra parameters to the Virsh address is not supported."
#: power_control_virsh / power_state_virsh when login fails.
LOGIN_FAILED = "Failed to login to virsh console."


class VirshError(Exception):
    """A virsh power action failed; the message is MAAS' (provisioningserver ``VirshError``)."""


@dataclass
class VirshHost:
    """A host the rack controller can SSH to: its libvirt ``uri`` (``test:///...xml`` in the
    lab), the public keys its login user accepts (None: any key, auth not modelled) and its
    ``password`` (None: password login refused)."""

    uri: str
    authorized_keys: list[str] | None = None
    password: str | None = None


@dataclass
class VirshHosts:
    """What the rack's ``virsh --connect qemu+ssh://user@HOST/system`` reaches.

    ``static``: ``{host or IP: VirshHost}``. ``lookup``: a fallback ``(host) -> VirshHost | None``
    (the simulator resolves a deployed machine's address to its host file and authorized keys).
    ``rack_key``: the rack controller's public key (None: key auth always succeeds).
    """

    static: dict[str, VirshHost] = field(default_factory=dict)
    lookup: Callable[[str], VirshHost | None] | None = None
    rack_key: str | None = None

    def add(self, host: str, uri: str, *, authorized_keys: list[str] | None = None,
            password: str | None = None) -> None:
        """Register ``host`` (IP or name as it appears in power_address) as libvirt ``uri``."""
        self.static[host] = VirshHost(uri, authorized_keys, password)

    def resolve(self, host: str) -> VirshHost | None:
        found = self.static.get(host)
        if found is None and self.lookup is not None:
            found = self.lookup(host)
        return found


def parse_power_address(power_address: str) -> str:
    """The host of a virsh ``power_address``; ``VirshError`` as MAAS' ``VirshSSH.login``
    raises it for a query string, or ``LOGIN_FAILED`` when there is no host to SSH to."""
    parsed = urlparse(power_address or "")
    if parsed.query:
        raise VirshError(EXTRA_PARAMETERS)
    if not parsed.hostname:
        raise VirshError(LOGIN_FAILED)
    return parsed.hostname


def _login(hosts: VirshHosts, power_address: str, power_pass: str | None) -> str:
    """``VirshSSH.login``: the libvirt URI reached, or ``VirshError``."""
    host = hosts.resolve(parse_power_address(power_address))
    if host is None:
        raise VirshError(LOGIN_FAILED)  # ssh: no route / connection refused
    key_ok = (hosts.rack_key is None or host.authorized_keys is None
              or hosts.rack_key.strip() in {k.strip() for k in host.authorized_keys})
    # power_control_virsh: a blank power_pass counts as none.
    pass_ok = bool(power_pass) and host.password is not None and power_pass == host.password
    if not (key_ok or pass_ok):
        raise VirshError(LOGIN_FAILED)  # "Permission denied" or a password prompt unanswered
    return host.uri


def _domain_state(conn, power_id: str) -> str | None:
    """``virsh domstate``: "running", "shut off", ... or None when there is no such domain."""
    try:
        dom = conn.lookupByName(power_id)
    except libvirt.libvirtError:
        return None
    state = dom.state()[0]
    return {libvirt.VIR_DOMAIN_RUNNING: "running", libvirt.VIR_DOMAIN_SHUTOFF: "shut off",
            libvirt.VIR_DOMAIN_PAUSED: "paused", libvirt.VIR_DOMAIN_CRASHED: "crashed",
            libvirt.VIR_DOMAIN_SHUTDOWN: "in shutdown",
            libvirt.VIR_DOMAIN_PMSUSPENDED: "pmsuspended"}.get(state, "no state")


def _session(uri: str):
    # The splitter's session persists test-driver changes to the host file (module doc).
    from testflinger_magic.agent_host.libvirt_session import session

    return session(uri)


def power_control(hosts: VirshHosts, power_address: str, power_id: str, change: str,
                  power_pass: str | None = None) -> None:
    """``VirshPowerDriver.power_control_virsh``: ``change`` is "on" or "off"; ``VirshError``
    with MAAS' message on failure."""
    uri = _login(hosts, power_address, power_pass)
    try:
        with _session(uri) as s:
            state = _domain_state(s.conn, power_id)
            if state is None:
                raise VirshError(f"{power_id}: Failed to get power state")
            dom = s.conn.lookupByName(power_id)
            try:
                if state == "shut off" and change == "on":
                    s.changed = True
                    dom.create()
                elif state == "running" and change == "off":
                    s.changed = True
                    dom.destroy()
            except libvirt.libvirtError as e:
                raise VirshError(f"{power_id}: Failed to power {change} VM") from e
    except VirshError:
        raise
    except Exception as e:  # the host file cannot be read: as an SSH session that dies
        raise VirshError(f"{LOGIN_FAILED} ({e})") from e


def power_state(hosts: VirshHosts, power_address: str, power_id: str,
                power_pass: str | None = None) -> str:
    """``VirshPowerDriver.power_state_virsh``: "on" or "off"; ``VirshError`` on failure."""
    uri = _login(hosts, power_address, power_pass)
    try:
        with _session(uri) as s:
            state = _domain_state(s.conn, power_id)
    except Exception as e:  # noqa: BLE001 - as an SSH session that dies
        raise VirshError(f"{LOGIN_FAILED} ({e})") from e
    if state is None:
        raise VirshError(f"Failed to get domain: {power_id}")
    # VM_STATE_TO_POWER_STATE
    return "on" if state in ("running", "in shutdown") else "off"
