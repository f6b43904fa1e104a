"""PURE decisions: what to do now about magic queues, devices and leases.

``plan(inputs) -> [Action]``: no I/O, no clock, no database. The same code runs in the server's
engine (which gathers :class:`Inputs` from MongoDB and applies the actions with compare-and-set),
in ``testflinger-magic plan`` (a dry run that prints the reasons) and in the simulator.

Rules (../shared/DESIGN.md "Reconcile"), per queue, highest ``policy.priority`` first:

* lease lifecycle: a bring-up lease past its deadline -> ``restore`` (data ``failure: True``); a
  draining lease whose VM agents are all idle -> ``restore``; past its grace -> ``force``. A
  forced drain (``drain.forced_at`` set by the engine's force) stays ``draining`` until every VM
  agent is idle (agents notice a cancel only every 10 s and never during provision), and only
  after ``drain.force_until`` -> ``restore`` anyway (data ``force_timeout: True``); a force whose
  cancel was not recorded (``drain.cancelled`` None: the server died after committing it) is
  planned again;
* demand returns: ``resume`` paused leases, ``undrain`` idle/consolidation drains, then ``lend``
  devices until supply covers demand (supply = idle VM agents of open-admission active leases +
  VMs not yet reporting, which covers every bring-up lease), within ``max_devices`` and
  ``max_starting``; ``min_devices`` are lent even with zero demand;
* owner reclaim (a home queue's oldest job waited longer than ``reclaim.owner_wait``; only as
  many devices as its waiting jobs need, less those already returning, idlest first) and
  ``max_lease`` -> ``drain`` with ``reclaim.grace``; idleness for ``idle_timeout`` -> ``drain``
  (never below ``min_devices``);
* consolidation by admission: when the other leases' idle VMs cover demand, ``pause`` the
  least-busy lease so it empties first; a paused lease that emptied -> ``drain``;
* a device whose ``failures`` reached the lowest ``failures_before_quarantine`` of the queues that
  may use it -> ``quarantine``;
* a queue in ``Inputs.suspended`` (its definition made a lease fail; the server clears it when the
  definition is applied again) lends nothing, not even for ``min_devices``; its leases keep their
  lifecycle.

With ``plan(inputs, explain=True)`` the plan also says why demand stays unmet, as non-acting
``blocked`` actions (:data:`NON_ACTING`; executors ignore them): the queue is suspended, no device
can be lent (with counts: quarantined, lent, busy at home, owner's jobs waiting, idle), or
``max_devices`` or ``max_starting`` is reached.
``data = {"why": "suspended" | "no_device" | "max_devices" | "max_starting", ...}``.

Drain actions carry ``data = {"kind", "grace" (seconds), "force": False}``, ``kind`` one of
``idle``, ``consolidate``, ``reclaim``, ``max_lease``, ``orphan``. The engine must store ``kind``
in the lease's ``drain`` document: only ``idle`` and ``consolidate`` drains are ever undrained.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from testflinger_magic.leases import ACTIVE, BRINGUP_STATES, DRAINING, FAILED, OPEN_STATES, RESTORING

ACTION_KINDS = ("lend", "drain", "undrain", "force", "restore", "pause", "resume", "quarantine",
                "blocked")
#: Kinds that only explain (``plan(..., explain=True)``); executors must do nothing for them.
NON_ACTING = frozenset({"blocked"})
#: Drain kinds that demand may cancel (the others are the owner's or the policy's).
UNDRAINABLE = frozenset({"idle", "consolidate"})
#: Grace (seconds) for leases whose queue definition was removed.
ORPHAN_GRACE = 900.0
#: An agent host whose last heartbeat is older than this (seconds; a few of the daemon's 30 s
#: heartbeat / long-poll intervals) is reported stale: its leases are not being worked.
STALE_HOST_AFTER = 120.0
#: Seconds after a lease became ``active`` during which its VMs that have no Testflinger agent
#: yet still count as "coming" (supply, and a reason not to drain for idleness). The daemon
#: starts every VM agent before reporting ``active`` and an agent posts its state within
#: seconds, so a VM still silent after this has failed to start: without a bound one dead VM
#: agent would keep an 8-GPU machine lent until ``max_lease``. The server passes it in
#: ``Inputs.vm_agent_grace`` (Engine.vm_agent_grace), so a lab or a test can shrink it.
VM_AGENT_GRACE = 120.0


@dataclass(frozen=True)
class QueueDemand:
    """Jobs waiting on a queue (magic or home): ``waiting`` count, ``max_priority`` of those
    jobs, ``oldest_age`` seconds the oldest has waited, ``last_job_at`` epoch seconds of the last
    job submitted or started (None: never)."""

    waiting: int = 0
    max_priority: int = 0
    oldest_age: float = 0.0
    last_job_at: float | None = None


@dataclass(frozen=True)
class DeviceView:
    """A registered device (``magic_devices``) joined with its Testflinger ``agents`` document.
    ``agent_state``/``job_id`` from ``agents``; ``last_home_use`` epoch seconds or None."""

    name: str
    agent_host: str
    gpus: int
    tags: tuple | list = ()
    home_queues: tuple | list = ()
    agent_state: str | None = None
    job_id: str | None = None
    quarantined: bool = False
    failures: int = 0
    last_home_use: float | None = None
    registered: bool = True


def _picking_up(planner, d) -> bool:
    """Added to both planners with TRIAL5 finding 5: the agent posted ``waiting`` within
    AGENT_PICKUP (15 s) and asks for a home job now."""
    return d.last_home_use is not None and planner.now - d.last_home_use <= 15.0


@dataclass(frozen=True)
class LeaseView:
    """A lease as reconcile sees it; ``vms`` is the planned VM count, ``drain`` the lease's drain
    document (``{reason, kind, requested_at, grace_until, forced}``) or None."""

    id: str
    device: str
    queue: str
    state: str
    generation: int
    created_at: float
    updated_at: float
    deadline: float | None
    vms: int
    drain: dict | None = None
    admission: str = "open"
    idle_since: float | None = None
    #: When the lease first became ``active`` (epoch seconds; None: unknown or not yet), and the
    #: planned VM agent names: together they tell which VM agents are missing (VM_AGENT_GRACE).
    active_since: float | None = None
    vm_names: tuple | list = ()


@dataclass(frozen=True)
class VMAgentView:
    """A VM agent of a lease; ``busy`` = running or about to run a job (LeaseStore.agent_busy)."""

    name: str
    lease_id: str
    queue: str
    state: str | None
    job_id: str | None
    busy: bool


@dataclass(frozen=True)
class Inputs:
    """Everything :func:`plan` looks at. ``demand`` is keyed by queue name (magic and home).
    ``suspended``: ``{queue name: reason}`` of queues that must not lend (their definition is at
    fault until applied again)."""

    definitions: list
    devices: list[DeviceView]
    demand: dict[str, QueueDemand]
    leases: list[LeaseView]
    vm_agents: list[VMAgentView]
    now: float
    suspended: dict[str, str] = field(default_factory=dict)
    vm_agent_grace: float = VM_AGENT_GRACE


@dataclass(frozen=True)
class Action:
    """One decision. ``kind`` in :data:`ACTION_KINDS`; ``reason`` is for people; ``generation``
    is the lease generation the decision was made on (for the engine's CAS)."""

    kind: str
    reason: str
    queue: str | None = None
    device: str | None = None
    lease_id: str | None = None
    generation: int | None = None
    data: dict[str, Any] = field(default_factory=dict)


_NO_DEMAND = QueueDemand()


def _dur(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds % 3600 == 0 and seconds:
        return f"{seconds // 3600}h"
    if seconds % 60 == 0 and seconds:
        return f"{seconds // 60}m"
    return f"{seconds}s"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


class _Planner:
    def __init__(self, inputs: Inputs, explain: bool = False):
        self.i = inputs
        self.explain = explain
        self.now = inputs.now
        self.actions: list[Action] = []
        self.reclaim_undrains: dict[str, str] = {}  # TRIAL6 M1 (both planners)
        self.defs = {q.name: q for q in inputs.definitions}
        self.device_by_name = {d.name: d for d in inputs.devices}
        # Devices a lease still holds: open leases and failed ones (they keep their claim).
        self.held = {l.device for l in inputs.leases if l.state in OPEN_STATES or l.state == FAILED}
        self.taken: set[str] = set()  # devices lent in this plan
        self.agents_of: dict[str, list[VMAgentView]] = {}
        for a in inputs.vm_agents:
            self.agents_of.setdefault(a.lease_id, []).append(a)
        self.open_leases: dict[str, list[LeaseView]] = {}
        for l in sorted(inputs.leases, key=lambda l: (l.created_at, l.id)):
            if l.state in OPEN_STATES:
                self.open_leases.setdefault(l.queue, []).append(l)

    def demand(self, queue: str) -> QueueDemand:
        return self.i.demand.get(queue, _NO_DEMAND)

    def add(self, kind: str, reason: str, lease: LeaseView | None = None, **kw) -> None:
        if lease is not None:
            kw.setdefault("queue", lease.queue)
            kw.setdefault("device", lease.device)
            kw.update(lease_id=lease.id, generation=lease.generation)
        self.actions.append(Action(kind, reason, **kw))

    # ------------------------------------------------------------------ counts

    def idle(self, lease: LeaseView) -> int:
        return sum(1 for a in self.agents_of.get(lease.id, ()) if not a.busy)

    def busy(self, lease: LeaseView) -> int:
        return sum(1 for a in self.agents_of.get(lease.id, ()) if a.busy)

    def coming(self, lease: LeaseView) -> int:
        """VMs planned but not yet reporting as agents (all of a bring-up lease's VMs). Once
        the lease has been active for ``vm_agent_grace`` a silent VM agent is *missing*, not
        coming (see VM_AGENT_GRACE): it no longer counts as supply nor blocks the idle drain."""
        if lease.state in BRINGUP_STATES:
            return lease.vms
        if _agents_overdue(lease, self.now, self.i.vm_agent_grace):
            return 0
        return max(0, lease.vms - len(self.agents_of.get(lease.id, ())))

    def supply_of(self, lease: LeaseView) -> int:
        if lease.state in BRINGUP_STATES:
            return lease.vms
        if lease.state == ACTIVE and lease.admission != "paused":
            return self.idle(lease) + self.coming(lease)
        return 0

    # ------------------------------------------------------------------ plan

    def run(self) -> list[Action]:
        self.quarantine()
        for lease in (l for ls in self.open_leases.values() for l in ls):
            if lease.queue not in self.defs:
                self.orphan(lease)
        self.reclaims = self.plan_reclaims()
        queues = sorted(self.defs.values(), key=lambda q: (-q.policy.priority, q.name))
        for q in queues:
            self.plan_queue(q)
        return self.actions

    def quarantine(self) -> None:
        for d in sorted(self.i.devices, key=lambda d: d.name):
            if d.quarantined or not d.registered:
                continue
            limits = [q.policy.failures_before_quarantine for q in self.defs.values()
                      if q.matches(_device_dict(d))]
            if limits and d.failures >= min(limits):
                self.add("quarantine", f"{d.name}: {_plural(d.failures, 'failed lease')} "
                         f"(limit {min(limits)}); quarantine until a person looks", device=d.name)

    def orphan(self, lease: LeaseView) -> None:
        if lease.state == ACTIVE:
            self.add("drain", f"{lease.queue}: queue definition removed; drain lease {lease.id} "
                     f"on {lease.device}", lease, data={"kind": "orphan", "grace": ORPHAN_GRACE, "force": False})
        elif lease.state in BRINGUP_STATES:
            # Nothing can ever run on it: stop the bring-up now (the engine restores a drained
            # bring-up at once, no failure counted) rather than finish it and then drain it.
            self.add("drain", f"{lease.queue}: queue definition removed; stop the bring-up of "
                     f"lease {lease.id} on {lease.device} ({lease.state})", lease,
                     data={"kind": "orphan", "grace": 0.0, "force": False})
        else:
            self.lifecycle(lease, None)

    def lifecycle(self, lease: LeaseView, q) -> bool:
        """Deadline/drain rules that hold whatever the demand. True if an action was added."""
        name = lease.queue
        if lease.state in BRINGUP_STATES:
            deadline = lease.deadline
            if deadline is None and q is not None:
                deadline = lease.created_at + q.policy.provision_timeout
            if deadline is not None and self.now >= deadline:
                self.add("restore", f"{name}: lease {lease.id} on {lease.device} still {lease.state} "
                         f"{_dur(self.now - lease.created_at)} after the claim (deadline passed); "
                         "restore and count a failure", lease, data={"failure": True})
                return True
            return False
        if lease.state != DRAINING:
            return False
        agents = self.agents_of.get(lease.id, ())
        drain = lease.drain or {}
        if all(not a.busy for a in agents):
            if drain.get("kind") in UNDRAINABLE and not drain.get("forced") and q is not None \
                    and self.shortfall(q) > 0 and agents:
                return False  # demand is back: plan_queue undrains it instead
            self.add("restore", f"{name}: lease {lease.id} on {lease.device} is draining and its "
                     f"{_plural(len(agents), 'VM agent')} "
                     f"{'is' if len(agents) == 1 else 'are'} idle; restore", lease)
            return True
        if drain.get("forced_at") is not None:
            return self.forced(lease, drain)
        # Added to both planners with TRIAL6 finding M1: a reclaim drain no home queue needs.
        if lease.id in self.reclaim_undrains:
            self.add("undrain", f"{name}: lease {lease.id} on {lease.device}: "
                     f"{self.reclaim_undrains[lease.id]}; cancel the reclaim drain: its "
                     f"{_plural(self.busy(lease), 'busy VM agent')} keep their jobs", lease,
                     data={"kind": "reclaim", "surplus": True})
            return True
        grace_until = drain.get("grace_until", lease.deadline)
        if grace_until is not None and self.now >= grace_until:
            self.add("force", f"{name}: lease {lease.id} on {lease.device}: grace ended with "
                     f"{_plural(self.busy(lease), 'busy VM agent')}; cancel their jobs "
                     f"(drain: {drain.get('reason', 'unknown')})", lease)
            return True
        return False

    def forced(self, lease: LeaseView, drain: dict) -> bool:
        """A committed force with busy VM agents: wait for them to notice the cancel, up to
        ``force_until``; repeat a force whose cancel was never recorded."""
        name, busy = lease.queue, self.busy(lease)
        if drain.get("cancelled") is None:
            self.add("force", f"{name}: lease {lease.id} on {lease.device}: forced but its jobs "
                     f"were not cancelled yet ({_plural(busy, 'busy VM agent')}); cancel them",
                     lease)
            return True
        until = drain.get("force_until")
        if until is not None and self.now >= until:
            self.add("restore", f"{name}: lease {lease.id} on {lease.device}: "
                     f"{_plural(busy, 'VM agent')} still busy "
                     f"{_dur(self.now - drain['forced_at'])} after their jobs were cancelled; "
                     "restore anyway", lease, data={"force_timeout": True})
            return True
        return False

    def shortfall(self, q) -> int:
        leases = self.open_leases.get(q.name, [])
        return self.demand(q.name).waiting - sum(self.supply_of(l) for l in leases)

    def plan_queue(self, q) -> None:
        leases = self.open_leases.get(q.name, [])
        handled = {l.id for l in leases if self.lifecycle(l, q)}
        live = [l for l in leases if l.id not in handled]
        # Added to both planners with TRIAL6 finding 3.
        # (reconcile.py) A quarantined device's lease (TRIAL6 finding 3: new jobs kept starting on hardware an
        # operator had just quarantined): a bring-up stops, an active lease takes no new job
        # (paused) and goes back once its running jobs ended; it serves nothing meanwhile.
        sick = set()
        for l in live:
            d = self.device_by_name.get(l.device)
            if d is None or not d.quarantined:
                continue
            sick.add(l.id)  # paused with jobs running, or draining: nothing new; no supply
            if l.state in BRINGUP_STATES:
                self.add("drain", f"{q.name}: {l.device} is quarantined; stop the bring-up of "
                         f"lease {l.id} ({l.state})", l,
                         data={"kind": "quarantined", "grace": 0.0, "force": False})
            elif l.state == ACTIVE and l.admission != "paused":
                self.add("pause", f"{q.name}: {l.device} is quarantined; pause lease {l.id}: no "
                         "new job starts there, its running jobs finish", l)
            elif l.state == ACTIVE and not self.busy(l) and not self.coming(l):
                self.add("drain", f"{q.name}: {l.device} is quarantined and lease {l.id} has "
                         "emptied; drain", l,
                         data={"kind": "quarantined", "grace": q.policy.reclaim.grace,
                               "force": False})
        live = [l for l in live if l.id not in sick]
        handled |= sick
        want = self.demand(q.name).waiting
        supply = sum(self.supply_of(l) for l in live)
        serving = [l for l in live if l.state in BRINGUP_STATES or l.state == ACTIVE]

        # Demand above supply: reuse what we hold before lending more.
        for l in live:
            if supply >= want:
                break
            if l.state == ACTIVE and l.admission == "paused":
                gain = self.idle(l) + self.coming(l)
                self.add("resume", f"{q.name}: {_plural(want, 'waiting job')}, {supply} idle or starting "
                         f"VMs; resume lease {l.id} on {l.device} ({gain} idle VMs)", l)
                supply += gain
                handled.add(l.id)
            elif l.state == DRAINING and (l.drain or {}).get("kind") in UNDRAINABLE \
                    and not (l.drain or {}).get("forced") and self.idle(l) > 0:
                gain = self.idle(l) + self.coming(l)
                self.add("undrain", f"{q.name}: {_plural(want, 'waiting job')}, {supply} idle or starting "
                         f"VMs; cancel the {(l.drain or {}).get('kind')} drain of lease {l.id} on "
                         f"{l.device} ({gain} idle VMs)", l)
                supply += gain
                serving.append(l)
                handled.add(l.id)

        if q.name in self.i.suspended:
            if self.explain:
                self.add("blocked", f"{q.name}: {_plural(want, 'waiting job')}; lending suspended: "
                         f"{self.i.suspended[q.name]}; fix the definition and apply it again",
                         queue=q.name, data={"why": "suspended", "waiting": want})
        else:
            self.lend(q, want, supply, leases, serving)
        self.scale_down(q, want, [l for l in live if l.id not in handled], serving)

    def lend(self, q, want: int, supply: int, leases: list[LeaseView], serving: list[LeaseView]) -> None:
        p = q.policy
        open_count = len(leases)
        starting = sum(1 for l in leases if l.state in BRINGUP_STATES)
        warm = len(serving)
        start_supply = supply
        candidates = self.candidates(q)
        while (supply < want or warm < p.min_devices) and candidates:
            if open_count >= p.max_devices or starting >= p.max_starting:
                break
            dev, vms = candidates.pop(0)
            if supply < want:
                why = (f"{_plural(want, 'waiting job')}, {start_supply} idle or starting VMs")
            else:
                why = f"min_devices {p.min_devices}, {warm} lent"
            self.add("lend", f"{q.name}: {why}; lend {dev.name} ({dev.gpus} GPUs -> {q.vms_text(dev.gpus)})",
                     queue=q.name, device=dev.name, data={"vms": vms, "gpus": dev.gpus,
                                                          "agent_host": dev.agent_host})
            self.taken.add(dev.name)
            supply += vms
            open_count += 1
            starting += 1
            warm += 1
        if not self.explain or supply >= want:
            return
        why = f"{q.name}: {_plural(want, 'waiting job')}, {supply} idle or starting VMs"
        if open_count >= p.max_devices:
            self.add("blocked", f"{why}; max_devices {p.max_devices} reached", queue=q.name,
                     data={"why": "max_devices", "waiting": want, "supply": supply})
        elif starting >= p.max_starting:
            # Leases still bringing up cap new lends; their VMs already count as supply, so this
            # is demand beyond what the starting leases will serve.
            self.add("blocked", f"{why}; max_starting {p.max_starting} reached "
                     f"({starting} bringing up)", queue=q.name,
                     data={"why": "max_starting", "waiting": want, "supply": supply,
                           "starting": starting})
        elif not candidates:
            counts = self.unlendable(q)
            detail = ", ".join(f"{n} {k}" for k, n in counts.items() if n and k != "idle")
            detail = f"{detail}, {counts['idle']} idle" if detail else f"{counts['idle']} idle"
            if not sum(counts.values()):
                detail = self.no_match_detail(q)
            self.add("blocked", f"{why}; no device can be lent: {detail}", queue=q.name,
                     data={"why": "no_device", "waiting": want, "supply": supply,
                           "devices": counts})

    def no_match_detail(self, q) -> str:
        """Why no registered device matches ``q``: the selection picks none, or it picks some
        that have too few GPUs for one VM (the limiting fact is then the GPU count)."""
        picked = [d for d in self.i.devices if d.registered and q.selects(_device_dict(d))]
        if picked:
            largest = max(d.gpus for d in picked)
            return (f"needs {_plural(q.vm.gpus, 'GPU')} per VM; the largest of the "
                    f"{_plural(len(picked), 'device')} its devices selection picks has "
                    f"{largest}")
        return (f"no registered device matches its devices selection "
                f"({_plural(len(self.i.devices), 'device')} registered)")

    def unlendable(self, q) -> dict[str, int]:
        """Why the devices matching ``q`` are not lendable now, counted (each device once, first
        reason wins): ``quarantined``, ``lent`` (held by a lease), ``busy`` (its agent is not
        waiting or has a job), ``owner first`` (its home queue has jobs of at least ``q``'s
        priority waiting), ``idle`` (lendable, but no VM of ``q`` fits or it was lent in this
        plan)."""
        # "on stale host": added to both planners with the lab trial's fixes (the random labs
        # have no stale agent host, so it stays 0 here).
        # "lent in a failed lease": added to both planners with the TRIAL finding 3 fix.
        counts = {"quarantined": 0, "lent": 0, "lent in a failed lease": 0, "returning": 0,
                  "on stale host": 0, "busy": 0, "owner first": 0, "idle": 0}
        failed = {l.device for l in self.i.leases if l.state == "failed"}
        for d in self.i.devices:
            if not d.registered or not q.matches(_device_dict(d)):
                continue
            if d.quarantined:
                counts["quarantined"] += 1
            elif d.name in failed and d.name not in self.taken:
                counts["lent in a failed lease"] += 1
            elif d.name in self.held or d.name in self.taken:
                counts["lent"] += 1
            elif not d.agent_back:  # added to both planners with issue 10 item 18
                counts["returning"] += 1
            elif d.agent_state != "waiting" or d.job_id:
                counts["busy"] += 1
            elif any(self.demand(h).waiting > 0 and d.name not in self.demand(h).avoid and (
                    q.policy.priority <= self.demand(h).max_priority or _picking_up(self, d))
                    for h in d.home_queues):  # picking up: added to both with TRIAL5 finding 5
                counts["owner first"] += 1  # (avoid: added to both with TRIAL11 F4)
            else:
                counts["idle"] += 1
        return counts

    def candidates(self, q) -> list[tuple[DeviceView, int]]:
        """Lendable devices for ``q``, best first: fewest GPUs wasted, least recent home use."""
        out = []
        for d in self.i.devices:
            if (not d.registered or d.quarantined or d.name in self.held or d.name in self.taken
                    or not d.agent_back  # added to both planners with issue 10 item 18
                    or d.agent_state != "waiting" or d.job_id or not q.matches(_device_dict(d))):
                continue
            if any(self.demand(h).waiting > 0 and d.name not in self.demand(h).avoid and (
                    q.policy.priority <= self.demand(h).max_priority or _picking_up(self, d))
                   for h in d.home_queues):  # picking up: added to both with TRIAL5 finding 5
                continue  # (avoid: added to both with TRIAL11 F4)
            vms = q.vms_for(d.gpus)
            if vms < 1:
                continue
            wasted = d.gpus - vms * q.vm.gpus
            last = d.last_home_use if d.last_home_use is not None else -math.inf
            out.append(((wasted, last, d.name), d, vms))
        return [(d, vms) for _, d, vms in sorted(out, key=lambda t: t[0])]

    def scale_down(self, q, want: int, live: list[LeaseView], serving: list[LeaseView]) -> None:
        p = q.policy
        active = [l for l in live if l.state == ACTIVE]
        kept = len(serving)  # leases not draining: min_devices counts these
        for l in active:
            reason = self.reclaim_reason(q, l)
            if reason:
                kind, text = reason
                # Added to both planners with TRIAL5 finding 7: a max_lease drain waits for
                # the running jobs, as a yield does (YIELD_GRACE, 10 h).
                grace = max(p.reclaim.grace, 36000.0) if kind == "max_lease" else p.reclaim.grace
                self.add("drain", f"{q.name}: {text}; drain lease {l.id} on {l.device} "
                         f"(grace {_dur(grace)})", l,
                         data={"kind": kind, "grace": grace, "force": False})
                kept -= 1
                live = [x for x in live if x.id != l.id]
        # Added to both planners with the lab trial's fixes: a bring-up no job needs any more
        # is drained (kind unneeded) after min(idle_timeout, 60 s) without a new job.
        supply = sum(self.supply_of(l) for l in live)
        last = self.demand(q.name).last_job_at
        for l in sorted((l for l in live if l.state in BRINGUP_STATES
                         and not getattr(l, "by_hand", False)),  # both: TRIAL5 finding 3
                        key=lambda l: (-l.created_at, l.id)):
            other = supply - self.supply_of(l)
            since = l.created_at if last is None else max(l.created_at, last)
            hold = min(p.idle_timeout, 60.0)
            if kept <= p.min_devices or want > other or self.now - since < hold:
                continue
            self.add("drain", f"{q.name}: {_plural(want, 'waiting job')}, {other} idle or "
                     f"starting VMs without lease {l.id} on {l.device} (still {l.state}), no job "
                     f"submitted or started for {_dur(self.now - since)} (hold {_dur(hold)}); "
                     "stop its bring-up and give the device back", l,
                     data={"kind": "unneeded", "grace": 0.0, "force": False})
            supply = other
            kept -= 1
        active = [l for l in live if l.state == ACTIVE]
        d = self.demand(q.name)
        for l in active:
            if kept <= p.min_devices or want > 0 or self.busy(l) or self.coming(l):
                continue
            since = max(x for x in (l.idle_since if l.idle_since is not None else l.updated_at,
                                    d.last_job_at) if x is not None)
            if self.now - since >= p.idle_timeout:
                self.add("drain", f"{q.name}: no waiting jobs and lease {l.id} on {l.device} idle for "
                         f"{_dur(self.now - since)} (idle_timeout {_dur(p.idle_timeout)}); drain", l,
                         data={"kind": "idle", "grace": p.reclaim.grace, "force": False})
                kept -= 1
                live = [x for x in live if x.id != l.id]
        self.consolidate(q, want, [l for l in live if l.state == ACTIVE], kept)

    def plan_reclaims(self) -> dict[str, tuple[str, str]]:
        """``{lease id: ("reclaim", text)}``: the active leases to give back to home queues whose
        oldest job waited longer than the lending queue's ``reclaim.owner_wait``.

        Only as many as the owner needs: a device serves its home queue one job at a time, so a
        home queue with N waiting jobs needs N devices, less those already on their way back for
        it (draining or restoring after a ``reclaim`` drain). Idlest first (fewest busy VM
        agents, then the oldest lease): reclaiming every lent device for one waiting job would
        cancel other people's running jobs for nothing."""
        out: dict[str, tuple[str, str]] = {}
        # Added to both planners with TRIAL6 finding M1: reclaim drains by home queue, what
        # each home queue has returning beyond its need, and the drains that would cancel jobs.
        by_home: dict[str, list[LeaseView]] = {}
        for l in (l for ls in self.open_leases.values() for l in ls):
            if l.state in (DRAINING, RESTORING) and (l.drain or {}).get("kind") == "reclaim":
                dev = self.device_by_name.get(l.device)
                for h in sorted(set(dev.home_queues) if dev is not None else ()):
                    by_home.setdefault(h, []).append(l)

        def cancels(l):
            d = l.drain or {}
            return l.state == DRAINING and not d.get("forced") and d.get("forced_at") is None \
                and self.busy(l) > 0

        surplus = {h: len(ls) for h, ls in by_home.items()}
        homes = sorted({h for d in self.i.devices for h in d.home_queues})
        for h in homes:
            hd = self.demand(h)
            if hd.waiting <= 0:
                continue
            returning, candidates = 0, []
            for l in (l for ls in self.open_leases.values() for l in ls):
                dev = self.device_by_name.get(l.device)
                if dev is None or h not in dev.home_queues or l.id in out:
                    continue
                if l.device in hd.avoid:  # added to both with TRIAL11 F4: its jobs exclude it
                    continue
                # Added to both planners with TRIAL7: any restoring lease is on its way back.
                if l.state == RESTORING or (
                        l.state == DRAINING and (l.drain or {}).get("kind") == "reclaim"):
                    returning += 1
                q = self.defs.get(l.queue)
                stale = dev.agent_host in self.i.stale_hosts  # nobody works it: cannot come back
                # Added to both planners with TRIAL5 finding 5: a queue outranking every
                # waiting owner job keeps its lease.
                if l.state == ACTIVE and q is not None and not stale \
                        and hd.oldest_age > q.policy.reclaim.owner_wait \
                        and q.policy.priority <= hd.max_priority:
                    candidates.append(l)
            # Added to both planners with the lab trial's fixes: a device back home about to
            # take the owner's job (just given back, or posted waiting within AGENT_PICKUP).
            for d in self.i.devices:
                if (h in d.home_queues and d.registered and not d.quarantined
                        and d.name not in hd.avoid  # added to both with TRIAL11 F4
                        and d.name not in self.held and d.agent_state == "waiting"
                        and not d.job_id and (not d.agent_back or (
                            d.last_home_use is not None and self.now - d.last_home_use <= 15.0))):
                    returning += 1
            need = hd.waiting - returning
            surplus[h] = -need
            candidates.sort(key=lambda l: (self.busy(l), l.created_at, l.id))

            def text(l):
                wait = self.defs[l.queue].policy.reclaim.owner_wait
                return (f"home queue {h} of {l.device} has {_plural(hd.waiting, 'job')} "
                        f"waiting up to {_dur(hd.oldest_age)} (owner_wait {_dur(wait)})")
            for l in candidates[:max(0, need)]:
                out[l.id] = ("reclaim", text(l))
            if need >= 0:  # an idle lease instead of each drain that would cancel jobs
                busy_drains = [l for l in by_home.get(h, []) if cancels(l)]
                idle = [l for l in candidates[max(0, need):]
                        if self.busy(l) == 0 and self.coming(l) == 0 and l.id not in out]
                for k in range(min(len(idle), len(busy_drains))):
                    l, instead = idle[k], busy_drains[k]
                    out[l.id] = ("reclaim", text(l) + f"; lease {l.id} is idle: taken instead "
                                 f"of lease {instead.id} on {instead.device}, whose "
                                 f"{_plural(self.busy(instead), 'busy VM agent')} keep their jobs")
        # Busiest first, then the newest: undrained when every home queue of its device has
        # more returning than it needs.
        costly = {l.id: l for ls in by_home.values() for l in ls if cancels(l)}
        for l in sorted(costly.values(), key=lambda l: (-self.busy(l), -l.created_at, l.id)):
            hs = sorted(set(self.device_by_name[l.device].home_queues))
            if hs and all(surplus.get(h, 0) > 0 for h in hs):
                for h in hs:
                    surplus[h] -= 1
                waits = ", ".join(f"{h} ({_plural(self.demand(h).waiting, 'job')} waiting)"
                                  for h in hs)
                still = any(self.demand(h).waiting for h in hs)
                self.reclaim_undrains[l.id] = (
                    f"home queue{'s' if len(hs) > 1 else ''} {waits} no longer "
                    f"need{'' if len(hs) > 1 else 's'} {l.device}: "
                    + ("enough devices are returning or back home" if still
                       else "no job waits there any more"))
        return out

    def reclaim_reason(self, q, l: LeaseView):
        p = q.policy
        if l.id in self.reclaims:
            return self.reclaims[l.id]
        if p.max_lease and self.now - l.created_at >= p.max_lease:
            return ("max_lease", f"lease {l.id} lent for {_dur(self.now - l.created_at)} "
                                 f"(max_lease {_dur(p.max_lease)})")
        return None

    def consolidate(self, q, want: int, active: list[LeaseView], kept: int) -> None:
        p = q.policy
        paused = [l for l in active if l.admission == "paused"]
        open_ = [l for l in active if l.admission != "paused"]
        supply = sum(self.supply_of(l) for l in open_)
        for l in paused:  # emptied: give the device back (not below min_devices)
            if kept > p.min_devices and not self.busy(l) and not self.coming(l) and supply >= want:
                self.add("drain", f"{q.name}: paused lease {l.id} on {l.device} has emptied and "
                         + (f"{supply} idle VMs elsewhere cover {_plural(want, 'waiting job')}"
                            if want else "no job waits there") + "; drain",
                         l, data={"kind": "consolidate", "grace": p.reclaim.grace, "force": False})
                kept -= 1
        if len(open_) < 2 or len(open_) <= p.min_devices:
            return
        # One pause per tick: the least-busy lease, oldest first on a tie (it meets max_lease first).
        l = min(open_, key=lambda x: (self.busy(x), x.created_at, x.id))
        rest = supply - self.supply_of(l)
        if supply > want and rest >= want and self.busy(l) > 0:
            self.add("pause", f"{q.name}: {supply} idle VMs for {_plural(want, 'waiting job')}; stop "
                     f"dispatching to lease {l.id} on {l.device} ({self.busy(l)} busy) so it empties "
                     "first", l)


def _device_dict(d: DeviceView) -> dict:
    return {"_id": d.name, "name": d.name, "gpus": d.gpus, "tags": list(d.tags),
            "home_queues": list(d.home_queues)}


def overdue_leases(leases: list[LeaseView], now: float) -> list[LeaseView]:
    """Leases in ``restoring`` past their deadline: the agent host is not finishing the restore
    (it is down, or it no longer drives the device). Nothing in the plan moves them, so a
    person must be told (status, event, metric)."""
    return [l for l in leases
            if l.state == RESTORING and l.deadline is not None and now >= l.deadline]


def _agents_overdue(lease: LeaseView, now: float, grace: float) -> bool:
    """True if ``lease`` (active or draining) has been active for at least ``grace`` seconds,
    so its VMs without an agent are missing rather than still starting."""
    return (lease.state in (ACTIVE, DRAINING) and lease.active_since is not None
            and now - lease.active_since >= grace)


def missing_vm_agents(inputs: Inputs) -> dict[str, list[str]]:
    """``{lease id: [VM agent names]}`` of active/draining leases past ``vm_agent_grace`` whose
    planned VM agents never registered with the server (no Testflinger ``agents`` document).
    The server reports each set once (event ``vm_agent.missing``) and in status: such a VM
    takes no job, and the lease is judged idle on the agents that did register."""
    registered: dict[str, set[str]] = {}
    for a in inputs.vm_agents:
        registered.setdefault(a.lease_id, set()).add(a.name)
    out = {}
    for l in inputs.leases:
        if not _agents_overdue(l, inputs.now, inputs.vm_agent_grace):
            continue
        names = sorted(n for n in l.vm_names if n not in registered.get(l.id, set()))
        if names:
            out[l.id] = names
    return out


def stale_hosts(last_heartbeats: dict[str, float | None], now: float,
                after: float = STALE_HOST_AFTER) -> list[str]:
    """Agent host names whose last heartbeat (epoch seconds, None = never) is older than
    ``after`` seconds, sorted."""
    return sorted(h for h, at in last_heartbeats.items() if at is None or now - at > after)


def plan(inputs: Inputs, explain: bool = False) -> list[Action]:
    """Decide what to do now (see the module docstring). Deterministic for the same inputs.
    ``explain``: also return non-acting ``blocked`` actions saying why demand stays unmet
    (for ``GET /v1/magic/plan``; executors that dispatch on ``kind`` leave it off)."""
    return _Planner(inputs, explain).run()
