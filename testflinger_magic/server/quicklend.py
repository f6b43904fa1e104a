"""Lend at once for a job just submitted to a magic queue (submit -> lease claimed in one plan,
not one full tick).

The POST /v1/job hook (dispatch.py) tells the plugin which magic queue got a job
(``MagicPlugin.kick(queue)``). Waiting for the next tick's full gather (every collection of a
1,000-device lab) before lending made submit -> claimed about one tick long, plus the tick in
flight. :meth:`QuickLend.lend_now` instead runs ``reconcile.plan`` (the same, whole plan: the
policy is decided there and nowhere else) on the snapshot the last tick gathered
(:meth:`QuickLend.remember`), with what a submission can have changed read again:

* the leases written since the snapshot's reads began (less :data:`LEASE_SLACK`; one read,
  index ``(state, updated_at)``, of the fields reconcile uses): lends, drains and returns since
  the snapshot, here or on another replica, so ``max_devices``/``max_starting`` and the devices
  held are as a tick would see them (every such change sets ``updated_at``; the other leases
  are the snapshot's);
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
got a quick lend after the tick's first read (its plan did not count that lease); the next
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
from testflinger_magic.tickreads import with_vms

from . import excludes

log = logging.getLogger(__name__)

#: Seconds a tick waits at most, at each of its steps, for a quick lend in flight.
YIELD_LIMIT = 2.0
#: Seconds a lease write's ``updated_at`` (its writer's clock: this replica or another) may
#: lag the clock reading taken before the snapshot's reads; a quick lend reads again every
#: lease written since that reading less this.
LEASE_SLACK = 60.0
#: The lease fields a quick lend reads: what ``Snapshot._lease_view`` and ``_track_idle`` use
#: (the VM agent names and when it became active as the flat ``vm_names`` and
#: ``active_since``: tickreads.with_vms). An inclusion projection: the documents carry the
#: daemon's ``intent`` log, the ``history`` and the VM details, which the stand-in (mongomock)
#: would deep-copy (~3x the time of the read with only these) and a real MongoDB would send.
LEASE_VIEW_FIELDS = {"device": 1, "queue": 1, "state": 1, "generation": 1, "created_at": 1,
                     "updated_at": 1, "deadline": 1, "vm_names": 1, "active_since": 1,
                     "drain": 1, "admission": 1, "idle_since": 1, "by_hand": 1}


def _idleness(lease, agents: list, now: float):
    """``lease`` (reconcile.LeaseView) with ``idle_since`` as the tick keeps it
    (``Snapshot._track_idle``, read-only): None while one of its VM agents (``agents``) is
    busy, ``now`` when an active lease whose agents are all idle had none."""
    if lease.state != L.ACTIVE:
        return lease
    busy = any(a.busy for a in agents)
    if busy == (lease.idle_since is None):
        return lease
    return dataclasses.replace(lease, idle_since=None if busy else now)


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

    def remember(self, inputs, read_at: float | None = None) -> None:
        """Keep ``inputs`` (a tick's gather) for :meth:`lend_now`; ``read_at``: ``clock()``
        before the tick read the leases (default ``inputs.now``): a quick lend reads again the
        leases written since then (:data:`LEASE_SLACK` earlier)."""
        self._snapshot = (inputs, time.monotonic(), inputs.now if read_at is None else read_at)

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
        cached, read_at = snap[0], snap[2]
        queues = sorted(set(queues) & {q.name for q in cached.definitions})
        if not queues:
            return []
        with self._lend_lock:
            self._quick_idle.clear()
            try:
                return self._lend(R, cached, read_at, queues)
            finally:
                self._quick_idle.set()

    def _lend(self, R, cached, read_at: float, queues: list[str]) -> list:
        """Refresh, plan, apply the lends of ``queues`` (under ``_lend_lock``)."""
        inputs = self._refreshed(R, cached, read_at, queues)
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

    def _leases_now(self, R, cached, read_at: float) -> dict:
        """``{id: reconcile.LeaseView}`` of the leases that hold their device now: the
        snapshot's, with those written since ``read_at`` (less :data:`LEASE_SLACK`) read again
        (one read, index ``magic_leases(state, updated_at)``): a lease claimed since is added,
        one whose state, generation, drain, admission or idleness changed is replaced, one
        returned since is dropped (a ``failed`` one keeps its claim: kept). Every change of
        those fields is a write through ``LeaseStore`` that sets ``updated_at`` (its writer's
        clock), so only a writer whose clock lags by more than the slack goes unseen until the
        next tick's snapshot; the claim's own checks stay the guarantee either way."""
        changed = list(self.db.magic_leases.find(
            {"state": {"$in": sorted(L.STATES)}, "updated_at": {"$gte": read_at - LEASE_SLACK}},
            LEASE_VIEW_FIELDS))
        views = {v.id: v for v in cached.leases}
        holding = [d for d in changed if d["state"] != L.RETURNED]
        with_vms(self.db, holding)
        for doc in changed:
            if doc["state"] == L.RETURNED:
                views.pop(doc["_id"], None)
        for doc in holding:
            views[doc["_id"]] = self._lease_view(R, doc)
        return views

    def _refreshed(self, R, cached, read_at: float, queues: list[str]):
        """``cached`` (reconcile.Inputs) with the leases written since the snapshot, the VM
        agents of ``queues``' leases and the demand of ``queues`` read again, at ``clock()``:
        four reads (the leases written since ``read_at``, :meth:`_leases_now`; those VM agents'
        ``agents`` documents; their dispatch markers; then one ``jobs`` read for the queues'
        waiting jobs, the held jobs and the markers' jobs, :class:`.jobreads.JobReads`)."""
        now = self.clock()
        views = self._leases_now(R, cached, read_at)
        mine = [v for v in views.values()
                if v.queue in queues and v.state in (L.ACTIVE, L.DRAINING)]
        names = [n for v in mine for n in v.vm_names]
        agents = {}
        if names:
            agents = {d["name"]: d for d in self.db.agents.find(
                {"name": {"$in": sorted(names)}},
                {"name": 1, "state": 1, "job_id": 1, "updated_at": 1})}  # updated_at: stalejob
        reporting = [n for n in names if n in agents]
        markers = self.store.gates.markers(reporting)
        possible = excludes.PossibleVMs(
            [q for q in cached.definitions if q.name in queues], cached.devices,
            ((v.queue, v.device, v.vm_names) for v in views.values()))
        facts = self.job_reads.read(now, [], queues, reporting, marker_job_ids(markers),
                                    possible)
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
        vm_views = [v for v in cached.vm_agents if v.queue not in queues and v.lease_id in views
                    and views[v.lease_id].state in (L.ACTIVE, L.DRAINING)]
        for lease in mine:
            fresh = []
            for name in lease.vm_names:
                a = agents.get(name)
                if a is None:
                    continue  # not reporting yet: "coming"
                fresh.append(R.VMAgentView(
                    name=name, lease_id=lease.id, queue=lease.queue, state=a.get("state"),
                    job_id=a.get("job_id") or facts.held.get(name), busy=name in busy))
            views[lease.id] = _idleness(lease, fresh, now)
            vm_views.extend(fresh)
        # As the tick's gather lists them: failed leases (they keep their claim), then the
        # open ones (reconcile orders them itself; this only keeps the inputs alike).
        order = lambda v: (v.created_at or 0.0, v.id)  # noqa: E731
        lease_views = sorted((v for v in views.values() if v.state == L.FAILED), key=order)
        lease_views += sorted((v for v in views.values() if v.state != L.FAILED), key=order)
        # A device whose lease closed since the snapshot: its agent's startup post may still be
        # to come (Snapshot._returning), which the snapshot cannot tell; not lent until a tick
        # has looked (reconcile.DeviceView.agent_back).
        held = {v.device for v in lease_views}
        gone = {v.device for v in cached.leases} - held
        devices = [dataclasses.replace(d, agent_back=False) if d.name in gone else d
                   for d in cached.devices]
        return dataclasses.replace(cached, demand=demand, leases=lease_views, vm_agents=vm_views,
                                   devices=devices, now=now)
