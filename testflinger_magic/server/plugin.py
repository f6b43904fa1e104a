"""MagicPlugin: the plugin's state inside one Testflinger server process (one replica).

It owns the database handle, the LeaseStore, the EventLog, the Engine, the metrics and the ticker
thread. Everything durable is in MongoDB, so any number of replicas can run side by side; the only
in-process state is a ``threading.Condition`` that wakes this replica's long-polls early.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from testflinger_magic import events as events_mod
from testflinger_magic import leases as leases_mod
from testflinger_magic import queues as queues_mod
from testflinger_magic import webhooks

from testflinger_magic import tfstates

from . import applycheck, bindings, removedqueues
from .engine import Engine, QueuesInUse
from .metrics import Metrics

log = logging.getLogger(__name__)



class MagicPlugin:
    """One replica's plugin.

    ``db``: a pymongo/locked-mongomock Database (Testflinger's). ``clock``: returns epoch seconds.
    ``tick_seconds``: period of the background reconcile (seconds). ``webhook_allow``: internal
    webhook destinations allowed (host names, addresses, networks; added to
    ``$TESTFLINGER_MAGIC_WEBHOOK_ALLOW``), see :mod:`testflinger_magic.webhooks`; ValueError
    naming a bad entry. ``agent_hosts``: how agent hosts get bound to Testflinger clients
    (:data:`.bindings.BINDING_MODES`; None: ``$TESTFLINGER_MAGIC_AGENT_HOSTS``, else by their
    first registration); ValueError naming a bad value.
    """

    def __init__(self, db, *, tick_seconds: float = 5.0, clock=time.time, webhook_allow=None,
                 agent_hosts: str | None = None):
        self.db = db
        self.clock = clock
        self.tick_seconds = tick_seconds
        #: Where ``policy.notify`` may point although internal (applied definitions and sends).
        self.webhook_allow = webhooks.AllowList.from_env() | webhooks.AllowList.parse(
            webhook_allow, source="init_app(webhook_allow=...)")
        self.notifier = events_mod.Notifier(self._webhooks, allow=self.webhook_allow)
        self.events = events_mod.EventLog(db, clock=clock, notifier=self.notifier)
        self.store = leases_mod.LeaseStore(db, clock=clock, events=self.events)
        mode = bindings.binding_mode(agent_hosts, "init_app(agent_hosts=...)") if agent_hosts \
            else bindings.binding_mode(os.environ.get(bindings.BINDING_ENV))
        self.engine = Engine(db, self.store, self.events, clock, binding_mode=mode)
        self.metrics = Metrics(alerts=self.engine.alerts)
        self.engine.metrics = self.metrics
        self.store.on_borrowed = self.metrics.count_borrowed
        self.changed = threading.Condition()
        self._stop = threading.Event()
        self._kick = threading.Event()
        self._thread: threading.Thread | None = None
        self._tick_lock = threading.Lock()
        self._repaired_at = float("-inf")  # time.monotonic() of the last tick with repairs
        # Quick lends (Engine.lend_now): magic queues that just got a job, and the thread that
        # lends for them without waiting for a tick in flight.
        self._lend_mutex = threading.Lock()
        self._lend_queues: set[str] = set()
        self._lend_wake = threading.Event()
        self._lender: threading.Thread | None = None
        self._ensure_indexes()

    # ----- definitions -------------------------------------------------------------------------
    def _ensure_indexes(self) -> None:
        # The hot path (GET /v1/job) reads only magic_agent_gate by _id (gates.Gates.read).
        self.store.ensure_indexes()
        self.engine.giveback.ensure_indexes()

    def _webhooks(self, queue: str) -> list[str]:
        q = self.definition(queue)
        return list(q.policy.notify) if q is not None else []

    def definition(self, name):
        """The MagicQueue named ``name``, or None if it is not a magic queue or its stored
        document is invalid (:meth:`problem` says so; the tick logs it)."""
        if not isinstance(name, str) or not name:
            return None
        return self.engine._definition(name)

    def problem(self, name, operator: bool = True) -> str | None:
        """Why the stored magic queue ``name`` lends nothing (invalid document, suspended), or
        None; ``operator`` False: worded for a test engineer (Engine.problem)."""
        return self.engine.problem(name, operator=operator)

    def definitions(self) -> list:
        """All valid applied MagicQueue definitions, by name; invalid stored documents are
        skipped with an event and a log line (Engine.stored)."""
        return self.engine.definitions()

    def apply(self, definitions, source: str = "api", *, prune: bool = True,
              force: bool = False, unsuspend: bool = False) -> dict:
        """Store ``definitions`` (list of MagicQueue) in ``magic_queues`` and advertise them in
        Testflinger's ``queues`` collection; with ``prune``, remove magic queues not listed.
        Returns ``{"applied": [names], "removed": [names], "cancelled": {name: jobs},
        "draining": [{queue, lease_id, device, state, grace, message}] (the open leases of the
        removed queues and what becomes of them, applycheck.draining), "undraining": [{queue,
        lease_id, device, state, message}] (leases of the applied queues whose removed-queue
        drain the next tick undoes, applycheck.undraining), "warnings": [{queue,
        message}] (applied queues no registered device can serve, applycheck.warnings),
        "unchanged": [names] (applied queues whose stored definition was already this one),
        "still_suspended": [{queue, reason}] (unchanged queues whose lending stays suspended)}``.

        A queue named like a registered device's agent or home queue is refused
        (``queues.DefinitionError`` naming the device, applycheck.name_clashes). A removed
        queue is no longer advertised, new submissions to it are refused and a job that still
        reaches it is cancelled with the reason (:mod:`.removedqueues`).

        A job is never stranded: removing a queue that still has waiting jobs (nobody would
        ever serve them, and the CLI's preflight would call the queue unknown) raises
        ``engine.QueuesInUse`` (409, nothing written) unless ``force``; with ``force`` the queue
        is removed first (so no new job is lent a VM for it) and then its waiting jobs are
        cancelled as Testflinger's cancel action does (CAS on still ``waiting``), counted in
        the answer and in the ``queue.removed`` event, each told why in its output and events
        (:mod:`.cancelnote`).

        All or nothing: every document is encoded as BSON first, and nothing is written unless
        all encode (an int beyond 8 bytes, a document over MongoDB's 16 MiB); else raises
        ``queues.DefinitionError`` whose issues name the field (``source`` is the file). Storing
        a changed definition replaces the whole document, which clears ``suspended``/``invalid``:
        applying a changed definition is how an operator says the queue is fixed. A definition
        identical to the stored one (compared as :func:`same_definition` does) is not written
        again: its ``applied_at``, ``source`` and ``suspended`` stay, so applying a file that
        changes only other queues does not lift a broken queue's suspension (TRIAL2 finding 5);
        ``unsuspend`` writes it anyway, which lifts the suspension once its cause was fixed
        outside the definition (e.g. the agent template installed on the agent hosts)."""
        now = self.clock()
        docs = []
        issues = []
        for q in definitions:
            doc = dict(q.to_document(), applied_at=now, source=source)
            doc.pop("_id", None)
            issues += bson_issues(doc, q.name, source)
            docs.append((q, doc))
        if issues:
            raise queues_mod.DefinitionError(issues)
        listed = [q.name for q, _ in docs]
        # With what fabric.refuses reads: apply's warnings name NVSwitch devices too.
        devices = list(self.db.magic_devices.find({}, {
            "home_queues": 1, "gpus": 1, "tags": 1, "nvswitches": 1, "nvswitches_found": 1,
            "nvswitch_multi_gpu": 1}))
        clashes = applycheck.name_clashes(listed, devices)
        if clashes:
            raise queues_mod.DefinitionError([
                queues_mod.Issue(source, 0, f"{queues_mod.TOP_KEY}.{name}", why)
                for name, why in sorted(clashes.items())])
        doomed = [d["_id"] for d in self.db.magic_queues.find({"_id": {"$nin": listed}},
                                                               {"_id": 1})] if prune else []
        waiting = {name: n for name in doomed if (n := self.db.jobs.count_documents(
            {"job_data.job_queue": name, "result_data.job_state": tfstates.JOB_WAITING}))}
        if waiting and not force:
            raise QueuesInUse(waiting)
        stored = {d["_id"]: d for d in self.db.magic_queues.find({"_id": {"$in": listed}})}
        names, unchanged, still_suspended = [], [], []
        changed: dict[str, tuple[dict, dict]] = {}  # {queue: (old, new)} of replaced ones
        for q, doc in docs:
            old = stored.get(q.name)
            if old is not None and same_definition(old, q) and not unsuspend:
                unchanged.append(q.name)
                if old.get("suspended"):
                    still_suspended.append({"queue": q.name, "reason": str(
                        (old["suspended"] or {}).get("reason") or "suspended")})
            else:
                if old is not None:
                    changed[q.name] = (_normalised(old), doc)
                self.db.magic_queues.replace_one({"_id": q.name}, doc, upsert=True)
            self.advertise(q)
            names.append(q.name)
        removedqueues.unmark(self.db, names)
        removed, cancelled = [], {}
        if prune:
            for doc in self.db.magic_queues.find({"_id": {"$nin": names}}, {"_id": 1}):
                self.db.magic_queues.delete_one({"_id": doc["_id"]})
                removed.append(doc["_id"])
        # Not advertised any more, new submissions refused, strays cancelled by the ticks.
        removedqueues.mark(self.db, removed, now, source)
        for name in removed:
            if force:
                cancelled[name] = self._cancel_waiting(name, source)
        for name in names:
            what = "definition unchanged, applied again" if name in unchanged else \
                "definition applied"
            self.events.record("queue.applied", f"{name}: {what} from {source}", queue=name)
        for name in removed:
            n = cancelled.get(name, 0)
            extra = (f"; {n} waiting job{'' if n == 1 else 's'} cancelled (forced)"
                     if force else "")
            self.events.record("queue.removed", f"{name}: definition removed by {source}{extra}",
                               queue=name, data={"cancelled": n})
        # Read before the kick, whose tick starts the drains this answer describes.
        open_leases = self.store.list(open_only=True) if removed or changed else []
        draining = applycheck.draining(open_leases) if removed else []
        # A queue applied again: the drains its removal started are undone (one read).
        undraining = applycheck.undraining(list(self.db.magic_leases.find(
            {"state": leases_mod.DRAINING, "drain.kind": "orphan",
             "queue": {"$in": sorted(names)}},
            {"queue": 1, "device": 1, "state": 1, "drain": 1}))) if names else []
        self.kick()
        return {"applied": names, "removed": removed, "cancelled": cancelled,
                "draining": [d for d in draining if d["queue"] in removed],
                "undraining": undraining,
                "warnings": applycheck.warnings([q for q, _ in docs], devices),
                "unchanged": unchanged, "still_suspended": still_suspended,
                "changed": [n for n in names if n not in unchanged],
                "keeping_old": applycheck.keeping_old(changed, open_leases,
                                                      [q for q, _ in docs], devices)}

    def _cancel_waiting(self, queue: str, source: str) -> int:
        """Cancel the waiting jobs of a removed ``queue``, each told why
        (removedqueues.cancel_waiting); returns how many."""
        why = (f"magic queue {queue} was removed from the definitions (apply --force from "
               f"{source}) while this job waited")
        return removedqueues.cancel_waiting(self.db, queue, why, self.clock())

    def advertise(self, q) -> None:
        """Upsert the queue into Testflinger's ``queues`` (name, description, updated_at), which
        GET /v1/agents/queues (``list-queues``) reads. ``updated_at`` is a datetime as Testflinger
        writes it (its TTL index needs one), refreshed by the ticks (:meth:`advertise_all`) so
        the 7-day TTL never fires."""
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

    def advertise_all(self, definitions) -> list[str]:
        """Each tick: :meth:`advertise` the queues whose ``queues`` document is missing, has
        another description, or was last refreshed more than :data:`READVERTISE_AFTER` seconds
        ago (Testflinger's 7-day TTL on ``queues.updated_at``, TESTFLINGER.md §1.4). One read of
        the ``queues`` documents, and a write only for those: not one upsert per queue per
        tick. Returns the names advertised."""
        from datetime import datetime, timezone  # noqa: PLC0415

        definitions = list(definitions)
        if not definitions:
            return []
        have = {d.get("name"): d for d in self.db.queues.find(
            {"name": {"$in": sorted(q.name for q in definitions)}},
            {"name": 1, "description": 1, "updated_at": 1})}
        now = datetime.now(timezone.utc)
        done = []
        for q in definitions:
            doc = have.get(q.name) or {}
            at = doc.get("updated_at")
            if isinstance(at, datetime) and at.tzinfo is None:
                at = at.replace(tzinfo=timezone.utc)  # pymongo returns naive UTC
            fresh = (isinstance(at, datetime)
                     and (now - at).total_seconds() < READVERTISE_AFTER)
            if fresh and doc.get("description") == (getattr(q, "description", "") or ""):
                continue
            self.advertise(q)
            done.append(q.name)
        return done

    def settle_removed(self) -> dict:
        """Each repairing tick: the removed queues' strays cancelled and advertising stopped
        (removedqueues.settle); never raises. Returns ``{queue: jobs cancelled}``."""
        try:
            return removedqueues.settle(self.db, self.clock(), self.events)
        except Exception:  # noqa: BLE001 - the next tick tries again
            log.exception("testflinger-magic: settling removed queues failed")
            return {}

    # ----- wake-ups and ticker -----------------------------------------------------------------
    def notify(self) -> None:
        """Wake this replica's long-polls (a lease changed)."""
        with self.changed:
            self.changed.notify_all()

    def kick(self, queue: str | None = None) -> None:
        """Ask for a reconcile tick soon, in the background (never raises). ``queue``: a magic
        queue that just got a job (the POST /v1/job hook): first a quick lend for it
        (:meth:`lend_pending`, Engine.lend_now), on its own thread, so the lease is claimed
        without waiting for a tick in flight or a full gather; the tick comes after it (it would
        only slow the quick lend down, sharing the process and the database with it)."""
        if queue:
            with self._lend_mutex:
                self._lend_queues.add(queue)
        if self._thread is None:
            threading.Thread(target=self._kicked, name="magic-kick", daemon=True).start()
        elif queue and self._lender is not None:
            self._lend_wake.set()  # the lender asks for the tick once it has lent
        else:
            self._kick.set()

    def _kicked(self) -> None:
        self.lend_pending()
        self.tick()

    def lend_pending(self) -> list:
        """Quick-lend for the magic queues kicked since the last call (Engine.lend_now, on the
        last tick's snapshot if younger than two ``tick_seconds``, at least 10 s); returns the
        lends applied. Never raises."""
        with self._lend_mutex:
            queues, self._lend_queues = sorted(self._lend_queues), set()
        if not queues:
            return []
        try:
            applied = self.engine.lend_now(queues, max_age=max(2 * self.tick_seconds, 10.0))
        except Exception:  # noqa: BLE001 - the kicked tick lends then
            log.exception("testflinger-magic quick lend failed")
            return []
        if applied:
            self.notify()
        return applied or []

    def _run_lender(self) -> None:
        while not self._stop.is_set():
            self._lend_wake.wait()
            self._lend_wake.clear()
            if self._stop.is_set():
                break
            self.lend_pending()
            self._kick.set()  # then the tick: everything but these lends

    def tick(self, repair: bool = True) -> list:
        """Run one reconcile tick now (one at a time per replica); returns the applied actions.
        ``repair=False``: skip the repairs (Engine.tick), as the ticker does for a tick a
        submission kicked while the last repairs are younger than ``tick_seconds``."""
        with self._tick_lock:
            try:
                if repair:
                    self.advertise_all(self.definitions())
                    self.settle_removed()
                    self._repaired_at = time.monotonic()
                applied = self.engine.tick(repair=repair)
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
        self._lender = threading.Thread(target=self._run_lender, name="magic-lender", daemon=True)
        self._lender.start()

    def stop(self) -> None:
        """Stop the ticker thread and wait for it."""
        self._stop.set()
        self._kick.set()
        self._lend_wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        if self._lender is not None:
            self._lender.join(timeout=30)
            self._lender = None

    def _run(self) -> None:
        while not self._stop.is_set():
            kicked = self._kick.is_set()
            self._kick.clear()
            # A kicked tick (a job was submitted to a magic queue) goes straight to gather,
            # plan and apply, so the lend comes sooner; the repairs still run at least every
            # tick_seconds, whatever the rate of kicks.
            due = time.monotonic() - self._repaired_at >= self.tick_seconds
            self.tick(repair=due or not kicked)
            self._kick.wait(self.tick_seconds)


#: Seconds after which a tick refreshes a magic queue's ``queues.updated_at`` (Testflinger
#: expires ``queues`` documents 7 days after it, TESTFLINGER.md §1.4): a day, well inside.
READVERTISE_AFTER = 86400.0

#: MongoDB's document size limit (BSON), bytes.
MAX_BSON_SIZE = 16 * 1024 * 1024
_INT64 = (-(2**63), 2**63 - 1)


def _normalised(stored: dict) -> dict:
    """The stored definition document as the model writes it now (a field added since gets its
    default), or as stored when it no longer validates."""
    try:
        return queues_mod.MagicQueue.from_document(stored).to_document()
    except Exception:  # noqa: BLE001 - compared as stored
        return stored


def same_definition(stored: dict, q) -> bool:
    """Whether the stored ``magic_queues`` document ``stored`` defines the same queue as the
    MagicQueue ``q``: both normalised through the model (``MagicQueue.from_document``, which
    ignores the bookkeeping keys), so a field the model added since with its default does
    not count as a change. A document that no longer validates, or is marked ``invalid``, is
    never the same."""
    if stored.get("invalid"):
        return False
    try:
        old = queues_mod.MagicQueue.from_document(stored).to_document()
    except Exception:  # noqa: BLE001 - a corrupt stored document is replaced
        return False
    return old == q.to_document()


def bson_issues(doc: dict, name: str, source: str) -> list:
    """Why ``doc`` (the stored form of queue ``name``) cannot be written to MongoDB, as
    ``queues.Issue(source, 0, "magic_queues.<name>.<field>", message)``; [] if it can.

    Encodes with pymongo's ``bson.BSON.encode`` (what the driver sends); on failure walks the
    document to name the field (an int outside 8 bytes raises a bare OverflowError)."""
    import bson  # noqa: PLC0415 - pymongo's, present with the server

    base = f"{queues_mod.TOP_KEY}.{name}"
    try:
        size = len(bson.BSON.encode(doc))
    except Exception as exc:  # noqa: BLE001 - OverflowError, InvalidDocument...
        found = list(_unencodable(doc, ()))
        if not found:
            return [queues_mod.Issue(source, 0, base, f"cannot be stored in MongoDB: {exc}")]
        return [queues_mod.Issue(source, 0, ".".join([base, *map(str, path)]), msg)
                for path, msg in found]
    if size > MAX_BSON_SIZE:
        return [queues_mod.Issue(source, 0, base, f"is {size} bytes stored, over MongoDB's "
                                 f"{MAX_BSON_SIZE}-byte document limit")]
    return []


def _unencodable(value, path: tuple):
    """(path, message) of each value BSON cannot hold: ints outside 8 bytes."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _unencodable(v, path + (k,))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _unencodable(v, path + (i,))
    elif isinstance(value, int) and not isinstance(value, bool) \
            and not _INT64[0] <= value <= _INT64[1]:
        yield path, f"{value} does not fit MongoDB's 8-byte integers"

