"""The server plugin's engine: one reconcile tick (repair, gather, plan, apply), the alerts, and the
operator actions behind the REST API, so api.py stays a thin translation layer.

Split along its seams: :mod:`.snapshot` reads the reconcile inputs (a bounded number of
queries), :mod:`.actions` applies actions with compare-and-set, :mod:`.hostproto` is the
agent-host protocol, :mod:`.handactions` the operator's lend, drain and quarantine by hand;
:class:`Engine` mixes them in, so its public methods (used by api.py, the
CLI and the tests) are where they were. Domain errors are in :mod:`.errors` (re-exported here).
"""

from __future__ import annotations

import logging
import time

from testflinger_magic import fairness
from testflinger_magic import leases as L
from testflinger_magic.server.giveback import GiveBackWatch
from testflinger_magic.tickreads import TickReads
from testflinger_magic.unservable import UNSERVABLE_GRACE

from . import attention, devicecount, keptquarantine, orphanjobs, unservablejobs
from .actions import UNDRAINABLE, Actions, replaced_drain  # noqa: F401 (re-exported)
from .errors import (Conflict, EngineError, Forbidden, Invalid, NotFound,  # noqa: F401
                     QueuesInUse, invalid_reason)
from .handactions import OperatorActions, selection_refusal  # noqa: F401 (re-exported)
from .jobreads import JobReads
from .quicklend import QuickLend
from .hostproto import (DAEMON_MOVES, VM_IDENTITY_FIELDS, VM_REPORT_FIELDS,  # noqa: F401
                        VM_STEP_FIELDS, WORK_STATES, HostProtocol)
from .snapshot import Snapshot, epoch  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)


def _plural_agents(names: list) -> str:
    return f"{len(names)} VM agent" + ("" if len(names) == 1 else "s")


class Engine(Snapshot, Actions, HostProtocol, QuickLend, OperatorActions):
    """Reconcile executor for one replica.

    ``db``: Testflinger's database; ``store``: :class:`testflinger_magic.leases.LeaseStore`;
    ``events``: :class:`testflinger_magic.events.EventLog`; ``clock() -> epoch seconds``.
    ``metrics`` (optional, set by the plugin): :class:`.metrics.Metrics`.
    """

    def __init__(self, db, store, events, clock=time.time, binding_mode: str | None = None):
        self.db = db
        self.store = store
        self.events = events
        self.clock = clock
        #: How agent hosts get bound to clients (bindings.BINDING_MODES; None: by their first
        #: registration).
        self.binding_mode = binding_mode or "first-registration"
        self.metrics = None
        from testflinger_magic import reconcile as R  # noqa: PLC0415

        #: Seconds after activation before a VM agent that never registered counts as missing
        #: (reconcile.VM_AGENT_GRACE; a lab or a test may shrink it on the plugin's engine).
        self.vm_agent_grace = R.VM_AGENT_GRACE
        #: Seconds a magic queue nothing can serve keeps its waiting jobs before they are
        #: cancelled, told why (testflinger_magic.unservable; a lab or a test may shrink it).
        self.unservable_grace = UNSERVABLE_GRACE
        #: Verified give-back: a returned device's agent must post within ``giveback.bound`` s.
        self.giveback = GiveBackWatch(db, events, self._quarantine, clock)
        #: The tick's read of Testflinger's jobs (one $or read; the latest job of each magic
        #: queue kept between ticks).
        self.job_reads = JobReads(db)
        self._quick_init()

    # ------------------------------------------------------------------ plan and apply
    def plan_only(self, explain: bool = False) -> list:
        """The actions a tick would apply now (dry run; no writes: a read-only gather).
        ``explain``: also the non-acting ``blocked`` actions saying why demand stays unmet
        (GET /v1/magic/plan)."""
        from testflinger_magic import reconcile as R  # noqa: PLC0415

        return R.plan(self.gather(read_only=True), explain=explain)

    def tick(self, repair: bool = True) -> list:
        """Repair (unless ``repair=False``: MagicPlugin's ticker skips them on a tick a
        submission kicked, at most for ``tick_seconds``), gather, plan, apply. Returns the
        actions that were applied (CAS won)."""
        from testflinger_magic import reconcile as R  # noqa: PLC0415

        # Each collection read once, shared by the repairs and the gather; each read (and each
        # action below) waits for a quick lend in flight (QuickLend.yield_to_quick_lend).
        reads = TickReads(self.db, before_read=self.yield_to_quick_lend)
        read_at = self.clock()  # before any read: a quick lend reads leases written since
        # Before any read too: the repairs read the open leases the plan then counts, so a
        # quick lend after that read was not counted (a lend for its queue is skipped below).
        gathered = time.monotonic()
        if repair:
            self.repair(reads)
        applied = []
        inputs = self.gather(reads=reads)
        self.remember(inputs, read_at)  # the snapshot quick lends plan on (QuickLend.lend_now)
        try:
            self.report_missing(R.missing_vm_agents(inputs), reads)
        except Exception:  # noqa: BLE001 - a report must not stop the tick
            log.exception("reporting missing VM agents failed")
        if inputs.orphans:  # jobs a restarted VM agent left in a phase: cancelled, told why
            orphanjobs.cancel(self.db, inputs.now, inputs.orphans, self._record)
        try:  # jobs of a queue no registered device can serve: marked, then cancelled, told why
            unservablejobs.settle(self.db, inputs, self.unservable_grace, self._record)
        except Exception:  # noqa: BLE001 - must not stop the tick
            log.exception("settling unservable magic queues failed")
        self.yield_to_quick_lend()  # plan() is pure Python: not alongside a quick lend's
        for action in R.plan(inputs):
            self.yield_to_quick_lend()
            try:
                if action.kind == "lend":
                    # Not alongside a quick lend: one for this queue since the tick's first read
                    # was not counted by this plan (QuickLend); the next tick plans again.
                    with self._lend_lock:
                        if self.lent_quickly_since(action.queue, gathered):
                            log.info("skipped lend of %s to %s: a quick lend since this tick's "
                                     "first read", action.device, action.queue)
                            continue
                        if self.apply(action):
                            applied.append(action)
                elif self.apply(action):
                    applied.append(action)
            except (L.StaleGeneration, L.LeaseNotFound, L.ClaimRefused, L.IllegalTransition) as exc:
                log.info("skipped %s %s: %s", action.kind, action.lease_id or action.device, exc)
            except Exception:
                log.exception("applying %s failed", action)
        return applied

    def repair(self, reads: TickReads | None = None) -> None:
        """Cheap fixes each tick runs before planning (each is idempotent and a CAS, so replicas
        may run them together), then the alerts nothing else would raise:

        * a ``returned`` lease still holding its claim or fences (a crash inside close()) is
          cleaned up (LeaseStore.repair_closed);
        * an ``active`` lease's VM agents that are still fenced (a lost undrain race, a crash
          after an undrain's or ``enrolling -> active``'s CAS) are unfenced
          (LeaseStore.repair_active_fences);
        * a lent device whose ``agents`` document shows it free again (a fault: its agent
          program started by hand while lent; a ``restoring`` lease's device agent, started by
          the restore itself, is left alone), or ``offline`` with our comment, is set
          ``maintenance`` (leases.LENT_AGENT_STATE) with our comment again
          (LeaseStore.reassert_device_fences);
        * dispatch gates that disagree with the fences or admission (a crash between the two
          writes) are synced, missing gates of devices and VM agents created
          (LeaseStore.repair_gates);
        * a device agent left ``maintenance``/``offline`` with our comment by a lease that is gone or returned
          is given back (LeaseStore.repair_device_agents; newer agents keep ``offline`` across
          restarts, testflinger#1291);
        * a job a forced drain cancelled that its agent's later post made live again is
          cancelled again (LeaseStore.recancel_overwritten);
        * overdue leases and stale agent hosts are reported once each (:meth:`watch`);
        * a returned device whose agent posted nothing within the bound is quarantined
          (:mod:`.giveback`, verified give-back).

        ``reads``: the tick's :class:`~testflinger_magic.tickreads.TickReads` (None: a fresh
        one): the steps share one read of each collection; a step that repaired something
        makes the next ones read again.
        """
        reads = reads or TickReads(self.db)
        steps = (("returned lease cleaned up after an interrupted close", self.store.repair_closed),
                 ("VM agents of an active lease unfenced", self.store.repair_active_fences),
                 ("device agent shown free (or offline) while lent set to maintenance again",
                  self.store.reassert_device_fences),
                 ("dispatch gate brought in step with fences and admission",
                  self.store.repair_gates),
                 ("device agent left offline by a lease that no longer holds it given back",
                  self.store.repair_device_agents),
                 ("jobs its forced drain cancelled, overwritten live by their agents, cancelled "
                  "again", self.store.recancel_overwritten))
        for what, step in steps:
            try:
                repaired, where = step(reads), {}
                if repaired:
                    reads.invalidate()
                    # The event names the lease's queue and device (one read per step that
                    # repaired something; a claim that never had a lease has neither).
                    where = {d["_id"]: d for d in self.db.magic_leases.find(
                        {"_id": {"$in": sorted(repaired)}}, {"queue": 1, "device": 1})}
                for lease_id in repaired:
                    queue = where.get(lease_id, {}).get("queue")
                    device = where.get(lease_id, {}).get("device")
                    name = f"{queue}: lease {lease_id} on {device}" if queue else f"lease {lease_id}"
                    log.warning("repaired %s: %s", name, what)
                    self._record("lease.repaired", f"{name}: {what}", queue=queue,
                                 device=device, lease_id=lease_id)
            except Exception:  # noqa: BLE001 - a failed repair must not stop the tick
                reads.invalidate()
                log.exception("repair failed: %s", what)
        try:
            self.watch(reads)
        except Exception:  # noqa: BLE001
            log.exception("watch failed")
        try:
            self.giveback.check(reads)
        except Exception:  # noqa: BLE001 - a failed check must not stop the tick
            log.exception("give-back check failed")

    def report_missing(self, missing: dict[str, list[str]],
                       reads: TickReads | None = None) -> None:
        """Record ``vm_agent.missing`` once per lease and set of missing VM agents
        (reconcile.missing_vm_agents): a VM agent that never registered takes no job, and the
        lease is now judged idle on the others, so a person should look at that VM. Marked with
        a CAS on ``missing_vm_agents`` (the names seen) so replicas report it once; it does not
        bump ``generation`` (the daemon's in-flight report must not get a 409 for it).

        Cleared (CAS on the names seen) on the leases the tick read that carry names no longer
        missing: open leases, leases that keep their claim (``failed``) and returned leases
        not yet judged by the give-back check (``reads``: the tick's reads), which every
        closing lease passes through; status shows the field of open leases only."""
        for lease_id, names in sorted(missing.items()):
            res = self.db.magic_leases.update_one(
                {"_id": lease_id, "state": {"$in": [L.ACTIVE, L.DRAINING]},
                 "missing_vm_agents": {"$ne": names}},
                {"$set": {"missing_vm_agents": names}})
            if not res.modified_count:
                continue
            lease = self.db.magic_leases.find_one({"_id": lease_id}) or {}
            self._record("vm_agent.missing",
                         f"{lease.get('queue')}: lease {lease_id} on {lease.get('device')}: "
                         f"{_plural_agents(names)} never registered with the server "
                         f"{int(self.vm_agent_grace)}s after the lease became active: "
                         f"{', '.join(names)}; the lease is judged idle on its other agents",
                         queue=lease.get("queue"), device=lease.get("device"),
                         lease_id=lease_id, data={"agents": names})
        # Agents that registered late (or leases that moved on) are no longer missing: status
        # reads this field, so clear it (CAS on the names seen).
        reads = reads or TickReads(self.db)
        seen = {lease["_id"]: lease for lease in reads.open_leases()}
        seen.update(reads.leases_by_id(c.get("lease_id") for c in reads.claims()))
        seen.update({lease["_id"]: lease for lease in reads.recently_returned(
            self.giveback.horizon(self.clock()))})
        for doc in (seen[i] for i in sorted(i for i, d in seen.items()
                                            if d.get("missing_vm_agents") and i not in missing)):
            self.db.magic_leases.update_one(
                {"_id": doc["_id"], "missing_vm_agents": doc["missing_vm_agents"]},
                {"$set": {"missing_vm_agents": []}})

    def _record(self, kind: str, message: str, **kw) -> None:
        try:
            self.events.record(kind, message, **kw)
        except Exception:  # noqa: BLE001 - the change it reports is done
            log.exception("could not record event %s", kind)

    def alerts(self) -> dict:
        """``{"overdue_leases": [{lease_id, device, queue, agent_host, state, deadline,
        overdue_for}], "stale_agent_hosts": [{name, last_heartbeat, silent_for, devices,
        instance}]}`` at
        ``clock()`` (reconcile.overdue_leases / reconcile.stale_hosts decide)."""
        return self._alerts()[0]

    def _alerts(self, reads: TickReads | None = None) -> tuple[dict, dict, dict]:
        """``(alerts, restoring lease documents by id, agent host documents by name)``;
        ``reads``: the tick's (its open leases), else the restoring leases are read."""
        from testflinger_magic import reconcile as R  # noqa: PLC0415

        now = self.clock()
        restoring = ([d for d in reads.open_leases() if d["state"] == L.RESTORING]
                     if reads is not None else self.store.list(state=L.RESTORING))
        docs = {d["_id"]: d for d in restoring}
        overdue = [{"lease_id": v.id, "device": v.device, "queue": v.queue,
                    "agent_host": docs[v.id].get("agent_host"), "state": v.state,
                    "deadline": v.deadline, "overdue_for": now - v.deadline}
                   for v in R.overdue_leases([self._lease_view(R, d) for d in docs.values()
                                              # views of those past their deadline only
                                              if d.get("deadline") is not None
                                              and now >= d["deadline"]], now)]
        hosts = {h["_id"]: h for h in (reads.agent_hosts() if reads is not None
                                       else self.db.magic_agent_hosts.find({}))}
        stale = [{"name": n, "last_heartbeat": hosts[n].get("last_heartbeat"),
                  "silent_for": (now - hosts[n]["last_heartbeat"])
                  if hosts[n].get("last_heartbeat") is not None else None,
                  "devices": list(hosts[n].get("devices") or []),
                  # the daemon instance last accepted (hostinstance.py): which machine to look at
                  "instance": hosts[n].get("instance")}
                 for n in R.stale_hosts({n: h.get("last_heartbeat") for n, h in hosts.items()}, now)]
        return {"overdue_leases": overdue, "stale_agent_hosts": stale}, docs, hosts

    def watch(self, reads: TickReads | None = None) -> dict:
        """Record one event per overdue lease (per deadline) and per stale agent host (per last
        heartbeat). Marked with a CAS on a flag (``overdue_reported`` = the deadline seen,
        ``stale_reported`` = the heartbeat seen) so replicas report each once. The lease flag
        does not bump ``generation``: the daemon's in-flight report on that lease must not get
        a 409 for a change it has nothing to do with. Returns :meth:`alerts`. ``reads``: the
        tick's shared reads (:class:`~testflinger_magic.tickreads.TickReads`), if any."""
        found, docs, hosts = self._alerts(reads)
        for o in found["overdue_leases"]:
            if docs[o["lease_id"]].get("overdue_reported") == o["deadline"]:
                continue  # reported (the CAS below would match nothing): no write per tick
            res = self.db.magic_leases.update_one(
                {"_id": o["lease_id"], "state": L.RESTORING, "deadline": o["deadline"],
                 "overdue_reported": {"$ne": o["deadline"]}},
                {"$set": {"overdue_reported": o["deadline"]}})
            if res.modified_count:
                self._record("lease.overdue", f"{o['queue']}: lease {o['lease_id']} on "
                             f"{o['device']} is still restoring {int(o['overdue_for'])}s past its "
                             f"deadline; is agent host {o['agent_host']} working it?",
                             queue=o["queue"], device=o["device"], lease_id=o["lease_id"])
        for h in found["stale_agent_hosts"]:
            if hosts[h["name"]].get("stale_reported") == h["last_heartbeat"]:
                continue
            res = self.db.magic_agent_hosts.update_one(
                {"_id": h["name"], "last_heartbeat": h["last_heartbeat"],
                 "stale_reported": {"$ne": h["last_heartbeat"]}},
                {"$set": {"stale_reported": h["last_heartbeat"]}})
            if res.modified_count:
                self._record("agent_host.stale", f"agent host {h['name']} has sent no heartbeat "
                             f"for {int(h['silent_for'] or 0)}s; its leases are not being worked "
                             f"(devices: {', '.join(h['devices']) or 'none'})",
                             data={"host": h["name"]})
        return found

    # ------------------------------------------------------------------ operator actions
    def lease(self, lease_id: str) -> dict:
        """One lease (NotFound)."""
        try:
            return self.store.get(lease_id)
        except L.LeaseNotFound:
            raise NotFound(f"no lease {lease_id}") from None

    def leases(self, queue=None, state=None, open_only=False) -> list[dict]:
        """Leases by filter, oldest first."""
        return self.store.list(queue=queue, state=state, open_only=open_only)

    def devices(self) -> list[dict]:
        """Registered devices with their open lease id (or None)."""
        claims = {c["_id"]: c.get("lease_id") for c in self.db.magic_device_claims.find({})}
        return [dict(d, lease_id=claims.get(d["_id"]))
                for d in self.db.magic_devices.find({}, sort=[("_id", 1)])]

    def host_conditions(self, hosts: list[dict] | None = None) -> tuple[set[str], set[str]]:
        """``(stale, maas_down)``: the agent hosts stale now (reconcile.stale_hosts: no
        heartbeat for STALE_HOST_AFTER) and the others whose daemon says MAAS does not answer
        (``maas_unreachable_since``, as the tick's ``Inputs.maas_down_hosts``), by name, for the
        preflight's device count (:mod:`.devicecount`). ``hosts``: ``magic_agent_hosts``
        documents (``_id``, ``last_heartbeat``, ``maas_unreachable_since``) already read, else
        one read of them."""
        from testflinger_magic import reconcile as R  # noqa: PLC0415

        if hosts is None:
            hosts = list(self.db.magic_agent_hosts.find(
                {}, {"last_heartbeat": 1, "maas_unreachable_since": 1}))
        now = self.clock()
        stale = set(R.stale_hosts({h["_id"]: h.get("last_heartbeat") for h in hosts}, now))
        down = R.maas_down_hosts({h["_id"]: h.get("maas_unreachable_since") for h in hosts},
                                 stale, now)
        return stale, set(down)

    def _quarantine(self, device: str, on: bool, reason: str, queue: str | None = None,
                    lease_id: str | None = None) -> bool:
        """Set the device's quarantine (CAS on the flag); the event names ``queue`` when given,
        so that queue's webhooks hear of it. ``lease_id``: the lease whose counted failure this
        quarantine is for (``quarantine_lease``; the planner's quarantine for the failure
        count), None for any other cause (an operator, a failed give-back check): only the
        former is lifted when that failure is taken back. True if this call changed it."""
        sets = {"quarantined": on, "quarantine_reason": reason if on else None,
                "quarantine_lease": lease_id if on else None}
        if not on:
            sets["failures"] = 0
        res = self.db.magic_devices.update_one({"_id": device, "quarantined": {"$ne": on}},
                                               {"$set": sets})
        if res.modified_count:
            self.events.record("device.quarantined" if on else "device.unquarantined",
                               f"{device}: {'quarantined' if on else 'unquarantined'}: {reason}",
                               device=device, queue=queue)
        return bool(res.modified_count)

    def status(self) -> dict:
        """What operators look at (``GET /v1/magic/status``, the status page, ``status``).

        ``{"queues": [{name, waiting, vm_agents, leases, devices_lendable (eligible, registered,
        not quarantined, not held by a lease, agent host not stale: :mod:`.devicecount`),
        devices_eligible, missing_vm_agents (names; see :meth:`report_missing`), suspended
        (reason or None), blocked (None, or ``{why, reason}``:
        why its waiting jobs get no device, the ``blocked`` action ``plan`` explains:
        ``why`` one of suspended, no_device, max_devices, max_starting), quarantined
        ([{device, reason}] of its eligible devices)}], "invalid_queues": [{name, reason}]
        (stored documents that do not validate), "leases": [open lease documents, each with
        ``running_jobs``: [{agent, job_id}] of its busy VM agents (an agent that restarted
        mid-job runs none, :mod:`testflinger_magic.stalejob`); a draining lease's grace deadline
        is ``drain.grace_until``], "devices": [...], "overdue_leases": [...],
        "stale_agent_hosts": [... each with leases and registered], "borrowed": [{queue,
        home_pool, gpu_hours, leases}] (GPU-hours of closed leases,
        testflinger_magic.fairness), "failed_leases": [...], "home_waits": [...]}`` (overdue
        and stale: :meth:`alerts`; failed leases, a stale host's leases, home waits:
        :mod:`.attention`).

        One read path with ``plan``: the reasons come from the same read-only gather and
        ``reconcile.plan(explain=True)``; the rest adds a fixed number of queries (open leases,
        devices and claims, agent hosts), however many leases or devices there are."""
        from testflinger_magic import reconcile as R  # noqa: PLC0415

        inputs = self.gather(read_only=True)
        blocked = {a.queue: a for a in R.plan(inputs, explain=True) if a.kind in R.NON_ACTING}
        defs, suspended, demand = inputs.definitions, inputs.suspended, inputs.demand
        running: dict[str, list[dict]] = {}
        for vm in inputs.vm_agents:
            if vm.job_id and vm.busy:  # an idle one (a restarted one included) runs none
                running.setdefault(vm.lease_id, []).append({"agent": vm.name, "job_id": vm.job_id})
        open_leases = [dict(x, running_jobs=running.get(x["_id"], []))
                       for x in self.store.list(open_only=True)]
        devices = self.devices()
        # Devices whose own agent is busy at home (reconcile's "busy": not lent now).
        busy = {d.name for d in inputs.devices if R.busy_at_home(d.agent_state, d.job_id)}
        queues = []
        for q in defs:
            mine = [x for x in open_leases if x["queue"] == q.name]
            eligible = [d for d in devices if q.matches(d)]
            counts = devicecount.count(q, devices, inputs.stale_hosts, busy,
                                       inputs.maas_down_hosts, inputs.now)
            why = blocked.get(q.name)
            queues.append({
                "name": q.name,
                "waiting": demand[q.name].waiting,
                "vm_agents": sum(len(x.get("vms") or []) for x in mine if x["state"] == L.ACTIVE),
                "leases": len(mine),
                # Lendable now, not merely eligible nor on a stale agent host (devicecount:
                # one definition with the preflight testflinger-cli sees).
                "devices_lendable": counts["lendable"],
                "devices_eligible": counts["eligible"],
                "missing_vm_agents": sorted(n for x in mine
                                            for n in x.get("missing_vm_agents") or []),
                "suspended": suspended.get(q.name),
                "blocked": {"why": why.data.get("why"), "reason": why.reason} if why else None,
                "quarantined": [{"device": d["_id"], "reason": d.get("quarantine_reason")}
                                for d in eligible if d.get("quarantined")],
                # Why no registered device can ever serve it (none selected, too few GPUs,
                # NVSwitch hosts refused: the preflight's 404 sends test engineers here; TRIAL10).
                "unservable": None if counts["eligible"] else devicecount.no_match_reason(
                    q, devices),
                # When its waiting jobs are cancelled, told why (server/unservablejobs.py),
                # unless a device that fits registers first; epoch seconds, None: not marked.
                "cancel_waiting_at": (inputs.unservable[q.name] + self.unservable_grace
                                      if q.name in inputs.unservable else None),
            })
        valid = {q.name for q in defs}
        invalid = [{"name": d["_id"], "reason": d.get("invalid") or "invalid"}
                   for d in self.db.magic_queues.find({}, {"invalid": 1}, sort=[("_id", 1)])
                   if d["_id"] not in valid]
        # For the people reading it (server/attention.py): failed leases still holding their
        # device, the leases of stale agent hosts, home queues waiting for lent devices.
        failed_ids = [x.id for x in inputs.leases if x.state == L.FAILED]
        failed = attention.failed_leases(
            list(self.db.magic_leases.find({"_id": {"$in": failed_ids}})) if failed_ids else [],
            devices)
        alerts, _, hosts = self._alerts()
        alerts["stale_agent_hosts"] = attention.with_host_leases(
            alerts["stale_agent_hosts"],
            open_leases + [dict(f, _id=f["lease_id"], state=L.FAILED) for f in failed], hosts)
        return {"queues": queues, "invalid_queues": invalid, "leases": open_leases,
                "devices": devices, "borrowed": fairness.totals(self.db),
                "failed_leases": failed,
                "home_waits": attention.home_waits(inputs, {q.name: q for q in defs}),
                # Quarantines of devices not registered now, taken back at their registration
                # (keptquarantine; an unquarantine of the name lifts one).
                "kept_quarantines": [
                    {"device": k["_id"], "maas_system_id": k.get("maas_system_id"),
                     "reason": k.get("reason"), "host": k.get("host"), "kept_at": k.get("kept_at")}
                    for k in keptquarantine.listed(self.db)],
                **alerts}
