"""Hardware facts the daemon learns about a device, kept on its ``magic_devices`` document
(testflinger_magic/fabric.py says what the NVSwitch one decides): from MAAS' commissioning at
registration, or from the device's split once it is deployed.

A daemon report (``POST /leases/<id>/report``) may carry ``facts: {"nvswitches": N}``: the
split's ``ok`` report (the splitter read the host's PCI devices), or the ``error`` report of a
split refused for it (``blame: hardware``, ``MultiGPUNeedsFabric``). :func:`record` keeps it as
``nvswitches`` with ``nvswitches_found = {at, lease_id, queue, refused}`` (compare-and-set: only
a changed count is written, so the first finding's lease stays named). The fact is kept until
the device is registered again with a changed hardware statement (its ``gpus`` or
``maas_system_id``: :func:`registration_changes`) or an operator forgets it (:func:`forget`,
``DELETE /devices/<name>/nvswitches``). The registration carries the agent host's opt-in
(``nvswitch_multi_gpu``) and, per device, the count MAAS' commissioning listed (``nvswitches``:
the daemon asks MAAS >= 3.0 for the machine's node devices, agent_host/maas_nodedevices.py),
so a board is known before its first lend. :func:`record_registration` keeps that count with
``nvswitches_found = {at, source: "maas", lease_id: None, queue: None, refused: False}`` only
where no count is known (never registered with one, cleared by a changed hardware statement or
forgotten) or where the known one came from MAAS too: a split's count, read from the deployed
host, is fresher than MAAS' commissioning and is kept.
"""

from __future__ import annotations

from testflinger_magic import fabric

from .errors import Invalid, NotFound

#: ``nvswitches_found.source``: the device's split (a report's ``facts``) or MAAS'
#: commissioning (the registration). Documents written before it have none: a split's.
SPLIT, MAAS = "split", fabric.FROM_MAAS

#: Keys a report's ``facts`` may carry, with their bounds.
FACT_BOUNDS = {fabric.NVSWITCHES: (0, fabric.MAX_NVSWITCHES)}


def check_facts(facts) -> dict:
    """``facts`` of a report (None or ``{}``: none) checked: a dict of known keys with integer
    values in bounds. Returns the dict; raises :class:`Invalid` naming ``facts.<key>``."""
    if facts is None:
        return {}
    if not isinstance(facts, dict):
        raise Invalid("facts", "must be an object, e.g. {\"nvswitches\": 4}")
    for key, value in facts.items():
        bounds = FACT_BOUNDS.get(key)
        if bounds is None:
            raise Invalid(f"facts.{key}", "unknown fact; a report may carry only "
                          + ", ".join(sorted(FACT_BOUNDS)))
        if isinstance(value, bool) or not isinstance(value, int) \
                or not bounds[0] <= value <= bounds[1]:
            raise Invalid(f"facts.{key}", f"must be an integer in {bounds[0]}..{bounds[1]}")
    return dict(facts)


def record(db, events, now: float, lease: dict, facts: dict, refused: bool) -> bool:
    """Keep ``facts`` (checked) on ``lease``'s device: ``nvswitches`` and, when the count
    changed, ``nvswitches_found = {at: now, lease_id, queue, refused}`` (``refused``: the
    lease's split was refused for it). Compare-and-set on the device's agent host and a
    different count; records ``device.nvswitches`` when the count changed to non-zero.
    Returns True if written."""
    if fabric.NVSWITCHES not in facts:
        return False
    count = int(facts[fabric.NVSWITCHES])
    found = {"at": now, "source": SPLIT, "lease_id": lease["_id"], "queue": lease["queue"],
             "refused": refused}
    res = db.magic_devices.update_one(
        {"_id": lease["device"], "agent_host": lease.get("agent_host"),
         fabric.NVSWITCHES: {"$ne": count}},
        {"$set": {fabric.NVSWITCHES: count, fabric.FOUND: found}})
    if not res.modified_count:
        return False
    if count:
        how = ("its split of several GPUs per VM was refused" if refused
               else "found at its split")
        events.record("device.nvswitches",
                      f"{lease['device']}: {count} NVSwitch(es) ({how}, lease {lease['_id']} of "
                      f"{lease['queue']}); from now on it is not lent to queues of more than one "
                      "GPU per VM unless its agent host sets splitter.nvswitch_multi_gpu",
                      queue=lease["queue"], device=lease["device"], lease_id=lease["_id"],
                      data={"nvswitches": count, "refused": refused})
    return True


def record_registration(db, events, now: float, host: str, device: dict) -> bool:
    """Keep the count MAAS gave in a registration's ``device`` (its ``nvswitches``, checked by
    the schema; None: MAAS could not say, nothing done) on the registered device, with
    ``nvswitches_found = {at: now, source: "maas", lease_id: None, queue: None, refused:
    False}``, where no count is known or the known one came from MAAS and differs
    (compare-and-set: a split's count written meanwhile is kept). Call it after the
    registration's own write (which may have cleared the count: :func:`registration_changes`).
    Records ``device.nvswitches`` when a non-zero count is written. Returns True if written."""
    count = device.get(fabric.NVSWITCHES)
    if count is None:
        return False
    count, name = int(count), device["agent_name"]
    found = {"at": now, "source": MAAS, "lease_id": None, "queue": None, "refused": False}
    res = db.magic_devices.update_one(
        {"_id": name, "agent_host": host,
         "$or": [{fabric.NVSWITCHES: None},
                 {f"{fabric.FOUND}.source": MAAS, fabric.NVSWITCHES: {"$ne": count}}]},
        {"$set": {fabric.NVSWITCHES: count, fabric.FOUND: found}})
    if not res.modified_count:
        return False
    if count:
        events.record("device.nvswitches",
                      f"{name}: {count} NVSwitch(es) listed by MAAS' commissioning of machine "
                      f"{device['maas_system_id']} (registration by agent host {host}); it is "
                      "not lent to queues of more than one GPU per VM unless its agent host "
                      "sets splitter.nvswitch_multi_gpu",
                      device=name, data={"nvswitches": count, "source": MAAS, "refused": False,
                                         "maas_system_id": device["maas_system_id"]})
    return True


def registration_changes(before: dict | None, device: dict) -> dict:
    """Fields a registration of ``device`` (its ``gpus``, ``maas_system_id``) resets on the
    stored document ``before`` (None: new): the learnt facts when the hardware statement
    changed (another machine, or GPUs added or taken out), else ``{}``."""
    if not before or fabric.NVSWITCHES not in before:
        return {}
    if (int(before.get("gpus") or 0), before.get("maas_system_id")) == \
            (int(device["gpus"]), device["maas_system_id"]):
        return {}
    return {fabric.NVSWITCHES: None, fabric.FOUND: None}


def forget(db, events, name: str, by: str | None = None) -> dict:
    """Operator: drop the learnt facts of device ``name`` (e.g. its NVSwitches were taken out,
    or a board was swapped without a change the registration sees); the agent host's next
    registration (MAAS' commissioning list: :func:`record_registration`) or the next split
    learns them again. Returns ``{"device", "previous": {nvswitches, nvswitches_found}}`` (previous
    nvswitches None: nothing was known); NotFound for an unregistered device. Records
    ``device.facts_forgotten`` when something was known."""
    doc = db.magic_devices.find_one_and_update(
        {"_id": name}, {"$set": {fabric.NVSWITCHES: None, fabric.FOUND: None}})
    if doc is None:
        raise NotFound(f"device {name} is not registered")
    previous = {fabric.NVSWITCHES: doc.get(fabric.NVSWITCHES), fabric.FOUND: doc.get(fabric.FOUND)}
    if previous[fabric.NVSWITCHES] is not None:
        events.record("device.facts_forgotten",
                      f"{name}: learnt facts forgotten (nvswitches was "
                      f"{previous[fabric.NVSWITCHES]})" + (f" by {by}" if by else ""),
                      device=name, data={"previous": previous})
    return {"device": name, "previous": previous}
