"""Reconcile's smarter lending (issue 11): the warm level of a queue by schedule and by learnt
arrivals, which lendable device to take (``device_fit``, ``max_share``), and leases with idle VMs
(wholly idle, or partly busy) given up to magic queues that share their devices and starve
(``yield_idle``). A mixin of the planner
(reconcile._Planner): it reads ``i`` (Inputs), ``defs``, ``open_leases``, ``held``, ``taken``,
``device_by_name`` and the eligibility methods. Pure: no I/O, no clock (``Inputs.now`` and
``Inputs.wall``).

Every rule here is off with the knobs' defaults (``warm`` empty, no ``warm_learn``,
``device_fit: waste``, no ``yield_idle``, ``max_share: 1``): plan() then decides exactly as
before them (tests/test_reconcile_oracle.py).
"""

from __future__ import annotations

import math

from .leases import ACTIVE, DRAINING, RESTORING
from .queue_policy import learned_jobs, scheduled_level
from .reconcile_model import DeviceView, _dur, _plural


class Sharing:
    """Warm levels, device choice and yields (see the module docstring)."""

    # ------------------------------------------------------------------ warm level

    def floor(self, q) -> int:
        """Devices ``q`` keeps lent without demand now: the largest of ``min_devices``, the
        ``warm`` window covering ``Inputs.wall`` and the learnt level, at most
        ``max_devices``. Cached per plan."""
        p = q.policy
        if not p.warm and p.warm_learn is None:
            return p.min_devices  # the old rule (no cap: plan() as before, the oracle test)
        return self._warm_cached(q)[0]

    def floor_reason(self, q) -> str:
        """What sets :meth:`floor` (for the lend reason): ``min_devices N`` or the schedule or
        the learnt level."""
        return self._warm_cached(q)[1]

    def _warm_cached(self, q) -> tuple[int, str]:
        """:meth:`_warm_level`, once per queue and plan (its inputs do not change in a plan)."""
        cache = self.__dict__.setdefault("_floors", {})
        if q.name not in cache:
            cache[q.name] = self._warm_level(q)
        return cache[q.name]

    def _warm_level(self, q) -> tuple[int, str]:
        p = q.policy
        level, why = p.min_devices, f"min_devices {p.min_devices}"
        if not p.warm and p.warm_learn is None:
            return level, why
        wall = self.i.wall if self.i.wall is not None else self.now
        scheduled = scheduled_level(p.warm, p.timezone, wall)
        if scheduled > level:
            level, why = scheduled, f"warm schedule {scheduled} now ({p.timezone})"
        if p.warm_learn is not None:
            jobs = learned_jobs(p.warm_learn, p.timezone, self.now, wall,
                                self.i.arrivals.get(q.name) or [])
            per = self.largest_vms(q) if jobs else 0
            learnt = min(p.warm_learn.max_devices, math.ceil(jobs / per)) if per else 0
            if learnt > level:
                level, why = learnt, (f"learnt warm level {learnt} ({jobs:g} jobs expected in "
                                      f"the next {_dur(p.warm_learn.ahead)})")
        return min(level, p.max_devices), why

    def largest_vms(self, q) -> int:
        """VMs of the largest device ``q`` may use (0: none): a learnt job count becomes
        devices at this many VMs each. ``vms_for`` grows with the GPU count, so this is
        ``vms_for`` of the most GPUs among the registered devices the selection picks."""
        return q.vms_for(self.most_gpus(q))

    # ------------------------------------------------------------------ device choice

    def _pool_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """``({home queue: registered devices}, {home queue: devices held by a lease or lent
        earlier in this plan})``, counted when a capped queue first asks, then kept up to date
        by :meth:`note_lent`."""
        if self._pools is None:
            size: dict[str, int] = {}
            lent: dict[str, int] = {}
            for d in self.i.devices:
                if not d.registered:
                    continue
                for h in set(d.home_queues):
                    size[h] = size.get(h, 0) + 1
                    if d.name in self.held or d.name in self.taken:  # taken: lent this plan
                        lent[h] = lent.get(h, 0) + 1
            self._pools = (size, lent)
        return self._pools

    def share_blocks(self, q, d: DeviceView) -> str | None:
        """Why lending ``d`` to ``q`` would break ``q``'s ``max_share`` (None: it does not): a
        home queue of ``d`` would have more than floor(max_share x its registered devices)
        lent, counting the devices lent earlier in this plan."""
        share = q.policy.max_share
        if share >= 1.0:
            return None
        size, lent = self._pool_counts()
        for h in sorted(set(d.home_queues)):
            cap = math.floor(share * size.get(h, 0) + 1e-9)
            if lent.get(h, 0) + 1 > cap:
                return (f"home queue {h} has {lent.get(h, 0)} of {size.get(h, 0)} devices lent "
                        f"(max_share {share:g}: at most {cap})")
        return None

    def note_lent(self, d: DeviceView) -> None:
        """Count a device lent in this plan in its home pools (for ``max_share``)."""
        if self._pools is None:
            return
        _, lent = self._pools
        for h in set(d.home_queues):
            lent[h] = lent.get(h, 0) + 1

    def pick(self, q, candidates: list, need: int):
        """Take the device to lend from ``candidates`` (best first, :meth:`candidates`) for
        ``need`` VMs still uncovered (<= 0: a warm lend): the first with ``device_fit: waste``;
        with ``demand``, the smallest whose VMs cover ``need`` (a warm lend: the smallest), else
        the largest; fewer VMs first on a tie, then the candidates' order. Skips devices that
        ``max_share`` forbids. Returns ``(device, vms)`` removed from ``candidates``, or None.
        Cost: O(1) with the defaults, one pass over ``candidates`` otherwise."""
        capped = q.policy.max_share < 1.0
        if q.policy.device_fit != "demand":
            if not capped:
                return candidates.pop(0) if candidates else None
            for k, (d, _) in enumerate(candidates):
                if self.share_blocks(q, d) is None:
                    return candidates.pop(k)
            self._note_share(q, candidates)
            return None
        best = None  # (key, position): covering -> fewest VMs; else -> most VMs
        for k, (d, vms) in enumerate(candidates):
            key = (0, vms) if vms >= need else (1, -vms)
            if best is not None and key >= best[0]:
                continue
            if capped and self.share_blocks(q, d) is not None:
                continue
            best = (key, k)
        if best is None:
            self._note_share(q, candidates)
            return None
        return candidates.pop(best[1])

    def _note_share(self, q, candidates: list) -> None:
        if candidates:
            self._share_notes[q.name] = self.share_blocks(q, candidates[0][0])

    # ------------------------------------------------------------------ yields

    def plan_yields(self) -> dict[str, tuple[str, str]]:
        """``{lease id: ("yield", text)}``: active leases of queues with ``yield_idle`` to drain
        for a magic queue that starves. A queue B starves when its waiting jobs exceed its
        supply, it is not suspended, below ``max_devices`` and ``max_starting``, and no device
        can be lent to it now. For each starving B (highest priority first), leases of another
        queue A on a device B may use and whose owners are not waiting for it are drained until
        the VMs B would get there cover its shortfall, less the VMs of leases already draining
        or restoring for a yield on devices B may use:

        1. *wholly idle* leases: all VMs idle for A's ``yield_idle`` and A has no shortfall;
           longest idle first;
        2. then *partly busy* ones (:meth:`_partly_idle`): open admission, some VMs idle and
           some running jobs, A quiet for ``yield_idle`` (no job of A submitted or started in
           that time, the lease active that long), A's waiting jobs still covered by its other
           leases' supply, and (the anti-thrash rule) A holding at least two more serving
           leases than B will after the yield, so the counts only ever move towards each other
           and a lease B got by a yield is never yielded back to A; most idle VMs first, then
           fewest running jobs. Their drain waits for the running jobs (:data:`YIELD_GRACE`).

        A yields to B of lower priority only above A's warm level (:meth:`floor`). Cost: one
        pass over the giving queues' leases, then per starving queue over the candidates."""
        out: dict[str, tuple[str, str]] = {}
        givers = [q for q in self.defs.values() if q.policy.yield_idle is not None]
        if not givers:
            return out
        # Leases of the giving queues that matter, found once: yields on their way, active
        # leases idle for their queue's yield_idle (a queue with jobs of its own gives
        # nothing), and partly busy leases of quiet queues.
        on_way, idle, partly = [], [], []
        slack: dict[str, int] = {}
        for a in givers:
            mine = self.open_leases.get(a.name, ())
            wanting = self.shortfall(a) > 0
            slack[a.name] = -self.shortfall(a)
            for l in mine:
                if l.state in (DRAINING, RESTORING) and (l.drain or {}).get("kind") == "yield":
                    on_way.append(l)
                elif l.state == ACTIVE and not wanting and not self.busy(l) and not self.coming(l):
                    since = l.idle_since if l.idle_since is not None else l.updated_at
                    if self.now - since >= a.policy.yield_idle:
                        idle.append((since, l.id, a, l))
                elif self._partly_idle(a, l):
                    partly.append(((-self.idle(l), self.busy(l), l.created_at, l.id), a, l))
        if not idle and not partly:
            return out
        idle.sort(key=lambda t: t[:2])
        partly.sort(key=lambda t: t[0])
        serving = {q.name: self._serving(q) for q in givers}
        counted: set[str] = set()
        devices = self.i.devices
        for b in sorted(self.defs.values(), key=lambda q: (-q.policy.priority, q.name)):
            need = self.shortfall(b)
            if need <= 0 or b.name in self.i.suspended:
                continue
            mine = self.open_leases.get(b.name, [])
            if len(mine) >= b.policy.max_devices or \
                    sum(1 for l in mine if l.state not in (ACTIVE, DRAINING, RESTORING)) \
                    >= b.policy.max_starting:
                continue
            if self._can_lend(b):
                continue  # it can lend a device itself
            # selected + a VM fits = MagicQueue.matches
            usable = {devices[i].name: i for i in self.selected(b)
                      if devices[i].registered and b.vms_for(devices[i].gpus) >= 1}
            coming = 0  # leases on their way to b (for the anti-thrash count)
            for l in on_way:  # yields already on their way
                if l.id not in counted and l.device in usable:
                    need -= b.vms_for(self.device_by_name[l.device].gpus)
                    counted.add(l.id)
                    coming += 1
            room = b.policy.max_devices - len(mine) - coming  # b holds at most max_devices
            for since, _, a, l in idle:
                if need <= 0 or room <= 0:
                    break
                if not self._may_yield(a, b, l, usable, out, serving):
                    continue
                gets = b.vms_for(self.device_by_name[l.device].gpus)
                self.yield_for[l.id] = b.name
                out[l.id] = ("yield", f"{b.name} has {_plural(self.demand(b.name).waiting, 'job')}"
                                      f" waiting and no device to lend; lease {l.id} on {l.device}"
                                      f" idle for {_dur(self.now - since)} (yield_idle "
                                      f"{_dur(a.policy.yield_idle)}) would give it "
                                      f"{_plural(gets, 'VM')}")
                serving[a.name] -= 1
                need -= gets
                coming += 1
                room -= 1
            if need <= 0 or room <= 0 or not partly:
                continue
            b_count = self._serving(b) + coming
            for _, a, l in partly:
                if need <= 0 or room <= 0:
                    break
                if not self._may_yield(a, b, l, usable, out, serving):
                    continue
                if serving[a.name] - (b_count + 1) < 1:
                    continue  # anti-thrash: a keeps at least as many leases as b will hold
                if slack[a.name] - self.supply_of(l) < 0:
                    continue  # a's waiting jobs need this lease's idle VMs
                gets = b.vms_for(self.device_by_name[l.device].gpus)
                self.yield_for[l.id] = b.name
                out[l.id] = ("yield", f"{b.name} has {_plural(self.demand(b.name).waiting, 'job')}"
                                      f" waiting and no device to lend; lease {l.id} on {l.device}"
                                      f" has {_plural(self.idle(l), 'idle VM')} and "
                                      f"{_plural(self.busy(l), 'running job')}, {a.name} quiet "
                                      f"for {_dur(a.policy.yield_idle)} (yield_idle) with "
                                      f"{_plural(serving[a.name], 'lease')} to {b.name}'s "
                                      f"{b_count}: stop new jobs there, let the running ones "
                                      f"finish, then give it {_plural(gets, 'VM')}")
                serving[a.name] -= 1
                slack[a.name] -= self.supply_of(l)
                b_count += 1
                need -= gets
                room -= 1
        return out

    def _can_lend(self, q) -> bool:
        """True if a device can be lent to ``q`` now: a candidate that ``max_share`` allows
        (a device idle at home but over the share cap is no device for ``q``)."""
        cands = self.candidates(q)
        if q.policy.max_share >= 1.0:
            return bool(cands)
        return any(self.share_blocks(q, d) is None for d, _ in cands)

    def _serving(self, q) -> int:
        """Open leases of ``q`` not on their way back (bringing up or active)."""
        return sum(1 for l in self.open_leases.get(q.name, ())
                   if l.state != DRAINING and l.state != RESTORING)

    def _partly_idle(self, a, l) -> bool:
        """True if ``a``'s lease ``l`` is a partly busy yield candidate: active with open
        admission, all its VMs reporting, some idle and some busy, and ``a`` quiet for its
        ``yield_idle``: no job of ``a`` submitted or started since (``QueueDemand.last_job_at``)
        and ``l`` active that long, so its idle VMs have served nothing new for that time."""
        if l.state != ACTIVE or l.admission == "paused" or self.coming(l):
            return False
        if not self.busy(l) or not self.idle(l):
            return False
        start = l.active_since if l.active_since is not None else l.created_at
        last = self.demand(a.name).last_job_at
        since = start if last is None else max(start, last)
        return self.now - since >= a.policy.yield_idle

    def _may_yield(self, a, b, l, usable: dict, out: dict, serving: dict) -> bool:
        """The rules every yield of ``a``'s lease ``l`` to ``b`` keeps: another queue, a
        device ``b`` may use, not yielded already in this plan, owners not about to take it
        back, and not below ``a``'s warm level for a lower-priority ``b``."""
        if a.name == b.name or l.id in out or l.device not in usable:
            return False
        bar = self._owner_bar(usable[l.device])
        if bar is not None and b.policy.priority <= bar:
            return False  # the owners would take it back: no use to b
        if b.policy.priority < a.policy.priority and serving[a.name] <= self.floor(a):
            return False
        return True

    def defers_warm(self, q) -> bool:
        """True if ``q`` lends in stages (reconcile._Planner.lend): its first device for
        waiting jobs in priority order with the other queues, more for its jobs only once every
        sharing queue had its first, its warm level last (a queue that yields must not take
        back a device a starving queue needs, nor a second device the other queue's first
        jobs need)."""
        return q.policy.yield_idle is not None
