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
  ``max_starting``; the warm level (the largest of ``min_devices``, the ``warm`` window covering
  ``Inputs.wall`` and the level ``warm_learn`` learns from ``Inputs.arrivals``) is lent even
  with zero demand; which device: the first candidate (fewest GPUs wasted, least recent home
  use), or with ``device_fit: demand`` the smallest covering the unmet demand; never past a
  ``max_share`` of a home queue's devices; queues with ``yield_idle`` lend in stages: their
  first device for waiting jobs, then the rest of their demand, then their warm level, each
  stage after every such queue's earlier one;
* owner reclaim (a home queue's oldest job waited longer than ``reclaim.owner_wait``; only as
  many devices as its waiting jobs need, less those already returning (a reclaim drain, or any
  lease restoring) and those back home about
  to take a job (just given back, agent not posted yet; or posted ``waiting`` within
  ``AGENT_PICKUP``), idlest first; an all-idle
  lease already after ``reclaim.idle_wait`` if set; while a busy reclaim drain would cancel
  jobs, a wholly idle lease of the same home queue is reclaimed too, and then the busy drain
  ``undrain``-ed, as is one no home queue needs any more), a yield (``yield_idle``: an all-idle lease,
  or a partly busy one of a quiet queue holding two more leases than the starving one (the
  anti-thrash rule), given up for a magic queue sharing its device that starves,
  reconcile_sharing.plan_yields) and ``max_lease`` -> ``drain`` with ``reclaim.grace`` (a yield
  or a ``max_lease`` drain: at least ``YIELD_GRACE``, so its running jobs finish); idleness for ``idle_timeout`` -> ``drain``
  (never below the warm level);
* a lease still in bring-up that no job needs any more (the queue's waiting jobs covered by its
  other leases, above the warm level, no job submitted or started for ``min(idle_timeout,
  UNNEEDED_HOLD)``) -> ``drain`` (kind ``unneeded``, newest first): the engine stops the bring-up
  and restores; never a lease an operator lent by hand (``LeaseView.by_hand``: a pre-warm
  before a burst, a check of one device), which the idle rule gives back once active;
* consolidation by admission: when the other leases' idle VMs cover demand, ``pause`` the
  least-busy lease so it empties first; a paused lease that emptied -> ``drain``;
* agent hosts in ``Inputs.stale_hosts`` (no heartbeat for ``STALE_HOST_AFTER``): their devices
  are not lent (explained as ``on stale host``), their leases still in bring-up -> ``restore``
  (data ``host_stale``, no failure counted); their other leases count as no supply (nor are
  resumed or undrained for demand), so the queue's waiting jobs get another device if one can
  be lent, but they keep their lifecycle and are not drained for staleness (the host may come
  back, its VM agents may still be running jobs; an extra lease is given back by the idle
  drain once the host is back; an operator drains one by hand); they still count towards
  ``max_devices`` and the warm level (they hold their device);
* agent hosts in ``Inputs.maas_down_hosts`` (their daemon's heartbeat says MAAS does not
  answer): their devices are not lent (``MAAS unreachable``), and a bring-up there that passes
  its deadline is restored with no failure counted (data ``maas_down``): an outage of MAAS is
  nobody's device's fault;
* a device whose ``failures`` reached the lowest ``failures_before_quarantine`` of the queues that
  may use it -> ``quarantine``;
* a lease of a quarantined device: in bring-up -> ``drain`` (kind ``quarantined``, grace 0: the
  engine restores it at once); active and open -> ``pause`` (no new job, its running jobs
  finish); active, paused and emptied -> ``drain`` (kind ``quarantined``); it counts as no
  supply, so the queue's waiting jobs get another device;
* a queue in ``Inputs.suspended`` (its definition made a lease fail; the server clears it when the
  definition is applied again) lends nothing, not even for ``min_devices``; its leases keep their
  lifecycle.

With ``plan(inputs, explain=True)`` the plan also says why demand stays unmet, as non-acting
``blocked`` actions (:data:`NON_ACTING`; executors ignore them): the queue is suspended, no device
can be lent (with counts: quarantined, lent, returning, busy at home, owner's jobs waiting,
idle), or
``max_devices``, ``max_starting`` or ``max_share`` is reached.
``data = {"why": "suspended" | "no_device" | "max_devices" | "max_starting" | "max_share", ...}``.

Drain actions carry ``data = {"kind", "grace" (seconds), "force": False}``, ``kind`` one of
``idle``, ``consolidate``, ``reclaim``, ``yield``, ``max_lease``, ``orphan``, ``unneeded`` (a
lease in bring-up: the engine moves it to ``restoring`` at once); a ``yield`` drain
also names the starving queue it is for (``"for"``) and gets at least ``YIELD_GRACE`` (it waits
for the running jobs, never cancels them). The engine must store ``kind``
in the lease's ``drain`` document: only ``idle`` and ``consolidate`` drains are undrained for
demand, and a ``reclaim`` drain only when no home queue of its device needs it any more (its
``undrain`` carries data ``{"kind": "reclaim", "surplus": True}``; Reclaims.plan_reclaims).

Where the parts live: the inputs, ``Action`` and constants in reconcile_model.py, the
eligibility index and lending candidates in reconcile_eligibility.py, warm levels, device choice,
``max_share`` and yields in reconcile_sharing.py, the owner reclaim in reconcile_reclaim.py, the
per-lease rules (deadlines, grace and force, removed queues, stale hosts, quarantined devices)
in reconcile_lifecycle.py (mixins of the planner); the knobs' schema in queue_policy.py.
reconcile re-exports every public name.
"""

from __future__ import annotations

from . import fabric
from .leases import ACTIVE, BRINGUP_STATES, DRAINING, FAILED, OPEN_STATES
from .reconcile_eligibility import Eligibility
from .reconcile_lifecycle import Lifecycle
from .reconcile_reclaim import Reclaims
from .reconcile_sharing import Sharing
from .reconcile_model import (  # noqa: F401 - re-exported: reconcile.<name>
    ACTION_KINDS, AGENT_PICKUP, NON_ACTING, ORPHAN_GRACE, REAPPLY_ADVICE, STALE_HOST_AFTER, UNDRAINABLE,
    UNNEEDED_HOLD,
    VM_AGENT_GRACE, YIELD_GRACE, Action, DeviceView, Inputs, LeaseView, QueueDemand, VMAgentView, _NO_DEMAND,
    busy_at_home,
    _agents_overdue, _device_dict, _dur, _plural, maas_down_hosts, missing_vm_agents,
    overdue_leases, quiet_hosts, stale_hosts, QUIET_HOST_AFTER,
    view, with_reapply_advice, without_reapply_advice,
)


class _Planner(Eligibility, Sharing, Reclaims, Lifecycle):
    def __init__(self, inputs: Inputs, explain: bool = False):
        self.i = inputs
        self.explain = explain
        self.now = inputs.now
        self.actions: list[Action] = []
        self.defs = {q.name: q for q in inputs.definitions}
        self.device_by_name = {d.name: d for d in inputs.devices}
        # Devices a lease still holds: open leases and failed ones (they keep their claim).
        self.held = {l.device for l in inputs.leases if l.state in OPEN_STATES or l.state == FAILED}
        self.taken: set[str] = set()  # devices lent in this plan
        # Per lease: [busy VM agents, all its VM agents] (idle = all - busy), counted once.
        self._counts: dict[str, list[int]] = {}
        counts = self._counts
        for a in inputs.vm_agents:
            c = counts.get(a.lease_id)
            if c is None:
                counts[a.lease_id] = [1 if a.busy else 0, 1]
            else:
                if a.busy:
                    c[0] += 1
                c[1] += 1
        # Per lease: its idle VM agents every waiting job of its queue excludes (no supply).
        self._avoided: dict[str, int] = {}
        for a in inputs.vm_agents:
            if not a.busy:
                d = inputs.demand.get(a.queue)
                if d is not None and a.name in d.avoid_agents:
                    self._avoided[a.lease_id] = self._avoided.get(a.lease_id, 0) + 1
        self.open_leases: dict[str, list[LeaseView]] = {}
        for l in sorted(inputs.leases, key=lambda l: (l.created_at, l.id)):
            if l.state in OPEN_STATES:
                self.open_leases.setdefault(l.queue, []).append(l)
        # Eligibility is indexed once per plan (selection keys -> device positions), so a queue
        # looks only at the devices its selection names, not at every device: time linear in
        # devices + queues (+ the devices each lending queue selects), not devices x queues.
        self._index: dict[tuple[str, str], list[int]] | None = None
        self._lendable: dict[tuple[str, str], list[int]] | None = None
        self._dicts: dict[int, dict] = {}
        self._shortfall: dict[str, int] = {}
        self._bars: dict[int, int | None] = {}
        self._deferred: list[tuple] = []
        self._lend_state: dict[str, tuple] = {}
        self._share_notes: dict[str, str] = {}
        self._pools = None
        self.yield_for: dict[str, str] = {}  # lease id -> the queue a yield drains it for
        #: Reclaim drains no home queue needs any more: lease id -> why (Reclaims.plan_reclaims;
        #: empty until it ran, so a lifecycle before it, an orphan's, undrains nothing).
        self.reclaim_undrains: dict[str, str] = {}

    def add(self, kind: str, reason: str, lease: LeaseView | None = None, **kw) -> None:
        if lease is not None:
            kw.setdefault("queue", lease.queue)
            kw.setdefault("device", lease.device)
            kw.update(lease_id=lease.id, generation=lease.generation)
        self.actions.append(Action(kind, reason, **kw))

    # ------------------------------------------------------------------ counts

    def idle(self, lease: LeaseView) -> int:
        c = self._counts.get(lease.id)
        return c[1] - c[0] if c else 0

    def busy(self, lease: LeaseView) -> int:
        c = self._counts.get(lease.id)
        return c[0] if c else 0

    def coming(self, lease: LeaseView) -> int:
        """VMs planned but not yet reporting as agents (all of a bring-up lease's VMs). Once
        the lease has been active for ``vm_agent_grace`` a silent VM agent is *missing*, not
        coming (see VM_AGENT_GRACE): it no longer counts as supply nor blocks the idle drain."""
        if lease.state in BRINGUP_STATES:
            return lease.vms
        if _agents_overdue(lease, self.now, self.i.vm_agent_grace):
            return 0
        c = self._counts.get(lease.id)
        return max(0, lease.vms - (c[1] if c else 0))

    def on_stale_host(self, lease: LeaseView) -> bool:
        """True if ``lease``'s device is on an agent host in ``Inputs.stale_hosts``."""
        dev = self.device_by_name.get(lease.device)
        return dev is not None and dev.agent_host in self.i.stale_hosts

    def supply_of(self, lease: LeaseView) -> int:
        """VMs of ``lease`` that may take ``lease.queue``'s waiting jobs: all of a bring-up
        lease's, the idle and coming ones of an active lease open to admission, none of a
        paused or draining one, and none of a lease on a stale agent host (its VM agents'
        documents may say ``waiting``, but nobody may be there to take a job), nor of a lease
        whose device the queue's waiting jobs all exclude (``QueueDemand.avoid``), nor an idle
        VM agent they all exclude (``QueueDemand.avoid_agents``)."""
        if self.on_stale_host(lease) or lease.device in self.demand(lease.queue).avoid:
            return 0
        if lease.state in BRINGUP_STATES:
            return lease.vms
        if lease.state == ACTIVE and lease.admission != "paused":
            return self.could_serve(lease)
        return 0

    # ------------------------------------------------------------------ plan

    def run(self) -> list[Action]:
        self.quarantine()
        for lease in (l for ls in self.open_leases.values() for l in ls):
            if lease.queue not in self.defs:
                self.orphan(lease)
        self.reclaims = self.plan_reclaims()
        for lease_id, reason in self.plan_yields().items():
            self.reclaims.setdefault(lease_id, reason)
        queues = sorted(self.defs.values(), key=lambda q: (-q.policy.priority, q.name))
        for q in queues:
            self.plan_queue(q)
        # Queues that share (yield_idle) lend in rounds: each its first device for waiting
        # jobs (in plan_queue), then the rest of their demand, then their warm level.
        for stage in ("demand", "all"):
            for q, want, leases, serving in self._deferred:
                self.lend(q, want, None, leases, serving, stage=stage)
        return self.actions

    def quarantine(self) -> None:
        if not self.defs:
            return
        # A device below the lowest limit of every queue cannot reach its own: skip it.
        lowest = min(q.policy.failures_before_quarantine for q in self.defs.values())
        at_risk = [i for i, d in enumerate(self.i.devices)
                   if d.failures >= lowest and not d.quarantined and d.registered]
        # Which queues name each selection key: a device's queues are those its keys reach.
        by_key: dict[tuple[str, str], list] = {}
        for q in self.defs.values():
            sel = q.devices
            for key in {("agent", v) for v in sel.agents} | {("tag", v) for v in sel.tags} \
                    | {("home", v) for v in sel.home_queues}:
                by_key.setdefault(key, []).append(q)
        for i in sorted(at_risk, key=lambda i: self.i.devices[i].name):
            d = self.i.devices[i]
            reached = {id(q): q for key in self._keys(d) for q in by_key.get(key, ())}
            # The lowest limit of the queues that may use it: the first match in limit order
            # (one q.matches per device, not one per queue its keys reach).
            limit = next((q.policy.failures_before_quarantine for q in sorted(
                reached.values(), key=lambda q: q.policy.failures_before_quarantine)
                if q.matches(self._device_dict(i))), None)
            if limit is not None and d.failures >= limit:
                self.add("quarantine", f"{d.name}: {_plural(d.failures, 'failed lease')} "
                         f"(limit {limit}); quarantine until a person looks", device=d.name)

    def idle_for_demand(self, lease: LeaseView) -> int:
        """The idle VM agents of ``lease`` its queue's waiting jobs may run: none when they all
        exclude its device (``QueueDemand.avoid``), else those they do not all exclude
        (``avoid_agents``)."""
        if lease.device in self.demand(lease.queue).avoid:
            return 0
        return self.idle(lease) - self._avoided.get(lease.id, 0)

    def could_serve(self, lease: LeaseView) -> int:
        """The idle and coming VMs of ``lease`` its queue's waiting jobs may run
        (:meth:`idle_for_demand`, and its VMs not reporting yet unless the jobs exclude its
        device). Resuming or undraining a lease for demand it cannot serve would hold its
        device for nothing (TRIAL8: an idle drain undone every tick for a job excluding the
        lease's VMs, the queue at ``max_devices``, the job waiting for ever)."""
        if lease.device in self.demand(lease.queue).avoid:
            return 0
        return self.idle_for_demand(lease) + self.coming(lease)

    def shortfall(self, q) -> int:
        """Waiting jobs of ``q`` less the supply of all its open leases (fixed for the plan:
        computed once per queue)."""
        if q.name not in self._shortfall:
            leases = self.open_leases.get(q.name, [])
            self._shortfall[q.name] = (self.demand(q.name).waiting
                                       - sum(self.supply_of(l) for l in leases))
        return self._shortfall[q.name]

    def plan_queue(self, q) -> None:
        leases = self.open_leases.get(q.name, [])
        handled = {l.id for l in leases if self.lifecycle(l, q)}
        live = [l for l in leases if l.id not in handled]
        sick = self.hold_back_quarantined(q, live)
        live = [l for l in live if l.id not in sick]
        handled |= sick
        want = self.demand(q.name).waiting
        supply = sum(self.supply_of(l) for l in live)
        serving = [l for l in live if l.state in BRINGUP_STATES or l.state == ACTIVE]

        # Demand above supply: reuse what we hold before lending more.
        for l in live:
            if supply >= want:
                break
            if self.on_stale_host(l):
                continue  # no supply while its host is stale: resuming it would not serve
            if l.state == ACTIVE and l.admission == "paused" \
                    and l.device not in self.demand(q.name).avoid:
                gain = self.could_serve(l)
                self.add("resume", f"{q.name}: {_plural(want, 'waiting job')}, {supply} idle or starting "
                         f"VMs; resume lease {l.id} on {l.device} ({gain} idle VMs)", l)
                supply += gain
                handled.add(l.id)
            elif l.state == DRAINING and (l.drain or {}).get("kind") in UNDRAINABLE \
                    and not (l.drain or {}).get("forced") and self.idle_for_demand(l) > 0:
                gain = self.could_serve(l)
                self.add("undrain", f"{q.name}: {_plural(want, 'waiting job')}, {supply} idle or starting "
                         f"VMs; cancel the {(l.drain or {}).get('kind')} drain of lease {l.id} on "
                         f"{l.device} ({gain} idle VMs)", l)
                supply += gain
                serving.append(l)
                handled.add(l.id)

        if q.name in self.i.suspended:
            if self.explain:
                self.add("blocked", f"{q.name}: {_plural(want, 'waiting job')}; lending suspended: "
                         f"{with_reapply_advice(self.i.suspended[q.name])}",
                         queue=q.name, data={"why": "suspended", "waiting": want})
        else:
            deferred = self.defers_warm(q)
            self.lend(q, want, supply, leases, serving, stage="first" if deferred else "all")
            if deferred:
                self._deferred.append((q, want, leases, serving))
        self.scale_down(q, want, [l for l in live if l.id not in handled], serving)

    def lend(self, q, want: int, supply: int | None, leases: list[LeaseView],
             serving: list[LeaseView], stage: str = "all") -> None:
        """Lend devices to ``q`` until its supply covers ``want`` and it holds its warm level
        (:meth:`floor`). A queue that shares (:meth:`defers_warm`) lends in stages: ``first``
        (for waiting jobs, only while it holds no lease), ``demand`` (for waiting jobs) and
        ``all`` (its warm level too); a later stage (``supply`` None) goes on from where the
        earlier one stopped. Only the ``all`` stage explains unmet demand."""
        p = q.policy
        if supply is None:  # a later stage: the state the earlier one left
            supply, open_count, starting, warm, start_supply, candidates = self._lend_state[q.name]
            if candidates is not None:  # other queues may have lent some since
                candidates = [c for c in candidates if c[0].name not in self.taken]
        else:
            open_count = len(leases)
            starting = sum(1 for l in leases if l.state in BRINGUP_STATES)
            warm = len(serving)
            start_supply = supply
            candidates = None  # computed only if this queue lends (or explains why it cannot)
        floor = self.floor(q) if stage == "all" else 0
        while (supply < want and (stage != "first" or warm < 1)) or warm < floor:
            if open_count >= p.max_devices or starting >= p.max_starting:
                break
            if candidates is None:
                candidates = self.candidates(q)
            if not candidates:
                break
            picked = self.pick(q, candidates, want - supply)
            if picked is None:
                break
            dev, vms = picked
            if supply < want:
                why = (f"{_plural(want, 'waiting job')}, {start_supply} idle or starting VMs")
            else:
                why = f"{self.floor_reason(q)}, {warm} lent"
            self.add("lend", f"{q.name}: {why}; lend {dev.name} ({dev.gpus} GPUs -> {q.vms_text(dev.gpus)})",
                     queue=q.name, device=dev.name, data={"vms": vms, "gpus": dev.gpus,
                                                          "agent_host": dev.agent_host})
            self.taken.add(dev.name)
            self.note_lent(dev)
            supply += vms
            open_count += 1
            starting += 1
            warm += 1
        if stage != "all":
            self._lend_state[q.name] = (supply, open_count, starting, warm, start_supply, candidates)
        if not self.explain or supply >= want or stage != "all":
            return
        why = f"{q.name}: {_plural(want, 'waiting job')}, {supply} idle or starting VMs"
        if open_count >= p.max_devices:
            self.add("blocked", f"{why}; max_devices {p.max_devices} reached"
                     f"{self.stale_leases_note(leases)}", queue=q.name,
                     data={"why": "max_devices", "waiting": want, "supply": supply})
        elif starting >= p.max_starting:
            # Leases still bringing up cap new lends; their VMs already count as supply, so this
            # is demand beyond what the starting leases will serve.
            self.add("blocked", f"{why}; max_starting {p.max_starting} reached "
                     f"({starting} bringing up)", queue=q.name,
                     data={"why": "max_starting", "waiting": want, "supply": supply,
                           "starting": starting})
        elif candidates and q.name in self._share_notes:
            self.add("blocked", f"{why}; max_share {p.max_share:g}: "
                     f"{self._share_notes[q.name]}", queue=q.name,
                     data={"why": "max_share", "waiting": want, "supply": supply})
        elif not (candidates if candidates is not None else self.candidates(q)):
            counts = self.unlendable(q)
            refused = self.fabric_refused(q)
            detail = ", ".join(f"{n} {k}" for k, n in counts.items() if n and k != "idle")
            detail = f"{detail}, {counts['idle']} idle" if detail else f"{counts['idle']} idle"
            if not sum(counts.values()):
                detail = self.no_match_detail(q)
            else:
                if counts["on stale host"]:
                    detail = (f"{detail} ({self.stale_detail(q)}: not lent until it heartbeats "
                              "again)")
                if refused:  # the others it picks: say why they are not counted
                    detail = f"{detail}; {fabric.blocked_text(q.vm.gpus, refused)}"
            self.add("blocked", f"{why}; no device can be lent: {detail}", queue=q.name,
                     data={"why": "no_device", "waiting": want, "supply": supply,
                           "devices": counts,
                           **({"nvswitch_devices": [d.name for d in refused]} if refused
                              else {})})

    def scale_down(self, q, want: int, live: list[LeaseView], serving: list[LeaseView]) -> None:
        p = q.policy
        floor = self.floor(q)
        active = [l for l in live if l.state == ACTIVE]
        kept = len(serving)  # leases not draining: the warm level (min_devices) counts these
        drained: set[str] = set()
        for l in active:
            reason = self.reclaim_reason(q, l)
            if reason:
                kind, text = reason
                # A yield waits for the running jobs (YIELD_GRACE): it never cancels one. Nor
                # does a max_lease drain: it closes admission and the lease goes back once
                # its jobs end (TRIAL5 finding 7: with reclaim.grace, a job started a minute
                # before max_lease was cancelled, and jobs longer than max_lease never ran out).
                grace = max(p.reclaim.grace, YIELD_GRACE) if kind in ("yield", "max_lease") \
                    else p.reclaim.grace
                self.add("drain", f"{q.name}: {text}; drain lease {l.id} on {l.device} "
                         f"(grace {_dur(grace)})", l,
                         data={"kind": kind, "grace": grace, "force": False,
                      **({"for": self.yield_for[l.id]} if l.id in self.yield_for else {})})
                kept -= 1
                drained.add(l.id)
        kept = self.drop_unneeded(q, want, [l for l in live if l.id not in drained], kept)
        active = [l for l in live if l.state == ACTIVE and l.id not in drained]
        d = self.demand(q.name)
        for l in active:
            # A lease whose VMs every waiting job excludes (d.avoid) is idle for them too.
            if kept <= floor or (want > 0 and l.device not in d.avoid) or self.busy(l) \
                    or self.coming(l):
                continue
            since = max(x for x in (l.idle_since if l.idle_since is not None else l.updated_at,
                                    d.last_job_at) if x is not None)
            if self.now - since >= p.idle_timeout:
                self.add("drain", f"{q.name}: no waiting jobs and lease {l.id} on {l.device} idle for "
                         f"{_dur(self.now - since)} (idle_timeout {_dur(p.idle_timeout)}); drain", l,
                         data={"kind": "idle", "grace": p.reclaim.grace, "force": False})
                kept -= 1
                drained.add(l.id)
        self.consolidate(q, want, [l for l in live if l.state == ACTIVE and l.id not in drained],
                         kept)

    def drop_unneeded(self, q, want: int, live: list[LeaseView], kept: int) -> int:
        """Drain (``kind: unneeded``) the leases of ``q`` still in bring-up that no job needs
        any more (their jobs were cancelled, or taken by VMs of other leases): ``q``'s waiting
        jobs are covered by the supply of its other leases without it, ``q`` keeps more
        serving leases than its warm level (:meth:`floor`), and no job of ``q`` was submitted
        or started for the hold (``min(idle_timeout,`` :data:`UNNEEDED_HOLD` ``)``) since the
        lease was claimed, so a quick resubmit does not thrash. Newest first: it has done the
        least. The engine moves such a lease to ``restoring`` at once (the daemon's step in
        flight ends by itself, its late report refused) with no failure counted. ``live``:
        ``q``'s open leases not handled or drained in this plan; ``kept``: its serving count.
        Returns ``kept`` less the leases drained."""
        bringing = [l for l in live if l.state in BRINGUP_STATES]
        if not bringing:
            return kept
        p = q.policy
        floor = self.floor(q)
        hold = min(p.idle_timeout, UNNEEDED_HOLD)
        last = self.demand(q.name).last_job_at
        supply = sum(self.supply_of(l) for l in live)
        for l in sorted(bringing, key=lambda l: (-l.created_at, l.id)):
            if l.by_hand:  # an operator's lend (a pre-warm, a check): its bring-up runs out
                continue
            other = supply - self.supply_of(l)
            since = l.created_at if last is None else max(l.created_at, last)
            needed = want > other and l.device not in self.demand(q.name).avoid
            if kept <= floor or needed or self.now - since < hold:
                continue
            self.add("drain", f"{q.name}: {_plural(want, 'waiting job')}, {other} idle or "
                     f"starting VMs without lease {l.id} on {l.device} (still {l.state}), no job "
                     f"submitted or started for {_dur(self.now - since)} (hold {_dur(hold)}); "
                     "stop its bring-up and give the device back", l,
                     data={"kind": "unneeded", "grace": 0.0, "force": False})
            supply = other
            kept -= 1
        return kept

    def consolidate(self, q, want: int, active: list[LeaseView], kept: int) -> None:
        p = q.policy
        floor = self.floor(q)
        paused = [l for l in active if l.admission == "paused"]
        open_ = [l for l in active if l.admission != "paused"]
        supply = sum(self.supply_of(l) for l in open_)
        for l in paused:  # emptied: give the device back (not below the warm level, min_devices)
            if kept > floor and not self.busy(l) and not self.coming(l) and supply >= want:
                self.add("drain", f"{q.name}: paused lease {l.id} on {l.device} has emptied and "
                         + (f"{supply} idle VMs elsewhere cover {_plural(want, 'waiting job')}"
                            if want else "no job waits there") + "; drain",
                         l, data={"kind": "consolidate", "grace": p.reclaim.grace, "force": False})
                kept -= 1
        if len(open_) < 2 or len(open_) <= floor:
            return
        # One pause per tick: the least-busy lease, oldest first on a tie (it meets max_lease first).
        l = min(open_, key=lambda x: (self.busy(x), x.created_at, x.id))
        rest = supply - self.supply_of(l)
        if supply > want and rest >= want and self.busy(l) > 0:
            self.add("pause", f"{q.name}: {supply} idle VMs for {_plural(want, 'waiting job')}; stop "
                     f"dispatching to lease {l.id} on {l.device} ({self.busy(l)} busy) so it empties "
                     "first", l)



def owner_reclaim_outlook(inputs: Inputs) -> dict[str, list[str]]:
    """``{home queue: [lease ids]}``: for each home queue with waiting jobs, the active leases
    of its devices the owner reclaim takes (now or once due), one per waiting job as
    :meth:`_Planner.plan_reclaims` counts them (less the devices on their way back or about to
    take a job), in the order it takes them; the other active leases of its devices stay lent.
    For ``status``' home-queue waits (server/attention.py). Pure."""
    p = _Planner(inputs)
    taken: dict[str, object] = {}
    out: dict[str, list[str]] = {}
    for h, need, ranked in p.reclaim_ranking(taken):
        out[h] = [l.id for l in ranked[:max(0, need)]]
        taken.update((i, h) for i in out[h])
    return out


def plan(inputs: Inputs, explain: bool = False) -> list[Action]:
    """Decide what to do now (see the module docstring). Deterministic for the same inputs.
    ``explain``: also return non-acting ``blocked`` actions saying why demand stays unmet
    (for ``GET /v1/magic/plan``; executors that dispatch on ``kind`` leave it off)."""
    return _Planner(inputs, explain).run()
