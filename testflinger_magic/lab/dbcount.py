"""Count database operations, for the benchmarks and the bounded-query tests.

``Counting(database)`` wraps a pymongo/mongomock ``Database``; while ``on`` it counts every call of
a read or write method of any collection in ``ops`` (a ``Counter``), keyed ``(collection,
method)``, or ``(collection, "read"|"write", method)`` with ``kinds=True``. With
``this_thread=True`` only calls from the thread that built it count (a Flask test client runs
the request there; a plugin's background threads do not). Counts are deterministic: they are
how the issues' query goals are measured, never wall time.
"""

from __future__ import annotations

import threading
from collections import Counter

#: Collection methods that read / write (pymongo's names; mongomock has the same).
READS = frozenset({"find", "find_one", "count_documents", "distinct", "aggregate",
                   "estimated_document_count"})
WRITES = frozenset({"insert_one", "insert_many", "update_one", "update_many", "replace_one",
                    "delete_one", "delete_many", "find_one_and_update", "find_one_and_delete",
                    "find_one_and_replace", "bulk_write"})


class Counting:
    """A database wrapper counting collection calls (see the module docstring)."""

    def __init__(self, database, *, kinds: bool = False, this_thread: bool = False):
        self._db = database
        self.ops: Counter = Counter()
        self.on = False
        self.kinds = kinds
        self.thread = threading.get_ident() if this_thread else None

    def __getitem__(self, name):
        return _CountingCollection(self, name, self._db[name])

    def __getattr__(self, name):
        if name.startswith("_") or name in ("list_collection_names", "command", "name",
                                            "client", "drop_collection", "get_collection"):
            return getattr(self._db, name)
        return self[name]

    def _count(self, collection: str, method: str) -> None:
        if not self.on or (self.thread is not None and threading.get_ident() != self.thread):
            return
        if self.kinds:
            self.ops[(collection, "write" if method in WRITES else "read", method)] += 1
        else:
            self.ops[(collection, method)] += 1


class _CountingCollection:
    def __init__(self, owner: Counting, name: str, coll):
        self._owner, self._name, self._coll = owner, name, coll

    def __getattr__(self, method):
        target = getattr(self._coll, method)
        if not callable(target) or method not in READS | WRITES:
            return target
        owner, name = self._owner, self._name

        def counted(*args, **kwargs):
            owner._count(name, method)
            return target(*args, **kwargs)

        return counted
