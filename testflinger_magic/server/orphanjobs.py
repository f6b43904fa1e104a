"""Ending the jobs a restarted VM agent left in a phase (TRIAL3 finding 12).

A testflinger-agent that restarts mid-job never resumes it (``agent.py::process_jobs`` asks for
a new job; :mod:`testflinger_magic.stalejob`), and the Testflinger server never times a job
out: the job would sit in ``provision`` (or whichever phase) until its ``jobs`` TTL deletes it 7
days after submission, and ``testflinger-cli poll`` would wait as long. So each tick cancels
every such orphan (:attr:`reconcile_model.Inputs.orphans`, found by the snapshot), as ``POST
/v1/job/<id>/action cancel`` does (``result_data.job_state = cancelled``; a newer Testflinger
also ``$unset``s the agent's ``job_id``, testflinger#1253 ``clear_agent_job``), and tells why
where the test engineer looks (:func:`.cancelnote.tell`: the job's output and events) and where
the operator looks (the event ``job.orphan_cancelled``). Cancelling rather than listing it for a
person: nobody can make the job progress, and the test engineer's resubmission runs at once on
a free VM; a person is needed only if VM agents keep restarting, which the events show.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone

from testflinger_magic import tfstates

from . import cancelnote

log = logging.getLogger(__name__)

#: The event kind recorded for each orphan cancelled.
EVENT = "job.orphan_cancelled"


def note(orphan: dict) -> tuple[str, str]:
    """``(output, detail)`` telling why ``orphan`` (``{agent, job_id, job_state, lease_id,
    queue}``) was cancelled. Pure."""
    where = (f"its agent {orphan.get('agent')} (a VM of lease {orphan.get('lease_id')}, magic "
             f"queue {orphan.get('queue')})")
    why = (f"{where} restarted while the job was in {orphan.get('job_state')}, and "
           "testflinger-agent never resumes a job after a restart: the job would have stayed "
           f"in {orphan.get('job_state')} for ever")
    output = (f"\n*** testflinger-magic: this job was cancelled: {why}. Submit it again to run "
              "it on another VM. ***\n")
    return output, f"Cancelled: {why}."


def cancel(db, now: float, orphans: list[dict], record=None) -> list[str]:
    """Cancel each of ``orphans`` still in the very phase it was seen in (a compare-and-set on
    ``result_data.job_state``: a job that moved on has a live agent after all, and one cancelled
    meanwhile is left alone), tell it why (:func:`note`, :func:`.cancelnote.tell`), and on a
    newer Testflinger (its jobs carry ``result_data.agent_id``) unset the agent's ``job_id`` if
    it still names the job. ``now``: epoch seconds; ``record(kind, message, queue=, lease_id=,
    data=)``: the engine's event recorder, or None. Returns the job ids cancelled. A failure on
    one job is logged and the others are still done."""
    done = []
    at = datetime.fromtimestamp(now, timezone.utc).replace(tzinfo=None)
    for orphan in orphans:
        job_id, state = orphan.get("job_id"), orphan.get("job_state")
        if not job_id or state not in tfstates.JOB_PHASES:
            continue
        try:
            before = db.jobs.find_one_and_update(
                {"job_id": job_id, "result_data.job_state": state},
                {"$set": {"result_data.job_state": tfstates.JOB_CANCELLED}},
                projection={"result_data": 1})
            if before is None:
                continue
            done.append(job_id)
            if "agent_id" in (before.get("result_data") or {}):
                db.agents.update_one({"name": orphan.get("agent"), "job_id": job_id},
                                     {"$unset": {"job_id": ""}})
            output, detail = note(orphan)
            cancelnote.tell(db, at, {job_id: state}, output, detail)
            if record is not None:
                record(EVENT, f"cancelled job {job_id}: {detail}", queue=orphan.get("queue"),
                       lease_id=orphan.get("lease_id"),
                       data={"job_id": job_id, "agent": orphan.get("agent"), "job_state": state})
        except Exception:  # noqa: BLE001 - the next tick sees it again
            log.exception("could not cancel orphaned job %s", job_id)
    return done
