"""Prometheus metrics of the plugin, on a private registry (served at GET /v1/magic/metrics).

A private ``CollectorRegistry`` per plugin keeps the plugin's series apart from Testflinger's own
(which live on the default registry, exported on METRICS_PORT) and lets tests mount several apps
in one process. Gauges are refreshed from MongoDB on each scrape, so every replica reports the
same cluster-wide values; counters count what this replica did.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from testflinger_magic.lease_states import ACTIVE, FAILED, OPEN_STATES, RETURNED
from testflinger_magic.tfstates import JOB_WAITING

from .snapshot import epoch

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """The plugin's metric families.

    - ``magic_leases{state}`` gauge: leases per state: the open ones and ``failed``: the failed
      leases still holding their device (a failed lease keeps it until a person releases it
      with ``unquarantine``; released ones stay ``failed`` in the history but are not counted,
      as ``status``' ``failed_leases``: TRIAL19 F6, an alert on it fired for ever);
      ``returned`` counts the returned leases stored (history: nothing of ours deletes them,
      so it only grows).
    - ``magic_vm_agents{queue}`` gauge: VM agents of leases that can take jobs (``active``
      leases whose admission is open).
    - ``magic_queue_waiting_jobs{queue}``, ``magic_queue_oldest_wait_seconds{queue}`` gauges:
      each magic queue's waiting jobs and how long the oldest has waited (0: none).
    - ``magic_queue_suspended{queue}`` gauge: 1 while a magic queue's lending is suspended (its
      definition made a lease fail), else 0; ``magic_devices_quarantined`` gauge.
    - ``magic_lends_total{queue}``, ``magic_drains_total{queue, kind}`` counters (this replica;
      ``kind``: reconcile's drain kinds, ``operator``, ``error``).
    - ``magic_jobs_cancelled_total{queue}`` counter: jobs this replica cancelled because a
      drain's grace ended while they ran (event ``lease.forced``).
    - ``magic_dispatch_refusals_total{reason}`` counter: GET /v1/job answered 204 by the plugin
      (``reason`` = ``fenced``, ``paused``, or ``error``: the hook failed and answered 204
      rather than let the poll through unchecked).
    - ``magic_gpu_hours_borrowed_total{queue, home_pool}`` counter: GPU-hours of the leases this
      replica closed, from claim to close (testflinger_magic.fairness; ``sum by (home_pool)``
      is what each pool of owners gave, ``sum by (queue)`` what each magic queue took).
    - ``magic_leases_overdue`` gauge: leases still ``restoring`` past their deadline.
    - ``magic_agent_hosts_stale`` gauge: agent hosts with no heartbeat for
      ``reconcile.STALE_HOST_AFTER`` seconds (their leases are not being worked).

    ``alerts``: a callable returning Engine.alerts() (set by the plugin) for the last two.
    """

    def __init__(self, alerts=None):
        self.alerts = alerts
        self.registry = CollectorRegistry()
        self.leases = Gauge("magic_leases", "Leases by state", ["state"], registry=self.registry)
        self.vm_agents = Gauge(
            "magic_vm_agents", "VM agents of open leases", ["queue"], registry=self.registry
        )
        self.lends = Counter(
            "magic_lends", "Devices lent to magic queues", ["queue"], registry=self.registry
        )
        self.drains = Counter(
            "magic_drains", "Leases put to draining", ["queue", "kind"], registry=self.registry
        )
        self.cancelled = Counter(
            "magic_jobs_cancelled", "Jobs cancelled at the end of a drain's grace", ["queue"],
            registry=self.registry)
        self.waiting = Gauge("magic_queue_waiting_jobs", "Waiting jobs per magic queue",
                             ["queue"], registry=self.registry)
        self.oldest = Gauge("magic_queue_oldest_wait_seconds",
                            "Seconds the oldest waiting job of a magic queue has waited",
                            ["queue"], registry=self.registry)
        self.suspended = Gauge("magic_queue_suspended",
                               "1 while a magic queue's lending is suspended", ["queue"],
                               registry=self.registry)
        self.quarantined = Gauge("magic_devices_quarantined", "Quarantined devices",
                                 registry=self.registry)
        self.refusals = Counter(
            "magic_dispatch_refusals",
            "Job requests refused by the plugin",
            ["reason"],
            registry=self.registry,
        )
        self.borrowed = Counter(
            "magic_gpu_hours_borrowed",
            "GPU-hours lent to magic queues, counted when leases close",
            ["queue", "home_pool"],
            registry=self.registry,
        )
        self.overdue = Gauge("magic_leases_overdue", "Leases restoring past their deadline",
                             registry=self.registry)
        self.stale_hosts = Gauge("magic_agent_hosts_stale",
                                 "Agent hosts whose heartbeat is overdue", registry=self.registry)

    def count_borrowed(self, queue: str, home_pool: str, gpu_hours: float) -> None:
        """LeaseStore.on_borrowed: a closed lease's GPU-hours (>= 0)."""
        self.borrowed.labels(queue=queue, home_pool=home_pool).inc(max(0.0, gpu_hours))

    def refresh(self, db, now: float | None = None) -> None:
        """Recompute the gauges from MongoDB, in a bounded number of reads whatever the
        history: the claims, the open leases and the failed ones holding a claim (index
        ``magic_leases(state, ...)``, ``_id``), a count of the
        returned ones, the magic queues, their waiting jobs (index ``jobs(result_data.job_state,
        job_data.job_queue)``) and a count of the quarantined devices. ``now``: epoch seconds
        (default: the wall clock)."""
        now = time.time() if now is None else now
        for gauge in (self.leases, self.vm_agents, self.waiting, self.oldest, self.suspended):
            gauge.clear()
        counts: dict[str, int] = {}
        vms: dict[str, int] = {}
        # Failed leases only while they hold their device's claim (one read of the claims,
        # bounded by the devices): not every failed lease of the history.
        held = sorted({c["lease_id"] for c in db.magic_device_claims.find({}, {"lease_id": 1})
                       if c.get("lease_id")})
        for doc in db.magic_leases.find({"$or": [{"state": {"$in": sorted(OPEN_STATES)}},
                                                 {"state": FAILED, "_id": {"$in": held}}]},
                                        {"state": 1, "queue": 1, "vms.agent_name": 1,
                                         "admission": 1}):
            state = doc.get("state", "unknown")
            counts[state] = counts.get(state, 0) + 1
            queue = doc.get("queue", "")
            vms.setdefault(queue, 0)
            if state == ACTIVE and doc.get("admission", "open") == "open":
                vms[queue] += len(doc.get("vms") or [])
        counts[RETURNED] = db.magic_leases.count_documents({"state": RETURNED})
        for state, n in counts.items():
            self.leases.labels(state=state).set(n)
        queues = {d["_id"]: d for d in db.magic_queues.find({}, {"suspended": 1})}
        for queue in set(vms) | set(queues):
            self.vm_agents.labels(queue=queue).set(vms.get(queue, 0))
        waiting = {q: [0, None] for q in queues}
        if queues:
            for job in db.jobs.find({"result_data.job_state": JOB_WAITING,
                                     "job_data.job_queue": {"$in": sorted(queues)}},
                                    {"job_data.job_queue": 1, "created_at": 1}):
                entry = waiting.get((job.get("job_data") or {}).get("job_queue"))
                if entry is None:
                    continue
                entry[0] += 1
                at = epoch(job.get("created_at"))
                if at is not None and (entry[1] is None or at < entry[1]):
                    entry[1] = at
        for queue, (n, oldest) in waiting.items():
            self.waiting.labels(queue=queue).set(n)
            self.oldest.labels(queue=queue).set(max(0.0, now - oldest) if oldest else 0.0)
            self.suspended.labels(queue=queue).set(1 if queues[queue].get("suspended") else 0)
        self.quarantined.set(db.magic_devices.count_documents({"quarantined": True}))
        if self.alerts is not None:
            found = self.alerts()
            self.overdue.set(len(found["overdue_leases"]))
            self.stale_hosts.set(len(found["stale_agent_hosts"]))

    def render(self, db, now: float | None = None) -> bytes:
        """Refresh the gauges and return the Prometheus text exposition."""
        self.refresh(db, now)
        return generate_latest(self.registry)
