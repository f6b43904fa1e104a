"""Make the mongomock stand-in hand out the documents a read returns at a driver's cost per
document, for the benchmarks: the same documents, built without mongomock's per-document
overheads that no MongoDB and pymongo pay.

What a read costs per returned document, on each side:

* **MongoDB + pymongo**: the server parses the query's projection once per query (its
  projection AST, built when the query is planned), serialises each document's projected fields
  to BSON, and pymongo decodes each BSON document into new dicts and lists in C
  (``bson._cbson``; ``bson.decode``). A cursor hands them out one by one from its batch.
* **mongomock 4.x** (``collection.Collection._copy_only_fields``): re-parses the projection for
  every document (``_combine_projection_spec``), copies every leaf value with ``copy.copy``
  (``_copy_field``: a ``datetime`` is rebuilt through ``__reduce_ex__``), and its cursor slices
  the whole result list again at every ``next`` (``Cursor.__next__`` ->
  ``_compute_results(with_limit_and_skip=True)``: ``self._results[self._skip:]``), which makes
  reading n documents O(n^2): ~20 ms of the 2,600 agents a reconcile tick reads at 1,000
  devices (benchmarks/reconcile_scale.py).

Two emulations, each installed by a function and undone by
:func:`testflinger_magic.lab.mongoindex.uninstall` (the same patch list):

* :func:`copy_like_driver`: a projection is worked out once per read (by the identity of the
  read's projection dict), and a returned document is a fresh copy of its dicts and lists
  whose immutable leaves (``str``,
  ``int``, ``float``, ``bool``, ``None``, ``datetime``, ``bytes``, ``ObjectId``, tuples) are
  shared, as equal immutable values; any other leaf type is copied as mongomock does. Also
  what a ``$slice`` or ``$elemMatch`` of an inclusion projection returns is a copy: mongomock
  hands out the stored array or its stored elements there
  (``Collection._apply_projection_operators``), so changing the result changed the database.
  With :func:`testflinger_magic.lab.mongosort.sort_natively` installed too, whose
  ``_get_dataset`` serves every read, a read's projection is looked up once for all its
  documents (:data:`COPIER`), not once per document;
* :func:`cursor_like_driver`: ``next`` hands out the next document of the computed results by
  position (skip + emitted, bounded by the limit) instead of re-slicing the list.

Same documents, in the same order: a returned document is still independent of the store and
of every other read (changing it changes nothing stored), projections give mongomock's fields,
and skip, limit, sort, ``rewind`` and ``clone`` behave as mongomock's. Checked against plain
mongomock on random documents, projections and cursor bounds (tests/test_mongocopy.py).

What is left per returned document is mongomock's filter test of each candidate
(``filtering.filter_applies``; :mod:`.mongoindex` picks the candidates) and the copy itself,
still several times pymongo's C decoding of the same document (the benchmark prints both).
"""

from __future__ import annotations

import copy
import datetime
import sys

from .mongoindex import _patch

#: Leaf types whose values are immutable: a copy may share them (exact types: a subclass, e.g.
#: ``bson.Int64`` or ``bson.Binary``, is copied as mongomock copies it).
_IMMUTABLE = frozenset({str, int, float, bool, type(None), bytes, tuple, datetime.datetime})
#: While :func:`copy_like_driver` is installed: ``COPIER(collection, projection, container)``
#: -> a function copying one document of a read, or None (copy each with
#: ``_copy_only_fields``). Read by lab/mongosort.py's ``_get_dataset``.
COPIER = None
#: Projections worked out, by the identity of their dict; cleared past this many (a benchmark
#: uses a few dozen).
_PLANS_MAX = 256


def copy_like_driver() -> None:
    """Parse each projection once and share immutable leaves in returned documents (module
    docstring). Same documents as mongomock's ``_copy_only_fields``."""
    from bson import ObjectId
    from mongomock import collection

    immutable = _IMMUTABLE | {ObjectId}
    copy_field = collection._copy_field

    def _copy_field(obj, container):
        # An immutable element or value is tested inline, not by a call per leaf: most of
        # what a read returns is strings, numbers and datetimes.
        kind = type(obj)
        if kind in immutable:
            return obj
        if kind is list:
            return [item if type(item) in immutable else _copy_field(item, container)
                    for item in obj]
        if kind is dict:
            new = container()
            for key, value in obj.items():
                new[key] = value if type(value) in immutable else _copy_field(value, container)
            return new
        return copy_field(obj, container)  # a subclass or another type: mongomock's copy

    operators = collection.Collection._apply_projection_operators

    def _apply_projection_operators(self, ops, doc, doc_copy):
        # mongomock puts the *stored* array (or its stored elements) into an inclusion
        # projection's result for $slice / $elemMatch; a driver's document is decoded afresh.
        operators(self, ops, doc, doc_copy)
        for field in ops:
            if field in doc_copy:
                doc_copy[field] = _copy_field(doc_copy[field], type(doc_copy))

    copy_only_fields = collection.Collection._copy_only_fields
    plans: dict = {}

    def plan_of(fields):
        # mongomock's _copy_only_fields works out, for every document, what its projection
        # means (the _id rule, the $slice/$elemMatch operators, include or exclude, the
        # parsed spec); done once per projection here, in the same steps. None: a projection
        # mongomock refuses (it raises on every document: left to it).
        # By identity (a read passes one dict for all its documents), checked against a copy
        # of its contents (a caller may change a dict it reuses between reads).
        hit = plans.get(id(fields))
        if hit is not None and hit[0] is fields and hit[1] == fields:
            return hit[2]
        plain = dict(fields)
        id_value = plain.pop("_id", 1)
        ops = {k: v for k, v in plain.items() if isinstance(v, dict)}
        if any(op not in ("$elemMatch", "$slice") for v in ops.values() for op in v):
            plan = None
        else:
            for k in ops:
                del plain[k]
            if len(set(plain.values())) > 1:
                plan = None
            elif not plain:
                plan = (id_value, ops, None, None, None)
            else:
                try:
                    spec = collection._combine_projection_spec(plain)
                except Exception:  # noqa: BLE001 - path collisions: mongomock raises
                    plan = None
                else:
                    # _project_by_spec's walk, worked out once: a key test per field of
                    # the document (in its order), one comprehension per level.
                    is_include = list(plain.values())[0]
                    flat = _projector(spec, bool(is_include), _copy_field, immutable) \
                        if not _positional(spec) else None
                    plan = (id_value, ops, spec, is_include, flat)
        if len(plans) >= _PLANS_MAX:
            plans.clear()
        plans[id(fields)] = (fields, copy.deepcopy(fields), plan)
        return plan

    def _copy_only_fields_planned(self, doc, fields, container):
        if fields is None or not fields:  # pymongo 4: an empty projection is the whole doc
            return copy_only_fields(self, doc, fields, container)
        plan = plan_of(fields) if isinstance(fields, dict) else None
        if plan is None:
            return copy_only_fields(self, doc, fields, container)
        id_value, ops, spec, is_include, flat = plan
        if spec is None:
            doc_copy = container() if id_value == 1 else _copy_field(doc, container)
        elif flat is not None and container is dict:
            doc_copy = flat(doc)
        else:
            doc_copy = collection._project_by_spec(doc, spec, is_include, container)
        if id_value == 0:
            doc_copy.pop("_id", None)
        elif "_id" in doc:
            doc_copy["_id"] = doc["_id"]
        if ops:
            self._apply_projection_operators(ops, doc, doc_copy)
        return doc_copy

    def copier(self, fields, container):
        # What _copy_only_fields_planned does per document, worked out once for a whole read
        # (lab/mongosort.py's _get_dataset asks): the common case only (an inclusion or
        # exclusion projection without operators, into dicts); None: copy each document
        # with _copy_only_fields.
        if not fields or not isinstance(fields, dict) or container is not dict:
            return None
        plan = plan_of(fields)
        if plan is None:
            return None
        id_value, ops, spec, _, flat = plan
        if spec is None or flat is None or ops:
            return None
        if id_value == 0:
            def one(doc):
                out = flat(doc)
                out.pop("_id", None)
                return out
        else:
            def one(doc):
                out = flat(doc)
                if "_id" in doc:
                    out["_id"] = doc["_id"]
                return out
        return one

    _patch(collection, "_copy_field", _copy_field)
    _patch(collection.Collection, "_apply_projection_operators", _apply_projection_operators)
    _patch(collection.Collection, "_copy_only_fields", _copy_only_fields_planned)
    _patch(sys.modules[__name__], "COPIER", copier)


def _positional(spec) -> bool:
    """Whether a combined projection spec has a ``$`` (positional) key at any level:
    mongomock's ``_project_by_spec`` raises on it, when it reaches it (left to it)."""
    return "$" in spec or any(_positional(v) for v in spec.values() if isinstance(v, dict))


def _projector(spec, is_include: bool, copy_field, immutable: frozenset = frozenset()):
    """mongomock's ``_project_by_spec(doc, spec, is_include, dict)`` for one combined spec
    (``collection._combine_projection_spec``), as a function of the document: the spec's
    leaves as a set and its sub-specs as projectors, worked out once. The same walk in the
    document's key order: a leaf key (include) or a key outside the spec (exclude) is copied
    (``copy_field``: :func:`copy_like_driver`'s ``_copy_field``; a value of a type in
    ``immutable`` is kept as it is without calling it); a key with a sub-spec keeps
    a sub-document projected, a list or tuple as a list of its elements projected (an element
    that is not a document raises ``AttributeError``, as mongomock's ``doc.items()`` does), and
    any other value is left out."""
    leaves = frozenset(k for k, v in spec.items() if not isinstance(v, dict))
    subs = {k: _projector(v, is_include, copy_field, immutable)
            for k, v in spec.items() if isinstance(v, dict)}

    def nested(key, value, out):
        sub = subs[key]
        if isinstance(value, (list, tuple)):
            out[key] = [sub(item) for item in value]
        elif isinstance(value, dict):
            out[key] = sub(value)

    if not subs:
        if is_include:
            return lambda doc: {k: v if type(v) in immutable else copy_field(v, dict)
                                for k, v in doc.items() if k in leaves}
        return lambda doc: {k: v if type(v) in immutable else copy_field(v, dict)
                            for k, v in doc.items() if k not in leaves}

    def project(doc):
        out = {}
        for key, value in doc.items():
            if key in subs:
                nested(key, value, out)
            elif (key in leaves) is is_include:
                out[key] = value if type(value) in immutable else copy_field(value, dict)
        return out
    return project


def cursor_like_driver() -> None:
    """Hand out a cursor's documents by position instead of re-slicing its results at every
    ``next`` (module docstring). Same documents, skip and limit as mongomock's cursor."""
    from mongomock import collection

    def __next__(self):
        results = self._compute_results(with_limit_and_skip=False)
        limit = abs(self._limit) if self._limit else None
        at = self._skip + self._emitted
        if at >= len(results) or (limit is not None and self._emitted >= limit):
            raise StopIteration()
        self._emitted += 1
        return results[at]

    _patch(collection.Cursor, "__next__", __next__)
    _patch(collection.Cursor, "next", __next__)
