"""One definition of a "lendable" device, shared by ``status`` (``devices_lendable``) and the
preflight entry testflinger-cli sees (``GET /v1/queues/<q>/agents``: ``magic:<queue>``'s
comment), so the two never count differently.

A registered device (a ``magic_devices`` document) is *eligible* for a queue when the queue's
definition matches it (selection and GPUs per VM, ``MagicQueue.matches``); *lendable* when it is
eligible, not quarantined, not held by a lease (``lease_id`` set: an open or failed lease
keeps the claim), its agent host is not stale (no heartbeat for
``reconcile.STALE_HOST_AFTER``: ``reconcile.plan`` lends none of its devices, "on stale host")
nor says MAAS does not answer it (its heartbeat's ``maas_unreachable_since``:
``Inputs.maas_down_hosts``, "MAAS unreachable": a deploy could not even start) and its own agent is not busy at home (not ``waiting``, or a job: reconcile's "busy", which it
does not lend; TRIAL8: counted lendable, the capacity entry said Available);
*usable* when eligible and not quarantined (a held device, or one of a stale host, still gives
the queue capacity later: jobs wait for it, or for the host's next heartbeat).
"""

from __future__ import annotations

from collections.abc import Collection

from testflinger_magic import fabric
from testflinger_magic.reconcile_model import _plural
from testflinger_magic.reconcile_model import busy_at_home as _busy

from .maasbackoff import held_back


def is_lendable(device: dict, stale_hosts: Collection[str] = ()) -> bool:
    """True for a device document that is neither quarantined nor held by a lease nor on an
    agent host in ``stale_hosts`` (names, :func:`testflinger_magic.reconcile.stale_hosts`);
    eligibility for a queue is the caller's :func:`count`."""
    return (not device.get("quarantined") and not device.get("lease_id")
            and device.get("agent_host") not in stale_hosts)


def count(definition, devices: list[dict], stale_hosts: Collection[str] = (),
          busy: Collection[str] = (), maas_down: Collection[str] = (),
          now: float | None = None) -> dict:
    """``{"eligible", "quarantined", "held", "stale", "maas_down", "held_back", "busy",
    "lendable", "usable"}`` counts of ``devices`` (``magic_devices`` documents with their
    ``lease_id``) for
    ``definition`` (a :class:`~testflinger_magic.queues.MagicQueue`); ``stale_hosts``: the names
    of the agent hosts that are stale now (:func:`testflinger_magic.reconcile.stale_hosts`);
    ``maas_down``: the names of the agent hosts whose daemon says MAAS does not answer
    (``Inputs.maas_down_hosts``); ``busy``: the names of the devices whose own agent is busy at
    home (:func:`busy_at_home`); ``now`` (epoch seconds; None: none counted): ``held_back``
    counts the devices held back after MAAS refused them (:func:`.maasbackoff.held_back`).
    Each eligible device counts once, first of quarantined, held, stale, maas_down, held_back,
    busy (reconcile's order: ``_Planner.unlendable``); also ``"usable_docs"``: the eligible
    devices that are not quarantined."""
    eligible = [d for d in devices if definition.matches(d)]
    usable = [d for d in eligible if not d.get("quarantined")]
    held = sum(1 for d in usable if d.get("lease_id"))
    free = [d for d in usable if not d.get("lease_id")]
    stale = sum(1 for d in free if d.get("agent_host") in stale_hosts)
    live = [d for d in free if d.get("agent_host") not in stale_hosts]
    down = sum(1 for d in live if d.get("agent_host") in maas_down)
    up = [d for d in live if d.get("agent_host") not in maas_down]
    back = [d for d in up if now is not None and held_back(d, now)]
    working = sum(1 for d in up if d["_id"] in busy) - sum(1 for d in back if d["_id"] in busy)
    return {"eligible": len(eligible), "quarantined": len(eligible) - len(usable),
            "held": held, "stale": stale, "maas_down": down, "held_back": len(back),
            "busy": working,
            "lendable": len(usable) - held - stale - down - len(back) - working,
            "usable": len(usable), "usable_docs": usable}


def busy_at_home(names, agents: dict[str, dict]) -> set[str]:
    """Those of ``names`` (devices) whose own agent is busy at home
    (:func:`testflinger_magic.reconcile_model.busy_at_home`; no agent document: never posted).
    ``agents``: ``{name: Testflinger agents document}`` (``state``, ``job_id``)."""
    return {n for n in names
            if _busy((agents.get(n) or {}).get("state"), (agents.get(n) or {}).get("job_id"))}


def no_match_reason(definition, devices: list[dict], operator: bool = True) -> str | None:
    """Why no registered device can serve ``definition`` (a
    :class:`~testflinger_magic.queues.MagicQueue`), or None if one matches it
    (``MagicQueue.matches``; quarantine, claims and stale hosts aside). ``devices``: the
    ``magic_devices`` documents. The limiting fact, as reconcile._Planner.no_match_detail words
    it: none registered; the selection picks none; the devices it picks that have GPUs enough
    are NVSwitch devices its VMs of several GPUs are refused on
    (:func:`testflinger_magic.fabric.refuses`: named, with the operator's choices, for an
    ``operator``; said without an operator's step for a test engineer, ``operator=False``); or
    the devices it picks have too few GPUs for one VM. One definition for the preflight's 404
    (server/dispatch.py ``capacity``, ``operator=False``) and ``apply``'s warnings
    (server/applycheck.py)."""
    if not devices:
        return "no agent host has registered any device yet"
    if any(definition.matches(d) for d in devices):
        return None
    picked = [d for d in devices if definition.selects(d)]
    refused = [d for d in picked if definition.vms_for(int(d.get("gpus") or 0)) >= 1
               and fabric.refuses(definition.vm.gpus, d)]
    if refused:
        return (fabric.blocked_text(definition.vm.gpus, refused) if operator
                else fabric.user_text(definition.vm.gpus, len(refused)))
    if picked:
        largest = max(int(d.get("gpus") or 0) for d in picked)
        return (f"needs {_plural(definition.vm.gpus, 'GPU')} per VM; the largest of the "
                f"{_plural(len(picked), 'device')} its devices selection picks has {largest}")
    return (f"no registered device matches its devices selection "
            f"({_plural(len(devices), 'device')} registered)")
