"""Results of ``testflinger-magic simulate``: the metrics of one replay and the comparison table."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from testflinger_magic.durations import format_duration
from testflinger_magic.fairness import home_pool  # noqa: F401 (the server's pool names)

__all__ = ["Result", "render_table"]


# --------------------------------------------------------------------------------- results

@dataclass
class Result:
    """What one policy did with the trace. Times in seconds, device-hours in hours."""

    label: str
    overrides: dict
    jobs: int = 0
    done: dict = field(default_factory=lambda: {"magic": 0, "home": 0})
    cancelled: dict = field(default_factory=lambda: {"magic": 0, "home": 0})
    unfinished: dict = field(default_factory=lambda: {"magic": 0, "home": 0})
    wait: dict = field(default_factory=dict)  # {"magic"|"home": {"mean","p50","p95","max"}}
    device_hours_lent: float = 0.0
    device_hours_idle_lent: float = 0.0
    vm_hours_busy: float = 0.0
    #: GPU-hours: lent = device GPUs x hours from claim to return; busy = VM GPUs x hours VM
    #: agents ran magic jobs (idle = lent - busy: bring-up, tear-down and idle VMs).
    gpu_hours_lent: float = 0.0
    gpu_hours_busy: float = 0.0
    #: GPU-hours lent (borrowed from the owners) per home pool (the device's home queues,
    #: joined by ``+``; see :func:`home_pool`) and per magic queue.
    borrowed_by_home: dict = field(default_factory=dict)
    borrowed_by_queue: dict = field(default_factory=dict)
    #: waits of each magic queue's jobs ({"n","mean","p50","p95","max"}, seconds)
    wait_by_queue: dict = field(default_factory=dict)
    #: leases that reached ``active`` (a static baseline's permanent splits count once)
    bringups: int = 0
    #: "policy" (reconcile.plan decides) or "baseline" (``none`` / ``static:N``: no planning)
    kind: str = "policy"
    #: a static baseline's ``{queue: N}`` (devices split for good); empty otherwise
    static: dict = field(default_factory=dict)
    lends: int = 0
    reclaims: int = 0
    drains: dict = field(default_factory=dict)  # by drain kind
    forced_cancels: int = 0
    #: failures counted against devices (bring-up errors and timeouts the queue is not blamed
    #: for; taken back when a later timeout blames the queue: testflinger_magic.blame)
    bringup_failures: int = 0
    quarantines: int = 0
    #: ``{magic queue: virtual seconds}`` when its lending was suspended (bring-up timeouts on
    #: blame.QUEUE_TIMEOUT_DEVICES devices: its definition is at fault); the reason is a warning
    suspended: dict = field(default_factory=dict)
    max_open_leases: dict = field(default_factory=dict)  # per magic queue
    #: seconds each magic queue starved: its jobs waited beyond its supply, below its
    #: max_devices (counting devices a yield drains for it), while another magic queue had
    #: idle VMs on an active lease with open admission on a device it may use
    #: (sim_starve.SimStarvation._starved)
    starved: dict = field(default_factory=dict)
    reconciles: int = 0
    virtual_seconds: float = 0.0
    outcomes: dict = field(default_factory=dict)  # job id -> done|cancelled|unfinished
    #: why jobs could never run (unknown queue; a magic queue no device can ever serve), one line
    #: per queue; the replay ended with those jobs unfinished.
    warnings: list = field(default_factory=list)

    #: for --plot (not in to_dict): ``(t, {queue|"home": waiting jobs}, devices lent)`` points
    #: when a value changed, and ``(start t, wait s, queue|"home")`` of every started job
    series: list = field(default_factory=list)
    started: list = field(default_factory=list)

    def to_dict(self, with_outcomes: bool = False) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k not in ("outcomes", "series", "started")}
        if with_outcomes:
            d["outcomes"] = dict(self.outcomes)
        return d


def busy_share(r: "Result") -> float | None:
    """Busy GPU-hours / lent GPU-hours (None when nothing was lent)."""
    return r.gpu_hours_busy / r.gpu_hours_lent if r.gpu_hours_lent > 0 else None


def _waits(values: list[float]) -> dict:
    if not values:
        return {"n": 0, "mean": None, "p50": None, "p95": None, "max": None}
    if len(values) == 1:
        v = values[0]
        return {"n": 1, "mean": v, "p50": v, "p95": v, "max": v}
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"n": len(values), "mean": statistics.fmean(values), "p50": q[49], "p95": q[94],
            "max": max(values)}


def _d(seconds) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.0f}s"
    return format_duration(round(seconds / 60.0) * 60.0)  # minutes are enough here


def render_table(results: list[Result]) -> str:
    """Metrics as rows, one column per policy set."""
    def waits(r, cls):
        w = r.wait.get(cls) or {}
        return f"{_d(w.get('mean'))} / {_d(w.get('p50'))} / {_d(w.get('p95'))}"

    def qwaits(r, q):
        w = r.wait_by_queue.get(q) or {}
        return f"{_d(w.get('mean'))} / {_d(w.get('p50'))} / {_d(w.get('p95'))}"

    def gpuh(d: dict) -> str:
        return ",".join(f"{k}={v:.0f}" for k, v in sorted(d.items())) or "-"

    queues = sorted({q for r in results for q in r.wait_by_queue})
    rows = [
        ("jobs done (magic/home)", lambda r: f"{r.done['magic']}/{r.done['home']}"),
        ("jobs cancelled", lambda r: f"{r.cancelled['magic']}/{r.cancelled['home']}"),
        ("jobs unfinished", lambda r: f"{r.unfinished['magic']}/{r.unfinished['home']}"),
        ("magic wait mean/p50/p95", lambda r: waits(r, "magic")),
        ("home wait mean/p50/p95", lambda r: waits(r, "home")),
        *[(f"{q} wait mean/p50/p95", lambda r, q=q: qwaits(r, q)) for q in queues],
        ("device-hours lent", lambda r: f"{r.device_hours_lent:.1f}"),
        ("device-hours idle while lent", lambda r: f"{r.device_hours_idle_lent:.1f}"),
        ("VM-hours busy", lambda r: f"{r.vm_hours_busy:.1f}"),
        ("GPU-hours lent", lambda r: f"{r.gpu_hours_lent:.1f}"),
        ("GPU-hours busy/idle", lambda r: f"{r.gpu_hours_busy:.1f} / "
                                          f"{r.gpu_hours_lent - r.gpu_hours_busy:.1f}"
                                          + (f" ({busy_share(r):.0%} busy)" if busy_share(r) is not None else "")),
        ("lends", lambda r: str(r.lends)),
        ("bring-ups", lambda r: str(r.bringups)),
        ("reclaims", lambda r: str(r.reclaims)),
        ("forced cancels", lambda r: str(r.forced_cancels)),
        ("bring-up failures", lambda r: str(r.bringup_failures)),
        ("quarantines", lambda r: str(r.quarantines)),
        ("queues suspended", lambda r: ",".join(
            f"{q}@{format_duration(t)}" for q, t in sorted(r.suspended.items())) or "-"),
        ("starved (waiting, sharer idle)", lambda r: ",".join(
            f"{q}={_d(s) if s else '0'}" for q, s in sorted(r.starved.items())) or "-"),
        ("max open leases", lambda r: ",".join(f"{q}={n}" for q, n in sorted(r.max_open_leases.items())) or "-"),
        ("GPU-hours borrowed by home pool", lambda r: gpuh(r.borrowed_by_home)),
        ("GPU-hours borrowed by queue", lambda r: gpuh(r.borrowed_by_queue)),
        ("virtual time", lambda r: format_duration(r.virtual_seconds)),
    ]
    header = ["policy"] + [r.label for r in results]
    body = [[name] + [fn(r) for r in results] for name, fn in rows]
    widths = [max(len(row[i]) for row in [header] + body) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header] + body]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
