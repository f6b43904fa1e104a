"""Reconcile's smarter lending (issue 11): the warm level of a queue by schedule and by learnt
arrivals, which lendable device to take (``device_fit``, ``max_share``), and idle leases given up
to magic queues that share their devices and starve (``yield_idle``). A mixin of the planner
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
        cache = self.__dict__.setdefault("_floors", {})
        if q.name not in cache:
            cache[q.name] = self._warm_level(q)
        return cache[q.name][0]

    def floor_reason(self, q) -> str:
        """What sets :meth:`floor` (for the lend reason): ``min_devices N`` or the schedule or
        the learnt level."""
        return self._warm_level(q)[1]

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
        devices = self.i.devices
        gpus = max((devices[i].gpus for i in self.selected(q) if devices[i].registered),
                   default=0)
        return q.vms_for(gpus)

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
        queue A whose VMs have all been idle for A's ``yield_idle``, on a device B may use and
        whose owners are not waiting for it, are drained (longest idle first) until the VMs B
        would get there cover its shortfall, less the VMs of leases already draining or
        restoring for a yield on devices B may use. A yields to B of lower priority only above
        A's warm level (:meth:`floor`)."""
        out: dict[str, tuple[str, str]] = {}
        givers = [q for q in self.defs.values() if q.policy.yield_idle is not None]
        if not givers:
            return out
        # Leases of the giving queues that matter, found once: yields on their way, and
        # active leases idle for their queue's yield_idle (a queue with jobs of its own gives
        # nothing).
        on_way, idle = [], []
        for a in givers:
            mine = self.open_leases.get(a.name, ())
            wanting = self.shortfall(a) > 0
            for l in mine:
                if l.state in (DRAINING, RESTORING) and (l.drain or {}).get("kind") == "yield":
                    on_way.append(l)
                elif l.state == ACTIVE and not wanting and not self.busy(l) and not self.coming(l):
                    since = l.idle_since if l.idle_since is not None else l.updated_at
                    if self.now - since >= a.policy.yield_idle:
                        idle.append((since, l.id, a, l))
        if not idle:
            return out
        idle.sort(key=lambda t: t[:2])
        serving = {q.name: sum(1 for l in self.open_leases.get(q.name, ())
                               if l.state != DRAINING and l.state != RESTORING)
                   for q in givers}
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
            if self.candidates(b):
                continue  # it can lend a device itself
            # selected + a VM fits = MagicQueue.matches
            usable = {devices[i].name: i for i in self.selected(b)
                      if devices[i].registered and b.vms_for(devices[i].gpus) >= 1}
            for l in on_way:  # yields already on their way
                if l.id not in counted and l.device in usable:
                    need -= b.vms_for(self.device_by_name[l.device].gpus)
                    counted.add(l.id)
            for since, _, a, l in idle:
                if need <= 0:
                    break
                if a.name == b.name or l.id in out or l.device not in usable:
                    continue
                bar = self._owner_bar(usable[l.device])
                if bar is not None and b.policy.priority <= bar:
                    continue  # the owners would take it back: no use to b
                if b.policy.priority < a.policy.priority and serving[a.name] <= self.floor(a):
                    continue
                gets = b.vms_for(self.device_by_name[l.device].gpus)
                out[l.id] = ("yield", f"{b.name} has {_plural(self.demand(b.name).waiting, 'job')}"
                                      f" waiting and no device to lend; lease {l.id} on {l.device}"
                                      f" idle for {_dur(self.now - since)} (yield_idle "
                                      f"{_dur(a.policy.yield_idle)}) would give it "
                                      f"{_plural(gets, 'VM')}")
                serving[a.name] -= 1
                need -= gets
        return out

    def defers_warm(self, q) -> bool:
        """True if ``q`` lends in stages (reconcile._Planner.lend): its first device for
        waiting jobs in priority order with the other queues, more for its jobs only once every
        sharing queue had its first, its warm level last (a queue that yields must not take
        back a device a starving queue needs, nor a second device the other queue's first
        jobs need)."""
        return q.policy.yield_idle is not None
