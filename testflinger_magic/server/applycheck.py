"""What ``apply`` checks and says about definitions against what the server knows (pure).

:mod:`testflinger_magic.queues` validates a definition file alone; this module judges it against
the registered devices (``magic_devices``) and the open leases, which only the server knows:

* :func:`name_clashes`: a magic queue named like a registered device's agent or one of its home
  queues is refused (the device agent would take the magic queue's jobs on bare metal, and the
  home queue's jobs would count as magic demand); :func:`device_clashes` is the same rule seen
  from a registration (both live in testflinger_magic.queue_clashes, which ``simulate`` uses
  too, and are re-exported here);
* :func:`warnings`: queues that no registered device can serve (the preflight's 404 reason,
  :func:`.devicecount.no_match_reason`, one definition);
* :func:`draining`: what happens to the open leases of the queues an apply removes.
* :func:`undraining`: the removed-queue drains an apply of their queue undoes.
"""

from __future__ import annotations

from testflinger_magic.durations import format_duration
from testflinger_magic.lease_states import ACTIVE, BRINGUP_STATES, DRAINING, RESTORING
from testflinger_magic.queue_clashes import device_clashes, name_clashes  # noqa: F401
from testflinger_magic.reconcile_model import ORPHAN_GRACE

from . import devicecount


def warnings(definitions, devices: list[dict]) -> list[dict]:
    """``[{queue, message}]``: each queue of ``definitions`` (MagicQueue) that no registered
    device can serve now, with the reason testflinger-cli's preflight would print
    (:func:`.devicecount.no_match_reason`); a submission to it is refused until one registers."""
    out = []
    for q in definitions:
        why = devicecount.no_match_reason(q, devices)
        if why is not None:
            out.append({"queue": q.name, "message": f"{why}: nothing can serve it, and "
                        "testflinger-cli refuses submissions to it (404) until a device that "
                        "fits registers"})
    return out


def undraining(leases: list[dict]) -> list[dict]:
    """``[{queue, lease_id, device, state, message}]`` for those of ``leases`` (lease documents
    of the queues an apply defines) that drain because their queue was removed (drain kind
    ``orphan``) and were not forced: the next tick undoes that drain (reconcile's
    ``Lifecycle.lifecycle``, TRIAL16 F1)."""
    out = []
    for x in leases:
        drain = x.get("drain") or {}
        if x.get("state") != DRAINING or drain.get("kind") != "orphan" or drain.get("forced") \
                or drain.get("forced_at") is not None:
            continue
        out.append({"queue": x.get("queue"), "lease_id": x.get("_id"), "device": x.get("device"),
                    "state": x.get("state"),
                    "message": "its removed-queue drain is undone at the next tick: its jobs "
                               "keep running and its idle VM agents take jobs again"})
    return out


def draining(leases: list[dict]) -> list[dict]:
    """``[{queue, lease_id, device, state, grace, message}]`` for the open ``leases`` (lease
    documents) of removed queues: what the next ticks do with each (reconcile's ``orphan``
    rule: an active lease drains with ``ORPHAN_GRACE``, not its queue's own ``reclaim.grace``,
    then its still-running jobs are cancelled; a bring-up is stopped at the next tick and the
    device given back, no failure counted; a draining or restoring lease goes on). ``grace``: seconds, or None."""
    out = []
    grace_text = format_duration(ORPHAN_GRACE)
    for x in leases:
        state = x.get("state")
        grace = None
        drain = x.get("drain") or {}
        if state == ACTIVE or (state == DRAINING and drain.get("kind") == "orphan"):
            grace = ORPHAN_GRACE
            what = (f"drains: running jobs get {grace_text} (the removed-queue grace), then are "
                    "cancelled; the device is given back once its VMs are idle")
        elif state == DRAINING:
            try:
                grace = float(drain["grace_until"]) - float(drain["requested_at"])
                what = (f"already draining ({drain.get('kind') or 'operator'} drain, grace "
                        f"{format_duration(max(grace, 0.0))})")
            except (KeyError, TypeError, ValueError):
                what = "already draining"
        elif state in BRINGUP_STATES:
            grace = 0.0
            what = ("bring-up stopped at the next tick, the device given back (no failure "
                    "counted): no job can reach it (new submissions are refused)")
        elif state == RESTORING:
            what = "being given back"
        else:
            what = state or "unknown"
        out.append({"queue": x.get("queue"), "lease_id": x.get("_id"), "device": x.get("device"),
                    "state": state, "grace": grace, "message": what})
    return out


#: Definition fields a lease copies at its claim and goes by until it is returned
#: (LeaseStore._insert_lease: ``spec``, and of ``timeouts`` the bring-up deadline), as dotted
#: paths of the stored definition document, each with where the lease keeps its copy (a path of
#: the lease document): a changed value reaches only leases claimed after the apply.
#: (``max_lease`` and the reclaim grace of reconcile's drains are read from the definition at
#: each tick: they apply at once.) ``vms_per_device``: a lease's VMs are made at its claim
#: (``MagicQueue.vms_for``, its ``vms`` list), so their number stays too.
BAKED = {"vms_per_device": None, "vm.vcpus": "spec.vcpus", "vm.memory_mib": "spec.memory_mib",
         "vm.disk_gib": "spec.disk_gib", "vm.gpus": "spec.gpus_per_vm",
         "vm.firmware": "spec.firmware", "vm.mmio64_mib": "spec.mmio64_mib",
         "vm_host_series": "spec.series", "agent_template": "spec.template",
         "provision_type": "spec.provision_type",
         "policy.provision_timeout": "timeouts.provision_timeout"}
BAKED_FIELDS = tuple(BAKED)
_MISSING = object()


def _at(doc: dict, path: str, default=None):
    for part in path.split("."):
        if not isinstance(doc, dict) or part not in doc:
            return default
        doc = doc[part]
    return doc


def _kept(lease: dict, field: str, old: dict, new: dict, q, device: dict | None) -> bool:
    """Whether ``lease`` goes by another value of definition ``field`` than the new definition
    (``new`` document, ``q`` its MagicQueue or None): its own copy (:data:`BAKED`), or, where
    it has none (a lease claimed by an older version, or the VM count of a device not
    registered any more), the old definition's value (``old``), which it was claimed with."""
    if field == "vms_per_device":
        if q is not None and device is not None:
            return len(lease.get("vms") or []) != q.vms_for(int(device.get("gpus") or 0))
        return _at(old, field) != _at(new, field)
    copy = _at(lease, BAKED[field], _MISSING)
    if copy is _MISSING:
        return _at(old, field) != _at(new, field)
    return copy != _at(new, field)


def keeping_old(changed: dict[str, tuple[dict, dict]], leases: list[dict],
                definitions=(), devices: list[dict] | None = None) -> list[dict]:
    """The open leases of queues whose definition changed that keep what they copied from an
    earlier one: ``changed`` is ``{queue: (old stored document, new document)}``; ``leases``
    the open lease documents. ``[{queue, fields: [dotted names], leases: [{lease_id, device,
    state, keeps: [dotted names]}], deselected: [lease ids], over_max_devices: int or None}]``
    for each such queue with open leases, by queue name. Pure.

    ``keeps``: the :data:`BAKED_FIELDS` whose value the lease copied at its claim differs from
    the new definition's (its own copy, not the old definition: a revert to the values a lease
    was claimed with is nothing to drain for, TRIAL9 F6); ``fields``: those of all its leases.
    A changed ``vm`` or timeout applies to the leases claimed after the apply; these keep the
    old ones until they are returned (an operator drains them to apply it now).
    ``deselected``: with ``definitions`` (the applied MagicQueues) and ``devices``
    (``magic_devices`` documents), the leases whose device the new ``devices`` selection no
    longer picks (``MagicQueue.selects``): they keep serving the queue until drained (TRIAL5: a
    device added to ``devices.exclude`` kept taking jobs). ``over_max_devices``: the new
    ``policy.max_devices`` when the queue holds more open leases than that (reconcile lends it
    nothing more, and drains none for it: the extra leases return by the idle rule, or an
    operator drains them; TRIAL9 F4), else None."""
    by_name = {q.name: q for q in definitions}
    docs = {d.get("_id"): d for d in devices or ()}
    out = []
    for queue in sorted(changed):
        old, new = changed[queue]
        q = by_name.get(queue)
        held = []
        for x in leases:
            if x.get("queue") != queue:
                continue
            keeps = [f for f in BAKED_FIELDS
                     if _kept(x, f, old, new, q, docs.get(x.get("device")))]
            held.append({"lease_id": x["_id"], "device": x.get("device"),
                         "state": x.get("state"), "keeps": keeps})
        fields = [f for f in BAKED_FIELDS if any(f in h["keeps"] for h in held)]
        gone = sorted(h["lease_id"] for h in held if q is not None and h["device"] in docs
                      and not q.selects(docs[h["device"]]))
        over = q.policy.max_devices if q is not None and len(held) > q.policy.max_devices \
            else None
        if held and (fields or gone or over is not None):
            out.append({"queue": queue, "fields": fields,
                        "leases": sorted(held, key=lambda h: h["lease_id"]),
                        "deselected": gone, "over_max_devices": over})
    return out
