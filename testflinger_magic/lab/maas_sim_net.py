"""The MAAS simulator's networking: subnets, interface links, addresses and bridges.

:class:`NetworkMixin` is part of :class:`~testflinger_magic.lab.maas_sim.MaasSimulator` (it uses
its ``_subnets``, ``_machines``, ``_link_ids``, ``_iface_ids``, ``_get`` and ``_form``); the
records and documents it works on are in :mod:`.maas_sim_records`.

Addresses (data only, never contacted) follow MAAS' link modes (MAAS API reference, "Interface",
``link_subnet``): commissioning leaves the boot interface with an AUTO link on the first subnet
(also true of machines added in any status but New); an AUTO link gets an address at deploy and
loses it at release; a STATIC link keeps its address until unlinked or the machine is deleted.
``ip_addresses`` lists every linked address. Addresses come from the simulated subnets (default
``10.77.0.0/16``), never twice across machines; each subnet's gateway (first host) and dynamic
range (top quarter, MAAS' DHCP pool) are never handed out.

HTTP: ``GET subnets/``, ``GET subnets/<id>/``; ``GET nodes/<system_id>/interfaces/``,
``GET nodes/<system_id>/interfaces/<id>/`` and ``POST nodes/<system_id>/interfaces/<id>/?op=``
``link_subnet`` / ``unlink_subnet`` (MAAS API reference: "Subnets", "Interfaces", "Interface").
``bridge_all`` at allocation puts a bridge on every configured interface
(maasserver/models/node.py ``_create_acquired_bridges``).
"""

from __future__ import annotations

import ipaddress

from testflinger_magic.agent_host import maas_status as st
from testflinger_magic.lab import maas_sim_parts as parts
from testflinger_magic.lab.maas_sim_records import Link, Machine, SimError, Subnet, form_bool, interface_json

# MAAS INTERFACE_LINK_TYPE values (lower case in documents; the API takes any case).
_LINK_MODES = ("auto", "dhcp", "static", "link_up")
# Statuses in which interface links may change (maasserver/api/interfaces.py ALLOWED_STATES).
_LINKABLE = st.LINKABLE
DEFAULT_SUBNETS = ("10.77.0.0/16",)


class NetworkMixin:
    """Subnets, links, addresses and bridges of the simulated machines (see the module
    docstring); mixed into ``MaasSimulator``, whose lock every caller holds."""

    def subnets(self) -> list[dict]:
        """The subnet documents (``GET subnets/``)."""
        return [sn.json() for sn in self._subnets]

    def _used(self, subnet: Subnet) -> set[str]:
        return {link.ip for m in self._machines.values() for links in m.links.values()
                for link in links if link.ip and link.subnet is subnet}

    def _free_ip(self, subnet: Subnet) -> str:
        """Lowest address of ``subnet`` that no link holds, outside the gateway and dynamic range;
        ``SimError(503)`` when there is none (MAAS' StaticIPAddressExhaustion)."""
        used = self._used(subnet)
        for ip in subnet.network.hosts():
            if ip != subnet.gateway and not subnet.dynamic(ip) and str(ip) not in used:
                return str(ip)
        raise SimError(503, f"No more IPs available in subnet: {subnet.network}.")

    def _auto_link(self, m: Machine) -> None:
        """What commissioning leaves on a boot interface without links: AUTO on its subnet."""
        boot = m.interface_ids[0]
        if m.vlan is not None and not m.links.get(boot):
            m.links[boot] = [Link(next(self._link_ids), "auto", m.vlan)]

    def _deploy_addresses(self, m: Machine) -> None:
        for links in m.links.values():
            for link in links:
                if link.mode == "auto" and not link.ip:
                    link.ip = self._free_ip(link.subnet)

    @staticmethod
    def _release_addresses(m: Machine) -> None:
        for links in m.links.values():
            for link in links:
                if link.mode == "auto":
                    link.ip = None

    def _create_bridges(self, m: Machine, form: dict) -> None:
        """``bridge_all`` at allocation: maasserver/models/node.py ``_create_acquired_bridges``
        puts a bridge (``Interface.create_acquired_bridge``) on every configured interface (one
        with a link that is not LINK_UP) and moves its links onto the bridge."""
        bridge_type = form.get("bridge_type", "standard")
        if bridge_type not in parts.BRIDGE_TYPES:
            raise SimError(400, {"bridge_type": [f"bridge_type must be one of "
                                                 f"{', '.join(parts.BRIDGE_TYPES)}"]})
        try:
            fd = int(form.get("bridge_fd") or parts.DEFAULT_BRIDGE_FD)
        except ValueError:
            raise SimError(400, {"bridge_fd": ["Enter a whole number."]}) from None
        params = {"bridge_type": bridge_type, "bridge_fd": fd,
                  "bridge_stp": form_bool(form.get("bridge_stp", ""))}
        for iid in m.interface_ids:
            links = m.links.get(iid, [])
            if iid in m.bridges or not any(link.mode != "link_up" for link in links):
                continue
            bridge = next(self._iface_ids)
            m.bridges[iid] = (bridge, params)
            m.links[bridge] = m.links.pop(iid)

    # -- HTTP handlers (MAAS API reference: "Subnets", "Interfaces", "Interface")

    def _h_subnets(self, request):
        if request.args.get("op"):
            raise SimError(400, f"Unrecognised signature: method=GET op={request.args['op']}")
        return self.subnets()

    def _h_subnet(self, request, subnet_id):
        for sn in self._subnets:
            if sn.id == subnet_id:
                return sn.json()
        raise SimError(404, "No Subnet matches the given query.")

    def _h_interfaces(self, request, system_id):
        m = self._get(system_id)
        return [interface_json(m, iid) for iid in m.interface_ids]

    def _h_interface(self, request, system_id, iface_id):
        m = self._get(system_id)
        if iface_id not in m.interface_ids:
            raise SimError(404, "No Interface matches the given query.")
        op = request.args.get("op")
        if request.method == "GET":
            if op:
                raise SimError(400, f"Unrecognised signature: method=GET op={op}")
            return interface_json(m, iface_id)
        if op not in ("link_subnet", "unlink_subnet"):
            raise SimError(400, f"Unrecognised signature: method=POST op={op}")
        if m.status_name not in _LINKABLE:
            verb = "link" if op == "link_subnet" else "unlink"
            raise SimError(409, f"Cannot {verb} interface because the machine is not Ready, "
                                "Allocated, or Broken.")
        form = dict(self._form(request))
        links = m.links.setdefault(iface_id, [])
        if op == "unlink_subnet":
            ids = {str(link.id): link for link in links}
            link = ids.get(form.get("id", ""))
            if link is None:
                raise SimError(400, {"id": [f"Select a valid choice. {form.get('id')!r} is not "
                                            "one of the available choices."]})
            links.remove(link)
        else:
            self._link_subnet(m, links, form)
        return interface_json(m, iface_id)

    def _subnet_for(self, spec: str) -> Subnet | None:
        """A subnet by id or CIDR (MAAS' SpecifierOrModelChoiceField takes either)."""
        for sn in self._subnets:
            if spec in (str(sn.id), str(sn.network)):
                return sn
        return None

    def _link_subnet(self, m: Machine, links: list, form: dict) -> None:
        """``op=link_subnet`` as maasserver's InterfaceLinkForm validates and saves it."""
        errors: dict[str, list[str]] = {}
        mode = form.get("mode", "").lower()
        force = form.get("force", "").lower() in ("1", "true", "yes", "on")
        if mode not in _LINK_MODES:
            errors["mode"] = [f"Select a valid choice. {form.get('mode', '')!r} is not one of "
                              "the available choices."]
        subnet = None
        if form.get("subnet"):
            subnet = self._subnet_for(form["subnet"])
            # Without force only subnets of the interface's VLAN may be chosen.
            if subnet is None or (not force and m.vlan is not None and subnet.vlan_id
                                  != m.vlan.vlan_id):
                errors["subnet"] = ["Select a valid choice. That choice is not one of the "
                                    "available choices."]
        elif mode in ("auto", "static"):
            errors["subnet"] = ["This field is required."]
        ip = form.get("ip_address") or None
        if mode == "static" and ip and subnet is not None and "subnet" not in errors:
            try:
                addr = ipaddress.ip_address(ip)
            except ValueError:
                errors["ip_address"] = ["Enter a valid IPv4 or IPv6 address."]
            else:
                if addr not in subnet.network:
                    errors["ip_address"] = [f"IP address is not in the given subnet "
                                            f"'{subnet.network}'."]
                elif subnet.dynamic(addr):
                    errors["ip_address"] = ["IP address is inside a dynamic range."]
        if mode == "dhcp" and any(link.mode == "dhcp" for link in links):
            errors["mode"] = ["Interface is already set to DHCP."]
        if mode == "link_up" and links and not force:
            errors["mode"] = ["Cannot configure interface to link up (with no IP address) while "
                              "other links are already configured. Specify force=True to "
                              "override this behavior and delete all links."]
        if errors:
            raise SimError(400, errors)
        if mode == "static":
            if ip and ip in self._used(subnet):
                raise SimError(409, f"IP address {ip} is already in use.")
            ip = ip or self._free_ip(subnet)
        else:
            ip = None
        if mode == "link_up" or force:
            links.clear()
        if force and subnet is not None:
            m.vlan = subnet
        links.append(Link(next(self._link_ids), mode, subnet, ip))
