#!/usr/bin/env python3
"""A lab at size: ``reconcile.plan()`` and the full ``Engine.tick`` at 1,000 devices / 50 queues.

Two parts:

* **plan()** on pure synthetic ``reconcile.Inputs`` (no database): N registered 4-GPU devices in
  10 racks, Q magic queues (each selects one rack by tag, or every device by home queue), N/2
  open leases (mostly active with their VM agents, some in bring-up, draining or paused),
  waiting jobs on magic and home queues, a few devices with failures. Median of repeats.
* **Engine.tick** on a mongomock database filled through the real code: queues applied with
  ``MagicPlugin.apply``, devices registered with ``Engine.register`` (8 per agent host), their
  Testflinger ``agents`` documents posted, N/2 devices lent with ``LeaseStore.claim`` and brought
  up with daemon reports (``Engine.report``) to ``active``, VM agents posted (a third of them
  running a job handed out through the dispatch hook's marker, ``Gates.mark``), waiting jobs on
  every magic queue and on the home queues. The clock is fixed, so after a few ticks (lends,
  drains that the jobs caused) the lab reaches a steady state; the steady tick is timed
  (median) and its database calls counted (every collection method call, by a wrapper around
  the collections, as benchmarks/dispatch_overhead.py does). The count is deterministic.
* **submit -> lease claimed** at that size: a job submitted to a magic queue with no supply
  (stored as ``POST /v1/job`` does, then ``MagicPlugin.kick(queue)`` as its hook does: a quick
  lend, server/quicklend.py) with the plugin's ticker and lender threads running, timed until
  ``LeaseStore.claim`` returns (p50 and p99 over 60 submissions at random moments, every
  second one just after a tick was asked for, so some land while a tick is in flight; the
  clock moved :data:`SUBMIT_CLOCK_STEP` since the fill), with where each quick lend's time
  went (:func:`_split`).

Where the time goes (:mod:`testflinger_magic.lab.dbtime`): the tick's time inside database
calls (the stand-in's process-wide lock held) and outside them (the project's own Python), and
the documents mongomock examined (tested against a filter) and matched (what a read served by
its declared index examines on a real MongoDB) per collection; a real MongoDB's figure is
reasoned from those, not measured (no server on this machine).

The stand-in serves reads as a MongoDB with the declared indexes does
(:mod:`testflinger_magic.lab.mongoindex`, checked against plain mongomock by
tests/test_mongoindex.py): ``$in`` as a set lookup, ``_id`` looked up in its store, and a read
with a condition on the first key of an index of :data:`testflinger_magic.indexes.INDEXES`
(ours and Testflinger's) tests only the documents that condition admits. Plain mongomock tests
every document of the collection per read, which no query of ours can avoid: a quick lend's read
of one queue's waiting jobs tested all 3,904 jobs, three times. Documents of TTL indexes expire
every 60 s, as MongoDB's TTL monitor removes them (mongomock tests every event for expiry at
each access of ``magic_events``). A path through arrays (``vms.agent_name``) is indexed by its
elements' values, as MongoDB's multikey indexes are. The documents a read returns are built
as a driver's are (:mod:`testflinger_magic.lab.mongocopy`: the projection worked out once per
read, not per document; immutable values shared; the cursor read by position, where
mongomock re-slices its results at every ``next``, O(n^2) per read), and a filter made only
of conditions exact index bounds answer (a string equality or ``$in``, an ObjectId range) is
answered without mongomock's general evaluator (:mod:`testflinger_magic.lab.mongofilter`),
as MongoDB drops such predicates from the fetch; a sort whose key values are all of one class
(the open leases by ``created_at``, an order their index gives MongoDB for nothing) is a
native sort, not mongomock's BSON comparison per step (:mod:`testflinger_magic.lab.mongosort`).
Same answers as plain mongomock (tests/test_mongoindex.py, test_mongocopy.py,
test_mongofilter.py, test_mongosort.py). What is left is the
stand-in's Python per returned document; the benchmark prints it beside what pymongo's C
decoder takes for the same documents (the client's share of a real MongoDB read).
``--mongomock-in``, ``--mongomock-id``, ``--mongomock-scan``, ``--mongomock-copy``,
``--mongomock-filter``, ``--mongomock-sort``: keep mongomock's own ``$in``, ``_id`` scan,
scan per read and TTL check per access, copy and cursor, filter evaluator, and sort. After each fill the
filled database is moved out of the cyclic garbage collector's generations (``gc.freeze``: the
stand-in's database lives in this process' heap, a MongoDB server's does not);
``--no-gc-freeze`` leaves it in.

Growth: tick (and plan) time at 10x the devices (100 -> 1,000, 50 queues) and 10x the queues
(5 -> 50, 1,000 devices), as time ratios.

Goals (issue 9; printed beside the figures, never asserted by tests; on a shared 2-core machine
compare ratios, not absolute times): at 1,000 devices / 50 queues ``plan()`` <= 10 ms; full tick
<= 50 database calls and <= 100 ms; 10x devices -> <= 12x tick time; 10x queues -> <= 12x;
submit -> lease claimed <= 100 ms p99. Last line:
``scale: plan_ms N, tick_ms N, tick_queries N, devices_10x_growth R, queues_10x_growth R``.

``--quick``: 100 devices only (a smoke run; no growth figures).
"""

from __future__ import annotations

import gc
import statistics
import struct
import sys
import threading
import time
import uuid
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

import bson
from bson import ObjectId

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testflinger_magic import db as dbmod  # noqa: E402
from testflinger_magic.lab import dbcount, dbtime, mongocopy, mongofilter, mongoindex, mongosort  # noqa: E402
from testflinger_magic import reconcile as R  # noqa: E402
from testflinger_magic.queues import load_text  # noqa: E402
from testflinger_magic.server.plugin import MagicPlugin  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale_inputs import (  # noqa: E402  (the lab's queues, devices and synthetic inputs)
    DEVICES_PER_HOST, GPUS, NOW, RACKS, device_name, queue_of, queue_yaml, synthetic_inputs,
    timed_plan, with_every_knob)

READS, WRITES = dbcount.READS, dbcount.WRITES
#: Seconds the clock moves between the fill (and the timed ticks) and the submissions.
SUBMIT_CLOCK_STEP = 90.0


# ------------------------------------------------------------------ a database through the real code

def _utc(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, timezone.utc)


def _inserted_id(created: float) -> ObjectId:
    """The ``_id`` the driver gives a job inserted at ``created`` (epoch seconds, the lab's
    clock): an ObjectId whose first four bytes are the inserting client's clock in seconds (BSON
    spec; pymongo ``bson.objectid.ObjectId``), the rest a fresh ObjectId's (unique). Without it
    mongomock would stamp every job with the moment the fill inserted it, so a day of history
    would look inserted within the last minute, which no steady lab has: the tick's read of the
    jobs inserted since its previous one (server/jobreads.py ``LatestJobs``; its clock is the
    lab's, :class:`Lab`) would find them all."""
    return ObjectId(struct.pack(">I", int(created)) + ObjectId().binary[4:])


def _job(queue: str, state: str, created: float, agent: str | None = None) -> dict:
    """A job document as Testflinger's POST /v1/job stores it (lab jobservice / conftest), with
    the ``_id`` of its insertion at ``created`` (:func:`_inserted_id`)."""
    doc = {"_id": _inserted_id(created), "job_id": str(uuid.uuid4()),
           "created_at": _utc(created), "job_priority": 0,
           "job_data": {"job_queue": queue, "exclude_agents": []},
           "result_data": {"job_state": state}}
    if state != "waiting":
        doc["started_at"] = _utc(created + 1)
    return doc


def _agent(db, name: str, state: str, queues: list, job_id: str = "") -> None:
    """POST /v1/agents/data/<name> as Testflinger stores it (upsert by name)."""
    db.agents.update_one({"name": name}, {"$set": {"name": name, "state": state, "queues": queues,
                                                   "job_id": job_id, "comment": "",
                                                   "updated_at": _utc(NOW - 600)}}, upsert=True)


class Lab:
    """A plugin on a counting mongomock database, filled through the real code."""

    def __init__(self, n: int, n_queues: int):
        self.n, self.n_queues = n, n_queues
        self.clock_now = NOW - 300  # the fill's time: bring-up deadlines and idle timeouts not yet due
        self.db = dbcount.Counting(dbmod.connect())
        self.plugin = MagicPlugin(self.db, clock=lambda: self.clock_now)
        self.engine, self.store = self.plugin.engine, self.plugin.store
        # The jobs' _ids carry the lab's clock (_inserted_id): so does the read of the jobs
        # inserted since the previous tick (on a server both are the wall clock).
        self.engine.job_reads.latest.wall = lambda: self.clock_now
        self.plugin.apply(load_text(queue_yaml(n_queues, n), "bench.yaml"), source="bench")
        for thread in threading.enumerate():  # the tick that applying the queues kicked
            if thread.name == "magic-kick":
                thread.join()
        self.defs = {q.name: q for q in self.engine.definitions()}
        self._fill()
        self.clock_now = NOW
        for host in {f"host-{i // DEVICES_PER_HOST:03d}" for i in range(n)}:
            self.engine.heartbeat(host, [])  # live agent hosts (the daemon's 30 s heartbeat)

    def _fill(self) -> None:
        n, db = self.n, self.db
        hosts: dict[str, list] = {}
        for i in range(n):
            rack = f"rack-{i % RACKS}"
            hosts.setdefault(f"host-{i // DEVICES_PER_HOST:03d}", []).append(
                {"agent_name": device_name(i), "maas_system_id": f"m{i:05d}", "gpus": GPUS,
                 "tags": [rack], "home_queues": ["gpu-hosts", rack]})
        for host, devices in hosts.items():
            self.engine.register(host, devices, "bench")
        for i in range(n):
            busy_home = i % 4 == 1
            job = _job(f"rack-{i % RACKS}", "test", NOW - 900, device_name(i)) if busy_home else None
            if job:
                db.jobs.insert_one(job)
            _agent(db, device_name(i), "test" if busy_home else "waiting",
                   ["gpu-hosts", f"rack-{i % RACKS}"], job["job_id"] if job else "")
        for i in range(0, n, 2):
            self._lend(i)
        # Demand: as many waiting jobs per magic queue as it has idle VM agents (nothing to
        # consolidate), plus 0-2 more (a lend each), and some home jobs.
        idle = Counter(a.queue for a in self.engine.gather(read_only=True).vm_agents
                       if not a.busy)
        for k in range(self.n_queues):
            for _ in range(idle[f"mq-{k:02d}"] + k % 3):
                db.jobs.insert_one(_job(f"mq-{k:02d}", "waiting", NOW - 120))
        for r in range(RACKS):
            for _ in range(r % 2):
                db.jobs.insert_one(_job(f"rack-{r}", "waiting", NOW - 60))
        # History: finished jobs on every queue.
        for j in range(2 * n):
            db.jobs.insert_one(_job(f"mq-{j % self.n_queues:02d}" if j % 2 else f"rack-{j % 10}",
                                    "complete", NOW - 86400 + j))

    def _lend(self, i: int) -> None:
        name = device_name(i)
        q = self.defs[f"mq-{queue_of(i, self.n_queues):02d}"]
        host = f"host-{i // DEVICES_PER_HOST:03d}"
        lease = self.store.claim(name, q, host, q.vms_for(GPUS), "bench")
        steps = ("fenced", "deploying") if i % 10 == 2 else (
            "fenced", "deploying", "splitting", "enrolling", "active")
        for to_state in steps:
            vms = []
            if to_state == "enrolling":
                vms = [{"index": v["index"], "domain": v["name"], "gpus": [f"0000:0{v['index'] + 1}:00.0"]}
                       for v in lease["vms"]]
            lease = self.engine.report(lease["_id"], {
                "agent_host": host, "state": lease["state"], "generation": lease["generation"],
                "result": "ok", "to_state": to_state, "vms": vms})
        if lease["state"] != "active":
            return
        for v, vm in enumerate(lease["vms"]):
            agent = vm["agent_name"]
            if (i + v) % 3 == 0:
                _agent(self.db, agent, "waiting", [q.name])
                continue
            job = _job(q.name, "running", NOW - 300)
            self.db.jobs.insert_one(job)
            self.store.gates.mark(agent, job["job_id"], q.name)  # the dispatch hook's marker
            _agent(self.db, agent, "test", [q.name], job["job_id"])

    def settle(self, limit: int = 30) -> int:
        """Tick until a tick applies nothing; returns the ticks it took."""
        for k in range(limit):
            if not self.engine.tick():
                return k + 1
        return limit

    def timed_tick(self, repeats: int = 5) -> "TickFigures":
        """A steady tick: median seconds of ``repeats`` ticks, split into the time inside
        database calls (holding the stand-in's lock, :mod:`testflinger_magic.lab.dbtime`) and
        the rest (the project's own Python); its database calls by collection.method; then, on
        one more (untimed) tick, the documents mongomock examined and matched per collection."""
        times, held, ops, refs = [], [], Counter(), []
        for _ in range(repeats):
            self.plugin.notifier.flush(30)  # its thread's reads are not the tick's
            refs.append(reference_seconds())  # this minute's machine speed
            self.db.ops.clear()
            self.db.on = True
            LOCK.reset()
            t0 = time.perf_counter()
            applied = self.engine.tick()
            times.append(time.perf_counter() - t0)
            held.append(LOCK.times().held)
            self.db.on = False
            ops = Counter(self.db.ops)
            if applied:
                print(f"    (a timed tick applied {len(applied)} actions)")
        self.plugin.notifier.flush(30)
        with dbtime.count_documents() as docs:
            self.engine.tick()
        REFERENCE.extend(refs)
        return TickFigures(statistics.median(times), statistics.median(held),
                           statistics.median(t - h for t, h in zip(times, held)),
                           sum(ops.values()), ops, docs, statistics.median(refs))

    def submit_to_claim(self, repeats: int = 60) -> tuple[list[float], Counter]:
        """Seconds from a job submitted to a magic queue with no supply to its lease claimed,
        ``repeats`` times, with the plugin's ticker and lender threads running as in a server
        (``MagicPlugin.start``, a tick every 5 s): the job is stored as POST /v1/job stores it,
        then ``MagicPlugin.kick(queue)`` is called as the POST /v1/job hook does (a quick lend
        on the last tick's snapshot, server/quicklend.py, then a tick); the time is taken when
        ``LeaseStore.claim`` returns for that queue. Submissions come at random moments, so
        some land while a tick is in flight, as real ones do. Each lease is then handed back
        (restoring, returned) and the jobs taken away, so every round starts alike. Every
        second submission comes 0-0.5 s after a tick was asked for (a kick, as another
        submission's or the periodic one; the tick that follows a quick lend ends before the
        next round, which hands back under the tick lock), so some land while a tick is in
        flight. Also
        returns which thread claimed (``magic-lender``: the quick lend; ``magic-ticker``: a
        tick), and for each submit claimed by the quick lend how its time splits
        (:func:`_split`; None for a tick's claim)."""
        import random  # noqa: PLC0415

        rng = random.Random(9)
        k = 9 if self.n_queues > 9 else 0  # mq-09 selects every device by home queue
        queue = f"mq-{k:02d}"
        claimed, stamps, by = threading.Event(), [], Counter()
        real_claim, real_lend = self.store.claim, self.engine.lend_now
        lend_lock = self.engine._lend_lock = dbtime.TimedLock()  # a tick's lends hold it too
        lend: dict = {}  # the quick lend in flight: when it began, a tick in flight then

        def lend_now(*args, **kwargs):
            LOCK.reset()
            lend_lock.reset()
            lend.update(start=time.perf_counter(), cpu=time.thread_time(),
                        tick=self.plugin._tick_lock.locked())
            return real_lend(*args, **kwargs)

        def claim(device, queue_def, *args, **kwargs):
            lease = real_claim(device, queue_def, *args, **kwargs)
            if queue_def.name == queue:
                stamps.append(time.perf_counter())
                name = threading.current_thread().name
                by[name] += 1
                db = LOCK.times()
                parts.append({"start": lend.get("start"), "tick": lend.get("tick", True),
                              "cpu": time.thread_time() - lend.get("cpu", 0.0),
                              "wait": db.wait, "held": db.held,
                              "lend_lock": lend_lock.times().wait} if name == "magic-lender"
                             else None)
                claimed.set()
            return lease

        self.store.claim = claim  # the engine calls self.store.claim
        self.engine.lend_now = lend_now  # the plugin's lender calls self.engine.lend_now
        parts: list = []
        # The submissions come a minute and a half after the fill and the settle ticks, as on
        # a server whose clock moves: with the clock left where they wrote, every lease they
        # touched would count as written since the last tick (a quick lend reads those again,
        # server/quicklend.py LEASE_SLACK). Fixed again from then on (the steady state); the
        # agent hosts' heartbeats come with it.
        self.clock_now = NOW + SUBMIT_CLOCK_STEP
        for host in {f"host-{i // DEVICES_PER_HOST:03d}" for i in range(self.n)}:
            self.engine.heartbeat(host, [])
        self.plugin.start()
        out, split = [], []
        try:
            for r in range(repeats):
                time.sleep(rng.uniform(0.0, 0.5))
                with self.plugin._tick_lock:  # between ticks: read what to submit
                    before = {l["_id"] for l in self.store.list(queue=queue, open_only=True)}
                    wanted = 1 + sum(self.engine._lease_view(R, l).vms
                                     for l in self.store.list(queue=queue, open_only=True))
                    jobs = [_job(queue, "waiting", self.clock_now) for _ in range(wanted)]
                    claimed.clear()
                if r % 2:  # a tick starts (another submission's, a periodic one) and this
                    self.plugin.kick()  # submission lands during it or after it
                    time.sleep(rng.uniform(0.0, 0.5))
                t0 = time.perf_counter()
                LOCK.reset()
                self.db.jobs.insert_many(jobs)  # POST /v1/job ...
                inserted = LOCK.times()
                self.plugin.kick(queue)         # ... and its after_request hook
                if claimed.wait(60):
                    out.append(stamps[-1] - t0)
                    split.append(_split(stamps[-1] - t0, t0, parts[-1], inserted))
                else:
                    why = [a.reason for a in R.plan(self.engine.gather(read_only=True),
                                                    explain=True)
                           if a.kind in R.NON_ACTING and a.queue == queue]
                    print(f"    (submit {r}: no lease claimed within 60 s: "
                          f"{'; '.join(why) or 'plan gives no reason'})")
                with self.plugin._tick_lock:  # hand back: restoring, then returned
                    for lease in self.store.list(queue=queue, open_only=True):
                        if lease["_id"] in before:
                            continue
                        lease = self.store.transition(lease["_id"], lease["state"],
                                                      lease["generation"], "restoring", "bench")
                        self.store.close(lease["_id"], lease["generation"], "returned", "bench")
                        # The restarted device agent posts its state at startup (TESTFLINGER.md
                        # §3.2); until it has, a returned device is not lent again.
                        self.db.agents.update_one(
                            {"name": lease["device"]},
                            {"$set": {"updated_at": datetime.fromtimestamp(
                                self.clock_now + 1, timezone.utc)}})
                    self.db.jobs.delete_many({"job_id": {"$in": [j["job_id"] for j in jobs]}})
        finally:
            self.plugin.stop()
            del self.store.claim
            del self.engine.lend_now
        return out, by, split


# ------------------------------------------------------------------ where the time goes

#: The stand-in's process-wide lock, timed (testflinger_magic.lab.dbtime): set by main().
LOCK: dbtime.TimedLock | None = None


#: Seconds of :func:`reference_seconds`, one before each timed tick of the run.
REFERENCE: list[float] = []


def reference_seconds() -> float:
    """Seconds a fixed piece of pure Python takes now (dicts, lists, strings, a sort: the kind
    of work a tick does, ~20 ms). This 2-core machine's speed moves by up to ~1.7x from minute
    to minute (a fixed loop measured 0.116-0.188 s within 40 s, no CPU steal): the run prints
    the reference beside the ticks, so a slow minute shows as such. Not a correction: the
    goals are judged on the times measured."""
    t0 = time.perf_counter()
    table = {}
    for i in range(12000):
        table[f"agent-{i:05d}"] = {"state": "waiting" if i % 3 else "test", "job": [i, str(i)]}
    sorted(table, key=lambda name: (table[name]["state"], name))
    return time.perf_counter() - t0


class TickFigures(NamedTuple):
    """A steady tick: median seconds in all, inside database calls and outside them (the
    project's own Python), database calls (and by collection.method), and the documents
    mongomock examined and matched by collection (dbtime.DocumentCounts) on one more tick."""

    seconds: float
    db: float
    own: float
    calls: int
    ops: Counter
    docs: dbtime.DocumentCounts
    #: median seconds of :func:`reference_seconds` just before each of these ticks
    reference: float = 0.0


def _split(total: float, submitted: float, part: dict | None,
           insert: "dbtime.ThreadTimes") -> dict | None:
    """Seconds of one submit -> claimed: ``insert_wait`` (the submission's job insert waiting
    for the stand-in's lock: a concurrent tick's call held it), ``wake`` (the rest of the
    submit until the lender thread began the quick lend: the insert itself, waking the
    lender), ``db`` (inside the quick lend's database calls), ``db_wait`` (waiting for
    the stand-in's lock: a concurrent tick's call held it), ``lend_wait`` (waiting for the
    lend lock: a tick applying its own lends), ``own`` (the rest: the quick lend's Python, and
    waiting for the interpreter while a tick's Python ran), ``tick`` (a tick was in flight
    when the quick lend began); and ``off_cpu``: of ``db`` + ``own``, the time the lender
    thread did not run (its CPU time, time.thread_time, subtracted): another thread of this
    process held the interpreter, or the machine's other processes the cores. None when a
    tick claimed."""
    if part is None or part.get("start") is None:
        return None
    wake = part["start"] - submitted - insert.wait
    rest = total - insert.wait - wake - part["held"] - part["wait"] - part["lend_lock"]
    return {"total": total, "insert_wait": insert.wait, "wake": wake, "db": part["held"],
            "db_wait": part["wait"],
            "lend_wait": part["lend_lock"], "own": rest, "tick": part["tick"],
            "off_cpu": max(0.0, part["held"] + rest - part["cpu"])}


def print_claim_split(split: list) -> None:
    """Medians of the parts of submit -> claimed, and the parts of the slowest 1% (p99)."""
    split = [s for s in split if s]
    if not split:
        return
    keys = ("insert_wait", "wake", "db", "db_wait", "lend_wait", "own", "off_cpu")
    med = {k: statistics.median(s[k] for s in split) * 1e3 for k in keys}
    print("  where it goes (ms; median of each part over the quick lends): "
          + ", ".join(f"{k} {med[k]:.0f}" for k in keys))
    ranked = sorted(split, key=lambda s: s["total"])
    tail = ranked[min(len(ranked) - 1, int(round(0.99 * (len(ranked) - 1)))):]
    for s in tail:
        print(f"  p99 submit: {s['total'] * 1e3:.0f} ms = "
              + ", ".join(f"{k} {s[k] * 1e3:.0f}" for k in keys)
              + (" (a tick was in flight)" if s["tick"] else ""))
    # The stand-in serialises every database call on one process-wide lock (mongomock is not
    # thread-safe, db.py); a MongoDB serves a job insert or a read while another client's read
    # runs. For orientation only (the goal is the measured total above): the same submissions
    # without their waits for that lock.
    unlocked = sorted(s["total"] - s["insert_wait"] - s["db_wait"] for s in split)
    print(f"  (orientation, not the goal: without the waits for the stand-in's one lock, "
          f"insert_wait + db_wait: p50 {statistics.median(unlocked) * 1e3:.0f} ms, p99 "
          f"{unlocked[min(len(unlocked) - 1, int(round(0.99 * (len(unlocked) - 1))))] * 1e3:.0f}"
          " ms)")
    print(f"  {sum(1 for s in split if s['tick'])} of {len(split)} quick lends began while a "
          "tick was in flight (insert_wait: the submission's insert waiting for the "
          "stand-in's one lock, held by a concurrent tick's call; wake: the rest until the "
          "lender ran; db: inside its database calls; db_wait: its calls waiting for that "
          "lock; "
          "lend_wait: a tick's lends; own: its Python; off_cpu: of db + own, the lender not "
          "running: the interpreter held by another thread, or the cores by other processes)")


# ------------------------------------------------------------------ main

def main() -> int:
    global LOCK
    quick = "--quick" in sys.argv
    LOCK = dbtime.install_timed_lock()
    if "--mongomock-in" not in sys.argv:
        mongoindex.index_like_in()
    if "--mongomock-id" not in sys.argv:
        mongoindex.index_like_id()
    if "--mongomock-scan" not in sys.argv:
        mongoindex.index_like_fields()
        mongoindex.ttl_like_mongodb()
    if "--mongomock-copy" not in sys.argv:
        mongocopy.copy_like_driver()
        mongocopy.cursor_like_driver()
    if "--mongomock-filter" not in sys.argv:
        mongofilter.filter_like_index_bounds()
    if "--mongomock-sort" not in sys.argv:
        mongosort.sort_natively()
    goals = ("goals (issue 9) at 1,000 devices / 50 queues: plan() <= 10 ms; full tick <= 50 "
             "database calls and <= 100 ms; 10x devices -> <= 12x tick time; 10x queues -> "
             "<= 12x; submit -> lease claimed <= 100 ms p99")
    print(goals)
    print("\nreconcile.plan() on synthetic inputs (median of repeats)")
    print(f"{'devices':>8}{'queues':>8}{'leases':>8}{'vm agents':>10}{'actions':>9}{'plan ms':>10}")
    plan_ms = {}
    sizes = [(100, 50)] if quick else [(100, 50), (1000, 5), (1000, 50)]
    for n, nq in sizes:
        inp = synthetic_inputs(n, nq)
        seconds, actions = timed_plan(inp)
        plan_ms[(n, nq)] = seconds * 1e3
        print(f"{n:>8}{nq:>8}{len(inp.leases):>8}{len(inp.vm_agents):>10}{actions:>9}"
              f"{seconds * 1e3:>10.2f}")
    n, nq = sizes[-1]
    inp = with_every_knob(synthetic_inputs(n, nq))
    seconds, actions = timed_plan(inp)
    print(f"{n:>8}{nq:>8}{len(inp.leases):>8}{len(inp.vm_agents):>10}{actions:>9}"
          f"{seconds * 1e3:>10.2f}  every lending knob on (issue 11; not a goal)")

    print("\nEngine.tick on mongomock filled through the real code (steady state, median of 5; "
          + ("mongomock's own $in" if "--mongomock-in" in sys.argv else
             "$in as a set lookup") + "; "
          + ("mongomock's own _id scan" if "--mongomock-id" in sys.argv else
             "_id looked up") + "; "
          + ("mongomock's scan of every document per read" if "--mongomock-scan" in sys.argv
             else "reads on a declared index's first key test its candidates only") + "; "
          + ("mongomock's copy and cursor" if "--mongomock-copy" in sys.argv
             else "projection parsed once, immutable leaves shared, cursor by position") + "; "
          + ("mongomock's evaluator for every filter" if "--mongomock-filter" in sys.argv
             else "exact conditions decided as index bounds") + "; "
          + ("mongomock's BSON comparison per sort step" if "--mongomock-sort" in sys.argv
             else "same-class sort keys sorted natively, as an index's order costs nothing")
          + ": lab/mongoindex.py, lab/mongocopy.py, lab/mongofilter.py, lab/mongosort.py)")
    print(f"{'devices':>8}{'queues':>8}{'fill s':>8}{'settle':>8}{'tick ms':>10}{'in db':>8}"
          f"{'own':>6}{'db calls':>10}{'examined':>10}{'matched':>9}{'ref ms':>8}")
    tick = {}
    big = None
    for n, nq in sizes:
        t0 = time.perf_counter()
        lab = Lab(n, nq)
        fill = time.perf_counter() - t0
        settled = lab.settle()
        if "--no-gc-freeze" not in sys.argv:
            # The stand-in keeps the whole database in this process' heap, which each full
            # collection of Python's cyclic GC traverses (60-80 ms at 1,000 devices, landing
            # in some timed ticks and quick lends); a server on MongoDB has no such heap.
            # gc.freeze() moves what exists now (the filled database) out of the collector's
            # generations (CPython docs: gc.freeze); later garbage is collected as usual. The
            # previous size's lab, unreferenced by now, is collected first (unfreeze, collect).
            gc.unfreeze()
            gc.collect()
            gc.freeze()
        fig = lab.timed_tick()
        tick[(n, nq)] = (fig.seconds * 1e3, fig.calls, fig.ops, fig)
        print(f"{n:>8}{nq:>8}{fill:>8.1f}{settled:>8}{fig.seconds * 1e3:>10.1f}"
              f"{fig.db * 1e3:>8.1f}{fig.own * 1e3:>6.1f}{fig.calls:>10}"
              f"{sum(fig.docs.examined.values()):>10}{sum(fig.docs.matched.values()):>9}"
              f"{fig.reference * 1e3:>8.1f}"
              + ("   goal <= 100 ms, <= 50 calls" if (n, nq) == (1000, 50) else ""))
        big = lab
    print("  (ref ms: the machine's speed beside these ticks, reference_seconds' median: the same "
          "work each time; a higher one is a slower minute)")
    print("  (tick ms = in db + own: inside the stand-in's database calls, and the project's own "
          "Python; examined: documents mongomock tested against a filter (an index's candidates, "
          "or the whole collection for a read no index serves); matched: those that passed, what a read "
          "served by its declared index examines on a real MongoDB; one more, untimed tick)")
    n, nq = sizes[-1]
    fig = tick[(n, nq)][3]
    print(f"\ndatabase calls of one steady tick at {n} devices / {nq} queues, by "
          "collection.method, and documents examined / matched by collection:")
    for (coll, method), v in sorted(fig.ops.items()):
        print(f"  {coll}.{method}: {v}")
    for coll in sorted(set(fig.docs.examined) | set(fig.docs.matched), key=str):
        print(f"  {coll}: examined {fig.docs.examined[coll]}, matched {fig.docs.matched[coll]}")
    returned = len(fig.docs.returned)
    decode = dbtime.driver_decode_seconds(fig.docs.returned)
    size = sum(len(bson.encode(d)) for d in fig.docs.returned)
    print(f"  documents returned: {returned} ({size / 1024:.0f} KiB of BSON, deterministic); "
          f"time inside the stand-in's calls {fig.db * 1e3:.1f}"
          f" ms ({fig.db * 1e6 / max(returned, 1):.1f} us per document returned); pymongo's C "
          f"decoding of the same documents {decode * 1e3:.1f} ms "
          f"({decode * 1e6 / max(returned, 1):.1f} us each: the client's share of a real "
          "MongoDB read, the server's and the network's not measurable here)")

    claims, by, split = big.submit_to_claim()
    claims = sorted(claims) or [float("nan")]
    p50 = statistics.median(claims) * 1e3
    p99 = claims[min(len(claims) - 1, int(round(0.99 * (len(claims) - 1))))] * 1e3
    print(f"\nsubmit -> lease claimed at {n} devices / {nq} queues ({len(claims)} submits; "
          f"claimed by {', '.join(f'{k} {v}' for k, v in sorted(by.items()))}): "
          f"p50 {p50:.0f} ms, p99 {p99:.0f} ms (goal <= 100 ms), max {claims[-1] * 1e3:.0f} ms")
    print_claim_split(split)

    full = (1000, 50)
    if quick:
        print("\n--quick: no growth figures")
        dev_growth = q_growth = float("nan")
    else:
        dev_growth = tick[full][0] / tick[(100, 50)][0]
        q_growth = tick[full][0] / tick[(1000, 5)][0]
        print(f"\n10x devices (100 -> 1,000, 50 queues): tick x{dev_growth:.1f} (goal <= 12), "
              f"plan x{plan_ms[full] / plan_ms[(100, 50)]:.1f}")
        print(f"10x queues (5 -> 50, 1,000 devices): tick x{q_growth:.1f} (goal <= 12), plan "
              f"x{plan_ms[full] / plan_ms[(1000, 5)]:.1f}")
    key = sizes[-1]
    met = {
        "plan() <= 10 ms": plan_ms[key] <= 10,
        "tick <= 50 database calls": tick[key][1] <= 50,
        "tick <= 100 ms": tick[key][0] <= 100,
        "10x devices <= 12x": quick or dev_growth <= 12,
        "10x queues <= 12x": quick or q_growth <= 12,
        "submit -> claimed <= 100 ms p99": p99 <= 100,
    }
    missed = [k for k, ok in met.items() if not ok]
    if REFERENCE:
        print(f"machine speed this run: a fixed piece of Python (reference_seconds) took "
              f"p50 {statistics.median(REFERENCE) * 1e3:.1f} ms before the timed ticks, "
              f"{min(REFERENCE) * 1e3:.1f} ms at best and {max(REFERENCE) * 1e3:.1f} ms at "
              f"worst (the same work; the goals are judged on the times measured)")
    print(goals)
    print("goals met" if not missed else "goals NOT met: " + "; ".join(missed))
    print(f"scale: plan_ms {plan_ms[key]:.2f}, tick_ms {tick[key][0]:.1f}, tick_queries "
          f"{tick[key][1]}, devices_10x_growth {dev_growth:.1f}, queues_10x_growth {q_growth:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
