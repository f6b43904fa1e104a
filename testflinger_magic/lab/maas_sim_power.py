"""The MAAS simulator's power control and node events.

:class:`PowerMixin` is part of :class:`~testflinger_magic.lab.maas_sim.MaasSimulator`: a virsh
machine is powered through :mod:`.virsh_power` (MAAS' virsh power driver, reached over the
rack's SSH); other power types are not modelled (their power state is only recorded). A power
action that fails leaves the rack's failure event on the node (maascommon/events.py), and
``GET events/?op=query`` (maasserver/api/events.py ``EventsHandler.query``) lists the events.
"""

from __future__ import annotations

import base64
import time

from testflinger_magic.agent_host import maas_status as st
from testflinger_magic.lab import maas_sim_parts as parts
from testflinger_magic.lab import virsh_power
from testflinger_magic.lab.maas_sim_records import USERNAME, Machine, SimError


class PowerMixin:
    """Power on/off and node events (see the module docstring); mixed into ``MaasSimulator``
    (uses its ``virsh``, ``_machines``, ``_event_ids``, ``_advance`` and
    ``_finalize_release``), whose lock every caller holds."""

    def events(self, system_id: str) -> list[dict]:
        """The machine's events, newest first (``GET events/?op=query&id=<system_id>``)."""
        with self._lock:
            m = self._machines[system_id]
            return [e.json(m.system_id, m.hostname, USERNAME) for e in reversed(m.events)]

    def _virsh_lookup(self, host: str):
        """A Deployed machine holding address ``host`` whose hostname is a registered virsh
        host: that host, accepting the ``ssh_authorized_keys`` of the machine's deploy user_data
        (cloud-init puts them in the default user's authorized_keys)."""
        for m in self._machines.values():
            if m.pending and m.power_type != "virsh":  # (a virsh one would recurse here)
                self._advance(m)
            ips = {link.ip for links in m.links.values() for link in links if link.ip}
            known = self.virsh.static.get(m.hostname)
            if host in ips and known is not None and m.status_name == st.DEPLOYED:
                return virsh_power.VirshHost(known.uri, self._deploy_keys(m), known.password)
        return None

    def _deploy_keys(self, m: Machine) -> list[str]:
        """The ``ssh_authorized_keys`` of ``m``'s deploy user_data, parsed once per user_data
        (a power call or query of each of its VMs looks them up, under the simulator's lock:
        parsing the YAML each time cost the lab's 8-lease bring-up ~0.1 s of CPU that no MAAS
        spends, counted as the project's own time by benchmarks/lab_latency.py)."""
        import yaml

        cached = self._keys_cache.get(m.system_id)
        if cached is not None and cached[0] is m.user_data:
            return list(cached[1])
        keys: list[str] = []
        try:
            doc = yaml.safe_load(base64.b64decode(m.user_data or b"") or b"") or {}
            keys = [str(k) for k in (doc.get("ssh_authorized_keys") or [])]
        except (ValueError, yaml.YAMLError, AttributeError):
            pass
        self._keys_cache[m.system_id] = (m.user_data, tuple(keys))
        return keys

    def _power(self, m: Machine, change: str) -> None:
        """Power ``m`` on/off; a virsh machine through ``virsh_power`` (``VirshError``)."""
        if m.power_type == "virsh":
            p = m.power_parameters
            virsh_power.power_control(self.virsh, p.get("power_address", ""),
                                      p.get("power_id", ""), change, p.get("power_pass"))
        m.power_state = change

    def _virsh_running(self, m: Machine) -> bool:
        """Whether a virsh machine's domain runs now (``power_state_virsh``); False when the
        query fails."""
        p = m.power_parameters
        try:
            m.power_state = virsh_power.power_state(self.virsh, p.get("power_address", ""),
                                                    p.get("power_id", ""), p.get("power_pass"))
        except virsh_power.VirshError:
            return False
        return m.power_state == "on"

    def _event(self, m: Machine, kind: tuple[str, str], description: str) -> None:
        m.events.append(parts.Event(next(self._event_ids), kind[0], kind[1], description,
                                    time.time()))
        m.status_message = m.events[-1].status_message()  # Node.status_message: latest event

    def _power_failed(self, m: Machine, change: str, old: str, error: str, start: bool) -> None:
        """A power action failed: the rack's failure event, then the machine back in ``old``
        (``_start_bmc_unavailable`` registers NODE_POWER_QUERY_FAILED for a start)."""
        busy = m.status_name
        m.pending = None
        self._event(m, parts.POWER_ON_FAILED if change == "on" else parts.POWER_OFF_FAILED, error)
        if start:
            self._event(m, parts.POWER_QUERY_FAILED,
                        parts.bmc_unavailable_message(USERNAME, busy, old))
        m.status_name = old

    def _op_power_on(self, m, form):
        self._power_op(m, "on")

    def _op_power_off(self, m, form):
        # Node.update_power_state: a Releasing machine that is now off is released.
        self._power_op(m, "off")
        if m.status_name == st.RELEASING:
            self._finalize_release(m)

    def _power_op(self, m, change):
        try:
            self._power(m, change)
        except virsh_power.VirshError as e:
            # The API answers at once; the rack's failure shows in the events.
            self._event(m, parts.POWER_ON_FAILED if change == "on" else parts.POWER_OFF_FAILED,
                        str(e))

    def _h_events(self, request):
        """maasserver/api/events.py ``EventsHandler.query``: events of the machines named by
        ``id`` (system ids), at ``level`` (default INFO) or above, newest first, ``limit``
        (default 100, at most 1000) of them."""
        if request.args.get("op") != "query":
            raise SimError(400, f"Unrecognised signature: method=GET op={request.args.get('op')}")
        level = request.args.get("level", "INFO")
        if level not in parts.LEVELS:
            raise SimError(400, f"Unrecognised log level: {level}")
        try:
            limit = int(request.args.get("limit", parts.DEFAULT_EVENT_LOG_LIMIT))
        except ValueError:
            raise SimError(400, {"limit": ["Enter a whole number."]}) from None
        if limit > parts.MAX_EVENT_LOG_COUNT:
            raise SimError(400, f"Requested number of events {limit} is greater than limit: "
                                f"{parts.MAX_EVENT_LOG_COUNT}")
        ids = set(request.args.getlist("id"))
        found = []
        for m in self._machines.values():
            if ids and m.system_id not in ids:
                continue
            found += [(e, m) for e in m.events if parts.LEVELS[e.level] >= parts.LEVELS[level]]
        found.sort(key=lambda em: -em[0].id)
        events = [e.json(m.system_id, m.hostname, USERNAME) for e, m in found[:max(1, limit)]]
        return {"count": len(events), "events": events, "next_uri": "", "prev_uri": ""}
