"""A step's stop: the daemon's, or the step's own once the server has moved its lease on.

Every wait of a step watches ``ctx.stop`` (``is_set()``, ``wait(seconds)``) and ends with
``Interrupted`` once it is set (steps.py). The daemon's stop ends every step; a step's own stop
ends one bring-up step whose lease the server moved to ``restoring`` meanwhile (its deadline,
``provision_timeout``, passed; an operator drained it): the step's work is moot, and without
this the restore waited for the step's own timeout, up to ``timeouts.deploying`` (45 m by
default), while ``status`` said ``restoring`` and nothing happened (TRIAL13 F5). The restore
then runs at the next poll; it is idempotent from any bring-up state (teardown.py).
"""

from __future__ import annotations

import threading


class StepStop(threading.Event):
    """The stop of one step's thread: a ``threading.Event`` (what the waits take: maas.py
    ``_stop_check``), set by :meth:`StepStops.stop_all` (the daemon stops) or by
    :meth:`supersede` (the lease moved on). ``why``: the reason of a supersede, else None."""

    def __init__(self):
        super().__init__()
        self.why: str | None = None

    def supersede(self, why: str) -> None:
        """End this step: its lease moved on (``why`` says how)."""
        if not self.is_set():
            self.why = why
            self.set()


class StepStops:
    """The live :class:`StepStop` of each lease's step thread, by lease id (thread-safe)."""

    def __init__(self, daemon_stop: threading.Event):
        self._daemon_stop = daemon_stop
        self._lock = threading.Lock()
        self._by_lease: dict[str, StepStop] = {}

    def start(self, lease_id: str) -> StepStop:
        """A new stop for the step now starting on ``lease_id`` (set at once if the daemon
        is stopping)."""
        stop = StepStop()
        with self._lock:
            self._by_lease[lease_id] = stop
        if self._daemon_stop.is_set():
            stop.set()
        return stop

    def end(self, lease_id: str, stop: StepStop) -> None:
        """The step of ``stop`` ended (a later step of the lease may hold its own by now)."""
        with self._lock:
            if self._by_lease.get(lease_id) is stop:
                del self._by_lease[lease_id]

    def supersede(self, lease_id: str, why: str) -> bool:
        """End the step running on ``lease_id``, if any; True if there was one."""
        with self._lock:
            stop = self._by_lease.get(lease_id)
        if stop is None:
            return False
        stop.supersede(why)
        return True

    def stop_all(self) -> None:
        """The daemon stops: end every step at its next wait."""
        with self._lock:
            stops = list(self._by_lease.values())
        for stop in stops:
            stop.set()
