"""Magic queues removed from the definitions: never advertised again, no new jobs, none stranded.

When ``apply`` removes a magic queue (server/plugin.py), its leases drain (reconcile's ``orphan``
drain, ``ORPHAN_GRACE``) and their VM agents are fenced, so a job that reaches the queue after
that would wait forever: no VM agent takes it and no lease is lent for it. This module keeps one
``magic_removed_queues`` document per removed name (``{_id: name, removed_at, source,
drained_at}``; epoch seconds) and, from it:

* **stops advertising it**: Testflinger's ``queues`` document of the name is deleted at the
  removal, and again each tick until its last lease closed (a VM agent restarting meanwhile
  re-posts its ``advertised_queues``, TESTFLINGER.md §1.3, §3.2), so ``list-queues`` and
  ``GET /v1/agents/queues`` no longer offer it;
* **refuses new submissions** (the ``POST /v1/job`` hook, server/dispatch.py): 422 with a
  ``message``, as Testflinger's own ``job_post`` refuses a job no agent of the queue may run
  (``abort(422, ...)``, TESTFLINGER.md §1.9; testflinger-cli prints the message and exits 1);
* **cancels a job that got in anyway** (a submission racing the apply, a replica without this
  hook) at the next tick, with the reason in its output and events (:mod:`.cancelnote`), as
  ``apply --force`` cancels the jobs waiting at the removal.

All three stand aside when an agent that is not one of our VM agents lists the queue (an operator
pointed a real agent at the name: it serves the jobs). Applying the queue again forgets the
record. The record is kept :data:`RETAIN` seconds after the queue's last lease closed, then
dropped. Once no agent document lists the queue (VM agent documents are deleted at the close),
testflinger-cli's preflight refuses it as unknown (404, TESTFLINGER.md §4.2); while the record
is kept that 404 says who removed the queue and when (:func:`unknown_queue_message`, the
``GET /v1/queues/<q>/agents`` hook in server/dispatch.py). Before that, while its leases drain,
that hook answers the agents listing it as Testflinger would, their fenced idle VM agents
``offline`` (:mod:`.fencedagents`), or 404 saying the queue was removed
(:func:`removed_message`) when none of them takes a new job.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone

from testflinger_magic import tfstates
from testflinger_magic.lease_states import OPEN_STATES

from . import cancelnote

log = logging.getLogger(__name__)

#: Seconds a removed queue's record is kept after its last lease closed (Testflinger keeps jobs,
#: agents and advertised queues 7 days, TESTFLINGER.md §1.4).
RETAIN = 7 * 86400.0


def _coll(db):
    return db.magic_removed_queues


def mark(db, names: list[str], now: float, source: str) -> None:
    """Record ``names`` as removed by ``source`` at ``now`` and stop advertising them (delete
    their ``queues`` documents)."""
    for name in names:
        _coll(db).replace_one({"_id": name}, {"_id": name, "removed_at": now, "source": source,
                                              "drained_at": None}, upsert=True)
    if names:
        db.queues.delete_many({"name": {"$in": sorted(names)}})


def unmark(db, names: list[str]) -> None:
    """Forget the removal of ``names`` (applied again)."""
    if names:
        _coll(db).delete_many({"_id": {"$in": sorted(names)}})


def served_elsewhere(db, queue: str) -> list[str]:
    """Names of the agents listing ``queue`` that are none of our VM agents (no lease, open or
    closed, planned a VM agent of that name): two reads."""
    names = [a["name"] for a in db.agents.find({"queues": queue}, {"name": 1}) if a.get("name")]
    if not names:
        return []
    ours = {vm.get("agent_name")
            for lease in db.magic_leases.find({"vms.agent_name": {"$in": names}}, {"vms": 1})
            for vm in lease.get("vms") or []}
    return sorted(n for n in names if n not in ours)


def record(db, queue) -> dict | None:
    """The removal record (``{_id, removed_at, source, drained_at}``) of ``queue`` if it is a
    removed magic queue not applied again, else None. One read by ``_id`` for any queue, two
    for a removed one."""
    if not isinstance(queue, str) or not queue:
        return None
    rec = _coll(db).find_one({"_id": queue})
    if rec is None or db.magic_queues.find_one({"_id": queue}, {"_id": 1}) is not None:
        return None
    return rec


def removed_message(queue: str, rec: dict) -> str:
    """Why ``queue`` (removal record ``rec``, :func:`record`) takes no new job. Pure."""
    return (f"Magic queue '{queue}' was removed from the testflinger-magic definitions "
            f"({_when(rec)}); its VMs take no new job. Submit to another queue "
            "(testflinger-cli list-queues).")


def refusal(db, queue) -> str | None:
    """The message refusing a job submitted to ``queue`` if it is a removed magic queue nobody
    serves (:func:`removed_message`), else None. One read by ``_id`` for any queue (the
    ``POST /v1/job`` hook's cost); more only for a removed one."""
    rec = record(db, queue)
    if rec is None or served_elsewhere(db, queue):
        return None
    return removed_message(queue, rec)


def unknown_queue_message(queue: str, rec: dict) -> str:
    """The 404 message for testflinger-cli's preflight (``GET /v1/queues/<queue>/agents``) on a
    removed magic queue (removal record ``rec``, :func:`record`: kept :data:`RETAIN`) that no
    agent document lists (the caller read them). Testflinger's own 404 says only "Queue
    '<queue>' does not exist." (``get_agents_on_queue``, TESTFLINGER.md §4.2; the CLI exits
    with that message); this one starts the same and says who removed the queue and when
    (TRIAL2 finding 4). Pure."""
    return (f"Queue '{queue}' does not exist: it was a magic queue, removed from the "
            f"testflinger-magic definitions ({_when(rec)}). Submit to another queue "
            "(testflinger-cli list-queues).")


def _when(rec: dict) -> str:
    at = rec.get("removed_at")
    stamp = (datetime.fromtimestamp(float(at), timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
             if isinstance(at, (int, float)) else "at an unknown time")
    return f"by {rec.get('source') or 'an operator'}, {stamp}"


def cancel_waiting(db, queue: str, why: str, now: float, rounds: int = 5) -> int:
    """Cancel the waiting jobs of ``queue`` as Testflinger's cancel action does (CAS on still
    ``waiting``), each told ``why`` (its output and events, :mod:`.cancelnote`); returns how many.

    Jobs are cancelled by the ids just read (so every cancelled job is one that is told), again
    while a submit raced the read; after ``rounds`` reads the rest are cancelled by queue,
    untold, rather than left waiting on a queue no agent serves."""
    waiting_q = {"job_data.job_queue": queue, "result_data.job_state": tfstates.JOB_WAITING}
    cancel = {"$set": {"result_data.job_state": tfstates.JOB_CANCELLED}}
    total = 0
    for _ in range(rounds):
        ids = [j["job_id"] for j in db.jobs.find(waiting_q, {"job_id": 1})]
        if not ids:
            return total
        total += db.jobs.update_many({"job_id": {"$in": ids}, **waiting_q}, cancel).modified_count
        done = [j["job_id"] for j in db.jobs.find(
            {"job_id": {"$in": ids}, "result_data.job_state": tfstates.JOB_CANCELLED},
            {"job_id": 1})]
        cancelnote.tell(
            db, datetime.fromtimestamp(now, timezone.utc).replace(tzinfo=None),
            {j: tfstates.JOB_WAITING for j in done},
            f"\n*** testflinger-magic: this job was cancelled before it ran: {why}. Submit it "
            "to another queue (testflinger-cli list-queues). ***\n",
            f"Cancelled before it ran: {why}.")
    return total + db.jobs.update_many(waiting_q, cancel).modified_count


def settle(db, now: float, events=None) -> dict:
    """One tick's work on the removed queues (a no-op read when there are none): for each
    record, cancel the jobs waiting on the queue (:func:`cancel_waiting`) unless an agent that is
    not ours serves it, delete its ``queues`` document while leases still serve it, mark
    ``drained_at`` when its last lease closed, and drop the record :data:`RETAIN` seconds after
    that. Each write is a compare-and-set or idempotent, so replicas may run it together.
    ``events``: an :class:`~testflinger_magic.events.EventLog` (a ``queue.jobs_cancelled``
    event per queue with cancelled jobs). Returns ``{queue: jobs cancelled}``."""
    records = list(_coll(db).find({}))
    if not records:
        return {}
    names = sorted(r["_id"] for r in records)
    defined = {d["_id"] for d in db.magic_queues.find({"_id": {"$in": names}}, {"_id": 1})}
    if defined:
        unmark(db, sorted(defined))
    serving = {x["queue"] for x in db.magic_leases.find(
        {"queue": {"$in": names}, "state": {"$in": sorted(OPEN_STATES)}}, {"queue": 1})}
    cancelled = {}
    for rec in records:
        name = rec["_id"]
        if name in defined or served_elsewhere(db, name):
            continue
        why = (f"magic queue {name} was removed from the definitions ({_when(rec)}) and no agent "
               "serves it any more")
        n = cancel_waiting(db, name, why, now)
        if n:
            cancelled[name] = n
            if events is not None:
                try:
                    events.record("queue.jobs_cancelled",
                                  f"{name}: {n} job{'' if n == 1 else 's'} submitted to the "
                                  "removed queue cancelled (nobody would run them)",
                                  queue=name, data={"cancelled": n})
                except Exception:  # noqa: BLE001 - the cancel is done
                    log.exception("could not record the cancel on %s", name)
        if name in serving:
            db.queues.delete_many({"name": name})  # a restarted VM agent re-advertised it
        elif rec.get("drained_at") is None:
            db.queues.delete_many({"name": name})
            _coll(db).update_one({"_id": name, "drained_at": None}, {"$set": {"drained_at": now}})
        elif now - float(rec["drained_at"]) >= RETAIN:
            _coll(db).delete_one({"_id": name, "drained_at": rec["drained_at"]})
    return cancelled
