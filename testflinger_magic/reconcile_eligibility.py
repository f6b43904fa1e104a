"""Reconcile's eligibility: which devices a magic queue's selection picks, which of them can be
lent now (candidates, best first), and why not (``unlendable``). A mixin of the planner
(reconcile._Planner), which owns the inputs and the per-plan caches it reads: ``i`` (Inputs),
``held``, ``taken``, ``_index``, ``_lendable``, ``_dicts``, ``_bars``. Split from reconcile.py
(pure move)."""

from __future__ import annotations

import math

from . import fabric
from .reconcile_model import (AGENT_PICKUP, DeviceView, QueueDemand, _NO_DEMAND, _device_dict, _dur,
                              _plural, busy_at_home)


class Eligibility:
    """Eligibility index and lending candidates (see the module docstring)."""

    # ------------------------------------------------------------------ eligibility index

    @staticmethod
    def _keys(d: DeviceView):
        yield ("agent", d.name)
        for t in d.tags:
            yield ("tag", t)
        for h in d.home_queues:
            yield ("home", h)

    def _build(self, positions) -> dict[tuple[str, str], list[int]]:
        """``{selection key: positions}`` of the devices at ``positions`` (increasing), each
        under each of its keys (:meth:`_keys`) once."""
        index: dict[tuple[str, str], list[int]] = {}
        devices = self.i.devices
        for i in positions:
            d = devices[i]
            for kind, values in (("agent", (d.name,)), ("tag", d.tags), ("home", d.home_queues)):
                for v in values:
                    found = index.get((kind, v))
                    if found is None:
                        index[(kind, v)] = [i]
                    elif found[-1] != i:  # a key the device has twice (positions increase)
                        found.append(i)
        return index

    def _device_dict(self, i: int) -> dict:
        d = self._dicts.get(i)
        if d is None:
            d = self._dicts[i] = _device_dict(self.i.devices[i])
        return d

    def _selected(self, q, index: dict[tuple[str, str], list[int]]) -> list[int]:
        """Positions (input order) of the devices of ``index`` that ``q``'s selection picks
        (queues.MagicQueue.selects: by agent name, tag or home queue, not excluded)."""
        sel = q.devices
        found: set[int] = set()
        for kind, values in (("agent", sel.agents), ("tag", sel.tags), ("home", sel.home_queues)):
            for v in values:
                found.update(index.get((kind, v), ()))
        if not sel.exclude:
            return sorted(found)
        exclude = set(sel.exclude)
        devices = self.i.devices
        return sorted(i for i in found if devices[i].name not in exclude)

    def selected(self, q) -> list[int]:
        """Positions of the registered or not devices ``q``'s selection picks (input order)."""
        if self._index is None:
            self._index = self._build(range(len(self.i.devices)))
        return self._selected(q, self._index)

    def most_gpus(self, q) -> int:
        """The most GPUs among the registered devices ``q``'s selection picks (0: none): the
        largest of each selection key's, kept per key for the plan (the selection's devices
        are the union of its keys' when it excludes none)."""
        sel = q.devices
        if sel.exclude:
            devices = self.i.devices
            return max((devices[i].gpus for i in self.selected(q) if devices[i].registered),
                       default=0)
        if self._index is None:
            self._index = self._build(range(len(self.i.devices)))
        most = self.__dict__.setdefault("_most_gpus", {})
        best = 0
        for kind, values in (("agent", sel.agents), ("tag", sel.tags), ("home", sel.home_queues)):
            for v in values:
                key = (kind, v)
                if key not in most:
                    most[key] = max((self.i.devices[i].gpus for i in self._index.get(key, ())
                                     if self.i.devices[i].registered), default=0)
                best = max(best, most[key])
        return best

    def eligible(self, q) -> list[DeviceView]:
        """Registered devices ``q`` may use (``q.matches``), in input order."""
        devices = self.i.devices
        return [devices[i] for i in self.selected(q)
                if devices[i].registered and q.matches(self._device_dict(i))]

    def demand(self, queue: str) -> QueueDemand:
        return self.i.demand.get(queue, _NO_DEMAND)

    def fabric_refused(self, q) -> list[DeviceView]:
        """The registered devices ``q``'s selection picks that have GPUs enough for one of its
        VMs but are NVSwitch devices its VMs of several GPUs would be refused on
        (:func:`testflinger_magic.fabric.refuses`), in input order: never lent to ``q``."""
        if q.vm.gpus <= 1:
            return []
        devices = self.i.devices
        return [devices[i] for i in self.selected(q)
                if devices[i].registered and q.vms_for(devices[i].gpus) >= 1
                and fabric.refuses(q.vm.gpus, devices[i])]

    def no_match_detail(self, q) -> str:
        """Why no registered device matches ``q``: the selection picks none, the devices it
        picks that are big enough are NVSwitch devices its VMs of several GPUs are refused on
        (:meth:`fabric_refused`, naming them and the operator's choices), or it picks some that
        have too few GPUs for one VM (the limiting fact is then the GPU count)."""
        picked = [self.i.devices[i] for i in self.selected(q) if self.i.devices[i].registered]
        refused = self.fabric_refused(q)
        if refused:
            return fabric.blocked_text(q.vm.gpus, refused)
        if picked:
            largest = max(d.gpus for d in picked)
            return (f"needs {_plural(q.vm.gpus, 'GPU')} per VM; the largest of the "
                    f"{_plural(len(picked), 'device')} its devices selection picks has "
                    f"{largest}")
        return (f"no registered device matches its devices selection "
                f"({_plural(len(self.i.devices), 'device')} registered)")

    def unlendable(self, q) -> dict[str, int]:
        """Why the devices matching ``q`` are not lendable now, counted (each device once, first
        reason wins): ``quarantined``, ``lent`` (held by an open lease), ``lent in a failed lease``
        (held by a ``failed`` lease: out of its home queues until a person releases it, TRIAL
        finding 3), ``returning`` (given back, its agent not seen since:
        ``DeviceView.agent_back``), ``on stale host`` (its agent host sends no heartbeat:
        ``Inputs.stale_hosts``), ``MAAS unreachable`` (its agent host's daemon says MAAS does not
        answer: ``Inputs.maas_down_hosts``; a key only when counted), ``on a silent agent host``
        (no heartbeat for ``QUIET_HOST_AFTER``, not yet stale: ``Inputs.quiet_hosts``; a key
        only when counted: TRIAL14 F3, a hung daemon was handed a second device), ``held back: MAAS
        refused it`` (a back-off after MAAS refused its bring-up: ``DeviceView.held_back``; a
        key only when counted), ``busy`` (its agent is not
        waiting or has a job), ``owner first`` (its home queue has jobs of at least ``q``'s
        priority waiting, or jobs waiting and its agent just posted ``waiting``:
        :meth:`_picking_up`), ``excluded by the waiting jobs`` (every waiting job of ``q`` names all
        its VMs in ``exclude_agents``: ``QueueDemand.avoid``; a key only when counted), ``idle``
        (lendable, but no VM of ``q`` fits or it was lent in this plan)."""
        counts = {"quarantined": 0, "lent": 0, "lent in a failed lease": 0, "returning": 0,
                  "on stale host": 0, "MAAS unreachable": 0, "busy": 0, "owner first": 0,
                  "idle": 0}
        stale = self.i.stale_hosts
        failed = self._failed_devices()
        for d in self.eligible(q):
            if d.quarantined:
                counts["quarantined"] += 1
            elif d.name in failed and d.name not in self.taken:
                counts["lent in a failed lease"] += 1
            elif d.name in self.held or d.name in self.taken:
                counts["lent"] += 1
            elif not d.agent_back:
                counts["returning"] += 1
            elif d.agent_host in stale:
                counts["on stale host"] += 1
            elif d.agent_host in self.i.maas_down_hosts:
                counts["MAAS unreachable"] += 1
            elif d.agent_host in self.i.quiet_hosts:
                counts["on a silent agent host"] = counts.get("on a silent agent host", 0) + 1
            elif d.held_back:
                counts["held back: MAAS refused it"] = counts.get(
                    "held back: MAAS refused it", 0) + 1
            elif busy_at_home(d.agent_state, d.job_id):
                counts["busy"] += 1
            elif any(self.demand(h).waiting > 0 and d.name not in self.demand(h).avoid and (
                    q.policy.priority <= self.demand(h).max_priority or self._picking_up(d))
                    for h in d.home_queues):
                counts["owner first"] += 1
            elif d.name in self.demand(q.name).avoid:
                counts["excluded by the waiting jobs"] = counts.get(
                    "excluded by the waiting jobs", 0) + 1
            else:
                counts["idle"] += 1
        if not counts["MAAS unreachable"]:
            del counts["MAAS unreachable"]  # only while a host says so (as before otherwise)
        return counts

    def _failed_devices(self) -> set[str]:
        """The devices held by a ``failed`` lease, computed once per plan (explain only)."""
        failed = getattr(self, "_failed_held", None)
        if failed is None:
            failed = self._failed_held = {l.device for l in self.i.leases if l.state == "failed"}
        return failed

    def stale_leases_note(self, leases) -> str:
        """For a ``max_devices`` reason: ``leases`` (a queue's open LeaseViews) on agent hosts
        that send no heartbeat hold devices yet serve nothing until the host is back (TRIAL
        finding 11): ``"; 2 of them on stale agent host h1 (no heartbeat for 3m: lease-a
        restoring on gpu-host-01, ...), serving nothing until it heartbeats again"``, or ``""``
        when none is."""
        stale = self.i.stale_hosts
        by_host: dict[str, list] = {}
        for l in leases:
            dev = self.device_by_name.get(l.device)
            if dev is not None and dev.agent_host in stale:
                by_host.setdefault(dev.agent_host, []).append(l)
        if not by_host:
            return ""
        parts = []
        for h, ls in sorted(by_host.items()):
            silent = stale[h]
            since = "yet" if silent is None else f"for {_dur(silent)}"
            parts.append(f"{len(ls)} of them on stale agent host {h} (no heartbeat {since}: "
                         + ", ".join(f"{l.id} {l.state} on {l.device}" for l in ls) + ")")
        return "; " + "; ".join(parts) + ", serving nothing until the host heartbeats again"

    def stale_detail(self, q) -> str:
        """The stale agent hosts of ``q``'s eligible devices that are otherwise free, for the
        ``blocked`` reason: ``agent host h1 sent no heartbeat for 3m`` (joined by ``; ``)."""
        hosts = sorted({d.agent_host for d in self.eligible(q)
                        if d.agent_host in self.i.stale_hosts and not d.quarantined
                        and d.name not in self.held})
        parts = []
        for h in hosts:
            silent = self.i.stale_hosts[h]
            parts.append(f"agent host {h} sent no heartbeat "
                         + ("yet" if silent is None else f"for {_dur(silent)}"))
        return "; ".join(parts)

    def _picking_up(self, d: DeviceView) -> bool:
        """True if ``d``'s agent posted ``waiting`` at most :data:`AGENT_PICKUP` s ago: it asks
        its queues for a job right after that post (TESTFLINGER.md §3.2-3.4), so a job waiting
        on a home queue is about to be its. Lent meanwhile, by a magic queue whose priority
        outranks that job, the device would be taken from under its owner (an owner reclaim
        had freed it for that job, and would reclaim another lent device next: TRIAL5 finding
        5)."""
        return d.last_home_use is not None and self.now - d.last_home_use <= AGENT_PICKUP

    def _owner_bar(self, i: int) -> int | None:
        """The highest ``max_priority`` of device ``i``'s home queues that have jobs waiting
        (None: none waiting). A queue of priority <= it leaves the device to its owner: the
        same as ``any(waiting > 0 and priority <= max_priority for each home queue)``."""
        if i not in self._bars:
            d = self.i.devices[i]
            # A home queue whose waiting jobs all exclude the device (avoid) is not its owner
            # waiting for it (TRIAL11 F4).
            bars = [self.demand(h).max_priority for h in d.home_queues
                    if self.demand(h).waiting > 0 and d.name not in self.demand(h).avoid]
            self._bars[i] = max(bars) if bars else None
        return self._bars[i]

    def candidates(self, q) -> list[tuple[DeviceView, int]]:
        """Lendable devices for ``q``, best first: fewest GPUs wasted, least recent home use.
        Looks only at the devices lendable this tick (registered, not quarantined, not held,
        agent back after its last lease and ``waiting`` with no job, agent host not stale and
        reaching MAAS and heartbeating, not held back after MAAS refused it) that ``q``'s
        selection picks, less those whose VMs every waiting job of
        ``q`` excludes (``QueueDemand.avoid``) and the NVSwitch devices its VMs of several
        GPUs would be refused on (:func:`testflinger_magic.fabric.refuses`)."""
        if self._lendable is None:
            self._lendable = self._build(
                i for i, d in enumerate(self.i.devices)
                if d.registered and not d.quarantined and d.name not in self.held
                and d.agent_back and d.agent_state == "waiting" and not d.job_id
                and d.agent_host not in self.i.stale_hosts
                and d.agent_host not in self.i.maas_down_hosts
                and d.agent_host not in self.i.quiet_hosts and not d.held_back)
        out = []
        devices, taken, owner_bar = self.i.devices, self.taken, self._owner_bar
        priority, vm_gpus = q.policy.priority, q.vm.gpus
        avoid = self.demand(q.name).avoid  # every waiting job excludes these devices' VMs
        vms_of: dict = {}  # GPU count -> q.vms_for (a handful of distinct counts)
        for i in self._selected(q, self._lendable):
            d = devices[i]
            if d.name in taken or d.name in avoid:  # the index already applied q.selects
                continue
            bar = owner_bar(i)
            if bar is not None and (priority <= bar or self._picking_up(d)):
                continue  # owner first: its home queue has jobs of at least q's priority
                # waiting, or jobs waiting and its agent, just back, is asking for one
            vms = vms_of.get(d.gpus)
            if vms is None:
                vms = vms_of[d.gpus] = q.vms_for(d.gpus)
            if vms < 1:
                continue
            if vm_gpus > 1 and d.nvswitches and fabric.refuses(vm_gpus, d):
                continue  # NVSwitch device: its split of several GPUs per VM is refused
            wasted = d.gpus - vms * vm_gpus
            last = d.last_home_use if d.last_home_use is not None else -math.inf
            out.append(((wasted, last, d.name), d, vms))
        return [(d, vms) for _, d, vms in sorted(out, key=lambda t: t[0])]
