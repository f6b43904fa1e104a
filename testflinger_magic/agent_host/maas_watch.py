"""One MAAS status poll for every machine the daemon waits on (``StatusWatch``).

Every lease step that waits for MAAS (deploy, each VM's commissioning, release at restore)
used to read its machine by itself every ``maas_poll`` seconds: 8 VMs commissioning at once
were 8 reads per interval, 8 leases deploying at once 8 more. ``StatusWatch`` reads them all
in one ``GET /MAAS/api/2.0/machines/?id=<a>&id=<b>...`` per round (the MAAS API's machines
``read``, ``id``: "Only nodes relating to the nodes with matching system ids will be
returned", repeatable: maasserver/api/machines.py ``MachinesHandler.read``), on one thread
that runs only while someone waits. A wait that starts is read at once (it kicks a round); a
round answers every waiter of its machines. Nothing about MAAS' behaviour changes: each waiter
sees the same machine documents a single read would give, only fewer requests are made.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Callable, Iterator

log = logging.getLogger(__name__)

#: seconds a waiter sleeps at most between looks at its stop condition
STOP_CHECK = 0.05


class StatusWatch:
    """Shared status polling. ``read_many(ids) -> {system_id: info}`` reads the machines
    ``ids`` in one call (a machine missing from the answer is gone: ``not_found(system_id)``
    makes the error its waiter gets); it may raise, and the error goes to every waiter of that
    round. ``name``: the poller thread's name.

    Use ``with watch.watching(system_id, poll) as next_info:``; each ``next_info(stopping)``
    returns the machine's info from a round that started after the previous call (the first
    from one started after ``watching`` began), or raises that round's error; ``stopping()``
    true raises ``interrupted()``. Rounds start every ``poll`` seconds (the smallest of the
    current waiters'), and at once when a waiter joins.
    """

    def __init__(self, read_many: Callable[[list[str]], dict], not_found: Callable[[str], Exception],
                 interrupted: Callable[[str], Exception], name: str = "maas-watch"):
        self._read_many = read_many
        self._not_found = not_found
        self._interrupted = interrupted
        self._name = name
        self._cond = threading.Condition()
        self._waiters: dict[int, tuple[str, float]] = {}  # token -> (system_id, poll)
        self._token = 0
        self._next_round = 1  # number of the round the poller starts next
        self._results: dict[str, tuple[int, object]] = {}  # system_id -> (round, info | exc)
        self._kick = False
        self._thread: threading.Thread | None = None
        #: rounds done (tests and benchmarks read it)
        self.rounds = 0

    @contextlib.contextmanager
    def watching(self, system_id: str, poll: float) -> Iterator[Callable]:
        """Register a waiter on ``system_id`` (rounds at most ``poll`` s apart) for the block;
        yields ``next_info(stopping)``. Unregisters on exit."""
        with self._cond:
            self._token += 1
            token = self._token
            self._waiters[token] = (system_id, max(0.0, float(poll)))
            seen = self._next_round - 1  # only rounds started from now on count
            self._kick = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify_all()

        def next_info(stopping: Callable[[], bool] = lambda: False):
            nonlocal seen
            with self._cond:
                while True:
                    got = self._results.get(system_id)
                    if got is not None and got[0] > seen:
                        seen = got[0]
                        value = got[1]
                        break
                    if stopping():
                        raise self._interrupted(system_id)
                    self._cond.wait(STOP_CHECK)
            if isinstance(value, BaseException):
                raise value
            return value

        try:
            yield next_info
        finally:
            with self._cond:
                del self._waiters[token]
                if not any(sid == system_id for sid, _p in self._waiters.values()):
                    self._results.pop(system_id, None)
                self._cond.notify_all()

    def _run(self) -> None:
        """The poller: a round every waiters' smallest ``poll`` seconds, counted from the
        round's start (the time MAAS takes to answer is not added to the interval; a round that
        takes longer is followed by the next at once, never two at a time), sooner when a new
        waiter joins; ends when nobody waits."""
        while True:
            with self._cond:
                if not self._waiters:
                    self._thread = None
                    return
                ids = sorted({sid for sid, _p in self._waiters.values()})
                number = self._next_round
                self._next_round += 1
                self._kick = False
            started = time.monotonic()
            try:
                infos = self._read_many(ids)
                error = None
            except Exception as exc:  # noqa: BLE001 - every waiter of the round gets it
                infos, error = {}, exc
            with self._cond:
                for sid in ids:
                    if error is not None:
                        value = error
                    elif sid in infos:
                        value = infos[sid]
                    else:
                        value = self._not_found(sid)
                    self._results[sid] = (number, value)
                self.rounds += 1
                self._cond.notify_all()
                if not self._waiters:
                    continue
                pause = min(p for _sid, p in self._waiters.values())
                end = started + pause
                while not self._kick and self._waiters:
                    left = end - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
