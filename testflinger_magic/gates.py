"""The dispatch gate: what ``GET /v1/job`` reads, the markers it writes, and "is this agent busy?".

One document per agent we watch, in ``magic_agent_gate`` (``_id`` = agent name)::

    {_id, fenced: bool, paused: bool, version: int, at: epoch seconds}

* ``fenced``: the agent has a ``magic_fences`` document (device lent, VM agent of a lease in
  bring-up or draining). ``paused``: a VM agent of an open lease whose ``admission`` is
  ``paused``. Both are *derived*: ``magic_fences`` and the lease documents stay the source of
  truth, and whoever changes them calls :meth:`Gates.sync` for the names concerned before doing
  anything that relies on the change (the fencer's busy check).
* A gate exists for every registered device (:meth:`Gates.ensure`, each tick) and for every VM
  agent of a lease (its fence at claim). An agent with no gate (neither a device nor a VM agent)
  costs an empty poll one read by ``_id`` and nothing else, and a poll that takes a job one more
  read (:meth:`Gates.hand_out`: it may have been registered and lent meanwhile).

:meth:`Gates.sync` is a compare-and-set on ``version``: it reads the gate, *then* the sources,
then writes ``version + 1``, retrying when the version moved. So once a fencer's sync returned,
no sync that read the sources before the fence can overwrite it (its CAS fails and it re-reads),
and the last write always reflects every committed source change (docs/architecture.md, "The
dispatch handshake").

Markers (``magic_dispatch``, ``{agent, phase: "done", job_id, queue, at}``) are written only when
a job is actually handed to a watched agent, *before* the gate is read a second time; a job handed
to an agent found fenced on that second read is given back (:meth:`Gates.give_back`).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Callable, Iterable

from . import indexes, stalejob, tfstates
from .claimchecks import ClaimChecks
from .db import DuplicateKeyErrors

log = logging.getLogger(__name__)

#: Collection names.
GATES, FENCES, DISPATCH = "magic_agent_gate", "magic_fences", "magic_dispatch"
#: A ``pending`` dispatch marker (written by versions before the gate) older than this (seconds)
#: belongs to a request that died; it no longer makes its agent count as busy. Also: a job popped
#: from one of a device's queues this recently and not yet attributed to any agent may be that
#: device's (see :meth:`Gates.unattributed_jobs`): a request and the agent's first post after it
#: take far less.
DISPATCH_PENDING_TTL = 60.0
#: Job states of a job an agent holds: popped (``running``) or in one of the phases it posts
#: (TESTFLINGER.md §1.6). Listed (not ``$nin`` terminal) so Testflinger's index on
#: ``(result_data.job_state, job_data.job_queue)`` serves the query.
HELD_JOB_STATES = sorted({tfstates.JOB_RUNNING, *tfstates.JOB_PHASES})
#: Agent states that are never idle: a phase (a job runs) or ``restart`` (testflinger#1304: the
#: agent is about to restart, possibly after finishing a job).
NOT_IDLE_STATES = frozenset(tfstates.JOB_PHASES) | {tfstates.AGENT_RESTART}
#: CAS attempts of one sync before giving up (each attempt lost to another writer, who then wrote
#: a newer value; the tick's :meth:`Gates.repair` finishes anything left).
SYNC_ATTEMPTS = 20
#: Seconds (monotonic) between the gate repair's full reads of every gate; between them it
#: reads the closed gates and counts the others (:meth:`Gates.repair`).
GATES_FULL_READ = 600.0


def marker_job_ids(markers: Iterable[dict]) -> list[str]:
    """The job ids the done markers among ``markers`` name (the jobs :meth:`Gates.busy` looks
    up), sorted."""
    return sorted({m.get("job_id") for m in markers
                   if m.get("phase") != "pending" and m.get("job_id") is not None})


class Gates(ClaimChecks):
    """The gate collection and the busy checks over Testflinger's ``jobs``/``agents``.

    ``db``: Testflinger's database; ``clock() -> epoch seconds``; ``open_states``: lease states
    that hold their device (leases.OPEN_STATES).
    """

    def __init__(self, db, clock: Callable[[], float], open_states: Iterable[str]):
        self.db = db
        self.clock = clock
        self.open_states = sorted(open_states)
        self.gates = db[GATES]
        self.fences = db[FENCES]
        self.dispatch = db[DISPATCH]
        self.leases = db["magic_leases"]
        self.agents = db["agents"]
        self.jobs = db["jobs"]
        #: Names with a gate as :meth:`repair` knows them (None: never read), and when
        #: (time.monotonic()) every gate was last read; ``_full``: the last repair read all.
        self._known: set[str] = set()
        self._known_at: float | None = None
        self._full = True

    def ensure_indexes(self) -> None:
        """Markers are looked up by agent, and by job (claim's attribution check); the table
        is :data:`testflinger_magic.indexes.INDEXES`."""
        indexes.ensure(self.db, (DISPATCH,))

    # ------------------------------------------------------------------ the hook's reads

    def read(self, agent: str) -> dict | None:
        """The gate of ``agent`` (``{_id, fenced, paused, version, at}``) or None if it is not
        watched: the one indexed read (by ``_id``) of an empty poll. No projection: the document
        is five small fields, and projecting cost the stand-in (mongomock) more than the read."""
        return self.gates.find_one({"_id": agent})

    def admit(self, agent: str) -> tuple[str | None, bool]:
        """Step 1 of a served ``GET /v1/job``, before Testflinger's handler: one read of the gate.
        Returns ``(refusal, watched)``: ``refusal`` is ``"fenced"`` or ``"paused"`` (answer 204
        and do not run the handler) or None; ``watched`` says whether a job handed out must go
        through :meth:`hand_out` (False: not our agent, nothing more to do)."""
        gate = self.read(agent)
        if gate is None:
            return None, False
        if gate.get("fenced"):
            return "fenced", True
        if gate.get("paused"):
            return "paused", True
        return None, True

    def hand_out(self, agent: str, job_id: str, queue: str | None,
                 watched: bool = True) -> str | None:
        """Step 2, after Testflinger's handler popped ``job_id`` for ``agent``: for a ``watched``
        agent (it had a gate at step 1) write the marker, *then* read the gate again; for one
        that had none, only read it again (a device registered and lent while its poll was
        between step 1 and the pop has a fenced gate now; one lent after this read is refused
        by the claim's :meth:`unattributed_jobs`). Returns None if the job may be delivered,
        else why it was given back (:meth:`give_back`): ``"fenced_late"`` (fenced between the
        two reads) or ``"error"`` (the marker or the re-read failed: the fence was not
        re-checked, so fail closed). Never raises."""
        marker = None
        try:
            if watched:
                marker = self.mark(agent, job_id, queue)
            gate = self.read(agent)
            if gate is None or not gate.get("fenced"):
                return None
            reason = "fenced_late"
        except Exception:  # noqa: BLE001 - e.g. pymongo AutoReconnect
            log.exception("dispatch marker or gate re-read failed for %s (job %s)", agent, job_id)
            reason = "error"
        try:
            if self.give_back(agent, job_id, marker):
                log.info("gave job %s back: %s (%s)", job_id, agent, reason)
        except Exception:  # noqa: BLE001
            log.exception("could not give job %s back; it stays running with no agent", job_id)
        return reason

    # ------------------------------------------------------------------ keeping gates in step

    def sync(self, names: Iterable[str]) -> None:
        """Make the gates of ``names`` reflect ``magic_fences`` and the leases' ``admission``
        (creating missing gates). CAS on ``version``: gate read first, sources second."""
        todo = sorted({n for n in names if n})
        for _ in range(SYNC_ATTEMPTS):
            if not todo:
                return
            gates = {g["_id"]: g for g in self.gates.find({"_id": {"$in": todo}})}
            fenced = {f["_id"] for f in self.fences.find({"_id": {"$in": todo}}, {"_id": 1})}
            paused = set()
            # Key order is for the stand-in only (mongomock tests keys in order; MongoDB's
            # planner picks the index): the rare condition first.
            for lease in self.leases.find({"admission": "paused", "vms.agent_name": {"$in": todo},
                                           "state": {"$in": self.open_states}},
                                          {"vms.agent_name": 1}):
                paused.update(vm.get("agent_name") for vm in lease.get("vms") or [])
            lost = []
            now = self.clock()
            for name in todo:
                want = {"fenced": name in fenced, "paused": name in paused, "at": now}
                gate = gates.get(name)
                if gate is None:
                    try:
                        self.gates.insert_one({"_id": name, "version": 1, **want})
                    except DuplicateKeyErrors:
                        lost.append(name)
                    continue
                # Written even when unchanged: bumping the version fails any concurrent sync
                # that read the sources before ours, so it re-reads them.
                res = self.gates.update_one({"_id": name, "version": gate.get("version")},
                                            {"$set": want, "$inc": {"version": 1}})
                if not res.matched_count:
                    lost.append(name)
            todo = lost
        if todo:
            log.warning("gates of %s kept changing under sync; the next tick repairs them", todo)

    def ensure(self, names: Iterable[str]) -> list[str]:
        """Create the gates missing among ``names`` (registered devices); returns those."""
        names = sorted(set(names))
        if not names:
            return []
        have = {g["_id"] for g in self.gates.find({"_id": {"$in": names}}, {"_id": 1})}
        missing = [n for n in names if n not in have]
        self.sync(missing)
        return missing

    def repair(self, watched: Iterable[str], *, fenced: set[str] | None = None,
               paused: set[str] | None = None,
               leave: Callable[[set[str]], set[str]] | None = None) -> list[str]:
        """Each tick: re-sync every gate that disagrees with its sources (a crash between a
        fence change and its sync), create missing gates of ``watched`` (registered devices and
        VM agents of leases), and drop open gates of agents no longer watched. ``fenced`` (names
        with a fence) and ``paused`` (VM agents of open leases whose admission is paused), when
        given, were read by the caller before this (the tick's shared reads) and are not read
        again. Returns the agent names whose gate disagreed (created gates are routine, not
        listed).

        What is read: only the *closed* gates (``fenced`` or ``paused``; indexes
        ``magic_agent_gate(fenced)``, ``(paused)``), and the number of gates. A gate can
        disagree with its sources in two ways, both seen from these alone: closed without a
        fence or a pause (in the closed gates, compared), or open or missing while fenced or
        paused (a fenced or paused name that is not among them). Which names have a gate at
        all (to create the missing ones of ``watched``, and drop the open ones nobody watches)
        is kept between ticks (:attr:`_known`): the names of the last full read of every gate,
        plus the gates this repair created since, minus those it dropped, plus what one read by
        ``_id`` finds of the watched names not known yet (a gate another writer created: a
        claim's VM agents, a registration). The count of gates checks that set: if it differs
        (a gate created for a name nobody watches, or deleted by another replica), or every
        :data:`GATES_FULL_READ` seconds, or on the first tick, every gate is read again, as
        before (one read of all of them).

        ``leave``: called with the disagreeing names (after the fresh look); the names it
        returns are neither synced nor listed: their own code is between its fence change and
        its sync right now (a close in progress, LeaseRepairs.repair_gates), and syncs them
        itself."""
        watched = set(watched) - {None}
        given = fenced is not None or paused is not None
        if fenced is None:
            fenced = {f["_id"] for f in self.fences.find({}, {"_id": 1})}
        if paused is None:
            paused = set()
            for lease in self.leases.find({"admission": "paused",
                                           "state": {"$in": self.open_states}},
                                          {"vms.agent_name": 1}):
                paused.update(vm.get("agent_name") for vm in lease.get("vms") or [])
        paused = set(paused) - {None}
        gates = self._gates_for_repair(watched)
        closed = {n: g for n, g in gates.items() if g.get("fenced") or g.get("paused")}
        wrong = {n for n, g in closed.items()
                 if bool(g.get("fenced")) != (n in fenced) or bool(g.get("paused")) != (n in paused)}
        wrong |= (fenced | paused) - closed.keys()
        if wrong and given:
            # The caller's fences and paused leases were read earlier in the tick: a fence
            # (a claim, a drain) or a lift since then is no disagreement. Look again, in the
            # order sync reads them (gate, then sources), at those names only.
            wrong = self._disagreeing(sorted(wrong))
        left = leave(set(wrong)) if wrong and leave is not None else set()
        wrong -= left
        changed = sorted(wrong)
        self.sync(changed)
        known = self._known
        missing = sorted(watched - known - wrong - left)  # set operations: ~3,000 names
        self.sync(missing)  # create missing
        known.update(changed, missing)
        # Gates of agents that are neither devices nor VM agents any more (deregistered devices,
        # VM agents of closed leases): those agents go back to costing one read per poll. CAS
        # on the version read (a gate closed since is left alone).
        keep = watched | fenced | paused | wrong | left
        extra = sorted(known - keep - closed.keys())
        if extra and not self._full:
            gates = {g["_id"]: g for g in self.gates.find({"_id": {"$in": extra}})}
            known.difference_update(n for n in extra if n not in gates)
        for name in extra:
            gate = gates.get(name)
            if gate is not None and gate.get("fenced") is False and gate.get("paused") is False:
                res = self.gates.delete_one({"_id": name, "version": gate.get("version")})
                if res.deleted_count:
                    known.discard(name)
        return changed

    def _gates_for_repair(self, watched: set[str]) -> dict[str, dict]:
        """The gates :meth:`repair` looks at, by name: every gate (a full read: the first tick,
        every :data:`GATES_FULL_READ` s, or when the known names do not add up), else the
        closed ones only; :attr:`_known` (the names with a gate) brought up to date either
        way; :attr:`_full` says which it was."""
        now = time.monotonic()
        if self._known_at is not None and now - self._known_at < GATES_FULL_READ:
            closed = {g["_id"]: g for g in self.gates.find(
                {"$or": [{"fenced": True}, {"paused": True}]}, {"fenced": 1, "paused": 1})}
            self._known.update(closed)
            new = sorted(watched - self._known)
            if new:  # another writer's gates (a claim's VM agents, a registration)
                self._known.update(g["_id"] for g in self.gates.find({"_id": {"$in": new}},
                                                                     {"_id": 1}))
            if self.gates.count_documents({}) == len(self._known):
                self._full = False
                return closed
        gates = {g["_id"]: g for g in self.gates.find({}, {"fenced": 1, "paused": 1,
                                                           "version": 1})}
        self._known, self._known_at, self._full = set(gates), now, True
        return gates

    def _disagreeing(self, names: list[str]) -> set[str]:
        """Those of ``names`` whose gate (read first) disagrees with their fences and paused
        leases (read after it), or that have none while fenced or paused."""
        gates = {g["_id"]: g for g in self.gates.find({"_id": {"$in": names}})}
        fenced = {f["_id"] for f in self.fences.find({"_id": {"$in": names}}, {"_id": 1})}
        paused = set()
        for lease in self.leases.find({"admission": "paused", "vms.agent_name": {"$in": names},
                                       "state": {"$in": self.open_states}}, {"vms.agent_name": 1}):
            paused.update(vm.get("agent_name") for vm in lease.get("vms") or [])
        out = set()
        for name in names:
            gate = gates.get(name)
            if gate is None:
                if name in fenced or name in paused:
                    out.add(name)
            elif bool(gate.get("fenced")) != (name in fenced) or \
                    bool(gate.get("paused")) != (name in paused):
                out.add(name)
        return out

    # ------------------------------------------------------------------ markers and give-back

    def mark(self, agent: str, job_id: str, queue: str | None) -> str:
        """Record that ``job_id`` was handed to ``agent`` (phase ``done``); returns the marker id.
        Written *before* the gate's second read (the handshake)."""
        marker_id = uuid.uuid4().hex
        self.dispatch.insert_one({"_id": marker_id, "agent": agent, "phase": "done",
                                  "job_id": job_id, "queue": queue, "at": self.clock()})
        return marker_id

    def give_back(self, agent: str, job_id: str, marker_id: str | None) -> bool:
        """Undo a hand-out the agent never receives (it was fenced between the two gate reads):
        the job goes back to ``waiting`` (CAS on ``running``; ``started_at`` and, on a newer
        Testflinger, ``result_data.agent_id`` removed) and ``agents.job_id`` is unset if the
        server set it to this job (testflinger#1253); the marker is deleted. A job cancelled
        meanwhile stays cancelled. Returns True if the job was put back."""
        res = self.jobs.update_one(
            {"job_id": job_id, "result_data.job_state": tfstates.JOB_RUNNING},
            {"$set": {"result_data.job_state": tfstates.JOB_WAITING},
             "$unset": {"started_at": "", "result_data.agent_id": ""}})
        self.agents.update_one({"name": agent, "job_id": job_id}, {"$unset": {"job_id": ""}})
        if marker_id:
            self.dispatch.delete_one({"_id": marker_id})
        return bool(res.modified_count)

    # ------------------------------------------------------------------ busy checks

    def agent_busy(self, agent: str, include_agent_doc: bool = True, include_pending: bool = True,
                   prune: bool = True) -> str | None:
        """Why ``agent`` may be running a job, or None if provably idle: :meth:`busy` for one
        agent (the fencer's check, after its fence and gate sync)."""
        return self.busy([agent], include_agent_doc=include_agent_doc,
                         include_pending=include_pending, prune=prune).get(agent)

    def busy(self, agents: Iterable[str], include_agent_doc: bool = True,
             include_pending: bool = True, prune: bool = True, *,
             agent_docs: dict[str, dict] | None = None,
             held: dict[str, str] | None = None,
             markers: list[dict] | None = None,
             job_states: dict[str, str] | None = None,
             stale_out: dict | None = None, orphans_out: list | None = None) -> dict[str, str]:
        """``{agent: why it may be running a job}`` for those of ``agents`` not provably idle,
        in a bounded number of queries whatever their number (indexes: :mod:`.indexes`).

        Busy, checked in this order (the first reason found is given): a done marker whose job
        is not terminal (markers of terminal or missing jobs before it are pruned unless
        ``prune=False``); (``include_pending``) a legacy ``pending`` marker younger than
        :data:`DISPATCH_PENDING_TTL`; a job the server attributes to the agent
        (``result_data.agent_id``, testflinger#1253) in a held state; and
        (``include_agent_doc``) the agent document: a ``job_id`` (missing and ``""`` both mean
        none: never trusted alone, hence the other checks) or a state in
        :data:`NOT_IDLE_STATES` (a phase, or ``restart``). With ``include_agent_doc``, a job an
        agent provably no longer runs (it restarted: its document is ``waiting`` and names a job
        in a phase or ended, :func:`testflinger_magic.stalejob.stale_job`) makes none of these
        three checks busy: the orphan's marker stays until the job ends. ``stale_out``, if
        given, gets ``{agent: (job_id, job_state)}`` of those agents (the snapshot's orphans).
        Likewise a job in a phase that a marker or the server attributes to an agent whose
        document is ``waiting`` and quiet for ``STALE_AFTER`` s (:func:`stalejob.quiet_waiting`:
        it restarted mid-job, perhaps ran another job since) makes it not busy;
        ``orphans_out``, if given, gets ``{"agent", "job_id", "job_state"}`` of each.

        Reads, in that order: the agent documents (``agents`` by ``name``, with
        ``updated_at``) unless ``agent_docs`` (``{name: document}``) is given or
        ``include_agent_doc`` is False, the markers (``magic_dispatch`` by ``agent``), the jobs
        they name (by ``job_id``), the states of jobs named by possibly stale documents
        (``stalejob.stale_agents``, rarely), the held jobs (by ``result_data.agent_id``) unless ``held``
        (``{agent: job_id}``, :meth:`held_by`) is given; then one ``delete_many`` of the
        pruned markers. ``markers`` (:meth:`markers` of at least ``agents``) and ``job_states``
        (``{job_id: job_state}`` of at least every job those markers name that is not terminal,
        read *after* the markers: a missing job counts as terminal) replace the first two reads
        (the snapshot reads them with the tick's other job reads). A fencer must call it only
        *after* its fence and gate sync, without anything read before the fence.
        """
        names = sorted({a for a in agents if a})
        if not names:
            return {}
        now = self.clock()
        wanted = set(names)
        if include_agent_doc and agent_docs is None:
            agent_docs = {d["name"]: d for d in self.agents.find(
                {"name": {"$in": names}}, {"name": 1, "job_id": 1, "state": 1, "updated_at": 1})}
        if markers is None:
            markers = self.markers(names)
        by_agent: dict[str, list] = {}
        for marker in markers:
            if marker.get("agent") in wanted:
                by_agent.setdefault(marker.get("agent"), []).append(marker)
        markers = by_agent
        states: dict[str, str | None] = {}
        if job_states is not None:
            states = job_states
        else:
            ids = marker_job_ids(m for ms in markers.values() for m in ms)
            if ids:
                states = self._job_states(ids)
        stale = stalejob.stale_agents(agent_docs, names, states, now, self._job_states,
                                      stale_out) if include_agent_doc else {}

        def orphan(name: str, job_id, state) -> bool:
            # Quiet waiting is looked at only for a job in a phase (a tick asks ~1,600 names;
            # few hold such a job their agent no longer runs).
            if not include_agent_doc or state not in stalejob.ORPHAN_STATES \
                    or not stalejob.quiet_waiting(agent_docs.get(name), now):
                return False
            if orphans_out is not None:
                orphans_out.append({"agent": name, "job_id": job_id, "job_state": state})
            return True
        out: dict[str, str] = {}
        pruned = []
        for name in names:
            for marker in markers.get(name, ()):
                if marker.get("phase") == "pending":
                    if include_pending and now - marker.get("at", now) < DISPATCH_PENDING_TTL:
                        out[name] = "a job request is in flight"
                        break
                    continue
                job_id = marker.get("job_id")
                if job_id in states and states[job_id] not in tfstates.JOB_TERMINAL:
                    if job_id == stale.get(name) or orphan(name, job_id, states[job_id]):
                        continue  # its agent restarted since: an orphan, kept till it ends
                    out[name] = f"job {job_id} is {states[job_id]}"
                    break
                if prune:
                    pruned.append(marker["_id"])
        rest = [n for n in names if n not in out]
        if rest:
            held_states = states
            if held is None:
                held, held_states = {}, dict(states)
                for job in self.jobs.find({"result_data.agent_id": {"$in": rest},
                                           "result_data.job_state": {"$in": HELD_JOB_STATES}},
                                          {"job_id": 1, "result_data": 1}):
                    held.setdefault(job["result_data"]["agent_id"], job.get("job_id"))
                    held_states.setdefault(job.get("job_id"), job["result_data"].get("job_state"))
            for name in rest:
                if name in held and held[name] != stale.get(name) and \
                        not orphan(name, held[name], held_states.get(held[name])):
                    out[name] = f"job {held[name]} is assigned to it"
        rest = [n for n in rest if n not in out]
        if rest and include_agent_doc:
            for name in rest:
                doc = agent_docs.get(name) or {}
                if doc.get("job_id") and doc["job_id"] != stale.get(name):
                    out[name] = f"agent reports job {doc['job_id']}"
                elif doc.get("state") in NOT_IDLE_STATES:
                    out[name] = f"agent is in state {doc['state']}"
        if pruned:
            self.dispatch.delete_many({"_id": {"$in": pruned}, "phase": "done"})
        return out

    def _job_states(self, ids) -> dict[str, str | None]:
        """``{job_id: job_state}`` of the jobs ``ids`` that exist (one read by ``job_id``)."""
        out: dict[str, str | None] = {}
        for job in self.jobs.find({"job_id": {"$in": sorted(ids)}},
                                  {"job_id": 1, "result_data.job_state": 1}):
            out.setdefault(job.get("job_id"), (job.get("result_data") or {}).get("job_state"))
        return out

    def markers(self, agents: Iterable[str]) -> list[dict]:
        """The dispatch markers of ``agents`` (one ``$in`` read by ``agent``; index
        ``magic_dispatch(agent, phase)``), for :meth:`busy`."""
        names = sorted({a for a in agents if a})
        if not names:
            return []
        # One name (a claim's check): an equality, the same index seek; the stand-in
        # (mongomock) evaluates a one-value $in per document at several times the cost.
        return list(self.dispatch.find({"agent": names[0]} if len(names) == 1
                                       else {"agent": {"$in": names}}))

    def held_by(self, agents: Iterable[str]) -> dict[str, str]:
        """``{agent: job_id}`` of the given agents that the server attributes a held job to
        (``result_data.agent_id``, newer Testflinger); one query (idle detection in gather)."""
        names = sorted(set(agents))
        if not names:
            return {}
        out: dict[str, str] = {}
        for job in self.jobs.find({"result_data.job_state": {"$in": HELD_JOB_STATES},
                                   "result_data.agent_id": {"$in": names}},
                                  {"job_id": 1, "result_data.agent_id": 1}):
            out.setdefault(job["result_data"]["agent_id"], job.get("job_id"))
        return out
