"""Effect code of the server plugin: read reconcile Inputs from MongoDB, apply Actions with CAS.

``reconcile.plan`` decides; this module only executes. Every write is a compare-and-set (through
LeaseStore or a filtered single-document update); a CAS that fails means another replica (or a
daemon report) got there first, so the action is skipped and the next tick re-plans.

Besides ``tick`` it holds the effects behind the REST API (register, report, drain/lend by hand,
quarantine), so api.py stays a thin translation layer. Domain errors are the exceptions below.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timezone

from testflinger_magic import leases as L
from testflinger_magic import queues as queues_mod
from testflinger_magic import tfstates
from testflinger_magic.db import DuplicateKeyErrors
from testflinger_magic.durations import parse_duration
from testflinger_magic.server.giveback import GiveBackWatch

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
WORK_STATES = sorted(L.DAEMON_STATES | {L.ACTIVE})
#: Drain kinds demand may cancel (reconcile.UNDRAINABLE; repeated here so the engine refuses an
#: undrain of an owner's or operator's drain even if asked).
UNDRAINABLE = frozenset({"idle", "consolidate"})
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


class EngineError(Exception):
    """Base of the errors the HTTP layer translates."""


class NotFound(EngineError):
    """Unknown lease or device (404)."""


class Forbidden(EngineError):
    """The agent host does not own the device (403)."""


class Conflict(EngineError):
    """Stale generation/state or a refused claim (409); ``.lease`` is the current lease."""

    def __init__(self, message: str, lease: dict | None = None):
        super().__init__(message)
        self.lease = lease


class QueuesInUse(Conflict):
    """Applying would remove magic queues that still have waiting jobs (409): a job must never
    be stranded (nothing would ever serve it). ``.waiting`` is ``{queue: waiting jobs}``."""

    def __init__(self, waiting: dict[str, int]):
        listed = ", ".join(f"{q} ({n} waiting job{'' if n == 1 else 's'})"
                           for q, n in sorted(waiting.items()))
        super().__init__(f"refusing to remove magic queue(s) with waiting jobs: {listed}; keep "
                         "them in the file, or apply with force (CLI: apply --force) to remove "
                         "them and cancel those jobs")
        self.waiting = dict(waiting)


class Invalid(EngineError):
    """A well-formed body asking for something illegal (422); ``.field`` names the field."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def invalid_reason(exc: Exception) -> str:
    """One line saying why a stored definition does not validate: ``field: message; ...`` for a
    pydantic ValidationError, the exception text otherwise."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(document)'}: {e['msg']}"
                             for e in errors(include_url=False))
        except Exception:  # noqa: BLE001 - fall back to the text
            pass
    return f"{type(exc).__name__}: {exc}"


def _plural_agents(names: list) -> str:
    return f"{len(names)} VM agent" + ("" if len(names) == 1 else "s")


def epoch(value) -> float | None:
    """Epoch seconds of a Testflinger timestamp (a datetime, naive = UTC, as pymongo returns
    them) or of a number; None stays None."""
    if value is None:
        return None
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value.timestamp()
    return float(value)


class Engine:
    """Reconcile executor for one replica.

    ``db``: Testflinger's database; ``store``: :class:`testflinger_magic.leases.LeaseStore`;
    ``events``: :class:`testflinger_magic.events.EventLog`; ``clock() -> epoch seconds``.
    ``metrics`` (optional, set by the plugin): :class:`.metrics.Metrics`.
    """

    def __init__(self, db, store, events, clock=time.time):
        self.db = db
        self.store = store
        self.events = events
        self.clock = clock
        self.metrics = None
        from testflinger_magic import reconcile as R  # noqa: PLC0415

        #: Seconds after activation before a VM agent that never registered counts as missing
        #: (reconcile.VM_AGENT_GRACE; a lab or a test may shrink it on the plugin's engine).
        self.vm_agent_grace = R.VM_AGENT_GRACE
        #: Verified give-back: a returned device's agent must post within ``giveback.bound`` s.
        self.giveback = GiveBackWatch(db, events, self._quarantine, clock)

    # ------------------------------------------------------------------ gather (reads only)
    def definitions(self) -> list:
        """Applied MagicQueue definitions, by name. An invalid stored document is skipped (see
        :meth:`stored`): one bad queue must not stop the others."""
        return self.stored()[0]

    def stored(self) -> tuple[list, dict[str, str]]:
        """``(definitions, suspended)``: the valid stored MagicQueues by name, and ``{name:
        reason}`` of those whose lending is suspended (``magic_queues.suspended``).

        A document that does not validate (written by an older version, by hand, or half
        written) is skipped; the first time a given problem is seen it is marked on the document
        (``invalid``: the reason, compare-and-set so replicas agree) and reported by an event
        ``queue.invalid`` and an error log line naming it. Applying the queue again clears it.
        """
        defs, suspended = [], {}
        for doc in self.db.magic_queues.find({}, sort=[("_id", 1)]):
            try:
                q = queues_mod.MagicQueue.from_document(doc)
            except Exception as exc:  # noqa: BLE001 - pydantic.ValidationError, TypeError...
                self._invalid_definition(doc, exc)
                continue
            defs.append(q)
            if doc.get("suspended"):
                suspended[q.name] = str((doc["suspended"] or {}).get("reason") or "suspended")
        return defs, suspended

    def _invalid_definition(self, doc: dict, exc: Exception) -> None:
        name = doc.get("_id")
        why = invalid_reason(exc)
        res = self.db.magic_queues.update_one({"_id": name, "invalid": {"$ne": why}},
                                              {"$set": {"invalid": why}})
        if res.modified_count:
            log.error("magic_queues/%s is not a valid definition, skipped until applied again: "
                      "%s", name, why)
            self.events.record("queue.invalid", f"{name}: stored definition is invalid and is "
                               f"ignored until applied again: {why}", queue=str(name))
        else:
            log.debug("magic_queues/%s still invalid: %s", name, why)

    def problem(self, name: str) -> str | None:
        """Why the stored queue ``name`` lends nothing now (its document is invalid, or lending
        is suspended), or None (also for a queue that is not stored)."""
        doc = self.db.magic_queues.find_one({"_id": name}) if isinstance(name, str) else None
        if doc is None:
            return None
        try:
            queues_mod.MagicQueue.from_document(doc)
        except Exception as exc:  # noqa: BLE001
            return f"its stored definition is invalid ({invalid_reason(exc)}); apply it again"
        if doc.get("suspended"):
            from testflinger_magic import reconcile as R  # noqa: PLC0415

            reason = (doc["suspended"] or {}).get("reason") or "suspended"
            return f"lending is suspended: {R.with_reapply_advice(reason)} (testflinger-magic apply)"
        return None

    def gather(self, read_only: bool = False):
        """Build ``reconcile.Inputs`` from MongoDB (definitions, devices, demand, open leases,
        ``failed`` leases that still hold their device's claim, VM agents) at ``clock()``.

        Failed leases are included because they keep the device fenced until an operator
        unquarantines it: without them reconcile would plan a ``lend`` of that device every tick,
        refused every tick (an event and a webhook each time, and with ``max_starting`` 1 no
        healthy device would ever be lent).

        ``read_only``: write nothing (GET /v1/magic/plan is a dry run): ``idle_since`` is worked
        out in memory instead of stored, and done dispatch markers are not pruned. Otherwise
        ``idle_since`` is kept up to date (CAS) and stale markers pruned.
        """
        from testflinger_magic import reconcile as R  # noqa: PLC0415

        now = self.clock()
        defs, suspended = self.stored()
        demand = self._demand(now, [q.name for q in defs])
        agents = {}
        leases = self.store.list(open_only=True)
        held = [c["lease_id"] for c in self.db.magic_device_claims.find({}, {"lease_id": 1})
                if c.get("lease_id")]
        failed = list(self.db.magic_leases.find({"_id": {"$in": held}, "state": L.FAILED})) \
            if held else []
        names = [d["_id"] for d in self.db.magic_devices.find({}, {"_id": 1})]
        names += [vm["agent_name"] for lease in leases for vm in lease.get("vms") or []]
        held = {}
        if names:
            for doc in self.db.agents.find({"name": {"$in": names}}):
                agents[doc["name"]] = doc
            # A newer Testflinger attributes a popped job to its agent itself (testflinger#1253),
            # and a newer agent no longer posts job_id: an absent or empty job_id is not idle.
            held = self.store.gates.held_by(names)
        devices = []
        for d in self.db.magic_devices.find({}):
            a = agents.get(d["_id"], {})
            devices.append(R.DeviceView(
                name=d["_id"], agent_host=d.get("agent_host"), gpus=int(d.get("gpus") or 0),
                tags=list(d.get("tags") or []), home_queues=list(d.get("home_queues") or []),
                agent_state=a.get("state"), job_id=a.get("job_id") or held.get(d["_id"]),
                quarantined=bool(d.get("quarantined")), failures=int(d.get("failures") or 0),
                last_home_use=epoch(a.get("updated_at")), registered=True))
        lease_views = [self._lease_view(R, lease) for lease in failed]
        vm_views = []
        for lease in leases:
            lease_views.append(self._lease_view(R, lease))
            if lease["state"] not in (L.ACTIVE, L.DRAINING):
                continue  # VM agents exist only once the lease is active
            views = []
            for vm in lease.get("vms") or []:
                a = agents.get(vm["agent_name"])
                if a is None:
                    continue  # not reporting yet: reconcile counts it as "coming"
                # Working, not merely polling: a poll in flight is no job (see agent_busy).
                busy = self.store.agent_busy(vm["agent_name"], include_pending=False,
                                             prune=not read_only)
                views.append(R.VMAgentView(
                    name=vm["agent_name"], lease_id=lease["_id"], queue=lease["queue"],
                    state=a.get("state"), job_id=a.get("job_id") or held.get(vm["agent_name"]),
                    busy=busy is not None))
            lease = self._track_idle(lease, views, now, read_only)
            lease_views[-1] = self._lease_view(R, lease)
            vm_views.extend(views)
        return R.Inputs(definitions=defs, devices=devices, demand=demand, leases=lease_views,
                        vm_agents=vm_views, now=now, suspended=suspended,
                        vm_agent_grace=self.vm_agent_grace)

    @staticmethod
    def _lease_view(R, lease: dict):
        return R.LeaseView(
            id=lease["_id"], device=lease["device"], queue=lease["queue"], state=lease["state"],
            generation=lease["generation"], created_at=lease.get("created_at"),
            updated_at=lease.get("updated_at"), deadline=lease.get("deadline"),
            vms=len(lease.get("vms") or []), drain=lease.get("drain"),
            admission=lease.get("admission", "open"), idle_since=lease.get("idle_since"),
            active_since=next((h.get("at") for h in lease.get("history") or []
                               if h.get("state") == L.ACTIVE), None),
            vm_names=[vm["agent_name"] for vm in lease.get("vms") or []])

    def _track_idle(self, lease: dict, views: list, now: float, read_only: bool = False) -> dict:
        """Keep ``idle_since`` of an active lease: None while a VM agent is busy, the time it
        became all idle otherwise (reconcile's idle_timeout counts from it). CAS; a lost race
        keeps the document as read. ``read_only``: the same value, in a copy only."""
        if lease["state"] != L.ACTIVE:
            return lease
        busy = any(v.busy for v in views)
        if busy == (lease.get("idle_since") is None):
            return lease
        if read_only:
            return dict(lease, idle_since=None if busy else now)
        try:
            return self.store.progress(lease["_id"], L.ACTIVE, lease["generation"],
                                       set_fields={"idle_since": None if busy else now})
        except (L.StaleGeneration, L.LeaseNotFound):
            return lease

    def _demand(self, now: float, magic_names: list[str]) -> dict:
        """QueueDemand per queue with waiting jobs (Testflinger's indexed
        ``(result_data.job_state, job_data.job_queue)``), plus every magic queue."""
        from testflinger_magic import reconcile as R  # noqa: PLC0415

        acc: dict[str, dict] = {}
        for job in self.db.jobs.find(
            {"result_data.job_state": tfstates.JOB_WAITING},
            {"job_data.job_queue": 1, "job_priority": 1, "created_at": 1},
        ):
            queue = (job.get("job_data") or {}).get("job_queue")
            if not queue:
                continue
            a = acc.setdefault(queue, {"n": 0, "prio": 0, "oldest": None, "last": None})
            created = epoch(job.get("created_at")) or now
            a["n"] += 1
            a["prio"] = max(a["prio"], int(job.get("job_priority") or 0))
            a["oldest"] = created if a["oldest"] is None else min(a["oldest"], created)
            a["last"] = created if a["last"] is None else max(a["last"], created)
        out = {}
        for name in set(acc) | set(magic_names):
            a = acc.get(name)
            last = a["last"] if a else None
            if name in magic_names:
                # Idle timeout counts from the queue's latest job, waiting or not.
                latest = self.db.jobs.find({"job_data.job_queue": name}, {"created_at": 1},
                                           sort=[("created_at", -1)], limit=1)
                for j in latest:
                    last = epoch(j.get("created_at"))
            out[name] = R.QueueDemand(
                waiting=a["n"] if a else 0, max_priority=a["prio"] if a else 0,
                oldest_age=max(0.0, now - a["oldest"]) if a else 0.0, last_job_at=last)
        return out

    # ------------------------------------------------------------------ plan and apply
    def plan_only(self, explain: bool = False) -> list:
        """The actions a tick would apply now (dry run; no writes: a read-only gather).
        ``explain``: also the non-acting ``blocked`` actions saying why demand stays unmet
        (GET /v1/magic/plan)."""
        from testflinger_magic import reconcile as R  # noqa: PLC0415

        return R.plan(self.gather(read_only=True), explain=explain)

    def tick(self) -> list:
        """Repair, gather, plan, apply. Returns the actions that were applied (CAS won)."""
        from testflinger_magic import reconcile as R  # noqa: PLC0415

        self.repair()
        applied = []
        inputs = self.gather()
        try:
            self.report_missing(R.missing_vm_agents(inputs))
        except Exception:  # noqa: BLE001 - a report must not stop the tick
            log.exception("reporting missing VM agents failed")
        for action in R.plan(inputs):
            try:
                if self.apply(action):
                    applied.append(action)
            except (L.StaleGeneration, L.LeaseNotFound, L.ClaimRefused, L.IllegalTransition) as exc:
                log.info("skipped %s %s: %s", action.kind, action.lease_id or action.device, exc)
            except Exception:
                log.exception("applying %s failed", action)
        return applied

    def repair(self) -> None:
        """Cheap fixes each tick runs before planning (each is idempotent and a CAS, so replicas
        may run them together), then the alerts nothing else would raise:

        * a ``returned`` lease still holding its claim or fences (a crash inside close()) is
          cleaned up (LeaseStore.repair_closed);
        * an ``active`` lease's VM agents that are still fenced (a lost undrain race, a crash
          after an undrain's or ``enrolling -> active``'s CAS) are unfenced
          (LeaseStore.repair_active_fences);
        * a lent device whose ``agents`` document shows it free again (its restarted agent's
          startup post landed after the claim) is set ``offline`` with our comment again
          (LeaseStore.reassert_device_fences);
        * dispatch gates that disagree with the fences or admission (a crash between the two
          writes) are synced, missing gates of devices and VM agents created
          (LeaseStore.repair_gates);
        * a device agent left ``offline`` with our comment by a lease that is gone or returned
          is given back (LeaseStore.repair_device_agents; newer agents keep ``offline`` across
          restarts, testflinger#1291);
        * overdue leases and stale agent hosts are reported once each (:meth:`watch`);
        * a returned device whose agent posted nothing within the bound is quarantined
          (:mod:`.giveback`, verified give-back).
        """
        steps = (("returned lease cleaned up after an interrupted close", self.store.repair_closed),
                 ("VM agents of an active lease unfenced", self.store.repair_active_fences),
                 ("device agent shown free while lent set offline again",
                  self.store.reassert_device_fences),
                 ("dispatch gate brought in step with fences and admission",
                  self.store.repair_gates),
                 ("device agent left offline by a lease that no longer holds it given back",
                  self.store.repair_device_agents))
        for what, step in steps:
            try:
                for lease_id in step():
                    log.warning("repaired lease %s: %s", lease_id, what)
                    self._record("lease.repaired", f"lease {lease_id}: {what}", lease_id=lease_id)
            except Exception:  # noqa: BLE001 - a failed repair must not stop the tick
                log.exception("repair failed: %s", what)
        try:
            self.watch()
        except Exception:  # noqa: BLE001
            log.exception("watch failed")
        try:
            self.giveback.check()
        except Exception:  # noqa: BLE001 - a failed check must not stop the tick
            log.exception("give-back check failed")

    def report_missing(self, missing: dict[str, list[str]]) -> None:
        """Record ``vm_agent.missing`` once per lease and set of missing VM agents
        (reconcile.missing_vm_agents): a VM agent that never registered takes no job, and the
        lease is now judged idle on the others, so a person should look at that VM. Marked with
        a CAS on ``missing_vm_agents`` (the names seen) so replicas report it once; it does not
        bump ``generation`` (the daemon's in-flight report must not get a 409 for it)."""
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
        for doc in self.db.magic_leases.find(
                {"missing_vm_agents": {"$nin": [None, []]}, "_id": {"$nin": sorted(missing)}},
                {"missing_vm_agents": 1}):
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
        overdue_for}], "stale_agent_hosts": [{name, last_heartbeat, silent_for, devices}]}`` at
        ``clock()`` (reconcile.overdue_leases / reconcile.stale_hosts decide)."""
        from testflinger_magic import reconcile as R  # noqa: PLC0415

        now = self.clock()
        docs = {d["_id"]: d for d in self.store.list(state=L.RESTORING)}
        overdue = [{"lease_id": v.id, "device": v.device, "queue": v.queue,
                    "agent_host": docs[v.id].get("agent_host"), "state": v.state,
                    "deadline": v.deadline, "overdue_for": now - v.deadline}
                   for v in R.overdue_leases([self._lease_view(R, d) for d in docs.values()], now)]
        hosts = {h["_id"]: h for h in self.db.magic_agent_hosts.find({})}
        stale = [{"name": n, "last_heartbeat": hosts[n].get("last_heartbeat"),
                  "silent_for": (now - hosts[n]["last_heartbeat"])
                  if hosts[n].get("last_heartbeat") is not None else None,
                  "devices": list(hosts[n].get("devices") or [])}
                 for n in R.stale_hosts({n: h.get("last_heartbeat") for n, h in hosts.items()}, now)]
        return {"overdue_leases": overdue, "stale_agent_hosts": stale}

    def watch(self) -> dict:
        """Record one event per overdue lease (per deadline) and per stale agent host (per last
        heartbeat). Marked with a CAS on a flag (``overdue_reported`` = the deadline seen,
        ``stale_reported`` = the heartbeat seen) so replicas report each once. The lease flag
        does not bump ``generation``: the daemon's in-flight report on that lease must not get
        a 409 for a change it has nothing to do with. Returns :meth:`alerts`."""
        found = self.alerts()
        for o in found["overdue_leases"]:
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

    def apply(self, action) -> bool:
        """Apply one ``reconcile.Action``; True if it changed something. Non-acting kinds
        (``blocked``: an explanation) change nothing."""
        from testflinger_magic import reconcile as R  # noqa: PLC0415

        if action.kind in R.NON_ACTING:
            return False
        handler = getattr(self, f"_do_{action.kind}", None)
        if handler is None:
            log.warning("unknown action kind %r", action.kind)
            return False
        return bool(handler(action))

    def _lease_at(self, action) -> dict | None:
        """The action's lease if still at the planned generation (else None: someone moved it)."""
        lease = self.db.magic_leases.find_one({"_id": action.lease_id})
        if lease is None or (action.generation is not None
                             and lease["generation"] != action.generation):
            return None
        return lease

    def _do_lend(self, action) -> bool:
        q = self._definition(action.queue)
        dev = self.db.magic_devices.find_one({"_id": action.device})
        if q is None or dev is None:
            return False
        vms = int((action.data or {}).get("vms") or q.vms_for(int(dev.get("gpus") or 0)))
        self.store.claim(action.device, q, dev["agent_host"], vms, action.reason)
        if self.metrics:
            self.metrics.lends.labels(queue=q.name).inc()
        return True

    def _drain_doc(self, lease: dict, reason: str, grace: float | None, forced: bool,
                   kind: str = "operator") -> dict:
        """The lease's ``drain`` field. ``kind`` (reconcile's drain kinds, or ``operator``/
        ``error``) decides whether demand may undrain it (only ``idle``/``consolidate``)."""
        if grace is None:
            grace = (lease.get("timeouts") or {}).get("grace") or L.DEFAULT_GRACE
        now = self.clock()
        return {"reason": reason, "kind": kind, "requested_at": now,
                "grace_until": now + float(grace), "forced": bool(forced)}

    def _do_drain(self, action) -> bool:
        lease = self._lease_at(action)
        if lease is None or lease["state"] != L.ACTIVE:
            return False
        data = action.data or {}
        drain = self._drain_doc(lease, action.reason, data.get("grace"), data.get("force", False),
                                data.get("kind", "operator"))
        new = self.store.transition(lease["_id"], L.ACTIVE, lease["generation"], L.DRAINING,
                                    action.reason, set_fields={"drain": drain})
        # After the CAS: a failed transition must not leave an active lease fenced. A crash here
        # is repaired by restore, which fences again before checking idleness.
        self._fence_vms(new, action.reason)
        if self.metrics:
            self.metrics.drains.labels(queue=new["queue"]).inc()
        return True

    def _do_undrain(self, action) -> bool:
        lease = self._lease_at(action)
        drain = (lease.get("drain") or {}) if lease else {}
        if (lease is None or lease["state"] != L.DRAINING or drain.get("forced")
                or drain.get("kind") not in UNDRAINABLE):
            return False
        new = self.store.transition(lease["_id"], L.DRAINING, lease["generation"], L.ACTIVE,
                                    action.reason, set_fields={"drain": None, "idle_since": None})
        # Only fences at or below the new generation: a drain that wins the next CAS fences
        # after it, with a higher one. A restore that lost to this undrain may fence again after
        # this; the next tick's repair_active_fences lifts that.
        self.store.lift_vm_fences(new)
        return True

    def force_wait(self, lease: dict) -> float:
        """Seconds a forced drain waits, after cancelling, for its VM agents to go idle before
        it is restored anyway: the lease's policy grace (``reclaim.grace`` at claim), else
        leases.DEFAULT_FORCE_WAIT (10 min). Agents see a cancel only every 10 s and not during
        provision (TESTFLINGER.md §3.6)."""
        return float((lease.get("timeouts") or {}).get("grace") or L.DEFAULT_FORCE_WAIT)

    def _do_force(self, action) -> bool:
        """Commit the force (CAS: ``drain.forced_at``, ``force_until``; an active lease goes to
        draining), then fence, then cancel the VM agents' jobs, then record what was cancelled
        (``drain.cancelled``). Nothing is cancelled unless the CAS won. The lease stays
        ``draining``: reconcile restores it once every VM agent is idle, or at ``force_until``.
        A force already committed (a crash before its cancel was recorded) only fences and
        cancels again (idempotent)."""
        lease = self._lease_at(action)
        if lease is None or lease["state"] not in (L.ACTIVE, L.DRAINING):
            return False
        drain = lease.get("drain") or {}
        if drain.get("forced_at") is None:
            now = self.clock()
            if not drain:
                drain = self._drain_doc(lease, action.reason, 0, True, "forced")
            drain = dict(drain, forced=True, forced_at=now,
                         force_until=now + self.force_wait(lease), cancelled=None)
            fields = {"drain": drain, "deadline": drain["force_until"]}
            if lease["state"] == L.ACTIVE:
                lease = self.store.transition(lease["_id"], L.ACTIVE, lease["generation"],
                                              L.DRAINING, action.reason, set_fields=fields)
            else:
                lease = self.store.progress(lease["_id"], L.DRAINING, lease["generation"],
                                            set_fields=fields)
        elif lease["state"] != L.DRAINING:
            return False
        self._fence_vms(lease, action.reason)
        cancelled = self._cancel_jobs(lease)
        try:
            self.store.progress(lease["_id"], L.DRAINING, lease["generation"],
                                set_fields={"drain": dict(lease["drain"], cancelled=cancelled)})
        except (L.StaleGeneration, L.LeaseNotFound):
            pass  # moved on meanwhile; if still forced without it, reconcile repeats the cancel
        self._record("lease.forced",
                     f"{lease['queue']}: lease {lease['_id']} forced: {action.reason}; cancelled "
                     f"{len(cancelled)} job(s); waiting up to "
                     f"{int(lease['drain']['force_until'] - lease['drain']['forced_at'])}s for "
                     "its VM agents to stop", queue=lease["queue"], device=lease["device"],
                     lease_id=lease["_id"], data={"cancelled": cancelled})
        return True

    def _do_restore(self, action) -> bool:
        lease = self._lease_at(action)
        if lease is None:
            return False
        state = lease["state"]
        if (action.data or {}).get("force_timeout"):
            return self._restore_after_force(lease, action)
        if state in L.BRINGUP_STATES:
            self.store.transition(lease["_id"], state, lease["generation"], L.RESTORING,
                                  action.reason, set_fields={"error": action.reason})
            self.store.record_failure(lease["_id"], action.reason)
            return True
        if state != L.DRAINING:
            return False
        self._fence_vms(lease, action.reason)
        for vm in lease.get("vms") or []:
            why = self.store.agent_busy(vm["agent_name"])
            if why is not None:
                log.info("restore of %s waits: %s %s", lease["_id"], vm["agent_name"], why)
                return False
        self.store.transition(lease["_id"], L.DRAINING, lease["generation"], L.RESTORING,
                              action.reason)
        return True

    def _restore_after_force(self, lease: dict, action) -> bool:
        """A forced drain whose VM agents are still busy at ``force_until``: restore anyway
        (re-checked here on the current document), and say which agents were still busy."""
        drain = lease.get("drain") or {}
        until = drain.get("force_until")
        if (lease["state"] != L.DRAINING or drain.get("forced_at") is None or until is None
                or self.clock() < until):
            return False
        self._fence_vms(lease, action.reason)
        busy = {vm["agent_name"]: why for vm in lease.get("vms") or []
                if (why := self.store.agent_busy(vm["agent_name"])) is not None}
        self.store.transition(lease["_id"], L.DRAINING, lease["generation"], L.RESTORING,
                              action.reason)
        self._record("lease.force_timeout",
                     f"{lease['queue']}: lease {lease['_id']} on {lease['device']}: restored "
                     f"with {len(busy)} VM agent(s) still busy after their jobs were cancelled: "
                     + ("; ".join(f"{n}: {w}" for n, w in sorted(busy.items())) or "none"),
                     queue=lease["queue"], device=lease["device"], lease_id=lease["_id"],
                     data={"busy": sorted(busy)})
        return True

    def _do_pause(self, action) -> bool:
        return self._admission(action, "paused")

    def _do_resume(self, action) -> bool:
        return self._admission(action, "open")

    def _admission(self, action, value: str) -> bool:
        lease = self._lease_at(action)
        if lease is None or lease.get("admission", "open") == value:
            return False
        self.store.progress(lease["_id"], lease["state"], lease["generation"],
                            set_fields={"admission": value})
        # The poll reads admission from the VM agents' gates only (gates.Gates.read).
        self.store.gates.sync([vm["agent_name"] for vm in lease.get("vms") or []])
        return True

    def _do_quarantine(self, action) -> bool:
        return self._quarantine(action.device, True, action.reason)

    def _fence_vms(self, lease: dict, reason: str) -> None:
        """Fence the lease's VM agents, stamped with the generation of ``lease`` (the document
        after the caller's CAS, where there is one; see LeaseStore.lift_vm_fences)."""
        self.store.fence_agents(lease["_id"], [vm["agent_name"] for vm in lease.get("vms") or []],
                                kind="vm", reason=reason, generation=lease["generation"])

    def _cancel_jobs(self, lease: dict) -> list[str]:
        """Cancel the non-terminal jobs of the lease's VM agents as POST /v1/job/<id>/action
        ``cancel`` does (``result_data.job_state = cancelled`` unless terminal; v1.cancel_job;
        on a newer Testflinger also ``$unset agents.job_id``). Jobs are found through the agent
        documents, the dispatch markers and ``result_data.agent_id``."""
        names = [vm["agent_name"] for vm in lease.get("vms") or []]
        job_ids = set()
        for doc in self.db.agents.find({"name": {"$in": names}}, {"job_id": 1}):
            if doc.get("job_id"):
                job_ids.add(doc["job_id"])
        for m in self.db.magic_dispatch.find({"agent": {"$in": names}, "phase": "done"}):
            if m.get("job_id"):
                job_ids.add(m["job_id"])
        job_ids.update(self.store.gates.held_by(names).values())
        cancelled = []
        for job_id in sorted(job_ids):
            res = self.db.jobs.update_one(
                {"job_id": job_id, "result_data.job_state": {"$nin": sorted(tfstates.JOB_TERMINAL)}},
                {"$set": {"result_data.job_state": tfstates.JOB_CANCELLED}})
            if res.modified_count:
                cancelled.append(job_id)
        # A newer Testflinger's cancel also unsets the agent's job_id (testflinger#1253,
        # clear_agent_job); its jobs carry result_data.agent_id, an older server's never do.
        newer = [j["job_id"] for j in self.db.jobs.find(
            {"job_id": {"$in": cancelled}, "result_data.agent_id": {"$exists": True}},
            {"job_id": 1})] if cancelled else []
        if newer:
            self.db.agents.update_many({"job_id": {"$in": newer}}, {"$unset": {"job_id": ""}})
        return cancelled

    def _definition(self, name):
        """The valid stored MagicQueue ``name``, or None (not stored, or invalid: logged by
        :meth:`stored` on the next tick)."""
        doc = self.db.magic_queues.find_one({"_id": name}) if name else None
        if not doc:
            return None
        try:
            return queues_mod.MagicQueue.from_document(doc)
        except Exception as exc:  # noqa: BLE001
            log.debug("magic_queues/%s is invalid: %s", name, invalid_reason(exc))
            return None

    # ------------------------------------------------------------------ agent-host protocol
    @property
    def bindings(self):
        """The :class:`.bindings.Bindings` of agent hosts to clients (made on first use)."""
        if getattr(self, "_bindings", None) is None:
            from .bindings import Bindings  # noqa: PLC0415 (it imports this module's errors)

            self._bindings = Bindings(self.db, self.events, self.clock, self._claimed)
        return self._bindings

    def register(self, host: str, devices: list[dict], version: str,
                 client_id: str | None = None) -> list[str]:
        """Register ``host`` and its ``devices`` (dicts: agent_name, maas_system_id, gpus, tags,
        home_queues) for the caller ``client_id`` (the token's client; None only for in-process
        callers, which are not bound). Raises :class:`Forbidden` (nothing written) if the host
        is bound to another client or a device belongs to another host; the first registration
        binds the host to ``client_id`` (bindings.Bindings). Returns the device names."""
        if client_id is not None:
            self.bindings.check(host, client_id, unbound_ok=True)
        names = [d["agent_name"] for d in devices]
        for doc in self.db.magic_devices.find({"_id": {"$in": names}}, {"agent_host": 1}):
            if doc.get("agent_host") != host:
                raise Forbidden(f"device {doc['_id']} is registered to agent host "
                                f"{doc.get('agent_host')}, not {host} (an admin frees it: "
                                f"testflinger-magic agent-hosts forget {doc.get('agent_host')})")
        if client_id is not None:
            self.bindings.pin(host, client_id)
        self._deregister_missing(host, names)
        now = self.clock()
        for d in devices:
            fields = {"agent_host": host, "maas_system_id": d["maas_system_id"],
                      "gpus": int(d["gpus"]), "tags": list(d.get("tags") or []),
                      "home_queues": list(d.get("home_queues") or []), "updated_at": now}
            res = self.db.magic_devices.update_one({"_id": d["agent_name"], "agent_host": host},
                                                   {"$set": fields})
            if res.matched_count:
                continue
            try:
                self.db.magic_devices.insert_one(dict(
                    fields, _id=d["agent_name"], registered_at=now, quarantined=False,
                    quarantine_reason=None, failures=0, last_lent_at=None))
            except DuplicateKeyErrors:
                raise Forbidden(f"device {d['agent_name']} was just registered by another "
                                "agent host") from None
        # Watched by the dispatch hook from now on, not from the next tick (gates.py).
        self.store.gates.ensure(names)
        self.db.magic_agent_hosts.update_one(
            {"_id": host},
            {"$set": {"devices": names, "last_heartbeat": now, "version": version},
             "$setOnInsert": {"registered_at": now}}, upsert=True)
        self.db.magic_agent_hosts.update_one({"_id": host, "registered_at": None},
                                             {"$set": {"registered_at": now}})  # pre-bound
        self.events.record("agent_host.registered", f"agent host {host} registered "
                           f"{len(names)} device(s): {', '.join(names)}", data={"host": host})
        return names

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
        removed = []
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
        if removed:
            self._record("device.deregistered", f"agent host {host} no longer lists "
                         f"{', '.join(removed)}: deregistered", data={"host": host,
                                                                     "devices": removed})
        return removed

    def _claimed(self, devices: list[str]) -> dict[str, str]:
        """``{device: "lease <id> (<state>)"}`` of the devices holding a claim."""
        out = {}
        for c in self.db.magic_device_claims.find({"_id": {"$in": devices}}):
            lease = self.db.magic_leases.find_one({"_id": c.get("lease_id")}, {"state": 1}) or {}
            out[c["_id"]] = f"lease {c.get('lease_id')} ({lease.get('state', 'unknown')})"
        return out

    def heartbeat(self, host: str, lease_ids: list[str], client_id: str | None = None) -> None:
        """Record the host's heartbeat (404 if it never registered; Forbidden if ``client_id``
        may not act for it, see :meth:`register`)."""
        if client_id is not None:
            self.bindings.check(host, client_id)
        res = self.db.magic_agent_hosts.update_one(
            {"_id": host}, {"$set": {"last_heartbeat": self.clock(), "working_on": lease_ids}})
        if not res.matched_count:
            raise NotFound(f"agent host {host} is not registered")

    def agent_hosts(self) -> list[dict]:
        """Agent host documents by name: ``{_id, client_id (bound client), devices, version,
        registered_at, last_heartbeat, working_on, ...}``."""
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
        if body.get("quarantine") and (body["result"], state) != ("error", L.RESTORING):
            raise Invalid("quarantine", "only an error report of a restore may quarantine")
        try:
            new = self._report(lease, body["result"], body.get("to_state"), message, intent,
                               vms, blame)
            if body.get("quarantine"):
                # Verified give-back failed: the device's agent must not get its queues back
                # until a person has looked (unquarantine also frees the failed lease).
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
            return self.store.progress(lid, state, gen, push_intent=intent, merge_vms=vms)
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
            if blame == "queue":
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
        """Stop lending for the lease's queue until its definition is applied again: set
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
            what = "lending suspended until the definition is applied again"
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

    def lend_by_hand(self, device: str, queue: str, reason: str) -> dict:
        """Claim ``device`` for ``queue`` now. NotFound / Invalid / Conflict (claim refused)."""
        q = self._definition(queue)
        if q is None:
            problem = self.problem(queue)
            raise NotFound(f"{queue}: {problem}" if problem else f"{queue} is not a magic queue")
        problem = self.problem(queue)
        if problem:
            raise Conflict(f"cannot lend to {queue}: {problem}")
        dev = self.db.magic_devices.find_one({"_id": device})
        if dev is None:
            raise NotFound(f"device {device} is not registered")
        if dev.get("quarantined"):
            raise Conflict(f"device {device} is quarantined: {dev.get('quarantine_reason')}")
        vms = q.vms_for(int(dev.get("gpus") or 0))
        if vms < 1:
            raise Invalid("device", f"{device} ({dev.get('gpus')} GPUs) cannot host a VM of {queue}")
        held = self.store.open_lease_for_device(device)
        if held is not None:  # say which lease, not what the fence did to the agent document
            raise Conflict(f"cannot lend {device}: already lent to {held['queue']} "
                           f"(lease {held['_id']}, {held['state']})")
        try:
            lease = self.store.claim(device, q, dev["agent_host"], vms, reason)
        except L.ClaimRefused as exc:
            raise Conflict(f"cannot lend {device}: {exc.reason}") from None
        if self.metrics:
            self.metrics.lends.labels(queue=queue).inc()
        return lease

    def drain_by_hand(self, lease_id: str, reason: str, grace: str, force: bool) -> dict:
        """Operator drain: active -> draining with ``grace`` (duration text); ``force`` marks it
        forced (no undrain; cancelled at grace end). A draining lease gets the new drain doc."""
        try:
            seconds = parse_duration(grace)
        except ValueError as exc:
            raise Invalid("grace", str(exc)) from None
        lease = self.lease(lease_id)
        if lease["state"] not in (L.ACTIVE, L.DRAINING):
            raise Conflict(f"lease {lease_id} is {lease['state']}; only active or draining "
                           "leases can be drained", lease)
        drain = self._drain_doc(lease, reason, seconds, force)
        old = lease.get("drain") or {}
        if old.get("forced_at") is not None:  # a committed force stays committed
            drain.update(forced=True, **{k: old.get(k) for k in ("forced_at", "force_until",
                                                                 "cancelled")})
        try:
            if lease["state"] == L.ACTIVE:
                new = self.store.transition(lease_id, L.ACTIVE, lease["generation"], L.DRAINING,
                                            reason, set_fields={"drain": drain})
            else:
                new = self.store.progress(lease_id, L.DRAINING, lease["generation"],
                                          set_fields={"drain": drain,
                                                      "deadline": drain["grace_until"]})
        except L.StaleGeneration as exc:
            raise Conflict(str(exc), exc.lease) from None
        self._fence_vms(new, reason)
        if self.metrics:
            self.metrics.drains.labels(queue=new["queue"]).inc()
        return new

    def set_quarantine(self, device: str, on: bool, reason: str) -> dict:
        """Quarantine or release a device; returns the device document (NotFound).

        Unquarantine is also how an operator says "I looked at it": if the device's latest
        lease is ``failed`` (it keeps the claim and the device fence, so the device could never
        be lent or serve its home queues again), its claim and fences are released and the
        device agent's ``agents`` document given back (LeaseStore.release_failed).

        Quarantining a device that is already quarantined records the new reason (an event
        says what it replaced). The answer adds ``previous_reason``: the reason the device was
        quarantined for before this call, or None if it was not quarantined."""
        before = self.db.magic_devices.find_one({"_id": device})
        if before is None:
            raise NotFound(f"device {device} is not registered")
        previous = before.get("quarantine_reason") if before.get("quarantined") else None
        if on and before.get("quarantined"):
            res = self.db.magic_devices.update_one(
                {"_id": device, "quarantined": True, "quarantine_reason": previous},
                {"$set": {"quarantine_reason": reason}})
            if res.modified_count and previous != reason:
                self.events.record("device.quarantined", f"{device}: still quarantined, reason "
                                   f"now: {reason} (was: {previous})", device=device)
        else:
            self._quarantine(device, on, reason)
        if not on:
            latest = list(self.db.magic_leases.find({"device": device}, {"state": 1},
                                                    sort=[("created_at", -1)], limit=1))
            if latest and latest[0]["state"] == L.FAILED:
                try:
                    self.store.release_failed(device)
                except L.LeaseError as exc:
                    raise Conflict(str(exc)) from None
        return dict(self.db.magic_devices.find_one({"_id": device}), previous_reason=previous)

    def _quarantine(self, device: str, on: bool, reason: str, queue: str | None = None) -> bool:
        """Set the device's quarantine (CAS on the flag); the event names ``queue`` when given,
        so that queue's webhooks hear of it. True if this call changed it."""
        sets = {"quarantined": on, "quarantine_reason": reason if on else None}
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
        not quarantined, not held by a lease), devices_eligible, missing_vm_agents (names; see
        :meth:`report_missing`), suspended (reason or None), blocked (None, or ``{why, reason}``:
        why its waiting jobs get no device, the ``blocked`` action ``plan`` explains:
        ``why`` one of suspended, no_device, max_devices, max_starting), quarantined
        ([{device, reason}] of its eligible devices)}], "invalid_queues": [{name, reason}]
        (stored documents that do not validate), "leases": [open lease documents, each with
        ``running_jobs``: [{agent, job_id}] of its VM agents; a draining lease's grace deadline
        is ``drain.grace_until``], "devices": [...], "overdue_leases": [...],
        "stale_agent_hosts": [...]}`` (the last two: :meth:`alerts`).

        One read path with ``plan``: the reasons come from the same read-only gather and
        ``reconcile.plan(explain=True)``; the rest adds a fixed number of queries (open leases,
        devices and claims, agent hosts), however many leases or devices there are."""
        from testflinger_magic import reconcile as R  # noqa: PLC0415

        inputs = self.gather(read_only=True)
        blocked = {a.queue: a for a in R.plan(inputs, explain=True) if a.kind in R.NON_ACTING}
        defs, suspended, demand = inputs.definitions, inputs.suspended, inputs.demand
        running: dict[str, list[dict]] = {}
        for vm in inputs.vm_agents:
            if vm.job_id:
                running.setdefault(vm.lease_id, []).append({"agent": vm.name, "job_id": vm.job_id})
        open_leases = [dict(x, running_jobs=running.get(x["_id"], []))
                       for x in self.store.list(open_only=True)]
        devices = self.devices()
        queues = []
        for q in defs:
            mine = [x for x in open_leases if x["queue"] == q.name]
            eligible = [d for d in devices if q.matches(d)]
            why = blocked.get(q.name)
            queues.append({
                "name": q.name,
                "waiting": demand[q.name].waiting,
                "vm_agents": sum(len(x.get("vms") or []) for x in mine if x["state"] == L.ACTIVE),
                "leases": len(mine),
                # Lendable now, not merely eligible: a device held by a lease (open or failed,
                # both keep the claim) or quarantined cannot be lent.
                "devices_lendable": sum(1 for d in eligible
                                        if not d.get("quarantined") and not d.get("lease_id")),
                "devices_eligible": len(eligible),
                "missing_vm_agents": sorted(n for x in mine
                                            for n in x.get("missing_vm_agents") or []),
                "suspended": suspended.get(q.name),
                "blocked": {"why": why.data.get("why"), "reason": why.reason} if why else None,
                "quarantined": [{"device": d["_id"], "reason": d.get("quarantine_reason")}
                                for d in eligible if d.get("quarantined")],
            })
        valid = {q.name for q in defs}
        invalid = [{"name": d["_id"], "reason": d.get("invalid") or "invalid"}
                   for d in self.db.magic_queues.find({}, {"invalid": 1}, sort=[("_id", 1)])
                   if d["_id"] not in valid]
        return {"queues": queues, "invalid_queues": invalid, "leases": open_leases,
                "devices": devices, **self.alerts()}
