"""``testflinger-magic trace export``: a simulate trace from a Testflinger database's history.

Reads Testflinger's ``jobs`` collection (TESTFLINGER.md §1.3: ``job_id``, ``created_at``,
``started_at`` set when an agent pops the job, ``job_priority``, ``job_data.job_queue``,
``result_data.job_state``) for the jobs *created* in ``[since, until)``, and writes a trace
(docs/simulate.md "Trace files"): ``submit`` = seconds from ``since``, ``queue``, ``priority``,
``duration`` = seconds from ``started_at`` to the job's end.

Testflinger stores no end time on a job. The end is the ``timestamp`` of the job's last ``logs``
fragment (TESTFLINGER.md §1.3: ``{job_id, log_type, phase, fragment_number, timestamp, ...}``;
the agent posts output while every phase runs), found by one aggregation over ``logs`` for all
the jobs at once (a job still running ends, in the trace, at its latest fragment). A job that
started but has no log fragment gets ``default_duration``. Jobs that never started are kept when they were
still waiting (``waiting`` state: real demand; they get ``default_duration``) and left out when
cancelled while waiting (their counts are in the ``skipped`` summary).

Testflinger deletes jobs 7 days after ``created_at`` (TESTFLINGER.md §1.4 TTL indexes): export
a week before it is gone.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from testflinger_magic.tfstates import JOB_CANCELLED as _CANCELLED

__all__ = ["export_trace", "parse_time", "ExportError"]



class ExportError(ValueError):
    """A bad ``--since``/``--until`` or an empty range."""


def parse_time(text: str, field: str) -> float:
    """ISO 8601 (``2024-05-06``, ``2024-05-06T09:00``, ``...+02:00``; no zone = UTC) -> epoch
    seconds. Raises ExportError naming ``field``."""
    try:
        when = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise ExportError(f"{field} {text!r}: not an ISO 8601 date or time "
                          "(e.g. 2024-05-06 or 2024-05-06T09:00)") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return when.timestamp()


def _epoch(value: Any) -> float | None:
    """Testflinger stores ``datetime`` (UTC, naive as pymongo returns it); accept numbers too."""
    if value is None:
        return None
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.timezone.utc)
        return value.timestamp()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _dt(epoch: float) -> dt.datetime:
    # Naive UTC, as Testflinger writes and pymongo reads them back (tz_aware off).
    return dt.datetime.fromtimestamp(epoch, dt.timezone.utc).replace(tzinfo=None)


def export_trace(db, since: float, until: float, queues: list[str] | None = None,
                 default_duration: float = 1800.0) -> dict:
    """A trace mapping ``{"until": seconds, "jobs": [{submit, queue, duration, priority}],
    "exported": {...}}`` (``exported``: the range, job counts and ``skipped`` counts; simulate
    ignores no key, so :func:`to_yaml` writes it as a comment). ``since``/``until`` are epoch
    seconds; ``queues`` limits the queues (None: all). Two queries (``jobs``, then one
    aggregation over ``logs``). Raises ExportError for an empty range."""
    if until <= since:
        raise ExportError(f"--until must be after --since ({_dt(until)} <= {_dt(since)})")
    flt: dict = {"created_at": {"$gte": _dt(since), "$lt": _dt(until)}}
    if queues:
        flt["job_data.job_queue"] = {"$in": sorted(set(queues))}
    docs = list(db["jobs"].find(flt, {"job_id": 1, "created_at": 1, "started_at": 1,
                                       "job_priority": 1, "job_data.job_queue": 1,
                                       "result_data.job_state": 1}))
    ids = [d["job_id"] for d in docs if d.get("started_at") is not None and d.get("job_id")]
    ends: dict[str, float] = {}
    if ids:
        for row in db["logs"].aggregate([{"$match": {"job_id": {"$in": ids}}},
                                         {"$group": {"_id": "$job_id",
                                                     "last": {"$max": "$timestamp"}}}]):
            at = _epoch(row.get("last"))
            if at is not None:
                ends[row["_id"]] = at
    jobs, skipped = [], {"cancelled before start": 0, "no queue": 0, "no created_at": 0}
    guessed = 0
    for d in docs:
        created = _epoch(d.get("created_at"))
        queue = (d.get("job_data") or {}).get("job_queue")
        state = (d.get("result_data") or {}).get("job_state")
        if created is None:
            skipped["no created_at"] += 1
            continue
        if not queue:
            skipped["no queue"] += 1
            continue
        started = _epoch(d.get("started_at"))
        if started is None:
            if state == _CANCELLED:
                skipped["cancelled before start"] += 1
                continue
            duration = default_duration
            guessed += 1
        elif d.get("job_id") in ends:
            duration = ends[d["job_id"]] - started
        else:
            duration = default_duration
            guessed += 1
        jobs.append({"submit": round(created - since, 3), "queue": queue,
                     "duration": round(max(1.0, duration), 3),
                     "priority": int(d.get("job_priority") or 0)})
    jobs.sort(key=lambda j: (j["submit"], j["queue"]))
    if not jobs:
        raise ExportError(f"no job was created between {_dt(since)} and {_dt(until)} UTC"
                          + (f" on {', '.join(sorted(set(queues)))}" if queues else "")
                          + " (Testflinger keeps jobs 7 days)")
    return {"until": round(until - since, 3), "jobs": jobs,
            "exported": {"since": _dt(since).isoformat() + "Z", "until": _dt(until).isoformat() + "Z",
                         "jobs": len(jobs), "durations_guessed": guessed,
                         "skipped": {k: v for k, v in skipped.items() if v}}}


def to_yaml(trace: dict, lab: dict | None = None) -> str:
    """The trace as YAML (``lab`` first when given), ``exported`` as a header comment."""
    import yaml

    info = trace.get("exported", {})
    head = [f"# Exported from Testflinger jobs created {info.get('since')} .. {info.get('until')} "
            f"(UTC): {info.get('jobs')} jobs, {info.get('durations_guessed', 0)} durations "
            "guessed (no log fragment)."]
    if info.get("skipped"):
        head.append("# Skipped: " + ", ".join(f"{n} {k}" for k, n in info["skipped"].items()))
    if lab is None:
        head.append("# No lab: replay with `simulate --lab FILE` (or the default lab).")
    body: dict = {}
    if lab is not None:
        body["lab"] = lab
    body["until"] = trace["until"]
    body["jobs"] = trace["jobs"]
    text = yaml.safe_dump(body, sort_keys=False, default_flow_style=None, width=100)
    return "\n".join(head) + "\n" + text
