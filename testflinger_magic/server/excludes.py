"""``exclude_agents`` on magic queues: which VM agents may run a job, at submit and in demand.

Testflinger's ``job_post`` (canonical/testflinger ``server/src/testflinger/api/v1.py``) refuses a
job with a non-empty ``exclude_agents`` when no agent document listing its queue
(``database.get_agents_on_queue``: every agent document whose ``queues`` holds it, whatever its
state) has a name outside that list: 422 "There are no agents on the specified queue that are
allowed to run this job". A magic queue has no agent document until a device is lent, so that
check alone refused every such job on an idle magic queue (TRIAL3 finding 13).

What counts on a magic queue (:func:`possible_agents`): the agent documents Testflinger counts,
plus the VM agents its usable devices will have when lent: ``<device>-vm1`` ..
``<device>-vm<N>``, N = ``MagicQueue.vms_for(gpus)`` (the names the claim gives them,
leases.py ``_insert_lease``), for every device the queue's selection matches that is not
quarantined, as the preflight's capacity entry counts them (server/dispatch.py
``capacity``: lent devices and a stale agent host's devices count, jobs wait for them).

- Some of those may run the job: it is accepted. Testflinger's own check must then agree, so for
  this one request (``request.environ[ALLOWED]``) its ``get_agents_on_queue`` also returns the
  future VM agents the job allows (:func:`install`: the function is wrapped, and adds nothing
  outside a ``POST /v1/job`` the hook marked). Dispatch then needs nothing more: Testflinger's
  ``pop_job`` never hands a job to an agent named in its ``exclude_agents``
  (``"job_data.exclude_agents": {"$nin": [agent_name]}``, ``database.pop_job``).
- None may: the job is refused before Testflinger's handler with Testflinger's 422 and message,
  plus which names were excluded, so that no lease is ever made for a job no VM can take.

In demand (server/jobreads.py, with :class:`PossibleVMs` and :func:`excluded_devices`): a
waiting job that excludes every VM agent lending can give its queue (its devices changed since
it was accepted) is not counted; the devices all of whose VMs every waiting job of the queue
excludes are ``QueueDemand.avoid``, which the planner neither lends nor counts as supply
(reconcile.py ``supply_of``, reconcile_eligibility.py ``candidates``). docs/api.md has the
user-visible rules and what is not done (no job-to-VM matching).
"""

from __future__ import annotations

import logging

from flask import has_request_context, request

from . import devicecount

log = logging.getLogger(__name__)

#: ``request.environ`` key: ``(queue, [future VM agent names the job allows])`` set by the
#: ``POST /v1/job`` hook for Testflinger's check in the same request.
ALLOWED = "testflinger_magic.exclude_allowed"

#: Testflinger's message (api/v1.py ``job_post``), kept word for word at the start of ours.
TF_MESSAGE = "There are no agents on the specified queue that are allowed to run this job"


def future_vms_by_device(definition, devices: list[dict]) -> dict[str, list[str]]:
    """``{device: [<device>-vm1 .. <device>-vm<N>]}``, N = ``definition.vms_for(gpus)``, for
    each ``devices`` document (``magic_devices`` shape: ``_id`` the device's agent name,
    ``gpus``) the definition matches and that is not quarantined (devicecount.count's
    ``usable_docs``); the names the claim gives the VM agents (leases.py ``_insert_lease``)."""
    usable = devicecount.count(definition, devices)["usable_docs"]
    out = {}
    for name, gpus in sorted((d.get("_id", d.get("name")), d.get("gpus")) for d in usable):
        out[name] = [f"{name}-vm{i + 1}" for i in range(definition.vms_for(int(gpus or 0)))]
    return out


def future_vm_names(definition, devices: list[dict]) -> list[str]:
    """The names of :func:`future_vms_by_device`, sorted by device then index."""
    return [n for names in future_vms_by_device(definition, devices).values() for n in names]


def _device_doc(d) -> dict:
    """A ``magic_devices``-shaped dict of ``d``: such a document, or a ``reconcile.DeviceView``."""
    if isinstance(d, dict):
        return d
    return {"_id": d.name, "gpus": d.gpus, "tags": list(d.tags),
            "home_queues": list(d.home_queues), "quarantined": d.quarantined}


class PossibleVMs:
    """``{magic queue: {device: the VM agent names lending that device gives the queue}}``,
    worked out per queue only when asked (``possible[queue]``, cached): the tick asks only for
    the queues with a waiting job that has ``exclude_agents``, so the usual tick pays nothing.
    ``definitions``: ``MagicQueue``; ``devices``: ``magic_devices`` documents or
    ``reconcile.DeviceView`` (:func:`future_vms_by_device`); ``lent``: ``(queue, device, VM
    agent names)`` of the open leases (a lease's VMs count even if its device is quarantined
    since). Pure (no I/O)."""

    def __init__(self, definitions, devices, lent=()):
        self._defs = {q.name: q for q in definitions}
        self._devices = devices
        self._lent = lent
        self._docs = None
        self._by_queue: dict[str, dict[str, frozenset]] = {}

    def __contains__(self, queue) -> bool:
        return queue in self._defs

    def __bool__(self) -> bool:
        return bool(self._defs)

    def __getitem__(self, queue: str) -> dict[str, frozenset]:
        got = self._by_queue.get(queue)
        if got is None:
            if self._docs is None:
                self._docs = [_device_doc(d) for d in self._devices]
                self._lent = list(self._lent)
            per = {d: set(names)
                   for d, names in future_vms_by_device(self._defs[queue], self._docs).items()}
            for q, device, vm_names in self._lent:
                if q == queue:
                    per.setdefault(device, set()).update(n for n in vm_names if n)
            got = self._by_queue[queue] = {d: frozenset(n) for d, n in per.items()}
        return got

    def as_dict(self) -> dict[str, dict[str, frozenset]]:
        """Every queue's (tests, diagnostics)."""
        return {name: self[name] for name in self._defs}


def possible_by_queue(definitions, devices, lent=()) -> dict[str, dict[str, frozenset]]:
    """:class:`PossibleVMs` of every queue at once."""
    return PossibleVMs(definitions, devices, lent).as_dict()


def excluded_devices(exclude, per_device: dict[str, frozenset]) -> frozenset | None:
    """For a waiting job's ``exclude_agents`` (a list, maybe malformed) and its queue's
    ``{device: VM agent names}`` (:func:`possible_by_queue`): None when it excludes every one
    of those names (lending cannot serve it: no demand, server/jobreads.py), else the devices
    none of whose VMs it may run (empty for a job excluding nothing). A queue no device can
    serve (``per_device`` empty) gives an empty set: the job still shows as waiting."""
    if not exclude or not isinstance(exclude, list) or not per_device:
        return frozenset()
    banned = {x for x in exclude if isinstance(x, str)}
    avoid = frozenset(d for d, names in per_device.items() if names <= banned)
    return None if len(avoid) == len(per_device) else avoid


def decide(exclude: list[str], current: list[str], future: list[str]) -> tuple[list[str], str]:
    """Pure decision. ``exclude``: the job's ``exclude_agents``; ``current``: names of the agent
    documents listing the queue (what Testflinger counts); ``future``: :func:`future_vm_names`.
    Returns (the future names the job allows that are not current, "") when some current or
    future agent is allowed, else ([], the refusal message)."""
    banned = set(exclude)
    if any(name not in banned for name in current):
        have = set(current)
        return [n for n in future if n not in banned and n not in have], ""
    allowed = [n for n in future if n not in banned]
    if allowed:
        return allowed, ""
    every = sorted(set(current) | set(future))
    shown = ", ".join(every[:8]) + (f" and {len(every) - 8} more" if len(every) > 8 else "")
    return [], (f"{TF_MESSAGE}: exclude_agents names every agent this magic queue has or can "
                f"have ({shown or 'none: no device can be lent to it'})")


def possible_agents(plugin, queue: str) -> tuple[list[str], list[str]] | None:
    """(current agent names listing ``queue``, future VM agent names) for a magic queue whose
    stored definition is valid and not suspended, else None (Testflinger's check alone applies).
    Two reads: the agent documents listing the queue, the registered devices."""
    definition = plugin.definition(queue)
    if definition is None or plugin.problem(queue) is not None:
        return None
    current = [d["name"] for d in plugin.db.agents.find({"queues": queue}, {"name": 1})]
    return current, future_vm_names(definition, plugin.engine.devices())


def check(plugin, queue: str, exclude) -> str | None:
    """The ``POST /v1/job`` hook's part for a served caller: None to let Testflinger's handler
    run (having marked the request so its check counts the allowed future VM agents), or the
    refusal message. Leaves a malformed ``exclude_agents`` (not a list of strings) to
    Testflinger's schema."""
    if not exclude or not isinstance(exclude, list) or not all(isinstance(x, str) for x in exclude):
        return None
    known = possible_agents(plugin, queue)
    if known is None:
        return None
    allowed, why = decide(exclude, *known)
    if why:
        return why
    if allowed:
        request.environ[ALLOWED] = (queue, allowed)
    return None


def _stand_ins(queue) -> list[dict]:
    """Agent entries the current request's hook allowed for ``queue`` (none elsewhere)."""
    if not has_request_context():
        return []
    marked = request.environ.get(ALLOWED)
    if not marked or marked[0] != queue:
        return []
    return [{"name": name, "queues": [queue], "state": "offline"} for name in marked[1]]


def wrap(original):
    """``get_agents_on_queue(queue)`` that returns ``original(queue)`` plus the stand-ins of
    :func:`_stand_ins` (idempotent: a wrapped function is returned as is)."""
    if getattr(original, "_magic_excludes", False):
        return original

    def get_agents_on_queue(queue, *args, **kwargs):
        agents = original(queue, *args, **kwargs)
        extra = _stand_ins(queue)
        return list(agents) + extra if extra else agents

    get_agents_on_queue._magic_excludes = True
    get_agents_on_queue.__wrapped__ = original
    get_agents_on_queue.__doc__ = original.__doc__
    return get_agents_on_queue


def install(app) -> None:
    """Wrap the ``get_agents_on_queue`` that ``app``'s ``job_post`` calls: Testflinger's
    ``testflinger.database`` inside the real server (v1.py calls it as
    ``database.get_agents_on_queue``, looked up at each call), the lab job service's
    ``testflinger_magic.lab.jobservice`` in the lab; nothing on another app (whose ``job_post``
    does not check ``exclude_agents``)."""
    from . import auth  # noqa: PLC0415

    module = None
    if auth._testflinger_auth(app) is not None:
        from testflinger import database as module  # noqa: PLC0415
    elif "jobservice" in app.extensions:
        from testflinger_magic.lab import jobservice as module  # noqa: PLC0415
    if module is not None and hasattr(module, "get_agents_on_queue"):
        module.get_agents_on_queue = wrap(module.get_agents_on_queue)
