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
        cache = self.__dict__.setdefault("_floors", {})
        if q.name not in cache:
            level, why = self._warm_level(q)
            cache[q.name] = (level, why)
        return cache[q.name][0]

    def floor_reason(self, q) -> str:
        """What sets :meth:`floor` (for the lend reason): ``min_devices N`` or the schedule or
        the learnt level."""
        self.floor(q)
        return self._floors[q.name][1]

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
        devices at this many VMs each."""
        return max((q.vms_for(d.gpus) for d in self.eligible(q)), default=0)

    # ------------------------------------------------------------------ device choice

    def _pool_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """``({home queue: registered devices}, {home queue: devices held by a lease})``."""
        if getattr(self, "_pools", None) is None:
            size: dict[str, int] = {}
            lent: dict[str, int] = {}
            for d in self.i.devices:
                if not d.registered:
                    continue
                for h in set(d.home_queues):
                    size[h] = size.get(h, 0) + 1
                    if d.name in self.held:
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
        if getattr(self, "_pools", None) is None:
            return
        _, lent = self._pools
        for h in set(d.home_queues):
            lent[h] = lent.get(h, 0) + 1

    def pick(self, q, candidates: list, need: int):
        """Take the device to lend from ``candidates`` (best first, :meth:`candidates`) for
        ``need`` VMs still uncovered (<= 0: a warm lend): the first with ``device_fit: waste``;
        with ``demand``, the smallest whose VMs cover ``need`` (a warm lend: the smallest), else
        the largest; fewer VMs first on a tie, then the candidates' order. Skips devices that
        ``max_share`` forbids. Returns ``(device, vms)`` removed from ``candidates``, or None."""
        allowed = [k for k, (d, _) in enumerate(candidates) if self.share_blocks(q, d) is None]
        if not allowed:
            if candidates:
                self._share_notes[q.name] = self.share_blocks(q, candidates[0][0])
            return None
        k = allowed[0]
        if q.policy.device_fit == "demand":
            covering = [j for j in allowed if candidates[j][1] >= need]
            if covering:
                k = min(covering, key=lambda j: (candidates[j][1], j))
            else:
                k = min(allowed, key=lambda j: (-candidates[j][1], j))
        return candidates.pop(k)

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
        serving = {q.name: sum(1 for l in self.open_leases.get(q.name, ())
                               if l.state != DRAINING and l.state != RESTORING)
                   for q in givers}
        counted: set[str] = set()
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
            usable = {self.i.devices[i].name: i for i in self.selected(b)
                      if self.i.devices[i].registered and b.matches(self._device_dict(i))}
            for a in givers:  # yields already on their way
                for l in self.open_leases.get(a.name, ()):
                    if l.id in counted or l.device not in usable:
                        continue
                    if l.state in (DRAINING, RESTORING) and (l.drain or {}).get("kind") == "yield":
                        need -= b.vms_for(self.device_by_name[l.device].gpus)
                        counted.add(l.id)
            offers = []
            for a in givers:
                if a.name == b.name or self.shortfall(a) > 0:
                    continue
                for l in self.open_leases.get(a.name, ()):
                    if l.state != ACTIVE or l.id in out or l.device not in usable:
                        continue
                    if self.busy(l) or self.coming(l):
                        continue
                    since = l.idle_since if l.idle_since is not None else l.updated_at
                    if self.now - since < a.policy.yield_idle:
                        continue
                    bar = self._owner_bar(usable[l.device])
                    if bar is not None and b.policy.priority <= bar:
                        continue  # the owners would take it back: no use to b
                    offers.append((since, l.id, a, l))
            for since, _, a, l in sorted(offers, key=lambda t: t[:2]):
                if need <= 0:
                    break
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
        """True if ``q``'s warm lends wait until every queue has lent for its waiting jobs (a
        queue that yields must not take back a device a starving queue needs)."""
        return q.policy.yield_idle is not None
