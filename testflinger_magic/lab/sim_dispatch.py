"""Testflinger's dispatch in the simulation: idle agents take waiting jobs, jobs start and end.

A mixin of ``Simulation`` (simulate.py), whose state (``agents``, ``devices``, ``leases``,
``waiting``, ``qdefs``, ``result``, ``now``) and event queue (``_at``) it uses. An idle, unfenced
agent takes the waiting job of its queues with the highest ``job_priority``, ties in submission
order (``database.pop_job``, TESTFLINGER.md §1.5); a device agent is fenced while its device is
lent, a VM agent unless its lease is active with open admission (server/dispatch.py). Busy VM
agents keep their lease's busy count and idle time (``_busy``).
"""

from __future__ import annotations

import heapq

from testflinger_magic import leases as L
from testflinger_magic.lab.sim_model import _Agent, _Job, _Lease
from testflinger_magic.lab.sim_policy import SimulationError


class SimDispatch:
    """Jobs and dispatch (see the module docstring)."""

    def _start_job(self, agent: _Agent, job: _Job) -> None:
        job.state, job.started, job.agent = "running", self.now, agent.name
        agent.job, agent.last_change = job, self.now
        if agent.lease_id:
            self._busy(self.leases[agent.lease_id], +1)
        self._at(self.now + job.spec.duration, "job_end", agent.name, job.seq)

    def _end_job(self, agent: _Agent, outcome: str) -> None:
        job = agent.job
        if job is None or job.state != "running":
            raise SimulationError(f"{job.spec.id if job else agent.name}: ended twice")
        job.state, job.ended = outcome, self.now
        agent.job, agent.last_change = None, self.now
        self._open_jobs -= 1
        if agent.lease_id:
            hours = (self.now - job.started) / 3600.0
            self.result.vm_hours_busy += hours
            q = self.qdefs.get(job.spec.queue)
            self.result.gpu_hours_busy += hours * (q.vm.gpus if q is not None else 0)
            self._busy(self.leases[agent.lease_id], -1)

    def _busy(self, lease: _Lease, delta: int) -> None:
        if lease.busy == 0 and delta > 0 and lease.idle_from is not None:
            lease.idle_seconds += self.now - lease.idle_from
            lease.idle_from = None
        lease.busy += delta
        if lease.busy == 0:
            lease.idle_from = self.now

    def _can_take(self, agent: _Agent) -> bool:
        if agent.job is not None:
            return False
        if agent.lease_id is None:  # device agent: fenced while its device is lent
            return self.devices[agent.name].lease_id is None
        lease = self.leases[agent.lease_id]
        # Fenced unless active; paused admission gets 204 too (server/dispatch.py).
        return lease.state == L.ACTIVE and lease.admission == "open"

    def _dispatch(self) -> None:
        """Idle agents pop jobs: highest priority, then oldest (TESTFLINGER.md §1.5)."""
        if not any(self.waiting.values()):
            return
        for name in sorted(self.agents):
            agent = self.agents[name]
            if not self._can_take(agent):
                continue
            best = None
            for q in agent.queues:
                heap = self.waiting.get(q)
                if heap and (best is None or heap[0][:2] < best[0][:2]):
                    best = (heap[0], q)
            if best is not None:
                heapq.heappop(self.waiting[best[1]])
                self._start_job(agent, best[0][2])
