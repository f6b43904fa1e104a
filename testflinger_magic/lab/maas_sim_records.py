"""The MAAS simulator's records and wire format (used by maas_sim.py and its parts).

The records the simulator keeps (machine, subnet, interface link, pending transition) and the
documents MAAS' handlers render from them (``machine_json``: MachineHandler,
``interface_json``: InterfaceHandler, ``Subnet.json``: SubnetHandler, ``describe``: the
``describe/`` document), the request parsing (multipart/urlencoded forms, the OAuth header)
and :class:`SimError`, an API error answered with its HTTP status. Sources are named next to
each (canonical/maas, python-libmaas, the MAAS API reference).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from email.parser import BytesParser
from email.policy import HTTP
from urllib.parse import parse_qsl, unquote

from testflinger_magic.agent_host import maas_status as st
from testflinger_magic.lab import maas_sim_parts as parts

API = "/MAAS/api/2.0"
USERNAME = "admin"

# MAAS status names and codes: maascommon/node.py NODE_STATUS_LABELS and
# maascommon/enums/node.py NodeStatus, kept in one table (agent_host/maas_status.py).
STATUS_CODES = dict(st.CODES)


def form_bool(value: str) -> bool:
    """MAAS' StringBool: "true"/"1"/"yes"/"on" (any case) are true."""
    return str(value).strip().lower() in ("true", "1", "yes", "on")


class SimError(Exception):
    """An API error: HTTP ``status`` and a body (str, or dict sent as JSON)."""

    def __init__(self, status: int, body):
        super().__init__(f"HTTP {status}: {body}")
        self.status = status
        self.body = body


@dataclass
class Pending:
    op: str
    done_at: float
    fail: bool


@dataclass
class Subnet:
    """A simulated MAAS subnet on its own untagged VLAN (``vlan_id``)."""

    id: int
    network: ipaddress.IPv4Network | ipaddress.IPv6Network
    vlan_id: int
    fabric_id: int

    @property
    def gateway(self):
        return next(self.network.hosts())

    def dynamic(self, ip) -> bool:
        """True if ``ip`` is in the top quarter of the subnet: the simulated DHCP range."""
        first = int(self.network.network_address)
        return int(ip) >= first + self.network.num_addresses * 3 // 4

    def vlan_json(self) -> dict:
        return {"id": self.vlan_id, "vid": 0, "name": "untagged", "mtu": 1500, "dhcp_on": True,
                "external_dhcp": None, "relay_vlan": None, "space": "undefined",
                "fabric": f"fabric-{self.fabric_id}", "fabric_id": self.fabric_id,
                "primary_rack": "rack01", "secondary_rack": None,
                "resource_uri": f"{API}/vlans/{self.vlan_id}/"}

    def json(self) -> dict:
        """The subnet document as MAAS' SubnetHandler renders it (DISPLAYED_SUBNET_FIELDS)."""
        return {"id": self.id, "name": str(self.network), "description": "",
                "cidr": str(self.network), "vlan": self.vlan_json(),
                "gateway_ip": str(self.gateway), "dns_servers": [], "rdns_mode": 2,
                "allow_dns": True, "allow_proxy": True, "active_discovery": False,
                "managed": True, "space": "undefined",
                "resource_uri": f"{API}/subnets/{self.id}/"}


@dataclass
class Link:
    """One interface link (a MAAS StaticIPAddress): ``ip`` None while an AUTO link waits for a
    deploy, and for DHCP/LINK_UP links."""

    id: int
    mode: str
    subnet: Subnet | None
    ip: str | None = None

    def json(self) -> dict:
        data = {"id": self.id, "mode": self.mode}
        if self.subnet is not None:
            data["subnet"] = self.subnet.json()
        if self.ip:
            data["ip_address"] = self.ip
        return data


@dataclass
class Machine:
    system_id: str
    hostname: str
    status_name: str
    power_type: str
    power_parameters: dict
    architecture: str
    macs: list
    interface_ids: list
    cpu_count: int = 4
    memory: int = 8192
    tag_names: list = field(default_factory=list)
    #: free text an admin sets at create or update (maasserver/forms/__init__.py
    #: ``AdminMachineForm.Meta.fields`` has ``description``; the machine document shows it:
    #: maasserver/api/machines.py ``DISPLAYED_MACHINE_FIELDS``).
    description: str = ""
    status_message: str = ""
    power_state: str = "off"
    owner: str | None = None
    osystem: str = ""
    distro_series: str = ""
    user_data: bytes | None = None
    # {interface id: [Link]}; the boot interface is interface_ids[0].
    links: dict = field(default_factory=dict)
    vlan: Subnet | None = None  # whose VLAN the interfaces are on (None: disconnected)
    pending: Pending | None = None
    prev_status: str = "New"
    events: list = field(default_factory=list)  # [parts.Event], oldest first
    # bridge_all bridges: {parent interface id: (bridge interface id, params)}
    bridges: dict = field(default_factory=dict)
    #: names of interface_ids' interfaces (commissioning reads them from the machine: the
    #: kernel's names, e.g. ``enp12s0f0np0``); missing ones are ``eth<i>``.
    interface_names: list = field(default_factory=list)
    #: the machine's PCI layout as commissioning reads it (maas_sim_devices.PciFunction list,
    #: with ``nic_address``: its boot interface's function), None: not known to the simulator
    hardware: list | None = None
    nic_address: str | None = None
    #: the node devices its last commissioning recorded (maas_sim_devices.NodeDevice); none
    #: before the first one (a New machine)
    node_devices: list = field(default_factory=list)

    def ifname(self, i: int) -> str:
        return self.interface_names[i] if i < len(self.interface_names) else f"eth{i}"


def interface_json(m: Machine, iid: int) -> dict:
    """An interface document as MAAS' InterfaceHandler renders it (DISPLAYED_INTERFACE_FIELDS).

    A bridge_all bridge (maasserver/models/interface.py ``create_acquired_bridge``) is a
    ``bridge`` interface named ``get_default_bridge_name()`` with its parent's MAC, the parent's
    links moved onto it, and the parent as its parent."""
    parent = next((p for p, (b, _) in m.bridges.items() if b == iid), None)
    i = m.interface_ids.index(parent if parent is not None else iid)
    name, kind, params, parents, children = m.ifname(i), "physical", "", [], []
    if parent is not None:
        name, kind, params = parts.default_bridge_name(name), "bridge", m.bridges[parent][1]
        parents = [m.ifname(i)]
    elif iid in m.bridges:
        children = [parts.default_bridge_name(name)]
    return {"id": iid, "name": name, "type": kind, "mac_address": m.macs[i],
            "enabled": True, "system_id": m.system_id,
            "links": [link.json() for link in m.links.get(iid, [])], "discovered": None,
            "tags": [], "params": params, "parents": parents, "children": children,
            "vlan": m.vlan.vlan_json() if m.vlan else None, "effective_mtu": 1500,
            "link_connected": True, "interface_speed": 1000, "link_speed": 1000,
            "resource_uri": f"{API}/nodes/{m.system_id}/interfaces/{iid}/"}


def machine_json(m: Machine) -> dict:
    """The machine document as MAAS' MachineHandler renders it (the fields clients read)."""
    ids = list(m.interface_ids) + [b for b, _ in m.bridges.values()]
    interfaces = [interface_json(m, iid) for iid in ids]
    ips = [link.ip for iid in ids for link in m.links.get(iid, []) if link.ip]
    return {
        "system_id": m.system_id, "hostname": m.hostname, "description": m.description,
        "fqdn": f"{m.hostname}.maas",
        "domain": {"id": 0, "name": "maas", "authoritative": True, "ttl": None,
                   "resource_record_count": 0, "is_default": True},
        "zone": {"id": 1, "name": "default", "description": ""},
        "pool": {"id": 0, "name": "default", "description": "Default pool"},
        "owner": m.owner, "owner_data": {}, "locked": False,
        "status": STATUS_CODES[m.status_name], "status_name": m.status_name,
        "status_message": m.status_message, "status_action": "",
        "power_state": m.power_state, "power_type": m.power_type,
        "architecture": m.architecture, "cpu_count": m.cpu_count, "memory": m.memory,
        "osystem": m.osystem, "distro_series": m.distro_series,
        "hwe_kernel": None, "min_hwe_kernel": "", "netboot": m.status_name != "Deployed",
        "disable_ipv4": False, "ip_addresses": ips,
        "boot_interface": interfaces[0] if interfaces else None, "interface_set": interfaces,
        "tag_names": list(m.tag_names), "node_type": 0, "node_type_name": "Machine",
        "blockdevice_set": [], "boot_disk": None, "bcaches": [], "cache_sets": [], "raids": [],
        "volume_groups": [], "storage": 0.0, "swap_size": None, "hardware_info": {},
        "resource_uri": f"{API}/machines/{m.system_id}/",
    }


def describe(base: str, node_devices: bool = True) -> dict:
    """The ``describe/`` document; ``base`` is ``scheme://host`` from the request.
    ``node_devices``: list ``NodeDevicesHandler`` (MAAS >= 3.0: maas_sim_devices)."""

    def action(name, method, op=None):
        return {"name": name, "method": method, "op": op, "restful": op is None, "doc": name}

    def handler(name, path, params, actions):
        return {"name": name, "doc": name, "params": params, "actions": actions,
                "path": f"{API}/{path}", "uri": f"{base}{API}/{path}"}

    version = handler("VersionHandler", "version/", [], [action("read", "GET")])
    users = handler("UsersHandler", "users/", [], [action("read", "GET"),
                                                  action("whoami", "GET", "whoami")])
    machines = handler("MachinesHandler", "machines/", [], [
        action("read", "GET"), action("create", "POST"),
        action("allocate", "POST", "allocate")])
    machine = handler("MachineHandler", "machines/{system_id}/", ["system_id"], [
        action("read", "GET"), action("update", "PUT"), action("delete", "DELETE"),
        action("power_parameters", "GET", "power_parameters")] + [
        action(op, "POST", op) for op in ("deploy", "release", "commission", "abort",
                                          "power_on", "power_off", "mark_broken", "mark_fixed")])
    subnets = handler("SubnetsHandler", "subnets/", [], [action("read", "GET")])
    subnet = handler("SubnetHandler", "subnets/{id}/", ["id"], [action("read", "GET")])
    interfaces = handler("InterfacesHandler", "nodes/{system_id}/interfaces/", ["system_id"],
                         [action("read", "GET")])
    interface = handler("InterfaceHandler", "nodes/{system_id}/interfaces/{id}/",
                        ["system_id", "id"], [action("read", "GET"),
                                              action("link_subnet", "POST", "link_subnet"),
                                              action("unlink_subnet", "POST", "unlink_subnet")])
    events = handler("EventsHandler", "events/", [], [action("query", "GET", "query")])
    auth = [machines, machine, subnets, subnet, interfaces, interface, events]
    if node_devices:  # src/maasserver/api/nodedevices.py: read only (create = update = None)
        auth.append(handler("NodeDevicesHandler", "nodes/{system_id}/devices/", ["system_id"],
                            [action("read", "GET")]))
    return {
        "doc": "MAAS API (testflinger-magic simulator)",
        "hash": "simulator",
        "handlers": [version, users, *auth],
        "resources": [
            {"name": "VersionHandler", "anon": version, "auth": None},
            {"name": "UsersHandler", "anon": None, "auth": users},
        ] + [{"name": h["name"], "anon": None, "auth": h} for h in auth],
    }


def parse_form(content_type: str, body: bytes) -> list[tuple[str, str]]:
    """Parse a POST/PUT body into ``[(name, value)]`` (repeatable names keep their order).

    Accepts ``multipart/form-data`` (parts base64-encoded or not, as python-libmaas and
    ``requests`` send them) and ``application/x-www-form-urlencoded``. Raises ``SimError(400)``
    on a malformed multipart body.
    """
    if not body:
        return []
    if content_type.startswith("multipart/"):
        msg = BytesParser(policy=HTTP).parsebytes(
            b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body)
        if not msg.is_multipart():
            raise SimError(400, "Malformed multipart/form-data body")
        out = []
        for part in msg.iter_parts():
            name = part.get_param("name", header="content-disposition")
            payload = part.get_payload(decode=True) or b""
            if name is None:
                if not payload and not part.keys():
                    continue  # python-libmaas sends one empty part when it has no data
                raise SimError(400, "multipart part without a name")
            out.append((name, payload.decode("utf-8", "replace")))
        return out
    return parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True)


def parse_oauth_header(value: str) -> dict[str, str]:
    """``OAuth k="v", ...`` -> ``{k: unquoted v}``; ``{}`` if not an OAuth header."""
    if not value.startswith("OAuth "):
        return {}
    params = {}
    for item in value[len("OAuth "):].split(","):
        key, _, val = item.strip().partition("=")
        params[key] = unquote(val.strip().strip('"'))
    return params
