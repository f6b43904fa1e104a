"""The checks a claim runs on its device's agent after the fence: is it running a job, and
were jobs of its queues just handed out that may be its? (:class:`ClaimChecks`, a mixin of
:class:`testflinger_magic.gates.Gates`: it uses ``self.jobs``, ``self.agents``,
``self.dispatch``, ``self.clock``, ``self.markers`` and ``self.busy``, and the constants of
:mod:`testflinger_magic.gates`, imported where used: gates imports this module.)"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Iterable



def _utc(epoch_seconds: float) -> datetime:
    """Naive UTC datetime (what pymongo returns for Testflinger's stored datetimes)."""
    return datetime.fromtimestamp(epoch_seconds, timezone.utc).replace(tzinfo=None)


def _recent(job: dict, cutoff: datetime) -> bool:
    """What ``{"$or": [{"started_at": {"$gte": cutoff}}, {"started_at": {"$exists": False}}]}``
    (``cutoff``: naive UTC) says of ``job``: no ``started_at`` key, or a datetime at or after
    ``cutoff`` (an aware one compared in UTC: a tz-aware client returns those). A ``null`` or a
    value of another type is not recent, as MongoDB's comparison (type bracketing) says."""
    if "started_at" not in job:
        return True
    at = job["started_at"]
    if not isinstance(at, datetime):
        return False
    if at.tzinfo is not None:
        at = at.astimezone(timezone.utc).replace(tzinfo=None)
    return at >= cutoff


class ClaimChecks:
    """The claim's checks (module docstring)."""

    def unattributed_jobs(self, agent: str, queues: Iterable[str]) -> list[str]:
        """Jobs of ``queues`` (the queues ``agent`` polls) popped in the last
        :data:`DISPATCH_PENDING_TTL` s (or not yet stamped ``started_at``) that no agent has
        claimed yet: no ``result_data.agent_id``, no agent document with that ``job_id``, no
        marker. Any of them may be ``agent``'s: a poll that read no gate (the agent was not
        watched yet) writes no marker, and an older agent posts its ``job_id`` only after
        receiving the job (TESTFLINGER.md §3.5). Jobs attributed to ``agent`` itself are listed
        too. The claim refuses while this is non-empty; the next tick tries again (it runs the
        same check in :meth:`claim_checks`, sharing the ``jobs`` read of the busy check)."""
        queues = sorted(set(queues or ()))
        if not queues:
            return []
        recent = list(self.jobs.find(self._recent_filter(queues),
                                     {"job_id": 1, "result_data.agent_id": 1}))
        return self._unattributed(agent, recent)

    def _recent_filter(self, queues: list[str]) -> dict:
        """The jobs of ``queues`` in a held state popped in the last
        :data:`DISPATCH_PENDING_TTL` s, or not stamped ``started_at`` yet (index
        ``jobs(result_data.job_state, job_data.job_queue)``). :func:`_recent` tells the same of
        one document."""
        from .gates import DISPATCH_PENDING_TTL, HELD_JOB_STATES  # noqa: PLC0415 (a cycle)

        return {"job_data.job_queue": {"$in": queues},
                "result_data.job_state": {"$in": HELD_JOB_STATES},
                "$or": [{"started_at": {"$gte": _utc(self.clock() - DISPATCH_PENDING_TTL)}},
                        {"started_at": {"$exists": False}}]}

    def _unattributed(self, agent: str, recent: list[dict]) -> list[str]:
        """Of ``recent`` (documents :meth:`_recent_filter` selects, with ``job_id`` and
        ``result_data.agent_id``), the jobs that may be ``agent``'s: attributed to it, or to no
        agent and named by no other agent's document and by no marker (two reads, only when
        such jobs exist)."""
        if not recent:
            return []
        out, ids = [], []
        for job in recent:
            owner = (job.get("result_data") or {}).get("agent_id")
            if owner == agent:
                out.append(job["job_id"])
            elif not owner:
                ids.append(job["job_id"])
        if ids:
            # Claimed by ANOTHER agent's document: one the device's own agent posts (it got the
            # job between the claim's busy check and this read) is the device's, so listed.
            claimed = {a.get("job_id") for a in self.agents.find(
                {"job_id": {"$in": ids}, "name": {"$ne": agent}}, {"job_id": 1})}
            claimed |= {m.get("job_id") for m in self.dispatch.find({"job_id": {"$in": ids}},
                                                                    {"job_id": 1})}
            out += [j for j in ids if j not in claimed]
        return sorted(out)

    def claim_checks(self, agent: str, queues: Iterable[str]) -> tuple[str | None, list[str]]:
        """The checks a claim runs after its fence, gate sync and agent-document CAS:
        ``(busy, loose)``: why ``agent`` may be running a job (:meth:`agent_busy` without the
        agent document, which the claim's CAS checked; ``include_pending``, pruning markers of
        finished jobs), or None; and, when it is not busy, :meth:`unattributed_jobs` of
        ``queues`` (the queues it polls), else ``[]``.

        The same answers as those two calls made one after the other, in fewer reads: the
        markers of ``agent``, then ONE ``jobs`` read, an ``$or`` of the jobs the markers name
        (index ``jobs(job_id)``), the held jobs attributed to ``agent`` and the recent held jobs
        of ``queues`` (both ``jobs(result_data.job_state, job_data.job_queue)``), each branch
        told apart again here; then, only when recent jobs nobody owns exist, the agents and
        markers naming them. Both old reads came after the fence, and so does this one: a job
        popped by a poll that passed the gate before the fence is in it (the dispatch
        handshake, module docstring)."""
        from .gates import HELD_JOB_STATES, marker_job_ids  # noqa: PLC0415 (a cycle)

        markers = self.markers([agent])
        ids = marker_job_ids(markers)
        queues = sorted(set(queues or ()))
        branches = []
        if ids:
            branches.append({"job_id": {"$in": ids}})
        # Key order is for the stand-in only (mongomock tests keys in order; MongoDB's planner
        # picks the index): the rare condition first.
        branches.append({"result_data.agent_id": agent,
                         "result_data.job_state": {"$in": HELD_JOB_STATES}})
        if queues:
            branches.append(self._recent_filter(queues))
        cutoff = branches[-1]["$or"][0]["started_at"]["$gte"] if queues else None
        jobs = list(self.jobs.find({"$or": branches} if len(branches) > 1 else branches[0],
                                   {"job_id": 1, "job_data.job_queue": 1, "started_at": 1,
                                    "result_data.job_state": 1, "result_data.agent_id": 1}))
        named = set(ids)
        states: dict[str, str | None] = {}
        held: dict[str, str] = {}
        recent = []
        wanted = set(queues)
        for job in jobs:
            result = job.get("result_data") or {}
            state = result.get("job_state")
            if job.get("job_id") in named:
                states.setdefault(job["job_id"], state)
            if state not in HELD_JOB_STATES:
                continue
            if result.get("agent_id") == agent:
                held.setdefault(agent, job.get("job_id"))
            if (job.get("job_data") or {}).get("job_queue") in wanted and \
                    _recent(job, cutoff):
                recent.append(job)
        busy = self.busy([agent], include_agent_doc=False, markers=markers,
                         job_states=states, held=held).get(agent)
        if busy:
            return busy, []
        return None, self._unattributed(agent, recent)
