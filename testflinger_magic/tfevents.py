"""Testflinger's server-side job events (testflinger#1297-#1299), as a newer server keeps them.

Sources (canonical/testflinger, read with the search tools; TESTFLINGER.md §9):

- ``server/src/testflinger/database.py``: ``create_indexes`` makes the collection ``jobs_events``
  (a unique index on ``job_id``, a 7-day TTL on ``updated_at``) when the server starts;
  ``add_job_event(job_id, event)`` is one ``update_one({"job_id"}, {"$push": {"events": event},
  "$set": {"updated_at": now}}, upsert=True)`` (best effort: a MongoDB error is logged);
  ``get_job_events(job_id)`` returns the document's ``events`` (oldest first) or ``[]``.
- ``server/src/testflinger/events.py``: ``build_event(event_type, detail="", **context)`` ->
  ``{"event_name", "timestamp" (UTC datetime), "message" (the type's template formatted with the
  context; a missing placeholder renders as ``<name>``), "detail" (str)}`` plus ``status`` when the
  context has one; ``detect_new_result_events`` (the events a result post adds).
- ``common/src/testflinger_common/enums.py``: ``JobEvent`` names.
- ``cli/tests/test_job_events.py`` (``testflinger-cli job-events``): ``GET /v1/events/job/<id>``
  answers ``{"job_id", "events": [...]}``; phase events also carry ``phase``; timestamps come as
  MongoDB extended JSON ``{"$date": ...}``; an unknown job is 404 ``{"message": "Job not found"}``.

An older server (fe381ff) has none of this: no collection, no route. :func:`server_keeps_job_events`
tells the two apart by the collection the newer server creates at start.
"""

from __future__ import annotations

from datetime import datetime, timezone

#: The collection a newer Testflinger keeps job events in (``database.create_indexes``).
COLLECTION = "jobs_events"

#: ``JobEvent`` values (``testflinger_common/enums.py``).
JOB_SUBMITTED = "job_submitted"
JOB_ASSIGNED = "job_assigned"
JOB_PHASE_STARTED = "job_phase_started"
JOB_PHASE_COMPLETED = "job_phase_completed"
JOB_COMPLETED = "job_completed"
JOB_CANCELLED = "job_cancelled"

#: ``TestPhase`` values (``testflinger_common/enums.py``): the states a phase event names.
TEST_PHASES = ("setup", "provision", "firmware_update", "test", "allocate", "reserve", "cleanup")

#: Message templates per event (``events._MESSAGE_TEMPLATES``).
MESSAGES = {
    JOB_SUBMITTED: "Job submitted by user {client_id} into queue {queue_name}.",
    JOB_ASSIGNED: "Job assigned to agent {agent_name}.",
    JOB_PHASE_STARTED: "Phase {phase} started.",
    JOB_PHASE_COMPLETED: "Phase {phase} completed with exit code {status}",
    JOB_COMPLETED: "Job completed.",
    JOB_CANCELLED: "Job cancellation requested by user {client_id}.",
}

#: The requester a cancel by testflinger-magic names (``{client_id}`` of JOB_CANCELLED).
MAGIC_REQUESTER = "testflinger-magic"


class _Missing(dict):
    def __missing__(self, key):
        return f"<{key}>"


def build_event(name: str, now: datetime | None = None, detail: str = "", **context) -> dict:
    """One event in the newer server's shape (module docstring): ``{"event_name", "timestamp",
    "message", "detail"}`` plus ``phase``/``status`` when ``context`` has them. ``now``: an aware
    or naive-UTC datetime (default: now). Raises ``KeyError`` for a ``name`` not in
    :data:`MESSAGES`."""
    event = {"event_name": name, "timestamp": now or datetime.now(timezone.utc),
             "message": MESSAGES[name].format_map(_Missing(context)), "detail": str(detail)}
    for key in ("phase", "status"):
        if key in context:
            event[key] = context[key]
    return event


def add_job_event(database, job_id: str, event: dict) -> None:
    """Append ``event`` to the job's events as ``database.add_job_event`` does (one upsert)."""
    now = event.get("timestamp") or datetime.now(timezone.utc)
    database[COLLECTION].update_one({"job_id": job_id},
                                    {"$push": {"events": event}, "$set": {"updated_at": now}},
                                    upsert=True)


def get_job_events(database, job_id: str) -> list[dict]:
    """The job's events, oldest first, or ``[]`` (``database.get_job_events``)."""
    doc = database[COLLECTION].find_one({"job_id": job_id}, {"_id": False, "events": True})
    return list((doc or {}).get("events") or [])


def server_keeps_job_events(database) -> bool:
    """True if the Testflinger server sharing ``database`` keeps job events: the newer server
    creates :data:`COLLECTION` (with its indexes) every time it starts, an older one never does.
    Errors answer False (then no event is written)."""
    try:
        return COLLECTION in database.list_collection_names()
    except Exception:  # noqa: BLE001 - unknown means no
        return False


def result_events(previous: dict, new: dict, now: datetime | None = None) -> list[dict]:
    """The events a result post adds (``events.detect_new_result_events``): a
    ``job_phase_completed`` per phase newly in ``status``; then ``job_completed`` when
    ``job_state`` becomes complete/completed, or ``job_phase_started`` when it changes to a test
    phase. ``previous``/``new``: the stored and the posted ``result_data``. A cancel is recorded
    by the cancel action, never here."""
    events = [build_event(JOB_PHASE_COMPLETED, now, phase=phase, status=status)
              for phase, status in (new.get("status") or {}).items()
              if phase not in (previous.get("status") or {})]
    state, before = new.get("job_state"), previous.get("job_state")
    if not state:
        return events
    done = {"complete", "completed"}
    if state in done:
        if before not in done:
            events.append(build_event(JOB_COMPLETED, now))
    elif state in TEST_PHASES and state != before:
        events.append(build_event(JOB_PHASE_STARTED, now, phase=state))
    return events
