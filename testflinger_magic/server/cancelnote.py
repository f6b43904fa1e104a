"""Telling a test engineer why testflinger-magic cancelled their job, where they look.

Two places (issue 10 item 2): the job's output, as ``testflinger-cli poll`` and ``results`` read
it (one ``logs`` fragment, Testflinger's shape, TESTFLINGER.md §1.3: ``{job_id, log_type:
output, phase, fragment_number, timestamp, log_data, updated_at}``), and, on a Testflinger that
keeps job events (testflinger#1297-#1299, :mod:`testflinger_magic.tfevents`), the job's events:
``job_cancelled`` as the server's own cancel action records it, requester
:data:`~testflinger_magic.tfevents.MAGIC_REQUESTER`, the reason in its ``detail``.
"""

from __future__ import annotations

import logging
import re
from datetime import datetime, timezone

from testflinger_magic import tfevents

log = logging.getLogger(__name__)

#: ``fragment_number`` of the output fragment written to each job testflinger-magic cancels. The
#: server returns a job's fragments per phase sorted by ``fragment_number``, from
#: ``start_fragment`` on (Testflinger's api/v1.py ``log_get`` -> logs.py
#: ``MongoLogHandler.retrieve_log_fragments``; the lab's jobservice.log_get), and the agent
#: numbers its fragments from 0 up, one per output chunk: the largest 32-bit int sorts after any
#: the agent writes and is at or after any ``start_fragment`` the CLI's poll asks for (the CLI
#: asks from the largest ``last_fragment_number`` of any phase, cli ``_get_combined_log_output``),
#: so ``testflinger-cli poll`` shows it last. The price: a poll already past it does not show
#: output the agent writes after the cancel (``results`` still shows all of it).
CANCEL_FRAGMENT = 2**31 - 1
#: Phases a fragment may name (Testflinger's TEST_PHASES, api/schemas.py); a job cancelled in
#: another state (waiting, allocated) gets its reason under ``setup``.
PHASES = ("setup", "provision", "firmware_update", "test", "allocate", "reserve", "cleanup")


#: What started a drain, by the lease's ``drain.kind`` (reconcile's drain kinds, the engine's
#: ``operator`` and ``forced``): the words of the note a cancelled job gets.
_DRAIN_BY = {
    "operator": "an operator's drain",
    "reclaim": "the device owner's reclaim",
    "max_lease": "the lease reaching its max_lease",
    "idle": "an idle drain",
    "consolidate": "a consolidation drain (its VMs were moved to fewer devices)",
    "yield": "a yield to another magic queue waiting for the device",
    "orphan": "the removal of its magic queue from the definitions",
    "unneeded": "a drain of a lease no longer needed",
    "error": "a drain after an error",
    "forced": "an immediate forced drain (no grace)",
}


#: The end reconcile gives a drain's reason (reconcile.py, ``scale_down``: "; drain lease
#: <id> on <device> (grace <duration>)", or "; drain"): the note says lease, device and grace
#: itself.
_DRAIN_TAIL = re.compile(r"; drain( lease \S+ on \S+ \(grace [^()]*\))?$")


def _plain_reason(reason: str, queue: str | None) -> str:
    """``reason`` without what the note says around it: the planner's ``<queue>: `` prefix and
    its ``; drain lease ... (grace ...)`` end (TRIAL11 F5: the note repeated them in a second
    pair of brackets). An operator's reason is left as written."""
    if queue and reason.startswith(f"{queue}: "):
        reason = reason[len(queue) + 2:]
    return _DRAIN_TAIL.sub("", reason) or reason


def drain_note(lease: dict, homes: str, grace_text: str) -> tuple[str, str]:
    """``(output, detail)`` telling a job why it was cancelled at the end of ``lease``'s drain
    grace, worded by what happened: who drained it (``drain.kind``: operator, reclaim,
    max_lease, ...), the reason, the lease, magic queue, device and owner's queue ``homes``,
    and that its grace (``grace_text``) ran out. ``drain.forced`` is not read: the engine sets
    it when it cancels at the grace's end (actions._do_force), whether or not the operator gave
    ``--force``, which only keeps demand from undoing a drain and changes nothing for the job.
    Pure."""
    drain = lease.get("drain") or {}
    kind = drain.get("kind") or "operator"
    by = _DRAIN_BY.get(kind, f"a {kind} drain")
    where = (f"lease {lease.get('_id')} (magic queue {lease.get('queue')}, device "
             f"{lease.get('device')}, owner's queue {homes})")
    reason = drain.get("reason") or "no reason given"
    if kind not in ("operator", "forced"):  # the planner's words; an operator's as written
        reason = _plain_reason(reason, lease.get("queue"))
    output = (f"\n*** testflinger-magic: this job was cancelled: {where} was drained by {by} "
              f"({reason}), and the job was still running when the drain's grace of "
              f"{grace_text} ran out. Submit it again to run it on another VM. ***\n")
    detail = (f"Cancelled: {where} was drained by {by} ({reason}); still running when the "
              f"drain's grace of {grace_text} ran out.")
    return output, detail


def tell(db, now: datetime, phases: dict, output: str, detail: str) -> None:
    """Say why in each cancelled job: ``phases`` is ``{job_id: job_state before the cancel}``;
    ``output``: the text of the output fragment (under the job's phase if it was in one, else
    ``setup``; ``fragment_number`` :data:`CANCEL_FRAGMENT`; one ``insert_many``); ``detail``: the
    ``job_cancelled`` event's detail (one upsert per job, as the server's ``add_job_event``, only
    where :func:`tfevents.server_keeps_job_events`). ``now``: naive UTC. Never raises: the
    cancel itself is done; a failure is logged."""
    if not phases:
        return
    try:
        if tfevents.server_keeps_job_events(db):
            for job_id in sorted(phases):
                tfevents.add_job_event(db, job_id, tfevents.build_event(
                    tfevents.JOB_CANCELLED, now.replace(tzinfo=timezone.utc), detail,
                    client_id=tfevents.MAGIC_REQUESTER))
    except Exception:  # noqa: BLE001 - best effort, as the server's own events
        log.exception("could not record the cancel in the jobs' events")
    try:
        db.logs.insert_many([
            {"job_id": job_id, "log_type": "output",
             "phase": state if state in PHASES else "setup",
             "fragment_number": CANCEL_FRAGMENT, "timestamp": now, "log_data": output,
             "updated_at": now} for job_id, state in sorted(phases.items())])
    except Exception:  # noqa: BLE001 - best effort, logged
        log.exception("could not write the cancel reason to the jobs' output")
