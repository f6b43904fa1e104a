"""Where a benchmark's time goes in the database stand-in (benchmarks/reconcile_scale.py).

Two instruments, both per thread, both for the lab's mongomock database behind the process-wide
lock of :mod:`testflinger_magic.db` only:

* :class:`TimedLock` replaces that lock (``install_timed_lock``): every database call takes it,
  so the time a thread *holds* it is the time inside mongomock (its scans, its deep copies), and
  the time it *waits* for it is the time another thread's call (a concurrent tick's read) kept
  it out. The rest of a measured span is the project's own Python (and, with other threads
  running, waiting for the interpreter lock).
* :func:`count_documents` (a context manager) counts, per collection, the documents mongomock
  tests against a filter (``examined``: every document of the collection for a scan, as
  mongomock has no indexes; the ``_id`` look-ups of ``index_like_id`` examine only those) and
  those that pass (``matched``: what a read served by an index on its filter's keys examines on
  a real MongoDB, where it returns them as BSON decoded in C). Deterministic; a wrapper call per
  document, so it runs on an untimed pass. It also keeps the documents the reads *returned*
  (``returned``: what ``Collection._copy_only_fields`` built, projections applied), so a
  benchmark can time what pymongo would spend decoding the same documents
  (:func:`driver_decode_seconds`).

Sources: mongomock 4.x ``collection.Collection._iter_documents`` (the scan: ``filter_applies``
on every document of ``self._store.documents``) and ``filtering.filter_applies``.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class ThreadTimes:
    """Seconds one thread spent waiting for the database lock and holding it (inside calls),
    and its calls (outermost acquisitions)."""

    wait: float = 0.0
    held: float = 0.0
    calls: int = 0


class TimedLock:
    """A re-entrant lock that times, per thread, the outermost acquisitions: waiting for it and
    holding it (:class:`ThreadTimes`). Used as ``with lock:`` (as db._LOCK is)."""

    def __init__(self):
        self._lock = threading.RLock()
        self._local = threading.local()

    def _state(self):
        st = self._local
        if not hasattr(st, "depth"):
            st.depth, st.since, st.times = 0, 0.0, ThreadTimes()
        return st

    def __enter__(self):
        st = self._state()
        if st.depth == 0:
            t0 = time.perf_counter()
            self._lock.acquire()
            st.since = time.perf_counter()
            st.times.wait += st.since - t0
            st.times.calls += 1
        else:
            self._lock.acquire()
        st.depth += 1
        return self

    def __exit__(self, *exc):
        st = self._local
        st.depth -= 1
        if st.depth == 0:
            st.times.held += time.perf_counter() - st.since
        self._lock.release()
        return False

    def reset(self) -> None:
        """Zero this thread's times."""
        self._state().times = ThreadTimes()

    def times(self) -> ThreadTimes:
        """This thread's times since its last :meth:`reset` (a copy)."""
        t = self._state().times
        return ThreadTimes(t.wait, t.held, t.calls)


def install_timed_lock() -> TimedLock:
    """Replace :data:`testflinger_magic.db._LOCK` (looked up at each call) with a
    :class:`TimedLock`; returns it. Call before any other thread uses the database."""
    from testflinger_magic import db as dbmod

    lock = TimedLock()
    dbmod._LOCK = lock
    return lock


@dataclass
class DocumentCounts:
    """Per collection: documents tested against a filter, and those that passed."""

    examined: Counter = field(default_factory=Counter)
    matched: Counter = field(default_factory=Counter)
    returned: list = field(default_factory=list)


@contextmanager
def count_documents():
    """Count, on this thread, the documents mongomock examines and matches per collection
    (module docstring) while the block runs; yields the :class:`DocumentCounts`. Wraps
    ``Collection._iter_documents`` as installed (the benchmark's ``index_like_id`` included)."""
    from mongomock import collection, filtering

    counts = DocumentCounts()
    me = threading.get_ident()
    current = {"name": None}
    original_iter = collection.Collection._iter_documents
    original_applies = filtering.filter_applies

    def applies(search_filter, document):
        ok = original_applies(search_filter, document)
        # mongomock first tests the filter on {} (a syntax check); real documents have an _id
        # (an array element an $elemMatch projection tests, e.g. a lease's history entry, is
        # not a document the read examined).
        if threading.get_ident() == me and isinstance(document, dict) and "_id" in document:
            counts.examined[current["name"]] += 1
            counts.matched[current["name"]] += bool(ok)
        return ok

    def iter_documents(self, filter):
        if threading.get_ident() == me:
            current["name"] = self.name
        return original_iter(self, filter)

    original_copy = collection.Collection._copy_only_fields

    def copy_only_fields(self, doc, fields, container):
        out = original_copy(self, doc, fields, container)
        if threading.get_ident() == me:
            # A copy: the caller may add to what it was handed (tickreads.with_vms does).
            counts.returned.append(copy.deepcopy(out))
        return out

    collection.Collection._iter_documents = iter_documents
    collection.Collection._copy_only_fields = copy_only_fields
    collection.filter_applies = applies
    filtering.filter_applies = applies
    try:
        yield counts
    finally:
        collection.Collection._iter_documents = original_iter
        collection.Collection._copy_only_fields = original_copy
        collection.filter_applies = original_applies
        filtering.filter_applies = original_applies


def driver_decode_seconds(docs: list, repeats: int = 5) -> float:
    """Median seconds pymongo's BSON decoder (``bson.decode_all``, the C extension when built,
    as pymongo uses it for a reply's documents) takes to decode ``docs`` (dicts, each encoded
    once beforehand): the client's side of returning those documents from a real MongoDB,
    without the server's and the network's, which this machine cannot measure."""
    import statistics

    import bson

    data = b"".join(bson.encode(d) for d in docs)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        bson.decode_all(data)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
