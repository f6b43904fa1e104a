"""MagicPlugin: the plugin's state inside one Testflinger server process (one replica).

It owns the database handle, the LeaseStore, the EventLog, the Engine, the metrics and the ticker
thread. Everything durable is in MongoDB, so any number of replicas can run side by side; the only
in-process state is a ``threading.Condition`` that wakes this replica's long-polls early.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from testflinger_magic import events as events_mod
from testflinger_magic import leases as leases_mod
from testflinger_magic import queues as queues_mod

from .engine import Engine
from .metrics import Metrics

log = logging.getLogger(__name__)

OPEN_STATES = sorted(leases_mod.OPEN_STATES)


class MagicPlugin:
    """One replica's plugin.

    ``db``: a pymongo/locked-mongomock Database (Testflinger's). ``clock``: returns epoch seconds.
    ``tick_seconds``: period of the background reconcile (seconds).
    """

    def __init__(self, db, *, tick_seconds: float = 5.0, clock=time.time):
        self.db = db
        self.clock = clock
        self.tick_seconds = tick_seconds
        self.notifier = events_mod.Notifier(self._webhooks)
        self.events = events_mod.EventLog(db, clock=clock, notifier=self.notifier)
        self.store = leases_mod.LeaseStore(db, clock=clock, events=self.events)
        self.engine = Engine(db, self.store, self.events, clock)
        self.metrics = Metrics()
        self.engine.metrics = self.metrics
        self.changed = threading.Condition()
        self._stop = threading.Event()
        self._kick = threading.Event()
        self._thread: threading.Thread | None = None
        self._tick_lock = threading.Lock()
        self._ensure_indexes()

    # ----- definitions -------------------------------------------------------------------------
    def _ensure_indexes(self) -> None:
        self.store.ensure_indexes()
        # The hot path (GET /v1/job) looks leases up by VM agent name.
        self.db.magic_leases.create_index("vms.agent_name")

    def _webhooks(self, queue: str) -> list[str]:
        q = self.definition(queue)
        return list(q.policy.notify) if q is not None else []

    def definition(self, name):
        """The MagicQueue named ``name``, or None if it is not a magic queue."""
        if not isinstance(name, str) or not name:
            return None
        doc = self.db.magic_queues.find_one({"_id": name})
        if doc is None:
            return None
        return queues_mod.MagicQueue.from_document(doc)

    def definitions(self) -> list:
        """All applied MagicQueue definitions, by name."""
        return [
            queues_mod.MagicQueue.from_document(d)
            for d in self.db.magic_queues.find({}, sort=[("_id", 1)])
        ]

    def apply(self, definitions, source: str = "api", *, prune: bool = True) -> dict:
        """Store ``definitions`` (list of MagicQueue) in ``magic_queues`` and advertise them in
        Testflinger's ``queues`` collection; with ``prune``, remove magic queues not listed.
        Returns ``{"applied": [names], "removed": [names]}``."""
        now = self.clock()
        names = []
        for q in definitions:
            doc = dict(q.to_document(), applied_at=now, source=source)
            doc.pop("_id", None)
            self.db.magic_queues.replace_one({"_id": q.name}, doc, upsert=True)
            self.advertise(q)
            names.append(q.name)
        removed = []
        if prune:
            for doc in self.db.magic_queues.find({"_id": {"$nin": names}}, {"_id": 1}):
                self.db.magic_queues.delete_one({"_id": doc["_id"]})
                removed.append(doc["_id"])
        for name in names:
            self.events.record("queue.applied", f"{name}: definition applied from {source}", queue=name)
        for name in removed:
            self.events.record("queue.removed", f"{name}: definition removed by {source}", queue=name)
        self.kick()
        return {"applied": names, "removed": removed}

    def advertise(self, q) -> None:
        """Upsert the queue into Testflinger's ``queues`` (name, description, updated_at), which
        GET /v1/agents/queues (``list-queues``) reads. ``updated_at`` is a datetime as Testflinger
        writes it (its TTL index needs one), refreshed on each tick so the 7-day TTL never fires."""
        from datetime import datetime, timezone  # noqa: PLC0415

        self.db.queues.update_one(
            {"name": q.name},
            {
                "$set": {
                    "name": q.name,
                    "description": getattr(q, "description", "") or "",
                    "updated_at": datetime.now(timezone.utc),
                }
            },
            upsert=True,
        )

    def admission_paused(self, agent: str) -> bool:
        """True if ``agent`` is a VM agent of an open lease whose admission is ``paused``."""
        return (
            self.db.magic_leases.find_one(
                {"vms.agent_name": agent, "admission": "paused", "state": {"$in": OPEN_STATES}},
                {"_id": 1},
            )
            is not None
        )

    # ----- wake-ups and ticker -----------------------------------------------------------------
    def notify(self) -> None:
        """Wake this replica's long-polls (a lease changed)."""
        with self.changed:
            self.changed.notify_all()

    def kick(self) -> None:
        """Ask for a reconcile tick soon, in the background (never raises)."""
        self._kick.set()
        if self._thread is None:
            threading.Thread(target=self.tick, name="magic-kick", daemon=True).start()

    def tick(self) -> list:
        """Run one reconcile tick now (one at a time per replica); returns the applied actions."""
        with self._tick_lock:
            try:
                for q in self.definitions():
                    self.advertise(q)
                applied = self.engine.tick()
            except Exception:
                log.exception("testflinger-magic tick failed")
                return []
        if applied:
            self.notify()
        return applied

    def start(self) -> None:
        """Start the ticker thread (idempotent)."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="magic-ticker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the ticker thread and wait for it."""
        self._stop.set()
        self._kick.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            self._kick.clear()
            self.tick()
            self._kick.wait(self.tick_seconds)


def load_definitions(definitions) -> list:
    """Normalise ``definitions`` (None, a list of MagicQueue, or a YAML path) to a list."""
    if definitions is None:
        return []
    if isinstance(definitions, (str, Path)):
        return queues_mod.load_file(str(definitions))
    return list(definitions)
