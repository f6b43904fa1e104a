"""What ``status`` adds for the people reading it (pure): the leases that ended ``failed`` yet
still hold their device, the leases of stale agent hosts, and the home queues whose jobs wait
because their devices are lent. Engine.status (server/engine.py) reads the documents and calls
these; the CLI (cli_output.py) words them under NEEDS A PERSON and WHY JOBS WAIT.

Found by a fresh user's trial (TRIAL 2026-12-02, findings 3, 11 and 17): a failed lease was
visible only in ``leases --all``; a dead daemon's leases filled ``max_devices`` with nothing
said; a home-queue job waiting for its lent devices showed no reason and no hint of the coming
reclaim.
"""

from __future__ import annotations

from testflinger_magic import lease_states as L


def failed_leases(docs: list[dict], devices: list[dict]) -> list[dict]:
    """``[{lease_id, device, queue, agent_host, error, failed_at, quarantined}]``, oldest
    first: the ``failed`` lease documents ``docs`` (those still holding their device's claim,
    reconcile's ``Inputs.leases``) with their device (``magic_devices`` documents
    ``devices``). ``error``: the bring-up or restore error that led there (the lease's
    ``error``, else its last history reason); ``failed_at``: epoch seconds of the close."""
    quarantined = {d.get("_id", d.get("name")): bool(d.get("quarantined")) for d in devices}
    out = []
    for doc in sorted(docs, key=lambda d: (d.get("updated_at") or 0, d["_id"])):
        if doc.get("state") != L.FAILED:
            continue
        history = doc.get("history") or []
        last = history[-1].get("reason") if history else None
        out.append({"lease_id": doc["_id"], "device": doc.get("device"),
                    "queue": doc.get("queue"), "agent_host": doc.get("agent_host"),
                    "error": last if last and last != L.FAILED else doc.get("error"),
                    "first_error": doc.get("error"),
                    "failed_at": doc.get("updated_at"),
                    "quarantined": quarantined.get(doc.get("device"), False)})
    return out


def with_host_leases(stale_hosts: list[dict], leases: list[dict],
                     hosts: dict[str, dict] | None = None) -> list[dict]:
    """``stale_hosts`` (``Engine.alerts()["stale_agent_hosts"]`` entries) each with
    ``leases``: ``[{lease_id, device, queue, state}]`` of ``leases`` (open or failed lease
    documents) whose ``agent_host`` it is, and ``registered``: False for a host bound
    (``agent-hosts bind``) that never registered (``hosts``: ``magic_agent_hosts`` documents
    by name; no ``registered_at``)."""
    by_host: dict[str, list[dict]] = {}
    for doc in leases:
        by_host.setdefault(doc.get("agent_host") or "", []).append(
            {"lease_id": doc["_id"], "device": doc.get("device"), "queue": doc.get("queue"),
             "state": doc.get("state")})
    hosts = hosts or {}
    return [dict(h, leases=by_host.get(h["name"], []),
                 registered=bool((hosts.get(h["name"]) or {}).get("registered_at",
                                                                  h.get("last_heartbeat"))))
            for h in stale_hosts]


def home_waits(inputs, defs: dict) -> list[dict]:
    """The home queues with jobs waiting while some of their devices are held by a lease:
    ``[{queue, waiting, oldest_age, lent: [{device, lease_id, queue, state, owner_wait,
    reclaim_in, reclaimed, agent_host, agent_host_stale_for}]}]``, by queue name. ``inputs``:
    reconcile.Inputs (its ``demand`` counts the home queues too; ``leases`` the open and
    failed ones; ``stale_hosts`` the silent agent hosts); ``defs``: magic queue definitions by
    name. ``owner_wait``: the lending queue's ``reclaim.owner_wait`` (seconds, None if the
    queue is gone). ``reclaimed``: for an ``active`` lease, whether the owner reclaim takes it
    (one device per waiting job, less those on their way back, idlest first:
    reconcile.owner_reclaim_outlook, the rule reconcile.plan_reclaims applies; TRIAL2 finding
    3), else None; ``reclaim_in``: for one it takes, seconds until the owner's oldest job has
    waited owner_wait (0: due now; the reconciler drains the lease at its next tick), else
    None (a lease that stays lent, one not ``active``: a failed lease is never reclaimed, it
    needs a person; one draining or restoring is already on its way). ``agent_host_stale_for``:
    when the device's agent host is stale (no heartbeat, reconcile.Inputs.stale_hosts), the
    seconds it has been silent (``-1`` if it never sent one), else None: nobody works the
    lease, so the device comes back only once its daemon runs again (TRIAL2 finding 2)."""
    from testflinger_magic import reconcile  # noqa: PLC0415 (the planner is big)

    holding: dict[str, object] = {}
    for lease in inputs.leases:
        if lease.state in L.OPEN_STATES or lease.state == L.FAILED:
            holding[lease.device] = lease
    out = []
    homes = sorted({h for d in inputs.devices for h in d.home_queues})
    outlook = None
    stale = getattr(inputs, "stale_hosts", None) or {}
    for h in homes:
        demand = inputs.demand.get(h)
        if demand is None or demand.waiting <= 0:
            continue
        if outlook is None:
            outlook = reconcile.owner_reclaim_outlook(inputs)
        taken = set(outlook.get(h, ()))
        lent = []
        for d in inputs.devices:
            lease = holding.get(d.name)
            if h not in d.home_queues or lease is None:
                continue
            q = defs.get(lease.queue)
            owner_wait = q.policy.reclaim.owner_wait if q is not None else None
            active = lease.state == L.ACTIVE
            reclaimed = (lease.id in taken) if active else None
            reclaim_in = (max(0.0, owner_wait - demand.oldest_age)
                          if owner_wait is not None and reclaimed else None)
            silent = stale[d.agent_host] if d.agent_host in stale else False
            lent.append({"device": d.name, "lease_id": lease.id, "queue": lease.queue,
                         "state": lease.state, "owner_wait": owner_wait,
                         "reclaim_in": reclaim_in, "reclaimed": reclaimed,
                         "agent_host": d.agent_host,
                         "agent_host_stale_for": (None if silent is False else
                                                  -1 if silent is None else silent)})
        if lent:
            out.append({"queue": h, "waiting": demand.waiting,
                        "oldest_age": demand.oldest_age, "lent": lent})
    return out
