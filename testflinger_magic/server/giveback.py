"""Verified give-back, server side: a returned device's agent must be seen alive within a bound.

The daemon's restore starts the device agent program and reports ``returned``
(agent_host/steps.py ``restore``, after ``verify_gpus_back``). supervisord's RUNNING proves
little: the charm's programs have ``startsecs=0`` (TESTFLINGER.md §6.2), so an agent that exits at
once (its metrics port taken, a broken config) is RUNNING most of the time while it crash-loops.
What proves the agent came up is what it does at startup: testflinger-agent re-posts its state and
advertised queues (``POST /v1/agents/data/<name>``, which stamps ``agents.updated_at``:
TESTFLINGER.md §1.8, §3.3) before it polls ``GET /v1/job``. The plugin itself never writes
``updated_at`` (``LeaseStore._restore_device_agent`` only sets state and comment), and the
dispatch hook writes nothing on a poll, so a fresh ``updated_at`` is the agent's own.

Each tick :meth:`GiveBackWatch.check` reads the recently returned leases not yet judged (one
indexed query) and their device agents' documents (one ``$in`` query; both are the tick's shared
reads, :class:`~testflinger_magic.tickreads.TickReads`, which the snapshot uses too), and :func:`verdicts`
decides, purely: ``verified`` once ``updated_at`` is later than the moment the lease entered
``restoring`` (the agent program was stopped from ``fenced`` on, so only the restarted agent
posts after that; the return is reported once the agent was started, and its startup post may
land before or after it), ``overdue`` once ``bound`` seconds passed after the return without
that. The same facts keep the planner from lending the device again before its agent posted
(``Snapshot._returning``, ``reconcile.DeviceView.agent_back``): that startup post says
``waiting`` and would undo a new claim's ``offline``. A verdict is recorded on the lease with a compare-and-set
(``giveback`` absent -> ``{state, at}``), so replicas judge each lease once; an overdue one
quarantines the device with the reason and records ``device.giveback_failed`` for the lease's
queue (its webhooks hear of it).
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Callable

log = logging.getLogger(__name__)

#: Seconds a returned device's agent has to show it is alive (post its state) by default.
DEFAULT_BOUND = 600.0
#: Returned leases older than this many bounds are never judged (history from before this check
#: existed, or a server that was down for longer: their agents' state says nothing now).
HORIZON_BOUNDS = 4


def _epoch(value) -> float | None:
    """``agents.updated_at`` as epoch seconds: Testflinger stores a datetime (UTC); the lab and
    old documents may hold a number. None when absent or unreadable."""
    if isinstance(value, datetime):
        return value.timestamp()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def verdicts(leases: list[dict], agents: dict[str, dict], now: float, bound: float
             ) -> tuple[list[dict], list[dict]]:
    """Pure: ``(verified, overdue)`` among ``leases`` (``returned`` lease documents with
    ``device``, ``updated_at``: the time of the return, and ``history``: its last entries, for
    when it entered ``restoring``; epoch seconds), given ``agents`` (``{device agent name:
    agents document}``), the time ``now`` and ``bound`` (seconds). Leases still within the
    bound and not yet seen are in neither list."""
    verified, overdue = [], []
    for lease in leases:
        returned_at = float(lease.get("updated_at") or 0.0)
        since = max((float(h.get("at") or 0.0) for h in lease.get("history") or ()
                     if h.get("state") == "restoring"), default=returned_at)
        seen = _epoch((agents.get(lease["device"]) or {}).get("updated_at"))
        if seen is not None and seen > since:
            verified.append(lease)
        elif now - returned_at >= bound:
            overdue.append(lease)
    return verified, overdue


class GiveBackWatch:
    """Judge returned leases (see the module docstring).

    ``db``: Testflinger's database (``magic_leases``, ``agents``); ``events``: the event log;
    ``quarantine(device, on, reason, queue=None)``: the engine's CAS quarantine; ``clock``:
    epoch seconds; ``bound``: seconds (``DEFAULT_BOUND``)."""

    def __init__(self, db, events, quarantine: Callable, clock: Callable[[], float],
                 bound: float = DEFAULT_BOUND):
        self.db = db
        self.events = events
        self.quarantine = quarantine
        self.clock = clock
        self.bound = float(bound)

    def ensure_indexes(self) -> None:
        """The tick's query: returned leases by return time (``state``, ``updated_at``; listed
        in :data:`testflinger_magic.indexes.INDEXES`)."""
        from testflinger_magic import indexes  # noqa: PLC0415

        indexes.ensure(self.db, ("magic_leases",))

    def horizon(self, now: float) -> float:
        """Epoch seconds before which a returned lease is never judged (``HORIZON_BOUNDS``
        bounds before ``now``)."""
        return now - HORIZON_BOUNDS * self.bound

    def check(self, reads=None) -> dict[str, list[str]]:
        """One pass: two reads (the tick's, when ``reads``, its
        :class:`~testflinger_magic.tickreads.TickReads`, is given: the snapshot reads the same
        returned leases and agent documents), then one CAS per verdict. Returns
        ``{"verified": [lease ids], "overdue": [lease ids]}`` (those this call recorded)."""
        from testflinger_magic.tickreads import TickReads  # noqa: PLC0415

        now = self.clock()
        reads = reads or TickReads(self.db)
        leases = reads.recently_returned(self.horizon(now))
        if not leases:
            return {"verified": [], "overdue": []}
        agents = reads.agents({lease["device"] for lease in leases})
        verified, overdue = verdicts(leases, agents, now, self.bound)
        done: dict[str, list[str]] = {"verified": [], "overdue": []}
        for lease in verified:
            if self._mark(lease, "verified", now):
                done["verified"].append(lease["_id"])
        for lease in overdue:
            if not self._mark(lease, "overdue", now):
                continue
            done["overdue"].append(lease["_id"])
            reason = (f"device agent {lease['device']} was not seen (no state posted to the "
                      f"server) within {self.bound:.0f}s after lease {lease['_id']} gave the "
                      "device back: it may be crash-looping under supervisord; look at its "
                      "program, then unquarantine")
            self.quarantine(lease["device"], True, reason, queue=lease.get("queue"))
            self.events.record("device.giveback_failed", f"{lease['device']}: {reason}",
                               queue=lease.get("queue"), device=lease["device"],
                               lease_id=lease["_id"])
        return done

    def _mark(self, lease: dict, state: str, now: float) -> bool:
        res = self.db.magic_leases.update_one(
            {"_id": lease["_id"], "state": "returned", "giveback": {"$exists": False}},
            {"$set": {"giveback": {"state": state, "at": now}}})
        return bool(res.modified_count)
