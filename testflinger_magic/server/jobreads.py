"""The reconcile tick's reads of Testflinger's ``jobs`` collection: one ``$or`` read per tick.

A tick needs four things from ``jobs``, which it used to read with four queries (one an
aggregate that mongomock serves by copying the whole collection):

1. demand: the ``waiting`` jobs of the queues reconcile looks at (magic queues and the home
   queues of registered devices; index ``(result_data.job_state, job_data.job_queue)``);
2. held jobs: jobs in a held state a newer Testflinger attributes to one of our agents
   (``result_data.agent_id``, testflinger#1253; same index, by state);
3. the state of each job a dispatch marker names that is not terminal (by ``job_id``), read
   *after* the markers (gates.Gates.busy: a job missing here counts as terminal, so a marker
   must never be newer than this read);
4. the latest job of each magic queue, waiting or not (its ``created_at``: reconcile's
   ``QueueDemand.last_job_at``, from which idle timeouts count).

:meth:`JobReads.read` asks for 1-3 and for the magic queues' jobs *inserted* since its previous
read in one ``find`` with ``$or`` (each branch served by its own index, MongoDB's ``$or``
plan), and keeps (4) between ticks: :class:`LatestJobs` starts from one full read (the
aggregate, a DISTINCT_SCAN of ``jobs(job_data.job_queue, created_at)``: indexes.py) and then
only raises each queue's value with the jobs found since. "Inserted since" is read from the
``_id``: Testflinger lets the driver make each job's ``_id``, an ObjectId whose first four bytes
are the inserting client's clock in seconds (the BSON spec; pymongo ``bson.objectid``), so
``_id >= ObjectId.from_datetime(t)`` is every job inserted at or after ``t``, whatever its
``created_at`` says (served by the ``_id`` index). ``t`` is the start of the previous read less
:data:`INSERT_SLACK` (clock differences between server replicas, a slow insert). The full read
runs again every :data:`LATEST_REFRESH` seconds and whenever a magic queue appears (a job
deleted since the last full read, which Testflinger never does, is forgotten then).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable, Iterable

from bson import ObjectId

from testflinger_magic import tfstates
from testflinger_magic.gates import HELD_JOB_STATES

from .excludes import excluded_devices
from .snapshot import epoch

#: Seconds between full reads of the latest job of each magic queue (monotonic clock).
LATEST_REFRESH = 600.0
#: Seconds a job's ``_id`` time may lag the start of the read that should have seen it.
INSERT_SLACK = 60.0
#: Job states that are not terminal (listed, so the index on the state serves the read).
LIVE_JOB_STATES = sorted({tfstates.JOB_WAITING, *HELD_JOB_STATES})
#: Agent names and job ids are strings: these are the empty ones, left out.
_NO_NAME = frozenset({None, ""})
#: HELD_JOB_STATES as a set (membership tested per job).
_HELD = frozenset(HELD_JOB_STATES)
#: The job fields a tick uses.
JOB_FIELDS = {"job_id": 1, "job_data.job_queue": 1, "result_data.job_state": 1,
              "result_data.agent_id": 1, "created_at": 1, "job_priority": 1,
              "job_data.exclude_agents": 1}


_NOTHING: frozenset = frozenset()


def _one_of(values: list):
    """A condition matching any of ``values`` (non-empty): the value itself when there is one
    (a quick lend's one queue), else ``$in``. The same index seek on MongoDB; the stand-in
    (mongomock) evaluates a one-value ``$in`` per document at several times an equality's
    cost."""
    return values[0] if len(values) == 1 else {"$in": values}


@dataclass(frozen=True)
class JobFacts:
    """What one read says: ``demand`` (``{queue: reconcile.QueueDemand}``: the magic queues
    always, other queues with waiting jobs), ``held`` (``{agent: job_id}``, gates.Gates.held_by)
    and ``states`` (``{job_id: job_state}`` of every non-terminal job a marker named, and of
    others found; gates.Gates.busy's ``job_states``)."""

    demand: dict
    held: dict
    states: dict


class LatestJobs:
    """The latest ``created_at`` (epoch seconds) of each magic queue, kept between reads (see
    the module docstring). Thread-safe (the ticker and status requests gather at once).
    ``monotonic``/``wall``: clocks (seconds), replaceable in tests."""

    def __init__(self, db, refresh: float = LATEST_REFRESH, slack: float = INSERT_SLACK,
                 monotonic: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time):
        self.db = db
        self.refresh, self.slack = float(refresh), float(slack)
        self.monotonic, self.wall = monotonic, wall
        self._lock = threading.Lock()
        self._values: dict[str, float | None] = {}
        self._queues: frozenset = frozenset()
        self._full_at: float | None = None
        self._read_at: float | None = None  # wall time at the start of the last read

    def begin(self, magic: list[str]) -> tuple[dict | None, float]:
        """Before a read: the ``$or`` branch that finds the jobs of ``magic`` inserted since the
        previous read (None if there are no magic queues), and the read's start (pass it to
        :meth:`merge`). Runs the full read first when it is due."""
        magic = sorted(set(magic))
        start = self.wall()
        if not magic:
            return None, start
        with self._lock:
            due = (self._full_at is None or not set(magic) <= self._queues
                   or self.monotonic() - self._full_at >= self.refresh)
        if due:
            self._full(magic)
        with self._lock:
            since = self._read_at
        branch = {"job_data.job_queue": {"$in": magic}}
        if since is not None:  # the _id first: it rules out every older job at once
            branch = {"_id": {"$gte": ObjectId.from_datetime(
                datetime.fromtimestamp(since - self.slack, timezone.utc))}, **branch}
        return branch, start

    def _full(self, magic: list[str]) -> None:
        """The aggregate: ``$sort`` + ``$group`` ``$first`` per queue (a DISTINCT_SCAN)."""
        start, at = self.wall(), self.monotonic()
        values: dict[str, float | None] = {name: None for name in magic}
        for row in self.db.jobs.aggregate([
                {"$match": {"job_data.job_queue": {"$in": magic}}},
                {"$sort": {"job_data.job_queue": 1, "created_at": -1}},
                {"$group": {"_id": "$job_data.job_queue", "last": {"$first": "$created_at"}}}]):
            values[row["_id"]] = epoch(row.get("last"))
        with self._lock:
            # Replaced, not merged (a deleted job is forgotten); a job inserted while the
            # aggregate ran is found by the next read, which looks from before its start.
            self._values, self._queues = values, frozenset(magic)
            self._full_at = at
            self._read_at = start if self._read_at is None else min(self._read_at, start)

    def merge(self, newest: dict, start: float) -> None:
        """After a read that began at ``start`` (wall seconds): raise each magic queue's value
        to ``newest[queue]``, the latest ``created_at`` (epoch seconds) of that queue's jobs
        the read found (queues with no such job absent; other queues ignored)."""
        with self._lock:
            for queue, created in newest.items():
                if queue in self._values:
                    old = self._values[queue]
                    self._values[queue] = created if old is None else max(old, created)
            self._read_at = start if self._read_at is None else max(self._read_at, start)

    def values(self) -> dict[str, float | None]:
        """``{magic queue: latest created_at or None}`` as known now."""
        with self._lock:
            return dict(self._values)


class JobReads:
    """The tick's ``jobs`` read (see the module docstring). ``db``: Testflinger's database."""

    def __init__(self, db, latest: LatestJobs | None = None):
        self.db = db
        self.latest = latest or LatestJobs(db)

    def read(self, now: float, magic: list[str], relevant: Iterable[str], agents: Iterable[str],
             marker_jobs: Iterable[str], possible: dict | None = None) -> JobFacts:
        """One ``find`` (plus the full latest-job read when due): ``magic``: the magic queue
        names; ``relevant``: every queue whose demand reconcile looks at (the magic queues and
        the devices' home queues); ``agents``: the names whose held jobs count; ``marker_jobs``:
        job ids named by dispatch markers read *before* this call. ``now``: epoch seconds (for
        ``oldest_age``). ``possible``: ``{magic queue: {device: the VM agent names lending it
        gives the queue}}`` (:class:`.excludes.PossibleVMs`, or a dict): a waiting job whose
        ``exclude_agents`` names all of its queue's is not counted as demand (lending cannot
        serve it), and ``QueueDemand.avoid`` holds the devices none of whose VMs any counted
        waiting job may run (docs/api.md). On a queue neither in ``magic`` nor in ``possible``
        (a home queue), ``avoid`` holds the agent names every waiting job excludes: the devices
        they will not run on."""
        from testflinger_magic import reconcile as R  # noqa: PLC0415

        relevant = sorted(set(relevant) | set(magic))
        agents = sorted(set(agents) - _NO_NAME)  # ~2,600 names a tick: set operations
        marker_jobs = sorted(set(marker_jobs) - _NO_NAME)
        # The state first in each branch: the index's first key, and what rules out most
        # documents (finished jobs) at once.
        branches = []
        if relevant:
            branches.append({"result_data.job_state": tfstates.JOB_WAITING,
                             "job_data.job_queue": _one_of(relevant)})
        mine = ([{"result_data.agent_id": _one_of(agents)}] if agents else []) + \
            ([{"job_id": _one_of(marker_jobs)}] if marker_jobs else [])
        if mine:
            # Jobs our agents hold, and the jobs markers name that are not terminal (a job
            # given back to waiting is one: Gates.give_back).
            branches.append({"result_data.job_state": {"$in": LIVE_JOB_STATES}, "$or": mine})
        latest_branch, start = self.latest.begin(magic)
        if latest_branch is not None:
            branches.append(latest_branch)
        jobs = list(self.db.jobs.find({"$or": branches}, JOB_FIELDS)) if branches else []
        # One pass over the jobs (a steady tick reads ~1,600 of them at 1,000 devices): each
        # job's created_at converted once, for the latest jobs and for the demand.
        wanted, held_agents, magic_set = set(relevant), set(agents), set(magic)
        acc: dict[str, list] = {}  # queue -> [waiting, max priority, oldest, last]
        # magic queue -> devices none of whose VMs any waiting job may run (QueueDemand.avoid)
        avoids: dict[str, frozenset] = {}
        # magic queue -> VM agent names every counted waiting job excludes (avoid_agents)
        avoid_agents: dict[str, frozenset] = {}
        held: dict[str, str] = {}
        states: dict[str, str] = {}
        newest: dict = {}  # queue -> latest created_at of the jobs found (LatestJobs.merge)
        newest_naive: dict = {}  # the same among naive datetimes, as datetimes
        waiting = tfstates.JOB_WAITING
        for job in jobs:
            result = job.get("result_data") or {}
            state = result.get("job_state")
            job_id = job.get("job_id")
            if job_id is not None:
                states.setdefault(job_id, state)
            if state in _HELD and result.get("agent_id") in held_agents:
                held.setdefault(result["agent_id"], job_id)
            queue = (job.get("job_data") or {}).get("job_queue")
            at = job.get("created_at")
            if type(at) is datetime and at.tzinfo is None:
                # The usual case (pymongo returns naive UTC datetimes): compared as they are,
                # converted once per queue below (their order is their epoch seconds' order).
                old = newest_naive.get(queue)
                if old is None or at > old:
                    newest_naive[queue] = at
                if state != waiting or queue not in wanted:
                    continue
                created = epoch(at) or now
            else:
                created = epoch(at)
                if created is not None:
                    old = newest.get(queue)
                    newest[queue] = created if old is None else max(old, created)
                if state != waiting or queue not in wanted:
                    continue
                created = created or now
            if possible is not None and queue in possible:
                exclude = (job.get("job_data") or {}).get("exclude_agents")
                if exclude:  # the queue's possible VMs are worked out now (PossibleVMs)
                    avoid = excluded_devices(exclude, possible[queue])
                    if avoid is None:
                        continue  # no VM agent lending can give the queue may run it
                    old = avoids.get(queue)
                    avoids[queue] = avoid if old is None else old & avoid
                    names = frozenset(n for n in exclude if isinstance(n, str)) \
                        if isinstance(exclude, (list, tuple)) else _NOTHING
                    old = avoid_agents.get(queue)
                    avoid_agents[queue] = names if old is None else old & names
                else:
                    avoids[queue] = avoid_agents[queue] = _NOTHING
            elif queue not in magic_set:  # a home queue: the device agents its jobs exclude
                exclude = (job.get("job_data") or {}).get("exclude_agents")
                names = frozenset(n for n in exclude if isinstance(n, str)) \
                    if isinstance(exclude, (list, tuple)) else _NOTHING
                old = avoids.get(queue)
                avoids[queue] = names if old is None else old & names
            a = acc.get(queue)
            if a is None:
                acc[queue] = [1, max(0, int(job.get("job_priority") or 0)), created, created]
                continue
            a[0] += 1
            a[1] = max(a[1], int(job.get("job_priority") or 0))
            a[2] = min(a[2], created)
            a[3] = max(a[3], created)
        for queue, at in newest_naive.items():
            old, created = newest.get(queue), epoch(at)
            newest[queue] = created if old is None else max(old, created)
        self.latest.merge(newest, start)
        latest = self.latest.values()
        demand = {}
        for name in set(acc) | set(magic):
            a = acc.get(name)
            last = a[3] if a else None
            if latest.get(name) is not None:
                last = latest[name] if last is None else max(last, latest[name])
            demand[name] = R.QueueDemand(
                waiting=a[0] if a else 0, max_priority=a[1] if a else 0,
                oldest_age=max(0.0, now - a[2]) if a else 0.0, last_job_at=last,
                avoid=avoids.get(name, _NOTHING) if a else _NOTHING,
                avoid_agents=avoid_agents.get(name, _NOTHING) if a else _NOTHING)
        return JobFacts(demand=demand, held=held, states=states)
