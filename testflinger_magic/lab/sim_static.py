"""The ``static`` and ``none`` baselines in the simulation (lab/baselines.py): devices split for
a queue at time 0 and never returned, and the jobs a baseline never runs.

A mixin of ``Simulation`` (simulate.py), whose state (``static``, ``lending``, ``qdefs``,
``devices``, ``jobs``, ``leases``, ``open``, ``agents``, ``bringup``, ``result``, ``now``) it
uses; the leases go through the bring-up states of ``leases.TRANSITIONS``.
"""

from __future__ import annotations

from testflinger_magic import leases as L
from testflinger_magic.lab.sim_model import _Agent, _Lease
from testflinger_magic.lab.sim_policy import SimulationError


class SimStatic:
    """The baselines' permanent VM hosts (see the module docstring)."""

    def _split_static(self) -> None:
        """The ``static`` baseline: for each ``{queue: N}``, N devices the queue may use (fewest
        GPUs wasted, then name) are split at time 0 and never returned: their leases go through
        the bring-up states of leases.TRANSITIONS at once (a permanent VM host was built
        before the trace starts), and their VM agents serve the queue for the whole replay.
        Raises SimulationError when fewer than N devices can serve the queue."""
        if not self.lending:
            for q in sorted(set(self.qdefs) - set(self.static)):
                n = sum(1 for j in self.jobs if j.spec.queue == q)
                if n:
                    self.result.warnings.append(f"queue {q}: {n} job(s) never run: this "
                                                "baseline lends no device to it")
        for qname, n in sorted(self.static.items()):
            q = self.qdefs.get(qname)
            if q is None:
                raise SimulationError(f"--baseline static:{n}:{qname}: {qname!r} is not a magic "
                                      "queue in the definitions "
                                      f"({', '.join(sorted(self.qdefs))})")
            fits = []
            for d in self.devices.values():
                if d.lease_id is not None:
                    continue
                doc = {"_id": d.name, "name": d.name, "gpus": d.spec.gpus, "tags": d.spec.tags,
                       "home_queues": d.spec.home_queues}
                vms = q.vms_for(d.spec.gpus)
                if vms >= 1 and q.matches(doc):
                    fits.append((d.spec.gpus - vms * q.vm.gpus, d.name, d, vms))
            if len(fits) < n:
                raise SimulationError(f"--baseline static:{n}:{qname}: only {len(fits)} "
                                      f"device(s) of the lab can serve {qname}")
            for _, _, dev, vms in sorted(fits, key=lambda t: t[:2])[:n]:
                self._lease_n += 1
                lease = _Lease(id=f"lease-{self._lease_n:06d}", device=dev.name, queue=qname,
                               vms=vms, created_at=self.now, updated_at=self.now,
                               idle_from=self.now)
                for nxt in [state for state, _ in self.bringup]:
                    if not L.is_legal(lease.state, nxt):
                        raise SimulationError(f"lease {lease.id}: {lease.state} -> {nxt} is not "
                                              "in leases.TRANSITIONS (static baseline)")
                    lease.state = nxt
                    lease.generation += 1
                    lease.moves += 1
                self.leases[lease.id] = self.open[lease.id] = lease
                dev.lease_id = lease.id
                self.result.lends += 1
                self.result.bringups += 1
                self.result.max_open_leases[qname] = self.result.max_open_leases.get(qname, 0) + 1
                lease.agents = [f"{dev.name}-vm{i + 1}" for i in range(vms)]
                for name in lease.agents:
                    self.agents[name] = _Agent(name, (qname,), lease_id=lease.id,
                                               last_change=self.now)
