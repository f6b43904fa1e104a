"""Prometheus metrics of the plugin, on a private registry (served at GET /v1/magic/metrics).

A private ``CollectorRegistry`` per plugin keeps the plugin's series apart from Testflinger's own
(which live on the default registry, exported on METRICS_PORT) and lets tests mount several apps
in one process. Gauges are refreshed from MongoDB on each scrape, so every replica reports the
same cluster-wide values; counters count what this replica did.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """The plugin's metric families.

    - ``magic_leases{state}`` gauge: leases per state (open ones and the final ones still stored).
    - ``magic_vm_agents{queue}`` gauge: VM agents of open leases.
    - ``magic_lends_total{queue}``, ``magic_drains_total{queue}`` counters (this replica).
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
            "magic_drains", "Leases put to draining", ["queue"], registry=self.registry
        )
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

    def refresh(self, db) -> None:
        """Recompute the gauges from ``magic_leases``."""
        self.leases.clear()
        self.vm_agents.clear()
        counts: dict[str, int] = {}
        vms: dict[str, int] = {}
        for doc in db.magic_leases.find({}, {"state": 1, "queue": 1, "vms": 1}):
            state = doc.get("state", "unknown")
            counts[state] = counts.get(state, 0) + 1
            if state not in ("returned", "failed"):
                queue = doc.get("queue", "")
                vms[queue] = vms.get(queue, 0) + len(doc.get("vms") or [])
        for state, n in counts.items():
            self.leases.labels(state=state).set(n)
        for queue, n in vms.items():
            self.vm_agents.labels(queue=queue).set(n)
        if self.alerts is not None:
            found = self.alerts()
            self.overdue.set(len(found["overdue_leases"]))
            self.stale_hosts.set(len(found["stale_agent_hosts"]))

    def render(self, db) -> bytes:
        """Refresh the gauges and return the Prometheus text exposition."""
        self.refresh(db)
        return generate_latest(self.registry)
