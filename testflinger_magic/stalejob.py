"""Is an agent document's ``job_id`` stale (its agent restarted and no longer runs that job)?

A testflinger-agent that restarts in the middle of a job (the agent-host charm's ``supervisorctl
update`` after it rewrote ``conf.d``, a crash, an OOM kill) never resumes the job and never
clears the ``job_id`` of its agent document. What the fe381ff agent does (canonical/testflinger
``agent/src/testflinger_agent/agent.py``, read at fe381ff; TESTFLINGER.md §3.2-3.5):

* at startup (``TestflingerAgent.__init__``) it posts ``{"state": "waiting", "comment": ""}``,
  then ``_post_initial_agent_data``: ``{location, queues, provision_type[, identifier]}``: no
  ``job_id``, so the one of the job it was running stays; then it asks for a *new* job
  (``process_jobs``; ``retry_old_results`` only re-sends outcomes it saved, it never resumes);
* it posts ``{"job_id": X}`` right after ``GET /v1/job`` handed X out (the job is ``running``),
  then for each phase ``POST /v1/result/X {"job_state": phase}`` immediately followed by
  ``{"state": phase}`` (``post_job_state`` then ``set_agent_state``), and only after the job's
  outcome (``transmit_job_outcome``: ``job_state`` ``complete``) ``{"job_id": ""}`` and then
  ``waiting``;
* the server stamps ``agents.updated_at`` on every post (``api/v1.py::agents_post``); the
  heartbeat re-posts only after a day (``handlers.py::AgentHeartbeatHandler``).

So a *running* agent shows ``waiting`` with ``job_id`` X only: (a) while X is still ``running``
(from the pop to the first phase: attachments are downloaded then, which may take minutes),
(b) for the instant between the job's ``setup`` post and the agent's own, (c) for the instant
between the outcome (``complete``) and ``{"job_id": ""}``, (d) while it runs the cleanup of a job
cancelled before its first phase (``cancelled``). A newer Testflinger (testflinger#1253) sets
``agents.job_id`` itself at ``job_get`` and ``$unset``s it on a cancel or a terminal result
(``clear_agent_job``), i.e. it already calls the agent of a cancelled or finished job free, (d)
included; a restart in a phase leaves it set there too.

The rule (:func:`stale_job`): the document names job X, its state is exactly ``waiting``, the
agent has posted nothing for :data:`STALE_AFTER` seconds (the instants (b) and (c) are over),
and X is in a phase (``setup`` .. ``reserve``), terminal, or missing. Never stale: X ``running``
(case (a): an agent downloading attachments looks the same as one that died then; the drain's
force timeout ends those), an unknown post time, any other agent state (a phase, ``restart``
(testflinger#1304), ``offline``/``maintenance``). Pure.
"""

from __future__ import annotations

from datetime import datetime, timezone

from testflinger_magic import tfstates

#: Seconds an agent must have posted nothing for before its ``waiting`` document with a job in
#: a phase counts as stale: far above the instant between the agent's paired posts
#: (``post_job_state`` then ``set_agent_state``; the outcome then ``{"job_id": ""}``), and short
#: next to a lease's ``idle_timeout`` and drain grace.
STALE_AFTER = 120.0
#: Job states a job is left in by an agent that restarted after its first phase began.
ORPHAN_STATES = frozenset(tfstates.JOB_PHASES)
#: Job states whose agent document, once stale, names a job nobody runs.
STALE_JOB_STATES = ORPHAN_STATES | tfstates.JOB_TERMINAL


def epoch(value) -> float | None:
    """``updated_at`` as epoch seconds: a datetime (naive = UTC, as pymongo returns them; an
    aware one converted), a number (epoch seconds) kept; anything else (None, a string) None."""
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value.timestamp()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def stale_job(doc: dict | None, job_state: str | None, now: float,
              job_exists: bool = True) -> str | None:
    """Why the agent of ``doc`` (an ``agents`` document: ``state``, ``job_id``, ``updated_at``)
    is provably not running the job its ``job_id`` names, or None (it may be, or names none).

    ``job_state``: that job's ``result_data.job_state`` (None if unknown); ``job_exists``: False
    if the job is not in ``jobs`` at all; ``now``: epoch seconds (the server's clock, which
    stamps ``updated_at``). The rule and its sources: the module docstring."""
    doc = doc or {}
    job_id = doc.get("job_id")
    if not job_id or not quiet_waiting(doc, now):
        return None
    posted = epoch(doc.get("updated_at"))
    if not job_exists:
        what = "no longer exists"
    elif job_state in STALE_JOB_STATES:
        what = f"is {job_state}"
    else:
        return None
    return (f"agent restarted: it posted waiting at {_when(posted)} and nothing since, while "
            f"its document still names job {job_id}, which {what} (testflinger-agent never "
            "resumes a job after a restart)")


def quiet_waiting(doc: dict | None, now: float) -> bool:
    """True if the agent of ``doc`` runs no job in a phase at all: its state is exactly
    ``waiting`` and it has posted nothing for :data:`STALE_AFTER` seconds. A running agent posts
    each phase as its state (``set_agent_state``), so a job in a phase that its dispatch marker
    or the server (``result_data.agent_id``) attributes to such an agent is an orphan, whichever
    job the document names: it restarted mid-job, and may since have taken and finished another
    (TRIAL4 finding 7). A job still ``running`` (popped, before its first phase) is not judged
    (:func:`stale_job`'s case (a))."""
    doc = doc or {}
    if doc.get("state") != tfstates.AGENT_WAITING:
        return False
    posted = epoch(doc.get("updated_at"))
    return posted is not None and now - posted >= STALE_AFTER


def orphaned(doc: dict | None, job_state: str | None, now: float) -> bool:
    """True if the job ``doc`` names is stale (:func:`stale_job`) *and* still in a phase: it
    will never end by itself: nobody runs it, and the server never times a job out (it only
    deletes it 7 days after its creation: the ``jobs`` TTL index, ``database.py::create_indexes``)."""
    return job_state in ORPHAN_STATES and stale_job(doc, job_state, now) is not None


def stale_claims(docs: dict[str, dict], names, states: dict[str, str | None],
                 now: float) -> dict[str, str]:
    """``{agent: job_id}`` of the ``names`` whose document (in ``docs``, ``{name: document}``)
    names a job it provably no longer runs (:func:`stale_job`). ``states``: ``{job_id:
    job_state}`` of every job :func:`candidates` lists that exists (one missing from it is taken
    as gone from ``jobs``)."""
    out = {}
    for name in names:
        doc = docs.get(name)
        job_id = (doc or {}).get("job_id")
        if job_id and stale_job(doc, states.get(job_id), now, job_exists=job_id in states):
            out[name] = job_id
    return out


def candidates(docs: dict[str, dict], names, now: float) -> set[str]:
    """The job ids named by the documents of ``names`` that could be stale (state ``waiting``,
    no post for :data:`STALE_AFTER` s): the jobs whose states :func:`stale_claims` needs."""
    out = set()
    for name in names:
        doc = docs.get(name) or {}
        if doc.get("job_id") and quiet_waiting(doc, now):
            out.add(doc["job_id"])
    return out


def stale_agents(docs: dict[str, dict], names, states: dict, now: float, read_states,
                 out: dict | None = None) -> dict[str, str]:
    """:func:`stale_claims` of ``names``, the states of the :func:`candidates` missing from
    ``states`` fetched by ``read_states(ids) -> {job_id: job_state}`` (called only when some
    are missing: a ``waiting`` document quiet for :data:`STALE_AFTER` s names a job not among
    them; a job it does not return is gone). ``out``, if given, gets ``{agent: (job_id,
    job_state or None if gone)}``. Pure but for ``read_states``."""
    ids = candidates(docs, names, now)
    if not ids:
        return {}
    known = {j: states[j] for j in ids if j in states}
    if len(known) < len(ids):
        known.update(read_states(sorted(ids - set(known))))
    claims = stale_claims(docs, names, known, now)
    if out is not None:
        out.update({a: (j, known.get(j)) for a, j in claims.items()})
    return claims


def _when(epoch_seconds: float) -> str:
    return datetime.fromtimestamp(epoch_seconds, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
