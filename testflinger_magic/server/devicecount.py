"""One definition of a "lendable" device, shared by ``status`` (``devices_lendable``) and the
preflight entry testflinger-cli sees (``GET /v1/queues/<q>/agents``: ``magic:<queue>``'s
comment), so the two never count differently.

A registered device (a ``magic_devices`` document) is *eligible* for a queue when the queue's
definition matches it (selection and GPUs per VM, ``MagicQueue.matches``); *lendable* when it is
eligible, not quarantined and not held by a lease (``lease_id`` set: an open or failed lease
keeps the claim); *usable* when eligible and not quarantined (a held device still gives the
queue capacity later: jobs wait for it).
"""

from __future__ import annotations


def is_lendable(device: dict) -> bool:
    """True for a device document that is neither quarantined nor held by a lease (eligibility
    for a queue is the caller's :func:`count`)."""
    return not device.get("quarantined") and not device.get("lease_id")


def count(definition, devices: list[dict]) -> dict:
    """``{"eligible", "quarantined", "held", "lendable", "usable"}`` counts of ``devices``
    (``magic_devices`` documents) for ``definition`` (a :class:`~testflinger_magic.queues.
    MagicQueue`); each eligible device counts once, quarantine first; also ``"usable_docs"``:
    the eligible devices that are not quarantined."""
    eligible = [d for d in devices if definition.matches(d)]
    usable = [d for d in eligible if not d.get("quarantined")]
    held = sum(1 for d in usable if d.get("lease_id"))
    return {"eligible": len(eligible), "quarantined": len(eligible) - len(usable),
            "held": held, "lendable": len(usable) - held, "usable": len(usable),
            "usable_docs": usable}
