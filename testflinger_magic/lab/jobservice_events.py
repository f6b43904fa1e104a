"""Server-side job events of the lab's job service, newer generation only (``newer=True``).

What a newer Testflinger does (testflinger#1297-#1299; shapes and sources in
:mod:`testflinger_magic.tfevents`): ``database.create_indexes`` creates ``jobs_events`` at start;
``job_post`` records ``job_submitted`` (the submitter's client_id and the queue), ``job_get``
``job_assigned`` (the cookie's agent), the cancel action ``job_cancelled`` (the requester's
client_id), ``result_post`` what ``events.detect_new_result_events`` finds between the stored and
the posted ``result_data``; ``GET /v1/events/job/<job_id>`` serves ``{"job_id", "events"}``, 404
``{"message": "Job not found"}`` for an unknown job. The older generation (fe381ff) does none of
it, so the collection never exists there and the route is not registered.
"""

from __future__ import annotations

from datetime import timezone
from http import HTTPStatus

from flask import g, jsonify

from testflinger_magic import tfevents
from testflinger_magic.lab.jobservice_auth import ALL_ROLES, _db, _newer, roles


def create_indexes(database) -> None:
    """``jobs_events``' unique ``job_id`` index (no TTL in the lab): the collection exists from
    the start, as on a newer server."""
    database[tfevents.COLLECTION].create_index("job_id", unique=True)


def record(job_id: str, name: str, **context) -> None:
    """Append one event to the job (newer generation only; best effort as ``add_job_event``)."""
    if _newer():
        tfevents.add_job_event(_db(), job_id, tfevents.build_event(name, **context))


def record_result(job_id: str, previous: dict, posted: dict) -> None:
    """Append the events a result post adds (``detect_new_result_events``; newer only)."""
    if _newer():
        for event in tfevents.result_events(previous or {}, posted):
            tfevents.add_job_event(_db(), job_id, event)


def requester() -> str | None:
    """The caller's client_id (the token's ``permissions.client_id``), as the newer server names
    the submitter and the canceller; None for an anonymous caller."""
    return getattr(g, "client_id", None)


def _extended_json(event: dict) -> dict:
    """Timestamps as MongoDB extended JSON ``{"$date": "...Z"}``, as the CLI's job-events reads
    them (``cli/tests/test_job_events.py``)."""
    out = dict(event)
    ts = out.get("timestamp")
    if hasattr(ts, "isoformat"):
        if ts.tzinfo is not None:
            ts = ts.astimezone(timezone.utc).replace(tzinfo=None)
        out["timestamp"] = {"$date": ts.isoformat(timespec="milliseconds") + "Z"}
    return out


def register(v1, valid_uuid) -> None:
    """Add ``GET /events/job/<job_id>`` to the ``v1`` blueprint (served by the newer generation
    only: on the older one the route answers 404 as an unknown URL would). The role decorator of
    the real route was not in the stored copies read; it is served to every role, as
    ``GET /v1/result/<id>``."""

    @v1.get("/events/job/<job_id>")
    @roles(*ALL_ROLES)
    def job_events_get(job_id):
        """``{"job_id", "events"}`` of a known job; 404 ``{"message": "Job not found"}``."""
        if not _newer():
            return jsonify({"message": "Not Found"}), HTTPStatus.NOT_FOUND
        if not valid_uuid(job_id):
            return jsonify({"message": "Invalid job_id specified"}), HTTPStatus.BAD_REQUEST
        if _db().jobs.find_one({"job_id": job_id}, {"_id": True}) is None:
            return jsonify({"message": "Job not found"}), HTTPStatus.NOT_FOUND
        events = tfevents.get_job_events(_db(), job_id)
        return jsonify({"job_id": job_id, "events": [_extended_json(e) for e in events]})
