"""The agent-host protocol (docs/architecture.md "Agent-host protocol"): register, GET work,
report, heartbeat, with the bindings checks (an agent host is bound to one Testflinger client,
:mod:`.bindings`): a caller acts only for the hosts its client is bound to, and a report may set
only the fields its step sets (:data:`VM_STEP_FIELDS`).

:class:`HostProtocol` is a mixin of :class:`.engine.Engine`: it uses ``self.db``, ``self.store``
(LeaseStore), ``self.events``, ``self.clock``, and the engine's ``_drain_doc``/``_fence_vms``
(actions) and ``_record``.
"""

from __future__ import annotations

import logging

from testflinger_magic import fabric
from testflinger_magic import leases as L
from testflinger_magic.db import DuplicateKeyErrors

from . import devicefacts, hostinstance, keptquarantine, maasbackoff
from .errors import Conflict, Forbidden, Invalid, NotFound

log = logging.getLogger(__name__)

#: Daemon-reported moves (docs/architecture.md "Who moves what"); other legal moves are the
#: server's.
DAEMON_MOVES = {
    L.CLAIMED: {L.FENCED},
    L.FENCED: {L.DEPLOYING},
    L.DEPLOYING: {L.SPLITTING},
    L.SPLITTING: {L.ENROLLING},
    L.ENROLLING: {L.ACTIVE},
    L.RESTORING: {L.RETURNED, L.FAILED},
}
#: Lease states listed by GET work: the daemon's steps plus ``active`` (it re-checks agents).
#: Active leases so the daemon re-checks their VM agents; draining ones, on which it has no step,
#: so that a lease absent from the answer is one the server closed (TRIAL17 F8: a drain read as
#: a close made the daemon end the lease's step and sweep, warning on every ordinary drain).
WORK_STATES = sorted(L.DAEMON_STATES | {L.ACTIVE, L.DRAINING})
#: Fields a daemon report may set on ``lease.vms[index]`` and their types (None allowed where the
#: claim leaves them unset). Anything else is refused: a key such as ``agent_name`` would make
#: later drains fence, and cleanup delete, another agent's document.
VM_REPORT_FIELDS = {
    "maas_system_id": (str, type(None)), "ip": (str, type(None)),
    "metrics_port": (int, type(None)), "domain": (str, type(None)), "mac": (str,),
    "gpus": (list,), "disk": (str,),
}
#: Which ``vms`` fields a report may change, by (lease state, result, to_state): a report may
#: repeat any other field's current value but not change it (422 naming the field). Read from
#: the daemon's steps (agent_host/steps.py): split reports domain/mac/gpus/disk; enroll the
#: MAAS machine, its address and the agent's metrics port; check_active only a moved metrics
#: port. A VM's MAAS machine never changes once enrolled: restore deletes what it names.
VM_STEP_FIELDS = {
    (L.SPLITTING, "ok", L.ENROLLING): frozenset({"domain", "mac", "gpus", "disk"}),
    (L.ENROLLING, "ok", L.ACTIVE): frozenset({"maas_system_id", "ip", "metrics_port"}),
    (L.ACTIVE, "progress", None): frozenset({"metrics_port"}),
}
#: Identity fields the server allocated at claim: a report may repeat them (the daemon's split
#: report does) but never change them.
VM_IDENTITY_FIELDS = ("name", "agent_name")


class HostProtocol:
    """The agent-host calls; mixed into :class:`.engine.Engine`."""

    @property
    def bindings(self):
        """The :class:`.bindings.Bindings` of agent hosts to clients (made on first use)."""
        if getattr(self, "_bindings", None) is None:
            from .bindings import Bindings  # noqa: PLC0415 (it imports this module's errors)

            self._bindings = Bindings(self.db, self.events, self.clock, self._claimed,
                                      self.binding_mode)
        return self._bindings

    def register(self, host: str, devices: list[dict], version: str,
                 client_id: str | None = None, templates: list[str] | None = None,
                 instance: str | None = None,
                 nvswitch_multi_gpu: bool | None = None) -> list[str]:
        """Register ``host`` and its ``devices`` (dicts: agent_name, maas_system_id, gpus, tags,
        home_queues) for the caller ``client_id`` (the token's client; None only for in-process
        callers, which are not bound). Raises :class:`Forbidden` (nothing written) if the host
        is bound to another client or a device (by name or ``maas_system_id``) belongs to another
        host, and :class:`Conflict` (nothing written) for a name clash with a device of another
        host (:meth:`_refuse_global_clashes`) or a magic queue; the first registration
        binds the host to ``client_id`` (bindings.Bindings). ``templates``: the agent template
        folders the host has (stored for apply's warning, server/templatecheck.py; None: not
        said, left as it was). ``instance``: the calling daemon's instance id
        (agent_host/instance.py; None: an older daemon, accepted as before and the stored one
        left as it is); raises :class:`.hostinstance.InstanceConflict` (409, nothing written)
        while another instance holds the host and heartbeats (:func:`.hostinstance.refusal`),
        and records ``agent_host.instance_changed`` when it takes over from a stale one.
        ``nvswitch_multi_gpu``: the host's ``splitter.nvswitch_multi_gpu`` (None: an older
        daemon, the stored one left as it is), kept on each device (fabric.OPT_IN). A device
        registered with another ``gpus`` or ``maas_system_id`` than stored loses its learnt
        facts (``nvswitches``: :func:`.devicefacts.registration_changes`); a device's
        ``nvswitches`` (the count MAAS' commissioning listed; None: unknown) is kept where no
        split's count is (:func:`.devicefacts.record_registration`).
        Returns the device names."""
        if client_id is not None:
            self.bindings.check(host, client_id, unbound_ok=True)
        names = [d["agent_name"] for d in devices]
        self._refuse_magic_names(devices)
        stored = {}
        for doc in self.db.magic_devices.find({"_id": {"$in": names}},
                                              {"agent_host": 1, "gpus": 1, "maas_system_id": 1,
                                               fabric.NVSWITCHES: 1}):
            stored[doc["_id"]] = doc
            if doc.get("agent_host") != host:
                raise Forbidden(f"device {doc['_id']} is registered to agent host "
                                f"{doc.get('agent_host')}, not {host} (an admin frees it: "
                                f"testflinger-magic agent-hosts forget {doc.get('agent_host')})")
        self._refuse_global_clashes(host, devices)
        self._refuse_other_agents(devices)
        now = self.clock()
        if instance is not None:  # the first write: a refused daemon changes nothing
            self._take_instance(host, instance, now, {})
        if client_id is not None:
            self.bindings.pin(host, client_id)
        self._deregister_missing(host, names)
        # Devices whose documents this creates take back a quarantine kept at their
        # deregistration (keptquarantine: only unquarantine lifts one).
        kept = keptquarantine.taken_back(self.db, [d for d in devices
                                                   if d["agent_name"] not in stored])
        for d in devices:
            fields = {"agent_host": host, "maas_system_id": d["maas_system_id"],
                      "gpus": int(d["gpus"]), "tags": list(d.get("tags") or []),
                      "home_queues": list(d.get("home_queues") or []), "updated_at": now,
                      **devicefacts.registration_changes(stored.get(d["agent_name"]), d)}
            if nvswitch_multi_gpu is not None:
                fields[fabric.OPT_IN] = bool(nvswitch_multi_gpu)
            res = self.db.magic_devices.update_one({"_id": d["agent_name"], "agent_host": host},
                                                   {"$set": fields})
            if not res.matched_count:
                record = kept.get(d["agent_name"])
                try:
                    self.db.magic_devices.insert_one({
                        **fields, "_id": d["agent_name"], "registered_at": now,
                        "quarantined": False, "quarantine_reason": None, "failures": 0,
                        "last_lent_at": None,
                        **(keptquarantine.fields(record) if record else {})})
                except DuplicateKeyErrors:
                    raise Forbidden(f"device {d['agent_name']} was just registered by another "
                                    "agent host") from None
                if record:
                    keptquarantine.done(self.db, d["agent_name"], record, host, self.events)
            devicefacts.record_registration(self.db, self.events, now, host, d)
        # Watched by the dispatch hook from now on, not from the next tick (gates.py).
        self.store.gates.ensure(names)
        owned = {"instance": instance} if instance is not None else {}
        try:
            # With an instance: still this caller's (or, for a new host, nobody's): a daemon of
            # another machine registering the same new host at once makes the upsert's insert
            # collide with its document.
            self.db.magic_agent_hosts.update_one(
                {"_id": host, **({"instance": {"$in": [None, instance]}} if owned else {})},
                {"$set": {"devices": names, "last_heartbeat": now, "version": version, **owned,
                          **({"templates": list(templates)} if templates is not None else {})},
                 "$setOnInsert": {"registered_at": now}}, upsert=True)
        except DuplicateKeyErrors:
            raise Conflict(f"agent host {host} was just registered by another daemon instance "
                           f"than {instance!r}; one daemon per agent host") from None
        self.db.magic_agent_hosts.update_one({"_id": host, "registered_at": None},
                                             {"$set": {"registered_at": now}})  # pre-bound
        if owned:  # a new host (or one written meanwhile without an instance)
            self.db.magic_agent_hosts.update_one(
                {"_id": host, "instance": instance, "instance_since": None},
                {"$set": {"instance_since": now}})
        self.events.record("agent_host.registered", f"agent host {host} registered "
                           f"{len(names)} device(s): {', '.join(names)}", data={"host": host})
        return names

    def _refuse_magic_names(self, devices: list[dict]) -> None:
        """Conflict (nothing written) if a device's agent name or home queue is an applied magic
        queue's name (applycheck.device_clashes; apply refuses the same clash from its side):
        one read of ``magic_queues``."""
        from .applycheck import device_clashes  # noqa: PLC0415

        wanted = sorted({d["agent_name"] for d in devices}
                        | {h for d in devices for h in d.get("home_queues") or ()})
        magic = {q["_id"] for q in self.db.magic_queues.find({"_id": {"$in": wanted}}, {"_id": 1})}
        clashes = device_clashes(devices, magic) if magic else []
        if clashes:
            raise Conflict("registration refused: " + "; ".join(clashes))

    def _refuse_other_agents(self, devices: list[dict]) -> None:
        """Refuse (Conflict naming ``devices.<i>.home_queues``, nothing written) a device whose
        Testflinger agent already posted queues none of which is among the device's
        ``home_queues``: the ``agent_name`` names another machine's agent (a typo, or a host
        that should not register it: TRIAL12 F1), whose lend would fence that agent and take
        it off its own queues. A device whose agent has not posted yet, or posted no queues,
        passes. One ``$in`` read (index ``agents(name)``). A host that declares that agent's
        queues passes too: admin-bound agent hosts (``TESTFLINGER_MAGIC_AGENT_HOSTS``) are
        what keeps an untrusted agent client out."""
        names = [d["agent_name"] for d in devices]
        served = {a["name"]: a.get("queues") for a in self.db.agents.find(
            {"name": {"$in": names}}, {"name": 1, "queues": 1})}
        wrong = []
        for i, d in enumerate(devices):
            queues = served.get(d["agent_name"])
            if not isinstance(queues, list) or not queues:
                continue
            home = list(d.get("home_queues") or [])
            if not set(home) & {q for q in queues if isinstance(q, str)}:
                wrong.append(f"devices.{i}.home_queues: {d['agent_name']}'s Testflinger agent "
                             f"serves {sorted(map(str, queues))}, none of its home_queues "
                             f"{home}: agent_name names another machine's agent, or "
                             "home_queues is wrong (agent-host.yaml)")
        if wrong:
            raise Conflict("registration refused: " + "; ".join(wrong))

    def _refuse_global_clashes(self, host: str, devices: list[dict]) -> None:
        """Refuse (nothing written) a device whose ``maas_system_id`` is another agent host's
        device's (Forbidden, like a device of another host: two leases would deploy and release
        one MAAS machine), or whose ``agent_name`` clashes with a device registered elsewhere
        (Conflict naming ``devices.<i>.agent_name``: :func:`testflinger_magic.names.vm_name_clash`,
        a case-only repeat or a VM agent name ``<device>-vm<N>``; names are global). Others: every
        registered device but this host's (those it lists are these, those it no longer lists
        are deregistered). One read of ``magic_devices`` (names and system ids only)."""
        from testflinger_magic.names import name_index, vm_name_clash  # noqa: PLC0415

        listed = {d["agent_name"] for d in devices}
        others = [o for o in self.db.magic_devices.find({}, {"agent_host": 1, "maas_system_id": 1})
                  if o.get("agent_host") != host and o["_id"] not in listed]
        by_id = {o.get("maas_system_id"): o for o in others}
        for i, d in enumerate(devices):
            other = by_id.get(d["maas_system_id"])
            if other is not None:
                raise Forbidden(f"devices.{i}.maas_system_id: MAAS machine {d['maas_system_id']} "
                                f"is device {other['_id']}'s, registered to agent host "
                                f"{other.get('agent_host')}, not {host}: two devices would "
                                "deploy and release one machine (an admin frees it: "
                                f"testflinger-magic agent-hosts forget {other.get('agent_host')})")
        index = name_index(o["_id"] for o in others)
        where = {o["_id"]: f"agent host {o.get('agent_host')}" for o in others}
        clashes = [f"devices.{i}.agent_name: {why}" for i, d in enumerate(devices)
                   if (why := vm_name_clash(d["agent_name"], index, where))]
        if clashes:
            raise Conflict("registration refused: " + "; ".join(clashes))

    def _deregister_missing(self, host: str, names: list[str]) -> list[str]:
        """Deregister the devices of ``host`` it no longer lists: nobody would work their leases
        (the daemon ignores a device it does not drive), so a lease would sit in ``restoring``
        for ever. Refused with :class:`Conflict` naming them while one holds a claim (an open
        lease, or a failed one not yet released): drain it and let it return first.

        Race-free against a claim: a claim takes the claim lock and then checks the device is
        registered (LeaseStore.claim); this deletes the registration and then looks for a claim,
        putting the registration back if one appeared. Returns the deregistered names."""
        gone = list(self.db.magic_devices.find({"agent_host": host, "_id": {"$nin": names}}))
        held = self._claimed([d["_id"] for d in gone])
        if held:
            raise Conflict(f"agent host {host} no longer lists device(s) {', '.join(held)}, "
                           "which still hold a lease (" + ", ".join(
                               f"{d}: {held[d]}" for d in sorted(held)) + "); drain them and "
                           "wait until returned (or unquarantine a failed one) before removing "
                           "them from agent-host.yaml")
        removed, docs = [], []
        for d in gone:
            doc = self.db.magic_devices.find_one_and_delete({"_id": d["_id"], "agent_host": host})
            if doc is None:
                continue
            held = self._claimed([d["_id"]])
            if held:
                self.db.magic_devices.insert_one(doc)
                raise Conflict(f"agent host {host} no longer lists device {d['_id']}, which was "
                               f"just lent ({held[d['_id']]}); drain it first")
            removed.append(d["_id"])
            docs.append(doc)
        if removed:
            kept = keptquarantine.keep(self.db, docs, self.clock())
            self._record("device.deregistered", f"agent host {host} no longer lists "
                         f"{', '.join(removed)}: deregistered"
                         + (f"; the quarantine of {', '.join(kept)} is kept (it stays "
                            "quarantined if registered again)" if kept else ""),
                         data={"host": host, "devices": removed, "quarantine_kept": kept})
        return removed

    def _claimed(self, devices: list[str]) -> dict[str, str]:
        """``{device: "lease <id> (<state>)"}`` of the devices holding a claim."""
        out = {}
        for c in self.db.magic_device_claims.find({"_id": {"$in": devices}}):
            lease = self.db.magic_leases.find_one({"_id": c.get("lease_id")}, {"state": 1}) or {}
            out[c["_id"]] = f"lease {c.get('lease_id')} ({lease.get('state', 'unknown')})"
        return out

    def heartbeat(self, host: str, lease_ids: list[str], client_id: str | None = None,
                  maas_unreachable_since: float | None = None,
                  instance: str | None = None) -> None:
        """Record the host's heartbeat (404 if it never registered; Forbidden if ``client_id``
        may not act for it, see :meth:`register`). ``maas_unreachable_since`` (epoch seconds,
        None: MAAS answers) is kept as the host's ``maas_unreachable_since``: reconcile lends
        none of its devices while it is set (``Inputs.maas_down_hosts``). ``instance``: as in
        :meth:`register` (InstanceConflict, 409, nothing written, while another instance holds
        the host and heartbeats: e.g. this daemon was cut off and another machine's took
        over)."""
        if client_id is not None:
            self.bindings.check(host, client_id)
        now = self.clock()
        if lease_ids:
            # Only leases of this host's devices: a heartbeat may not claim to work another
            # host's (TRIAL19 F5: GET /agent-hosts showed it as working_on them). Two reads,
            # bounded by the schema's list length.
            doc = self.db.magic_agent_hosts.find_one({"_id": host}, {"devices": 1}) or {}
            mine = {d["_id"] for d in self.db.magic_leases.find(
                {"_id": {"$in": sorted(set(lease_ids))},
                 "device": {"$in": sorted(doc.get("devices") or [])}}, {"_id": 1})}
            lease_ids = [x for x in lease_ids if x in mine]
        fields = {"last_heartbeat": now, "working_on": lease_ids,
                  "maas_unreachable_since": maas_unreachable_since}
        if instance is not None:
            if self._take_instance(host, instance, now, fields) is None:
                raise NotFound(f"agent host {host} is not registered")
            return
        res = self.db.magic_agent_hosts.update_one({"_id": host}, {"$set": fields})
        if not res.matched_count:
            raise NotFound(f"agent host {host} is not registered")

    def _take_instance(self, host: str, instance: str, now: float, fields: dict) -> dict | None:
        """:func:`.hostinstance.take` (``fields`` set with the accepted instance) plus the
        ``agent_host.instance_changed`` event when ``instance`` took over from a stale other
        one. Returns the document as read (None: the host has none, nothing written)."""
        before = hostinstance.take(self.db, host, instance, now, fields)
        message = hostinstance.takeover_message(host, before, instance, now)
        if message:
            self._record("agent_host.instance_changed", message,
                         data={"host": host, "instance": instance,
                               "previous_instance": before.get("instance"),
                               "previous_heartbeat": before.get("last_heartbeat")})
            log.warning("%s", message)
        return before

    def agent_hosts(self) -> list[dict]:
        """Agent host documents by name: ``{_id, client_id (bound client), devices, version,
        registered_at, last_heartbeat, working_on, instance (the daemon instance accepted,
        absent: none said yet), instance_since, ...}``."""
        return list(self.db.magic_agent_hosts.find({}, sort=[("_id", 1)]))

    def work_for(self, host: str, client_id: str | None = None) -> list[dict]:
        """Open leases of ``host`` the daemon should look at (WORK_STATES), oldest first.
        Forbidden if ``client_id`` may not act for ``host`` (see :meth:`register`)."""
        if client_id is not None:
            self.bindings.check(host, client_id)
        return [d for d in self.store.list(agent_host=host, open_only=True)
                if d["state"] in WORK_STATES]

    def report(self, lease_id: str, body: dict, client_id: str | None = None) -> dict:
        """Apply a daemon report (shape: docs/architecture.md "Agent-host protocol") from the
        caller ``client_id`` (None only for in-process callers).

        Raises NotFound, Forbidden (another host's lease/device, or a client the lease's agent
        host is not bound to), Conflict (stale state or generation, with the current lease),
        Invalid (illegal ``to_state``, bad ``vms``: a field that step may not set, see
        :data:`VM_STEP_FIELDS`). Nothing is written unless every check passed. Returns the new
        lease document.
        """
        try:
            lease = self.store.get(lease_id)
        except L.LeaseNotFound:
            raise NotFound(f"no lease {lease_id}") from None
        if client_id is not None:
            self.bindings.check(lease.get("agent_host") or "", client_id)
        host = body["agent_host"]
        device = self.db.magic_devices.find_one({"_id": lease["device"]}, {"agent_host": 1}) or {}
        if lease.get("agent_host") != host or device.get("agent_host", host) != host:
            raise Forbidden(f"lease {lease_id} is for device {lease['device']} of agent host "
                            f"{lease.get('agent_host')}, not {host}")
        state, gen = body["state"], body["generation"]
        if lease["state"] != state or lease["generation"] != gen:
            raise Conflict(f"lease {lease_id} is {lease['state']}@{lease['generation']}, "
                           f"report was for {state}@{gen}", lease)
        settable = VM_STEP_FIELDS.get((state, body["result"], body.get("to_state") or None),
                                      frozenset())
        for i, vm in enumerate(body.get("vms") or []):
            self._check_vm_report(lease, i, vm, settable)
        intent, vms = body.get("intent") or [], body.get("vms") or []
        message = body.get("message") or ""
        blame = body.get("blame") or "device"
        if body.get("quarantine") and (body["result"] != "error" or (
                state != L.RESTORING and state not in L.BRINGUP_STATES)):
            raise Invalid("quarantine", "only an error report of a restore or of a bring-up "
                          "step may quarantine")
        facts = devicefacts.check_facts(body.get("facts"))
        if blame == "hardware" and body["result"] == "error" and not facts:
            # Without the fact the server would pick the device again and burn another deploy.
            raise Invalid("facts", "blame 'hardware' names the device fact at fault, e.g. "
                          "{\"nvswitches\": 4}")
        try:
            new = self._report(lease, body["result"], body.get("to_state"), message, intent,
                               vms, blame)
            if facts:  # after the lease moved: a refused (stale) report writes nothing
                devicefacts.record(self.db, self.events, self.clock(), lease, facts,
                                   refused=blame == "hardware" and body["result"] == "error")
            if body.get("quarantine"):
                # Verified give-back failed: the device's agent must not get its queues back
                # until a person has looked (unquarantine also frees the failed lease). Or a
                # bring-up step found the device's registration wrong (it promises more GPUs
                # than the host can lend): every lend would fail the same way, a bare-metal
                # deploy each, so none is tried until a person fixed it (TRIAL5 finding 9).
                self._quarantine(lease["device"], True, message or "give-back check failed",
                                 queue=lease["queue"])
            return new
        except L.StaleGeneration as exc:
            raise Conflict(str(exc), exc.lease) from None
        except L.IllegalTransition as exc:
            raise Invalid("to_state", str(exc)) from None

    @staticmethod
    def _check_vm_report(lease: dict, i: int, vm: dict, settable=frozenset()) -> None:
        """Refuse (Invalid ``vms.<i>.<key>``) a ``vms`` entry with an index out of range, a key
        outside VM_REPORT_FIELDS, a value of the wrong type, an identity field
        (``name``/``agent_name``) that differs from what the claim allocated, or a field not in
        ``settable`` (this step's VM_STEP_FIELDS) whose value differs from the lease's."""
        index = vm.get("index")
        if isinstance(index, bool) or not isinstance(index, int) \
                or not 0 <= index < len(lease["vms"]):
            raise Invalid(f"vms.{i}.index", f"must be an integer in 0..{len(lease['vms']) - 1}")
        for key, value in vm.items():
            if key == "index":
                continue
            if key in VM_IDENTITY_FIELDS:
                planned = lease["vms"][index].get(key)
                if value != planned:
                    raise Invalid(f"vms.{i}.{key}", f"is {planned!r}, allocated at claim; a "
                                  "report cannot change it")
                continue
            types = VM_REPORT_FIELDS.get(key)
            if types is None:
                raise Invalid(f"vms.{i}.{key}", "unknown field; a report may set only "
                              + ", ".join(sorted(VM_REPORT_FIELDS)))
            if isinstance(value, bool) or not isinstance(value, types):
                raise Invalid(f"vms.{i}.{key}", "must be " + " or ".join(
                    "null" if t is type(None) else t.__name__ for t in types))
            if key == "gpus" and not all(isinstance(g, str) for g in value):
                raise Invalid(f"vms.{i}.gpus", "must be a list of PCI addresses (strings)")
            if key == "metrics_port" and value is not None and not 1 <= value <= 65535:
                raise Invalid(f"vms.{i}.metrics_port", "must be in 1..65535")
            current = lease["vms"][index].get(key)
            if key not in settable and value != current:
                steps = sorted(f"{s} {r}" + (f" -> {t}" if t else "")
                               for (s, r, t), keys in VM_STEP_FIELDS.items() if key in keys)
                raise Invalid(f"vms.{i}.{key}", f"a {lease['state']} report may not change it "
                              f"(is {current!r}); only {' or '.join(steps)} sets it")

    def _report(self, lease, result, to_state, message, intent, vms, blame="device") -> dict:
        lid, state, gen = lease["_id"], lease["state"], lease["generation"]
        if result == "progress":
            # The last progress message (e.g. "MAAS unreachable since ...") is kept so status
            # can say why a bring-up or restore is slow (TRIAL finding 17).
            note = {"progress_note": {"message": message, "state": state, "at": self.clock()}} \
                if message else None
            return self.store.progress(lid, state, gen, push_intent=intent, merge_vms=vms,
                                       set_fields=note)
        if result == "ok":
            if not to_state:
                raise Invalid("to_state", "required with result 'ok'")
            if to_state not in DAEMON_MOVES.get(state, ()):
                legal = ", ".join(sorted(DAEMON_MOVES.get(state, ()))) or "none"
                raise Invalid("to_state", f"{state} -> {to_state} is not a move the agent host "
                                          f"reports (from {state}: {legal})")
            if to_state in L.FINAL_STATES:
                if intent or vms:
                    lease = self.store.progress(lid, state, gen, push_intent=intent, merge_vms=vms)
                    gen = lease["generation"]
                return self.store.close(lid, gen, to_state, message or to_state)
            extra = {"idle_since": self.clock()} if to_state == L.ACTIVE else {}
            new = self.store.transition(lid, state, gen, to_state, message or "ok",
                                        set_fields=extra, push_intent=intent, merge_vms=vms)
            if to_state == L.SPLITTING:  # MAAS deployed it: any refusals in a row are over
                maasbackoff.clear(self.db, new["device"])
            if to_state == L.ACTIVE:
                # The VM agents were fenced at claim so none takes a job during bring-up; they
                # get jobs from now on. A crash before this is repaired by the next tick.
                self.store.lift_vm_fences(new)
            return new
        # result == "error"
        reason = message or "agent host reported an error"
        if state in L.BRINGUP_STATES:
            new = self.store.transition(lid, state, gen, L.RESTORING, reason,
                                        set_fields={"error": reason}, push_intent=intent,
                                        merge_vms=vms)
            if blame == "maas":
                # MAAS was unreachable, or refused the machine with a 503 (PowerProblem): no
                # failure counted, but the device is held back, longer each time in a row, so
                # a machine MAAS cannot power is not lent again at once for ever (maasbackoff).
                doc = maasbackoff.count(self.db, lease["device"], reason, self.clock()) or {}
                wait = maasbackoff.backoff_seconds(int(doc.get("maas_refusals") or 0))
                self.events.record("lease.maas_unreachable",
                                   f"{lease['queue']}: lease {lid} on {lease['device']} restored: "
                                   f"MAAS unreachable from agent host {lease.get('agent_host')} "
                                   f"or refusing the machine (no failure counted; not lent for "
                                   f"{int(wait)}s, refusal {doc.get('maas_refusals', 1)} in a "
                                   f"row): {reason}", queue=lease["queue"],
                                   device=lease["device"], lease_id=lid)
            elif blame == "hardware":
                # The device's hardware cannot serve this queue's VM shape (NVSwitches and
                # VMs of several GPUs: the report's facts say so, kept on the device by the
                # caller): neither a failure of the device nor a fault of the queue, whose
                # other devices may serve it. Reconcile no longer picks the device for it.
                self.events.record("lease.unfit_device",
                                   f"{lease['queue']}: lease {lid} on {lease['device']} restored: "
                                   f"the device cannot serve this queue (no failure counted, "
                                   f"queue not suspended; it is not lent to it again): {reason}",
                                   queue=lease["queue"], device=lease["device"], lease_id=lid)
            elif blame == "queue":
                # The queue's definition is at fault (e.g. its VM spec does not fit): counting
                # it against the device would quarantine healthy machines of every queue.
                self._suspend_queue(new, reason)
            else:
                self.store.record_failure(lid, reason)
            return new
        if state == L.RESTORING:
            if intent or vms:
                lease = self.store.progress(lid, state, gen, push_intent=intent, merge_vms=vms)
                gen = lease["generation"]
            return self.store.close(lid, gen, L.FAILED, reason)
        if state == L.ACTIVE:
            drain = self._drain_doc(lease, reason, None, False, "error")
            new = self.store.transition(lid, state, gen, L.DRAINING, reason,
                                        set_fields={"drain": drain, "error": reason},
                                        push_intent=intent, merge_vms=vms)
            self._fence_vms(new, reason)
            return new
        return self.store.progress(lid, state, gen, push_intent=intent, merge_vms=vms,
                                   set_fields={"error": reason})

    def _suspend_queue(self, lease: dict, reason: str) -> bool:
        """Stop lending for the lease's queue until a changed definition is applied (or
        ``apply --unsuspend``, plugin.apply): set
        ``magic_queues.suspended = {reason, at, lease_id, device}`` (compare-and-set on
        ``applied_at``, so a definition re-applied after this lease's claim, which may be the
        fix, is not suspended), and record ``queue.misconfigured`` (webhooks are notified).
        Returns True if this call suspended the queue."""
        queue = lease["queue"]
        doc = self.db.magic_queues.find_one({"_id": queue}, {"applied_at": 1})
        applied_at = doc.get("applied_at") if doc else None
        fresh = applied_at is not None and applied_at > (lease.get("created_at") or 0)
        done = False
        if doc is not None and not fresh:
            res = self.db.magic_queues.update_one(
                {"_id": queue, "applied_at": applied_at, "suspended": None},
                {"$set": {"suspended": {"reason": reason, "at": self.clock(),
                                        "lease_id": lease["_id"], "device": lease["device"]}}})
            done = bool(res.modified_count)
        if done:
            what = ("lending suspended until a changed definition is applied (or apply "
                    "--unsuspend once the cause is fixed elsewhere)")
        elif fresh:
            what = "not suspended: the definition was applied again since this lease's claim"
        else:
            what = "lending already suspended" if doc is not None else "queue no longer defined"
        self.events.record("queue.misconfigured",
                           f"{queue}: lease {lease['_id']} on {lease['device']} failed because of "
                           f"the queue's definition, not the device (no failure counted); {what}: "
                           f"{reason}", queue=queue, device=lease["device"],
                           lease_id=lease["_id"], data={"suspended": done})
        return done
