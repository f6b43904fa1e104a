"""Read the reconcile inputs from MongoDB: the stored magic queues, demand, devices, leases and
VM agents, as one ``reconcile.Inputs`` snapshot (:meth:`Snapshot.gather`).

A bounded number of queries whatever the number of devices, leases and agents: each collection
is read once with an ``$in`` or ``$or`` read keyed by indexes of the table in
:mod:`testflinger_magic.indexes`, most through the tick's
:class:`~testflinger_magic.tickreads.TickReads` (shared with the repairs) and Testflinger's
``jobs`` in one read (:mod:`.jobreads`): 12 calls per steady tick with the repairs (a count
of the gates among them; benchmarks/reconcile_scale.py counts them). The only writes are ``idle_since`` (a CAS per lease whose idleness changed), the
``invalid`` mark of a stored queue that does not validate, and pruning dispatch markers of
finished jobs; ``gather(read_only=True)`` writes none of them.

:class:`Snapshot` is a mixin of :class:`.engine.Engine`: it uses ``self.db``, ``self.store``
(LeaseStore), ``self.events``, ``self.clock``, ``self.vm_agent_grace`` and ``self.giveback``.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone

from testflinger_magic import leases as L
from testflinger_magic import queues as queues_mod
from testflinger_magic.gates import NOT_IDLE_STATES, marker_job_ids
from testflinger_magic.stalejob import ORPHAN_STATES
from testflinger_magic.tickreads import TickReads

from . import excludes
from .errors import invalid_reason
from .maasbackoff import held_back

log = logging.getLogger(__name__)

#: An absent agents document, looked up as an empty one (never written to).
_NO_DOC: dict = {}


#: The epoch as a naive UTC datetime (naive timestamps are UTC: pymongo returns them so).
_EPOCH_NAIVE = datetime(1970, 1, 1)


def epoch(value) -> float | None:
    """Epoch seconds of a Testflinger timestamp (a datetime, naive = UTC, as pymongo returns
    them) or of a number; None stays None.

    A naive datetime is subtracted from the naive epoch: the same float as
    ``value.replace(tzinfo=timezone.utc).timestamp()`` (CPython computes an aware datetime's
    ``timestamp()`` as ``(value - epoch).total_seconds()``) at a sixth of its cost; a tick
    converts a few thousand of them (every job it reads, every agent document)."""
    if value is None:
        return None
    if isinstance(value, datetime):
        if value.tzinfo is None:
            return (value - _EPOCH_NAIVE).total_seconds()
        return value.timestamp()
    return float(value)


class Snapshot:
    """Reads (see the module docstring); mixed into :class:`.engine.Engine`."""

    def definitions(self) -> list:
        """Applied MagicQueue definitions, by name. An invalid stored document is skipped (see
        :meth:`stored`): one bad queue must not stop the others."""
        return self.stored()[0]

    def stored(self) -> tuple[list, dict[str, str], dict[str, float]]:
        """``(definitions, suspended, unservable)``: the valid stored MagicQueues by name,
        ``{name: reason}`` of those whose lending is suspended (``magic_queues.suspended``), and
        ``{name: epoch seconds}`` of those marked unservable since then
        (``magic_queues.unservable.since``, :mod:`.unservablejobs`).

        A document that does not validate (written by an older version, by hand, or half
        written) is skipped; the first time a given problem is seen it is marked on the document
        (``invalid``: the reason, compare-and-set so replicas agree) and reported by an event
        ``queue.invalid`` and an error log line naming it. Applying the queue again clears it.
        """
        defs, suspended, unservable = [], {}, {}
        for doc in self.db.magic_queues.find({}, sort=[("_id", 1)]):
            try:
                q = queues_mod.MagicQueue.from_document(doc)
            except Exception as exc:  # noqa: BLE001 - pydantic.ValidationError, TypeError...
                self._invalid_definition(doc, exc)
                continue
            defs.append(q)
            if doc.get("suspended"):
                suspended[q.name] = str((doc["suspended"] or {}).get("reason") or "suspended")
            since = (doc.get("unservable") or {}).get("since")
            if isinstance(since, (int, float)):
                unservable[q.name] = float(since)
        return defs, suspended, unservable

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

    def problem(self, name: str, operator: bool = True) -> str | None:
        """Why the stored queue ``name`` lends nothing now (its document is invalid, or lending
        is suspended), or None (also for a queue that is not stored). ``operator``: the words
        end with the operator's step (apply the definition again); False: for a test engineer
        (the preflight testflinger-cli prints at submit), who cannot apply one: they are told
        the lab's operators must act, and where those see why."""
        doc = self.db.magic_queues.find_one({"_id": name}) if isinstance(name, str) else None
        if doc is None:
            return None
        try:
            queues_mod.MagicQueue.from_document(doc)
        except Exception as exc:  # noqa: BLE001
            if not operator:
                return (f"its stored definition is invalid ({invalid_reason(exc)}); no machine "
                        f"is lent to it until the lab's operators fix it")
            return f"its stored definition is invalid ({invalid_reason(exc)}); apply it again"
        if doc.get("suspended"):
            from testflinger_magic import reconcile as R  # noqa: PLC0415

            reason = (doc["suspended"] or {}).get("reason") or "suspended"
            if not operator:
                reason = R.without_reapply_advice(reason)
                return (f"lending is suspended because of the queue's definition ({reason}); no "
                        "machine is lent to it until the lab's operators fix it "
                        "(testflinger-magic status tells them why)")
            return f"lending is suspended: {R.with_reapply_advice(reason)} (testflinger-magic apply)"
        return None

    def gather(self, read_only: bool = False, reads: TickReads | None = None):
        """Build ``reconcile.Inputs`` from MongoDB (definitions, devices, demand, open leases,
        ``failed`` leases that still hold their device's claim, VM agents) at ``clock()``.

        Failed leases are included because they keep the device fenced until an operator
        unquarantines it: without them reconcile would plan a ``lend`` of that device every tick,
        refused every tick (an event and a webhook each time, and with ``max_starting`` 1 no
        healthy device would ever be lent).

        ``read_only``: write nothing (GET /v1/magic/plan is a dry run): ``idle_since`` is worked
        out in memory instead of stored, and done dispatch markers are not pruned. Otherwise
        ``idle_since`` is kept up to date (CAS) and stale markers pruned. ``reads``: the tick's
        :class:`~testflinger_magic.tickreads.TickReads` (shared with its repairs), else a
        fresh one.

        Reads (each once): ``magic_queues``; from ``reads``: the claims, the open leases and
        the failed ones holding a claim, the registered devices, the ``agents`` documents of
        devices and VM agents, the returned leases not judged yet, the agent hosts (their
        heartbeats: ``Inputs.stale_hosts``, as the watch reports them); the dispatch markers of the
        reporting VM agents not in a job phase (one in a phase is busy: nothing more is read
        about it); then one ``jobs`` read (:mod:`.jobreads`: demand, held jobs, the
        markers' jobs, the magic queues' latest jobs).
        """
        from testflinger_magic import reconcile as R  # noqa: PLC0415

        now = self.clock()
        reads = reads or TickReads(self.db)
        defs, suspended, unservable = self.stored()                # magic_queues: 1 read
        leases = reads.open_leases()                               # magic_leases(state)
        held_leases = [c["lease_id"] for c in reads.claims() if c.get("lease_id")]
        failed = sorted((lease for lease in reads.leases_by_id(held_leases).values()
                         if lease["state"] == L.FAILED),
                        key=lambda lease: (lease.get("created_at") or 0, lease["_id"]))
        registered = reads.devices()
        names = [d["_id"] for d in registered]
        names += [vm["agent_name"] for lease in leases for vm in lease.get("vms") or []]
        agents = reads.agents(names)                               # agents(name)
        # VM agents exist only once the lease is active; one not reporting yet (no agents
        # document) is "coming" to reconcile. Working, not merely polling: a poll in flight is
        # no job (include_pending=False). One batch for all of them (Gates.busy): the markers,
        # then (after them) the jobs, with the demand and the held jobs.
        reporting = [vm["agent_name"] for lease in leases if lease["state"] in (L.ACTIVE, L.DRAINING)
                     for vm in lease.get("vms") or [] if vm["agent_name"] in agents]
        # An agent whose document says it is in a job phase (or restarting) is busy whatever
        # its markers and jobs say (Gates.busy's last check; its other checks can only add a
        # reason: a stale or orphaned job needs a quiet *waiting* document): nothing more is
        # read about it. In a steady lab that is most VM agents, whose markers and jobs were
        # half of what a tick read (benchmarks/reconcile_scale.py).
        in_phase = {name: agents[name]["state"] for name in reporting
                    if agents[name].get("state") in NOT_IDLE_STATES}
        if in_phase:
            reporting = [name for name in reporting if name not in in_phase]
        reads.before_read()
        markers = self.store.gates.markers(reporting)              # magic_dispatch(agent)
        magic = [q.name for q in defs]
        homes = set().union(*[d.get("home_queues") or () for d in registered])
        # A newer Testflinger attributes a popped job to its agent itself (testflinger#1253),
        # and a newer agent no longer posts job_id: an absent or empty job_id is not idle.
        reads.before_read()
        # The VM agent names lending can give each magic queue: a waiting job excluding all
        # of them is no demand (server/excludes.py; no read).
        possible = excludes.PossibleVMs(
            defs, registered, ((lease["queue"], lease["device"],
                                [vm["agent_name"] for vm in lease.get("vms") or []])
                               for lease in leases))
        # Held jobs only of agents not in a phase: those in one are busy already (a device's
        # busy_at_home is its state first; a VM agent's job_id, its document's).
        facts = self.job_reads.read(now, magic, homes,             # jobs: 1 $or read
                                    [n for n in names
                                     if agents.get(n, _NO_DOC).get("state") not in NOT_IDLE_STATES],
                                    marker_job_ids(markers), possible)
        demand, held = facts.demand, facts.held
        returning = self._returning(now, agents, reads)
        # One pass per collection, names looked up in dicts built once (a tick builds 1,000s
        # of views: see benchmarks/reconcile_scale.py's own-Python figure).
        DeviceView, VMAgentView, view = R.DeviceView, R.VMAgentView, R.view
        agent_of, held_by = agents.get, held.get
        devices = []
        for d in registered:
            name = d["_id"]
            a = agent_of(name, _NO_DOC)
            devices.append(view(DeviceView, {
                "name": name, "agent_host": d.get("agent_host"), "gpus": int(d.get("gpus") or 0),
                "tags": list(d.get("tags") or []),
                "home_queues": list(d.get("home_queues") or []),
                "agent_state": a.get("state"), "job_id": a.get("job_id") or held_by(name),
                "quarantined": bool(d.get("quarantined")),
                "failures": int(d.get("failures") or 0),
                "last_home_use": epoch(a.get("updated_at")), "registered": True,
                "agent_back": name not in returning,
                "nvswitches": int(d.get("nvswitches") or 0),
                "nvswitches_found": d.get("nvswitches_found"),
                "nvswitch_multi_gpu": bool(d.get("nvswitch_multi_gpu")),
                "held_back": held_back(d, now) if "maas_refusals" in d else None}))
        stale: dict = {}  # {VM agent: (job_id, job_state)} of those that restarted mid-job
        orphaned: list = []  # jobs in a phase of quiet waiting VM agents (markers, held jobs)
        busy = self.store.gates.busy(reporting, include_pending=False, prune=not read_only,
                                     agent_docs=agents, held=held, markers=markers,
                                     job_states=facts.states, stale_out=stale,
                                     orphans_out=orphaned) if reporting else {}
        for name, state in in_phase.items():
            busy[name] = f"agent is in state {state}"
        orphans, vm_lease = [], {}
        orphaned_agents = {o["agent"] for o in orphaned}
        lease_view = self._lease_view
        lease_views = [lease_view(R, lease) for lease in failed]
        vm_views = []
        for lease in leases:
            state = lease["state"]
            if state != L.ACTIVE and state != L.DRAINING:
                lease_views.append(lease_view(R, lease))
                continue
            any_busy, lease_id, queue = False, lease["_id"], lease["queue"]
            views = []
            for vm in lease.get("vms") or []:
                name = vm["agent_name"]
                a = agent_of(name)
                if a is None:
                    continue  # not reporting yet: reconcile counts it as "coming"
                is_busy = name in busy
                any_busy = any_busy or is_busy
                job_id = a.get("job_id") or held_by(name)
                vm_lease[name] = (lease_id, queue)
                if not is_busy and name in orphaned_agents:  # its job in a phase: nobody runs it
                    job_id = None
                if name in stale:  # it restarted: no job of its runs (stalejob)
                    job_id = None
                    gone, job_state = stale[name]
                    if job_state in ORPHAN_STATES:
                        orphans.append({"agent": name, "job_id": gone, "job_state": job_state,
                                        "lease_id": lease_id, "queue": queue})
                views.append(view(VMAgentView, {
                    "name": name, "lease_id": lease_id, "queue": queue,
                    "state": a.get("state"), "job_id": job_id, "busy": is_busy}))
            if state == L.ACTIVE and any_busy != (lease.get("idle_since") is None):
                lease = self._track_idle(lease, views, now, read_only)  # its idleness changed
            lease_views.append(lease_view(R, lease))
            vm_views.extend(views)
        seen = {o["job_id"] for o in orphans}
        for o in orphaned:  # restarted mid-job, then idle (perhaps after another job)
            if o["job_id"] not in seen and o["agent"] in vm_lease:
                seen.add(o["job_id"])
                lease_id, queue = vm_lease[o["agent"]]
                orphans.append({**o, "lease_id": lease_id, "queue": queue})
        hosts = reads.agent_hosts()
        heartbeats = {h["_id"]: h.get("last_heartbeat") for h in hosts}
        stale_hosts = {h: (None if heartbeats[h] is None else now - heartbeats[h])
                       for h in R.stale_hosts(heartbeats, now)}    # magic_agent_hosts: 1 read
        maas_down = R.maas_down_hosts({h["_id"]: h.get("maas_unreachable_since") for h in hosts},
                                      stale_hosts, now)
        return R.Inputs(definitions=defs, devices=devices, demand=demand, leases=lease_views,
                        vm_agents=vm_views, now=now, suspended=suspended,
                        vm_agent_grace=self.vm_agent_grace,
                        arrivals=self._arrivals(now, defs),             # jobs: 1 read, if learning
                        stale_hosts=stale_hosts, maas_down_hosts=maas_down, orphans=orphans,
                        quiet_hosts=R.quiet_hosts(heartbeats, now), unservable=unservable)

    def _arrivals(self, now: float, defs: list) -> dict[str, list[float]]:
        """``{magic queue: [created_at epoch seconds]}`` of the jobs submitted to the queues with
        ``policy.warm_learn`` within their ``lookback`` (reconcile.Inputs.arrivals): one read,
        served by the index jobs(job_data.job_queue, created_at) (indexes.py), and none when
        no queue learns. Testflinger keeps jobs 7 days (its ``jobs`` TTL), so a longer
        lookback sees at most that."""
        learners = {q.name: q.policy.warm_learn.lookback for q in defs
                    if q.policy.warm_learn is not None}
        if not learners:
            return {}
        since = datetime.fromtimestamp(now - max(learners.values()), timezone.utc)
        out: dict[str, list[float]] = {name: [] for name in learners}
        for job in self.db.jobs.find(
                {"job_data.job_queue": {"$in": sorted(learners)}, "created_at": {"$gte": since}},
                {"job_data.job_queue": 1, "created_at": 1}):
            name = (job.get("job_data") or {}).get("job_queue")
            at = epoch(job.get("created_at"))
            if name in out and at is not None and at >= now - learners[name]:
                out[name].append(at)
        return {name: sorted(times) for name, times in out.items()}

    def _returning(self, now: float, agents: dict[str, dict],
                   reads: TickReads | None = None) -> set[str]:
        """Devices given back by a lease whose device agent has not posted since the lease
        entered ``restoring`` (:func:`.giveback.verdicts`, the facts of the verified give-back,
        on the returned leases not judged yet: one indexed read, the give-back check's). The
        restore starts the agent and reports ``returned`` before the agent's startup post
        (``waiting``, TESTFLINGER.md §3.2) has necessarily landed; lent again before it, the
        device would have that post undo the claim's ``offline``. Overdue ones are not back
        either (the give-back check quarantines them)."""
        from .giveback import verdicts  # noqa: PLC0415

        reads = reads or TickReads(self.db)
        leases = reads.recently_returned(self.giveback.horizon(now))
        if not leases:
            return set()
        verified, _ = verdicts(leases, reads.agents({lease["device"] for lease in leases}),
                               now, self.giveback.bound)
        back = {lease["_id"] for lease in verified}
        return {lease["device"] for lease in leases if lease["_id"] not in back}

    @staticmethod
    def _lease_view(R, lease: dict):
        vms = lease.get("vms") or []
        active_since = L.first_active(lease)
        return R.view(R.LeaseView, {
            "id": lease["_id"], "device": lease["device"], "queue": lease["queue"],
            "state": lease["state"], "generation": lease["generation"],
            "created_at": lease.get("created_at"), "updated_at": lease.get("updated_at"),
            "deadline": lease.get("deadline"), "vms": len(vms), "drain": lease.get("drain"),
            "admission": lease.get("admission", "open"), "idle_since": lease.get("idle_since"),
            "active_since": active_since, "vm_names": [vm["agent_name"] for vm in vms],
            "by_hand": bool(lease.get("by_hand"))})

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
