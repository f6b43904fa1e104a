"""The starvation figure of ``testflinger-magic simulate`` (issue 11): how long each magic queue's
jobs waited beyond its supply while another magic queue had idle VMs on an active lease with open
admission on a device it may use (issue 11's goal: "no magic queue starving while another sharing
its devices has idle VMs"). A mixin of :class:`testflinger_magic.lab.simulate.Simulation`; it reads ``defs``,
``devices``, ``open``, ``waiting``, ``lending``, ``now`` and writes ``result.starved``. Split from
simulate.py along its seam (sampling, not the replay)."""

from __future__ import annotations

from testflinger_magic import leases as L


class SimStarvation:
    """Starvation sampling (see the module docstring)."""

    def _init_starvation(self) -> None:
        """Called once the devices exist: which devices each queue may use, nothing starving."""
        self._usable = self._usable_devices()
        self._starving: set[str] = set()
        self._sampled_at = 0.0

    def _sample_starvation(self) -> None:
        """After a batch of events: add the time since the last sample to every queue that was
        starving then, and find the queues starving now (policy columns with 2+ magic queues)."""
        for q in self._starving:  # starvation held since the last sample
            self.result.starved[q] = self.result.starved.get(q, 0.0) + self.now - self._sampled_at
        self._starving = self._starved() if self.lending and len(self.defs) > 1 else set()
        self._sampled_at = self.now

    def _usable_devices(self) -> dict[str, set[str]]:
        """``{magic queue: names of the devices it may use}`` (``MagicQueue.matches``)."""
        out = {}
        for q in self.defs:
            out[q.name] = {d.name for d in self.devices.values()
                           if q.matches({"_id": d.name, "name": d.name, "gpus": d.spec.gpus,
                                         "tags": d.spec.tags, "home_queues": d.spec.home_queues})}
        return out

    def _starved(self) -> set[str]:
        """Magic queues starving now: jobs waiting beyond their supply (idle VMs of open active
        leases + VMs of leases bringing up), below ``max_devices`` (its open leases and the
        leases drained by a yield for it), while another magic queue
        holds an active lease with open admission and at least one idle VM (wholly idle or
        partly busy) on a device the starving queue may use: capacity it could have had. A
        draining or paused lease is not counted: its admission is closed, it is on its way
        back (a yield drain waits for its running jobs)."""
        out = set()
        for q in self.defs:
            waiting = len(self.waiting.get(q.name) or ())
            if not waiting:
                continue
            mine = [l for l in self.open.values() if l.queue == q.name]
            # Devices yielded to q count towards its max_devices while their jobs finish:
            # a queue that can hold one device and has one on its way could use no other.
            coming = sum(1 for l in self.open.values() if l.queue != q.name
                         and (l.drain or {}).get("kind") == "yield"
                         and (l.drain or {}).get("for") == q.name)
            if len(mine) + coming >= q.policy.max_devices:
                continue
            supply = sum(l.vms for l in mine if l.state in L.BRINGUP_STATES)
            supply += sum(l.vms - l.busy for l in mine
                          if l.state == L.ACTIVE and l.admission == "open")
            if waiting <= supply:
                continue
            usable = self._usable[q.name]
            if any(l.queue != q.name and l.state == L.ACTIVE and l.admission == "open"
                   and l.busy < len(l.agents) and l.device in usable for l in self.open.values()):
                out.add(q.name)
        return out
