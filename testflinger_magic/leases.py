"""Leases: states, the legal transitions, and the MongoDB store (every change a compare-and-set).

A lease is one lending of one device to one magic queue (docs/architecture.md "Lease document").
Who may lend a device is decided by the database, not by code that reads then writes:

* ``magic_device_claims`` (``_id`` = device) makes "one open lease per device" a unique index.
* ``magic_fences`` (``_id`` = agent) keeps an agent from getting jobs. Every fence change is
  mirrored into the agent's ``magic_agent_gate`` document (:mod:`testflinger_magic.gates`), the
  one document ``GET /v1/job`` reads; with the ``magic_dispatch`` markers written when a job is
  handed out it makes release race-free (docs/architecture.md, "The dispatch handshake").
* ``magic_resources`` (``_id`` = ``mac:<mac>``) makes VM MACs unique across every agent host.

Every lease update filters on ``{_id, state, generation}`` and increments ``generation``, so a
repeated daemon report or a second server replica can never apply one step twice.
"""

from __future__ import annotations

import logging
import random
import secrets
import time
from typing import Callable, Iterable

from . import fairness, indexes, tfstates
from .db import DuplicateKeyErrors, ReturnDocument
from .events import EventLog
from .gates import DISPATCH_PENDING_TTL, Gates  # noqa: F401 (DISPATCH_PENDING_TTL re-exported)
from .lease_repairs import LeaseRepairs
from .lease_states import LENT_AGENT_STATE, NOT_FREE_AGENT_STATES  # noqa: F401 (re-exported)
from .lease_states import AFTER_ACTIVE_STATES, first_active
from .lease_states import (  # noqa: F401 (re-exported: leases is where callers import them)
    ACTIVE, ACTIVE_LIFT_AGE, BRINGUP_STATES, CLAIMED, CLOSE_CLEANUP_AGE, DAEMON_STATES,
    DEFAULT_FORCE_WAIT, DEFAULT_GRACE, DEFAULT_PROVISION_TIMEOUT, DEPLOYING, DRAINING, ENROLLING,
    FAILED, FENCED,
    FINAL_STATES, OPEN_STATES, ORPHAN_CLAIM_AGE, RESTORE_TIMEOUT, RESTORING, RETURNED, SPLITTING,
    STATES, TRANSITIONS, VM_DISK_DIR, ClaimRefused, IllegalTransition, LeaseError, LeaseNotFound,
    StaleGeneration, _policy_of_lease, deadline_for, is_legal, lent_comment)
from .names import vm_name


class LeaseStore(LeaseRepairs):
    """Lease documents and their side collections (see the module docstring).

    ``db``: from :func:`testflinger_magic.db.connect` (Testflinger's database: ``agents`` and
    ``jobs`` are read, and only the ``state``/``comment`` of a device agent and the documents of
    our own VM agents are written). ``clock() -> epoch seconds``. ``events``: an
    :class:`~testflinger_magic.events.EventLog` (one on ``db`` by default). ``rng``: for MACs.
    """

    def __init__(self, db, clock: Callable[[], float] = time.time, events: EventLog | None = None,
                 rng: random.Random | None = None):
        self.db = db
        self.clock = clock
        self.events = events if events is not None else EventLog(db, clock)
        self._rng = rng or random.SystemRandom()
        self.leases = db["magic_leases"]
        self.claims = db["magic_device_claims"]
        self.fences = db["magic_fences"]
        self.dispatch = db["magic_dispatch"]
        self.resources = db["magic_resources"]
        self.devices = db["magic_devices"]
        self.agents = db["agents"]
        self.jobs = db["jobs"]
        #: The dispatch gate (one document per watched agent) and the busy checks.
        self.gates = Gates(db, clock, OPEN_STATES)

    def ensure_indexes(self) -> None:
        """Create the indexes our queries use (``_id`` uniqueness does the locking): every
        index of the table in :mod:`testflinger_magic.indexes` that is ours."""
        indexes.ensure(self.db)

    # ----------------------------------------------------------------- reads

    def get(self, lease_id: str) -> dict:
        """The lease document; raises :class:`LeaseNotFound`."""
        doc = self.leases.find_one({"_id": lease_id})
        if doc is None:
            raise LeaseNotFound(f"no lease {lease_id!r}")
        return doc

    def list(self, queue: str | None = None, state: str | None = None, open_only: bool = False,
             device: str | None = None, agent_host: str | None = None) -> list[dict]:
        """Leases matching every given filter, oldest first."""
        flt: dict = {}
        if queue is not None:
            flt["queue"] = queue
        if device is not None:
            flt["device"] = device
        if agent_host is not None:
            flt["agent_host"] = agent_host
        if state is not None:
            flt["state"] = state
        elif open_only:
            flt["state"] = {"$in": sorted(OPEN_STATES)}
        return list(self.leases.find(flt, sort=[("created_at", 1)]))

    def open_lease_for_device(self, device: str) -> dict | None:
        """The device's open lease, or None."""
        found = list(self.leases.find({"device": device, "state": {"$in": sorted(OPEN_STATES)}}, limit=1))
        return found[0] if found else None

    # ----------------------------------------------------------------- claim

    def claim(self, device: str, queue_def, agent_host: str, vms: int, reason: str,
              by_hand: bool = False) -> dict:
        """Lend ``device`` to ``queue_def`` (a MagicQueue): create the lease in ``claimed``.
        ``by_hand``: an operator's lend (``lend DEVICE QUEUE``), stored as the lease's
        ``by_hand``: reconcile never drains it as ``unneeded`` during its bring-up.

        Steps: (a) the claim lock ``magic_device_claims[device]``; (b) the lease with ``vms``
        planned VMs (name ``<device>-vm<N>``, N from 1; ``index`` = list position from 0; a unique
        MAC; disk ``/var/lib/libvirt/images/<lease>-<name>.qcow2``); (c) the device fence, and the
        Testflinger ``agents`` document set ``maintenance`` (:data:`LENT_AGENT_STATE`) with comment
        :func:`lent_comment` (only if
        it is ``waiting`` with no ``job_id``: a compare-and-set, the claim's one read of that
        document); (d) then the proof that no job slipped in (no in-flight dispatch, no
        dispatched job that is not terminal, no job of a queue it polls just handed out to no
        one: :meth:`claim_checks`, one ``jobs`` read). Any failure undoes all of it and raises
        :class:`ClaimRefused`; a job is never touched. Returns the lease document.

        The planned VM agent names are fenced here too (kind ``vm``, generation 0): the daemon
        starts each VM agent during ``enrolling``, and if bring-up then fails the lease goes to
        ``restoring`` and the agent is torn down; fenced from the start, it can never have taken
        a job. The report that makes the lease ``active`` lifts these fences
        (:meth:`lift_vm_fences`), so a VM agent gets jobs only while its lease is ``active``.
        """
        if vms < 1:
            raise ClaimRefused(f"{device}: a lease needs at least one VM (got {vms})")
        qname = queue_def.name
        now = self.clock()
        lease_id = "lease-" + secrets.token_hex(6)
        try:
            self.claims.insert_one({"_id": device, "lease_id": lease_id, "queue": qname, "at": now})
        except DuplicateKeyErrors:
            raise self._refused(device, qname, "device already lent") from None
        undo = _Undo()
        undo.add(lambda: self.claims.delete_one({"_id": device, "lease_id": lease_id}))
        try:
            # After the claim lock: an agent host deregistering the device deletes the
            # registration and then looks for a claim (Engine._deregister_missing), so either
            # it sees this claim or this sees the registration gone.
            if self.devices.find_one({"_id": device}, {"_id": 1}) is None:
                raise ClaimRefused("device is not registered by any agent host")
            lease = self._insert_lease(lease_id, device, queue_def, agent_host, vms, reason, now,
                                       undo, by_hand)
            agent = self._fence_device(lease, reason, undo)
            vm_names = [vm["agent_name"] for vm in lease["vms"]]
            undo.add(lambda: (self.fences.delete_many({"lease_id": lease_id, "kind": "vm"}),
                              self.gates.sync(vm_names)))
            self.fence_agents(lease_id, [vm["agent_name"] for vm in lease["vms"]], kind="vm",
                              reason=f"bring-up of lease {lease_id}", generation=0)
            # The busy checks, then the jobs a poll that read no gate (the device was not
            # watched yet) handed out: it writes no marker (one jobs read for both).
            busy, loose = self.claim_checks(device, agent.get("queues") or [])
            if busy:
                raise ClaimRefused(f"a job slipped in: {busy}")
            if loose:
                raise ClaimRefused(f"job(s) {', '.join(loose)} of a queue it polls were just "
                                   "handed out and no agent has claimed them yet")
        except ClaimRefused as exc:
            undo.run()
            raise self._refused(device, qname, exc.reason) from None
        except BaseException:
            undo.run()
            raise
        self.devices.update_one({"_id": device}, {"$set": {"last_lent_at": now}})
        capped = (f", vms_per_device {queue_def.vms_per_device} capped by the device's GPUs"
                  if queue_def.vms_per_device != "gpus" and vms < int(queue_def.vms_per_device)
                  else "")
        self.events.record("lease.claimed", f"{qname}: lent {device} ({vms} VMs{capped}), "
                           f"lease {lease_id}: {reason}",
                           queue=qname, device=device, lease_id=lease_id, data={"vms": vms})
        return lease

    def _refused(self, device: str, queue: str, reason: str) -> ClaimRefused:
        self.events.record("claim.refused", f"{queue}: cannot lend {device}: {reason}",
                           queue=queue, device=device)
        return ClaimRefused(reason)

    @staticmethod
    def _agent_doc_idle(agent: dict) -> bool:
        return agent.get("state") == tfstates.AGENT_WAITING and not agent.get("job_id")

    def _insert_lease(self, lease_id, device, queue_def, agent_host, vms, reason, now, undo,
                      by_hand: bool = False) -> dict:
        undo.add(lambda: self.resources.delete_many({"lease_id": lease_id}))
        vm = queue_def.vm
        policy = queue_def.policy
        planned = []
        for i in range(vms):
            name = vm_name(device, i)
            planned.append({"index": i, "name": name, "agent_name": name,
                            "mac": self._allocate_mac(lease_id),
                            "disk": f"{VM_DISK_DIR}/{lease_id}-{name}.qcow2", "gpus": [],
                            "maas_system_id": None, "ip": None, "metrics_port": None, "domain": None})
        timeouts = {"provision_timeout": policy.provision_timeout, "max_lease": policy.max_lease,
                    "grace": policy.reclaim.grace}
        lease = {
            "_id": lease_id, "device": device, "queue": queue_def.name, "agent_host": agent_host,
            "state": CLAIMED, "generation": 0, "created_at": now, "updated_at": now,
            "deadline": deadline_for(CLAIMED, policy, now),
            "history": [{"state": CLAIMED, "at": now, "reason": reason}], "intent": [],
            "vms": planned,
            # The VM agent names again, flat: fixed at the claim (a report may not change a
            # VM's identity, server/hostproto.py), and what every tick reads of ``vms``
            # (tickreads.OPEN_LEASE_FIELDS); ``active_since`` is set by the first move to
            # active or to restoring (transition).
            "vm_names": [p["agent_name"] for p in planned],
            "spec": {"vcpus": vm.vcpus, "memory_mib": vm.memory_mib, "disk_gib": vm.disk_gib,
                     "gpus_per_vm": vm.gpus, "firmware": vm.firmware,
                     "mmio64_mib": vm.mmio64_mib, "series": queue_def.vm_host_series,
                     "template": queue_def.agent_template, "provision_type": queue_def.provision_type},
            "drain": None, "admission": "open", "error": None, "failures_counted": False,
            "idle_since": None, "timeouts": timeouts, "device_agent_before": None,
            "by_hand": bool(by_hand),
        }
        self.leases.insert_one(lease)
        undo.add(lambda: self.leases.delete_one({"_id": lease_id, "state": CLAIMED}))
        return lease

    def _allocate_mac(self, lease_id: str, attempts: int = 200) -> str:
        """A locally administered QEMU-range MAC (52:54:00:xx:xx:xx) unique in ``magic_resources``."""
        for _ in range(attempts):
            mac = "52:54:00:%02x:%02x:%02x" % tuple(self._rng.randrange(256) for _ in range(3))
            try:
                self.resources.insert_one({"_id": f"mac:{mac}", "lease_id": lease_id, "kind": "mac",
                                           "at": self.clock()})
                return mac
            except DuplicateKeyErrors:
                continue
        raise LeaseError(f"no free MAC after {attempts} attempts")

    def _fence_device(self, lease: dict, reason: str, undo: "_Undo") -> dict:
        """Fence the device, sync its gate, then CAS its ``agents`` document from idle to
        :data:`LENT_AGENT_STATE` with our comment (the first idleness check; it reads the document too:
        returns it as it was, whose ``queues`` the claim's later check uses). Raises
        :class:`ClaimRefused`."""
        device, lease_id = lease["device"], lease["_id"]
        try:
            self.fences.insert_one({"_id": device, "lease_id": lease_id, "kind": "device",
                                    "reason": reason, "since": self.clock()})
        except DuplicateKeyErrors:
            other = self.fences.find_one({"_id": device}) or {}
            raise ClaimRefused(f"device agent already fenced ({other.get('reason')})") from None
        undo.add(lambda: (self.fences.delete_one({"_id": device, "lease_id": lease_id}),
                          self.gates.sync([device])))
        self.gates.sync([device])  # before any busy check: the handshake's order
        comment = lent_comment(lease["queue"], lease_id)
        # The agents doc is changed only from idle: the CAS is itself the first idleness check.
        before = self.agents.find_one_and_update(
            {"name": device, "state": tfstates.AGENT_WAITING, "job_id": {"$in": ["", None]}},
            {"$set": {"state": LENT_AGENT_STATE, "comment": comment}},
            return_document=ReturnDocument.BEFORE)
        if before is None:
            raise ClaimRefused(self._not_idle(device))
        saved = {"state": before.get("state"), "comment": before.get("comment", "")}
        undo.add(lambda: self.agents.update_one({"name": device, "comment": comment}, {"$set": saved}))
        self.leases.update_one({"_id": lease_id, "generation": 0}, {"$set": {"device_agent_before": saved}})
        lease["device_agent_before"] = saved
        return before

    def _not_idle(self, device: str) -> str:
        """Why the claim's CAS on the device's ``agents`` document matched nothing (read once
        more, on this refusal path only)."""
        agent = self.agents.find_one({"name": device}, {"state": 1, "job_id": 1})
        if agent is None:
            return "device agent has no Testflinger agents document"
        if not self._agent_doc_idle(agent):
            return (f"device agent is {agent.get('state')!r} with job "
                    f"{agent.get('job_id') or 'none'}")
        return "device agent stopped being idle"

    # ----------------------------------------------------------------- transitions

    def transition(self, lease_id: str, from_state: str, generation: int, to_state: str, reason: str,
                   set_fields: dict | None = None, push_intent: Iterable[dict] | None = None,
                   merge_vms: Iterable[dict] | None = None) -> dict:
        """Move the lease ``from_state -> to_state`` if it is still at ``generation``.

        Sets ``state``, ``updated_at``, ``deadline`` (:func:`deadline_for`, unless ``set_fields``
        has one), increments ``generation``, appends ``{state, at, reason}`` to ``history``;
        ``set_fields`` are more top-level fields, ``push_intent`` intent entries (``at`` added),
        ``merge_vms`` ``[{index, ...}]`` merged into ``vms[index]``. Returns the new document.
        Raises :class:`IllegalTransition`, :class:`StaleGeneration`, :class:`LeaseNotFound`.
        """
        if not is_legal(from_state, to_state):
            raise IllegalTransition(f"{lease_id}: {from_state} -> {to_state} is not a legal transition")
        lease = self._current(lease_id, from_state, generation)
        now = self.clock()
        set_fields = dict(set_fields or {})
        if "deadline" not in set_fields:
            running = lease.get("deadline") if from_state in BRINGUP_STATES else None
            set_fields["deadline"] = deadline_for(
                to_state, _policy_of_lease(lease), now, bringup_deadline=running,
                drain=set_fields.get("drain", lease.get("drain")), created_at=lease.get("created_at"))
        if to_state in AFTER_ACTIVE_STATES and lease.get("active_since") is None:
            # Written once: when it first became active, or null at a restore that follows
            # none (tickreads.with_vms: a lease without the field is an older server's).
            first = first_active(lease)
            set_fields.setdefault("active_since",
                                  now if first is None and to_state == ACTIVE else first)
        update = self._update(lease, now, set_fields, push_intent, merge_vms)
        update["$set"]["state"] = to_state
        update["$push"]["history"] = {"state": to_state, "at": now, "reason": reason}
        new = self._cas(lease_id, from_state, generation, update)
        self._record(f"lease.{to_state}", f"{new['queue']}: lease {lease_id} on {new['device']}: "
                           f"{from_state} -> {to_state}: {reason}", queue=new["queue"],
                           device=new["device"], lease_id=lease_id)
        return new

    def _record(self, kind: str, message: str, **kw) -> None:
        """Record an event after a committed change. A failing event log (MongoDB hiccup, a
        broken webhook notifier) must not turn a committed change into an error: the caller
        would skip what has to follow it (close() would leave the claim and fence behind)."""
        try:
            self.events.record(kind, message, **kw)
        except Exception:  # noqa: BLE001 - the change itself is done
            logging.getLogger(__name__).exception("could not record event %s: %s", kind, message)

    def progress(self, lease_id: str, state: str, generation: int, push_intent: Iterable[dict] | None = None,
                 merge_vms: Iterable[dict] | None = None, set_fields: dict | None = None) -> dict:
        """Record intent / VM facts without a state change (same CAS, ``generation`` + 1)."""
        lease = self._current(lease_id, state, generation)
        update = self._update(lease, self.clock(), dict(set_fields or {}), push_intent, merge_vms)
        return self._cas(lease_id, state, generation, update)

    def _current(self, lease_id: str, state: str, generation: int) -> dict:
        lease = self.get(lease_id)
        if lease["state"] != state or lease["generation"] != generation:
            raise StaleGeneration(f"{lease_id}: is {lease['state']}@{lease['generation']}, "
                                  f"not {state}@{generation}", lease)
        return lease

    def _update(self, lease, now, set_fields, push_intent, merge_vms) -> dict:
        sets = {"updated_at": now, **set_fields}
        for vm in merge_vms or ():
            index = vm.get("index")
            if not isinstance(index, int) or not 0 <= index < len(lease.get("vms", [])):
                raise LeaseError(f"{lease['_id']}: vms[].index {index!r} out of range "
                                 f"0..{len(lease.get('vms', [])) - 1}")
            for key, value in vm.items():
                if key != "index":
                    sets[f"vms.{index}.{key}"] = value
        update = {"$set": sets, "$inc": {"generation": 1}, "$push": {}}
        intents = [{"at": now, **i} for i in (push_intent or ())]
        if intents:
            update["$push"]["intent"] = {"$each": intents}
        return update

    def _cas(self, lease_id: str, state: str, generation: int, update: dict) -> dict:
        if not update["$push"]:
            del update["$push"]
        new = self.leases.find_one_and_update({"_id": lease_id, "state": state, "generation": generation},
                                              update, return_document=ReturnDocument.AFTER)
        if new is None:
            raise StaleGeneration(f"{lease_id}: changed under us (expected {state}@{generation})",
                                  self.get(lease_id))
        return new

    # ----------------------------------------------------------------- failures and close

    def record_failure(self, lease_id: str, reason: str) -> bool:
        """Count one failure against the lease's device, once per lease (``failures_counted``),
        and name the lease on the device (``last_failure_lease``: a quarantine the planner puts
        on for the count names it, so a failure taken back later lifts only the quarantine it
        caused, server/actions.py ``_bringup_timed_out``). Returns True if this call counted
        it."""
        lease = self.leases.find_one_and_update({"_id": lease_id, "failures_counted": {"$ne": True}},
                                                {"$set": {"failures_counted": True}})
        if lease is None:
            return False
        self.devices.update_one({"_id": lease["device"]},
                                {"$inc": {"failures": 1}, "$set": {"last_failure_lease": lease_id}})
        self._record("device.failure", f"{lease['device']}: lease {lease_id} failed: {reason}",
                           queue=lease["queue"], device=lease["device"], lease_id=lease_id)
        return True

    def close(self, lease_id: str, generation: int, final_state: str, reason: str = "") -> dict:
        """``restoring -> returned|failed`` (CAS), then :meth:`cleanup` of what the lease held.

        Cleanup runs even if counting the failure raises (the event log never raises here, see
        :meth:`_record`). A crash between the CAS and cleanup is repaired by
        :meth:`repair_closed`, which each reconcile tick runs."""
        if final_state not in FINAL_STATES:
            raise IllegalTransition(f"{lease_id}: close() needs returned or failed, not {final_state}")
        lease = self.transition(lease_id, RESTORING, generation, final_state, reason or final_state)
        try:
            if final_state == FAILED:
                self.record_failure(lease_id, reason or "restore failed")
        finally:
            self.cleanup(lease)
        self._account(lease)
        return lease

    #: Called with ``(queue, home_pool, gpu_hours)`` after a lease closed (the plugin counts it
    #: in ``magic_gpu_hours_borrowed_total``); None: no one listens.
    on_borrowed: Callable[[str, str, float], None] | None = None

    def _account(self, lease: dict) -> None:
        """Fairness accounting of a closed lease (testflinger_magic.fairness); never raises:
        a failed count must not make a finished close look failed to the agent host."""
        try:
            queue, pool, hours = fairness.record(self.db, lease)
            if self.on_borrowed is not None:
                self.on_borrowed(queue, pool, hours)
        except Exception as exc:  # noqa: BLE001 - accounting is best effort, logged
            logging.getLogger(__name__).warning("lease %s: fairness accounting failed: %s",
                                                lease.get("_id"), exc)

    def cleanup(self, lease: dict) -> None:
        """Free what a closed lease held; idempotent (re-run it after a crash).

        ``returned``: claim lock, device fence, VM fences, MACs, the VM agents' Testflinger
        ``agents`` documents (else they would count as online for 7 days, TESTFLINGER.md §8) and
        dispatch markers, and
        the device agent back to ``waiting`` with an empty comment if the comment is still ours.
        ``failed``: the claim and the device fence stay (a person must look; see
        :meth:`release_failed`); VM agent documents and markers are removed and VM fences kept.
        """
        lease_id, device = lease["_id"], lease["device"]
        names = [vm["agent_name"] for vm in lease.get("vms", [])]
        if names:
            self.agents.delete_many({"name": {"$in": names}})
            # Their dispatch markers too: the tick reads those of VM agents of open leases
            # only, and not of one in a job phase (Snapshot.gather), so a marker left by a
            # job the lease ended in (a forced drain) would otherwise stay for ever.
            self.dispatch.delete_many({"agent": {"$in": names}})
        if lease["state"] == RETURNED:
            self.fences.delete_many({"lease_id": lease_id})
            self.resources.delete_many({"lease_id": lease_id})
        # Admission no longer applies to a closed lease, and a returned one's fences are gone.
        self.gates.sync([device] + names)
        if lease["state"] == RETURNED:
            self._restore_device_agent(lease)
            self.claims.delete_one({"_id": device, "lease_id": lease_id})

    def _restore_device_agent(self, lease: dict, state: str = tfstates.AGENT_WAITING,
                              comment: str | None = None) -> None:
        """Give the device agent's Testflinger ``agents`` document back (``state``, default
        ``waiting``; ``comment``, default the one it had before the claim), only if the comment
        is still ours: an operator or the agent itself may have changed it since, and theirs
        wins."""
        before = lease.get("device_agent_before") or {}
        self.agents.update_one(
            {"name": lease["device"], "comment": lent_comment(lease["queue"], lease["_id"])},
            {"$set": {"state": state,
                      "comment": before.get("comment") or "" if comment is None else comment}})

    def release_failed(self, device: str) -> bool:
        """Operator action (unquarantine): free the claim, fences and MACs a ``failed`` lease of
        ``device`` kept, and give the device agent's ``agents`` document back if its comment is
        still ours. Idempotent; the claim goes last so a crash part-way is finished by a retry.
        Returns True if something was released."""
        claim = self.claims.find_one({"_id": device})
        if claim is None:
            return False
        lease = self.leases.find_one({"_id": claim["lease_id"]})
        if lease is not None and lease["state"] != FAILED:
            raise LeaseError(f"{device}: lease {lease['_id']} is {lease['state']}, not failed")
        gone = [f["_id"] for f in self.fences.find({"lease_id": claim["lease_id"]}, {"_id": 1})]
        self.fences.delete_many({"lease_id": claim["lease_id"]})
        self.gates.sync(gone + [device])
        self.resources.delete_many({"lease_id": claim["lease_id"]})
        if lease is not None:
            # Not ``waiting``: a failed restore (or an abandoned lease, whose host never
            # restored it) may have left the agent program stopped, and Testflinger would
            # list a dead agent as available (TRIAL14 F5). ``offline`` until the agent
            # posts its own state (its startup post, TESTFLINGER.md §3.2); the plan lends the
            # device only once it says ``waiting``.
            self._restore_device_agent(lease, tfstates.AGENT_OFFLINE, (
                f"testflinger-magic: released after failed lease {lease['_id']}; offline "
                "until its testflinger-agent posts (start it if it is stopped)"))
        res = self.claims.delete_one({"_id": device, "lease_id": claim["lease_id"]})
        if res.deleted_count:
            self._record("device.released", f"{device}: claim of failed lease {claim['lease_id']} "
                         "released by an operator; the device can be lent again",
                         queue=(lease or {}).get("queue"), device=device,
                         lease_id=claim["lease_id"])
        return True

    # ----------------------------------------------------------------- fences

    def fence_agents(self, lease_id: str, names: Iterable[str], kind: str = "vm", reason: str = "",
                     generation: int | None = None) -> None:
        """Fence ``names`` (idempotent: an existing fence keeps its reason and ``since``). The
        caller must look at :meth:`agent_busy` only *after* this returns (the handshake's order).

        ``generation``: the lease generation the fencer acted on (after its CAS where there is
        one), kept as the fence's highest ``generation`` (``$max``). :meth:`lift_vm_fences` only
        removes fences at or below the generation at which it saw the lease ``active``, so a lift
        racing a drain on another replica can never remove the drain's newer fence."""
        now = self.clock()
        update: dict = {"$setOnInsert": {"lease_id": lease_id, "kind": kind, "reason": reason,
                                         "since": now}}
        if generation is not None:
            update["$max"] = {"generation": int(generation)}
        names = list(names)
        for name in names:
            try:
                self.fences.update_one({"_id": name}, update, upsert=True)
            except DuplicateKeyErrors:  # two upserts raced: the other inserted it; stamp it
                self.fences.update_one({"_id": name}, update)
        self.gates.sync(names)  # before returning: the caller's busy check comes next

    def unfence(self, names: Iterable[str]) -> None:
        """Remove the fences of ``names`` (and open their gates)."""
        names = list(names)
        self.fences.delete_many({"_id": {"$in": names}})
        self.gates.sync(names)

    def lift_vm_fences(self, lease: dict) -> int:
        """Remove the VM fences of ``lease``, a document read in state ``active`` at its
        ``generation`` (an active lease's VM agents must get jobs). Only fences stamped at or
        below that generation go: a drain commits ``active -> draining`` (generation + 1) before
        it fences, so its fence is never removed here. Returns how many were removed."""
        names = [vm["agent_name"] for vm in lease.get("vms") or []]
        if not names:
            return 0
        res = self.fences.delete_many({
            "_id": {"$in": names}, "lease_id": lease["_id"], "kind": "vm",
            "$or": [{"generation": {"$lte": lease["generation"]}},
                    {"generation": {"$exists": False}}]})
        if res.deleted_count:
            self.gates.sync(names)
        return res.deleted_count

    def is_fenced(self, name: str) -> bool:
        """True if ``name`` is fenced."""
        return self.fences.find_one({"_id": name}) is not None

    # ----------------------------------------------------------------- busy checks

    def claim_checks(self, device: str, queues) -> tuple[str | None, list[str]]:
        """The claim's checks after its fence (gates.Gates.claim_checks): ``(why device may be
        running a job or None, jobs of ``queues`` just handed out that may be its)``."""
        return self.gates.claim_checks(device, queues)

    def agent_busy(self, agent: str, include_agent_doc: bool = True,
                   include_pending: bool = True, prune: bool = True) -> str | None:
        """Why ``agent`` may be running a job, or None if provably idle (gates.Gates.agent_busy:
        dispatch markers, jobs the server attributes to it, its agents document; a phase or
        ``restart`` state is never idle). A fencer looks only *after* its fence and gate sync.
        ``prune=False`` deletes nothing (a dry run, GET /v1/magic/plan, must not write)."""
        return self.gates.agent_busy(agent, include_agent_doc=include_agent_doc,
                                     include_pending=include_pending, prune=prune)

    def agents_busy(self, agents: Iterable[str], include_agent_doc: bool = True,
                    include_pending: bool = True, prune: bool = True) -> dict[str, str]:
        """``{agent: why it may be running a job}`` of ``agents`` that are not provably idle
        (gates.Gates.busy: the checks of :meth:`agent_busy`, a bounded number of queries
        whatever the number of agents). A fencer looks only *after* its fence and gate sync."""
        return self.gates.busy(agents, include_agent_doc=include_agent_doc,
                               include_pending=include_pending, prune=prune)


class _Undo:
    """Compensating actions, run newest first; one failing does not stop the others."""

    def __init__(self):
        self._steps: list[Callable[[], object]] = []

    def add(self, step: Callable[[], object]) -> None:
        self._steps.append(step)

    def run(self) -> None:
        for step in reversed(self._steps):
            try:
                step()
            except Exception:  # best effort: the rest must still run
                logging.getLogger(__name__).exception("claim undo step failed")
