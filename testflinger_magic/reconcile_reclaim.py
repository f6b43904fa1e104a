"""Reconcile's owner reclaim: which active leases go back to home queues whose jobs wait, and
how many (one device per waiting job, less those already coming back), plus ``max_lease``. A
mixin of the planner (reconcile._Planner): it reads ``i`` (Inputs), ``defs``, ``open_leases``,
``held``, ``device_by_name``, ``reclaims``, ``now`` and the planner's ``demand``, ``busy`` and
``coming``. Pure: no I/O, no clock (``Inputs.now``).
"""

from __future__ import annotations

from .leases import ACTIVE, DRAINING, RESTORING
from .reconcile_model import LeaseView, _dur, _plural, busy_at_home


class Reclaims:
    """The owner reclaim rules of :class:`reconcile._Planner` (see the module docstring)."""

    def plan_reclaims(self) -> dict[str, tuple[str, str]]:
        """``{lease id: ("reclaim", text)}``: the active leases to give back to home queues whose
        oldest job waited longer than the lending queue's ``reclaim.owner_wait``.

        Only as many as the owner needs: a device serves its home queue one job at a time, so a
        home queue with N waiting jobs needs N devices, less those already on their way back
        (draining for a ``reclaim``, or restoring whatever the drain) and the devices already back home
        that are about to take its job (:meth:`home_supply`). Idlest first (fewest busy VM
        agents, then the oldest lease): reclaiming every lent device for one waiting job would
        cancel other people's running jobs for nothing.

        The idlest at the moment of the reclaim may not stay so (TRIAL6 finding M1: a lease
        went wholly idle during the grace of a busy one's reclaim drain, whose 8 jobs were then
        cancelled). So, while a reclaim drain would still cancel jobs at its grace's end (busy,
        not forced) and the home queue needs no more devices than are returning, a due lease
        none of whose VMs runs or awaits a job is reclaimed as well, one per such drain; the
        next plan finds more devices returning than the home queues need, and the busy drains
        are undrained (:attr:`reclaim_undrains`, busiest first; the lifecycle adds the
        ``undrain``), as are busy reclaim drains whose owners' jobs no longer wait (served by
        another device, or cancelled)."""
        out: dict[str, tuple[str, str]] = {}
        drains = self.reclaim_drains()
        # Devices returning (or back home) beyond what each home queue's waiting jobs need; a
        # home queue nothing waits on needs none of its returning devices.
        surplus = {h: len(ls) for h, ls in drains.items()}
        for h, need, ranked in self.reclaim_ranking(out):
            surplus[h] = -need
            hd = self.demand(h)
            candidates = [l for l in ranked if (
                hd.oldest_age > self.defs[l.queue].policy.reclaim.owner_wait
                or self.owner_waited(self.defs[l.queue], l, hd.oldest_age))]
            for l in candidates[:max(0, need)]:
                out[l.id] = ("reclaim", self._reclaim_text(h, l))
            if need < 0:
                continue  # more returning than needed: the busy drains are undrained below
            costly = [l for l in drains.get(h, ()) if self._would_cancel(l)]
            idle = [l for l in candidates[max(0, need):]
                    if not self.busy(l) and not self.coming(l) and l.id not in out]
            for l, instead in zip(idle, costly):
                out[l.id] = ("reclaim", self._reclaim_text(h, l) + (
                    f"; lease {l.id} is idle: taken instead of lease {instead.id} on "
                    f"{instead.device}, whose {_plural(self.busy(instead), 'busy VM agent')} "
                    "keep their jobs"))
        self.reclaim_undrains = self._surplus_undrains(drains, surplus)
        return out

    def _reclaim_text(self, h: str, l: LeaseView) -> str:
        hd, r = self.demand(h), self.defs[l.queue].policy.reclaim
        limit = f"owner_wait {_dur(r.owner_wait)}"
        if hd.oldest_age <= r.owner_wait:  # reclaimed early: its VMs are all idle
            limit = f"idle_wait {_dur(r.idle_wait)}, its VMs idle"
        return (f"home queue {h} of {l.device} has {_plural(hd.waiting, 'job')} waiting up to "
                f"{_dur(hd.oldest_age)} ({limit})")

    def _would_cancel(self, l: LeaseView) -> bool:
        """True if ``l`` is a reclaim drain whose grace's end would cancel jobs: draining, not
        forced, with busy VM agents."""
        drain = l.drain or {}
        return (l.state == DRAINING and drain.get("kind") == "reclaim"
                and not drain.get("forced") and drain.get("forced_at") is None
                and self.busy(l) > 0)

    def reclaim_drains(self) -> dict[str, list[LeaseView]]:
        """``{home queue: open leases draining or restoring for a reclaim}``, each lease under
        every home queue of its device (as :meth:`reclaim_ranking` counts them), in lease
        order."""
        out: dict[str, list[LeaseView]] = {}
        for l in (l for ls in self.open_leases.values() for l in ls):
            if l.state not in (DRAINING, RESTORING) or (l.drain or {}).get("kind") != "reclaim":
                continue
            dev = self.device_by_name.get(l.device)
            for h in sorted(set(dev.home_queues) if dev is not None else ()):
                out.setdefault(h, []).append(l)
        return out

    def _surplus_undrains(self, drains: dict[str, list[LeaseView]],
                          surplus: dict[str, int]) -> dict[str, str]:
        """``{lease id: text}``: the reclaim drains that would cancel jobs and that every home
        queue of their device can do without (``surplus``: devices returning or back home
        beyond its waiting jobs), busiest first, then the newest lease."""
        costly = {l.id: l for ls in drains.values() for l in ls if self._would_cancel(l)}
        out: dict[str, str] = {}
        for l in sorted(costly.values(), key=lambda l: (-self.busy(l), -l.created_at, l.id)):
            homes = sorted(set(self.device_by_name[l.device].home_queues))
            if not homes or any(surplus.get(h, 0) <= 0 for h in homes):
                continue
            for h in homes:
                surplus[h] -= 1
            why = ("enough devices are returning or back home" if any(
                self.demand(h).waiting for h in homes) else "no job waits there any more")
            out[l.id] = ("home queue" + ("s " if len(homes) > 1 else " ") + ", ".join(
                f"{h} ({_plural(self.demand(h).waiting, 'job')} waiting)" for h in homes)
                + f" no longer need{'' if len(homes) > 1 else 's'} {l.device}: {why}")
        return out

    def reclaim_ranking(self, taken: dict):
        """Yield ``(home queue, need, ranked)`` for each home queue with waiting jobs, in name
        order: ``need`` = its waiting jobs less its devices already on their way back (draining
        for a ``reclaim``, or restoring whatever the drain) and those back home about to take a
        job (:meth:`home_supply`); ``ranked``: the active leases of its devices whose queue is
        defined, whose agent host is not stale and whose queue's ``priority`` does not outrank
        the home queue's highest waiting job (``max_priority``: such a queue may lend the device
        while the owner's jobs wait, so it keeps it), in the order the owner reclaim takes them
        (idlest first, then the oldest lease), less those in ``taken`` (lease ids already
        reclaimed for another home queue; read lazily, so the caller may add to it between
        homes). The owner reclaim (:meth:`plan_reclaims`) takes the first ``need`` of them that
        are due; ``status`` (:func:`owner_reclaim_outlook`) says which devices that will be."""
        homes = sorted(h for h in set().union(*[d.home_queues for d in self.i.devices])
                       if self.demand(h).waiting > 0)
        if not homes:
            return
        at_home = self.home_supply(homes)
        # The open leases of each home queue's devices, in lease order: one pass over leases.
        by_home: dict[str, list[LeaseView]] = {}
        for l in (l for ls in self.open_leases.values() for l in ls):
            dev = self.device_by_name.get(l.device)
            if dev is None:
                continue
            for h in set(dev.home_queues):
                by_home.setdefault(h, []).append(l)
        for h in homes:
            hd = self.demand(h)
            returning, ranked = 0, []
            for l in by_home.get(h, ()):
                if l.id in taken or l.device in hd.avoid:
                    # (every waiting job of h excludes that device: taking it back, or counting
                    # it as on its way back, serves none of them; TRIAL11 F4)
                    continue
                # On its way back: a reclaim drain, or any lease restoring (an idle drain, a
                # bring-up stopped, an operator's drain: its device is home in seconds; TRIAL7).
                if l.state == RESTORING or (
                        l.state == DRAINING and (l.drain or {}).get("kind") == "reclaim"):
                    returning += 1
                # A lease on a stale agent host cannot come back (nobody works it): reclaiming
                # it would leave the owner waiting while another lent device could go home.
                # A queue whose priority outranks every waiting owner job may lend the device
                # while they wait (reconcile_eligibility "owner first"): reclaiming its lease
                # would hand the device straight back to it (TRIAL5 finding 5).
                q = self.defs.get(l.queue)
                if l.state == ACTIVE and q is not None and not self.on_stale_host(l) \
                        and q.policy.priority <= hd.max_priority:
                    ranked.append(l)
            ranked.sort(key=lambda l: (self.busy(l), l.created_at, l.id))
            yield h, hd.waiting - returning - at_home.get(h, 0), ranked

    def home_supply(self, homes: list[str]) -> dict[str, int]:
        """``{home queue: devices}`` of ``homes`` (queues with jobs waiting) whose device is
        back home and about to take one of those jobs, so an owner reclaim need not take
        another: a registered device no lease holds, not quarantined, its agent ``waiting``
        with no job, and either just given back (``DeviceView.agent_back`` False: its restarted
        agent has not posted yet, within the give-back window of server/giveback.py) or
        posted ``waiting`` at most :data:`AGENT_PICKUP` seconds ago (it asks for a job right
        after that post, TESTFLINGER.md §3.2-3.4). A device counts for each of its home
        queues, as a lease returning for a reclaim does."""
        wanted = set(homes)
        out: dict[str, int] = {}
        for d in self.i.devices:
            if not wanted.intersection(d.home_queues) or not d.registered or d.quarantined \
                    or d.name in self.held or busy_at_home(d.agent_state, d.job_id):
                continue
            if d.agent_back and not self._picking_up(d):
                continue
            for h in set(d.home_queues) & wanted:
                if d.name not in self.demand(h).avoid:  # its jobs all exclude it: no supply
                    out[h] = out.get(h, 0) + 1
        return out

    def owner_waited(self, q, l: LeaseView, oldest_age: float) -> bool:
        """True if an owner's job waiting ``oldest_age`` seconds reclaims ``q``'s active lease
        ``l``: longer than ``reclaim.owner_wait``, or, when none of ``l``'s VMs runs or awaits a
        job, longer than ``reclaim.idle_wait`` (if set)."""
        r = q.policy.reclaim
        if oldest_age > r.owner_wait:
            return True
        return (r.idle_wait is not None and oldest_age > r.idle_wait
                and not self.busy(l) and not self.coming(l))

    def reclaim_reason(self, q, l: LeaseView):
        p = q.policy
        if l.id in self.reclaims:
            return self.reclaims[l.id]
        if p.max_lease and self.now - l.created_at >= p.max_lease:
            return ("max_lease", f"lease {l.id} lent for {_dur(self.now - l.created_at)} "
                                 f"(max_lease {_dur(p.max_lease)})")
        return None
