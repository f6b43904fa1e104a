"""Pieces of MAAS behaviour the simulator (maas_sim.py) models, kept apart from its HTTP code.

Each names its source in canonical/maas (read at 9e51f33ce6f7f19bd91ecddfd97baf5495db4eba).
"""

from __future__ import annotations

import re
import time
import zlib
from dataclasses import dataclass

from testflinger_magic.agent_host import maas_status as st

# Event types (maascommon/events.py EVENT_DETAILS_MAP: description, level).
POWER_ON_FAILED = ("Failed to power on node", "ERROR")
POWER_OFF_FAILED = ("Failed to power off node", "ERROR")
POWER_QUERY_FAILED = ("Failed to query node's BMC", "WARNING")
LEVELS = {"DEBUG": 10, "INFO": 20, "WARNING": 30, "ERROR": 40, "CRITICAL": 50}
# maasserver/api/events.py: DATETIME_FORMAT, DEFAULT_EVENT_LOG_LIMIT, MAX_EVENT_LOG_COUNT.
DATETIME_FORMAT = "%a, %d %b. %Y %H:%M:%S"
DEFAULT_EVENT_LOG_LIMIT = 100
MAX_EVENT_LOG_COUNT = 1000


@dataclass
class Event:
    """One node event (maasserver/models/event.py); ``type`` is the event type's description."""

    id: int
    type: str
    level: str
    description: str
    created: float

    def json(self, system_id: str, hostname: str, username: str) -> dict:
        """As maasserver/api/events.py ``event_to_dict`` renders it."""
        return {"username": username, "node": system_id, "hostname": hostname, "id": self.id,
                "level": self.level, "type": self.type, "description": self.description,
                "created": time.strftime(DATETIME_FORMAT, time.gmtime(self.created))}

    def status_message(self) -> str:
        """maasserver/models/node.py ``Node.status_message``: "<type> - <description>"."""
        return f"{self.type} - {self.description}" if self.description else self.type


def enum_name(label: str) -> str:
    """The NODE_STATUS attribute name of a status label ("Commissioning" -> "COMMISSIONING"),
    as ``map_enum_reverse(NODE_STATUS)`` gives it in ``_start_bmc_unavailable``."""
    for attr, value in vars(st).items():
        if attr.isupper() and value == label and label in st.CODES:
            return attr
    raise KeyError(label)


def bmc_unavailable_message(user: str, status: str, old_status: str) -> str:
    """The event description of maasserver/models/node.py ``Node._start_bmc_unavailable``,
    registered when a power action of a start (commission, deploy) fails and the node is put
    back in ``old_status``."""
    return (f"({user}) - Aborting {enum_name(status)} and reverting to {enum_name(old_status)}. "
            "Unable to power control the node. Please check power credentials.")


def default_bridge_name(ifname: str) -> str:
    """maasserver/models/interface.py ``Interface.get_default_bridge_name``: the name of the
    bridge MAAS creates on an interface for ``bridge_all`` (``br-<ifname>``, shortened to fit
    Linux' 15 characters as MAAS does)."""
    name = f"br-{ifname}"
    if len(name) > 15:
        name = f"b-{ifname}"
        if ifname[:2] == "en":
            name = f"b-{ifname[2:]}"
        if len(name) > 15:
            digest = f"{zlib.crc32(ifname.encode()) & 0xFFFFFFFF:06x}"[-6:]
            name = f"b-{digest}-{ifname[len(ifname) - 6:]}"
    return name


#: maasserver/models/interface.py DEFAULT_BRIDGE_FD; BRIDGE_TYPE.STANDARD.
DEFAULT_BRIDGE_FD = 15
BRIDGE_TYPES = ("standard", "ovs")


@dataclass
class Injection:
    """A failure injected into the simulator's HTTP API (``MaasSimulator.inject``)."""

    method: str
    path: re.Pattern
    status: int
    body: object
    times: int

    def matches(self, method: str, full_path: str) -> bool:
        return self.times != 0 and self.method in ("*", method) and bool(
            self.path.search(full_path))


_LABEL_CHARS = re.compile(r"[a-zA-Z0-9-]*$")


def hostname_problem(hostname: str) -> str | None:
    """MAAS' refusal of a machine ``hostname`` (the validator of ``Node.hostname``, run by the
    machine create and update forms: 400 ``{"hostname": [why]}``), or None. From
    src/maasserver/utils/dns.py ``validate_hostname`` and ``validate_domain_name``: the host
    label (before the first ``.``) holds no ``_``; every label is 1-63 letters, digits and
    ``-``, not starting or ending with ``-``; at most 255 characters in all."""
    if len(hostname) > 255:
        return "Hostname is too long.  Maximum allowed is 255 characters."
    host = hostname.split(".")[0]
    if "_" in host:
        return f"Host label cannot contain underscore: {host!r}."
    for label in hostname.split("."):
        if not label:
            return "DNS name contains an empty label."
        if len(label) > 63:
            return f"Label is too long: {label!r}.  Maximum allowed is 63 characters."
        if label.startswith("-") or label.endswith("-"):
            return f"Label cannot start or end with hyphen: {label!r}."
        if not _LABEL_CHARS.match(label):
            return f"Label contains disallowed characters: {label!r}."
    return None
