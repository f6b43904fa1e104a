"""The VM agents of a magic queue's draining or restoring leases, as ``GET /v1/queues/<magic
queue>/agents`` (testflinger-cli's preflight and ``queue-status``, TESTFLINGER.md §4.2) shows
them.

Such a lease's VM agents are fenced (the dispatch hook answers their polls 204): none takes a
new job. Their own documents still said ``waiting``, so ``queue-status`` counted them Available
while the queue's job waited for another machine, and the preflight passed on a queue nothing
could serve (TRIAL16 F2). The answer keeps Testflinger's ``AgentOut`` fields
(dispatch.AGENT_OUT_FIELDS) and changes only ``state`` and ``comment`` of an idle one:
``offline`` (queue-status counts it Offline; the CLI's online check skips it), the comment
naming the lease. A busy one keeps its state (queue-status counts it Busy: its job runs on).
No read: the caller passes the queue's open leases (one read it makes anyway).
"""

from __future__ import annotations

from testflinger_magic import lease_states as L
from testflinger_magic import tfstates

#: Lease states whose VM agents may have documents but take no new job (bring-up leases have
#: no VM agent running yet; an ``active`` one's admission pause is lifted by demand).
FENCED_STATES = frozenset({L.DRAINING, L.RESTORING})


def fenced_vm_agents(leases: list[dict]) -> dict[str, dict]:
    """``{VM agent name: lease document}`` of those of ``leases`` (open lease documents of one
    queue, with ``_id``, ``state`` and ``vms[].agent_name``) in :data:`FENCED_STATES`."""
    return {vm.get("agent_name"): lease for lease in leases
            if lease.get("state") in FENCED_STATES for vm in lease.get("vms") or []}


def annotate(agents: list[dict], fenced: dict[str, dict]) -> list[dict]:
    """``agents`` (AgentOut dicts) with the idle ones named in ``fenced``
    (:func:`fenced_vm_agents`) answered ``offline`` with a comment naming their lease. Pure;
    new dicts for the changed ones."""
    out = []
    for agent in agents:
        lease = fenced.get(agent.get("name"))
        if lease is None or agent.get("job_id") or agent.get("state") not in (
                tfstates.AGENT_WAITING, None, ""):
            out.append(agent)
            continue
        agent = dict(agent, state=tfstates.AGENT_OFFLINE)
        agent["comment"] = (f"testflinger-magic: lease {lease.get('_id')} is "
                            f"{lease.get('state')}: this VM agent takes no new job")
        out.append(agent)
    return out


def serving(agents: list[dict], fenced: dict[str, dict]) -> bool:
    """True if an agent of ``agents`` (as answered) may take a new job of the queue: not
    ``offline`` and not a VM agent of a fenced lease (a busy one of those finishes its job and
    takes no other)."""
    return any(a.get("state") != tfstates.AGENT_OFFLINE and a.get("name") not in fenced
               for a in agents)
