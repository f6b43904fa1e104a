"""Fairness accounting: GPU-hours each magic queue borrowed from each home pool.

A lease borrows its device's GPUs from the device's owners from the claim (``created_at``) to
its close (``returned`` or ``failed``: the ``at`` of the lease's last history entry, else
``updated_at``). The amount is counted once, when the lease closes
(:meth:`testflinger_magic.leases.LeaseStore.close`, after its compare-and-set):

* into ``magic_fairness`` (one document per ``(queue, home_pool)``, ``$inc`` of ``gpu_hours``:
  cluster-wide totals, shown by ``GET /v1/magic/status`` under ``borrowed``);
* into the Prometheus counter ``magic_gpu_hours_borrowed_total{queue, home_pool}`` of the
  replica that closed it (server/metrics.py).

A home pool is a device's home queues sorted and joined by ``+`` (``-`` for none), as
``simulate`` names it (lab/sim_results.home_pool). A crash between the lease's close and the
``$inc`` loses that lease's hours from the totals (the close itself is never undone).
"""

from __future__ import annotations

from typing import Any

COLLECTION = "magic_fairness"


def home_pool(home_queues) -> str:
    """``["b", "a"]`` -> ``"a+b"``; no home queue -> ``"-"``."""
    return "+".join(sorted(home_queues or ())) or "-"


def borrowed(lease: dict, device: dict | None) -> tuple[str, str, float]:
    """``(queue, home_pool, gpu_hours)`` of a closed ``lease`` document; ``device`` is its
    ``magic_devices`` document (None if deregistered: then the GPUs its VMs were planned to use,
    ``spec.gpus_per_vm`` x VMs, and home pool ``-``). Hours are from ``created_at`` to the close
    time (seconds / 3600, never negative)."""
    history = lease.get("history") or []
    closed = history[-1].get("at") if history else None
    if closed is None:
        closed = lease.get("updated_at")
    hours = max(0.0, float(closed or 0) - float(lease.get("created_at") or 0)) / 3600.0
    if device is not None and device.get("gpus") is not None:
        gpus = int(device["gpus"])
        pool = home_pool(device.get("home_queues"))
    else:
        gpus = int((lease.get("spec") or {}).get("gpus_per_vm") or 0) * len(lease.get("vms") or [])
        pool = home_pool(())
    return lease.get("queue", ""), pool, hours * gpus


def record(db, lease: dict) -> tuple[str, str, float]:
    """Add a closed ``lease``'s borrowed GPU-hours to ``magic_fairness`` (one read of its
    device, one ``$inc`` upsert). Returns what :func:`borrowed` computed."""
    device = db["magic_devices"].find_one({"_id": lease.get("device")}, {"gpus": 1, "home_queues": 1})
    queue, pool, hours = borrowed(lease, device)
    db[COLLECTION].update_one({"_id": f"{queue}|{pool}"},
                              {"$set": {"queue": queue, "home_pool": pool},
                               "$inc": {"gpu_hours": hours, "leases": 1}}, upsert=True)
    return queue, pool, hours


def totals(db) -> list[dict[str, Any]]:
    """``[{queue, home_pool, gpu_hours, leases}]`` from ``magic_fairness``, sorted (one query)."""
    return [{"queue": d.get("queue"), "home_pool": d.get("home_pool"),
             "gpu_hours": round(float(d.get("gpu_hours") or 0.0), 3), "leases": d.get("leases", 0)}
            for d in db[COLLECTION].find({}, sort=[("_id", 1)])]
