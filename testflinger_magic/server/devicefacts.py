"""Hardware facts the daemon learns about a device once it is deployed, kept on its
``magic_devices`` document (testflinger_magic/fabric.py says what the NVSwitch one decides).

A daemon report (``POST /leases/<id>/report``) may carry ``facts: {"nvswitches": N}``: the
split's ``ok`` report (the splitter read the host's PCI devices), or the ``error`` report of a
split refused for it (``blame: hardware``, ``MultiGPUNeedsFabric``). :func:`record` keeps it as
``nvswitches`` with ``nvswitches_found = {at, lease_id, queue, refused}`` (compare-and-set: only
a changed count is written, so the first finding's lease stays named). The fact is kept until
the device is registered again with a changed hardware statement (its ``gpus`` or
``maas_system_id``: :func:`registration_changes`) or an operator forgets it (:func:`forget`,
``DELETE /devices/<name>/nvswitches``). The registration carries the agent host's opt-in
(``nvswitch_multi_gpu``) and never a count: the daemon learns it only from a deployed device.
"""

from __future__ import annotations

from testflinger_magic import fabric

from .errors import Invalid, NotFound

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
    found = {"at": now, "lease_id": lease["_id"], "queue": lease["queue"], "refused": refused}
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
    or a board was swapped without a change the registration sees); the next split learns them
    again. Returns ``{"device", "previous": {nvswitches, nvswitches_found}}`` (previous
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
