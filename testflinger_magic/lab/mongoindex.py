"""Make the mongomock stand-in serve reads as a MongoDB with the declared indexes does, for the
benchmarks: the same answers, found without testing every document of the collection.

mongomock has no indexes: every read (``find``, ``count_documents``, the filter of
``update_one``/``find_one_and_update``/``delete_one``) tests its whole filter on every document
of the collection (mongomock 4.x ``collection.Collection._iter_documents``:
``filter_applies`` on each of ``self._store.documents``), and evaluates ``$in`` by scanning the
value list for each document (``filtering._in_op``). A real MongoDB serves those reads from
indexes: the ``_id`` index, Testflinger's (``database.create_indexes``, TESTFLINGER.md §1.4)
and ours (:data:`testflinger_magic.indexes.INDEXES`), examining only the index entries that
match. A benchmark timing our code on plain mongomock would measure the stand-in's scans, which
grow with the collections whatever our queries ask (a quick lend's read of one queue's waiting
jobs tested all 3,904 jobs three times, benchmarks/reconcile_scale.py). Four emulations, each
installed by a function and undone by :func:`uninstall`:

* :func:`index_like_in`: ``{"$in": [...]}`` of hashable values as a set lookup (mongomock tests
  ``x in list`` per document: O(documents x values));
* :func:`index_like_id`: a filter on ``_id`` (a value or ``$in``) looks the ids up in
  mongomock's store, a dict keyed by ``_id``;
* :func:`index_like_fields`: a filter with a condition on the *first key* of a declared index
  (a value, ``$in`` of values; a range on ``_id``), alone or in every branch of an ``$or``,
  tests only the documents that condition admits (an index scan's candidates), found in a
  per-collection map ``{value: ids}`` built from mongomock's store on first use and kept up to
  date as MongoDB keeps an index: after each write (``_insert``, ``_update``, ``_delete``;
  ``drop`` empties it) the documents it inserted, updated or deleted are indexed again;
  candidates that are under a quarter of the collection are handed out in the store's order
  from a ``{key: position}`` map worked out again after a write, not by a walk of every key;
* :func:`ttl_like_mongodb`: documents of TTL indexes expire every 60 s, as MongoDB's TTL
  monitor removes them, not on every access of the collection.

A read constraining a prefix of a declared compound index (``jobs(result_data.job_state,
job_data.job_queue)``: a state and a queue) tests only the documents in bounds on every key
of that prefix (the intersection of the keys' maps), as MongoDB's index scan on the compound
bounds examines them.

Same answers, in the same order: the emulations only choose which documents mongomock tests,
never whether one matches (``filter_applies`` still decides, on every candidate). A candidate
set is always a superset of the matches: a path through or to arrays (a multikey path, e.g.
``vms.agent_name``) is indexed by every value found in the arrays' elements, as MongoDB's
multikey index is; a document whose indexed field is a sub-document, unhashable, an array
inside an array, or behind a numeric path part is a candidate for every value; conditions
that are not a plain value or ``$in`` of plain values (``None``, regexes, operators) use no
index (mongomock's scan). Checked against plain mongomock on random documents and filters
(tests/test_mongoindex.py).

What is left is what a real server also does per returned document (mongomock deep-copies
each one it returns, where a real MongoDB sends BSON the driver decodes in C), so the time of a
read that returns many documents is still the stand-in's, not a real server's.
"""

from __future__ import annotations

import bisect

from collections import defaultdict

#: What was replaced, to put back (:func:`uninstall`): ``(object, attribute, original)``.
_PATCHES: list[tuple[object, str, object]] = []
#: A path through a non-dict, or to a missing field: no index entry (equality to a plain value
#: never matches it).
_MISSING = object()
#: A path through an array, or to an array or sub-document: a candidate for every value.
_ANY = object()


def _patch(owner, name: str, value) -> None:
    _PATCHES.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def uninstall() -> None:
    """Undo every emulation installed, newest first (plain mongomock again)."""
    while _PATCHES:
        owner, name, original = _PATCHES.pop()
        setattr(owner, name, original)


def index_like_in() -> None:
    """Evaluate ``{"$in": [...]}`` with a set lookup instead of mongomock's scan of the whole
    list for every document (``mongomock.filtering._in_op``: it rebuilds a regex flag list and
    tests ``x in list`` per document, O(documents x values)). Same answers: hashable values
    without regexes only (anything else goes to mongomock's own code), and ``x in set`` is
    ``x in list`` for them."""
    from mongomock import filtering

    original = filtering._in_op
    cache: dict = {}  # id(list) -> (the list, its length, its values as a set or None)

    def in_op(doc_val, search_val):
        if not isinstance(search_val, (list, tuple)) or len(search_val) < 2:
            return original(doc_val, search_val)
        hit = cache.get(id(search_val))
        if hit is None or hit[0] is not search_val or hit[1] != len(search_val):
            try:
                values = frozenset(search_val)
            except TypeError:
                values = None
            if values is not None and any(isinstance(x, filtering._RE_TYPES) for x in values):
                values = None
            if len(cache) > 64:  # several lists in one query ($or branches); keep a few
                cache.clear()
            hit = cache[id(search_val)] = (search_val, len(search_val), values)
        values = hit[2]
        if values is None:
            return original(doc_val, search_val)
        if doc_val is filtering.NOTHING:
            return None in values
        try:
            return any(x in values for x in filtering._force_list(doc_val))
        except TypeError:  # an unhashable document value (a sub-document): compare as mongomock
            return original(doc_val, search_val)

    _patch(filtering, "_in_op", in_op)  # $nin calls it through the module
    _patch(filtering._filterer_inst, "_operator_map",
           {**filtering._filterer_inst._operator_map, "$in": in_op})


def index_like_id() -> None:
    """Find documents by ``_id`` (``{"_id": value}``, ``{"_id": {"$in": [...]}}``, with or
    without other conditions) by looking the value up in mongomock's store, a dict keyed by
    ``_id``, instead of testing the whole filter on every document of the collection. Same
    answers, in the same (store) order: the rest of the filter is still tested by mongomock,
    on the documents with those ids only."""
    from mongomock import collection, filtering

    original = collection.Collection._iter_documents

    def _iter_documents(self, filter):
        key = filter.get("_id", filtering.NOTHING) if isinstance(filter, dict) else filtering.NOTHING
        if isinstance(key, dict) and set(key) == {"$in"} and isinstance(key["$in"], (list, tuple)):
            try:
                ids = set(key["$in"])
            except TypeError:
                return original(self, filter)
            if self._store.is_empty or any(isinstance(x, filtering._RE_TYPES) for x in ids):
                return original(self, filter)
            return (d for d in list(self._store.documents)
                    if d.get("_id") in ids and filtering.filter_applies(filter, d))
        if key is filtering.NOTHING or isinstance(key, (dict, list, filtering._RE_TYPES)) \
                or self._store.is_empty:
            return original(self, filter)
        try:
            doc = self._store[key]
        except (KeyError, TypeError):
            return iter(())
        return iter([doc] if filtering.filter_applies(filter, doc) else [])

    _patch(collection.Collection, "_iter_documents", _iter_documents)


def ttl_like_mongodb(interval: float = 60.0, clock=None) -> None:
    """Expire documents of TTL indexes at most every ``interval`` seconds per collection, as
    MongoDB's TTL monitor does (a background task every ``ttlMonitorSleepSecs``, 60 s by
    default: "Expiration of data" in MongoDB's TTL index documentation; a document may outlive
    its expiry by up to that), instead of mongomock's check of every document of the
    collection on each access of it (``store.CollectionStore._remove_expired_documents``,
    called by every read and ``len``): a write to ``magic_events``, whose ``expire_at`` is a TTL
    index, tested every event each time. ``clock``: monotonic seconds (tests may pass their
    own)."""
    import time

    from mongomock import store as mstore

    clock = clock or time.monotonic
    original = mstore.CollectionStore._remove_expired_documents
    last: dict[int, tuple[object, float]] = {}  # id(store) -> (store, when it last expired)

    def remove_expired(self):
        now = clock()
        seen = last.get(id(self))
        if seen is not None and seen[0] is self and now - seen[1] < interval:
            return
        last[id(self)] = (self, now)
        original(self)

    _patch(mstore.CollectionStore, "_remove_expired_documents", remove_expired)


def declared_first_keys() -> dict[str, frozenset[str]]:
    """``{collection: first keys}`` of the indexes a read can be served by: every index of
    :data:`testflinger_magic.indexes.INDEXES` (ours and Testflinger's), whose first key serves
    an equality or ``$in`` on it (a compound index's prefix), plus ``_id`` everywhere (MongoDB's
    own, handled separately)."""
    from testflinger_magic.indexes import INDEXES

    out: dict[str, set[str]] = defaultdict(set)
    for ix in INDEXES:
        out[ix.collection].add(ix.keys[0][0])
    return {name: frozenset(keys) for name, keys in out.items()}


def _path_value(doc: dict, parts: list[str]):
    """The value at a dotted path, ``_MISSING`` or ``_ANY`` (module docstring)."""
    value = doc
    for part in parts:
        if isinstance(value, list):
            return _ANY
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return _ANY if isinstance(value, (list, dict)) else value


def _plain(value, filtering) -> bool:
    """A value an index entry can be looked up by: hashable, not None, not a regex, not a
    sub-document or array (those compare by mongomock's own rules)."""
    if value is None or isinstance(value, (dict, list, tuple, set, filtering._RE_TYPES)):
        return False
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _store_key(doc_id):
    """The key mongomock's store keeps a document under (a sub-document ``_id`` as its
    ``helpers.hashdict``, collection.py ``_insert``)."""
    from mongomock import helpers

    return helpers.hashdict(doc_id) if isinstance(doc_id, dict) else doc_id


#: Range operators, as Python comparisons.
_RANGE = {"$gt": lambda a, b: a > b, "$gte": lambda a, b: a >= b,
          "$lt": lambda a, b: a < b, "$lte": lambda a, b: a <= b}


class _Many(frozenset):
    """A multikey entry: the values an array on a document's path holds at the path's end."""


def _multikey(doc: dict, parts: list[str]):
    """A multikey index's entries for a path through (or to) arrays, as MongoDB's multikey
    index keys each element (MongoDB's "Multikey Indexes" documentation): the values found by
    following ``parts`` into every element of every array met, as a :class:`_Many`; or
    ``_ANY`` (a candidate for every value) where that might not hold every value a plain
    query matches: a numeric part (``vms.0.name``: an array position or a field), an array
    inside an array, a sub-document or an unhashable value at the end. A query on a list or
    a sub-document uses no index here (:func:`_plain`), so an array's own value needs no
    entry."""
    if any(part.isdigit() for part in parts):
        return _ANY
    found: set = set()
    todo = [(doc, 0)]
    while todo:
        value, at = todo.pop()
        if isinstance(value, list):
            for item in value:
                if isinstance(item, list):
                    return _ANY
                todo.append((item, at))
        elif at == len(parts):
            if isinstance(value, dict):
                return _ANY
            try:
                found.add(value)
            except TypeError:  # an unhashable value
                return _ANY
        elif isinstance(value, dict) and parts[at] in value:
            todo.append((value[parts[at]], at + 1))
    return _Many(found)


class _Index:
    """One collection's ``{value: keys}`` maps by field (store keys: ``_id``): built from
    mongomock's store for ``fields`` (and any other field on its first look-up), then kept up to
    date as MongoDB keeps an index: the documents a write inserted, updated or deleted are
    looked at again (:meth:`touch`) after it."""

    def __init__(self, store, fields=()):
        self.store = store  # the mongomock CollectionStore it indexes
        #: field -> (value -> keys, keys of documents that match any value, key -> entry)
        self._maps: dict[str, tuple[dict, set, dict]] = {}
        #: The store's keys in order when every one is an ObjectId (the _id index: a range
        #: of "jobs inserted since" is a bisection, not a test of every key), and them as a
        #: set; None: not worked out since a write added or removed a key.
        self._ids: list | None = None
        self._id_set: set = set()
        #: ``{store key: position}`` in the store's order (mongomock's natural order), so a
        #: read whose index candidates are a few of many documents hands them out in that
        #: order without walking the whole store; None: not worked out since a write.
        self._order: dict | None = None
        for field in fields:  # built now, then kept by the writes, as MongoDB's are
            self._build(field)

    def _build(self, field: str) -> tuple[dict, set, dict]:
        maps = self._maps[field] = ({}, set(), {})
        parts = field.split(".")
        for key, doc in list(self.store._documents.items()):  # under the database lock
            self._add(maps, parts, key, doc)
        return maps

    def clear(self) -> None:
        """Empty every map (the collection was dropped)."""
        self._ids = self._order = None
        for field in list(self._maps):
            self._build(field)

    @staticmethod
    def _entry(doc: dict, parts: list[str]):
        value = _path_value(doc, parts)
        if value is _ANY:
            return _multikey(doc, parts)
        if value is _MISSING:
            return value
        try:
            hash(value)
        except TypeError:
            return _ANY
        return value

    def _add(self, maps, parts, key, doc) -> None:
        by_value, anywhere, of = maps
        entry = self._entry(doc, parts)
        of[key] = entry
        if entry is _ANY:
            anywhere.add(key)
        elif type(entry) is _Many:
            for value in entry:
                by_value.setdefault(value, set()).add(key)
        elif entry is not _MISSING:
            by_value.setdefault(entry, set()).add(key)

    def ids_in(self, cond: dict) -> set | None:
        """The store keys in the range ``cond`` (``$gt``, ``$gte``, ``$lt``, ``$lte``, every bound
        an ObjectId) when every key is an ObjectId, by bisection of the sorted keys (MongoDB's
        IXSCAN of the ``_id`` index); None otherwise (the caller tests each key)."""
        from bson import ObjectId

        if not all(type(b) is ObjectId for b in cond.values()):
            return None
        ids = self._ids
        if ids is None:
            keys = list(self.store._documents)
            if not all(type(k) is ObjectId for k in keys):
                return None
            ids = self._ids = sorted(keys)
            self._id_set = set(keys)
        lo, hi = 0, len(ids)
        for op, bound in cond.items():
            if op == "$gte":
                lo = max(lo, bisect.bisect_left(ids, bound))
            elif op == "$gt":
                lo = max(lo, bisect.bisect_right(ids, bound))
            elif op == "$lte":
                hi = min(hi, bisect.bisect_right(ids, bound))
            else:  # $lt
                hi = min(hi, bisect.bisect_left(ids, bound))
        return set(ids[lo:hi]) if lo < hi else set()

    def in_order(self, found: set) -> list | None:
        """``found`` (store keys) in the store's order, or None if one of them is not stored."""
        order = self._order
        if order is None:
            order = self._order = {k: i for i, k in enumerate(self.store._documents)}
        if not all(k in order for k in found):
            return None
        return sorted(found, key=order.__getitem__)

    def touch(self, keys) -> None:
        """Index again the documents stored under ``keys`` (gone ones are dropped)."""
        self._order = None  # a write may add, remove or (mongomock's own way) move keys
        docs = self.store._documents
        if self._ids is not None and any((k in docs) != (k in self._id_set) for k in keys):
            self._ids = None  # a key added or removed: sorted again at the next range
        for field, maps in self._maps.items():
            by_value, anywhere, of = maps
            parts = field.split(".")
            for key in keys:
                old = of.pop(key, _MISSING)
                if old is _ANY:
                    anywhere.discard(key)
                elif type(old) is _Many:
                    for value in old:
                        by_value.get(value, set()).discard(key)
                elif old is not _MISSING:
                    by_value.get(old, set()).discard(key)
                doc = docs.get(key)
                if doc is not None:
                    self._add(maps, parts, key, doc)

    def within(self, field: str, cond: dict) -> set:
        """Store keys of the documents whose ``field`` may be in the range ``cond`` (``$gt``,
        ``$gte``, ``$lt``, ``$lte`` of plain values): every indexed value in it, every value
        that does not compare with the bounds, and with two bounds or more every array (each
        may be met by another element): mongomock decides those."""
        maps = self._maps.get(field) or self._build(field)
        by_value, anywhere, of = maps
        out = set(anywhere)
        if len(cond) > 1:  # on an array, each bound may be met by a different element
            out.update(k for k, entry in of.items() if type(entry) is _Many)
        for value, found in by_value.items():
            try:
                inside = all(_RANGE[op](value, bound) for op, bound in cond.items())
            except TypeError:
                inside = True
            if inside:
                out |= found
        return out

    def lookup(self, field: str, values: list) -> set:
        """Store keys of the documents whose ``field`` may equal one of ``values``."""
        maps = self._maps.get(field) or self._build(field)
        by_value, anywhere, _ = maps
        out = set(anywhere)
        get = by_value.get
        for v in values:  # a read's $in names thousands: no empty set made per miss
            found = get(v)
            if found:
                out |= found
        return out


def declared_compound_keys() -> dict[str, list[tuple[str, ...]]]:
    """``{collection: [key names of each index with two keys or more]}`` of
    :data:`testflinger_magic.indexes.INDEXES`: a read constraining a prefix of one of them is
    served by that index's bounds on the whole prefix (an IXSCAN of ``(state, queue)`` for a
    state *and* a queue examines the jobs with both, not every job in that state)."""
    from testflinger_magic.indexes import INDEXES

    out: dict[str, list[tuple[str, ...]]] = defaultdict(list)
    for ix in INDEXES:
        if len(ix.keys) > 1:
            out[ix.collection].append(tuple(k for k, _ in ix.keys))
    return dict(out)


def index_like_fields(first_keys: dict[str, frozenset[str]] | None = None,
                      compound: dict[str, list[tuple[str, ...]]] | None = None) -> None:
    """Serve reads whose filter (or each branch of its ``$or``) has a condition on the first key
    of a declared index (``first_keys``, default :func:`declared_first_keys`) by testing only
    the documents that condition admits (module docstring). Install after
    :func:`index_like_id`: a filter on ``_id`` by value or ``$in`` still goes there."""
    from mongomock import collection, filtering

    keys = declared_first_keys() if first_keys is None else first_keys
    compound = (declared_compound_keys() if first_keys is None else {}) if compound is None \
        else compound
    previous = collection.Collection._iter_documents
    indexes: dict[int, _Index] = {}  # id(store) -> its index

    def index_of(store) -> _Index:
        # The maps of every declared first key of the collection exist from its first use
        # on (a real MongoDB has its indexes before the reads: no read pays for a build).
        ix = indexes.get(id(store))
        if ix is None or ix.store is not store:  # a new store that reuses a freed one's id
            fields = set(keys.get(store.name, ()))
            fields.update(k for names in compound.get(store.name, ()) for k in names)
            fields.discard("_id")
            ix = indexes[id(store)] = _Index(store, sorted(fields))
        return ix

    def field_candidates(coll, store, field: str, cond, later: bool = False) -> set | None:
        if field == "_id":
            return id_range(store, cond)
        if not later and field not in keys.get(coll.name, ()):
            return None
        if isinstance(cond, dict):
            if later and cond and set(cond) <= set(_RANGE) \
                    and all(_plain(v, filtering) for v in cond.values()):
                return index_of(store).within(field, cond)  # a range on a later key
            if set(cond) != {"$in"} or not isinstance(cond["$in"], (list, tuple)):
                return None
            values = list(cond["$in"])
        else:
            values = [cond]
        if not all(_plain(v, filtering) for v in values):
            return None
        return index_of(store).lookup(field, values)

    def id_range(store, cond) -> set | None:
        # The _id index's range scan ({"$gte": ObjectId}: jobs inserted since a time).
        ops = {"$gt": lambda a, b: a > b, "$gte": lambda a, b: a >= b,
               "$lt": lambda a, b: a < b, "$lte": lambda a, b: a <= b}
        if not isinstance(cond, dict) or not cond or not set(cond) <= set(ops) \
                or not all(_plain(v, filtering) for v in cond.values()):
            return None
        found = index_of(store).ids_in(cond)
        if found is not None:
            return found
        try:
            return {k for k in store._documents
                    if all(ops[op](k, v) for op, v in cond.items())}
        except TypeError:  # ids of mixed types: compare as mongomock does
            return None

    def candidates(coll, store, flt) -> set | None:
        if not isinstance(flt, dict):
            return None
        best = None
        for field, cond in flt.items():
            if field in ("$or", "$and"):
                if not isinstance(cond, list) or not cond:
                    continue
                parts = [candidates(coll, store, branch) for branch in cond]
                if field == "$or":
                    found = None if any(p is None for p in parts) else set().union(*parts)
                else:
                    known = [p for p in parts if p is not None]
                    found = min(known, key=len) if known else None
            elif field.startswith("$"):
                continue
            else:
                found = field_candidates(coll, store, field, cond)
                if found is not None:
                    found = narrowed(coll, store, flt, field, found)
            if found is not None and (best is None or len(found) < len(best)):
                best = found
        return best

    def narrowed(coll, store, flt: dict, first: str, found: set) -> set:
        # A compound index whose first key is ``first``: each next key the filter also
        # constrains (a plain value, $in, or a range) narrows the candidates to the documents
        # in bounds on it too, up to the first key it does not constrain (the index prefix).
        for names in compound.get(coll.name, ()):
            if names[0] != first:
                continue
            for name in names[1:]:
                if name not in flt or name == "_id":
                    break
                more = field_candidates(coll, store, name, flt[name], later=True)
                if more is None:
                    break
                found = found & more
        return found

    def _iter_documents(self, filter):
        store = self._store
        key = filter.get("_id", filtering.NOTHING) if isinstance(filter, dict) else filtering.NOTHING
        by_id = (key is not filtering.NOTHING and not isinstance(key, dict)) or \
            (isinstance(key, dict) and set(key) == {"$in"})
        found = None if by_id or store.is_empty else candidates(self, store, filter)
        ordered = None
        if found is not None and 4 * len(found) < len(store._documents):
            # A few of many: in the store's order without a walk of every key (MongoDB's
            # index scan touches only its bounds).
            ordered = index_of(store).in_order(found)
        if found is None:  # index_like_id's (or mongomock's) way
            docs = previous(self, filter)
        elif ordered is not None:
            stored = store._documents
            docs = (doc for doc in [stored[k] for k in ordered]
                    if filtering.filter_applies(filter, doc))
        else:
            docs = (doc for k, doc in list(store._documents.items())
                    if k in found and filtering.filter_applies(filter, doc))
        seen = _writing.get(id(store))
        if seen is None:
            return docs
        return _recording(docs, seen)  # a write's documents: indexed again after it

    def writer(name):
        original = getattr(collection.Collection, name)

        def write(self, *args, **kwargs):
            store = self._store
            if name == "drop":
                try:
                    return original(self, *args, **kwargs)
                finally:
                    index_of(store).clear()
            outer = _writing.get(id(store))
            seen = _writing[id(store)] = set() if outer is None else outer
            try:
                result = original(self, *args, **kwargs)
                if name == "_insert" and args and isinstance(args[0], dict):
                    seen.add(_store_key(args[0].get("_id")))
                return result
            finally:
                if outer is None:
                    del _writing[id(store)]
                    index_of(store).touch(seen)

        return write

    _patch(collection.Collection, "_iter_documents", _iter_documents)
    for name in ("_insert", "_update", "_delete", "drop"):
        _patch(collection.Collection, name, writer(name))


#: ``{id(store): store keys}`` of the writes in progress (the database lock serialises them).
_writing: dict[int, set] = {}


def _recording(docs, seen: set):
    for doc in docs:
        seen.add(_store_key(doc.get("_id")))
        yield doc
