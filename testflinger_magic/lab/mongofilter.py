"""Make the mongomock stand-in decide the simple conditions of a filter as a MongoDB's exact index
bounds do, for the benchmarks: the same answers, without mongomock's general evaluator for each
document of a read.

A MongoDB serving ``{"name": {"$in": [...]}}`` from an index on ``name`` fetches the documents
the index bounds admit and tests nothing more: bounds built from an equality or ``$in`` of
strings, or a range of ObjectIds, are *exact* (``IndexBoundsBuilder``'s ``BoundsTightness::EXACT``
in MongoDB's ``src/mongo/db/query/index_bounds_builder.h``), so the planner drops those
predicates from the fetch stage's filter. mongomock has no indexes and tests every candidate
(:mod:`.mongoindex` chooses the candidates) with ``filtering.filter_applies``, a general
evaluator costing several microseconds per document even for ``name in [...]``: about a third
of what a reconcile tick spends inside the stand-in at 1,000 devices
(benchmarks/reconcile_scale.py).

:func:`filter_like_index_bounds` (undone by :func:`.mongoindex.uninstall`) answers a filter
itself when every condition in it is one of these, on a value reached through sub-documents
only (no array on the path):

* a string (or a bool) equality, and ``$in`` of strings: true when the document's value has
  exactly that type and is equal (in the set); false when the value is missing or ``null``
  (neither equals a string or a bool, in MongoDB as in mongomock);
* a range (``$gt``, ``$gte``, ``$lt``, ``$lte``) of ObjectIds on an ObjectId value (the
  ``_id`` range of "jobs inserted since");
* ``$or`` / ``$and`` of such filters (a non-empty list).

Anything else (another operator, another value type, an array or sub-document on the path or
at it, a value of another type than the condition's) goes to mongomock's ``filter_applies``
for the *whole* filter, so mongomock still decides every case it alone knows (and raises what
it raises). The conditions are tested in mongomock's order with its short cuts (the first
condition not met, the first ``$or`` branch met, ends the test). Also: a list of strings in a
filter is not walked element by element for datetimes (there are none to patch). Checked
against plain mongomock on random documents and filters (tests/test_mongofilter.py).
"""

from __future__ import annotations

from bson import ObjectId

from .mongoindex import _patch

#: Not decided here: mongomock's filter_applies decides.
UNDECIDED = None
_MISSING = object()
_RANGE_OPS = {"$gt": lambda a, b: a > b, "$gte": lambda a, b: a >= b,
              "$lt": lambda a, b: a < b, "$lte": lambda a, b: a <= b}
#: Condition lists seen, as sets (id -> (list, its length, frozenset or None)); a read's
#: filter tests its lists against every candidate.
_SETS: dict[int, tuple] = {}


def _strings(values) -> frozenset | None:
    """``values`` (a ``$in`` list) as a set when every one is a ``str``, else None."""
    hit = _SETS.get(id(values))
    if hit is not None and hit[0] is values and hit[1] == len(values):
        return hit[2]
    found = frozenset(values) if all(type(v) is str for v in values) else None
    if len(_SETS) > 64:
        _SETS.clear()
    _SETS[id(values)] = (values, len(values), found)
    return found


def decide(flt, doc: dict):
    """True or False when every condition of ``flt`` is one this module decides (module
    docstring), else UNDECIDED."""
    return compiled(flt)(doc)


def _never(doc):
    return UNDECIDED


def compiled(flt):
    """``decide`` for one filter, worked out once: a function of a document giving what
    :func:`decide` gives (a read tests one filter on each of its candidates)."""
    if type(flt) is not dict:
        return _never
    parts = []
    for field, cond in flt.items():
        if field == "$or" or field == "$and":
            if type(cond) is not list or not cond:
                return _never
            subs = [compiled(branch) for branch in cond]
            if _never in subs:
                return _never
            parts.append(_any(subs) if field == "$or" else _all(subs))
        elif field.startswith("$"):
            return _never
        else:
            test = _field_test(field, cond)
            if test is None:
                return _never
            parts.append(test)
    return _all(parts)


def _joined(tests, either: bool):
    """All of ``tests`` (``either`` False: ``$and``, a document's conditions) or any of them
    (``$or``), in mongomock's order and with its short cuts (``Filterer.apply`` returns False
    at the first condition not met; ``$or`` is ``any``, ``$and`` ``all``: they stop at the
    first branch that decides): UNDECIDED as soon as a test reached is (mongomock then decides
    the whole filter, reaching the same tests in the same order, with the same answers up to
    that one)."""
    if len(tests) == 1:
        return tests[0]

    if either:
        def check_any(doc):
            for test in tests:
                ok = test(doc)
                if ok is UNDECIDED:
                    return UNDECIDED
                if ok:
                    return True
            return False
        return check_any

    def check_all(doc):
        for test in tests:
            ok = test(doc)
            if ok is UNDECIDED:
                return UNDECIDED
            if not ok:
                return False
        return True
    return check_all


def _all(tests):
    return _joined(tests, False)


def _any(tests):
    return _joined(tests, True)


def _field_test(field: str, cond):
    """A function of a document for ``{field: cond}`` (the value reached through sub-documents
    only, the condition tested on it; the path split and the set made once), or None when no
    document's answer is decided here (the condition itself is not one this module knows)."""
    kind = type(cond)
    if kind is str or kind is bool:
        def decide(value):
            if value is None:
                return False
            return value == cond if type(value) is kind else UNDECIDED
    elif kind is not dict or not cond:
        return None
    elif len(cond) == 1 and "$in" in cond:
        values = cond["$in"]
        strings = _strings(values) if type(values) is list and values else None
        if strings is None:
            return None

        def decide(value):
            if value is None:
                return False
            return value in strings if type(value) is str else UNDECIDED
    elif all(op in _RANGE_OPS and type(bound) is ObjectId for op, bound in cond.items()):
        def decide(value):
            if type(value) is not ObjectId:
                return UNDECIDED
            return all(_RANGE_OPS[op](value, bound) for op, bound in cond.items())
    else:
        return None
    # The walk: each step a document (an array: undecided; anything else: missing), the
    # value reached neither an array nor a document (undecided).
    missing = UNDECIDED if kind is dict and "$in" not in cond else False  # a range: undecided
    parts = tuple(field.split("."))
    containers = (list, tuple, dict)
    def walk(doc):
        value = doc
        for part in parts:
            if not isinstance(value, dict):
                return UNDECIDED if isinstance(value, (list, tuple)) else missing
            value = value.get(part, _MISSING)
            if value is _MISSING:
                return missing
        if isinstance(value, containers):
            return UNDECIDED
        return decide(value)
    return walk


def filter_like_index_bounds() -> None:
    """Answer filters made only of exact conditions without mongomock's evaluator (module
    docstring); mongomock's ``filter_applies`` decides every other filter. A read's filter is
    worked out once (:func:`compiled`) for all its candidates: the one worked out last is kept
    until the next read starts (``Collection._iter_documents``), so a filter changed between
    two reads is worked out again."""
    from mongomock import collection, filtering, helpers

    original = filtering.filter_applies
    last: list = [None, _never]  # the filter object, its compiled test (a strong reference)

    def filter_applies(search_filter, document):
        if document:  # mongomock tests each filter on {} first: a syntax check, its own
            if last[0] is not search_filter:
                last[0], last[1] = search_filter, compiled(search_filter)
            answer = last[1](document)
            if answer is not UNDECIDED:
                return answer
        return original(search_filter, document)

    iter_documents = collection.Collection._iter_documents

    def _iter_documents(self, filter):
        last[0], last[1] = None, _never  # a new read: its filter is worked out again
        return iter_documents(self, filter)

    # mongomock walks every filter (and every written document) for datetimes to make naive
    # and round to milliseconds (helpers.patch_datetime_awareness_in_document), element by
    # element: 2,600 agent names in a tick's $in. A list of plain strings holds none; it is
    # copied as the walk copies it. (MongoDB parses a query's $in once, into a set.)
    patch_datetimes = helpers.patch_datetime_awareness_in_document

    def patch_datetime_awareness_in_document(value):
        if type(value) is list and all(type(v) is str for v in value):
            return list(value)
        return patch_datetimes(value)

    _patch(helpers, "patch_datetime_awareness_in_document", patch_datetime_awareness_in_document)
    _patch(filtering, "filter_applies", filter_applies)
    _patch(collection, "filter_applies", filter_applies)
    _patch(collection.Collection, "_iter_documents", _iter_documents)
