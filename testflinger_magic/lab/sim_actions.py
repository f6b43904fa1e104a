"""How the simulation applies reconcile's actions (lend, drain, undrain, force, restore, pause,
resume, quarantine), as ``server/engine.py`` applies them: a mixin of ``Simulation``
(simulate.py), whose state (``leases``, ``devices``, ``agents``, ``result``, ``now``,
``suspended``) and moves (``_move``, ``_schedule_daemon``, ``_end_job``) it uses. Every action
names the generation it was planned on; a lease that moved since is skipped, like the engine's
compare-and-set.

A bring-up that hit its deadline is judged as the server judges it (server/actions.py
``Actions._bringup_timed_out``): :func:`testflinger_magic.blame.judge_timeout` decides whether
the queue is at fault; if so its lending is suspended (``Inputs.suspended``, for the rest of the
replay: nothing re-applies a definition) and the device is not charged.
"""

from __future__ import annotations

from testflinger_magic import blame as B
from testflinger_magic import leases as L
from testflinger_magic.durations import format_duration
from testflinger_magic import reconcile as R
from testflinger_magic.lab.sim_model import _Lease


class SimActions:
    """The ``_do_<kind>(action)`` handlers ``Simulation`` dispatches reconcile's actions to."""

    def _lease_at(self, action) -> _Lease | None:
        lease = self.leases.get(action.lease_id)
        if lease is None or (action.generation is not None and lease.generation != action.generation):
            return None
        return lease

    def _do_lend(self, action) -> None:
        dev = self.devices.get(action.device)
        q = self.qdefs.get(action.queue)
        if dev is None or q is None or dev.lease_id is not None or dev.agent.job is not None:
            return  # ClaimRefused
        vms = int(action.data.get("vms") or q.vms_for(dev.spec.gpus))
        self._lease_n += 1
        lid = f"lease-{self._lease_n:06d}"
        deadline = L.deadline_for(L.CLAIMED, q.policy, self.now)
        lease = _Lease(id=lid, device=dev.name, queue=q.name, vms=vms, created_at=self.now,
                       updated_at=self.now, deadline=deadline, bringup_deadline=deadline,
                       idle_from=self.now)
        self.leases[lid] = self.open[lid] = lease
        dev.lease_id = lid
        self.result.lends += 1
        n_open = sum(1 for l in self.open.values() if l.queue == q.name)
        self.result.max_open_leases[q.name] = max(self.result.max_open_leases.get(q.name, 0), n_open)
        self._schedule_daemon(lease)

    def _drain_doc(self, action, grace: float, forced: bool, kind: str) -> dict:
        return {"reason": action.reason, "kind": kind, "requested_at": self.now,
                "grace_until": self.now + grace, "forced": forced}

    def _do_drain(self, action) -> None:
        lease = self._lease_at(action)
        if lease is None or lease.state not in (L.ACTIVE, *L.BRINGUP_STATES):
            return
        data = action.data or {}
        kind = data.get("kind", "operator")
        grace = data.get("grace")
        grace = L.DEFAULT_GRACE if grace is None else float(grace)
        drain = self._drain_doc(action, grace, bool(data.get("force")), kind)
        if lease.state in L.BRINGUP_STATES:
            # server/actions.py _do_drain: a lease in bring-up goes to restoring at once, no
            # failure counted; the daemon's step in flight is refused (here: moves changed).
            self._move(lease, L.RESTORING, action.reason, drain=drain)
            self.result.drains[kind] = self.result.drains.get(kind, 0) + 1
            return
        if data.get("for"):  # a yield names its starving queue (for sim_starve; the reason says it)
            drain["for"] = data["for"]
        self._move(lease, L.DRAINING, action.reason, drain=drain)
        self.result.drains[kind] = self.result.drains.get(kind, 0) + 1
        if kind == "reclaim":
            self.result.reclaims += 1

    def _do_undrain(self, action) -> None:
        lease = self._lease_at(action)
        drain = (lease.drain or {}) if lease else {}
        surplus = drain.get("kind") == "reclaim" and bool((action.data or {}).get("surplus"))
        requeued = drain.get("kind") == "orphan" and bool((action.data or {}).get("requeued")) \
            and any(q.name == lease.queue for q in self.defs)
        if lease is None or lease.state != L.DRAINING or drain.get("forced") \
                or drain.get("forced_at") is not None \
                or (drain.get("kind") not in R.UNDRAINABLE and not surplus and not requeued):
            return  # as server/actions.py _do_undrain refuses
        self._move(lease, L.ACTIVE, action.reason, drain=None, idle_since=None)

    def _do_force(self, action) -> None:
        lease = self._lease_at(action)
        if lease is None or lease.state not in (L.ACTIVE, L.DRAINING):
            return
        if lease.state == L.ACTIVE:
            self._move(lease, L.DRAINING, action.reason,
                       drain=self._drain_doc(action, 0.0, True, "forced"))
        for name in lease.agents:  # engine._cancel_jobs: the VM agents' non-terminal jobs
            agent = self.agents[name]
            if agent.job is not None:
                self._end_job(agent, "cancelled")
                self.result.forced_cancels += 1
        self._move(lease, L.RESTORING, action.reason, drain=dict(lease.drain or {}, forced=True))

    def _do_restore(self, action) -> None:
        lease = self._lease_at(action)
        if lease is None:
            return
        if lease.state in L.BRINGUP_STATES:
            # data.failure: the bring-up hit its deadline (reconcile's lifecycle rule).
            timed_out = bool((action.data or {}).get("failure"))
            lease.bringup_timeout = lease.bringup_timeout or timed_out
            self._move(lease, L.RESTORING, action.reason)
            if (action.data or {}).get("host_stale"):
                return  # server/actions.py _do_restore: no failure of the device
            if timed_out and self._bringup_timed_out(lease):
                return
            if not lease.failures_counted:  # LeaseStore.record_failure: once per lease
                lease.failures_counted = True
                self.devices[lease.device].failures += 1
                self.devices[lease.device].last_failure_lease = lease.id
                self.result.bringup_failures += 1
            return
        if lease.state != L.DRAINING or lease.busy:
            return  # restore waits for idle VM agents
        self._move(lease, L.RESTORING, action.reason)

    def _bringup_timed_out(self, lease: _Lease) -> bool:
        """``lease`` (restoring, ``bringup_timeout``) hit its bring-up deadline: is its queue
        to blame? The same inputs the server reads (its queue's timed-out leases, the latest
        of its leases that reached ``active``; definitions are applied once, at time 0) and the
        same decision (:func:`testflinger_magic.blame.judge_timeout`). At fault: suspend the
        queue (once; the reason becomes a warning, as the server's ``queue.misconfigured``),
        take back the failures the run's earlier leases counted (never below 0) and return
        True (no failure for ``lease``); a quarantine the planner put on for a failure taken
        back is lifted (server/actions.py ``_lift_failure_quarantine``; a warning names the
        device and why). Reads every lease of the replay, only on a timeout."""
        mine = [x for x in self.leases.values() if x.queue == lease.queue]
        timeouts = [{"_id": x.id, "device": x.device, "created_at": x.created_at,
                     "failures_counted": x.failures_counted} for x in mine if x.bringup_timeout]
        ok = max((x.created_at for x in mine if x.active_since is not None), default=None)
        verdict = B.judge_timeout(lease.id, timeouts, applied_at=0.0, last_ok_created_at=ok)
        if not verdict.queue_at_fault:
            return False
        if lease.queue not in self.suspended:  # _suspend_queue: CAS on "suspended": None
            q = self.qdefs.get(lease.queue)
            reason = B.suspension_reason(lease.queue, q.policy.provision_timeout if q else None,
                                         list(verdict.devices))
            self.suspended[lease.queue] = reason
            self.result.suspended[lease.queue] = self.now
            self.result.warnings.append(f"queue {lease.queue}: lending suspended at "
                                        f"{format_duration(self.now)}: {reason}")
        for lease_id in verdict.take_back:
            earlier = self.leases[lease_id]
            if earlier.failures_counted:
                earlier.failures_counted = False
                dev = self.devices[earlier.device]
                dev.failures = max(0, dev.failures - 1)
                self.result.bringup_failures -= 1
                if dev.quarantined and dev.quarantine_lease == lease_id:
                    dev.quarantined, dev.quarantine_lease = False, None
                    self.result.warnings.append(
                        f"device {dev.name}: unquarantined at {format_duration(self.now)}: its "
                        f"quarantine was for the bring-up timeout of lease {lease_id}, a failure "
                        f"taken back: {lease.queue} is at fault")
        return True

    def _admission(self, action, value: str) -> None:
        lease = self._lease_at(action)
        if lease is None or lease.admission == value:
            return
        lease.admission = value
        lease.generation += 1

    def _do_pause(self, action) -> None:
        self._admission(action, "paused")

    def _do_resume(self, action) -> None:
        self._admission(action, "open")

    def _do_quarantine(self, action) -> None:
        dev = self.devices.get(action.device)
        if dev is not None and not dev.quarantined:
            # server/actions.py _do_quarantine: for the failure count, naming its latest failure
            dev.quarantined, dev.quarantine_lease = True, dev.last_failure_lease
            self.result.quarantines += 1
