"""The figures of one replay: the simulation's final state summed into its ``Result``
(sim_results.py): jobs done, cancelled and unfinished, waits (all, per magic queue, each start),
device- and GPU-hours lent, idle and borrowed by home pool and queue.

A mixin of ``Simulation`` (simulate.py), whose state (``jobs``, ``leases``, ``devices``,
``qdefs``, ``lending``, ``result``) it reads.
"""

from __future__ import annotations

from testflinger_magic.lab.sim_results import Result, _waits, home_pool


class SimReport:
    """``_finish``: the Result at the end of the replay (see the module docstring)."""

    def _finish(self, end: float) -> Result:
        r = self.result
        r.virtual_seconds = end
        waits: dict[str, list[float]] = {"magic": [], "home": []}
        for job in self.jobs:
            cls = "magic" if job.magic else "home"
            if job.state == "done":
                r.done[cls] += 1
            elif job.state == "cancelled":
                r.cancelled[cls] += 1
            else:
                r.unfinished[cls] += 1
            r.outcomes[job.spec.id] = (job.state if job.state in ("done", "cancelled")
                                       else "unfinished")
            if job.started is not None:
                waits[cls].append(job.started - job.spec.submit)
        r.wait = {cls: _waits(v) for cls, v in waits.items()}
        by_queue: dict[str, list[float]] = {q: [] for q in self.qdefs}
        for job in self.jobs:
            if job.magic and job.started is not None:
                by_queue[job.spec.queue].append(job.started - job.spec.submit)
        r.wait_by_queue = {q: _waits(v) for q, v in sorted(by_queue.items())}
        r.started = [(job.started, job.started - job.spec.submit,
                      job.spec.queue if job.magic else "home")
                     for job in self.jobs if job.started is not None]
        for lease in self.leases.values():
            stop = lease.closed_at if lease.closed_at is not None else end
            hours = max(0.0, stop - lease.created_at) / 3600.0
            r.device_hours_lent += hours
            spec = self.devices[lease.device].spec
            gpu_hours = hours * spec.gpus
            r.gpu_hours_lent += gpu_hours
            pool = home_pool(spec.home_queues)
            r.borrowed_by_home[pool] = r.borrowed_by_home.get(pool, 0.0) + gpu_hours
            r.borrowed_by_queue[lease.queue] = (r.borrowed_by_queue.get(lease.queue, 0.0)
                                                + gpu_hours)
            idle = lease.idle_seconds
            if lease.closed_at is None and lease.idle_from is not None:
                idle += max(0.0, end - lease.idle_from)
            r.device_hours_idle_lent += idle / 3600.0
        for q in self.qdefs:
            r.max_open_leases.setdefault(q, 0)
            if self.lending:  # baselines do not plan: no starvation figure
                r.starved.setdefault(q, 0.0)
        return r
