"""Reconcile's rules for one lease whatever the demand: deadlines of a bring-up, a drain's grace
and force, a removed queue's leases, leases on stale agent hosts or hosts that cannot reach
MAAS, and the leases of quarantined devices. A mixin of the planner (reconcile._Planner): it
reads ``i`` (Inputs), ``now``, ``device_by_name``, ``_counts`` and the planner's ``add``,
``busy``, ``coming``, ``idle`` and ``shortfall``. Pure: no I/O, no clock (``Inputs.now``).

A lease of a quarantined device (TRIAL6 finding 3: new jobs kept starting on hardware an
operator had just quarantined): in bring-up -> ``drain`` (kind ``quarantined``, grace 0: the
engine restores it at once); active and open -> ``pause`` (no new job, its running jobs
finish); active, paused and emptied -> ``drain`` (kind ``quarantined``); meanwhile it is no
supply, so the queue's waiting jobs get another device.
"""

from __future__ import annotations

from .leases import ACTIVE, BRINGUP_STATES, DRAINING
from .reconcile_model import ORPHAN_GRACE, UNDRAINABLE, LeaseView, _dur, _plural


class Lifecycle:
    """The per-lease rules of :class:`reconcile._Planner` (see the module docstring)."""

    def orphan(self, lease: LeaseView) -> None:
        if lease.state == ACTIVE:
            self.add("drain", f"{lease.queue}: queue definition removed; drain lease {lease.id} "
                     f"on {lease.device}", lease, data={"kind": "orphan", "grace": ORPHAN_GRACE, "force": False})
        elif lease.state in BRINGUP_STATES:
            # Nothing can ever run on it: stop the bring-up now (the engine restores a drained
            # bring-up at once, no failure counted) rather than finish it and then drain it.
            self.add("drain", f"{lease.queue}: queue definition removed; stop the bring-up of "
                     f"lease {lease.id} on {lease.device} ({lease.state})", lease,
                     data={"kind": "orphan", "grace": 0.0, "force": False})
        else:
            self.lifecycle(lease, None)

    def lifecycle(self, lease: LeaseView, q) -> bool:
        """Deadline/drain rules that hold whatever the demand. True if an action was added."""
        name = lease.queue
        if lease.state in BRINGUP_STATES:
            deadline = lease.deadline
            if deadline is None and q is not None:
                deadline = lease.created_at + q.policy.provision_timeout
            if deadline is not None and self.now >= deadline and self.maas_down(lease):
                host = self.device_by_name[lease.device].agent_host
                self.add("restore", f"{name}: lease {lease.id} on {lease.device} still "
                         f"{lease.state} {_dur(self.now - lease.created_at)} after the claim "
                         f"(deadline passed) while agent host {host} cannot reach MAAS (for "
                         f"{_dur(self.i.maas_down_hosts[host])}); restore, no failure counted",
                         lease, data={"maas_down": True})
                return True
            dev = self.device_by_name.get(lease.device)
            host = dev.agent_host if dev is not None else None
            if deadline is not None and self.now >= deadline and host in self.i.quiet_hosts:
                self.add("restore", f"{name}: lease {lease.id} on {lease.device} still "
                         f"{lease.state} {_dur(self.now - lease.created_at)} after the claim "
                         f"(deadline passed) while agent host {host} has sent no heartbeat "
                         f"for {_dur(self.i.quiet_hosts[host])} (hung or cut off: not the "
                         "device's fault); restore, no failure counted", lease,
                         data={"host_stale": True})
                return True
            if deadline is not None and self.now >= deadline and host in self.i.stale_hosts:
                # A host that has just turned stale, or stayed so while no tick ran (a server
                # restart): its silence, not the device (TRIAL14 F1).
                return self.abandon_on_stale_host(lease)
            if deadline is not None and self.now >= deadline:
                self.add("restore", f"{name}: lease {lease.id} on {lease.device} still {lease.state} "
                         f"{_dur(self.now - lease.created_at)} after the claim (deadline passed); "
                         "restore and count a failure", lease, data={"failure": True})
                return True
            return self.abandon_on_stale_host(lease)
        if lease.state != DRAINING:
            return False
        counts = self._counts.get(lease.id)  # [busy, all] of its VM agents
        drain = lease.drain or {}
        if drain.get("kind") == "orphan" and q is not None and not drain.get("forced") \
                and drain.get("forced_at") is None:
            # Its queue was removed, then applied again (TRIAL16 F1): the removal is undone
            # ("Applying the queue again undoes the removal"), so is its drain, before its
            # grace cancels a job; idleness drains it again by the queue's own rules.
            self.add("undrain", f"{name}: its magic queue is defined again; undo the "
                     f"removed-queue drain of lease {lease.id} on {lease.device}: its "
                     f"{_plural(self.busy(lease), 'busy VM agent')} keep their jobs, its idle "
                     "ones take jobs again", lease, data={"kind": "orphan", "requeued": True})
            return True
        if not counts or not counts[0]:  # every VM agent idle (or none reporting)
            if drain.get("kind") in UNDRAINABLE and not drain.get("forced") and q is not None \
                    and self.shortfall(q) > 0 and counts and self.could_serve(lease) > 0:
                return False  # demand is back: plan_queue undrains it instead
            self.add("restore", f"{name}: lease {lease.id} on {lease.device} is draining and its "
                     f"{_plural(counts[1] if counts else 0, 'VM agent')} "
                     f"{'is' if counts and counts[1] == 1 else 'are'} idle; restore",
                     lease)
            return True
        if drain.get("forced_at") is not None:
            return self.forced(lease, drain)
        if lease.id in self.reclaim_undrains:  # before its grace ends: no job is cancelled
            self.add("undrain", f"{name}: lease {lease.id} on {lease.device}: "
                     f"{self.reclaim_undrains[lease.id]}; cancel the reclaim drain: its "
                     f"{_plural(self.busy(lease), 'busy VM agent')} keep their jobs", lease,
                     data={"kind": "reclaim", "surplus": True})
            return True
        grace_until = drain.get("grace_until", lease.deadline)
        if grace_until is not None and self.now >= grace_until:
            self.add("force", f"{name}: lease {lease.id} on {lease.device}: grace ended with "
                     f"{_plural(self.busy(lease), 'busy VM agent')}; cancel their jobs "
                     f"(drain: {drain.get('reason', 'unknown')})", lease)
            return True
        return False

    def maas_down(self, lease: LeaseView) -> bool:
        """True if ``lease``'s device is on an agent host in ``Inputs.maas_down_hosts``."""
        dev = self.device_by_name.get(lease.device)
        return dev is not None and dev.agent_host in self.i.maas_down_hosts

    def abandon_on_stale_host(self, lease: LeaseView) -> bool:
        """A lease in bring-up whose device's agent host is stale (``Inputs.stale_hosts``: no
        heartbeat, so nobody works the lease) -> ``restore`` (data ``host_stale``: no failure
        is counted, the device did nothing wrong). Its queue's jobs stop waiting for it (the
        plan lends elsewhere), and when the host heartbeats again its daemon restores the
        device (the restore is idempotent from any bring-up state) instead of going on with a
        bring-up that may no longer be needed. True if an action was added."""
        dev = self.device_by_name.get(lease.device)
        if dev is None or dev.agent_host not in self.i.stale_hosts:
            return False
        silent = self.i.stale_hosts[dev.agent_host]
        self.add("restore", f"{lease.queue}: lease {lease.id} on {lease.device} is {lease.state} "
                 f"but agent host {dev.agent_host} sent no heartbeat "
                 + ("yet" if silent is None else f"for {_dur(silent)}")
                 + " (stale: nobody works the lease); restore (no failure counted): the queue "
                 "lends elsewhere, the host restores the device when it is back", lease,
                 data={"host_stale": True})
        return True

    def forced(self, lease: LeaseView, drain: dict) -> bool:
        """A committed force with busy VM agents: wait for them to notice the cancel, up to
        ``force_until``; repeat a force whose cancel was never recorded."""
        name, busy = lease.queue, self.busy(lease)
        if drain.get("cancelled") is None:
            self.add("force", f"{name}: lease {lease.id} on {lease.device}: forced but its jobs "
                     f"were not cancelled yet ({_plural(busy, 'busy VM agent')}); cancel them",
                     lease)
            return True
        until = drain.get("force_until")
        if until is not None and self.now >= until:
            self.add("restore", f"{name}: lease {lease.id} on {lease.device}: "
                     f"{_plural(busy, 'VM agent')} still busy "
                     f"{_dur(self.now - drain['forced_at'])} after their jobs were cancelled; "
                     "restore anyway", lease, data={"force_timeout": True})
            return True
        return False

    def hold_back_quarantined(self, q, live: list[LeaseView]) -> set[str]:
        """The ids of ``q``'s leases (of ``live``, those no lifecycle rule handled) whose
        device is quarantined, after adding what each needs (module docstring); the caller
        leaves them out of the queue's supply and serving leases."""
        # A quarantined device's lease (TRIAL6 finding 3: new jobs kept starting on hardware an
        # operator had just quarantined): a bring-up stops, an active lease takes no new job
        # (paused) and goes back once its running jobs ended; it serves nothing meanwhile.
        sick: set[str] = set()
        for l in live:
            d = self.device_by_name.get(l.device)
            if d is None or not d.quarantined:
                continue
            sick.add(l.id)  # paused with jobs running, or draining: nothing new; no supply
            if l.state in BRINGUP_STATES:
                self.add("drain", f"{q.name}: {l.device} is quarantined; stop the bring-up of "
                         f"lease {l.id} ({l.state})", l,
                         data={"kind": "quarantined", "grace": 0.0, "force": False})
            elif l.state == ACTIVE and l.admission != "paused":
                self.add("pause", f"{q.name}: {l.device} is quarantined; pause lease {l.id}: no "
                         "new job starts there, its running jobs finish", l)
            elif l.state == ACTIVE and not self.busy(l) and not self.coming(l):
                self.add("drain", f"{q.name}: {l.device} is quarantined and lease {l.id} has "
                         "emptied; drain", l,
                         data={"kind": "quarantined", "grace": q.policy.reclaim.grace,
                               "force": False})
        return sick
