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
from types import SimpleNamespace
from typing import Callable, Iterable

from . import fairness, indexes, tfstates
from .db import DuplicateKeyErrors, ReturnDocument
from .events import EventLog
from .gates import DISPATCH_PENDING_TTL, Gates  # noqa: F401 (DISPATCH_PENDING_TTL re-exported)

# --------------------------------------------------------------------------- states (pure)

CLAIMED, FENCED, DEPLOYING, SPLITTING, ENROLLING = "claimed", "fenced", "deploying", "splitting", "enrolling"
ACTIVE, DRAINING, RESTORING, RETURNED, FAILED = "active", "draining", "restoring", "returned", "failed"

STATES = (CLAIMED, FENCED, DEPLOYING, SPLITTING, ENROLLING, ACTIVE, DRAINING, RESTORING, RETURNED, FAILED)
FINAL_STATES = frozenset({RETURNED, FAILED})
#: States of a lease that still holds its device (``failed`` also keeps the claim, see close()).
OPEN_STATES = frozenset(STATES) - FINAL_STATES
#: Bring-up states: one deadline (policy.provision_timeout) covers all of them together.
BRINGUP_STATES = frozenset({CLAIMED, FENCED, DEPLOYING, SPLITTING, ENROLLING})
#: States in which the agent-host daemon has a step to run.
DAEMON_STATES = BRINGUP_STATES | {RESTORING}

TRANSITIONS: dict[str, frozenset[str]] = {
    CLAIMED: frozenset({FENCED, RESTORING}),
    FENCED: frozenset({DEPLOYING, RESTORING}),
    DEPLOYING: frozenset({SPLITTING, RESTORING}),
    SPLITTING: frozenset({ENROLLING, RESTORING}),
    ENROLLING: frozenset({ACTIVE, RESTORING}),
    ACTIVE: frozenset({DRAINING}),
    DRAINING: frozenset({ACTIVE, RESTORING}),
    RESTORING: frozenset({RETURNED, FAILED}),
    RETURNED: frozenset(),
    FAILED: frozenset(),
}

#: Seconds a restore may take before the lease is reported overdue.
RESTORE_TIMEOUT = 1800.0
#: Defaults when a policy lacks a field (seconds).
DEFAULT_PROVISION_TIMEOUT = 2700.0
DEFAULT_GRACE = 900.0
#: After a forced drain cancelled its jobs, how long (seconds) the lease stays ``draining`` at
#: most, waiting for every VM agent to notice the cancel, when the lease's policy has no grace.
#: Agents look for a cancel only every 10 s and never during provision (TESTFLINGER.md §3.6), so
#: tearing the VMs down at once would kill a job mid-provision.
DEFAULT_FORCE_WAIT = 600.0

VM_DISK_DIR = "/var/lib/libvirt/images"


def is_legal(from_state: str, to_state: str) -> bool:
    """True if ``from_state -> to_state`` is in :data:`TRANSITIONS`."""
    return to_state in TRANSITIONS.get(from_state, ())


def deadline_for(state: str, policy, now: float, *, bringup_deadline: float | None = None,
                 drain: dict | None = None, created_at: float | None = None) -> float | None:
    """Deadline (epoch seconds) of a lease entering ``state`` at ``now``, or None.

    ``policy``: an object with ``provision_timeout``, ``max_lease`` (seconds, 0/None = none) and
    ``reclaim.grace`` (a queue's ``policy``, or the snapshot kept in the lease's ``timeouts``).
    Bring-up states share one deadline: ``bringup_deadline`` (the running one) if given, else
    ``now + provision_timeout``. ``draining``: ``drain["grace_until"]`` or ``now + grace``.
    ``restoring``: ``now + RESTORE_TIMEOUT``. ``active``: ``created_at + max_lease`` or None.
    Final states: None.
    """
    if state in BRINGUP_STATES:
        if bringup_deadline is not None:
            return bringup_deadline
        return now + float(getattr(policy, "provision_timeout", None) or DEFAULT_PROVISION_TIMEOUT)
    if state == DRAINING:
        if drain and drain.get("grace_until") is not None:
            return float(drain["grace_until"])
        reclaim = getattr(policy, "reclaim", None)
        return now + float(getattr(reclaim, "grace", None) or DEFAULT_GRACE)
    if state == RESTORING:
        return now + RESTORE_TIMEOUT
    if state == ACTIVE:
        max_lease = getattr(policy, "max_lease", None)
        if max_lease:
            return (created_at if created_at is not None else now) + float(max_lease)
        return None
    return None


def _policy_of_lease(lease: dict):
    """The policy snapshot stored at claim, as an object :func:`deadline_for` accepts."""
    t = lease.get("timeouts") or {}
    return SimpleNamespace(provision_timeout=t.get("provision_timeout"), max_lease=t.get("max_lease"),
                           reclaim=SimpleNamespace(grace=t.get("grace")))


# --------------------------------------------------------------------------- errors


class LeaseError(Exception):
    """Base class of lease store errors."""


class LeaseNotFound(LeaseError):
    """No lease with that id."""


class IllegalTransition(LeaseError):
    """The requested state change is not in :data:`TRANSITIONS`."""


class StaleGeneration(LeaseError):
    """The lease is not in the (state, generation) the caller acted on; ``.lease`` is the current
    document (the HTTP layer answers 409 with it)."""

    def __init__(self, message: str, lease: dict):
        super().__init__(message)
        self.lease = lease


class ClaimRefused(LeaseError):
    """The device cannot be lent now; ``.reason`` says why. Nothing was left behind."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# --------------------------------------------------------------------------- the store


#: Seconds after which a claim lock or fence whose lease document does not exist is an orphan of
#: a process that died inside :meth:`LeaseStore.claim` (a live claim takes milliseconds).
ORPHAN_CLAIM_AGE = 60.0


def lent_comment(queue: str, lease_id: str) -> str:
    """The Testflinger agent comment that marks a device agent as ours while lent."""
    return f"lent to magic queue {queue} (lease {lease_id})"


class LeaseStore:
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

    def claim(self, device: str, queue_def, agent_host: str, vms: int, reason: str) -> dict:
        """Lend ``device`` to ``queue_def`` (a MagicQueue): create the lease in ``claimed``.

        Steps: (a) the claim lock ``magic_device_claims[device]``; (b) the lease with ``vms``
        planned VMs (name ``<device>-vm<N>``, N from 1; ``index`` = list position from 0; a unique
        MAC; disk ``/var/lib/libvirt/images/<lease>-<name>.qcow2``); (c) the device fence, and the
        Testflinger ``agents`` document set ``offline`` with comment :func:`lent_comment` (only if
        it is ``waiting`` with no ``job_id``); (d) then the proof that no job slipped in (no
        in-flight dispatch, no dispatched job that is not terminal). Any failure undoes all of
        it and raises :class:`ClaimRefused`; a job is never touched. Returns the lease document.

        The planned VM agent names are fenced here too (kind ``vm``, generation 0): the daemon
        starts each VM agent during ``enrolling``, and if bring-up then fails the lease goes to
        ``restoring`` and the agent is torn down; fenced from the start, it can never have taken
        a job. The report that makes the lease ``active`` lifts these fences
        (:meth:`lift_vm_fences`), so a VM agent gets jobs only while its lease is ``active``.
        """
        if vms < 1:
            raise ClaimRefused(f"{device}: a lease needs at least one VM (got {vms})")
        qname = queue_def.name
        agent = self.agents.find_one({"name": device})
        if agent is None:
            raise self._refused(device, qname, "device agent has no Testflinger agents document")
        if not self._agent_doc_idle(agent):
            raise self._refused(device, qname, f"device agent is {agent.get('state')!r} with job "
                                               f"{agent.get('job_id') or 'none'}")
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
            lease = self._insert_lease(lease_id, device, queue_def, agent_host, vms, reason, now, undo)
            self._fence_device(lease, reason, undo)
            vm_names = [vm["agent_name"] for vm in lease["vms"]]
            undo.add(lambda: (self.fences.delete_many({"lease_id": lease_id, "kind": "vm"}),
                              self.gates.sync(vm_names)))
            self.fence_agents(lease_id, [vm["agent_name"] for vm in lease["vms"]], kind="vm",
                              reason=f"bring-up of lease {lease_id}", generation=0)
            busy = self.agent_busy(device, include_agent_doc=False)
            if busy:
                raise ClaimRefused(f"a job slipped in: {busy}")
            # A poll that read no gate (the device was not watched yet) writes no marker.
            loose = self.gates.unattributed_jobs(device, agent.get("queues") or [])
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
        self.events.record("lease.claimed", f"{qname}: lent {device} ({vms} VMs), lease {lease_id}: {reason}",
                           queue=qname, device=device, lease_id=lease_id, data={"vms": vms})
        return lease

    def _refused(self, device: str, queue: str, reason: str) -> ClaimRefused:
        self.events.record("claim.refused", f"{queue}: cannot lend {device}: {reason}",
                           queue=queue, device=device)
        return ClaimRefused(reason)

    @staticmethod
    def _agent_doc_idle(agent: dict) -> bool:
        return agent.get("state") == tfstates.AGENT_WAITING and not agent.get("job_id")

    def _insert_lease(self, lease_id, device, queue_def, agent_host, vms, reason, now, undo) -> dict:
        undo.add(lambda: self.resources.delete_many({"lease_id": lease_id}))
        vm = queue_def.vm
        policy = queue_def.policy
        planned = []
        for i in range(vms):
            name = f"{device}-vm{i + 1}"
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
            "spec": {"vcpus": vm.vcpus, "memory_mib": vm.memory_mib, "disk_gib": vm.disk_gib,
                     "gpus_per_vm": vm.gpus, "firmware": vm.firmware,
                     "mmio64_mib": vm.mmio64_mib, "series": queue_def.vm_host_series,
                     "template": queue_def.agent_template, "provision_type": queue_def.provision_type},
            "drain": None, "admission": "open", "error": None, "failures_counted": False,
            "idle_since": None, "timeouts": timeouts, "device_agent_before": None,
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

    def _fence_device(self, lease: dict, reason: str, undo: "_Undo") -> None:
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
            {"$set": {"state": tfstates.AGENT_OFFLINE, "comment": comment}},
            return_document=ReturnDocument.BEFORE)
        if before is None:
            raise ClaimRefused("device agent stopped being idle")
        saved = {"state": before.get("state"), "comment": before.get("comment", "")}
        undo.add(lambda: self.agents.update_one({"name": device, "comment": comment}, {"$set": saved}))
        self.leases.update_one({"_id": lease_id, "generation": 0}, {"$set": {"device_agent_before": saved}})
        lease["device_agent_before"] = saved

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
        """Count one failure against the lease's device, once per lease (``failures_counted``).
        Returns True if this call counted it."""
        lease = self.leases.find_one_and_update({"_id": lease_id, "failures_counted": {"$ne": True}},
                                                {"$set": {"failures_counted": True}})
        if lease is None:
            return False
        self.devices.update_one({"_id": lease["device"]}, {"$inc": {"failures": 1}})
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

    def repair_closed(self) -> list[str]:
        """Finish the cleanup of ``returned`` leases that still hold a claim or a fence (the
        server died, or the database failed, between close()'s CAS and :meth:`cleanup`; a
        ``returned`` lease is final, so nothing else would ever free them). Cheap: reads the
        claim and fence collections (one document per lent device / VM agent) and the leases
        they name. Returns the ids of the leases cleaned up."""
        ids = {c.get("lease_id") for c in self.claims.find({}, {"lease_id": 1})}
        ids |= {f.get("lease_id") for f in self.fences.find({}, {"lease_id": 1})}
        ids.discard(None)
        if not ids:
            return []
        done = []
        found = set()
        for lease in self.leases.find({"_id": {"$in": sorted(ids)}}, {"_id": 1, "state": 1}):
            found.add(lease["_id"])
            if lease["state"] == RETURNED:
                self.cleanup(self.leases.find_one({"_id": lease["_id"]}))
                done.append(lease["_id"])
        done.extend(self._repair_orphan_claims(ids - found))
        return done

    def _repair_orphan_claims(self, lease_ids: set) -> list[str]:
        """Free what a claim that never produced a lease holds: the process died inside
        :meth:`claim` (between the claim lock and the lease insert, or while undoing a refused
        claim). Only claims older than :data:`ORPHAN_CLAIM_AGE` s, so a claim in progress on
        another replica is never touched; every delete names the lease id (CAS)."""
        done = []
        cutoff = self.clock() - ORPHAN_CLAIM_AGE
        for lease_id in sorted(lease_ids):
            if self.leases.find_one({"_id": lease_id}, {"_id": 1}) is not None:
                continue  # written meanwhile
            claims = list(self.claims.find({"lease_id": lease_id}))
            if any(c.get("at", 0) > cutoff for c in claims):
                continue
            fences = list(self.fences.find({"lease_id": lease_id}))
            if not claims and any(f.get("since", 0) > cutoff for f in fences):
                continue
            for claim in claims:
                # The device agent document, if the claim got as far as marking it ours.
                self.agents.update_one(
                    {"name": claim["_id"], "comment": lent_comment(claim.get("queue", ""), lease_id)},
                    {"$set": {"state": tfstates.AGENT_WAITING, "comment": ""}})
            self.fences.delete_many({"lease_id": lease_id})
            self.gates.sync([c["_id"] for c in claims] + [f["_id"] for f in fences])
            self.resources.delete_many({"lease_id": lease_id})
            for claim in claims:
                self.claims.delete_one({"_id": claim["_id"], "lease_id": lease_id})
            self._record("claim.repaired", f"claim {lease_id} of "
                         f"{', '.join(c['_id'] for c in claims) or 'no device'} had no lease "
                         "(a server died inside a claim); freed", lease_id=lease_id)
            done.append(lease_id)
        return done

    def cleanup(self, lease: dict) -> None:
        """Free what a closed lease held; idempotent (re-run it after a crash).

        ``returned``: claim lock, device fence, VM fences, MACs, the VM agents' Testflinger
        ``agents`` documents (else they would count as online for 7 days, TESTFLINGER.md §8), and
        the device agent back to ``waiting`` with an empty comment if the comment is still ours.
        ``failed``: the claim and the device fence stay (a person must look; see
        :meth:`release_failed`); VM agent documents are removed and VM fences kept.
        """
        lease_id, device = lease["_id"], lease["device"]
        names = [vm["agent_name"] for vm in lease.get("vms", [])]
        if names:
            self.agents.delete_many({"name": {"$in": names}})
        if lease["state"] == RETURNED:
            self.fences.delete_many({"lease_id": lease_id})
            self.resources.delete_many({"lease_id": lease_id})
        # Admission no longer applies to a closed lease, and a returned one's fences are gone.
        self.gates.sync([device] + names)
        if lease["state"] == RETURNED:
            self._restore_device_agent(lease)
            self.claims.delete_one({"_id": device, "lease_id": lease_id})

    def _restore_device_agent(self, lease: dict) -> None:
        """Give the device agent's Testflinger ``agents`` document back (``waiting``, the comment
        it had before the claim), only if the comment is still ours: an operator or the agent
        itself may have changed it since, and theirs wins."""
        before = lease.get("device_agent_before") or {}
        self.agents.update_one(
            {"name": lease["device"], "comment": lent_comment(lease["queue"], lease["_id"])},
            {"$set": {"state": tfstates.AGENT_WAITING, "comment": before.get("comment") or ""}})

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
            self._restore_device_agent(lease)
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

    def repair_active_fences(self) -> list[str]:
        """Lift VM fences left on ``active`` leases (an undrain that lost a race with a restore or
        force on another replica, or a crash between an undrain's CAS and its unfence, or between
        the ``enrolling -> active`` report and its lift): without this the lease would keep its
        VM agents fenced for ever. Cheap: the VM fences and the leases they name. Returns the ids
        of the leases repaired."""
        ids = {f.get("lease_id") for f in self.fences.find({"kind": "vm"}, {"lease_id": 1})}
        ids.discard(None)
        if not ids:
            return []
        done = []
        for lease in self.leases.find({"_id": {"$in": sorted(ids)}, "state": ACTIVE}):
            if self.lift_vm_fences(lease):
                done.append(lease["_id"])
        return done

    def reassert_device_fences(self) -> list[str]:
        """Put back the fence state (``offline`` + :func:`lent_comment`) on the Testflinger
        ``agents`` document of every device lent by a lease that does not give it back yet,
        where it is no longer so.

        The device agent program is stopped from ``fenced`` until the restore starts it again,
        so while a lease holds its device nothing but a fault (an operator or supervisord
        starting the program by hand, someone posting its state) makes its document show it
        free: the 204 fence still keeps jobs off, but Testflinger's agent list and the home
        queue's preflight would show a lent machine as free for the whole lease.

        ``restoring`` leases are left alone: their restore starts the device agent before it
        reports ``returned`` (agent_host/steps.py ``restore``), and the agent's startup post
        (``waiting``, empty comment: TESTFLINGER.md §3.2) is the give-back under way, not a
        fault; the device stays fenced until the close. (Fencing it again there was the
        ``lease.repaired`` warning of every normal return, issue 10 item 18.) Nor does a quick
        re-lend meet that post: the planner lends a returned device again only once its agent
        has posted (``reconcile.DeviceView.agent_back``).

        Cheap: open leases (device, queue) and one ``agents`` query that is normally empty.
        CAS on ``state != offline``; afterwards the lease is read again and, if it was returned
        (or its claim undone) meanwhile, whose cleanup may have given the agent back before
        this write, the agent is given back again: a free device is never left offline.
        Returns the ids of the leases whose device agent was fenced again."""
        # Only leases whose claim finished its own fence (device_agent_before set): a claim in
        # progress CASes the agent from waiting itself, and must not find it offline already.
        leases = {l["device"]: l for l in self.leases.find(
            {"state": {"$in": sorted(OPEN_STATES - {RESTORING})},
             "device_agent_before": {"$ne": None}},
            {"device": 1, "queue": 1, "device_agent_before": 1})}
        if not leases:
            return []
        done = []
        for agent in self.agents.find({"name": {"$in": sorted(leases)},
                                       "state": {"$ne": tfstates.AGENT_OFFLINE}}, {"name": 1}):
            lease = leases[agent["name"]]
            res = self.agents.update_one(
                {"name": agent["name"], "state": {"$ne": tfstates.AGENT_OFFLINE}},
                {"$set": {"state": tfstates.AGENT_OFFLINE,
                          "comment": lent_comment(lease["queue"], lease["_id"])}})
            if not res.modified_count:
                continue
            now = self.leases.find_one({"_id": lease["_id"]})
            if now is None or now["state"] == RETURNED:  # returned, or a claim undone
                self._restore_device_agent(now or lease)
                continue
            done.append(lease["_id"])
        return done

    def repair_gates(self) -> list[str]:
        """Bring every dispatch gate in step with the fences and admission (a crash between a
        fence change and its gate sync), create the gates of registered devices and of the VM
        agents of leases that hold their device, drop gates nobody needs (gates.Gates.repair).
        Returns the ids of the leases whose agents' gates disagreed (an agent name when no
        lease holds it)."""
        watched = [d["_id"] for d in self.devices.find({}, {"_id": 1})]
        owner = {c["_id"]: c.get("lease_id") for c in self.claims.find({}, {"lease_id": 1})}
        for lease in self.leases.find({"$or": [{"state": {"$in": sorted(OPEN_STATES)}},
                                               {"_id": {"$in": sorted(set(owner.values()))}}]},
                                      {"vms.agent_name": 1}):
            for vm in lease.get("vms") or []:
                watched.append(vm.get("agent_name"))
                owner[vm.get("agent_name")] = lease["_id"]
        return sorted({owner.get(name) or name for name in self.gates.repair(watched)})

    def repair_device_agents(self) -> list[str]:
        """Give back device agents our lending left ``offline`` with :func:`lent_comment` when
        no lease holds them any more: the lease is ``returned`` (a crash inside close() after
        the claim went), or it never existed and no claim names it (a crash inside claim). A
        newer testflinger-agent keeps ``offline`` across restarts (testflinger#1291), so such a
        leftover would keep the machine out of its home queue for good. ``failed`` leases keep
        theirs (a person must look). CAS on the comment. Returns the lease ids repaired."""
        names = [d["_id"] for d in self.devices.find({}, {"_id": 1})]
        if not names:
            return []
        prefix = "lent to magic queue "
        stale = [a for a in self.agents.find({"name": {"$in": names},
                                              "comment": {"$regex": "^" + prefix}},
                                             {"name": 1, "comment": 1})
                 if "(lease " in (a.get("comment") or "")]
        if not stale:
            return []
        ids = {a["comment"].rsplit("(lease ", 1)[1].rstrip(")") for a in stale}
        leases = {x["_id"]: x["state"] for x in self.leases.find({"_id": {"$in": sorted(ids)}},
                                                                  {"state": 1})}
        claimed = {c.get("lease_id") for c in self.claims.find({"lease_id": {"$in": sorted(ids)}},
                                                                {"lease_id": 1})}
        done = []
        for agent in stale:
            lease_id = agent["comment"].rsplit("(lease ", 1)[1].rstrip(")")
            state = leases.get(lease_id)
            if state == RETURNED or (state is None and lease_id not in claimed):
                res = self.agents.update_one(
                    {"name": agent["name"], "comment": agent["comment"]},
                    {"$set": {"state": tfstates.AGENT_WAITING, "comment": ""}})
                if res.modified_count:
                    done.append(lease_id)
        return done

    def is_fenced(self, name: str) -> bool:
        """True if ``name`` is fenced."""
        return self.fences.find_one({"_id": name}) is not None

    # ----------------------------------------------------------------- busy checks

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
