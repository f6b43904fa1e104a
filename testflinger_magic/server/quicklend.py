"""Lend at once for a job just submitted to a magic queue (submit -> lease claimed in one plan,
not one full tick).

The POST /v1/job hook (dispatch.py) tells the plugin which magic queue got a job
(``MagicPlugin.kick(queue)``). Waiting for the next tick's full gather (every collection of a
1,000-device lab) before lending made submit -> claimed about one tick long, plus the tick in
flight. :meth:`QuickLend.lend_now` instead runs ``reconcile.plan`` (the same, whole plan: the
policy is decided there and nowhere else) on the snapshot the last tick gathered
(:meth:`QuickLend.remember`), with what a submission can have changed read again:

* every open lease (one read, index ``(state, created_at)``): lends, drains and returns since
  the snapshot, here or on another replica, so ``max_devices``/``max_starting`` and the devices
  held are as a tick would see them;
* the VM agents of the submitted queues' leases, whose idleness is the queue's supply (their
  ``agents`` documents and dispatch markers: two ``$in`` reads; gates.Gates.busy);
* the demand of the submitted queues, with those agents' held jobs and the jobs their markers
  name, in one ``jobs`` read (:class:`.jobreads.JobReads`; the latest job of the queue as the
  ticks keep it),

A device whose lease closed since the snapshot counts as not back yet (its agent's startup
post may still be to come: ``Snapshot._returning``), so only a tick lends it again. It then
applies only the ``lend`` actions of those queues (every other action waits for the tick,
which plans again on a full gather). Everything else (other queues' demand and VM agents, the
device agents' states, quarantine) is at most ``max_age`` seconds old, as on a tick on another
replica: a device that became busy meanwhile is refused by the claim's own checks
(LeaseStore.claim: compare-and-set on the device's claim and on its agent document, then the
busy checks), and the next tick tries again.

While a quick lend runs, this replica's tick waits before each of its reads and actions
(:meth:`QuickLend.yield_to_quick_lend`, at most :data:`YIELD_LIMIT` seconds each), so a
submission shares the process and the database with one read of the tick at most.

One replica's quick lends and its tick's lends exclude each other (``_lend_lock``): a quick lend
reads the open leases, plans and claims under it, and a tick skips a ``lend`` for a queue that
got a quick lend after the tick began to gather (its plan did not count that lease); the next
tick plans again. Across replicas two plans may still pick the same device: the claim lets one
win (``magic_device_claims`` is keyed by device), the other is refused.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from testflinger_magic import leases as L
from testflinger_magic.gates import marker_job_ids

log = logging.getLogger(__name__)

#: Lease fields a quick lend does not read (``history``: the snapshot has ``active_since``).
#: Seconds a tick waits at most, at each of its steps, for a quick lend in flight.
YIELD_LIMIT = 2.0
LEASE_VIEW_UNUSED = {"history": 0, "intent": 0, "spec": 0, "timeouts": 0,
                     "device_agent_before": 0, "error": 0}


class QuickLend:
    """Mixed into :class:`.engine.Engine` (uses ``self.db``, ``self.store``, ``self.clock``,
    ``self.job_reads``, ``self.apply``, ``self._lease_view``, ``self._track_idle``)."""

    def _quick_init(self) -> None:
        self._lend_lock = threading.RLock()
        self._snapshot: tuple | None = None  # (reconcile.Inputs, time.monotonic() at gather)
        self._quick_lent: dict[str, float] = {}  # queue -> time.monotonic() of a quick lend
        self._quick_idle = threading.Event()  # clear while a quick lend runs
        self._quick_idle.set()

    def yield_to_quick_lend(self) -> None:
        """Called by the tick before each of its reads and actions: wait (at most
        :data:`YIELD_LIMIT` seconds) while a quick lend runs, so the two do not share this
        process and the database for the quick lend's duration (a submission waits for the
        tick's read in flight at most)."""
        self._quick_idle.wait(YIELD_LIMIT)

    def remember(self, inputs) -> None:
        """Keep ``inputs`` (a tick's gather) for :meth:`lend_now`."""
        self._snapshot = (inputs, time.monotonic())

    def lent_quickly_since(self, queue: str, since: float) -> bool:
        """True if :meth:`lend_now` lent for ``queue`` at or after ``since`` (time.monotonic())."""
        return self._quick_lent.get(queue, float("-inf")) >= since

    def lend_now(self, queues, max_age: float) -> list | None:
        """Plan on the last tick's snapshot refreshed as the module docstring says, and apply
        the ``lend`` actions of ``queues`` (magic queue names). Returns the lends applied (CAS
        won), or None when there is no snapshot younger than ``max_age`` seconds (the caller's
        tick does it then)."""
        from testflinger_magic import reconcile as R  # noqa: PLC0415

        snap = self._snapshot
        if snap is None or time.monotonic() - snap[1] > max_age:
            return None
        cached = snap[0]
        queues = sorted(set(queues) & {q.name for q in cached.definitions})
        if not queues:
            return []
        with self._lend_lock:
            self._quick_idle.clear()
            try:
                return self._lend(R, cached, queues)
            finally:
                self._quick_idle.set()

    def _lend(self, R, cached, queues: list[str]) -> list:
        """Refresh, plan, apply the lends of ``queues`` (under ``_lend_lock``)."""
        inputs = self._refreshed(R, cached, queues)
        applied = []
        for action in R.plan(inputs):
            if action.kind != "lend" or action.queue not in queues:
                continue
            try:
                if self.apply(action):
                    applied.append(action)
                    self._quick_lent[action.queue] = time.monotonic()
            except L.ClaimRefused as exc:
                log.info("quick lend of %s to %s refused: %s", action.device, action.queue,
                         exc.reason)
            except Exception:  # noqa: BLE001 - the tick plans again
                log.exception("quick lend %s failed", action)
        return applied

    def _with_active_since(self, cached, leases: list[dict]) -> None:
        """Give each of ``leases`` (read without ``history``) the ``history`` entry
        ``_lease_view`` takes ``active_since`` from: the snapshot's, or, for a lease that became
        active since the snapshot, its history (one read of those leases only, usually none)."""
        known = {v.id: v.active_since for v in cached.leases}
        need = [lease["_id"] for lease in leases
                if known.get(lease["_id"]) is None and lease["state"] in (L.ACTIVE, L.DRAINING)]
        history = {}
        if need:
            history = {d["_id"]: d.get("history") or [] for d in self.db.magic_leases.find(
                {"_id": {"$in": need}}, {"history": 1})}
        for lease in leases:
            if lease["_id"] in history:
                lease["history"] = history[lease["_id"]]
            elif known.get(lease["_id"]) is not None:
                lease["history"] = [{"state": L.ACTIVE, "at": known[lease["_id"]]}]
            else:
                lease["history"] = []

    def _refreshed(self, R, cached, queues: list[str]):
        """``cached`` (reconcile.Inputs) with the open leases, the VM agents of ``queues``'
        leases and the demand of ``queues`` read again, at ``clock()``: four reads (open
        leases, without their history; those VM agents' ``agents`` documents; their dispatch
        markers; then one ``jobs`` read for the queues' waiting jobs, the held jobs and the
        markers' jobs, :class:`.jobreads.JobReads`)."""
        now = self.clock()
        leases = list(self.db.magic_leases.find({"state": {"$in": sorted(L.OPEN_STATES)}},
                                                LEASE_VIEW_UNUSED, sort=[("created_at", 1)]))
        self._with_active_since(cached, leases)
        ids = {lease["_id"] for lease in leases}
        mine = {lease["_id"] for lease in leases if lease["queue"] in queues
                and lease["state"] in (L.ACTIVE, L.DRAINING)}
        names = [vm["agent_name"] for lease in leases if lease["_id"] in mine
                 for vm in lease.get("vms") or []]
        agents = {}
        if names:
            agents = {d["name"]: d for d in self.db.agents.find(
                {"name": {"$in": sorted(names)}}, {"name": 1, "state": 1, "job_id": 1})}
        reporting = [n for n in names if n in agents]
        markers = self.store.gates.markers(reporting)
        facts = self.job_reads.read(now, [], queues, reporting, marker_job_ids(markers))
        latest = self.job_reads.latest.values()
        demand = dict(cached.demand)
        for queue in queues:
            fresh = facts.demand.get(queue, R.QueueDemand())
            last = [v for v in (fresh.last_job_at, latest.get(queue),
                                cached.demand.get(queue, R.QueueDemand()).last_job_at)
                    if v is not None]
            demand[queue] = dataclasses.replace(fresh, last_job_at=max(last) if last else None)
        busy = self.store.gates.busy(reporting, include_pending=False, prune=False,
                                     agent_docs=agents, held=facts.held, markers=markers,
                                     job_states=facts.states) if reporting else {}
        # Other queues' VM agents as the tick saw them, for the leases still open.
        vm_views = [v for v in cached.vm_agents if v.queue not in queues and v.lease_id in ids]
        lease_views = [v for v in cached.leases if v.state == L.FAILED]
        for lease in leases:
            views = []
            if lease["_id"] in mine:
                for vm in lease.get("vms") or []:
                    a = agents.get(vm["agent_name"])
                    if a is None:
                        continue  # not reporting yet: "coming"
                    views.append(R.VMAgentView(
                        name=vm["agent_name"], lease_id=lease["_id"], queue=lease["queue"],
                        state=a.get("state"),
                        job_id=a.get("job_id") or facts.held.get(vm["agent_name"]),
                        busy=vm["agent_name"] in busy))
                lease = self._track_idle(lease, views, now, read_only=True)
            lease_views.append(self._lease_view(R, lease))
            vm_views.extend(views)
        # A device whose lease closed since the snapshot: its agent's startup post may still be
        # to come (Snapshot._returning), which the snapshot cannot tell; not lent until a tick
        # has looked (reconcile.DeviceView.agent_back).
        held = {v.device for v in lease_views}
        gone = {v.device for v in cached.leases} - held
        devices = [dataclasses.replace(d, agent_back=False) if d.name in gone else d
                   for d in cached.devices]
        return dataclasses.replace(cached, demand=demand, leases=lease_views, vm_agents=vm_views,
                                   devices=devices, now=now)
