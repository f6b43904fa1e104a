"""Cancelling, with the reason, the jobs of a magic queue nothing can serve (TRIAL17 F4).

The decision is :mod:`testflinger_magic.unservable` (pure); this applies it each tick:

* **mark** a queue newly unservable: ``magic_queues.unservable = {since, reason}``
  (compare-and-set on its absence, so replicas mark it once) and an event
  ``queue.unservable`` saying why (the operator's wording, :func:`.devicecount.no_match_reason`),
  how many jobs wait and when they are cancelled unless a device that fits registers;
* **cancel** its waiting jobs once it stayed so for the grace, as Testflinger's cancel action
  does, each told why in its output and events (:func:`.removedqueues.cancel_waiting`, the
  test engineer's wording), with an event ``queue.jobs_cancelled``; then forget the mark, so a
  job that still gets in (a submission racing the preflight's 404) gets a grace of its own;
* **clear** the mark of a queue that can be served again (event ``queue.servable`` while jobs
  still wait) or has no waiting job left.

A queue an agent that is none of our VM agents lists (an operator pointed a real agent at the
name: it runs the jobs, :func:`.removedqueues.served_elsewhere`) is never marked, nor are its
jobs cancelled. Reads: none when no queue is unservable or marked (the decision uses the tick's
inputs); two per unservable queue marked or cancelled (served_elsewhere), plus the cancel's.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone

from testflinger_magic import unservable
from testflinger_magic.durations import format_duration
from testflinger_magic.reconcile_model import _NO_DEMAND, Inputs, _plural

from . import devicecount, removedqueues

log = logging.getLogger(__name__)


def settle(db, inputs: Inputs, grace: float, record) -> dict[str, int]:
    """Apply this tick's :func:`testflinger_magic.unservable.decide` on ``db`` (Testflinger's
    database) from the tick's ``inputs``; ``grace``: seconds; ``record(kind, message,
    queue=, data=)``: the engine's event recorder. Returns ``{queue: jobs cancelled}``. Each
    write is a compare-and-set (``unservable.since``) or the cancel's own CAS on ``waiting``.
    A failure on one queue is logged; the others are still done."""
    now = inputs.now
    names, dicts = unservable.unservable_queues(inputs)
    verdict = unservable.decide(names, inputs.unservable, now, grace)
    if not (verdict.mark or verdict.cancel or verdict.clear):
        return {}
    defs = {q.name: q for q in inputs.definitions}
    cancelled: dict[str, int] = {}
    for name in verdict.mark:
        try:
            _mark(db, defs[name], dicts, inputs, grace, record)
        except Exception:  # noqa: BLE001 - the next tick tries again
            log.exception("could not mark magic queue %s unservable", name)
    for name in verdict.cancel:
        try:
            n = _cancel(db, defs[name], dicts, inputs, grace, record)
            if n:
                cancelled[name] = n
        except Exception:  # noqa: BLE001 - the next tick tries again
            log.exception("could not cancel the jobs of unservable magic queue %s", name)
    for name in verdict.clear:
        try:
            _clear(db, name, inputs, record)
        except Exception:  # noqa: BLE001 - the next tick tries again
            log.exception("could not clear the unservable mark of magic queue %s", name)
    return cancelled


def _mark(db, q, dicts: list[dict], inputs: Inputs, grace: float, record) -> None:
    if removedqueues.served_elsewhere(db, q.name):
        return
    reason = devicecount.no_match_reason(q, dicts) or "no registered device matches it"
    res = db.magic_queues.update_one(
        {"_id": q.name, "unservable": {"$exists": False}},
        {"$set": {"unservable": {"since": inputs.now, "reason": reason}}})
    if not res.modified_count:
        return
    waiting = inputs.demand.get(q.name, _NO_DEMAND).waiting
    at = datetime.fromtimestamp(inputs.now + grace, timezone.utc).strftime("%H:%M UTC")
    record("queue.unservable",
           f"{q.name}: {_plural(waiting, 'job')} waiting and no registered device can serve "
           f"it: {reason}. They are cancelled at {at} (in {format_duration(grace)}) unless a "
           "device that fits registers, the definition changes, or a lease serves it",
           queue=q.name, data={"waiting": waiting, "reason": reason, "grace": grace})


def _cancel(db, q, dicts: list[dict], inputs: Inputs, grace: float, record) -> int:
    since = inputs.unservable[q.name]
    if removedqueues.served_elsewhere(db, q.name):
        _forget(db, q.name, since)
        return 0
    user = devicecount.no_match_reason(q, dicts, operator=False) or "no machine fits it"
    why = (f"magic queue {q.name} has had no machine able to run it for "
           f"{format_duration(inputs.now - since)}: {user}")
    n = removedqueues.cancel_waiting(db, q.name, why, inputs.now)
    _forget(db, q.name, since)
    if n:
        record("queue.jobs_cancelled",
               f"{q.name}: {_plural(n, 'waiting job')} cancelled: no registered device could "
               f"serve the queue for {format_duration(grace)} "
               f"({devicecount.no_match_reason(q, dicts) or 'none matches it'})",
               queue=q.name, data={"cancelled": n, "unservable_since": since})
    return n


def _forget(db, name: str, since: float) -> bool:
    return bool(db.magic_queues.update_one({"_id": name, "unservable.since": since},
                                           {"$unset": {"unservable": ""}}).modified_count)


def _clear(db, name: str, inputs: Inputs, record) -> None:
    if not _forget(db, name, inputs.unservable[name]):
        return
    waiting = inputs.demand.get(name, _NO_DEMAND).waiting
    if waiting and name in {q.name for q in inputs.definitions}:
        record("queue.servable",
               f"{name}: a device can serve it again (or a lease does); its "
               f"{_plural(waiting, 'waiting job')} are no longer to be cancelled",
               queue=name, data={"waiting": waiting})
