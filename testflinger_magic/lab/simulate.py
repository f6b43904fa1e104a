"""``testflinger-magic simulate``: replay a job trace in virtual time to compare policies.

A discrete-event simulation (no sleeping, no threads, no HTTP). It drives the *same* decision code
the server runs -- :func:`testflinger_magic.reconcile.plan` and the lease transition table
:data:`testflinger_magic.leases.TRANSITIONS` (every state change goes through
:func:`~testflinger_magic.leases.is_legal`, deadlines through
:func:`~testflinger_magic.leases.deadline_for`) -- and models the rest of the lab:

* **devices** (bare-metal GPU machines) whose device agents take jobs from their home queues;
* **Testflinger dispatch**: an idle, unfenced agent takes the waiting job of its queues with the
  highest ``job_priority``, ties in submission order (``database.pop_job``, TESTFLINGER.md §1.5).
  Agents are modelled as taking a job the moment one is waiting (a real testflinger-agent polls
  every ``polling_interval`` = 10 s, TESTFLINGER.md §3), so waits are low by up to 10 s;
* **the agent-host daemon**: bring-up ``claimed -(fence)-> fenced -> deploying -(deploy)->
  splitting -(split)-> enrolling -(enrol)-> active`` and tear-down ``restoring -(sum of
  teardown)-> returned``, with configurable durations (seconds). A report for a state the lease
  has left is stale (the server's 409) and dropped;
* **VM agents**: one per planned VM, created when the lease is ``active``, taking jobs of the
  magic queue while the lease is active and its admission open (the dispatch hook's fence and
  pause, server/dispatch.py).

Actions are applied as ``server/engine.py`` applies them: ``lend`` claims an idle device (fences
its agent), ``drain`` moves active -> draining with a drain document and fences the VM agents,
``undrain`` only cancels ``idle``/``consolidate`` drains, ``restore`` moves a draining lease to
restoring only when every VM agent is idle (a bring-up lease at once, counting a failure),
``force`` cancels the VM agents' jobs and restores, ``pause``/``resume`` flip admission,
``quarantine`` marks the device. Every action names the generation it was planned on; a lease that
moved since is skipped, exactly like the engine's compare-and-set.


Where the parts live: the action handlers in sim_actions.py, Testflinger's dispatch in
sim_dispatch.py, reconcile's inputs in sim_reconcile.py, the static baseline in sim_static.py,
the figures of a replay in sim_report.py and the starvation figure in sim_starve.py (mixins of
``Simulation``), the model's records in sim_model.py, ``--policy`` parsing and
``SimulationError`` in sim_policy.py (re-exported here), results and their table in
sim_results.py.

Calendar: time 0 is Monday 2024-01-01 00:00 UTC (:data:`.sim_reconcile.SIM_EPOCH`, passed as
``Inputs.wall``) for ``policy.warm`` windows and ``warm_learn``, which learns from the replay's
own submissions (``Inputs.arrivals``). Starvation (``Result.starved``,
:meth:`Simulation._starved`) is sampled after every batch of events, for policy columns only.

Reconcile runs after every batch of simultaneous events (a submission, a daemon report, a job
end: DESIGN.md "Reconcile runs on events") and on a periodic ``tick`` while anything could change
(open leases, waiting magic jobs, ``min_devices``); quiet stretches are skipped.

Trace files (docs/simulate.md): YAML or JSON ``{lab, seed, until, jobs, generate}``, or CSV with
columns ``submit,queue,duration[,priority]``. Durations are seconds or
``30s``/``10m``/``2h``/``1d``. Errors are :class:`testflinger_magic.queues.DefinitionError`
(``file:line: field: message``).
"""

from __future__ import annotations

import heapq
import math

from testflinger_magic.durations import format_duration

from testflinger_magic import leases as L
from testflinger_magic.lab.sim_results import Result, render_table
from testflinger_magic.lab.trace import (
    DAY,
    Lab,
    Trace,
    TraceJob,
    load_lab,
    load_trace,
)
from testflinger_magic import names
from testflinger_magic.queue_clashes import device_clashes
from testflinger_magic.queues import MagicQueue
from testflinger_magic.lab.sim_actions import SimActions
from testflinger_magic.lab.sim_starve import SimStarvation
from testflinger_magic.lab.sim_dispatch import SimDispatch
from testflinger_magic.lab.sim_reconcile import SimReconcile
from testflinger_magic.lab.sim_report import SimReport
from testflinger_magic.lab.sim_static import SimStatic
from testflinger_magic.lab.sim_model import _Agent, _Device, _Job, _Lease  # noqa: F401
from testflinger_magic.lab.sim_policy import (  # noqa: F401 - re-exported: simulate.<name>
    _INT_FIELDS, _POLICY_KEYS, AS_DEFINED, SimulationError, apply_policy, definition_warnings,
    parse_policy,
)

__all__ = ["Lab", "Trace", "TraceJob", "Result", "SimulationError", "load_trace", "load_lab",
           "apply_policy", "parse_policy", "simulate", "compare", "render_table", "DAY"]


# --------------------------------------------------------------------------------- simulation

class Simulation(SimActions, SimStarvation, SimDispatch, SimReconcile, SimStatic, SimReport):
    """One replay of ``trace`` under ``definitions`` (already carrying any policy overrides).

    ``run()`` returns a :class:`Result`. Deterministic: events at the same virtual time are taken
    in scheduling order, agents in name order, jobs by (priority desc, submission order).
    """

    def __init__(self, trace: Trace, definitions: list[MagicQueue], label: str = "as defined",
                 overrides: dict | None = None, static: dict[str, int] | None = None,
                 lending: bool = True):
        """``lending`` False: ``reconcile.plan`` never runs (the ``none`` baseline, and with
        ``static`` ``{queue: N}`` the ``static:N:queue`` baseline: N devices split for the queue
        at time 0, from its eligible devices, and never returned)."""
        self.lending = lending
        self.static = dict(static or {})
        self.trace = trace
        self.defs = list(definitions)
        self.qdefs = {q.name: q for q in self.defs}
        self.lab = trace.lab
        self.now = 0.0
        self.result = Result(label=label, overrides=dict(overrides or {}), jobs=len(trace.jobs),
                             kind="policy" if lending else "baseline",
                             warnings=definition_warnings(self.defs) if lending else [])
        self._events: list = []
        self._seq = 0
        self._tick_at: float | None = None
        self.devices: dict[str, _Device] = {}
        self._refuse_unregistrable([n for spec in self.lab.devices for n in spec.names()])
        for spec in self.lab.devices:
            for name in spec.names():
                self.devices[name] = _Device(spec, name, _Agent(name, tuple(spec.home_queues)))
        self._refuse_name_clashes()
        self.agents: dict[str, _Agent] = {d.name: d.agent for d in self.devices.values()}
        self.leases: dict[str, _Lease] = {}
        self.suspended: dict[str, str] = {}  # queue -> reason (Inputs.suspended; sim_actions)
        self.open: dict[str, _Lease] = {}  # leases not yet returned/failed (kept small for speed)
        self.waiting: dict[str, list] = {}  # queue -> heap of (-priority, seq, job)
        self.last_job_at: dict[str, float] = {}
        #: submission times of the magic queues that learn a warm level (Inputs.arrivals)
        self.arrived: dict[str, list[float]] = {q.name: [] for q in self.defs
                                                if q.policy.warm_learn is not None}
        #: a queue's plan depends on the calendar (warm windows, a learnt warm level): a trace
        #: with ``until`` then runs to it (no settling stop), and a fixed point waits for
        #: :meth:`_calendar_end`
        self._calendar = any(q.policy.warm or q.policy.warm_learn is not None for q in self.defs)
        self._init_starvation()
        self.jobs: list[_Job] = []
        self._lease_n = 0
        self._open_jobs = 0
        self._next_submit = 0
        b = self.lab.bringup
        self.bringup = [(L.FENCED, b.fence), (L.DEPLOYING, 0.0), (L.SPLITTING, b.deploy),
                        (L.ENROLLING, b.split), (L.ACTIVE, b.enrol)]

    # ----------------------------------------------------------------- event queue
    def _at(self, when: float, kind: str, *payload) -> None:
        self._seq += 1
        heapq.heappush(self._events, (when, self._seq, kind, payload))

    def _live(self) -> bool:
        """True if a reconcile tick could decide something that no event will trigger."""
        if not self.lending:  # baselines never plan: only their events move them
            return False
        if self.open:
            return True
        if any(q.policy.min_devices > 0 or q.policy.warm or q.policy.warm_learn is not None
               for q in self.defs):
            return True
        return any(self.waiting.get(q) for q in self.qdefs)

    def _settle(self) -> float:
        """Seconds after the last job ends within which every lease closes unless a policy keeps
        it (min_devices): idle_timeout + grace + bring-up + tear-down + two ticks."""
        pols = [q.policy for q in self.defs] or [None]
        idle = max((p.idle_timeout for p in pols if p), default=0.0)
        grace = max((p.reclaim.grace for p in pols if p), default=0.0)
        prov = max((p.provision_timeout for p in pols if p), default=0.0)
        return idle + grace + prov + self.lab.teardown.total + 2 * self.lab.tick

    # ----------------------------------------------------------------- run
    def run(self) -> Result:
        trace_jobs = self.trace.jobs
        for j in trace_jobs:
            self.jobs.append(_Job(j, len(self.jobs), j.queue in self.qdefs))
        self._open_jobs = len(self.jobs)
        if self.jobs:
            self._at(self.jobs[0].spec.submit, "submit")
        self._warn_unserved_queues()
        self._warn_after_until()
        self._split_static()
        quiet_since: float | None = None
        until = self.trace.until
        end = None
        while self._events:
            when = self._events[0][0]
            if until is not None and when > until:
                end = until
                break
            if quiet_since is not None and when > quiet_since + self._settle() \
                    and not (self._calendar and until is not None):
                break
            self.now = when
            while self._events and self._events[0][0] == when:
                _, _, kind, payload = heapq.heappop(self._events)
                if kind == "tick":  # only means "reconcile now", which every batch does
                    self._tick_at = None
                else:
                    getattr(self, f"_on_{kind}")(*payload)
            self._dispatch()
            acted = self._reconcile() if self.lending else False
            self._dispatch()
            self._sample()
            if not acted and self._fixed_point():
                # Nothing can change any more (see _fixed_point): the jobs still waiting can
                # never run. Ending here bounds the replay by construction, not by a timeout.
                if self.lending:
                    self._warn_stuck()
                end = until if until is not None else self.now
                break
            if self._open_jobs == 0 and self._next_submit >= len(self.jobs):
                if quiet_since is None:
                    quiet_since = self.now
            if self._live() and self._tick_at is None:
                tick = self.lab.tick
                self._tick_at = (math.floor(self.now / tick) + 1) * tick
                self._at(self._tick_at, "tick")
        return self._finish(self.now if end is None else end)

    def _sample(self) -> None:
        """One point of ``Result.series`` (for --plot) when something it shows changed: waiting
        jobs per magic queue and on home queues, and devices lent (open leases)."""
        self._sample_starvation()
        waiting = {q: len(self.waiting.get(q) or ()) for q in self.qdefs}
        waiting["home"] = sum(len(h) for q, h in self.waiting.items() if q not in self.qdefs)
        point = (waiting, len(self.open))
        series = self.result.series
        if not series or (series[-1][1], series[-1][2]) != point:
            series.append((self.now, waiting, len(self.open)))

    # ----------------------------------------------------------------- events
    def _on_submit(self) -> None:
        # Submissions are released one at a time so the heap stays small on long traces.
        while self._next_submit < len(self.jobs) and \
                self.jobs[self._next_submit].spec.submit <= self.now:
            job = self.jobs[self._next_submit]
            self._next_submit += 1
            q = job.spec.queue
            heapq.heappush(self.waiting.setdefault(q, []), (-job.spec.priority, job.seq, job))
            self.last_job_at[q] = self.now
            if q in self.arrived:
                self.arrived[q].append(self.now)
        if self._next_submit < len(self.jobs):
            self._at(self.jobs[self._next_submit].spec.submit, "submit")

    def _on_job_end(self, agent_name: str, job_seq: int) -> None:
        agent = self.agents.get(agent_name)
        job = self.jobs[job_seq]
        if agent is None or agent.job is not job or job.state != "running":
            return  # cancelled (force) before it ended
        self._end_job(agent, "done")

    def _on_step(self, lease_id: str, moves: int, to_state: str) -> None:
        """A daemon report ``ok`` moving the lease to ``to_state`` (stale if it moved since)."""
        lease = self.leases[lease_id]
        if lease.moves != moves:
            return  # the server answered 409; the daemon re-reads and acts on the new state
        if to_state in L.FINAL_STATES:
            self._close(lease, to_state)
            return
        self._move(lease, to_state, "agent host: ok")
        if to_state == L.ACTIVE:
            self.result.bringups += 1
            lease.idle_since = self.now  # engine._report sets idle_since on ->active
            lease.active_since = self.now
            lease.agents = [f"{lease.device}-vm{i + 1}" for i in range(lease.vms)]
            for name in lease.agents:
                self.agents[name] = _Agent(name, (lease.queue,), lease_id=lease.id,
                                           last_change=self.now)

    # ----------------------------------------------------------------- leases
    def _move(self, lease: _Lease, to_state: str, reason: str, **fields) -> None:
        """A legal transition (leases.TRANSITIONS), generation +1, deadline as the store sets it,
        and the daemon's next step scheduled."""
        if not L.is_legal(lease.state, to_state):
            raise SimulationError(f"lease {lease.id}: {lease.state} -> {to_state} is not in "
                                  f"leases.TRANSITIONS ({reason})")
        for k, v in fields.items():
            setattr(lease, k, v)
        lease.state = to_state
        lease.generation += 1
        lease.moves += 1
        lease.updated_at = self.now
        policy = self.qdefs[lease.queue].policy if lease.queue in self.qdefs else None
        lease.deadline = L.deadline_for(to_state, policy, self.now,
                                         bringup_deadline=lease.bringup_deadline,
                                         drain=lease.drain, created_at=lease.created_at)
        self._schedule_daemon(lease)

    def _schedule_daemon(self, lease: _Lease) -> None:
        """The daemon's report for the lease's current state, after that step's duration."""
        if lease.state == L.RESTORING:
            self._at(self.now + self.lab.teardown.total, "step", lease.id, lease.moves, L.RETURNED)
            return
        order = [L.CLAIMED] + [s for s, _ in self.bringup]
        if lease.state in L.BRINGUP_STATES:
            nxt, seconds = self.bringup[order.index(lease.state)]
            self._at(self.now + seconds, "step", lease.id, lease.moves, nxt)

    def _close(self, lease: _Lease, final: str) -> None:
        self._move(lease, final, "agent host: restored")
        lease.closed_at = self.now
        del self.open[lease.id]
        if lease.idle_from is not None:
            lease.idle_seconds += self.now - lease.idle_from
            lease.idle_from = None
        for name in lease.agents:
            agent = self.agents.pop(name)
            if agent.job is not None:  # cannot happen: restore waits for idle or cancels
                raise SimulationError(f"{name}: removed while running {agent.job.spec.id}")
        if final == L.RETURNED:  # failed keeps the claim (leases.LeaseStore.cleanup)
            dev = self.devices[lease.device]
            dev.lease_id = None
            dev.agent.last_change = self.now

    def _calendar_end(self) -> float:
        """With warm windows or a learnt warm level the clock itself moves the plan (lends
        without jobs): the state is settled only a week (the windows' period) or a lookback,
        whichever is longer, after the last submission."""
        last = self.jobs[-1].spec.submit if self.jobs else 0.0
        learn = max((q.policy.warm_learn.lookback for q in self.defs
                     if q.policy.warm_learn is not None), default=0.0)
        return last + max(7 * DAY, learn)

    def _fixed_point(self) -> bool:
        """True when the state can never change again: every job is submitted, no lease is open,
        no job runs, and only reconcile ticks are scheduled. ``reconcile.plan`` is pure and
        without open leases its only input that moves is the clock, which it reads only for
        leases (deadlines, idle and lease age): the next tick sees the same inputs and takes
        the same (no) action, forever."""
        if self._calendar and (self.trace.until is not None or self.now < self._calendar_end()):
            return False
        return (self._next_submit >= len(self.jobs) and not self.open
                and all(kind == "tick" for _, _, kind, _ in self._events)
                and not any(a.job is not None for a in self.agents.values()))

    def _served_queues(self) -> set[str]:
        return {q for d in self.devices.values() for q in d.spec.home_queues}

    def _refuse_unregistrable(self, device_names: list[str]) -> None:
        """SimulationError if the agent hosts could not register these devices (``device_names``
        in the trace's order): a name outside the device name rule
        (names.device_name_problem), a name listed twice, or a name clashing with another
        device's (names.vm_name_clash: equal but for case, or another's VM agent name
        ``<device>-vm<N>``), in the registration's words (server/api_hosts.py ``RegisterIn``,
        server/hostproto.py; TRIAL4 finding 5). Names are global, so every agent host of the
        trace counts."""
        problems: list[str] = []
        index: dict = {}
        seen: set = set()
        for name in device_names:
            why = names.device_name_problem(name)
            if why:
                problems.append(f"device agent_name {why}")
            elif name in seen:
                problems.append(f"device {name!r} is listed twice: each device is registered "
                                "once, with its own agent_name")
            else:
                clash = names.vm_name_clash(name, index)
                if clash:
                    problems.append(f"device agent_name {clash}")
            seen.add(name)
            index.setdefault(name.lower(), []).append(name)
        if problems:
            raise SimulationError(f"{self.trace.source}: lab.devices: the server would refuse "
                                  "this lab: " + "; ".join(problems))

    def _refuse_name_clashes(self) -> None:
        """SimulationError if a device is named like a magic queue or has one among its
        home_queues: the server refuses such a lab (a registration 409, an apply 422,
        testflinger_magic.queue_clashes; same words), and replaying it would let the device's
        own agent run the magic queue's jobs on bare metal, counted as magic jobs with no
        wait."""
        clashes = device_clashes([{"agent_name": d.name, "home_queues": d.spec.home_queues}
                                  for d in self.devices.values()], set(self.qdefs))
        if clashes:
            raise SimulationError(f"{self.trace.source}: lab.devices: the server would refuse "
                                  "this lab: " + "; ".join(clashes))

    def _warn_after_until(self) -> None:
        """Warn once for trace jobs submitted after ``until``: the replay stops at ``until``,
        so they are never submitted and count as unfinished."""
        until = self.trace.until
        late = [j for j in self.trace.jobs if until is not None and j.submit > until]
        if late:
            self.result.warnings.append(
                f"{len(late)} job(s) submitted after until ({format_duration(until)}, first at "
                f"{format_duration(late[0].submit)}) are never submitted: the replay stops at "
                "until, and they count as unfinished")

    def _warn_unserved_queues(self) -> None:
        """Warn once per queue for trace jobs on a queue that is neither a magic queue nor any
        device's home queue: no agent will ever take them."""
        known = set(self.qdefs) | self._served_queues()
        counts: dict[str, int] = {}
        for job in self.jobs:
            if job.spec.queue not in known:
                counts[job.spec.queue] = counts.get(job.spec.queue, 0) + 1
        for q, n in sorted(counts.items()):
            self.result.warnings.append(
                f"queue {q}: {n} job(s) never run: it is not a magic queue and no device of "
                "the lab has it among its home_queues")


# --------------------------------------------------------------------------------- API

def simulate(trace: Trace, definitions: list[MagicQueue], overrides: dict | None = None,
             label: str | None = None) -> Result:
    """Replay ``trace`` with ``definitions`` and optional policy ``overrides``."""
    overrides = dict(overrides or {})
    defs = apply_policy(definitions, overrides) if overrides else definitions
    if label is None:
        label = ",".join(f"{k}={v}" for k, v in overrides.items()) or "as defined"
    return Simulation(trace, defs, label, overrides).run()


def compare(trace: Trace, definitions: list[MagicQueue], policies: list[str],
            baselines: list[str] = ()) -> list[Result]:
    """One Result per ``--baseline`` text (``none``, ``static:N[:queue]``; see
    :mod:`testflinger_magic.lab.baselines`), then one per ``--policy`` text (none: the
    definitions as they are; an empty text is a column "as defined"). A static baseline brings
    a ``none`` column with it (home-queue waits are compared with it). Every policy and
    baseline is parsed and applied before the first replay, so a typo fails fast. Raises
    SimulationError."""
    from testflinger_magic.lab import baselines as B

    try:
        parsed = [B.parse_baseline(b) for b in baselines]
        if any(b.static for b in parsed) and not any(b.label == "none" for b in parsed):
            parsed.insert(0, B.parse_baseline("none"))
        seen: set[str] = set()
        parsed = [b for b in parsed if not (b.label in seen or seen.add(b.label))]
        resolved = [(b, b.resolve(trace, [q.name for q in definitions])) for b in parsed]
    except B.BaselineError as exc:
        raise SimulationError(str(exc)) from None
    sets = [(p, parse_policy(p)) for p in policies] or [(AS_DEFINED, {})]
    # A column's label is its policy text; --policy as-defined (no override) is the
    # definitions as they are, and says so.
    prepared = [(p.strip() if o else "as defined", o, apply_policy(definitions, o) if o
                 else definitions) for p, o in sets]
    labels = [label for label, _, _ in prepared]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise SimulationError(f"--policy {repeated[0]!r} is given twice: each --policy is one "
                              "column; a second would repeat the first")
    out = []
    for b, static in resolved:
        r = Simulation(trace, definitions, b.label, static=static, lending=False).run()
        r.static = static
        out.append(r)
    return out + [Simulation(trace, defs, p, o).run() for p, o, defs in prepared]
