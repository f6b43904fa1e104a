"""Make the mongomock stand-in sort a read's documents at a native sort's cost, for the
benchmarks: the same order, without mongomock's per-comparison BSON evaluator.

A MongoDB serving ``find({"state": {"$in": [...]}}, sort=[("created_at", 1)])`` from the index
``(state, created_at)`` returns the documents in index order and compares nothing per document
(the plan has no SORT stage: ``QueryPlannerAnalysis::analyzeSort`` in MongoDB's
``src/mongo/db/query/planner_analysis.cpp`` drops it when an index provides the order); the tick's
open-lease read is one (tickreads.TickReads.open_leases, index in indexes.py). mongomock sorts
with the key ``(1, BsonComparable(value))`` (``filtering.resolve_sort_key``), whose every
comparison runs ``filtering.bson_compare`` in Python: a few milliseconds per tick at 1,000
devices (benchmarks/reconcile_scale.py).

:func:`sort_natively` (undone by :func:`.mongoindex.uninstall`) sorts by the values themselves
when, for a sort key, every document's value is present, not a list or tuple, and of one
comparison class that orders the same in Python as in BSON: numbers (``int`` and ``float``, not
``bool``), ``str`` (Python compares code points; BSON compares UTF-8 bytes, the same order),
``ObjectId``, or ``datetime`` (naive and aware ones mixed raise ``TypeError`` in both). For those,
``bson_compare(lt, a, b)`` is ``a < b`` (same compare type: ``op(a, b)``), and Python's
``sorted`` with the same comparisons and the same ``reverse`` is the same stable order.
Anything else (a missing value, ``None``, a ``bool``, an array, mixed classes, a subclass) is
sorted by mongomock's own key. Checked against plain mongomock on random
documents and sorts (tests/test_mongosort.py).
"""

from __future__ import annotations

from datetime import datetime

from . import mongocopy
from .mongoindex import _patch

#: Comparison classes sorted natively: exact types -> class (ints and floats compare as numbers).
_CLASS = {int: "number", float: "number", str: "str", datetime: "datetime"}


def _native_class(values: list) -> str | None:
    """The one comparison class of ``values`` sorted natively, or None (module docstring)."""
    from bson import ObjectId

    found = None
    for value in values:
        kind = type(value)
        cls = "objectid" if kind is ObjectId else _CLASS.get(kind)
        if cls is None:
            return None
        if found is None:
            found = cls
        elif cls != found:
            return None
    return found


def sort_natively() -> None:
    """Sort a read's documents by their native values where that is mongomock's order (module
    docstring)."""
    from mongomock import collection, filtering

    nothing = filtering.NOTHING
    original = collection.Collection._get_dataset

    def _get_dataset(self, spec, sort, fields, as_class):
        keys = list(sort.items() if isinstance(sort, dict) else sort or ())
        if any(key.startswith("$") for key, _ in keys):  # $natural, or what mongomock refuses
            yield from original(self, spec, sort, fields, as_class)
            return
        dataset = self._iter_documents(spec)
        if keys:
            dataset = list(dataset)
        for sort_key, direction in reversed(keys):  # mongomock's order: the last key first
            values = [filtering.resolve_key(sort_key, doc) for doc in dataset]
            if all(v is not nothing for v in values) and _native_class(values) is not None:
                order = sorted(range(len(dataset)), key=values.__getitem__,
                               reverse=direction < 0)
                dataset = [dataset[i] for i in order]
            else:
                dataset = sorted(dataset, key=lambda x, k=sort_key: filtering.resolve_sort_key(k, x),
                                 reverse=direction < 0)
        # mongomock's copy of each document (_copy_only_fields), or the copy emulation's,
        # its projection worked out once for the read (lab/mongocopy.py copier).
        hook = mongocopy.COPIER
        one = hook(self, fields, as_class) if hook is not None else None
        if one is None:
            for document in dataset:
                yield self._copy_only_fields(document, fields, as_class)
        else:
            for document in dataset:
                yield one(document)

    _patch(collection.Collection, "_get_dataset", _get_dataset)
