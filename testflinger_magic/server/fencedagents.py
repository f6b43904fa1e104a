"""The VM agents of a magic queue's leases that take no new job, as ``GET /v1/queues/<queue>/
agents`` (testflinger-cli's preflight and ``queue-status``, TESTFLINGER.md §4.2) shows them.

Those are the VM agents of a lease that is

* ``draining`` or ``restoring`` (an operator's drain, an idle drain, or the ``orphan`` drain of
  a queue an apply removed): fenced (``magic_fences``);
* ``active`` but paused (``admission: paused``) because its device is quarantined
  (reconcile_lifecycle.hold_back_quarantined): their gates are ``paused``, and such a lease is
  not resumed for demand while its device stays quarantined. A lease paused to consolidate
  (device not quarantined) is left alone: demand resumes it (reconcile ``resume``).

Either way the dispatch hook answers their polls 204 (gates.Gates.admit). Their own documents
still said ``waiting``, so ``queue-status`` counted them Available while the queue's job waited
for another machine, and the preflight passed on a queue nothing could serve (TRIAL16 F2; F2
and F5 of the next trial: a removed queue's drain, a paused lease). The answer keeps
Testflinger's ``AgentOut`` fields (dispatch.AGENT_OUT_FIELDS) and changes only ``state`` and
``comment`` of an idle one: ``offline`` (queue-status counts it Offline; the CLI's online check
skips it), the comment naming the lease and why. A busy one keeps its state (queue-status
counts it Busy: its job runs on). Reads: the caller passes the queue's open leases (one read it
makes anyway, with ``admission``); :func:`quarantined_devices` reads the devices of its paused
leases, once, only when one is paused.
"""

from __future__ import annotations

from testflinger_magic import lease_states as L
from testflinger_magic import tfstates

#: Lease states whose VM agents may have documents but take no new job (bring-up leases have
#: no VM agent running yet).
FENCED_STATES = frozenset({L.DRAINING, L.RESTORING})


def _paused(lease: dict) -> bool:
    return lease.get("state") == L.ACTIVE and lease.get("admission") == "paused"


def quarantined_devices(db, leases: list[dict]) -> dict[str, str]:
    """``{device: quarantine reason ("" if none)}`` of the quarantined devices of the paused
    leases among ``leases`` (open lease documents with ``device``, ``state``, ``admission``).
    One read of ``magic_devices`` by ``_id``, only when a lease is paused; none otherwise."""
    devices = sorted({lease.get("device") for lease in leases if _paused(lease)} - {None})
    if not devices:
        return {}
    return {d["_id"]: d.get("quarantine_reason") or "" for d in db.magic_devices.find(
        {"_id": {"$in": devices}, "quarantined": True}, {"quarantine_reason": 1})}


def fenced_vm_agents(leases: list[dict],
                     quarantined: dict[str, str] | None = None) -> dict[str, str]:
    """``{VM agent name: why it takes no new job}`` of those of ``leases`` (open lease documents
    of one queue, with ``_id``, ``device``, ``state``, ``admission`` and ``vms[].agent_name``)
    in :data:`FENCED_STATES`, or paused with their device in ``quarantined``
    (:func:`quarantined_devices`). ``why`` reads "lease L is draining" or "lease L is paused
    (device D quarantined: reason)". Pure."""
    quarantined = quarantined or {}
    out: dict[str, str] = {}
    for lease in leases:
        device = lease.get("device")
        if lease.get("state") in FENCED_STATES:
            why = f"lease {lease.get('_id')} is {lease.get('state')}"
        elif _paused(lease) and device in quarantined:
            reason = quarantined[device]
            why = (f"lease {lease.get('_id')} is paused (device {device} quarantined"
                   f"{': ' + reason if reason else ''})")
        else:
            continue
        for vm in lease.get("vms") or []:
            out[vm.get("agent_name")] = why
    return out


def annotate(agents: list[dict], fenced: dict[str, str]) -> list[dict]:
    """``agents`` (AgentOut dicts) with the idle ones named in ``fenced``
    (:func:`fenced_vm_agents`) answered ``offline`` with a comment saying why. Pure; new dicts
    for the changed ones."""
    out = []
    for agent in agents:
        why = fenced.get(agent.get("name"))
        if why is None or agent.get("job_id") or agent.get("state") not in (
                tfstates.AGENT_WAITING, None, ""):
            out.append(agent)
            continue
        agent = dict(agent, state=tfstates.AGENT_OFFLINE)
        agent["comment"] = f"testflinger-magic: {why}: this VM agent takes no new job"
        out.append(agent)
    return out


def serving(agents: list[dict], fenced: dict[str, str]) -> bool:
    """True if an agent of ``agents`` (as answered) may take a new job of the queue: not
    ``offline`` and not a VM agent of a fenced lease (a busy one of those finishes its job and
    takes no other)."""
    return any(a.get("state") != tfstates.AGENT_OFFLINE and a.get("name") not in fenced
               for a in agents)
