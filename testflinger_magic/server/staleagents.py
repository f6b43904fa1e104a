"""The VM agents of a stale agent host's leases, as ``GET /v1/queues/<magic queue>/agents``
(testflinger-cli's preflight and ``queue-status``, TESTFLINGER.md §4.2) shows them.

With the daemon dead (no heartbeat for ``reconcile.STALE_HOST_AFTER``), the VM agent documents
of its leases still said ``waiting``: ``queue-status`` counted them Available while nothing
could serve (TRIAL 2026-12-02 finding 11). The answer keeps Testflinger's ``AgentOut`` fields
(dispatch.AGENT_OUT_FIELDS) and changes only ``state`` and ``comment``:

* a VM agent of a lease that is not ``active`` (bring-up, draining, restoring) and has no job is
  answered ``offline`` (queue-status counts Offline; the CLI's online check skips it, §4.2):
  its lease is fenced and no daemon works it;
* one of an ``active`` lease keeps its state (it runs under supervisord, not the daemon, and
  may still take jobs), with the note in its comment.

One read of the agent hosts' heartbeats per preflight (shared with the capacity entry), and one
of the queue's leases on stale hosts only when there is a stale host.
"""

from __future__ import annotations

from testflinger_magic import lease_states as L
from testflinger_magic import tfstates
from testflinger_magic.durations import format_duration


def stale_heartbeats(plugin, hosts: list[dict] | None = None) -> dict[str, float | None]:
    """``{agent host: seconds since its last heartbeat (None: never)}`` of the hosts stale now
    (``reconcile.stale_hosts``). ``hosts``: ``magic_agent_hosts`` documents already read
    (``_id``, ``last_heartbeat``), else one read of them."""
    from testflinger_magic import reconcile as R  # noqa: PLC0415

    now = plugin.engine.clock()
    if hosts is None:
        hosts = plugin.db.magic_agent_hosts.find({}, {"last_heartbeat": 1})
    beats = {h["_id"]: h.get("last_heartbeat") for h in hosts}
    return {h: (None if beats[h] is None else now - beats[h])
            for h in R.stale_hosts(beats, now)}


def annotate(agents: list[dict], leases: list[dict], stale: dict[str, float | None]) -> list[dict]:
    """``agents`` (AgentOut dicts) with those of ``leases`` (open lease documents: ``_id``,
    ``state``, ``agent_host``, ``vms[].agent_name``) whose agent host is in ``stale`` (as
    :func:`stale_heartbeats`) answered as the module docstring says. Pure; new dicts."""
    owner = {vm.get("agent_name"): lease for lease in leases
             if lease.get("agent_host") in stale for vm in lease.get("vms") or []}
    out = []
    for agent in agents:
        lease = owner.get(agent.get("name"))
        if lease is None:
            out.append(agent)
            continue
        host, silent = lease["agent_host"], stale[lease["agent_host"]]
        since = "yet" if silent is None else f"for {format_duration(silent)}"
        note = (f"agent host {host} is stale (no heartbeat {since}); lease {lease['_id']} "
                f"{lease.get('state')}")
        agent = dict(agent)
        if lease.get("state") != L.ACTIVE and not agent.get("job_id"):
            agent["state"] = tfstates.AGENT_OFFLINE
            agent["comment"] = f"{note}: takes no job until the host is back"
        else:
            agent["comment"] = f"{note}; {agent.get('comment') or 'may still run jobs'}"
        out.append(agent)
    return out


def answer(plugin, queue: str, agents: list[dict], stale: dict[str, float | None]) -> list[dict]:
    """:func:`annotate` ``agents`` of ``queue`` with its open leases on the ``stale`` hosts
    (one read of ``magic_leases``, only when a host is stale and an agent is listed)."""
    if not stale or not agents:
        return agents
    leases = list(plugin.db.magic_leases.find(
        {"queue": queue, "agent_host": {"$in": sorted(stale)},
         "state": {"$in": sorted(L.OPEN_STATES)}},
        {"state": 1, "agent_host": 1, "vms.agent_name": 1}))
    return annotate(agents, leases, stale)
