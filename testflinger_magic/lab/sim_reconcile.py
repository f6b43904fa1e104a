"""``reconcile.plan``'s view of the simulation: its Inputs built from the model, the plan run and
its actions handed to ``SimActions``, and why a stuck magic queue waits.

A mixin of ``Simulation`` (simulate.py), whose state (``devices``, ``agents``, ``open``,
``waiting``, ``last_job_at``, ``arrived``, ``defs``, ``qdefs``, ``suspended``, ``result``,
``now``) it reads; building the inputs tracks an active lease's idleness as the engine does
(``engine._track_idle``: ``idle_since`` and generation +1).

Calendar: time 0 is Monday 2024-01-01 00:00 UTC (:data:`SIM_EPOCH`, passed as ``Inputs.wall``)
for ``policy.warm`` windows and ``warm_learn``, which learns from the replay's own submissions
(``Inputs.arrivals``).
"""

from __future__ import annotations

import bisect

from testflinger_magic import leases as L
from testflinger_magic import reconcile as R

#: Epoch seconds of the trace's time 0 for calendar rules (``policy.warm`` windows and the day
#: kind of ``policy.warm_learn``): Monday 2024-01-01 00:00 UTC. Traces start on a Monday at
#: 00:00 (docs/simulate.md), so ``days: [0]`` rules and ``warm: mon`` windows agree.
SIM_EPOCH = 1704067200.0


class SimReconcile:
    """Reconcile's inputs, the plan and its actions (see the module docstring)."""

    def _demand(self) -> dict[str, R.QueueDemand]:
        out = {}
        for q, heap in self.waiting.items():
            if not heap:
                continue
            out[q] = R.QueueDemand(
                waiting=len(heap), max_priority=-heap[0][0],
                oldest_age=self.now - min(e[2].spec.submit for e in heap),
                last_job_at=self.last_job_at.get(q))
        for q in self.qdefs:
            if q not in out:
                out[q] = R.QueueDemand(last_job_at=self.last_job_at.get(q))
        return out

    def _inputs(self) -> R.Inputs:
        devices = []
        for d in self.devices.values():
            a = d.agent
            lent = d.lease_id is not None
            state = L.LENT_AGENT_STATE if lent else ("test" if a.job else "waiting")
            devices.append(R.DeviceView(
                name=d.name, agent_host=d.spec.agent_host, gpus=d.spec.gpus, tags=d.spec.tags,
                home_queues=d.spec.home_queues, agent_state=state,
                job_id=a.job.spec.id if a.job else None, quarantined=d.quarantined,
                failures=d.failures, last_home_use=a.last_change))
        leases, vm_agents = [], []
        for lease in self.open.values():
            if lease.state in (L.ACTIVE, L.DRAINING):
                for name in lease.agents:
                    a = self.agents[name]
                    vm_agents.append(R.VMAgentView(
                        name=name, lease_id=lease.id, queue=lease.queue,
                        state="test" if a.job else "waiting",
                        job_id=a.job.spec.id if a.job else None, busy=a.job is not None))
                if lease.state == L.ACTIVE and (lease.busy > 0) != (lease.idle_since is None):
                    # engine._track_idle: a CAS progress (generation +1)
                    lease.idle_since = None if lease.busy else self.now
                    lease.generation += 1
            leases.append(R.LeaseView(
                id=lease.id, device=lease.device, queue=lease.queue, state=lease.state,
                generation=lease.generation, created_at=lease.created_at,
                updated_at=lease.updated_at, deadline=lease.deadline, vms=lease.vms,
                drain=lease.drain, admission=lease.admission, idle_since=lease.idle_since,
                active_since=lease.active_since))
        arrivals = {}
        for q, times in self.arrived.items():
            since = self.now - self.qdefs[q].policy.warm_learn.lookback
            arrivals[q] = times[bisect.bisect_left(times, since):]
        return R.Inputs(definitions=self.defs, devices=devices, demand=self._demand(),
                        leases=leases, vm_agents=vm_agents, now=self.now,
                        wall=SIM_EPOCH + self.now, arrivals=arrivals, suspended=self.suspended)

    def _reconcile(self) -> bool:
        """One ``reconcile.plan`` and its actions; True when any action was taken."""
        self.result.reconciles += 1
        actions = R.plan(self._inputs())
        for action in actions:
            getattr(self, f"_do_{action.kind}")(action)
        return bool(actions)

    def _warn_stuck(self) -> None:
        """At a fixed point: one warning per magic queue with waiting jobs, with the last reason
        ``reconcile.plan`` gives for not lending (its ``blocked`` actions, as ``plan`` shows)."""
        blocked = {a.queue: a.reason for a in R.plan(self._inputs(), explain=True)
                   if a.kind in R.NON_ACTING}
        for q in sorted(self.qdefs):
            n = len(self.waiting.get(q) or ())
            if n:
                why = blocked.get(q) or "nothing would lend a device for it"
                self.result.warnings.append(f"queue {q}: {n} job(s) can never run: {why}")
